"""Lesson 02's driver: the six variants trained and measured, then the largest batch per rank
with no / every block checkpointed (lesson 05's search).

The checkpointing and sharding are the lesson script's functions (``activation_checkpointing.py``,
handed in as ``code``); here: which variants run, what is measured and how it becomes rows.
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

from torch import nn

from utilities.activation_checkpointing import checkpointed_blocks
from utilities.course.lesson import Lesson
from utilities.measure import fmt_bytes
from utilities.measure.batch_search import all_ranks_agree, find_max_batch, training_trial
from utilities.results import variant
from utilities.training import TrainStats


def run_variants_and_search(lesson: Lesson, args: argparse.Namespace, code: SimpleNamespace) -> None:
    """Each variant (api x none / selective / all), then the batch search (``--search on``)."""
    lesson.results.columns("checkpointed_blocks")
    lesson.print(f"block class: {lesson.spec.block_class().__name__}; "
                 f"selective = every {args.every} block(s)")
    every = {"none": None, "selective": args.every, "all": 1}  # which blocks are checkpointed

    def describe(name: str, model: nn.Module, stats: TrainStats) -> dict:
        mem, n = stats.peak_memory_bytes, checkpointed_blocks(model)
        lesson.print(f"    {n} checkpointed blocks, activations {fmt_bytes(mem.get('activations'))}, "
                     f"peak {fmt_bytes(mem.get('total'))}")
        return dict(api=name.split("-")[0], checkpointed_blocks=n)

    def build_variant(name: str) -> nn.Module:
        api, blocks = name.split("-")
        return build(lesson, code, api, every[blocks])

    lesson.run_variants(args.variants, build_variant, describe=describe)
    if args.search == "on":
        none = [v for v in lesson.results.data["variants"] if v["name"] == "fsdp2-none"]
        search_largest_batch(lesson, code, args, none[0]["peak_memory_bytes"].get("total") if none else None)


def build(lesson: Lesson, code: SimpleNamespace, api: str, every: int | None) -> nn.Module:
    """A fresh model, checkpointed every ``every``-th block (None: none) and sharded with ``api``."""
    block = lesson.spec.block_class()
    if api == "fsdp2":
        return lesson.materialize(code.fsdp2_checkpointed(lesson.build_model(), block, every))
    return lesson.materialize(code.fsdp1_checkpointed(lesson.build_model(), block, every, lesson.device))


def search_largest_batch(lesson: Lesson, code: SimpleNamespace, args: argparse.Namespace,
                         none_peak: int | None) -> None:
    """The largest clean batch per rank with FSDP2 and no / every block checkpointed (lesson 05's
    search). On GPU a trial fails on cudaMalloc retries or OOM; on CPU, where nothing retries, on
    going over a memory budget (the tracked peak). Against a budget the peak grows linearly with the
    batch, so after two trials the search tries the batch the line predicts, and the one above it."""
    on_gpu = lesson.device.type == "cuda"
    limit = args.search_limit or (256 if on_gpu else 48)  # CPU: 6x the quick batch is room enough
    budget = int(args.budget_mib * 2**20) if args.budget_mib else None
    if budget is None and not on_gpu:
        if none_peak is None:  # fsdp2-none was not among the variants: measure it here
            trial = training_trial(lesson.batch_size, lambda: build(lesson, code, "fsdp2", None),
                                   lesson.optimizer, lesson.data(), 2, lesson.device)
            none_peak = trial[0].peak_bytes
        budget = int(1.25 * none_peak)
    found = {}
    for which, every in (("none", None), ("all", 1)):
        def try_batch(batch: int, every=every):
            return training_trial(batch, lambda: build(lesson, code, "fsdp2", every), lesson.optimizer,
                                  lesson.data(batch_size=batch), 2 if not on_gpu else 4, lesson.device,
                                  lesson.dist.world_size)[0]

        result = find_max_batch(try_batch, start=lesson.batch_size, limit=limit, budget_bytes=budget,
                                predict=True, agree=all_ranks_agree)
        found[which] = {"best": result.best, "reason": result.reason,
                        "trials": [t.as_dict() for t in result.trials]}
        lesson.print(f"  largest batch per rank, {which} checkpointed: {result.best} ({result.reason})")
    lesson.results.record("batch_search", dict(
        budget_bytes=budget, limit=limit, api="fsdp2", **found,
        gain=round(found["all"]["best"] / found["none"]["best"], 2) if found["none"]["best"] else None))
    where = f"a budget of {fmt_bytes(budget)} per rank" if budget else "this GPU (no retries, no OOM)"
    lesson.results.note(f"batch_search: largest batch per rank in {where}: {found['none']['best']} "
                        f"without checkpointing, {found['all']['best']} with every block checkpointed.")


def takeaway(results: dict) -> str:
    """The lesson's point, from what the run measured (printed last)."""
    act = lambda name: fmt_bytes(variant(results, name)["peak_memory_bytes"]["activations"])  # noqa: E731
    line = (f"checkpointing every block: activations at the peak {act('fsdp2-none')} -> "
            f"{act('fsdp2-all')} (FSDP2), same losses")
    found = {k: v["best"] for k, v in (results.get("batch_search") or {}).items()
             if isinstance(v, dict) and "best" in v}
    if found:
        line += "; largest batch in the budget: " + ", ".join(f"{k} {b}" for k, b in found.items())
    return line
