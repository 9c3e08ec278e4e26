"""README results tables rendered from a committed run, so every number in them comes from the
lesson's own command.

A lesson folder holds ``results_cpu.json``: the ``results.json`` that ``fsdp-course run NN --device
cpu`` wrote (2 gloo ranks), copied as is. Its README marks the table rendered from it:

    <!-- results:01 results_cpu.json (python -m utilities.course.readme_tables --write 01) -->
    ...rendered, never edited by hand...
    <!-- /results -->

``python -m utilities.course.readme_tables`` checks every marked table against its JSON (exit 1 and a
diff if one differs); ``--write NN`` re-renders it after a new run. The tests do the check, and
compare ``claims()`` (the numbers a shorter run must reproduce exactly: units, sizes, memory,
dtypes) with the quick run the suite already makes.
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
}


def claims(lesson: str, results: dict[str, Any]) -> dict[str, Any]:
    """What any run of the lesson must reproduce exactly, whatever its number of steps: per
    variant, the wrapping and the memory at the peak (lesson 01), the dtypes and the memory at the
    peak (lesson 07). Step times, losses (the quick run trains on other batches) and gradient
    statistics depend on the run, so they are not claims a quick run can check. Nor is the number
    of all-gather buffers alive at the peak: one or two, depending on when gloo's thread finishes
    the previous gather (seen on a loaded 2-core machine: 1.00 MiB against 0.50 MiB, all else
    equal), so the total is compared without them."""
    out: dict[str, Any] = {}
    for v in results["variants"]:
        peak = v["peak_memory_bytes"]
        gathers = (peak.get("detail") or {}).get("all_gather") or 0
        c: dict[str, Any] = {"peak": {"total_without_all_gather": peak["total"] - gathers,
                                      **{k: peak[k] for k in ("parameters", "optimizer", "activations")}}}
        if lesson == "01":
            c.update(units=v["fsdp_units"], largest=v["largest_unit_parameters"],
                     unsharded=v["peak_unsharded_parameter_bytes"])
        elif lesson == "07":
            c.update(forward=v["forward_param_dtypes"], reduce=v["reduce_dtypes"])
        out[v["name"]] = c
    return out


# The moment of the peak can catch one more short-lived tensor when gloo's thread finishes a
# collective later (seen on a loaded 2-core machine: lesson 01's activations +0.56 MiB, 1.5 logits'
# worth); these two may differ by this much, everything else must be equal.
PEAK_TIMING_TOLERANCE = {"activations": 0.03, "total_without_all_gather": 0.03}


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
                if got[key] != value:
                    problems.append(f"{name} {key}: {got[key]!r} != {value!r}")
                continue
            for part, expected in value.items():
                tolerance = PEAK_TIMING_TOLERANCE.get(part, 0) * expected
                if abs(got["peak"][part] - expected) > tolerance:
                    problems.append(f"{name} peak {part}: {got['peak'][part]} != {expected}")
    return problems


def caption(results: dict[str, Any], source: str) -> str:
    s = results["settings"]
    return (f"_Rendered from [`{source}`]({source}): `fsdp-course run {results['lesson']} --device "
            f"cpu`{' --quick' if s.get('quick') else ''} on {results['world_size']} x "
            f"{results['device_name']} ({results['device']}, {s.get('backend', '?')}), torch "
            f"{results['torch']}, {results['date'][:10]}; {results['model']['name']}, "
            f"{s['steps']} steps, batch {s['batch_size']} x {s['seq_len']} tokens per rank._")


def render(lesson: str, results: dict[str, Any], source: str = "results_cpu.json") -> str:
    """The markdown between the markers: a caption naming the run, then the table."""
    columns = TABLES[lesson]
    lines = [caption(results, source), "",
             "| " + " | ".join(h for h, _ in columns) + " |",
             "|" + "---|" * len(columns)]
    for v in results["variants"]:
        lines.append("| " + " | ".join(fn(v, results) for _, fn in columns) + " |")
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
        fresh = draw(json.loads((folder / m.group(3)).read_text()), m.group(3))
        if m.group(4) != fresh:
            problems.extend(difflib.unified_diff(m.group(4).splitlines(), fresh.splitlines(),
                                                 f"{readme} (as committed)",
                                                 f"rendered from {m.group(3)}", lineterm=""))
        return m.group(1) + fresh + m.group(5)

    new = BLOCK.sub(lambda m: replace(m, lambda r, src: render(lesson, r, src)), text)
    new = PREDICTED.sub(lambda m: replace(m, render_predicted), new)
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
