"""Lesson 05: the memory maximizer (find the fastest batch: no cudaMalloc retries).

The classic insight: the fastest batch size is not the largest one that avoids an out-of-memory
error, but the largest one that avoids cudaMalloc retries. When the caching allocator cannot find a
free cached block it empties its cache and calls cudaMalloc again; near the memory limit that
happens on every step and each retry stalls the step. The classic figures (2B ViT, SHARD_GRAD_OP):
batch 16, 0 retries, 2.93 img/s; batch 17, 9 retries, 2.34 img/s; batch 18, OOM.

This script searches the batch size: it doubles it until the first trial that retries, OOMs or goes
over the memory budget, then bisects down to the largest clean batch. Each trial shards a fresh
model with FSDP2 (one unit per block), trains a few steps under Memory_Maximizer and records the
throughput, the peak memory, the max reserved memory, the retries and the OOMs (an OOM is caught,
memory freed, and the search goes on). It recommends the largest clean batch.

On CPU there is no caching allocator and nothing retries: the same search runs against a memory
budget (--budget-mib), and the tracked peak (torch.distributed._tools trackers) decides. On GPU the
budget is optional; retries and OOMs decide.

Run: fsdp-course run 05 [--quick]   or   torchrun --nproc-per-node 2 memory_maximizer.py --device cpu
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without install

from memory_maximizer_run import search

from utilities import Memory_Maximizer
from utilities.course.lesson import Lesson, lesson_parser
from utilities.distributed import world_mesh
from utilities.errors import positive_float, positive_int
from utilities.measure.batch_search import Trial
from utilities.results import variant
from utilities.training import TrainStats, train


# -- what the allocator says: retries are the signal, not OOMs -------------------------------------
def cuda_malloc_retries(device: torch.device) -> int:
    """How many times so far the CUDA caching allocator found no free cached block, emptied its
    cache and called cudaMalloc again: ``num_alloc_retries``. It never resets by itself, so a
    trial reads it before and after. A CPU has no caching allocator: 0."""
    if device.type != "cuda":
        return 0
    return torch.cuda.memory_stats(device).get("num_alloc_retries", 0)


def try_batch(lesson: Lesson, batch: int) -> tuple[Trial, TrainStats]:
    """One trial: a fresh FSDP2 model (one unit per block) trained a few steps at ``batch``, watched
    by ``Memory_Maximizer``. An OOM propagates for the search to record; the model goes either way."""
    model = lesson.build_model()
    mesh = world_mesh()  # every rank, on this run's device (not the machine's accelerator)
    for block in [m for m in model.modules() if isinstance(m, lesson.spec.block_class())]:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)  # the root: embeddings, final norms, what no block holds
    model = lesson.materialize(model)
    optimizer = lesson.optimizer(model)
    retries_before = cuda_malloc_retries(lesson.device)
    mm = Memory_Maximizer(verbose=False)
    mm.start()  # resets the allocator's peaks and notes its retry and OOM counters
    try:
        stats = train(model, optimizer, lesson.data(batch_size=batch), lesson.steps, lesson.device,
                      flops_per_token=lesson.spec.flops_per_token(lesson.seq_len))
        mm.update()  # reserved memory after the last step
    finally:
        report = mm.stop()  # max reserved, retries and OOMs since start(); {"gpu": False} on CPU
        del model, optimizer
    retries = cuda_malloc_retries(lesson.device) - retries_before  # = report["cuda_malloc_retries"]
    samples_per_s = batch * lesson.dist.world_size / stats.step_time_s if stats.step_time_s else None
    trial = Trial(batch, throughput=samples_per_s, peak_bytes=stats.peak_memory_bytes.get("total"),
                  retries=retries)
    if report["gpu"]:
        trial.max_reserved_bytes = int(report["max_reserved_gb"] * 2**30)
        trial.ooms = report["ooms"]
    return trial, stats


# -- the lesson run: the search and its evidence -----------------------------------------------------
# t5-tiny, seq 64, 2 ranks: the tracked peak per rank is about 14 MiB + 5.3 MiB per sample (batch 4:
# 34.6 MiB, batch 8: 55.7 MiB). 48 MiB puts the answer (batch 6, 7 over) inside the sweep 1..32,
# with a few MiB of margin on both sides.
CPU_BUDGET_MIB = 48.0
CPU_NOTE = ("CPU run: there is no caching allocator, so no cudaMalloc retries; a trial counts as "
            "failed when its tracked peak (torch.distributed._tools trackers) exceeds the {budget:g} "
            "MiB budget per rank, the CPU stand-in for retries and OOMs. Step times on a shared CPU "
            "are only indicative.")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = lesson_parser(__doc__)
    p.add_argument("--budget-mib", type=positive_float, default=None,
                   help=f"per-rank memory budget in MiB: a trial whose peak exceeds it counts as "
                        f"failed (default: {CPU_BUDGET_MIB:g} on CPU, none on GPU)")
    p.add_argument("--start-batch", type=positive_int, default=1,
                   help="first per-rank batch size tried (default 1)")
    p.add_argument("--max-batch", type=positive_int, default=None,
                   help="largest per-rank batch size tried (default: 32 on CPU, 256 on GPU)")
    p.add_argument("--no-bisect", action="store_true",
                   help="only double the batch; stop at the first failed trial")
    args = p.parse(argv)
    if args.max_batch is not None and args.max_batch < args.start_batch:
        p.exit(2, f"error: --max-batch {args.max_batch} is not allowed; allowed: integers >= "
                  f"--start-batch ({args.start_batch})\n")
    return args


def takeaway(results: dict) -> str:
    """The lesson's point: the recommendation and why (printed last)."""
    return variant(results, "recommendation")["reason"]


def main(args: argparse.Namespace) -> None:
    with Lesson("05", args, cpu_note=CPU_NOTE.format(budget=args.budget_mib or CPU_BUDGET_MIB),
                takeaway=takeaway) as lesson:
        lesson.results.columns("batch", "phase", "verdict", "retries", "ooms")
        budget_mib = args.budget_mib or (None if lesson.device.type == "cuda" else CPU_BUDGET_MIB)
        result = search(lesson, SimpleNamespace(**globals()), args, budget_mib)
        lesson.results.add("recommendation", None, batch=result.best, reason=result.reason,
                           budget_mib=budget_mib, trials=len(result.trials))
        lesson.print(f"recommendation: batch {result.best} per rank ({result.reason})")
        lesson.results.note(f"recommendation: batch {result.best} per rank: {result.reason}.")


if __name__ == "__main__":
    main(parse_args())
