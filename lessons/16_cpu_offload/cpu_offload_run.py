"""Lesson 16's driver: each variant sharded (with or without offload), trained, its state's
placement and its host <-> device copies counted, and made a row.

The wrapping is the lesson script's functions (``cpu_offload.py``, handed in as ``code``); here:
what is run and measured around them.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
from collections.abc import Iterator
from types import SimpleNamespace

import torch
from torch import nn

from utilities.course.lesson import Lesson
from utilities.measure import fmt_bytes
from utilities.measure.plan_options import PlanOptions
from utilities.measure.predictions import predict_from_arguments
from utilities.measure.transfers import count_copies, local_parameter_bytes, placement
from utilities.models import get_model_spec, init_weights
from utilities.results import variant
from utilities.training import default_step

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


def build(lesson: Lesson, name: str, pin_memory: bool, code: SimpleNamespace) -> nn.Module:
    """The model sharded as variant ``name`` says; an offloaded one is built on the CPU."""
    api, offload = VARIANTS[name]
    block = lesson.spec.block_class()
    model = lesson.build_model()
    if offload and not any(p.is_meta for p in model.parameters()):
        model = model.cpu()
    if api == "fsdp2":
        model = code.wrap_fsdp2(model, block, offload, pin_memory)
        if offload and any(p.is_meta for p in model.parameters()):  # a model too big for one host
            model.to_empty(device="cpu")
            lesson.seed()
            init_weights(model)
        return model
    return code.wrap_fsdp1(model, block, lesson.device, offload)


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


def run_variant(lesson: Lesson, name: str, pin_memory: bool, code: SimpleNamespace) -> None:
    api, offload = VARIANTS[name]
    with lesson.variant(name), pinning_stands_in(lesson.device, api, offload):
        model = lesson.materialize(build(lesson, name, pin_memory, code))
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


def pin_memory_setting(lesson: Lesson, args: argparse.Namespace) -> bool:
    """The table's columns, and --pin-memory resolved (auto: pinned on a GPU), checked and recorded."""
    lesson.results.columns("parameters_on", "optimizer_on", "to_device_copies",
                           "to_device_bytes", "to_host_copies", "to_host_bytes",
                           "to_device_moved_bytes", "to_host_moved_bytes")
    pin = lesson.device.type == "cuda" if args.pin_memory == "auto" else args.pin_memory == "true"
    lesson.check(not pin or lesson.device.type == "cuda", "--pin-memory", args.pin_memory,
                 "auto or false on a CPU (pinned host memory needs a GPU)")
    lesson.results.setting(pin_memory=pin)
    return pin


def prediction_knobs(code: SimpleNamespace, variants: list[str], block_class: type[nn.Module]
                     ) -> dict[str, dict]:
    """Each variant as the step-time model takes it. An FSDP2 variant is traced through
    ``wrap_fsdp2`` itself, with the page-locked shards a GPU run gets; the time model reads its
    CPUOffloadPolicy from the model it shards (the copies over PCIe, AdamW on the host CPU). The
    model traces FSDP2 only: FSDP1's offload is ``PlanOptions(offload=True)``, predicted the same
    way."""
    knobs = {}
    for name in variants:
        api, offload = VARIANTS[name]
        if api == "fsdp2":
            knobs[name] = {"parallelize": functools.partial(code.wrap_fsdp2, block_class=block_class,
                                                            offload=offload, pin_memory=True)}
        else:
            knobs[name] = {"plan_options": PlanOptions(offload=True)} if offload else {}
    return knobs


def prediction(args: argparse.Namespace, code: SimpleNamespace) -> dict | None:
    """The variants predicted on ``--predict-on`` (``predict_from_arguments``: rank 0, before the
    process group)."""
    if not args.variants or args.predict_on == "none":
        return None
    block = get_model_spec(args.predict_model).block_class()
    return predict_from_arguments(args, prediction_knobs(code, args.variants, block))
