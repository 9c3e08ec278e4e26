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

from utilities.activation_checkpointing import apply_activation_checkpointing, block_units
from utilities.course.lesson import CPU_MODEL, Lesson, lesson_parser
from utilities.measure import fmt_bytes
from utilities.measure.planner import largest_batch, parse_memory, plan
from utilities.models import get_model_spec
from utilities.precision import fsdp2_policy

VARIANTS = {
    # name: (strategy, precision, activation checkpointing)
    "full_shard-fp32": ("full_shard", "fp32", "none"),
    "shard_grad_op-fp32": ("shard_grad_op", "fp32", "none"),
    "full_shard-bf16-ac": ("full_shard", "bf16", "full"),
}
CATS = ("total", "parameters", "gradients", "optimizer", "activations")
GPU_MODEL, BATCH, GPU_BATCH = "llama-1b", 4, 2
BIG = dict(gpus=8, gpu_memory="80GB", strategy="full_shard", precision="bf16", ac="full", seq=8192)


def parse_args(argv=None):
    p = lesson_parser(__doc__)
    p.add_variants(VARIANTS)
    return p.parse(argv)


def _jobs(args) -> list[tuple[str, dict]]:
    """Every plan the lesson makes, as (key, plan() keywords); computed before any process group
    exists (plan() creates its own fake one), shared out over the ranks."""
    on_gpu = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    name = args.model or (GPU_MODEL if on_gpu and not args.quick else CPU_MODEL)
    spec = get_model_spec(name)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    batch = args.batch_size or (GPU_BATCH if on_gpu and not args.quick else BATCH)
    seq = args.seq_len or spec.default_seq_len
    jobs = [(v, dict(model=name, gpus=world, gpu_memory_bytes=parse_memory("80GB"), strategy=s,
                     precision=p, ac=ac, batch=batch, seq=seq, device_type="cuda" if on_gpu else "cpu"))
            for v, (s, p, ac) in VARIANTS.items() if v in args.variants]
    big = dict(BIG, gpu_memory_bytes=parse_memory(BIG["gpu_memory"]))
    big.pop("gpu_memory")
    jobs.append(("llama-8b-8x80GB-batch2", dict(big, model="llama-8b", batch=2)))
    if not args.quick:
        jobs.append(("llama-1b-8x80GB-batch8", dict(big, model="llama-1b", batch=8)))
        jobs.append(("llama-8b-8x80GB-largest-batch", dict(big, model="llama-8b", batch=None)))
    return jobs


def _run_job(key: str, kw: dict) -> dict:
    if kw["batch"] is None:
        kw = dict(kw)
        kw.pop("batch")
        best, p = largest_batch(**kw)
        return dict(p.as_dict(), largest_batch=best)
    return plan(**kw).as_dict()


def predict(args) -> dict[str, dict]:
    """This rank's share of the plans (the biggest ones on the last rank), keyed by name."""
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    jobs = _jobs(args)
    small = [j for j in jobs if j[0] in VARIANTS]
    big = [j for j in jobs if j[0] not in VARIANTS]
    mine = small if rank == 0 else []  # rank 0 plans the small models it will also train...
    mine += [j for i, j in enumerate(big) if i % world == world - 1 - rank]  # ...the last, the big
    return {key: _run_job(key, kw) for key, kw in mine}


def main(args) -> None:
    mine = predict(args)  # before the Lesson joins the real process group
    with Lesson("14", args) as L:
        plans: dict[str, dict] = {}
        if dist.is_initialized() and L.dist.world_size > 1:
            gathered: list = [None] * L.dist.world_size
            dist.all_gather_object(gathered, mine)
            for part in gathered:
                plans.update(part)
        else:
            plans = mine
        block = L.spec.block_class()
        for name in args.variants:
            with L.variant(name):  # everything the variant made is freed before the next one
                strategy, precision, ac = VARIANTS[name]
                model = L.build_model()
                if ac != "none":
                    apply_activation_checkpointing(model, block, every=1 if ac == "full" else 2)
                opts = dict(reshard_after_forward=strategy == "full_shard",
                            mp_policy=fsdp2_policy(precision))
                from torch.distributed.fsdp import fully_shard

                for unit in block_units(model, block):
                    fully_shard(unit, **opts)
                fully_shard(model, **opts)
                model = L.materialize(model)
                stats = L.train(model, name)
                measured = stats.peak_memory_bytes
                predicted = plans[name]["peak_bytes"]
                ratio = {c: (predicted[c] / measured[c] if measured[c] else None) for c in CATS}
                L.results.add(name, stats, strategy=strategy, precision=precision, ac=ac,
                              predicted_peak_bytes=predicted, predicted_detail=plans[name]["detail"],
                              prediction_ratio=ratio)
                L.print(f"    predicted {fmt_bytes(predicted['total'])}, measured "
                        f"{fmt_bytes(measured['total'])}: ratio {ratio['total']:.3f}")
                del model, unit  # the last block (``unit``) reaches the whole model

        big = {k: v for k, v in plans.items() if k not in VARIANTS}
        L.results.data["plans"] = big
        for key, p in big.items():
            extra = f", largest batch {p['largest_batch']}" if "largest_batch" in p else ""
            L.print(f"  plan {key}: peak {fmt_bytes(p['peak_bytes']['total'])} per rank of "
                    f"{fmt_bytes(p['budget_bytes'])} budget, fits={p['fits']}{extra}")
        L.results.note("predicted_peak_bytes: utilities.measure.planner.plan() (FSDPMemTracker on fake "
                       "tensors with a fake process group, one process); measured: the same "
                       "tracker on the real run's tensors. prediction_ratio = predicted/measured.")
        if L.device.type == "cpu":
            L.results.note("CPU run: the prediction is checked against the tracker on real CPU "
                           "tensors, not against torch.cuda.max_memory_allocated (no GPU here).")


if __name__ == "__main__":
    main(parse_args())
