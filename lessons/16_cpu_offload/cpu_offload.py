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
import contextlib
import functools
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffload, fully_shard
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without install

from utilities.course.catalog import LESSONS
from utilities.course.lesson import Lesson, lesson_parser
from utilities.distributed import world_mesh
from utilities.measure import fmt_bytes
from utilities.measure.plan_options import PlanOptions
from utilities.measure.predictions import add_prediction_arguments, predict_from_arguments
from utilities.measure.transfers import count_copies, local_parameter_bytes, placement
from utilities.models import init_weights
from utilities.results import variant
from utilities.torch_internals import cpu_offload_policy_class
from utilities.training import default_step

CPUOffloadPolicy = cpu_offload_policy_class()  # torch.distributed.fsdp.CPUOffloadPolicy


# -- FSDP2: an offload policy on every fully_shard call --------------------------------------------
def wrap_fsdp2(model: nn.Module, block_class: type[nn.Module], offload: bool,
               pin_memory: bool) -> nn.Module:
    """One unit per block, then the root. With ``offload`` every unit keeps its parameter shards,
    their gradients (and so the optimizer state) in host memory; ``pin_memory`` page-locks them so
    the copies to the GPU run asynchronously (it needs a GPU). The model must be on the CPU when
    ``fully_shard`` sees it: offloaded parameters are never on the GPU whole."""
    mesh = world_mesh()
    policy = {"offload_policy": CPUOffloadPolicy(pin_memory=pin_memory)} if offload else {}
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


# -- the comparison ---------------------------------------------------------------------------------
VARIANTS = {"fsdp2": ("fsdp2", False), "fsdp2-offload": ("fsdp2", True),
            "fsdp1": ("fsdp1", False), "fsdp1-offload": ("fsdp1", True)}
NOTES = ("to_device / to_host: the copies one step issued each way (FSDP2 one per parameter, FSDP1 "
         "one per unit), with their bytes; moved: the bytes that changed place.",
         "The prediction on a cluster is `fsdp-course plan --offload`'s time model: the copies over "
         "PCIe and AdamW on the host, with their assumptions.")
CPU_NOTE = ("CPU run: the host and the device are the same memory, so offloading frees no memory "
            "and its copies move little or nothing: the placement and the copies counted are the "
            "mechanism; the memory it saves and the time it costs show on a GPU. fsdp1-offload: "
            "FSDP1 pins its host shards unconditionally and nothing can be pinned without an "
            "accelerator, so pin_memory() returns the tensor itself during that variant, and the "
            "CPU stream's synchronize (FSDP1 waits on the device's stream after backward) waits for "
            "nothing; the copies and the placement are FSDP1's own.")


def build(lesson: Lesson, name: str, pin_memory: bool) -> nn.Module:
    """The model sharded as variant ``name`` says; an offloaded one is built on the CPU."""
    api, offload = VARIANTS[name]
    block = lesson.spec.block_class()
    model = lesson.build_model()
    if offload and not any(p.is_meta for p in model.parameters()):
        model = model.cpu()
    if api == "fsdp2":
        model = wrap_fsdp2(model, block, offload, pin_memory)
        if offload and any(p.is_meta for p in model.parameters()):  # a model too big for one host
            model.to_empty(device="cpu")
            lesson.seed()
            init_weights(model)
        return model
    return wrap_fsdp1(model, block, lesson.device, offload)


