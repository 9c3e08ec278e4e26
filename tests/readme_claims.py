"""What a lesson's committed run claims, which any run of the lesson must reproduce exactly: the
check behind every ``test_readme_table_is_reproduced_by_the_quick_run`` (``conftest``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Row = dict[str, Any]


def _picked(*keys: str) -> Callable[[Row], dict[str, Any]]:
    return lambda v: {k: v.get(k) for k in keys}


# Per lesson: what a variant's row claims beyond the memory at the peak, which any run of the
# lesson must reproduce exactly (sizes, counts, dtypes, bytes, deterministic differences).
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


def claims(lesson: str, results: dict[str, Any]) -> dict[str, Any]:
    """What any run of the lesson must reproduce exactly, per variant: the lesson's own claims
    (``CLAIMS``: units and sizes, dtypes, bytes, counts) and the memory at the peak by category;
    the losses too when ``results`` is a quick run (a quick run repeats a committed quick run's
    batches; a full run trains on more). Step times and gradient statistics depend on the run, so
    they are not claims. Nor is the number of all-gather buffers alive at the peak: one or two,
    depending on when gloo's thread finishes the previous gather (seen on a loaded 2-core machine:
    1.00 MiB against 0.50 MiB, all else equal), so the total is compared without them."""
    out: dict[str, Any] = {}
    quick = bool(results.get("settings", {}).get("quick"))
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
        if quick and v.get("losses"):
            c["losses"] = v["losses"]
        out[v["name"]] = c
    return out


# The moment of the peak can catch one more short-lived tensor when gloo's thread finishes a
# collective later (seen on a loaded 2-core machine: lesson 01's activations +0.56 MiB, 1.5 logits'
# worth); these two may differ by this much, everything else must be equal.
PEAK_TIMING_TOLERANCE = {"activations": 0.03, "total_without_all_gather": 0.03}
# Losses summed over 2 ranks in another order differ in the last bits; the table shows 3 decimals.
LOSS_TOLERANCE = 1e-4


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
            if key == "losses":
                if len(got.get(key) or []) != len(value) or any(
                        abs(a - b) > LOSS_TOLERANCE for a, b in zip(got[key], value)):
                    problems.append(f"{name} losses: {got.get(key)!r} != {value!r}")
            elif key != "peak":
                if got.get(key) != value:
                    problems.append(f"{name} {key}: {got.get(key)!r} != {value!r}")
            else:
                for part, expected in value.items():
                    tolerance = PEAK_TIMING_TOLERANCE.get(part, 0) * expected
                    if abs(got["peak"][part] - expected) > tolerance:
                        problems.append(f"{name} peak {part}: {got['peak'][part]} != {expected}")
    return problems
