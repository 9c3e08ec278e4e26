"""Lesson 02: activation checkpointing.

In training, autograd keeps the intermediate tensors of the forward (the activations) until the
backward needs them. FSDP shards parameters, gradients and optimizer state, but never activations:
with a large batch or long sequences they become the biggest item. Activation checkpointing keeps
only each checkpointed block's input and recomputes the block's inside during backward: less memory,
one extra forward per checkpointed block.

This script trains the same model, on the same data, five ways, and measures for each the peak
activation memory, the total peak, the step time and the losses (which must not change):

    fsdp2-none        FSDP2, no checkpointing
    fsdp2-selective   FSDP2, every --every-th block checkpointed (default every 2nd)
    fsdp2-all         FSDP2, every block checkpointed
    fsdp1-none        FSDP1, no checkpointing
    fsdp1-all         FSDP1, every block checkpointed

FSDP2: checkpoint_wrapper(block) *before* fully_shard. FSDP1: apply_activation_checkpointing(...)
*after* FullyShardedDataParallel(...). Both use CheckpointImpl.NO_REENTRANT.

Run: fsdp-course run 02 [--quick]   or   torchrun --nproc-per-node 2 activation_checkpointing.py --device cpu
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without install

from torch.distributed.fsdp import fully_shard  # noqa: E402

from utilities.checkpointing import apply_activation_checkpointing, block_units  # noqa: E402
from utilities.lesson import Lesson, lesson_parser, positive_int  # noqa: E402
from utilities.measure import fmt_bytes  # noqa: E402
from utilities.wrapping import shard_model  # noqa: E402

VARIANTS = {
    # name: (api, which blocks: "none" | "every" | "all")
    "fsdp2-none": ("fsdp2", "none"),
    "fsdp2-selective": ("fsdp2", "every"),
    "fsdp2-all": ("fsdp2", "all"),
    "fsdp1-none": ("fsdp1", "none"),
    "fsdp1-all": ("fsdp1", "all"),
}


def parse_args(argv=None):
    p = lesson_parser(__doc__)
    p.add_variants(VARIANTS)
    p.add_argument("--every", type=positive_int, default=2,
                   help="selective variant: checkpoint every N-th block (1 = all; default 2)")
    return p.parse(argv)




def build(L, api: str, every: int | None):
    """The model sharded with ``api``, with every ``every``-th block checkpointed (None: none)."""
    block = L.spec.block_class()
    model = L.build_model()
    if api == "fsdp2":
        n = apply_activation_checkpointing(model, block, every=every, api="fsdp2") if every else 0
        for unit in block_units(model, block):  # the CheckpointWrapper where a block has one
            fully_shard(unit)
        fully_shard(model)
    else:
        model = shard_model(model, api="fsdp1", block_class=block, policy="block", device=L.device)
        n = apply_activation_checkpointing(model, block, every=every, api="fsdp1") if every else 0
    return L.materialize(model), n


def main(args) -> None:
    with Lesson("02", "activation checkpointing", args, gpu_model="t5-large", gpu_batch_size=8,
                steps=10, quick_steps=4, batch_size=8, settings={"every": args.every}) as L:
        block = L.spec.block_class()
        L.print(f"block class: {block.__name__}; selective = every {args.every} block(s)")
        for name in args.variants:
            api, which = VARIANTS[name]
            every = {"none": None, "every": args.every, "all": 1}[which]
            model, n = build(L, api, every)
            stats = L.train(model, name)
            mem = stats.peak_memory_bytes
            L.results.add(name, stats, api=api, checkpointed_blocks=n)
            L.print(f"    {n} checkpointed blocks, activations {fmt_bytes(mem.get('activations'))}, "
                    f"peak {fmt_bytes(mem.get('total'))}")
            del model

        L.results.note("activations: peak bytes the tracker attributes to activations; a "
                       "checkpointed block keeps only its input and recomputes the rest in backward.")
        if L.device.type == "cpu":
            L.results.note("CPU run: memory from torch.distributed._tools trackers; step times on "
                           "CPU are only indicative (the recompute costs about one extra forward).")


if __name__ == "__main__":
    main(parse_args())
