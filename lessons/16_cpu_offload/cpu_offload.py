"""Lesson 16: CPU offload.

When the sharded training state still does not fit on the GPUs, FSDP can keep it in host memory:
the parameter shards, their gradients and the optimizer state live on the CPU, the optimizer step
runs there, and each step copies every parameter shard to the GPU before its all-gather (in forward,
and again in backward) and every gradient shard back after its reduce-scatter. GPU memory falls to
what is gathered plus the activations; the price is those copies over PCIe and an optimizer step
on the host CPU.

    fsdp2            fully_shard(block), fully_shard(model)              the state on the device
    fsdp2-offload    ... offload_policy=CPUOffloadPolicy(pin_memory=...)  the state on the host
    fsdp1            FullyShardedDataParallel(model, auto_wrap_policy)     the state on the device
    fsdp1-offload    ... cpu_offload=CPUOffload(offload_params=True)      the state on the host

For each variant the run records where every piece of state lives (parameters, gradients,
optimizer state, and whether the host copies are pinned), the host <-> device copies of one step,
counted (calls and bytes, each way), and the memory by category and the step time. On a CPU-only
run the host and the device are the same memory: placement and counts are what it shows; on a GPU
the same run shows the memory the offload saves and the time it costs.

Run: fsdp-course run 16 [--quick]   or   torchrun --nproc-per-node 2 cpu_offload.py --device cpu
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from cpu_offload_run import CPU_NOTE, NOTES, VARIANTS, pin_memory_setting, prediction, run_variant, takeaway
from torch import nn
from torch.distributed.fsdp import CPUOffload, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without install

from utilities.course.catalog import LESSONS
from utilities.course.lesson import Lesson, lesson_parser
from utilities.distributed import world_mesh
from utilities.measure.predictions import add_prediction_arguments
from utilities.torch_internals import cpu_offload_policy_class

CPUOffloadPolicy = cpu_offload_policy_class()  # torch.distributed.fsdp.CPUOffloadPolicy


# -- FSDP2: an offload policy on every fully_shard call --------------------------------------------
def wrap_fsdp2(model: nn.Module, block_class: type[nn.Module], offload: bool,
               pin_memory: bool, mp_policy: MixedPrecisionPolicy | None = None) -> nn.Module:
    """One unit per block, then the root. With ``offload`` every unit keeps its parameter shards,
    their gradients (and so the optimizer state) in host memory; ``pin_memory`` page-locks them so
    the copies to the GPU run asynchronously (it needs a GPU). The model must be on the CPU when
    ``fully_shard`` sees it: offloaded parameters are never on the GPU whole. ``mp_policy``: none
    in the lesson's runs (fp32); its cluster prediction passes bf16's."""
    mesh = world_mesh()
    policy = {"offload_policy": CPUOffloadPolicy(pin_memory=pin_memory)} if offload else {}
    if mp_policy is not None:
        policy["mp_policy"] = mp_policy
    for module in reversed(list(model.modules())):  # inner modules before outer ones
        if isinstance(module, block_class):
            fully_shard(module, mesh=mesh, **policy)
    fully_shard(model, mesh=mesh, **policy)
    return model


# -- FSDP1: one CPUOffload argument on the wrapper -------------------------------------------------
def wrap_fsdp1(model: nn.Module, block_class: type[nn.Module], device: torch.device,
               offload: bool) -> FSDP:
    """One unit per block. ``CPUOffload(offload_params=True)`` keeps each unit's flat parameter
    shard and its gradient on the host (FSDP1 pins them itself when a GPU is there); the
    optimizer, built on these parameters, keeps its state there too."""
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={block_class})
    return FSDP(model, auto_wrap_policy=policy, device_id=device,
                cpu_offload=CPUOffload(offload_params=offload))


# -- the lesson run -------------------------------------------------------------------------------
def main(args: argparse.Namespace) -> None:
    code = SimpleNamespace(**globals())  # the functions above, for the driver
    predicted = prediction(args, code)  # rank 0, before the group
    with Lesson("16", args, needs_ranks="sharding before offloading", notes=NOTES,
                cpu_note=CPU_NOTE, takeaway=takeaway) as lesson:
        pin = pin_memory_setting(lesson, args)
        for name in args.variants:
            run_variant(lesson, name, pin, code)
        lesson.results.predicted(predicted)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = lesson_parser(__doc__)
    p.add_variants(VARIANTS)
    p.add_argument("--pin-memory", default="auto", choices=("auto", "true", "false"),
                   help="FSDP2's CPUOffloadPolicy(pin_memory=...): page-locked host shards, "
                        "asynchronous copies (auto: true on a GPU, false on CPU, where nothing "
                        "can be pinned)")
    add_prediction_arguments(p, LESSONS["16"].run.gpu_model, LESSONS["16"].run.gpu_batch_size)
    args = p.parse(argv)
    on_cpu = args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available())
    if args.pin_memory == "true" and on_cpu:
        p.exit(2, "error: --pin-memory 'true' is not allowed; allowed: auto or false on a CPU "
                  "(pinned host memory needs a GPU)\n")
    return args


if __name__ == "__main__":
    main(parse_args())
