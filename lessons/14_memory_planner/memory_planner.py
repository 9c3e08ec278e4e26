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

import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without install

import torch
from memory_planner_run import CPU_NOTE, NOTE, VARIANTS, my_plans, run_variants, takeaway
from torch import nn
from torch.distributed.fsdp import fully_shard

from utilities.activation_checkpointing import (
    apply_activation_checkpointing,
    apply_op_selective_checkpointing,
    block_units,
)
from utilities.course.lesson import Lesson, lesson_parser
from utilities.distributed import pin_cuda_device, world_mesh
from utilities.measure.planner import parse_memory, plan
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


# -- the lesson run: the configurations and the plans (memory_planner_run.py) ----------------
def parse_args(argv=None):
    p = lesson_parser(__doc__)
    p.add_variants(VARIANTS)
    return p.parse(argv)


def main(args) -> None:
    lesson = Lesson("14", args, notes=(NOTE,), cpu_note=CPU_NOTE, takeaway=takeaway)
    if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()):
        pin_cuda_device()  # the planner's meshes must find this rank's GPU, not GPU LOCAL_RANK
    mine = my_plans(args, predict)  # before the lesson joins the real process group
    with lesson as lesson:
        run_variants(lesson, mine, SimpleNamespace(**globals()))  # the functions above, for the driver


if __name__ == "__main__":
    main(parse_args())
