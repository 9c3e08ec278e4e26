"""Lesson 11's driver: each variant wrapped (the lesson script's functions), trained under
Memory_Maximizer and made a row, with the allocator's evidence where it can be measured.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from utilities import Memory_Maximizer
from utilities.course.lesson import Lesson
from utilities.distributed import NOT_MEASURABLE
from utilities.results import peak_range

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


def run_variant(lesson: Lesson, name: str, code: SimpleNamespace) -> None:
    """Wrap (the lesson script's functions, handed in as ``code``), train under Memory_Maximizer
    (started on an emptied cache, so reserved memory is this variant's own), record."""
    limit = VARIANTS[name]
    block = lesson.spec.block_class()
    if lesson.device.type == "cuda":
        torch.cuda.empty_cache()
    if limit is None:
        model = code.wrap_fsdp2(lesson.build_model(), block)
    else:
        model = code.wrap_fsdp1(lesson.build_model(), block, lesson.device, limit_all_gathers=limit)
    model = lesson.materialize(model)
    mm = Memory_Maximizer(verbose=lesson.dist.is_main)
    mm.start()
    stats = lesson.train(model, name, step_fn=code.watched_step(mm))
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


def takeaway(results: dict) -> str:
    """The lesson's point, from what the run measured (printed last)."""
    return "the limiter changes when all-gathers are issued, never the losses; " + peak_range(results)


def run_variants(lesson: Lesson, code: SimpleNamespace) -> None:
    """Every variant in turn, what each made freed before the next; on a GPU over gloo, the note
    that the limiter's effect cannot show."""
    lesson.results.columns("limit_all_gathers", "max_reserved_gb", "cuda_malloc_retries")
    if lesson.device.type == "cuda" and not lesson.dist.nccl_on_gpu:
        lesson.results.note(GLOO_GPU_NOTE)
        lesson.print(f"note: {GLOO_GPU_NOTE}")
    for name in lesson.args.variants:
        with lesson.variant(name):  # everything the variant made is freed before the next one
            run_variant(lesson, name, code)
