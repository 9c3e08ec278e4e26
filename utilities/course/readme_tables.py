"""README results tables rendered from a committed run, so every number in them comes from the
lesson's own command.

A lesson folder holds ``results_cpu.json``: the ``results.json`` that ``fsdp-course run NN --device
cpu`` wrote (2 gloo ranks; with ``--quick`` where the caption says so), copied as is. Its README
marks the table rendered from it, whose caption names the command, the machine (CPU cores,
memory), torch and the date:

    <!-- results:01 results_cpu.json (python -m utilities.course.readme_tables --write 01) -->
    ...rendered, never edited by hand...
    <!-- /results -->

A table may join runs (``results_cpu.json,results_cpu_4ranks.json``): one caption each, their rows
in that order, with the flags each run added named from its settings. ``table=NAME`` after the
files picks a lesson's other table (``TABLES["NN NAME"]``) over the same runs.

``python -m utilities.course.readme_tables`` checks every marked table against its JSON (exit 1 and a
diff if one differs); ``--write NN`` re-renders it after a new run. The tests do the check, and
compare ``claims()`` (what any run of the lesson must reproduce: units, sizes, bytes, dtypes, the
memory at the peak, and a committed quick run's losses) with the quick run the suite already makes.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
MIB = 2**20
BLOCK = re.compile(r"(<!-- results:(\d\d) (\S+)[^\n]*-->\n)(.*?)(<!-- /results -->)", re.S)
# a lesson's prediction on a cluster (results.json "predicted", saved as is), rendered the same way
PREDICTED = re.compile(r"(<!-- predicted:(\d\d) (\S+)[^\n]*-->\n)(.*?)(<!-- /predicted -->)", re.S)

Row = dict[str, Any]
Column = tuple[str, Callable[[Row, dict[str, Any]], str]]


# -- formats ---------------------------------------------------------------------------------------
def _mib(n: float | None) -> str:
    if n is None:
        return "-"
    return "0" if n == 0 else f"{n / MIB:.2f}"


def _peak(part: str) -> Callable[[Row, dict], str]:
    return lambda v, r: _mib(v["peak_memory_bytes"][part])


def _parts(v: Row, r: dict) -> str:
    p = v["peak_memory_bytes"]
    return " / ".join(_mib(p[k]) for k in ("parameters", "optimizer", "activations"))


def _losses(v: Row, r: dict) -> str:
    return f"{v['losses'][0]:.3f} -> {v['losses'][-1]:.3f}"


def _step(v: Row, r: dict) -> str:
    return f"{v['step_time_s']:.3f}"


def _pct(key: str) -> Callable[[Row, dict], str]:
    return lambda v, r: "0" if not v[key] else f"{100 * v[key]:.2f}%"


def max_loss_diff(v: Row, r: dict[str, Any], reference: str = "fsdp2-fp32") -> float:
    """The largest |loss - reference loss| over the steps both ran."""
    ref = next(x for x in r["variants"] if x["name"] == reference)["losses"]
    return max(abs(a - b) for a, b in zip(v["losses"], ref))


def _diff(v: Row, r: dict) -> str:
    d = max_loss_diff(v, r)
    return "0" if d == 0 else f"{d:.3f}"


def _dtypes(key: str) -> Callable[[Row, dict], str]:
    return lambda v, r: ", ".join(v[key])


def _key(key: str, fmt: Callable[[Any], str] = str) -> Callable[[Row, dict], str]:
    """A variant's own value, formatted; "-" where the variant has none."""
    return lambda v, r: "-" if v.get(key) is None else fmt(v[key])


def _key_mib(key: str) -> Callable[[Row, dict], str]:
    return lambda v, r: _mib(v.get(key))


def _count(n: int) -> str:
    return f"{n:,}"


def _secs(n: float) -> str:
    return f"{n:.3f}"


def _yes(b: bool) -> str:
    return "yes" if b else "no"


def _diff_value(x: float) -> str:
    return "0" if x == 0 else f"{x:.1e}"


def _name(v: Row, r: dict) -> str:
    return v["name"]


def _ranks(v: Row, r: dict) -> str:
    return str(r["world_size"])


def _flags(v: Row, r: dict) -> str:
    return f"`{r['_flags']}`" if r.get("_flags") else "(defaults)"


def _pair(a: Callable[[Row, dict], str], b: Callable[[Row, dict], str]) -> Callable[[Row, dict], str]:
    return lambda v, r: f"{a(v, r)} / {b(v, r)}"


