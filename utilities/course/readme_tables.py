"""README results tables rendered from a committed run, so every number in them comes from the
lesson's own command, in the table the command prints.

A lesson folder holds ``results_cpu.json``: the ``results.json`` that ``fsdp-course run NN --device
cpu`` wrote (2 gloo ranks; with ``--quick`` where the caption says so), copied as is. Its README
marks the table rendered from it, whose caption names the command, the machine (CPU cores,
memory), torch and the date:

    <!-- results:01 results_cpu.json (python -m utilities.course.readme_tables --write 01) -->
    ...rendered, never edited by hand...
    <!-- /results -->

The table is the one the run printed (``utilities.results.columns``: the same columns, the
same cells, none cut for the terminal's width), then the run's takeaway. A table may join runs
(``results_cpu.json,results_cpu_4ranks.json``): one caption each, their rows in that order after
a first column naming the flags each run added. ``columns=a,b`` after the files shows those
columns instead (headers such as ``peak`` or variant keys); ``table=NAME`` renders a lesson's
summary of a run (``SUMMARIES``, those the lesson's catalog entry names) instead of its variants.

``python -m utilities.course.readme_tables`` checks every marked table against its JSON (exit 1 and a
diff if one differs); ``--write NN`` re-renders it after a new run. The tests do the check, and
compare what the committed run claims with the quick run the suite already makes.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

from utilities.course.catalog import LESSONS
from utilities.errors import UsageError
from utilities.measure.predictions import predicted_batch_text, predicted_rows
from utilities.results import idle_category_notes, markdown_table
from utilities.results import load as load_results
from utilities.safe_files import atomic_write_text
from utilities.text import markdown, markdown_escape, markdown_inert

REPO = Path(__file__).resolve().parents[2]
MIB = 2**20
BLOCK = re.compile(r"^(<!-- results:(\d\d) (\S+)[^\n]*-->\n)(.*?)^(<!-- /results -->)$", re.S | re.M)
# a lesson's prediction on a cluster (results.json "predicted", saved as is), rendered the same way
PREDICTED = re.compile(r"^(<!-- predicted:(\d\d) (\S+)[^\n]*-->\n)(.*?)^(<!-- /predicted -->)$", re.S | re.M)


# -- what a lesson's table ends with, from the same run ---------------------------------------------
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
                   f"equal the saved model's: {'yes' if d['reload_outputs_equal'] else 'no'}.")
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
    rows = [[label, f"**{search[key]['best']}**", search[key]["reason"],
             ", ".join(str(t["batch"]) for t in search[key]["trials"])]
            for key, label in (("none", "none"), ("all", "every block")) if key in search]
    if not rows:
        return []
    return [markdown([["checkpointed", "largest batch per rank", "evidence", "batches tried"], *rows]),
            f"Budget {search['budget_bytes'] / MIB:.2f} MiB per rank ({search['api']}), batches up to "
            f"{search['limit']}: {search.get('gain', 0):g}x the batch."]


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
    header = ["strategy", "measured on", "bytes per parameter per GPU",
              f"largest model, {cap['gpus']} x {cap['gpu_mem_bytes'] / 1e9:g} GB",
              "classic series, 8 x A10, measured"]
    rows = [[names.get(row["strategy"], row["strategy"]), row["measured_from"],
             f"{row['bytes_per_param']:.2f}", _params(row["largest_model"]),
             _params(classic[row["strategy"]]) if classic.get(row["strategy"]) else "-"]
            for row in cap["at_gpus"]]
    return [markdown([header, *rows])]


# lines a lesson's table ends with, from the same run (after its takeaway), by the name its
# catalog entry gives (``readme_footer``)
FOOTERS: dict[str, Callable[[dict[str, Any]], list[str]]] = {"checkpoints": _checkpoints, "fisher": _fisher}
# other tables of one run, by the name a marker gives (table=NAME) and a lesson's catalog entry
# allows (``readme_summaries``)
SUMMARIES: dict[str, Callable[[dict[str, Any]], list[str]]] = {"search": _batch_search,
                                                               "capacity": _capacity}


def summary(lesson: str, name: str) -> Callable[[dict[str, Any]], list[str]]:
    """The summary ``name`` of the lesson's run; ``KeyError`` unless its catalog entry allows it."""
    info = LESSONS.get(lesson)
    if info is None or name not in info.readme_summaries:
        raise KeyError(f"{lesson} {name}")
    return SUMMARIES[name]


def footer(lesson: str) -> Callable[[dict[str, Any]], list[str]]:
    """What the lesson's table ends with (its catalog entry's ``readme_footer``; none: nothing)."""
    info = LESSONS.get(lesson)
    return FOOTERS[info.readme_footer] if info is not None and info.readme_footer else lambda r: []


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


def source_link(source: str) -> str:
    """A link to the results file a table is rendered from (a path relative to the README): its
    name as text, its path percent-encoded as the target, so no name ends the link early."""
    return f"[`{markdown_escape(source)}`]({quote(source, safe='/._-~')})"


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
        return (f"_And {source_link(source)}: `{command}` (variants: {names}){where}, "
                f"{results['date'][:10]}._")
    batch = f", batch {s['batch_size']} x {s['seq_len']} tokens per rank" if "seq_len" in s else ""
    info = LESSONS.get(results["lesson"])
    sizes = info.sizes if info is not None and info.sizes else f"{s['steps']} steps{batch}"
    return (f"_Rendered from {source_link(source)}: `{command}` on {results['world_size']} "
            f"ranks ({results['device']}, {s.get('backend', '?')}) of one machine ({machine(results)}), "
            f"torch {results['torch']}, {results['date'][:10]}; {results['model']['name']}, "
            f"{sizes}._")


