"""What a lesson's committed run claims, which any run of the lesson must reproduce: the check
behind every ``test_readme_table_is_reproduced_by_the_quick_run`` (``conftest``).

The committed runs were made on another machine, and this module is the one home of how far a
number made there may be from the same number made here (``differences``): counts, sizes, dtypes
and parameter or optimizer bytes exactly; losses within the rounding of their precision
(``loss_tolerance``); the memory at the peak within one short-lived tensor's timing
(``PEAK_TIMING_SHARE``); a prediction of the step-time model within ``MODEL_ARITHMETIC_RTOL``."""

from __future__ import annotations

import math
from typing import Any

from utilities.course.catalog import LESSONS, Claims

Row = dict[str, Any]

# What a variant's row claims beyond the memory at the peak (sizes, counts, dtypes, bytes,
# differences within one run) is the lesson's catalog entry's ``Claims``, compared by ``differences``.
PEAK_PARTS = ("total_without_all_gather", "parameters", "optimizer", "activations")


def row_claims(lesson_claims: Claims, v: Row) -> dict[str, Any]:
    """A row's claims: its ``columns`` as they are, and its ``named`` columns under their names
    (``KeyError`` when the row lacks one: a summary row claims only its peak)."""
    out = {key: v.get(key) for key in lesson_claims.columns}
    out.update({name: v[key] for name, key in lesson_claims.named})
    return out


# The bits after the point of each precision a loss is computed in (fp32's 23, bf16's 7, fp16's 10).
MANTISSA_BITS = {"fp32": 23, "bf16": 7, "fp16": 10}
# An fp32 loss another machine computed may be this many units in the last place (ulps) away per
# optimizer step taken before it. Another CPU's kernels or thread count sum in another order (a
# few ulps in the first forward), and training carries the difference on: AdamW's first steps
# divide a gradient by its own size, so a rounding in a near-zero gradient moves that weight by up
# to the learning rate. Seen: lesson 03's next loss after 3 steps, 13 ulps apart on a learner's
# 2-core AMD EPYC; on one machine, lesson 06's committed 4-rank and 2-rank runs of the same model,
# 1, 0, 8 and 54 ulps apart at steps 0-3. At lesson 10's 30 steps this allows 1920
# ulps, at most 0.023% of the loss: a loss 1% off is still far outside.
FP32_ULPS_PER_STEP = 64
# The memory at the peak can catch one more short-lived tensor when gloo's thread finishes a
# collective later (seen on a loaded 2-core machine: lesson 01's activations +0.56 MiB, 1.5 logits'
# worth): these parts may differ by this share of the committed value; the parameters and the
# optimizer state at the peak are exact.
PEAK_TIMING_SHARE = {"activations": 0.03, "total_without_all_gather": 0.03}
# The step-time model is float64 arithmetic on exact counts and fixed efficiencies: the same on
# every machine but for the last bits of libm's functions (1e-16). A prediction may differ from the
# committed one by this share; any change of the model's inputs or formulas moves it further.
MODEL_ARITHMETIC_RTOL = 1e-6


class Loss(float):
    """A loss with what its tolerance needs: the precision it was computed in and the optimizer
    steps taken before it (a ``float`` still: it compares, prints and serialises as one)."""

    precision: str
    steps: int

    def __new__(cls, value: float, precision: str, steps: int) -> Loss:
        loss = super().__new__(cls, value)
        loss.precision, loss.steps = precision, steps
        return loss

    def __getnewargs__(self) -> tuple[float, str, int]:
        return float(self), self.precision, self.steps


def ulp(value: float, mantissa_bits: int) -> float:
    """The spacing of the numbers a format with ``mantissa_bits`` holds at ``value``'s magnitude
    (bf16 between 4 and 8: 2**-5)."""
    _, exponent = math.frexp(value)  # value = m * 2**exponent, 0.5 <= |m| < 1
    return 2.0 ** (exponent - 1 - mantissa_bits)


def loss_tolerance(expected: Loss, got: float | None = None) -> float:
    """How far a loss made here (``got``) may be from ``expected``, made on another machine.

    An fp32 loss: ``FP32_ULPS_PER_STEP`` ulps per step taken before it (one step's worth for the
    first loss). A bf16 or fp16 loss (a model trained under that precision): one rounding step of
    the precision at the larger of the two losses' magnitudes, taken at the top of its binade
    (2**-7 of the loss in bf16: 1 to 2 steps, under 0.8%). Lesson 14's bf16 losses are each rank's
    loss rounded to bf16, averaged over two ranks: an upstream difference far below a step moves a
    rank's loss across a rounding boundary, so two machines' averages differ by 0, a half or a
    whole step (seen: 5.0 and 5.015625 against the committed 4.984375 at step 2); lesson 13's
    bf16 compute moves its fp32 loss by 3e-4 by step 2 (eager against compiled kernels), a
    hundredth of a step. A loss 1% off is outside either way."""
    bits = MANTISSA_BITS[expected.precision]
    if expected.precision == "fp32":
        return FP32_ULPS_PER_STEP * (expected.steps + 1) * ulp(expected, bits)
    magnitude = max(abs(expected), abs(got)) if got is not None else abs(expected)
    return magnitude * 2.0 ** -bits