def _kept(v: Row, r: dict) -> str:
    kept = v["resident_bytes"]
    return " / ".join(_mib(kept[k]) for k in ("parameters", "gradients", "optimizer"))


def _held_out(v: Row, r: dict) -> str:
    return f"{v['held_out_loss_before']:.3f} -> {v['held_out_loss_after']:.3f}"


def _eval_last(v: Row, r: dict) -> str:
    return f"{v['eval_losses'][-1][1]:.3f}" if v.get("eval_losses") else "-"


def _planned_measured(part: str) -> Callable[[Row, dict], str]:
    return lambda v, r: f"{_mib(v['predicted_peak_bytes'][part])} / {_mib(v['peak_memory_bytes'][part])}"


def _grads_optim(v: Row, r: dict) -> str:
    return f"{_mib(v['gradient_bytes_per_rank'])} / {_mib(v['optimizer_bytes_per_rank'])}"


# -- the tables ------------------------------------------------------------------------------------
TABLES: dict[str, list[Column]] = {
    "01": [
        ("variant", lambda v, r: v["name"]),
        ("FSDP units", lambda v, r: str(v["fsdp_units"])),
        ("largest unit (params)", lambda v, r: f"{v['largest_unit_parameters']:,}"),
        ("unsharded params at peak (MiB)", lambda v, r: _mib(v["peak_unsharded_parameter_bytes"])),
        ("peak per rank (MiB)", _peak("total")),
        ("params / optim / activ at peak (MiB)", _parts),
        ("median step (s)", _step),
        ("loss first -> last", _losses),
    ],
    "07": [
        ("variant", lambda v, r: v["name"] + (" (scaler)" if v["name"] == "fsdp2-fp16" else "")),
        ("weights in forward", _dtypes("forward_param_dtypes")),
        ("grads reduced in", _dtypes("reduce_dtypes")),
        ("peak (MiB)", _peak("total")),
        ("params / optim / activ at peak (MiB)", _parts),
        ("median step (s)", _step),
        ("loss first -> last", _losses),
        ("max \\|loss - fp32\\|", _diff),
        ("zero grads", _pct("grad_zero_fraction")),
        ("grads below fp16", _pct("grad_fp16_underflow_fraction")),
    ],
    "02": [
        ("variant", _name),
        ("checkpointed blocks", _key("checkpointed_blocks")),
        ("peak per rank (MiB)", _peak("total")),
        ("params / optim / activ at peak (MiB)", _parts),
        ("median step (s)", _step),
        ("loss first -> last", _losses),
    ],
    "03": [
        ("variant", _name),
        ("save (s)", _key("save_s", _secs)),
        ("load (s)", _key("load_s", _secs)),
        ("checkpoint bytes", _key("checkpoint_bytes", _count)),
        ("loaded step", _key("loaded_step")),
        ("outputs max abs diff, before / after load", _pair(_key("diff_before_load", "{:.2f}".format),
                                                            _key("outputs_max_abs_diff", _diff_value))),
        ("next-step loss (trained / loaded)", _pair(_key("next_loss_a", "{:.6f}".format),
                                                    _key("next_loss_b", "{:.6f}".format))),
        ("weights after next step, max abs diff", _key("after_step_max_abs_diff", _diff_value)),
        ("HF export bytes", _key("hf_export_bytes", _count)),
        ("HF from_pretrained max abs diff", _key("hf_max_abs_diff", _diff_value)),
    ],
    "04": [
        ("variant", _name),
        ("prefetch", _key("prefetch")),
        ("gathered params at peak (MiB)", _key_mib("peak_gathered_parameter_bytes")),
        ("of which unsharded params (MiB)", _key_mib("peak_unsharded_parameter_bytes")),
        ("peak per rank (MiB)", _peak("total")),
        ("params / optim / activ at peak (MiB)", _parts),
        ("median step (s)", _step),
        ("loss first -> last", _losses),
    ],
    "05": [
        ("batch per rank", _key("batch")),
        ("phase", _key("phase")),
        ("peak per rank (MiB)", _peak("total")),
        ("params / optim / activ at peak (MiB)", _parts),
        ("median step (s)", _step),
        ("samples/s (all ranks)", _key("samples_per_s", "{:.1f}".format)),
        ("retries", _key("retries")),
        ("verdict", _key("verdict")),
    ],
    "06": [
        ("variant (mesh)", lambda v, r: v["name"] + (f" ({'x'.join(map(str, v['mesh']))})"
                                                    if len(v.get("mesh") or ()) > 1 else "")),
        ("kept between steps: params / grads / optim (MiB)", _kept),
        ("unsharded params at peak (MiB)", _key_mib("peak_unsharded_parameter_bytes")),
        ("peak per rank (MiB)", _peak("total")),
        ("params / optim / activ at peak (MiB)", _parts),
        ("sent per step, theory (MiB)", _key_mib("sent_per_step_bytes")),
        ("median step (s)", _step),
        ("loss first -> last", _losses),
    ],
    "08": [
        ("variant", _name),
        ("format", _key("format")),
        ("save (s)", _key("save_s", _secs)),
        ("checkpoint bytes (all ranks)", _key("checkpoint_bytes", _count)),
        ("files", _key("files")),
    ],
    "09": [
        ("variant", _name),
        ("trainable / frozen params", _pair(_key("trainable_parameters", _count),
                                            _key("frozen_parameters", _count))),
        ("held-out loss before -> after", _held_out),
        ("held-out token accuracy", _key("held_out_accuracy", "{:.1%}".format)),
        ("grads / optimizer kept per rank (MiB)", _grads_optim),
        ("peak per rank (MiB)", _peak("total")),
        ("median step (s)", _step),
        ("frozen weights bit-identical", lambda v, r: (_yes(v["frozen_bit_identical"])
                                                       if v.get("frozen_parameters") else "(none frozen)")),
    ],
    "10": [
        ("flags (after `--`)", _flags),
        ("train loss first -> last", _losses),
        ("eval loss, last", _eval_last),
        ("peak per rank (MiB)", _peak("total")),
        ("params / grads / optim / activ at peak (MiB)", lambda v, r: " / ".join(
            _mib(v["peak_memory_bytes"][k]) for k in ("parameters", "gradients", "optimizer",
                                                      "activations"))),
        ("memory method", lambda v, r: v["peak_memory_bytes"].get("detail", {}).get("method", "-")),
        ("median step (s)", _step),
    ],
    "11": [
        ("variant", _name),
        ("limit_all_gathers", _key("limit_all_gathers", _yes)),
        ("peak per rank (MiB)", _peak("total")),
        ("params / optim / activ at peak (MiB)", _parts),
        ("median step (s)", _step),
        ("loss first -> last", _losses),
    ],
    "12": [
        ("variant", _name),
        ("ranks", _ranks),
        ("tp", _key("tp_size")),
        ("dp", _key("dp_size")),
        ("weights per rank (MiB)", _key_mib("weight_bytes_per_rank")),
        ("split / replicated (MiB)", _pair(_key_mib("split_weight_bytes_per_rank"),
                                           _key_mib("replicated_weight_bytes_per_rank"))),
        ("peak per rank (MiB)", _peak("total")),
        ("max abs diff output / grads", _pair(_key("max_abs_diff_output", _diff_value),
                                              _key("max_abs_diff_grads", _diff_value))),
        ("median step (s)", _step),
        ("loss first -> last", _losses),
    ],
    "13": [
        ("variant", _name),
        ("median step (s)", _step),
        ("first step, compile included (s)", _key("first_step_s", _secs)),
        ("compile (s)", _key("compile_s", _secs)),
        ("compiled blocks", _key("compiled_blocks")),
        ("peak per rank (MiB)", _peak("total")),
        ("loss first -> last", _losses),
        ("max \\|loss - eager\\|", lambda v, r: _diff_value(max_loss_diff(v, r, "eager"))),
    ],
    "14": [
        ("variant", _name),
        *[(f"{part}, planned / measured (MiB)", _planned_measured(part))
          for part in ("parameters", "gradients", "optimizer", "activations", "total")],
        ("planned / measured (total)", _key("predicted_over_measured_ratio", "{:.3f}".format)),
    ],
}