@contextlib.contextmanager
def shape_refused(sources: str) -> Iterator[None]:
    """A results file whose sections (a lesson's own: ``capacity``, a checkpoint's ``layout``...)
    are not what its table reads: one ``UsageError`` line naming it, not a traceback. The keys
    every results file has are checked when it is read (``utilities.results.check``)."""
    try:
        yield
    except UsageError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, ZeroDivisionError,
            OverflowError) as e:
        said = " ".join(str(e).split())
        said = said if len(said) <= 80 else f"{said[:77]}..."
        raise UsageError(f"results file {sources} does not hold what its table reads "
                         f"({type(e).__name__}: {said})") from None


def render(lesson: str, runs: dict[str, Any] | list[tuple[str, dict[str, Any]]],
           source: str = "results_cpu.json", name: str | None = None,
           picked: tuple[str, ...] = ()) -> str:
    """The markdown between the markers: a caption naming each run (``runs``: one results.json,
    or (file, results) pairs whose rows follow one another), then the lesson's table as its run
    printed it (``picked``: these columns instead), or its summary ``name``; then the takeaway
    and what a run skipped. Every string of the runs is ``markdown_inert`` first."""
    if isinstance(runs, dict):
        runs = [(source, runs)]
    runs = [(src, markdown_inert(r)) for src, r in runs]
    with shape_refused(", ".join(repr(src) for src, _ in runs)):
        return _render(lesson, runs, name, picked)


def _render(lesson: str, runs: list[tuple[str, dict[str, Any]]], name: str | None,
            picked: tuple[str, ...]) -> str:
    first = runs[0][1]
    lines = "\n\n".join(caption(r, src, first if len(runs) > 1 else None) for src, r in runs).split("\n")
    if name is not None:
        return "\n".join(lines + ["\n" + line for line in summary(lesson, name)(first)]) + "\n"
    ranks = len({r["world_size"] for _, r in runs}) > 1
    variants = []
    for _, r in runs:
        flags = settings_flags(r, first)
        label = " ".join(filter(None, [f"{r['world_size']} ranks" if ranks else "",
                                       f"`{flags}`" if flags else ""])) or "(defaults)"
        variants += [{**v, "_run": label} for v in r["variants"]]
    run_column = ("run", lambda v: v["_run"]) if len(runs) > 1 else None
    lines += ["", markdown_table(variants, first, picked, run_column)]
    if not picked:
        lines += [f"\n{note[0].upper()}{note[1:]}." for note in idle_category_notes(variants)]
    if first.get("takeaway") and not picked:
        lines.append(f"\nTakeaway, as the run printed it: {first['takeaway']}.")
    for _, r in runs:
        lines += [f"\n{v}: skipped, {why}" for v, why in (r.get("skipped") or {}).items()]
        lines += ["\n" + line for line in footer(lesson)(r)]
    return "\n".join(lines) + "\n"


def render_predicted(block: dict[str, Any], source: str) -> str:
    """The markdown of a lesson's ``predicted`` block: what it is, then the table the lesson prints."""
    block = markdown_inert(block)
    with shape_refused(repr(source)):
        return (f"_PREDICTED by the course's step-time model, not measured: rendered from "
                f"{source_link(source)}, {block['model']} at {predicted_batch_text(block)}, "
                f"{block['precision']}, on {block['cluster']}._\n\n{markdown(predicted_rows(block))}\n")


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

    def load(source: str, results: bool = True) -> dict[str, Any]:
        return load_results(folder / source, results)

    def option(m: re.Match, key: str) -> str | None:
        given = re.search(rf" {key}=(\S+)", m.group(1))
        return given.group(1) if given else None

    new = BLOCK.sub(lambda m: replace(m, lambda src: render(
        lesson, [(one, load(one)) for one in src.split(",")], name=option(m, "table"),
        picked=tuple((option(m, "columns") or "").split(",")) if option(m, "columns") else ())), text)
    new = PREDICTED.sub(lambda m: replace(m, lambda src: render_predicted(load(src, results=False), src)),
                        new)
    if not any(m.group(2) == lesson for pattern in (BLOCK, PREDICTED) for m in pattern.finditer(text)):
        return [f"{readme} has no <!-- results:{lesson} ... --> or <!-- predicted:{lesson} ... --> block"]
    if write and new != text:
        atomic_write_text(readme, new, "README")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m utilities.course.readme_tables",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("lessons", nargs="*", help="lesson numbers (default: every marked README)")
    parser.add_argument("--write", action="store_true", help="re-render the tables in place")
    args = parser.parse_args(argv)
    failed = False
    for lesson in args.lessons or marked_lessons():
        try:
            problems = check(lesson, write=args.write)
        except UsageError as e:
            print(f"error: lesson {lesson}: {e}", file=sys.stderr)
            return 2
        if problems and not args.write:
            failed = True
            print("\n".join(problems))
        print(f"lesson {lesson}: " + ("re-rendered" if args.write and problems else
                                      "differs" if problems else "matches its results JSON"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
