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

import argparse
import functools
import sys
from pathlib import Path

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    CheckpointWrapper,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without install

from utilities.activation_checkpointing import checkpointed_blocks
from utilities.course.lesson import Lesson, lesson_parser
from utilities.distributed import world_mesh
from utilities.errors import positive_float, positive_int
from utilities.measure import fmt_bytes
from utilities.measure.batch_search import all_ranks_agree, find_max_batch, training_trial
from utilities.results import variant
from utilities.training import TrainStats
from utilities.wrapping import shard_model

# NO_REENTRANT is torch.utils.checkpoint(use_reentrant=False): the reentrant form needs inputs that
# require grad, takes no keyword arguments and is deprecated.
NO_REENTRANT = functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT)


def every_nth_block(model: nn.Module, block_class: type[nn.Module], every: int) -> set[nn.Module]:
    """Selective checkpointing: the 1st, (1 + every)-th, ... block in module order (every=1: all)."""
    return set([m for m in model.modules() if isinstance(m, block_class)][::every])


def fsdp2_checkpointed(model: nn.Module, block_class: type[nn.Module], every: int | None) -> nn.Module:
    """FSDP2: checkpoint *before* sharding. Each chosen block is replaced, in its parent, by a
    CheckpointWrapper around it; then fully_shard goes on each block's outermost module (the
    wrapper where there is one), so a checkpointed block and its wrapper are one unit.
    ``every=None``: nothing checkpointed."""
    chosen = every_nth_block(model, block_class, every) if every else set()
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if child in chosen:
                setattr(parent, name, NO_REENTRANT(child))
    units = [m for m in model.modules()  # a checkpointed block's wrapper, or a plain block
             if isinstance(m, CheckpointWrapper) or (isinstance(m, block_class) and m not in chosen)]
    mesh = world_mesh()  # every rank, on this run's device (not the machine's accelerator)
    for unit in units:
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def fsdp1_checkpointed(model: nn.Module, block_class: type[nn.Module], every: int | None,
                       device: torch.device) -> nn.Module:
    """FSDP1 wants the other order: wrap first (one unit per block, lesson 01), *then* let
    apply_activation_checkpointing swap each block that check_fn accepts, inside its unit, for a
    CheckpointWrapper. ``every=None``: nothing checkpointed."""
    # = FSDP(model, auto_wrap_policy=transformer_auto_wrap_policy for block_class, device_id=device)
    model = shard_model(model, api="fsdp1", block_class=block_class, policy="block", device=device)
    if every:
        chosen = every_nth_block(model, block_class, every)
        apply_activation_checkpointing(model, checkpoint_wrapper_fn=NO_REENTRANT,
                                       check_fn=lambda m: m in chosen)
    return model


# -- the comparison ---------------------------------------------------------------------------------
VARIANTS = [f"{api}-{blocks}" for api in ("fsdp2", "fsdp1") for blocks in ("none", "selective", "all")]
NOTES = ("activations: peak bytes the tracker attributes to activations; a checkpointed block keeps "
         "only its input and recomputes the rest in backward.",)
CPU_NOTE = ("CPU run: memory from torch.distributed._tools trackers; step times on CPU are only "
            "indicative (the recompute costs about one extra forward).")


def build(lesson: Lesson, api: str, every: int | None) -> nn.Module:
    """A fresh model, checkpointed every ``every``-th block (None: none) and sharded with ``api``."""
    block = lesson.spec.block_class()
    if api == "fsdp2":
        return lesson.materialize(fsdp2_checkpointed(lesson.build_model(), block, every))
    return lesson.materialize(fsdp1_checkpointed(lesson.build_model(), block, every, lesson.device))


def takeaway(results: dict) -> str:
    """The lesson's point, from what the run measured (printed last)."""
    act = lambda name: fmt_bytes(variant(results, name)["peak_memory_bytes"]["activations"])  # noqa: E731
    line = (f"checkpointing every block: activations at the peak {act('fsdp2-none')} -> "
            f"{act('fsdp2-all')} (FSDP2), same losses")
    found = {k: v["best"] for k, v in (results.get("batch_search") or {}).items()
             if isinstance(v, dict) and "best" in v}
    if found:
        line += "; largest batch in the budget: " + ", ".join(f"{k} {b}" for k, b in found.items())
    return line