# A lesson's second table on other columns of the same runs: its marker names it (table=NAME).
TABLES["06 4ranks"] = [
    ("variant", _name),
    ("peak per rank (MiB)", _peak("total")),
    ("unsharded params at peak (MiB)", _key_mib("peak_unsharded_parameter_bytes")),
    ("kept after forward, tracked as activations (MiB)", _peak("activations")),
    ("sent per step, theory (MiB)", _key_mib("sent_per_step_bytes")),
    ("loss first -> last", _losses),
]
TABLES["12 ratios"] = [
    ("variant", _name),
    ("TP ranks", _key("tp_size")),
    ("published peak ratio to 1 rank", _key("published_ratio_vs_tp1", "{:.2f}".format)),
    ("our peak ratio (`peak_ratio_vs_tp1`)", _key("peak_ratio_vs_tp1", "{:.2f}".format)),
    ("our weight ratio (`weight_ratio_vs_tp1`)", _key("weight_ratio_vs_tp1", "{:.2f}".format)),
]

# the variants a table shows (default: all): those with these keys
ROW_KEYS: dict[str, tuple[str, ...]] = {"05": ("batch", "phase"), "08": ("format",),
                                        "12 ratios": ("peak_ratio_vs_tp1",)}


def _recommendation(r: dict[str, Any]) -> list[str]:
    rec = next((v for v in r["variants"] if v["name"] == "recommendation"), None)
    if rec is None:
        return []
    return [f"Recommendation: **batch {rec['batch']} per rank** ({rec['reason']}; budget "
            f"{rec['budget_mib']:g} MiB per rank), after {rec['trials']} trials."]