def loss_precision(row: Row, results: dict[str, Any]) -> str:
    """The precision a variant trained in: its own ``precision``, the run's, else fp32."""
    precision = row.get("precision") or results.get("settings", {}).get("precision") or "fp32"
    return precision if precision in MANTISSA_BITS else "fp32"


def claims(lesson: str, results: dict[str, Any]) -> dict[str, Any]:
    """What any run of the lesson must reproduce, per variant: the lesson's own claims (its
    catalog entry's ``Claims``: units and sizes, dtypes, bytes, counts, losses) and the memory at the peak by
    category; the losses too when ``results`` is a quick run (a quick run repeats a committed
    quick run's batches; a full run trains on more). Step times and gradient statistics depend on
    the run, so they are not claims. Nor is the number of all-gather buffers alive at the peak:
    one or two, depending on when gloo's thread finishes the previous gather (seen on a loaded
    2-core machine: 1.00 MiB against 0.50 MiB, all else equal), so the total is compared without
    them. Losses are ``Loss``es, which ``differences`` compares within ``loss_tolerance``."""
    out: dict[str, Any] = {}
    settings = results.get("settings", {})
    lesson_claims = LESSONS[lesson].claims if lesson in LESSONS else Claims()
    for v in results["variants"]:
        if v.get("kind") in lesson_claims.unclaimed_kinds:
            continue
        c: dict[str, Any] = {}
        peak = v.get("peak_memory_bytes")
        if peak:
            gathers = (peak.get("detail") or {}).get("all_gather") or 0
            whole = {"total_without_all_gather": peak["total"] - gathers,
                     **{k: peak[k] for k in ("parameters", "optimizer", "activations")}}
            c["peak"] = {k: whole[k] for k in lesson_claims.peak or PEAK_PARTS}
        try:
            c.update(row_claims(lesson_claims, v))
        except KeyError:
            pass  # a row without the lesson's columns (a summary row): only its peak, if any
        precision = loss_precision(v, results)
        for key in lesson_claims.losses:
            if c.get(key) is not None:
                c[key] = Loss(c[key], precision, settings["steps"])
        if settings.get("quick") and v.get("losses"):
            c["losses"] = [Loss(loss, precision, step) for step, loss in enumerate(v["losses"])]
        out[v["name"]] = c
    return out


def differences(got: Any, expected: Any, where: str) -> list[str]:
    """Where ``got`` (made here) is not ``expected`` (made on the committed run's machine): a
    ``Loss`` within ``loss_tolerance``, lists and dicts item by item, anything else exactly."""
    if isinstance(expected, Loss):
        if not isinstance(got, (int, float)):
            return [f"{where}: {got!r} != {float(expected)!r}"]
        allowed = loss_tolerance(expected, got)
        if abs(got - expected) > allowed:
            return [f"{where}: {got!r} != {float(expected)!r} (within {allowed:.3g}, "
                    f"{expected.precision} after {expected.steps} steps)"]
        return []
    if isinstance(expected, list) and isinstance(got, list) and len(got) == len(expected):
        return [d for i, (g, e) in enumerate(zip(got, expected)) for d in differences(g, e, f"{where}[{i}]")]
    if isinstance(expected, dict) and isinstance(got, dict) and set(got) == set(expected):
        return [d for k in expected for d in differences(got[k], expected[k], f"{where} {k}")]
    return [] if got == expected else [f"{where}: {got!r} != {expected!r}"]


def claim_differences(ran: dict[str, Any], committed: dict[str, Any]) -> list[str]:
    """What a run's ``claims`` fail to reproduce of the committed run's, variant by variant (a
    variant the run adds is not compared); empty when it reproduces them."""
    problems = []
    for name, claim in committed.items():
        got = ran.get(name)
        if got is None:
            problems.append(f"{name}: not run")
            continue
        for key, value in claim.items():
            if key != "peak":
                problems += differences(got.get(key), value, f"{name} {key}")
                continue
            for part, expected in value.items():
                allowed = PEAK_TIMING_SHARE.get(part, 0) * expected
                if abs(got["peak"][part] - expected) > allowed:
                    problems.append(f"{name} peak {part}: {got['peak'][part]} != {expected}")
    return problems