def counted_step(counts: dict, at: int):
    """The training step, with the host <-> device copies of call ``at`` counted into ``counts``."""
    calls = [0]

    def step(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        calls[0] += 1
        if calls[0] - 1 != at:
            return default_step(model, batch)
        with count_copies(model) as count:
            loss = default_step(model, batch)
        counts.update(count.as_dict())
        return loss

    return step


@contextlib.contextmanager
def pinning_stands_in(device: torch.device, api: str, offload: bool) -> Iterator[None]:
    """FSDP1's offload assumes an accelerator: it pins its host shards unconditionally and waits
    on the compute device's stream after backward. With ``--device cpu`` the CPU's stream has no
    ``synchronize``, and a CPU-only torch cannot pin: while FSDP1 offloads there, the stream gets a
    ``synchronize`` that waits for nothing (the CPU runs in order) and, without CUDA,
    ``pin_memory()`` returns the tensor itself; the run says so. The copies and the placement are
    FSDP1's own."""
    if device.type != "cpu" or api != "fsdp1" or not offload:
        yield
        return
    stream = type(torch.cpu.current_stream())
    pin, had_sync = torch.Tensor.pin_memory, hasattr(stream, "synchronize")
    if not torch.cuda.is_available():
        torch.Tensor.pin_memory = lambda self, *args, **kwargs: self
    if not had_sync:
        stream.synchronize = lambda self: None
    try:
        yield
    finally:
        torch.Tensor.pin_memory = pin
        if not had_sync:
            del stream.synchronize


def run_variant(lesson: Lesson, name: str, pin_memory: bool) -> None:
    api, offload = VARIANTS[name]
    with lesson.variant(name), pinning_stands_in(lesson.device, api, offload):
        model = lesson.materialize(build(lesson, name, pin_memory))
        optimizer = lesson.optimizer(model)
        counts: dict = {}
        stats = lesson.train(model, name, optimizer=optimizer,
                             step_fn=counted_step(counts, at=min(1, lesson.steps - 1)))
        where = placement(model, optimizer)
        lesson.print(f"    parameters on {where['parameters']}, gradients on {where['gradients']}, "
                     f"optimizer state on {where['optimizer']}; per step "
                     f"{counts['to_device_copies']} copies to the device "
                     f"({fmt_bytes(counts['to_device_bytes'])}), {counts['to_host_copies']} to the "
                     f"host ({fmt_bytes(counts['to_host_bytes'])})")
        lesson.results.add(name, stats, api=api, offload=offload,
                           pin_memory=pin_memory if offload else None,
                           parameters_on=where["parameters"], gradients_on=where["gradients"],
                           optimizer_on=where["optimizer"], pinned=where["pinned"],
                           sharded_bytes=local_parameter_bytes(model), **counts)
        del model, optimizer, stats


def takeaway(results: dict) -> str:
    """The lesson's point, from what the run measured (printed last)."""
    base, off = variant(results, "fsdp2"), variant(results, "fsdp2-offload")
    shards = off["sharded_bytes"]
    line = (f"FSDP2 offload issued {off['to_device_copies']} copies to the device per step "
            f"({fmt_bytes(off['to_device_bytes'])}, {off['to_device_bytes'] / shards:.2f}x the "
            f"parameter shards: forward and backward gathers) and {off['to_host_copies']} to the "
            f"host ({fmt_bytes(off['to_host_bytes'])}, {off['to_host_bytes'] / shards:.2f}x: the "
            f"gradients); without offload {base['to_device_copies'] + base['to_host_copies']}")
    if results["device"] == "cuda":
        peak = lambda v: fmt_bytes(v["peak_memory_bytes"]["total"])  # noqa: E731
        return (f"{line}; state on {off['parameters_on']} (without: {base['parameters_on']}), GPU "
                f"peak {peak(base)} -> {peak(off)}, step {base['step_time_s'] * 1e3:.0f} -> "
                f"{off['step_time_s'] * 1e3:.0f} ms")
    moved = off["to_device_moved_bytes"] + off["to_host_moved_bytes"]
    return f"{line}; here they moved {fmt_bytes(moved)}: host and device are one memory"


def prediction_knobs(variants: list[str]) -> dict[str, dict]:
    """Each variant as the step-time model takes it: offload moves the shards, gradients and the
    optimizer step to the host (``PlanOptions(offload=True)``: the copies over PCIe and AdamW on
    the host CPU). The model plans FSDP2; FSDP1's offload is predicted the same way."""
    return {name: {"plan_options": PlanOptions(offload=offload)} if offload else {}
            for name, (_api, offload) in VARIANTS.items() if name in variants}


def main(args: argparse.Namespace) -> None:
    knobs = prediction_knobs(args.variants)
    predicted = predict_from_arguments(args, knobs) if knobs else None  # rank 0, before the group
    with Lesson("16", args, needs_ranks="sharding before offloading", notes=NOTES,
                cpu_note=CPU_NOTE, takeaway=takeaway) as lesson:
        lesson.results.columns("parameters_on", "optimizer_on", "to_device_copies",
                               "to_device_bytes", "to_host_copies", "to_host_bytes",
                               "to_device_moved_bytes", "to_host_moved_bytes")
        pin = lesson.device.type == "cuda" if args.pin_memory == "auto" else args.pin_memory == "true"
        lesson.check(not pin or lesson.device.type == "cuda", "--pin-memory", args.pin_memory,
                     "auto or false on a CPU (pinned host memory needs a GPU)")
        lesson.results.setting(pin_memory=pin)
        for name in args.variants:
            run_variant(lesson, name, pin)
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