def _fisher(r: dict[str, Any]) -> list[str]:
    d = next((v for v in r["variants"] if v.get("fisher_time_s") is not None), None)
    if d is None:
        return []
    return [f"{d['name']}'s Fisher pass ({r['settings'].get('fisher_batches', '?')} forward/backward "
            f"passes plus the threshold search) took {d['fisher_time_s']:.1f} s and kept "
            f"{d['kept_fraction']:.1%} of the entries."]


def _checkpoints(r: dict[str, Any]) -> list[str]:
    by = {v["name"]: v for v in r["variants"]}
    out = []
    if "fsdp2-dcp" in by:
        d = by["fsdp2-dcp"]
        files = ", ".join(f"`{f}` {n:,}" for f, n in d["layout"].items())
        out.append(f"fsdp2-dcp's checkpoint, bytes per file: {files}. Load {d['load_s']:.3f} s on "
                   f"{r['world_size']} ranks; `async_save` blocked training for {d['async_blocked_s']:.3f} s "
                   f"and the checkpoint was complete after {d['async_total_s']:.3f} s; reloaded outputs "
                   f"equal the saved model's: {_yes(d['reload_outputs_equal'])}.")
    if "convert" in by:
        c = by["convert"]
        out.append(f"Conversion: `dcp_to_torch_save` {c['dcp_to_torch_save_s']:.3f} s -> one "
                   f"{c['torch_save_bytes']:,}-byte file; `torch_save_to_dcp` "
                   f"{c['torch_save_to_dcp_s']:.3f} s -> {c['back_to_dcp_bytes']:,} bytes.")
    if "fsdp1-local" in by:
        out.append(f"fsdp1-local: {by['fsdp1-local']['rank0_file_bytes']:,} bytes on rank 0, "
                   f"{by['fsdp1-local']['flat_params']} flat shards per rank.")
    if "resume-check" in by:
        rc = by["resume-check"]
        out.append(f"Resume check: {len(rc['uninterrupted_losses'])} losses uninterrupted vs "
                   f"{rc['resumed_at_step']} + save/load + the rest, largest difference "
                   f"{rc['max_abs_loss_diff']}.")
    return out


def _batch_search(r: dict[str, Any]) -> list[str]:
    """Lesson 02's search for the largest batch, without and with checkpointing, as a table."""
    search = r.get("batch_search") or {}
    lines = ["| checkpointed | largest batch per rank | evidence | batches tried |", "|---|---|---|---|"]
    for key, label in (("none", "none"), ("all", "every block")):
        if key in search:
            s = search[key]
            lines.append(f"| {label} | **{s['best']}** | {s['reason']} | "
                         f"{', '.join(str(t['batch']) for t in s['trials'])} |")
    if len(lines) == 2:
        return []
    return ["\n".join(lines), f"Budget {search['budget_bytes'] / MIB:.2f} MiB per rank ({search['api']}), "
                             f"batches up to {search['limit']}: {search.get('gain', 0):g}x the batch."]


def _params(n: float) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.0f} M"


