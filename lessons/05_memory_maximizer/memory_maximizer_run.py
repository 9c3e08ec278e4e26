"""Lesson 05's driver: the batch search, each trial one variant, recorded with its verdict.

The trial and what the allocator says are the lesson script's functions (``memory_maximizer.py``,
handed in as ``code``); here: how the batches are chosen and how each trial becomes a row.
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

from utilities.course.lesson import Lesson
from utilities.measure import fmt_bytes
from utilities.measure.batch_search import SearchResult, Trial, all_ranks_agree, find_max_batch
from utilities.training import TrainStats

MIB = 2**20


def search(lesson: Lesson, code: SimpleNamespace, args: argparse.Namespace,
           budget_mib: float | None) -> SearchResult:
    """Double the batch from --start-batch until a trial is not clean, then bisect; each trial is
    one variant, freed before the next, and recorded with its verdict."""
    limit = args.max_batch or (256 if lesson.device.type == "cuda" else 32)
    budget = int(budget_mib * MIB) if budget_mib else None
    stats_by_batch: dict[int, TrainStats] = {}

    def trial(batch: int) -> Trial:
        with lesson.variant(f"batch-{batch}"):
            t, stats_by_batch[batch] = code.try_batch(lesson, batch)
        return t

    def log(t: Trial) -> None:
        rate = f"{t.throughput:.1f} samples/s" if t.throughput else "-"
        lesson.print(f"  batch {t.batch:>4} ({t.phase}): peak {fmt_bytes(t.peak_bytes)}, {rate}, "
                     f"retries {t.retries}, OOMs {t.ooms} -> {t.verdict}")

    lesson.print(f"search: batch {args.start_batch}..{limit}, budget "
                 f"{f'{budget_mib:g} MiB per rank' if budget else 'none (retries and OOMs decide)'}")
    result = find_max_batch(trial, start=args.start_batch, limit=limit, bisect=not args.no_bisect,
                            budget_bytes=budget, agree=all_ranks_agree, on_trial=log)
    for t in result.trials:
        lesson.results.add(f"batch-{t.batch}", stats_by_batch.get(t.batch), batch=t.batch,
                           samples_per_s=None if t.throughput is None else round(t.throughput, 2),
                           peak_bytes=t.peak_bytes, retries=t.retries, ooms=t.ooms,
                           over_budget=t.over_budget, max_reserved=t.max_reserved_bytes,
                           clean=t.clean, verdict=t.verdict, phase=t.phase, error=t.error)
    return result
