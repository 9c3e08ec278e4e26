"""Lesson 02: activation checkpointing.

In training, autograd keeps the intermediate tensors of the forward (the activations) until the
backward needs them. FSDP shards parameters, gradients and optimizer state, but never activations:
with a large batch or long sequences they become the biggest item. Activation checkpointing keeps
only each checkpointed block's input and recomputes the block's inside during backward: less memory,
one extra forward per checkpointed block.

This script trains the same model, on the same data, six ways, and measures for each the peak
activation memory, the total peak, the step time and the losses (which must not change):

    fsdp2-none        FSDP2, no checkpointing
    fsdp2-selective   FSDP2, every --every-th block checkpointed (default every 2nd)
    fsdp2-all         FSDP2, every block checkpointed
    fsdp1-none        FSDP1, no checkpointing
    fsdp1-selective   FSDP1, every --every-th block checkpointed
    fsdp1-all         FSDP1, every block checkpointed

Then (--search on, the default) it finds the largest batch per rank that fits with FSDP2 and no /
every block checkpointed: on a GPU, without cudaMalloc retries or OOM; on CPU, within a memory
budget (--budget-mib, default 1.25 x the peak of fsdp2-none at --batch-size).

FSDP2: checkpoint_wrapper(block) *before* fully_shard. FSDP1: apply_activation_checkpointing(...)
*after* FullyShardedDataParallel(...). Both use CheckpointImpl.NO_REENTRANT.

Run: fsdp-course run 02 [--quick]   or   torchrun --nproc-per-node 2 activation_checkpointing.py --device cpu
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without install

from torch.distributed.fsdp import fully_shard

from utilities.activation_checkpointing import apply_activation_checkpointing, block_units
from utilities.course.lesson import Lesson, lesson_parser, positive_float, positive_int
from utilities.measure import fmt_bytes
from utilities.measure.batch_search import all_ranks_agree, find_max_batch, training_trial
from utilities.wrapping import shard_model

VARIANTS = {
    # name: (api, which blocks: "none" | "every" | "all")
    "fsdp2-none": ("fsdp2", "none"),
    "fsdp2-selective": ("fsdp2", "every"),
    "fsdp2-all": ("fsdp2", "all"),
    "fsdp1-none": ("fsdp1", "none"),
    "fsdp1-selective": ("fsdp1", "every"),
    "fsdp1-all": ("fsdp1", "all"),
}


def parse_args(argv=None):
    p = lesson_parser(__doc__)
    p.add_variants(VARIANTS)
    p.add_argument("--every", type=positive_int, default=2,
                   help="selective variant: checkpoint every N-th block (1 = all; default 2)")
    p.add_argument("--search", choices=("on", "off"), default="on",
                   help="after the variants, find the largest batch per rank that fits with FSDP2 "
                        "and no / all blocks checkpointed (default on)")
    p.add_argument("--search-limit", type=positive_int, default=None,
                   help="largest batch the search tries (default 256 on GPU, 64 on CPU)")
    p.add_argument("--budget-mib", type=positive_float, default=None,
                   help="memory per rank a batch must fit in, in MiB (default: on GPU none, the "
                        "search stops at cudaMalloc retries or OOM; on CPU 1.25 x the peak of "
                        "fsdp2-none at --batch-size)")
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
    with Lesson("02", args, settings={"every": args.every}) as L:
        block = L.spec.block_class()
        L.print(f"block class: {block.__name__}; selective = every {args.every} block(s)")
        peaks: dict[str, int | None] = {}
        for name in args.variants:
            with L.variant(name):  # everything the variant made is freed before the next one
                api, which = VARIANTS[name]
                every = {"none": None, "every": args.every, "all": 1}[which]
                model, n = build(L, api, every)
                stats = L.train(model, name)
                mem = stats.peak_memory_bytes
                peaks[name] = mem.get("total")
                L.results.add(name, stats, api=api, checkpointed_blocks=n)
                L.print(f"    {n} checkpointed blocks, activations {fmt_bytes(mem.get('activations'))}, "
                        f"peak {fmt_bytes(mem.get('total'))}")
                del model

        if args.search == "on":
            search_largest_batch(L, args, peaks.get("fsdp2-none"))

        L.results.note("activations: peak bytes the tracker attributes to activations; a "
                       "checkpointed block keeps only its input and recomputes the rest in backward.")
        if L.device.type == "cpu":
            L.results.note("CPU run: memory from torch.distributed._tools trackers; step times on "
                           "CPU are only indicative (the recompute costs about one extra forward).")


def search_largest_batch(L, args, none_peak: int | None) -> None:
    """The largest clean batch per rank with FSDP2 and no / every block checkpointed (lesson 05's
    search). On GPU a trial fails on cudaMalloc retries or OOM; on CPU, where nothing retries, on
    going over a memory budget (the tracked peak)."""
    on_gpu = L.device.type == "cuda"
    limit = args.search_limit or (256 if on_gpu else 64)
    budget = int(args.budget_mib * 2**20) if args.budget_mib else None
    if budget is None and not on_gpu:
        if none_peak is None:  # fsdp2-none was not among the variants: measure it here
            none_peak = training_trial(L.batch_size, lambda: build(L, "fsdp2", None)[0], L.optimizer,
                                       L.data(), 2, L.device)[0].peak_bytes
        budget = int(1.25 * none_peak)
    found = {}
    for which, every in (("none", None), ("all", 1)):
        def try_batch(batch: int, every=every):
            return training_trial(batch, lambda: build(L, "fsdp2", every)[0], L.optimizer,
                                  L.data(batch_size=batch), 2 if not on_gpu else 4, L.device,
                                  L.dist.world_size)[0]

        result = find_max_batch(try_batch, start=L.batch_size, limit=limit, budget_bytes=budget,
                                agree=all_ranks_agree)
        found[which] = {"best": result.best, "reason": result.reason,
                        "trials": [t.as_dict() for t in result.trials]}
        L.print(f"  largest batch per rank, {which} checkpointed: {result.best} ({result.reason})")
    L.results.data["batch_search"] = dict(
        budget_bytes=budget, limit=limit, api="fsdp2", **found,
        gain=round(found["all"]["best"] / found["none"]["best"], 2) if found["none"]["best"] else None)
    where = f"a budget of {fmt_bytes(budget)} per rank" if budget else "this GPU (no retries, no OOM)"
    L.results.note(f"batch_search: largest batch per rank in {where}: {found['none']['best']} "
                   f"without checkpointing, {found['all']['best']} with every block checkpointed.")


if __name__ == "__main__":
    main(parse_args())