def _capacity(r: dict[str, Any]) -> list[str]:
    """Lesson 06's largest model whose training state fits, from the measured bytes per parameter."""
    cap = r.get("capacity")
    if not cap:
        return []
    names = {"ddp": "DDP", "shard_grad_op": "SHARD_GRAD_OP", "full_shard": "FULL_SHARD",
             "hybrid_shard": f"HSDP (shard within {cap['gpus_per_node_for_hsdp']})"}
    classic = cap.get("classic_a10_8gpu") or {}
    gb = cap["gpu_mem_bytes"] / 1e9
    lines = [f"| strategy | measured on | bytes per parameter per GPU | largest model, {cap['gpus']} x "
             f"{gb:g} GB | classic series, 8 x A10, measured |", "|---|---|---|---|---|"]
    for row in cap["at_gpus"]:
        known = classic.get(row["strategy"])
        lines.append(f"| {names.get(row['strategy'], row['strategy'])} | {row['measured_from']} | "
                     f"{row['bytes_per_param']:.2f} | {_params(row['largest_model'])} | "
                     f"{_params(known) if known else '-'} |")
    return ["\n".join(lines)]


# lines a lesson's table ends with, from the same run; a named table may be only these
FOOTERS: dict[str, Callable[[dict[str, Any]], list[str]]] = {"05": _recommendation, "08": _checkpoints,
                                                             "09": _fisher, "02 search": _batch_search,
                                                             "06 capacity": _capacity}


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


def machine(results: dict[str, Any]) -> str:
    """The machine a run was measured on, as results.json names it."""
    m = results.get("machine") or {}
    cores = f"{m['cpu_cores']} CPU cores" if m.get("cpu_cores") else "CPU cores not recorded"
    memory = f"{m['memory_bytes'] / 2**30:.1f} GiB memory" if m.get("memory_bytes") else "memory not recorded"
    return f"{results['device_name']}, {cores}, {memory}"


def settings_flags(results: dict[str, Any], first: dict[str, Any]) -> str:
    """The lesson flags a run of a multi-run table added: its settings that differ from the first
    run's (e.g. ``--api fsdp1 --grad-accum 2``)."""
    flags = []
    for key, value in results["settings"].items():
        if first["settings"].get(key) == value or key in ("quick", "date"):
            continue
        flag = "--" + key.replace("_", "-")
        flags.append(flag if value is True else f"{flag} {value}")
    return " ".join(flags)


def caption(results: dict[str, Any], source: str, first: dict[str, Any] | None = None) -> str:
    """One line naming a run: its file, command, machine, torch, date, model and sizes."""
    s = results["settings"]
    command = (f"fsdp-course run {results['lesson']} --device {results['device']}"
               f"{' --quick' if s.get('quick') else ''}")
    if results["world_size"] != 2:
        command += f" --nproc {results['world_size']}"
    flags = settings_flags(results, first) if first is not None else ""
    if flags:
        command += f" -- {flags}"
    if first is not None and first is not results:  # one more run of the same table
        names = ", ".join(v["name"] for v in results["variants"])
        same = all(results.get(k) == first.get(k) for k in ("device_name", "machine", "torch", "model"))
        where = "" if same else (f" on {results['world_size']} ranks ({machine(results)}), "
                                 f"torch {results['torch']}")
        return (f"_And [`{source}`]({source}): `{command}` (variants: {names}){where}, "
                f"{results['date'][:10]}._")
    batch = f", batch {s['batch_size']} x {s['seq_len']} tokens per rank" if "seq_len" in s else ""
    return (f"_Rendered from [`{source}`]({source}): `{command}` on {results['world_size']} "
            f"ranks ({results['device']}, {s.get('backend', '?')}) of one machine ({machine(results)}), "
            f"torch {results['torch']}, {results['date'][:10]}; {results['model']['name']}, "
            f"{s['steps']} steps{batch}._")


def rows(table: str, results: dict[str, Any]) -> list[Row]:
    """The variants a table shows."""
    keys = ROW_KEYS.get(table, ())
    return [v for v in results["variants"] if all(k in v for k in keys)]


