"""Lesson 14: memory planning without the hardware.

Before renting 8 GPUs, ask whether the job fits. ``utilities.measure.planner.plan`` answers by running one
real training step of the real model in one process, with a fake process group (it plays rank 0 of
N ranks) and fake tensors (shapes and dtypes, no storage), under FSDPMemTracker. Nothing is
estimated by formula; a laptop plans llama-8b on 8 x 80 GB.

This script checks the planner against a measurement: for each configuration it first *predicts*
the per-rank peak (before any process group exists), then trains the same configuration for real
on the lesson's ranks and measures the peak with the same tracker on real tensors, and records the
ratio per category. It also plans a few real-size models (llama-8b on 8 x 80 GB; more without
--quick: llama-1b, and the largest llama-8b batch that fits).

Run: fsdp-course run 14 [--quick]   or   torchrun --nproc-per-node 2 memory_planner.py --device cpu
Plan anything: fsdp-course plan --model llama-8b --gpus 8 --gpu-memory 80GB --ac full --batch 2 --seq 8192
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without install

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from utilities.activation_checkpointing import (
    apply_activation_checkpointing,
    apply_op_selective_checkpointing,
    block_units,
)
from utilities.course.catalog import LESSONS
from utilities.course.lesson import Lesson, lesson_parser
from utilities.distributed import pin_cuda_device, world_mesh
from utilities.measure import fmt_bytes
from utilities.measure.planner import largest_batch, parse_memory, plan
from utilities.models import get_model_spec
from utilities.precision import fsdp2_policy

CATS = ("total", "parameters", "gradients", "optimizer", "activations")


# -- the code this lesson teaches ----------------------------------------------------------------
def predict(model: str, gpus: int, strategy: str, precision: str, ac: str, batch: int, seq: int,
            device_type: str) -> dict:
    """The plan: one real training step of ``model`` in this process, playing rank 0 of ``gpus``
    (fake process group) on fake tensors (no storage), under FSDPMemTracker. It must run before
    the lesson joins its real process group: plan() makes its own fake one."""
    p = plan(model, gpus=gpus, gpu_memory_bytes=parse_memory("80GB"), strategy=strategy,
             precision=precision, ac=ac, batch=batch, seq=seq, device_type=device_type)
    return p.as_dict()  # peak_bytes per category, detail, budget_bytes, fits, overflowing, ...


def shard(model: nn.Module, block_class: type[nn.Module], strategy: str, precision: str,
          ac: str) -> nn.Module:
    """The same configuration for real, as plan() builds it: activation checkpointing first, then
    fully_shard each block (its checkpoint wrapper, if any) and the root."""
    if ac == "selective":  # op-level: matmul and attention outputs kept, the rest recomputed
        apply_op_selective_checkpointing(model, block_class)
    elif ac != "none":  # "full": every block; "every-2nd-block": half of them
        apply_activation_checkpointing(model, block_class, every=1 if ac == "full" else 2)
    opts = dict(reshard_after_forward=strategy == "full_shard", mp_policy=fsdp2_policy(precision),
                mesh=world_mesh())  # every rank, on this run's device (not the machine's GPU)
    for unit in block_units(model, block_class):
        fully_shard(unit, **opts)
    fully_shard(model, **opts)
    return model


def compare(predicted: dict[str, int], measured: dict[str, int]) -> dict[str, float | None]:
    """prediction_ratio per category: predicted / measured at the peak (1.0: exact)."""
    return {c: predicted[c] / measured[c] if measured[c] else None for c in CATS}


# -- the lesson's configurations -----------------------------------------------------------------
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


def parse_args(argv=None):
    p = lesson_parser(__doc__)
    p.add_variants(VARIANTS)
    return p.parse(argv)


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


def my_plans(args) -> dict[str, dict]:
    """This rank's share of the plans, dealt round the ranks (a planned llama-8b step takes half a
    minute of CPU; the ranks gather them all before training)."""
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


def main(args) -> None:
    lesson = Lesson("14", args, notes=(NOTE,), cpu_note=CPU_NOTE, takeaway=takeaway)
    if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()):
        pin_cuda_device()  # the planner's meshes must find this rank's GPU, not GPU LOCAL_RANK
    mine = my_plans(args)  # before the lesson joins the real process group
    with lesson as lesson:
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
            ratio = compare(predicted, stats.peak_memory_bytes)
            lesson.print(f"    predicted {fmt_bytes(predicted['total'])}, measured "
                         f"{fmt_bytes(stats.peak_memory_bytes['total'])}: ratio {ratio['total']:.3f}")
            return dict(strategy=strategy, precision=precision, ac=ac, predicted_peak_bytes=predicted,
                        predicted_detail=plans[name]["detail"], prediction_ratio=ratio,
                        predicted_peak_total_bytes=predicted["total"],
                        predicted_over_measured_ratio=ratio["total"])

        lesson.run_variants(args.variants, lambda name: shard(lesson.build_model(), block, *VARIANTS[name]),
                            describe=describe)
        big = lesson.results.record("plans", {k: v for k, v in plans.items() if k not in VARIANTS})
        for key, p in big.items():
            extra = f", largest batch {p['largest_batch']}" if "largest_batch" in p else ""
            lesson.print(f"  plan {key}: peak {fmt_bytes(p['peak_bytes']['total'])} per rank of "
                         f"{fmt_bytes(p['budget_bytes'])} budget, fits={p['fits']}{extra}")


if __name__ == "__main__":
    main(parse_args())
