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

import gc
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without install

import torch

from utilities.course.lesson import Lesson, lesson_parser
from utilities.measure import fmt_bytes
from utilities.memory_maximizer import Memory_Maximizer
from utilities.training import default_step
from utilities.wrapping import shard_model

VARIANTS = {
    # name: (api, options for FullyShardedDataParallel)
    "fsdp1-limit-all-gathers": ("fsdp1", dict(limit_all_gathers=True)),
    "fsdp1-unlimited": ("fsdp1", dict(limit_all_gathers=False)),
    "fsdp2": ("fsdp2", {}),
}


def parse_args(argv=None):
    p = lesson_parser(__doc__)
    p.add_variants(VARIANTS)
    args = p.parse(argv)
    return args


def main(args) -> None:
    with Lesson("11", args,
                needs_ranks="the rate limiter (all-gathers in flight)") as L:
        block = L.spec.block_class()
        on_gpu = L.device.type == "cuda"

        for name in args.variants:
            with L.variant(name):  # everything the variant made is freed before the next one
                api, options = VARIANTS[name]
                if on_gpu:  # each variant starts from an empty cache, so reserved memory is its own
                    gc.collect()
                    torch.cuda.empty_cache()
                model = L.materialize(shard_model(L.build_model(), api=api, block_class=block,
                                                  device=L.device, **options))
                mm = Memory_Maximizer(verbose=L.dist.is_main)
                mm.start()

                def step(model, batch, mm=mm):
                    loss = default_step(model, batch)
                    mm.update()  # reserved memory right after backward, every step
                    return loss

                stats = L.train(model, name, step_fn=step)
                report = mm.stop()
                extra = {"api": api, "limit_all_gathers": options.get("limit_all_gathers"),
                         "memory_maximizer": report}
                if report.get("gpu"):
                    extra.update(max_reserved_gb=report["max_reserved_gb"],
                                 cuda_malloc_retries=report["cuda_malloc_retries"])
                L.results.add(name, stats, **extra)
                L.print(f"    peak {fmt_bytes(stats.peak_memory_bytes.get('total'))}")
                del model

        L.results.note("limit_all_gathers bounds FSDP1 to 2 all-gathers in flight (default True "
                       "since mid-2023); FSDP2 has no such knob: its stream-ordered all-gather "
                       "buffers are freed by the copy-out, so about 2 are in flight by construction.")
        if not on_gpu:
            L.results.note("CPU run: the rate limiter's effect lives in the CUDA caching allocator "
                           "(reserved memory, cudaMalloc retries), which a CPU does not have; gloo "
                           "runs collectives synchronously, so the CPU thread cannot run ahead. "
                           "Memory_Maximizer records nothing here; its report is kept per variant.")


if __name__ == "__main__":
    main(parse_args())
