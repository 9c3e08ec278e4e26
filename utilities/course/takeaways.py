"""Each lesson's point in one line, from what its run measured (results.json ``takeaway``).

A lesson run ends with this line, and ``fsdp-course run all`` prints one per lesson. Each function
reads only the run's own results; a variant left out with ``--variants`` falls back to the
general line (the range of peak memory over the variants that ran). Lesson 10's train.py, a program
to copy that imports nothing from the course, writes its own line (``TrainingLog.takeaway``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from utilities.measure import fmt_bytes

Results = dict[str, Any]


def _v(results: Results, name: str) -> dict[str, Any]:
    return next(v for v in results["variants"] if v["name"] == name)


def _peak(v: dict[str, Any]) -> str:
    return fmt_bytes(v["peak_memory_bytes"]["total"])


def general(results: Results) -> str:
    """The range of peak memory per rank over the variants that ran."""
    measured = [v for v in results["variants"] if (v.get("peak_memory_bytes") or {}).get("total")]
    if not measured:
        return f"{len(results['variants'])} variants ran; see the table"
    low = min(measured, key=lambda v: v["peak_memory_bytes"]["total"])
    high = max(measured, key=lambda v: v["peak_memory_bytes"]["total"])
    return f"peak per rank from {_peak(low)} ({low['name']}) to {_peak(high)} ({high['name']})"


def _01(r: Results) -> str:
    one, block = _v(r, "fsdp2-one-unit"), _v(r, "fsdp2-per-block")
    return (f"per-block wrapping: {fmt_bytes(one['peak_unsharded_parameter_bytes'])} -> "
            f"{fmt_bytes(block['peak_unsharded_parameter_bytes'])} unsharded at the peak, "
            f"{_peak(one)} -> {_peak(block)} in all (FSDP2, {one['fsdp_units']} -> "
            f"{block['fsdp_units']} units)")


def _02(r: Results) -> str:
    none, every = _v(r, "fsdp2-none"), _v(r, "fsdp2-all")
    act = lambda v: fmt_bytes(v["peak_memory_bytes"]["activations"])
    line = (f"checkpointing every block: activations at the peak {act(none)} -> {act(every)} "
            f"(FSDP2), same losses")
    found = {k: v["best"] for k, v in (r.get("batch_search") or {}).items()
             if isinstance(v, dict) and "best" in v}
    if found:
        line += "; largest batch in the budget: " + ", ".join(f"{k} {b}" for k, b in found.items())
    return line


def _03(r: Results) -> str:
    exact = all(v.get("outputs_identical") and v.get("next_step_identical") for v in r["variants"])
    return (f"full state dict: {'every' if exact else 'NOT every'} reload gives identical outputs and "
            f"an identical next step ({', '.join(v['name'] for v in r['variants'])})")


def _04(r: Results) -> str:
    line = "prefetching never changes the losses"
    predicted = {v["name"]: v for v in (r.get("predicted") or {}).get("variants", [])}
    if {"fsdp1-no-prefetch", "fsdp1-backward-pre"} <= set(predicted):
        none, pre = predicted["fsdp1-no-prefetch"], predicted["fsdp1-backward-pre"]
        line += (f"; PREDICTED on {r['predicted']['gpus']} GPUs: BACKWARD_PRE "
                 f"{pre['step_s'] * 1e3:.0f} ms vs no prefetch {none['step_s'] * 1e3:.0f} ms per step")
    return line


def _05(r: Results) -> str:
    return _v(r, "recommendation")["reason"]


def _06(r: Results) -> str:
    ddp, full = _v(r, "ddp"), _v(r, "fsdp2-reshard-true")
    d, f = ddp["resident_bytes_per_rank"], full["resident_bytes_per_rank"]
    return (f"state held per rank: DDP {fmt_bytes(d)} -> FULL_SHARD {fmt_bytes(f)} "
            f"({d / f:.1f}x less on {r['world_size']} ranks), for "
            f"{full['sent_per_step_bytes'] / ddp['sent_per_step_bytes']:.1f}x the bytes sent per step")


def _07(r: Results) -> str:
    fp32, bf16 = _v(r, "fsdp2-fp32"), _v(r, "fsdp2-bf16")
    diff = max(abs(a - b) for a, b in zip(fp32["losses"], bf16["losses"]))
    return (f"bf16: forward weights {', '.join(bf16['forward_param_dtypes'])}, gradients reduced in "
            f"{', '.join(bf16['reduce_dtypes'])}, loss within {diff:.3f} of fp32")


def _08(r: Results) -> str:
    saved = [v for v in r["variants"] if v.get("files") and v["name"] != "convert"]  # convert: one file
    files = ", ".join(f"{v['name']} {v['files']} files" for v in saved)
    dcp = _v(r, "fsdp2-dcp")
    return (f"each rank writes its own shard ({files}); the DCP checkpoint reloads "
            f"{'exactly' if dcp.get('reload_outputs_equal') else 'NOT exactly'}")


def _09(r: Results) -> str:
    full, frozen = _v(r, "full"), _v(r, "frozen-encoder")
    return (f"freezing the encoder: {fmt_bytes(full['optimizer_bytes_per_rank'])} -> "
            f"{fmt_bytes(frozen['optimizer_bytes_per_rank'])} of optimizer state per rank, held-out "
            f"loss {frozen['held_out_loss_after']:.3f} vs {full['held_out_loss_after']:.3f} trained fully")


def _11(r: Results) -> str:
    return "the limiter changes when all-gathers are issued, never the losses; " + general(r)


def _12(r: Results) -> str:
    worst = max(v.get("max_abs_diff_vs_unsplit") or 0 for v in r["variants"])
    return f"tensor parallel computes what the unsplit model does (max |diff| {worst:.1e})"


def _13(r: Results) -> str:
    eager, compiled = _v(r, "eager"), _v(r, "compiled")
    diff = max(abs(a - b) for a, b in zip(eager["losses"], compiled["losses"]))
    return f"compiled trains as eager does (losses within {diff:.1e})"


def _14(r: Results) -> str:
    ratios = [v["predicted_over_measured_ratio"] for v in r["variants"]]
    return (f"the plan predicts the measured peak within {max(abs(x - 1) for x in ratios):.1%} "
            f"({len(ratios)} configurations)")


TAKEAWAYS: dict[str, Callable[[Results], str]] = {
    "01": _01, "02": _02, "03": _03, "04": _04, "05": _05, "06": _06, "07": _07, "08": _08,
    "09": _09, "11": _11, "12": _12, "13": _13, "14": _14,
}


def takeaway(results: Results) -> str:
    """The lesson's line, or the general one when the variants it reads did not run."""
    lesson = TAKEAWAYS.get(results.get("lesson"), general)
    try:
        return lesson(results)
    except (StopIteration, KeyError, TypeError, ValueError, ZeroDivisionError):
        return general(results)
