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
from types import SimpleNamespace

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

from checkpointing_run import run_variants_and_search, takeaway

from utilities.course.lesson import Lesson, lesson_parser
from utilities.distributed import world_mesh
from utilities.errors import positive_float, positive_int
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


# -- the lesson run -------------------------------------------------------------------------------
VARIANTS = [f"{api}-{blocks}" for api in ("fsdp2", "fsdp1") for blocks in ("none", "selective", "all")]
NOTES = ("activations: peak bytes the tracker attributes to activations; a checkpointed block keeps "
         "only its input and recomputes the rest in backward.",)
CPU_NOTE = ("CPU run: memory from torch.distributed._tools trackers; step times on CPU are only "
            "indicative (the recompute costs about one extra forward).")


def main(args: argparse.Namespace) -> None:
    with Lesson("02", args, settings={"every": args.every}, notes=NOTES, cpu_note=CPU_NOTE,
                takeaway=takeaway) as lesson:
        run_variants_and_search(lesson, args, SimpleNamespace(**globals()))  # the wrappers above


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
