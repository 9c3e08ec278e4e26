"""Lesson 04: backward prefetch (and forward prefetch).

Before a unit computes, FSDP must all-gather its parameters. If the gather starts only when the unit
is needed, the GPU waits for the network. *Prefetching* issues the next unit's all-gather early, so
it runs on the network while the current unit computes. In backward the question is *when* the next
gather is issued:

    FSDP1 backward_prefetch=BACKWARD_PRE   before the current unit's gradient computation
    FSDP1 backward_prefetch=BACKWARD_POST  after it, before its reduce-scatter (less memory, less overlap)
    FSDP1 backward_prefetch=None           only when the next unit is reached (no overlap)
    FSDP1 forward_prefetch=True            also prefetch in forward, from the previous forward's order
    FSDP2 implicit (default)               always BACKWARD_PRE-like, forward prefetch one unit ahead
    FSDP2 explicit, depth N                set_modules_to_forward/backward_prefetch, N units ahead

This script trains the same model on the same data with each setting and records step time, peak
memory and losses. Prefetching changes timing, never numerics: the losses must match. On GPU it also
writes a torch.profiler Chrome trace per variant and reports exposed communication (collective
kernel time with no compute kernel running beside it); on CPU gloo runs collectives synchronously,
so there is no overlap to see (--trace still records a small CPU trace).

Run: fsdp-course run 04 [--quick]   or   torchrun --nproc-per-node 2 backward_prefetch.py --device cpu
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn
from torch.distributed.fsdp import BackwardPrefetch, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without install

from backward_prefetch_run import prediction, run_prefetch_variants, takeaway

from utilities.course.catalog import LESSONS
from utilities.course.lesson import Lesson, lesson_parser
from utilities.distributed import world_mesh
from utilities.errors import positive_int
from utilities.measure.predictions import add_prediction_arguments
from utilities.wrapping import fsdp1_meta_init


# -- FSDP2: prefetching is implicit; explicit lists reach further ahead ----------------------------
def shard_blocks(model: nn.Module, block_class: type[nn.Module],
                 mp_policy: MixedPrecisionPolicy | None = None) -> list[nn.Module]:
    """``fully_shard`` every block, then the root; return the blocks in forward order, the order
    prefetch lists speak of. With nothing more, FSDP2 prefetches implicitly: one block ahead in
    forward, and in backward the block that ran before in forward (BACKWARD_PRE-like).
    ``mp_policy``: none in the lesson's runs (fp32); its cluster prediction passes bf16's."""
    blocks = [m for m in model.modules() if isinstance(m, block_class)]  # T5: encoder, then decoder
    mesh = world_mesh()  # every rank, on this run's device (not the machine's accelerator)
    policy = {} if mp_policy is None else {"mp_policy": mp_policy}
    for block in blocks:
        fully_shard(block, mesh=mesh, **policy)
    fully_shard(model, mesh=mesh, **policy)
    return blocks


def prefetch_ahead(blocks: list[nn.Module], depth: int) -> None:
    """Explicit prefetching ``depth`` blocks ahead. When block i starts its forward it issues the
    all-gathers of blocks i+1..i+depth; backward runs the blocks in reverse, so when block i starts
    its backward it issues those of blocks i-1..i-depth, nearest first. Depth 1 is what FSDP2
    already does; each extra level keeps one more block's parameters unsharded at once."""
    for i, block in enumerate(blocks):
        next_in_forward = blocks[i + 1:i + 1 + depth]
        next_in_backward = blocks[max(0, i - depth):i][::-1]
        if next_in_forward:  # the last blocks have nothing ahead: they keep the implicit default
            block.set_modules_to_forward_prefetch(next_in_forward)
        if next_in_backward:
            block.set_modules_to_backward_prefetch(next_in_backward)


def shard_fsdp2(model: nn.Module, block_class: type[nn.Module], depth: int | None,
                mp_policy: MixedPrecisionPolicy | None = None) -> nn.Module:
    """An FSDP2 variant: the blocks and the root sharded, then (``depth``) the explicit lists."""
    blocks = shard_blocks(model, block_class, mp_policy)
    if depth:
        prefetch_ahead(blocks, depth)
    return model


