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

import torch
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without install

from utilities import Memory_Maximizer
from utilities.course.catalog import LESSONS
from utilities.course.lesson import Lesson, lesson_parser
from utilities.distributed import NOT_MEASURABLE, world_mesh
from utilities.measure.predictions import add_prediction_arguments, predict_from_arguments
from utilities.models import get_model_spec
from utilities.results import peak_range
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


# -- the comparison ---------------------------------------------------------------------------------
VARIANTS = {
    # name: FSDP1's limit_all_gathers, or None for FSDP2
    "fsdp1-limit-all-gathers": True,
    "fsdp1-unlimited": False,
    "fsdp2": None,
}
NOTES = ("limit_all_gathers bounds FSDP1 to 2 all-gathers in flight (default True since mid-2023); "
         "FSDP2 has no such knob: its stream-ordered all-gather buffers are freed by the copy-out, "
         "so about 2 are in flight by construction.",)
CPU_NOTE = ("CPU run: the rate limiter's effect lives in the CUDA caching allocator (reserved "
            "memory, cudaMalloc retries), which a CPU does not have; gloo runs collectives "
            "synchronously, so the CPU thread cannot run ahead. Memory_Maximizer records nothing "
            "here; its report is kept per variant.")


def run_variant(lesson: Lesson, name: str) -> None:
    """Wrap, train under Memory_Maximizer (started on an emptied cache, so reserved memory is this
    variant's own), record."""
    limit = VARIANTS[name]
    block = lesson.spec.block_class()
    if lesson.device.type == "cuda":
        torch.cuda.empty_cache()
    if limit is None:
        model = wrap_fsdp2(lesson.build_model(), block)
    else:
        model = wrap_fsdp1(lesson.build_model(), block, lesson.device, limit_all_gathers=limit)
    model = lesson.materialize(model)
    mm = Memory_Maximizer(verbose=lesson.dist.is_main)
    mm.start()
    stats = lesson.train(model, name, step_fn=watched_step(mm))
    report = mm.stop()
    lesson.results.add(name, stats, api="fsdp2" if limit is None else "fsdp1", limit_all_gathers=limit,
                       memory_maximizer=report, **allocator_columns(lesson, report))


def allocator_columns(lesson: Lesson, report: dict) -> dict:
    """Max reserved memory and cudaMalloc retries, the rate limiter's evidence, on a GPU. Over gloo
    (ranks sharing a GPU) each collective blocks the host thread, so the CPU can never run ahead
    and every setting is the same run: no number is given for them (the allocator's own report
    stays in ``memory_maximizer``)."""
    if not report["gpu"]:
        return {}
    if not lesson.dist.nccl_on_gpu:
        return {"max_reserved_gb": NOT_MEASURABLE, "cuda_malloc_retries": NOT_MEASURABLE}
    return {"max_reserved_gb": report["max_reserved_gb"],
            "cuda_malloc_retries": report["cuda_malloc_retries"]}


GLOO_GPU_NOTE = (f"the rate limiter's effect is {NOT_MEASURABLE}: the collectives run over gloo "
                 "(ranks sharing a GPU), which blocks the host thread in each one, so the CPU never "
                 "runs ahead of the GPU and every setting is the same run. It needs one rank per GPU "
                 "over NCCL.")


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


def takeaway(results: dict) -> str:
    """The lesson's point, from what the run measured (printed last)."""
    return "the limiter changes when all-gathers are issued, never the losses; " + peak_range(results)


def main(args: argparse.Namespace) -> None:
    predicted = None
    if args.predict_on != "none":
        block = get_model_spec(args.predict_model).block_class()
        predicted = predict_from_arguments(args, {n: predicted_knobs(n, block) for n in args.variants})
    with Lesson("11", args, needs_ranks="the rate limiter (all-gathers in flight)", notes=NOTES,
                cpu_note=CPU_NOTE, takeaway=takeaway) as lesson:
        lesson.results.columns("limit_all_gathers", "max_reserved_gb", "cuda_malloc_retries")
        if lesson.device.type == "cuda" and not lesson.dist.nccl_on_gpu:
            lesson.results.note(GLOO_GPU_NOTE)
            lesson.print(f"note: {GLOO_GPU_NOTE}")
        for name in args.variants:
            with lesson.variant(name):  # everything the variant made is freed before the next one
                run_variant(lesson, name)
        lesson.results.predicted(predicted)


if __name__ == "__main__":
    main(parse_args())