def render(lesson: str, runs: dict[str, Any] | list[tuple[str, dict[str, Any]]],
           source: str = "results_cpu.json", name: str | None = None) -> str:
    """The markdown between the markers: a caption naming each run (``runs``: one results.json,
    or (file, results) pairs whose rows follow one another), then the table (the lesson's, or its
    table ``name``), then what a run skipped."""
    if isinstance(runs, dict):
        runs = [(source, runs)]
    table = f"{lesson} {name}" if name else lesson
    columns = TABLES.get(table, [])  # none: the table is its footer (a run's summary, not its variants)
    first = runs[0][1]
    lines = "\n\n".join(caption(r, src, first if len(runs) > 1 else None) for src, r in runs).split("\n")
    if columns:
        lines += ["", "| " + " | ".join(h for h, _ in columns) + " |", "|" + "---|" * len(columns)]
    for _, r in runs:
        r = {**r, "_flags": settings_flags(r, first)}
        for v in rows(table, r) if columns else ():
            lines.append("| " + " | ".join(fn(v, r) for _, fn in columns) + " |")
    for _, r in runs:
        if name is None:
            lines += [f"\n{v}: skipped, {why}" for v, why in (r.get("skipped") or {}).items()]
        lines += ["\n" + line for line in FOOTERS.get(table, lambda r: [])(r)]
    return "\n".join(lines) + "\n"


def render_predicted(block: dict[str, Any], source: str) -> str:
    """The markdown of a lesson's ``predicted`` block: what it is, then one row per variant."""
    lines = [f"_PREDICTED by the course's step-time model, not measured: rendered from [`{source}`]"
             f"({source}), {block['model']} at batch {block['batch']} x {block['seq']} per GPU, "
             f"{block['precision']}, on {block['cluster']}._", "",
             "| variant | step (ms) | communication (ms) | exposed (ms) | tokens/s per GPU |",
             "|---|---|---|---|---|"]
    for v in block["variants"]:
        lines.append(f"| {v['name']} | {v['step_s'] * 1e3:.1f} | {v['comm_s'] * 1e3:.1f} | "
                     f"{v['exposed_comm_s'] * 1e3:.1f} | {v['tokens_per_s_per_gpu']:,.0f} |")
    return "\n".join(lines) + "\n"


# -- READMEs ---------------------------------------------------------------------------------------
def lesson_dir(lesson: str) -> Path:
    found = sorted((REPO / "lessons").glob(f"{lesson}_*"))
    if not found:
        raise SystemExit(f"error: no lesson {lesson!r} under {REPO / 'lessons'}")
    return found[0]


def marked_lessons() -> list[str]:
    """Lessons whose README has a rendered results table."""
    out = []
    for readme in sorted((REPO / "lessons").glob("*/README.md")):
        text = readme.read_text()
        out += [m.group(2) for pattern in (BLOCK, PREDICTED) for m in pattern.finditer(text)]
    return sorted(set(out))


def check(lesson: str, write: bool = False) -> list[str]:
    """Differences between the README's marked tables (results and predictions) and a fresh
    rendering (empty: they agree); with ``write``, rewrite the README so they do."""
    folder = lesson_dir(lesson)
    readme = folder / "README.md"
    text = readme.read_text()
    problems: list[str] = []

    def replace(m: re.Match, draw: Callable[[dict[str, Any], str], str]) -> str:
        if m.group(2) != lesson:
            return m.group(0)
        fresh = draw(m.group(3))
        if m.group(4) != fresh:
            problems.extend(difflib.unified_diff(m.group(4).splitlines(), fresh.splitlines(),
                                                 f"{readme} (as committed)",
                                                 f"rendered from {m.group(3)}", lineterm=""))
        return m.group(1) + fresh + m.group(5)

    def load(source: str) -> dict[str, Any]:
        return json.loads((folder / source).read_text())

    def table_name(m: re.Match) -> str | None:
        named = re.search(r" table=(\w+)", m.group(1))
        return named.group(1) if named else None

    new = BLOCK.sub(lambda m: replace(m, lambda src: render(
        lesson, [(one, load(one)) for one in src.split(",")], name=table_name(m))), text)
    new = PREDICTED.sub(lambda m: replace(m, lambda src: render_predicted(load(src), src)), new)
    if not any(m.group(2) == lesson for pattern in (BLOCK, PREDICTED) for m in pattern.finditer(text)):
        return [f"{readme} has no <!-- results:{lesson} ... --> or <!-- predicted:{lesson} ... --> block"]
    if write and new != text:
        readme.write_text(new)
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m utilities.course.readme_tables",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("lessons", nargs="*", help="lesson numbers (default: every marked README)")
    parser.add_argument("--write", action="store_true", help="re-render the tables in place")
    args = parser.parse_args(argv)
    failed = False
    for lesson in args.lessons or marked_lessons():
        problems = check(lesson, write=args.write)
        if problems and not args.write:
            failed = True
            print("\n".join(problems))
        print(f"lesson {lesson}: " + ("re-rendered" if args.write and problems else
                                      "differs" if problems else "matches its results JSON"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
