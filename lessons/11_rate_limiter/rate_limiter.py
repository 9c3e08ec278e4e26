"""Lesson 11: the rate limiter (FSDP1 limit_all_gathers) and why FSDP2 needs none.

The CPU thread only *issues* GPU work; it can run far ahead of the GPU. With FSDP1 and
limit_all_gathers=False nothing stops it from issuing the all-gathers of many units before the GPU
has finished (and freed) the earlier ones. Each issued all-gather needs its full-size output buffer
*now*, on the all-gather stream, so the CUDA caching allocator reserves memory for several units'
unsharded parameters at once. Blocks freed on one stream cannot be reused on another until the
streams sync, so reserved memory climbs, and near the limit the allocator starts cudaMalloc retries
(free its whole cache and try again: a stall every step).

    FSDP1 limit_all_gathers=True    at most 2 units' all-gathers in flight; the CPU waits on an
                                    event before issuing a third (the default since mid-2023)
    FSDP1 limit_all_gathers=False   unbounded: the CPU runs ahead and the allocator over-reserves
    FSDP2 (no knob)                 all-gather buffers are allocated and freed in stream order; the
                                    copy-out into the parameters frees each buffer, and the next
                                    all-gather waits on it: about 2 in flight by construction

This script trains the same model on the same data each way and records step time, peak memory,
losses and the Memory_Maximizer report (reserved memory per step, max reserved, cudaMalloc retries:
GPU only). On CPU there is no caching allocator, so the memory effect cannot appear; the losses,
which must match, and the structure of the comparison still run.

Run: fsdp-course run 11 [--quick]   or   torchrun --nproc-per-node 2 rate_limiter.py --device cpu
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import torch
from rate_limiter_run import CPU_NOTE, NOTES, VARIANTS, run_variants, takeaway
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without install

from utilities import Memory_Maximizer
from utilities.course.catalog import LESSONS
from utilities.course.lesson import Lesson, lesson_parser
from utilities.distributed import world_mesh
from utilities.measure.predictions import add_prediction_arguments, predict_from_arguments
from utilities.models import get_model_spec
from utilities.training import default_step
from utilities.wrapping import fsdp1_meta_init


# -- FSDP1: the rate limiter is one constructor option ---------------------------------------------
def wrap_fsdp1(model: nn.Module, block_class: type[nn.Module], device: torch.device,
               limit_all_gathers: bool) -> FSDP:
    """One unit per block. ``limit_all_gathers=True`` (the default since mid-2023) keeps at most
    two units' all-gathers in flight: before issuing a third, the CPU waits on the event recorded
    when the oldest one's gathered parameters were freed. ``False`` lets it issue as far ahead as
    it can run."""
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={block_class})
    on_meta = any(p.is_meta for p in model.parameters())
    return FSDP(model, auto_wrap_policy=policy, limit_all_gathers=limit_all_gathers,
                device_id=device,  # this rank's GPU, or the CPU (else FSDP1 looks for a GPU)
                param_init_fn=fsdp1_meta_init(model, device) if on_meta else None)


# -- FSDP2: no such knob ---------------------------------------------------------------------------
def wrap_fsdp2(model: nn.Module, block_class: type[nn.Module],
               mp_policy: MixedPrecisionPolicy | None = None) -> nn.Module:
    """Nothing to set: FSDP2 has no limit_all_gathers. Each all-gather's output buffer is allocated
    on the all-gather stream and freed by the copy-out into the parameters, and the next gather is
    ordered after that free, so about two are in flight by construction. What stays gathered after
    a block's forward is ``reshard_after_forward`` (lesson 06), not a rate limit. ``mp_policy``:
    none in the lesson's runs (fp32); its cluster prediction passes bf16's."""
    mesh = world_mesh()  # every rank, on this run's device (not the machine's accelerator)
    policy = {} if mp_policy is None else {"mp_policy": mp_policy}
    for module in model.modules():
        if isinstance(module, block_class):
            fully_shard(module, mesh=mesh, **policy)
    fully_shard(model, mesh=mesh, **policy)
    return model


def watched_step(mm: Memory_Maximizer) -> Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor]:
    """A training step that records the allocator's reserved memory right after backward, where
    all-gathers issued ahead would have piled up."""
    def step(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        loss = default_step(model, batch)  # forward, backward
        mm.update()
        return loss
    return step


# -- the lesson run ---------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = lesson_parser(__doc__)
    p.add_variants(VARIANTS)
    add_prediction_arguments(p, LESSONS["11"].run.gpu_model, LESSONS["11"].run.gpu_batch_size)
    return p.parse(argv)


def predicted_knobs(name: str, block_class: type[nn.Module]) -> dict:
    """Each variant as the step-time model's schedule: FSDP1 with or without the limiter (FSDP1's
    default BACKWARD_PRE), FSDP2's one-ahead prefetch, traced through ``wrap_fsdp2`` itself. The
    model has no CPU side, so it shows when all-gathers may be issued, not the limiter's cost in
    host synchronizations."""
    limit = VARIANTS[name]
    if limit is None:
        return dict(prefetch=1, parallelize=functools.partial(wrap_fsdp2, block_class=block_class))
    return dict(backward_prefetch="backward_pre", limit_all_gathers=limit)


def main(args: argparse.Namespace) -> None:
    predicted = None
    if args.predict_on != "none":
        block = get_model_spec(args.predict_model).block_class()
        predicted = predict_from_arguments(args, {n: predicted_knobs(n, block) for n in args.variants})
    with Lesson("11", args, needs_ranks="the rate limiter (all-gathers in flight)", notes=NOTES,
                cpu_note=CPU_NOTE, takeaway=takeaway) as lesson:
        run_variants(lesson, SimpleNamespace(**globals()))  # the functions above, for the driver
        lesson.results.predicted(predicted)


if __name__ == "__main__":
    main(parse_args())
