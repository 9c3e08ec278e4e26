"""Lesson 01's driver: each wrapping trained and measured, its units counted.

The wrappings are the lesson script's functions (``auto_wrap.py``, handed in as ``code``); here:
what is measured around them and how it becomes rows.
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

from torch import nn

from utilities.course.lesson import Lesson
from utilities.measure import fmt_bytes, unsharded_parameter_bytes
from utilities.models import ModelSpec
from utilities.results import variant
from utilities.training import TrainStats
from utilities.wrapping import fsdp_units, unit_parameter_counts

POLICIES = {"one-unit": "whole", "per-block": "block", "size-based": "size",  # results.json "policy"
            "yours": "yours"}


def run_wrappings(lesson: Lesson, args: argparse.Namespace, code: SimpleNamespace) -> None:
    """Each variant's wrapping of a fresh model, trained; its units and unsharded peak measured."""
    lesson.results.columns("fsdp_units", "largest_unit_parameters", "peak_unsharded_parameter_bytes")
    block, per_block = lesson.spec.block_class(), parameters_per_block(lesson.spec)
    lesson.print(f"block class: {block.__name__} ({per_block:,} parameters per block)")
    wrappings = code.variants(block, args.min_params or per_block // 2, lesson.device, args.unit_classes)
    if args.unit_classes:
        args.variants = [*args.variants, "fsdp2-yours"]

    def describe(name: str, model: nn.Module, stats: TrainStats) -> dict:
        units = unit_parameter_counts(model)
        unsharded = unsharded_parameter_bytes(stats.peak_memory_bytes)
        lesson.print(f"    {len(units)} unit{'' if len(units) == 1 else 's'}, largest {max(units):,} "
                     f"params, unsharded params at peak {fmt_bytes(unsharded)}")
        api, kind = name.split("-", 1)
        return dict(api=api, policy=POLICIES[kind], fsdp_units=len(fsdp_units(model)),
                    largest_unit_parameters=max(units), peak_unsharded_parameter_bytes=unsharded)

    lesson.run_variants(args.variants, lambda name: wrappings[name](lesson.build_model()),
                        describe=describe)


def parameters_per_block(spec: ModelSpec) -> int:
    model = spec.build("meta")  # the structure only, no memory
    block = next(m for m in model.modules() if isinstance(m, spec.block_class()))
    return sum(p.numel() for p in block.parameters())


def takeaway(results: dict) -> str:
    """The lesson's point, from what the run measured (printed last)."""
    one, block = variant(results, "fsdp2-one-unit"), variant(results, "fsdp2-per-block")
    peak = lambda v: fmt_bytes(v["peak_memory_bytes"]["total"])  # noqa: E731
    return (f"per-block wrapping: {fmt_bytes(one['peak_unsharded_parameter_bytes'])} -> "
            f"{fmt_bytes(block['peak_unsharded_parameter_bytes'])} unsharded at the peak, "
            f"{peak(one)} -> {peak(block)} in all (FSDP2, {one['fsdp_units']} -> "
            f"{block['fsdp_units']} units)")