def main(args: argparse.Namespace) -> None:
    with Lesson("02", args, settings={"every": args.every}, notes=NOTES, cpu_note=CPU_NOTE,
                takeaway=takeaway) as lesson:
        lesson.results.columns("checkpointed_blocks")
        lesson.print(f"block class: {lesson.spec.block_class().__name__}; "
                     f"selective = every {args.every} block(s)")
        every = {"none": None, "selective": args.every, "all": 1}  # which blocks are checkpointed

        def describe(name: str, model: nn.Module, stats: TrainStats) -> dict:
            mem, n = stats.peak_memory_bytes, checkpointed_blocks(model)
            lesson.print(f"    {n} checkpointed blocks, activations {fmt_bytes(mem.get('activations'))}, "
                         f"peak {fmt_bytes(mem.get('total'))}")
            return dict(api=name.split("-")[0], checkpointed_blocks=n)

        def build_variant(name: str) -> nn.Module:
            api, blocks = name.split("-")
            return build(lesson, api, every[blocks])

        lesson.run_variants(args.variants, build_variant, describe=describe)
        if args.search == "on":
            none = [v for v in lesson.results.data["variants"] if v["name"] == "fsdp2-none"]
            search_largest_batch(lesson, args, none[0]["peak_memory_bytes"].get("total") if none else None)


def search_largest_batch(lesson: Lesson, args: argparse.Namespace, none_peak: int | None) -> None:
    """The largest clean batch per rank with FSDP2 and no / every block checkpointed (lesson 05's
    search). On GPU a trial fails on cudaMalloc retries or OOM; on CPU, where nothing retries, on
    going over a memory budget (the tracked peak). Against a budget the peak grows linearly with the
    batch, so after two trials the search tries the batch the line predicts, and the one above it."""
    on_gpu = lesson.device.type == "cuda"
    limit = args.search_limit or (256 if on_gpu else 48)  # CPU: 6x the quick batch is room enough
    budget = int(args.budget_mib * 2**20) if args.budget_mib else None
    if budget is None and not on_gpu:
        if none_peak is None:  # fsdp2-none was not among the variants: measure it here
            trial = training_trial(lesson.batch_size, lambda: build(lesson, "fsdp2", None),
                                   lesson.optimizer, lesson.data(), 2, lesson.device)
            none_peak = trial[0].peak_bytes
        budget = int(1.25 * none_peak)
    found = {}
    for which, every in (("none", None), ("all", 1)):
        def try_batch(batch: int, every=every):
            return training_trial(batch, lambda: build(lesson, "fsdp2", every), lesson.optimizer,
                                  lesson.data(batch_size=batch), 2 if not on_gpu else 4, lesson.device,
                                  lesson.dist.world_size)[0]

        result = find_max_batch(try_batch, start=lesson.batch_size, limit=limit, budget_bytes=budget,
                                predict=True, agree=all_ranks_agree)
        found[which] = {"best": result.best, "reason": result.reason,
                        "trials": [t.as_dict() for t in result.trials]}
        lesson.print(f"  largest batch per rank, {which} checkpointed: {result.best} ({result.reason})")
    lesson.results.record("batch_search", dict(
        budget_bytes=budget, limit=limit, api="fsdp2", **found,
        gain=round(found["all"]["best"] / found["none"]["best"], 2) if found["none"]["best"] else None))
    where = f"a budget of {fmt_bytes(budget)} per rank" if budget else "this GPU (no retries, no OOM)"
    lesson.results.note(f"batch_search: largest batch per rank in {where}: {found['none']['best']} "
                        f"without checkpointing, {found['all']['best']} with every block checkpointed.")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = lesson_parser(__doc__)
    p.add_variants(VARIANTS)
    p.add_argument("--every", type=positive_int, default=2,
                   help="selective variant: checkpoint every N-th block (1 = all; default 2)")
    p.add_argument("--search", choices=("on", "off"), default="on",
                   help="after the variants, find the largest batch per rank that fits with FSDP2 "
                        "and no / all blocks checkpointed (default on)")
    p.add_argument("--search-limit", type=positive_int, default=None,
                   help="largest batch the search tries (default 256 on GPU, 48 on CPU)")
    p.add_argument("--budget-mib", type=positive_float, default=None,
                   help="memory per rank a batch must fit in, in MiB (default: on GPU none, the "
                        "search stops at cudaMalloc retries or OOM; on CPU 1.25 x the peak of "
                        "fsdp2-none at --batch-size)")
    return p.parse(argv)


if __name__ == "__main__":
    main(parse_args())