# -- FSDP1: prefetching is two constructor options -------------------------------------------------
def wrap_fsdp1(model: nn.Module, block_class: type[nn.Module], device: torch.device,
               backward_prefetch: BackwardPrefetch | None, forward_prefetch: bool) -> FSDP:
    """One unit per block. ``backward_prefetch`` says when the next unit's all-gather is issued in
    backward (BACKWARD_PRE, the default: before this unit's gradients; BACKWARD_POST: after them;
    None: when the next unit is reached); ``forward_prefetch=True`` also issues the next unit's
    all-gather in forward, following the order recorded in the first forward."""
    on_meta = any(p.is_meta for p in model.parameters())
    return FSDP(model, device_id=device,  # this rank's GPU, or the CPU (else FSDP1 wants a GPU)
                auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                                   transformer_layer_cls={block_class}),
                backward_prefetch=backward_prefetch, forward_prefetch=forward_prefetch,
                param_init_fn=fsdp1_meta_init(model, device) if on_meta else None)


# -- the comparison: each variant's calls -----------------------------------------------------------
FSDP1_VARIANTS = {
    "fsdp1-no-prefetch": dict(backward_prefetch=None, forward_prefetch=False),
    "fsdp1-backward-post": dict(backward_prefetch=BackwardPrefetch.BACKWARD_POST, forward_prefetch=False),
    "fsdp1-backward-pre": dict(backward_prefetch=BackwardPrefetch.BACKWARD_PRE, forward_prefetch=False),
    "fsdp1-pre+forward": dict(backward_prefetch=BackwardPrefetch.BACKWARD_PRE, forward_prefetch=True),
}
FSDP2_VARIANTS = {"fsdp2-implicit": False, "fsdp2-explicit": True}  # explicit: --prefetch-depth
VARIANTS = [*FSDP1_VARIANTS, *FSDP2_VARIANTS]


def build(lesson: Lesson, depth: int, name: str) -> nn.Module:
    """The model sharded as variant ``name`` says."""
    block = lesson.spec.block_class()
    if name in FSDP1_VARIANTS:
        return wrap_fsdp1(lesson.build_model(), block, lesson.device, **FSDP1_VARIANTS[name])
    return shard_fsdp2(lesson.build_model(), block, depth if FSDP2_VARIANTS[name] else None)


# -- the lesson run -------------------------------------------------------------------------------
NOTES = ("Prefetching changes when all-gathers are issued, never what is computed: every variant's "
         "losses match.",)
CPU_NOTE = ("CPU run: gloo runs each collective synchronously on the calling thread, so nothing "
            "overlaps and step times here cannot show prefetching. The overlap and the exposed "
            "communication time are measured only on GPUs (NCCL kernels on their own stream), with "
            "a profiler trace per variant.")


def main(args: argparse.Namespace) -> None:
    predicted = prediction(args, SimpleNamespace(**globals()))  # before any rank starts
    with Lesson("04", args, settings=dict(prefetch_depth=args.prefetch_depth), notes=NOTES,
                cpu_note=CPU_NOTE, needs_ranks="prefetching (overlap of all-gathers with compute)",
                takeaway=takeaway) as lesson:
        run_prefetch_variants(lesson, args, predicted, SimpleNamespace(**globals()))  # the calls above


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = lesson_parser(__doc__)
    p.add_variants(VARIANTS)
    p.add_argument("--prefetch-depth", type=positive_int, default=2,
                   help="FSDP2 explicit prefetch: how many blocks ahead to all-gather (default 2)")
    add_prediction_arguments(p, LESSONS["04"].run.gpu_model, LESSONS["04"].run.gpu_batch_size)
    p.add_argument("--trace", action="store_true",
                   help="also record a torch.profiler Chrome trace per variant on CPU (always on GPU)")
    return p.parse(argv)


if __name__ == "__main__":
    main(parse_args())
