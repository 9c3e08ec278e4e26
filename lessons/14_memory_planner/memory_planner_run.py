"""Lesson 14's driver: the plans made (dealt round the ranks, before the process group), each
configuration run and its measured peak held against its plan, and the real-size plans recorded.

``predict``, ``shard`` and ``compare`` are the lesson script's functions (``memory_planner.py``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn

from utilities.course.catalog import LESSONS
from utilities.course.lesson import Lesson
from utilities.measure import fmt_bytes
from utilities.measure.planner import largest_batch, parse_memory, plan
from utilities.models import get_model_spec

VARIANTS = {
    # name: (strategy, precision, activation checkpointing)
    "full_shard-fp32": ("full_shard", "fp32", "none"),
    "shard_grad_op-fp32": ("shard_grad_op", "fp32", "none"),
    "full_shard-bf16-ac": ("full_shard", "bf16", "full"),
}
BIG = dict(gpus=8, gpu_memory_bytes=parse_memory("80GB"), strategy="full_shard", precision="bf16",
           ac="full", seq=8192)
NOTE = ("predicted_peak_bytes: utilities.measure.planner.plan() (FSDPMemTracker on fake tensors with "
        "a fake process group, one process); measured: the same tracker on the real run's tensors. "
        "prediction_ratio = predicted/measured.")
CPU_NOTE = ("CPU run: the prediction is checked against the tracker on real CPU tensors, not against "
            "torch.cuda.max_memory_allocated (no GPU here).")


def plan_jobs(args) -> list[tuple[str, dict]]:
    """Every plan the lesson makes, as (key, keywords): the lesson's configurations at the run's
    model, ranks, batch and sequence (the catalog's defaults unless flags say otherwise), then a few
    real-size ones without --quick (llama-8b and llama-1b on 8 x 80 GB, the largest llama-8b batch)."""
    on_gpu = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    run = LESSONS["14"].run
    name = args.model or run.model(on_gpu, args.quick)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    batch = args.batch_size or run.batch(on_gpu, args.quick)
    seq = args.seq_len or get_model_spec(name).default_seq_len
    jobs = [(v, dict(model=name, gpus=world, strategy=s, precision=p, ac=ac, batch=batch, seq=seq,
                     device_type="cuda" if on_gpu else "cpu"))
            for v, (s, p, ac) in VARIANTS.items() if v in args.variants]
    if not args.quick:  # a planned llama-8b step takes half a minute of CPU
        jobs.append(("llama-8b-8x80GB-batch2", dict(BIG, model="llama-8b", batch=2)))
        jobs.append(("llama-1b-8x80GB-batch8", dict(BIG, model="llama-1b", batch=8)))
        jobs.append(("llama-8b-8x80GB-largest-batch", dict(BIG, model="llama-8b", batch=None)))
    return jobs


def my_plans(args, predict: Callable[..., dict]) -> dict[str, dict]:
    """This rank's share of the plans, dealt round the ranks (a planned llama-8b step takes half a
    minute of CPU; the ranks gather them all before training); ``predict``: the lesson's."""
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    plans = {}
    for i, (key, kw) in enumerate(plan_jobs(args)):
        if i % world != rank:
            continue
        if key in VARIANTS:
            plans[key] = predict(**kw)
        elif kw["batch"] is None:  # the largest batch that fits, and its plan
            best, p = largest_batch(**{k: v for k, v in kw.items() if k != "batch"})
            plans[key] = dict(p.as_dict(), largest_batch=best)
        else:
            plans[key] = plan(**kw).as_dict()
    return plans


def takeaway(results: dict) -> str:
    """The lesson's point, from what the run measured (printed last)."""
    ratios = [v["predicted_over_measured_ratio"] for v in results["variants"]]
    return (f"the plan predicts the measured peak within {max(abs(x - 1) for x in ratios):.1%} "
            f"({len(ratios)} configurations)")


def run_variants(lesson: Lesson, mine: dict[str, dict], code: SimpleNamespace) -> None:
    """Every rank's plans gathered; each configuration sharded by the lesson's ``shard``, trained,
    its measured peak held against the plan (``compare``; both handed in as ``code``); the real-size
    plans recorded."""
    plans = dict(mine)
    if dist.is_initialized() and lesson.dist.world_size > 1:
        gathered: list = [None] * lesson.dist.world_size
        dist.all_gather_object(gathered, mine)
        for part in gathered:
            plans.update(part)
    lesson.results.columns("predicted_over_measured_ratio", "predicted_peak_total_bytes")
    block = lesson.spec.block_class()

    def describe(name: str, model: nn.Module, stats) -> dict:
        strategy, precision, ac = VARIANTS[name]
        predicted = plans[name]["peak_bytes"]
        ratio = code.compare(predicted, stats.peak_memory_bytes)
        lesson.print(f"    predicted {fmt_bytes(predicted['total'])}, measured "
                     f"{fmt_bytes(stats.peak_memory_bytes['total'])}: ratio {ratio['total']:.3f}")
        return dict(strategy=strategy, precision=precision, ac=ac, predicted_peak_bytes=predicted,
                    predicted_detail=plans[name]["detail"], prediction_ratio=ratio,
                    predicted_peak_total_bytes=predicted["total"],
                    predicted_over_measured_ratio=ratio["total"])

    lesson.run_variants(lesson.args.variants,
                        lambda name: code.shard(lesson.build_model(), block, *VARIANTS[name]),
                        describe=describe)
    big = lesson.results.record("plans", {k: v for k, v in plans.items() if k not in VARIANTS})
    for key, p in big.items():
        extra = f", largest batch {p['largest_batch']}" if "largest_batch" in p else ""
        lesson.print(f"  plan {key}: peak {fmt_bytes(p['peak_bytes']['total'])} per rank of "
                     f"{fmt_bytes(p['budget_bytes'])} budget, fits={p['fits']}{extra}")
