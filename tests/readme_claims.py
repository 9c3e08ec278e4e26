"""What a lesson's committed run claims, which any run of the lesson must reproduce: the check
behind every ``test_readme_table_is_reproduced_by_the_quick_run`` (``conftest``).

The committed runs were made on another machine, and this module is the one home of how far a
number made there may be from the same number made here (``differences``): counts, sizes, dtypes
and parameter or optimizer bytes exactly; losses within the rounding of their precision
(``loss_tolerance``); the memory at the peak within one short-lived tensor's timing
(``PEAK_TIMING_SHARE``); a prediction of the step-time model within ``MODEL_ARITHMETIC_RTOL``."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

Row = dict[str, Any]


def _picked(*keys: str) -> Callable[[Row], dict[str, Any]]:
    return lambda v: {k: v.get(k) for k in keys}


# Per lesson: what a variant's row claims beyond the memory at the peak (sizes, counts, dtypes,
# bytes, differences within one run), compared by ``differences``. A parameter, gradient or
# optimizer byte count is the product of shapes and dtypes, the same on every machine, so it is
# exact: one parameter more or less is a different model. A difference measured inside one run
# (``outputs_max_abs_diff``: a reload against the model it saved) is 0.0 on any machine, or a bug.
CLAIMS: dict[str, Callable[[Row], dict[str, Any]]] = {
    "01": lambda v: dict(units=v["fsdp_units"], largest=v["largest_unit_parameters"],
                         unsharded=v["peak_unsharded_parameter_bytes"]),
    "02": _picked("checkpointed_blocks"),
    "03": _picked("checkpoint_bytes", "loaded_step", "outputs_max_abs_diff", "next_loss_a", "next_loss_b",
                  "after_step_max_abs_diff", "hf_export_bytes", "hf_max_abs_diff"),
    "04": _picked("prefetch", "peak_unsharded_parameter_bytes", "peak_gathered_parameter_bytes"),
    "05": _picked("batch", "phase", "verdict"),
    "06": _picked("resident_bytes", "peak_unsharded_parameter_bytes", "sent_per_step_bytes"),
    "07": lambda v: dict(forward=v["forward_param_dtypes"], reduce=v["reduce_dtypes"]),
    "08": _picked("format", "files", "flat_params", "reload_outputs_equal", "max_abs_loss_diff"),
    "09": _picked("trainable_parameters", "frozen_parameters", "gradient_bytes_per_rank",
                  "optimizer_bytes_per_rank", "frozen_bit_identical"),
    "10": _picked("precision", "activation_checkpointing"),
    "11": _picked("limit_all_gathers"),
    "12": _picked("tp_size", "dp_size", "weight_bytes_per_rank", "split_weight_bytes_per_rank",
                  "replicated_weight_bytes_per_rank"),
    "13": _picked("compiled_blocks", "parameters"),
    "14": lambda v: {"planned": v["predicted_peak_bytes"]},
    # each failure's pair, and the byte and collective counts its shapes fix
    "15": _picked("symptom_shown", "fix_works", "mistake_weight_copies", "fix_weight_copies",
                  "unsharded_gradient_bytes", "mistake_peak_gradient_bytes", "fix_peak_gradient_bytes",
                  "mistake_reduce_scatters", "fix_reduce_scatters", "mistake_all_gathers",
                  "fix_all_gathers", "trainable_gradient_bytes_per_rank", "frozen_gradient_bytes_per_rank",
                  "tensors", "mistake_tensors_as_a_rank_built", "fix_tensors_as_a_rank_built",
                  "mistake_reduce_dtypes", "fix_reduce_dtypes"),
    "16": _picked("parameters_on", "gradients_on", "optimizer_on", "pinned", "sharded_bytes",
                  "to_device_copies", "to_device_bytes", "to_device_moved_bytes", "to_host_copies",
                  "to_host_bytes", "to_host_moved_bytes"),
    # the work per rank and the bytes the ring sends are fixed by the shapes and the layout
    "17": _picked("cp", "dp", "score_blocks_per_rank", "forward_sent_bytes", "backward_sent_bytes",
                  "tokens_per_rank"),
}
PEAK_PARTS = ("total_without_all_gather", "parameters", "optimizer", "activations")
# The parts of the peak a lesson's quick run reproduces of its committed run (default: all of
# PEAK_PARTS). Lessons 09 and 12 commit a full run whose sequences or widths the quick run does
# not use, so only the parts independent of those are claims. Lesson 05's small batches have two
# moments of backward within a few hundred KiB of each other, and which one is the peak depends on
# timing (batch 1: activations 3.67 or 4.27 MiB from one run of the same code to the next; its
# README says more): only the state the batch does not change is claimed.
PEAK_CLAIMED: dict[str, tuple[str, ...]] = {
    "05": ("optimizer",),  # the parameters booked at its peak move by a bias under load
    "09": ("parameters", "optimizer"),
    "12": ("parameters", "optimizer"),
}
# Variants a quick run does not repeat: lesson 12's quick FeedForward is half as wide as the full run's.
UNCLAIMED: dict[str, Callable[[Row], bool]] = {"12": lambda v: v.get("kind") == "mlp"}


# Claims that are losses, per lesson: lesson 03's next step after the reload, taken after the
# run's ``steps`` optimizer steps.
LOSS_CLAIMS: dict[str, tuple[str, ...]] = {"03": ("next_loss_a", "next_loss_b")}

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
    """What any run of the lesson must reproduce, per variant: the lesson's own claims (``CLAIMS``:
    units and sizes, dtypes, bytes, counts; ``LOSS_CLAIMS``) and the memory at the peak by
    category; the losses too when ``results`` is a quick run (a quick run repeats a committed
    quick run's batches; a full run trains on more). Step times and gradient statistics depend on
    the run, so they are not claims. Nor is the number of all-gather buffers alive at the peak:
    one or two, depending on when gloo's thread finishes the previous gather (seen on a loaded
    2-core machine: 1.00 MiB against 0.50 MiB, all else equal), so the total is compared without
    them. Losses are ``Loss``es, which ``differences`` compares within ``loss_tolerance``."""
    out: dict[str, Any] = {}
    settings = results.get("settings", {})
    for v in results["variants"]:
        if UNCLAIMED.get(lesson, lambda v: False)(v):
            continue
        c: dict[str, Any] = {}
        peak = v.get("peak_memory_bytes")
        if peak:
            gathers = (peak.get("detail") or {}).get("all_gather") or 0
            whole = {"total_without_all_gather": peak["total"] - gathers,
                     **{k: peak[k] for k in ("parameters", "optimizer", "activations")}}
            c["peak"] = {k: whole[k] for k in PEAK_CLAIMED.get(lesson, PEAK_PARTS)}
        try:
            c.update(CLAIMS[lesson](v))
        except KeyError:
            pass  # a row without the lesson's columns (a summary row): only its peak, if any
        precision = loss_precision(v, results)
        for key in LOSS_CLAIMS.get(lesson, ()):
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
