"""What lesson 13 measures around its convert -> shard -> compile code (fp8_compile.py holds it).

* ``width_spec``: a Llama of a given width, for the sweep that finds where FP8 starts to pay;
* ``Stopwatch``: the first step, where compilation happens, timed apart from the others;
* ``compare``: compile time and speed-ups of each variant against its eager / compiled twin;
* ``crossover_hidden``: the smallest width from which a candidate beats its baseline for good;
* ``report_crossovers``: both crossovers (fp8 over compiled, compiled over eager) into results.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from utilities.models import ModelSpec, llama_shapes


def width_spec(hidden: int, layers: int, seq_len: int) -> ModelSpec:
    """A Llama of the given width: head dim 128 (64 below 1024), 4x fewer KV heads, FFN ~3.5x."""
    head_dim = 128 if hidden >= 1024 else 64
    heads = hidden // head_dim
    kv = max(1, heads // 4)
    inter = 16 * round(3.5 * hidden / 16)  # a multiple of 16, as FP8 GEMMs need
    return ModelSpec(f"llama-h{hidden}", "llama", block_class_name="LlamaDecoderLayer",
                     default_seq_len=seq_len, **llama_shapes(hidden, inter, layers, heads, kv))


def flops_per_token(spec: ModelSpec, params: int, seq_len: int) -> float:
    """6 FLOPs per parameter per token (forward + backward) plus attention's score matmuls."""
    cfg = spec.config()
    return 6.0 * params + 12.0 * cfg.num_hidden_layers * cfg.hidden_size * seq_len


class Stopwatch:
    """``with Stopwatch() as t: ...; t.seconds`` (synchronizes CUDA so GPU work is counted)."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.seconds = 0.0

    def __enter__(self) -> Stopwatch:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.seconds = time.perf_counter() - self._t0


def first_step_seconds(model: nn.Module, batch: dict[str, torch.Tensor], device: torch.device) -> float:
    """One forward and backward on its own batch, gradients dropped: compilation happens here, so
    every timed step of the training that follows runs compiled code."""
    with Stopwatch(device) as first:
        model(**batch).loss.backward()
    model.zero_grad(set_to_none=True)
    return first.seconds


def compare(variants: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """By variant name: ``compile_s`` = its first step minus eager's at the same width,
    ``speedup_vs_eager`` and, for fp8, ``speedup_vs_compiled`` (tokens/s ratios)."""
    by_name = {v["name"]: v for v in variants}
    columns: dict[str, dict[str, float]] = {}
    for v in variants:
        suffix = v["name"][len(v["variant"]):]
        row = {}
        eager = by_name.get("eager" + suffix)
        if v["variant"] != "eager" and eager is not None:
            row["compile_s"] = round(v["first_step_s"] - eager["first_step_s"], 3)
            row["speedup_vs_eager"] = round(v["tokens_per_s"] / eager["tokens_per_s"], 3)
        compiled = by_name.get("compiled" + suffix)
        if v["variant"] == "fp8-compiled" and compiled is not None:
            row["speedup_vs_compiled"] = round(v["tokens_per_s"] / compiled["tokens_per_s"], 3)
        if row:
            columns[v["name"]] = row
    return columns


def crossover_hidden(variants: list[dict[str, Any]], candidate: str, baseline: str) -> dict[str, Any]:
    """Where ``candidate`` starts to pay over ``baseline`` (e.g. fp8-compiled over compiled).

    ``variants`` are results.json variants with ``variant``, ``hidden`` and ``tokens_per_s``. For
    every width measured with both, the ratio candidate / baseline tokens/s; the crossover is the
    smallest width from which the candidate is faster at that width *and every wider one measured*
    (a single lucky width below a slower one is not a crossover). Returns ``{"hidden": int | None,
    "ratios": {width: ratio}, "why": str}``; ``hidden`` is None when the candidate never pays at
    the widest width, or when no width has both."""
    tps = {(v["variant"], v.get("hidden")): v.get("tokens_per_s") for v in variants}
    ratios = {h: tps[(candidate, h)] / tps[(baseline, h)]
              for (name, h) in tps if name == candidate and h is not None
              and tps.get((candidate, h)) and tps.get((baseline, h))}
    widths = sorted(ratios)
    hidden = None
    for h in reversed(widths):
        if ratios[h] <= 1.0:
            break
        hidden = h
    if not widths:
        why = f"no width was measured with both {candidate} and {baseline}"
    elif hidden is None:
        why = (f"{candidate} was not faster than {baseline} at the widest width measured "
               f"({widths[-1]}): the crossover, if any, is above it")
    elif hidden == widths[0]:
        why = (f"{candidate} was faster at every width measured: the crossover is at or below "
               f"{hidden}")
    else:
        below = max(h for h in widths if h < hidden)
        why = f"{candidate} is slower at {below} and faster from {hidden} on"
    return {"hidden": hidden, "ratios": {h: round(r, 4) for h, r in sorted(ratios.items())}, "why": why}


def report_crossovers(lesson, chosen: list[str], fp8_skipped: str | None) -> None:
    """Where FP8 starts to pay over compiled bf16, and compile over eager, from a width sweep's
    rows: ``<key>_crossover_hidden`` and ``<key>_crossover`` in results.json, printed and noted."""
    for key, candidate, baseline in (("fp8", "fp8-compiled", "compiled"),
                                     ("compile", "compiled", "eager")):
        if candidate not in chosen or baseline not in chosen:
            continue
        if candidate == "fp8-compiled" and fp8_skipped:
            found = {"hidden": None, "ratios": {}, "why": f"fp8-compiled skipped: {fp8_skipped}"}
        else:
            found = crossover_hidden(lesson.results.data["variants"], candidate, baseline)
        lesson.results.record(f"{key}_crossover_hidden", found["hidden"])
        lesson.results.record(f"{key}_crossover", found)
        ratios = "".join(f", h{h}: {r:.2f}x" for h, r in found["ratios"].items())
        lesson.print(f"  {key} crossover (tokens/s {candidate} / {baseline}{ratios}): "
                     f"{found['hidden'] if found['hidden'] is not None else 'none'} ({found['why']})")
        lesson.results.note(f"{key}_crossover_hidden = {found['hidden']}: {found['why']}")
