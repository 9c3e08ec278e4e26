"""results.json: what every lesson writes, and the table the CLI prints from it.

Keys (later lessons and the tests rely on them): lesson, title, device, device_name, machine
{cpu_cores, memory_bytes}, world_size, torch, model {name, parameters}, variants [{name,
step_time_s, tokens_per_s, mfu, peak_memory_bytes {total, parameters, gradients, optimizer,
activations, detail}, losses, ...}].
A variant may carry extra keys of its own (e.g. ``fsdp_units``).
"""

from __future__ import annotations

import datetime
import json
import os
import re
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from utilities.errors import UsageError
from utilities.measure import fmt_bytes
from utilities.text import markdown, width, wrap_lines
from utilities.training import TrainStats


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return platform.processor() or platform.machine() or "cpu"


def machine() -> dict[str, int | None]:
    """The host's CPU cores and memory (None where the OS does not say), so a measurement names
    the machine it was taken on."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        memory = None
    return {"cpu_cores": os.cpu_count(), "memory_bytes": memory}


class Results:
    """Collects a lesson's variants and writes them atomically to ``out/results.json``.

    Lessons read ``data`` and write through the methods: ``add`` (a variant), ``extend_variants``,
    ``note``, ``columns``, ``setting``, ``record`` (a section of their own), ``skipped``, ``run_model``,
    ``predicted`` and ``takeaway``.
    """

    # the keys the methods below write; ``record`` refuses them
    OWN_KEYS = frozenset({"lesson", "title", "device", "device_name", "machine", "world_size", "torch",
                          "date", "model", "settings", "variants", "notes", "columns", "takeaway",
                          "predicted", "skipped", "releases"})

    def __init__(self, lesson: str, title: str, device: torch.device, world_size: int,
                 model_name: str | None, parameters: int | None, settings: dict[str, Any]):
        self.data: dict[str, Any] = {
            "lesson": lesson, "title": title, "device": device.type,
            "device_name": device_name(device), "machine": machine(), "world_size": world_size,
            "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "model": {"name": model_name, "parameters": parameters},
            "settings": settings, "variants": [], "notes": [],
        }

    def add(self, name: str, stats: TrainStats | None = None, **extra: Any) -> dict[str, Any]:
        variant: dict[str, Any] = {"name": name}
        if stats is not None:
            variant.update(
                step_time_s=stats.step_time_s, step_times_s=stats.step_times_s,
                tokens_per_s=stats.tokens_per_s, mfu=stats.mfu,
                peak_memory_bytes=stats.peak_memory_bytes, losses=stats.losses,
            )
        variant.update(extra)
        self.data["variants"].append(variant)
        return variant

    def extend_variants(self, fields_by_name: dict[str, dict[str, Any]]) -> None:
        """Fields known only once other variants have run (a ratio to a baseline), added to the
        recorded variants they belong to, by name."""
        by_name = {v["name"]: v for v in self.data["variants"]}
        unknown = sorted(set(fields_by_name) - set(by_name))
        if unknown:
            raise ValueError(f"no recorded variant named {', '.join(map(repr, unknown))}")
        for name, fields in fields_by_name.items():
            by_name[name].update(fields)

    def columns(self, *keys: str) -> None:
        """The variant keys the printed table shows, in this order, after the standard columns
        (default: every scalar key); the rest are named under the table and kept in results.json."""
        self.data["columns"] = list(keys)

    def note(self, text: str) -> None:
        """A sentence the reader needs next to the numbers (e.g. what only a GPU shows)."""
        self.data["notes"].append(text)

    def takeaway(self, text: str) -> None:
        """The lesson's point in one line, from what this run measured (printed last)."""
        self.data["takeaway"] = text

    def setting(self, **values: Any) -> None:
        """Settings the lesson chose after it started (``settings`` in results.json)."""
        self.data["settings"].update(values)

    def record(self, key: str, value: Any) -> Any:
        """A named section of the lesson's own (``capacity``, ``batch_search``...) at the top of
        results.json; returns ``value``. The keys every lesson writes belong to their methods."""
        if key in self.OWN_KEYS:
            raise ValueError(f"results key {key!r} is written by Results itself; lesson sections "
                             f"take other names")
        self.data[key] = value
        return value

    def skipped(self, name: str, reason: str) -> None:
        """A variant that was not run, and why (``skipped`` in results.json)."""
        self.data.setdefault("skipped", {})[name] = reason

    def released(self, name: str, report: dict[str, Any], since: int) -> None:
        """What freeing variant block ``name`` left alive (``releases``), also on each variant
        recorded since index ``since`` (the rows that block added)."""
        self.data.setdefault("releases", {})[name] = report
        for entry in self.data["variants"][since:]:
            entry["release"] = report

    def run_model(self, name: str, parameters: int) -> None:
        """The model the run is named by, when it is not the lesson's ``--model`` (a width sweep
        names its widest)."""
        self.data["model"] = {"name": name, "parameters": parameters}

    def predicted(self, block: dict[str, Any] | None) -> None:
        """The step-time model's prediction of the variants on a cluster (``predicted``), kept
        apart from what was measured; None (other ranks, ``--predict-on none``) records nothing."""
        if block is not None:
            self.data["predicted"] = block

    def write(self, out_dir: str | os.PathLike) -> Path:
        """Write ``out_dir/results.json`` and return its path.

        A run can take an hour; losing what it measured because the folder became unwritable at
        the end (full disk, permissions, a removed mount) helps nobody. If the write fails, the
        results go to a fresh folder under the system's temporary directory instead, with one
        warning line saying why and where; the caller prints the table as usual. Only if that
        fails too is the error raised, after the JSON is printed to stdout so nothing is lost.
        """
        target = Path(out_dir) / "results.json"
        try:
            return write_json(target, self.data)
        except (OSError, UsageError) as e:  # UsageError: the path is not a writable file
            first = e
        try:
            path = Path(tempfile.mkdtemp(prefix=f"fsdp-course-{self.data['lesson']}-")) / "results.json"
            self.data["notes"].append(f"written to {path}: {target} was not writable ({_why(first)})")
            write_json(path, self.data)
        except (OSError, UsageError):
            print(json.dumps(self.data, indent=2), flush=True)
            print(f"error: could not write {target} ({_why(first)}) nor a fallback copy; the "
                  "results are printed above", file=sys.stderr, flush=True)
            raise first from None
        print(f"warning: could not write {target} ({_why(first)}); results written to {path} "
              "instead", file=sys.stderr, flush=True)
        return path


def _why(e: Exception) -> str:
    return f"{type(e).__name__}: {getattr(e, 'strerror', None) or e}"


def write_json(path: Path, data: Any) -> Path:
    """Write JSON to a temporary file beside ``path`` and rename it into place (never half-written)."""
    from utilities.safe_files import atomic_write_text

    return atomic_write_text(path, json.dumps(data, indent=2), "results file")


def load(path: str | os.PathLike, results: bool = True) -> dict[str, Any]:
    """A results.json (``path`` or ``path/results.json``), read within ``utilities.json_input``'s
    bounds and checked by ``check``; one ``UsageError`` line for a file that is not one. With
    ``results`` False, any JSON object (a lesson's saved ``predicted`` block)."""
    from utilities.errors import UsageError
    from utilities.json_input import read_json

    p = Path(path)
    if p.is_dir():
        p = p / "results.json"
    try:
        data = read_json(p)
        if not isinstance(data, dict):
            raise UsageError(f"it holds a JSON {type(data).__name__}, not an object")
        if results:
            check(data)
    except UsageError as e:
        raise UsageError(f"results file {str(p)!r} cannot be read: {e}") from None
    return data


# What the table, the README renderers and the CLI read from a results file, by key: the kinds of
# JSON value allowed (None: null), and for the model, the machine and a variant their own keys.
# Numbers are never negative. A key not listed may hold anything; of those listed only
# ``variants`` must be there (``Results`` writes them all; a renderer that needs one that is
# absent says so in one line).
_NUMBER = (int, float)
_KEYS = {"lesson": (str,), "title": (str,), "device": (str,), "device_name": (str,),
         "world_size": (int,), "torch": (str,), "date": (str,), "model": (dict,),
         "settings": (dict,), "variants": (list,), "machine": (dict, None), "notes": (list,),
         "columns": (list,), "takeaway": (str,), "skipped": (dict,), "predicted": (dict,)}
_SECTIONS = {
    "model": {"name": (str, None), "parameters": (*_NUMBER, None)},
    "machine": {"cpu_cores": (int, None), "memory_bytes": (*_NUMBER, None)},
    "variant": {"name": (str,), "step_time_s": (*_NUMBER, None), "tokens_per_s": (*_NUMBER, None),
                "mfu": (*_NUMBER, None), "peak_memory_bytes": (dict, None), "losses": (list, None),
                "step_times_s": (list, None)},
}
# at most as many ranks as a results file could come from (the planner's largest cluster)
MAX_WORLD_SIZE = 1 << 20


def check(data: Any) -> None:
    """``data`` holds what a results.json holds, each value of the kind the course reads (a
    string where text is shown, a list of variants each an object with a name, numbers not
    negative where they count or time something); ``UsageError`` naming the first value that does
    not (its key and what is allowed)."""
    from utilities.errors import UsageError

    def kinds_text(kinds: tuple) -> str:
        names = {str: "a string", int: "an integer", float: "a number", dict: "an object",
                 list: "a list", None: "null"}
        return " or ".join(dict.fromkeys(names[k] for k in kinds if not (k is float and int in kinds)))

    def value(key: str, got: Any, kinds: tuple) -> None:
        ok = (got is None and None in kinds) or (
            got is not None and not isinstance(got, bool)
            and isinstance(got, tuple(k for k in kinds if k is not None)))
        if not ok:
            raise UsageError(f"{key} is {_brief(got)}; allowed: {kinds_text(kinds)}")
        if isinstance(got, _NUMBER) and got < 0:
            raise UsageError(f"{key} is {_brief(got)}; allowed: numbers >= 0")

    if not isinstance(data, dict):
        raise UsageError(f"it holds a JSON {type(data).__name__}, not an object")
    if "variants" not in data:
        raise UsageError("it has no 'variants' (a results.json lists what the lesson ran there)")
    for key, kinds in _KEYS.items():
        if key in data:
            value(key, data[key], kinds)
    if not 1 <= data.get("world_size", 1) <= MAX_WORLD_SIZE:
        raise UsageError(f"world_size is {_brief(data['world_size'])}; allowed: integers in "
                         f"[1, {MAX_WORLD_SIZE}]")
    sections = [("model", data.get("model") or {}, "model"),
                ("machine", data.get("machine") or {}, "machine")]
    sections += [(f"variants[{i}]", v, "variant") for i, v in enumerate(data["variants"])]
    for where, section, kind in sections:
        value(where, section, (dict,))
        for key, kinds in _SECTIONS[kind].items():
            if key in section:
                value(f"{where}.{key}", section[key], kinds)
        for key in ("losses", "step_times_s"):
            for i, x in enumerate(section.get(key) or ()):
                value(f"{where}.{key}[{i}]", x, _NUMBER)
        for key, x in (section.get("peak_memory_bytes") or {}).items():
            if key != "detail":
                value(f"{where}.peak_memory_bytes.{_key(key)}", x, (*_NUMBER, None))
    for key in ("notes", "columns"):
        for i, x in enumerate(data.get(key) or ()):
            value(f"{key}[{i}]", x, (str,))
    for name, why in (data.get("skipped") or {}).items():
        value(f"skipped.{_key(name)}", why, (str,))


def _key(key: str) -> str:
    """A key from the file as an error line names it: as is when it is a plain name, else its
    repr cut to 40 characters (never a line break)."""
    return key if re.fullmatch(r"[\w.-]{1,40}", key, re.ASCII) else _brief(key)


def _brief(value: Any) -> str:
    """A value as an error line shows it: its repr, cut to 40 characters."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}..."


def variant(results: dict[str, Any], name: str) -> dict[str, Any]:
    """The variant called ``name`` in a results.json (KeyError naming those there if none is)."""
    for v in results["variants"]:
        if v["name"] == name:
            return v
    raise KeyError(f"no variant {name!r} in {[v['name'] for v in results['variants']]}")


def peak_range(results: dict[str, Any]) -> str:
    """The range of peak memory per rank over the variants that ran: a lesson's takeaway when its
    own cannot be said (``--variants`` left out a variant it reads)."""
    measured = [v for v in results["variants"] if (v.get("peak_memory_bytes") or {}).get("total")]
    if not measured:
        return f"{len(results['variants'])} variants ran; see the table"
    low, high = (f(measured, key=lambda v: v["peak_memory_bytes"]["total"]) for f in (min, max))
    return (f"peak per rank from {fmt_bytes(low['peak_memory_bytes']['total'])} ({low['name']}) to "
            f"{fmt_bytes(high['peak_memory_bytes']['total'])} ({high['name']})")


Column = tuple[str, Callable[[dict[str, Any]], str]]


# The memory categories of the peak, by column label; a category that is 0 at the peak in every
# variant is a note instead of a column (``idle_categories``), saying why where the reason is
# general: gradients exist only from backward on, and zero_grad frees the last step's.
CATEGORY_COLUMNS = (("params", "parameters"), ("grads", "gradients"), ("optim", "optimizer"),
                    ("activ", "activations"))
IDLE_CATEGORY_REASONS = {
    "gradients": "the peak comes before backward makes a gradient, and zero_grad freed the last step's",
}
# The columns a table keeps first when the terminal is too narrow for all (the rest in their
# order): the variant, its peak and the category most of a training peak is made of.
KEPT_FIRST = ("variant", "peak", "activ", "step", "tokens/s", "MFU")


def idle_categories(variants: list[dict[str, Any]]) -> list[str]:
    """The memory categories that are 0 at the peak in every variant that measured one."""
    peaks = [v["peak_memory_bytes"] for v in variants if (v.get("peak_memory_bytes") or {}).get("total")]
    return [key for _, key in CATEGORY_COLUMNS
            if peaks and all(key in p and not p[key] for p in peaks)]


def idle_category_notes(variants: list[dict[str, Any]]) -> list[str]:
    """One line per category ``idle_categories`` leaves out of the table, and why."""
    notes = []
    for key in idle_categories(variants):
        why = IDLE_CATEGORY_REASONS.get(key)
        notes.append(f"{key}: 0 B at the peak in every variant, not a column" + (f" ({why})" if why else ""))
    return notes


def columns(results: dict[str, Any]) -> tuple[list[Column], list[str]]:
    """The columns of the comparison (header, a variant's cell) and the scalar keys they leave
    out: the variant's name; step time, tokens/s, MFU and the peak; the lesson's own columns (the
    ``columns`` it chose, else every scalar key); then the peak by category and the losses. A
    column that is empty for every variant is left out, and so is a category that is 0 at the
    peak in every variant (``idle_category_notes`` says so under the table)."""
    variants = results["variants"]
    extras = list(results.get("columns", ()))
    chosen = bool(extras)
    hidden = []
    for v in variants:
        for k, val in v.items():
            scalar = val is None or isinstance(val, (int, float, str))
            if scalar and k not in extras and k not in _SKIP and not k.startswith("_"):
                (hidden if chosen else extras).append(k)
    first = [
        ("step", lambda v: _seconds(v.get("step_time_s"))),
        ("tokens/s", lambda v: _count(v.get("tokens_per_s"))),
        ("MFU", lambda v: "-" if v.get("mfu") is None else f"{v['mfu']:.1%}"),
        ("peak", _mem("total")),
    ]
    idle = idle_categories(variants)
    breakdown = [
        *[(label, _mem(key)) for label, key in CATEGORY_COLUMNS if key not in idle],
        ("loss", lambda v: f"{v['losses'][0]:.3f}->{v['losses'][-1]:.3f}" if v.get("losses") else "-"),
    ]
    lesson = [(_label(k), _cell(k)) for k in extras]
    # the lesson's own columns come before the rest of the memory breakdown, so that they are cut
    # after it (``KEPT_FIRST`` are cut last)
    shown = [("variant", lambda v: str(v["name"])), *first, *lesson, *breakdown]
    shown = [(h, f) for h, f in shown if h == "variant" or any(f(v) != "-" for v in variants)]
    return shown, [_label(k) for k in dict.fromkeys(hidden)]


def table(results: dict[str, Any]) -> str:
    """The comparison as a plain-text table, one row per variant, at most ``width()`` columns wide.

    Every number is shown in a human unit (bytes as MiB/GiB, counts as 1.9M, seconds, ratios as
    1.52x); columns that are empty for every variant are left out, a memory category that is 0 at
    the peak in every variant is a note, and columns that do not fit (``KEPT_FIRST`` fit first,
    then the others in their order) are named in a last line (their values are in results.json).
    """
    cols, hidden = columns(results)
    rows = [[h for h, _ in cols]] + [[f(v) for _, f in cols] for v in results["variants"]]
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    headers = [h for h, _ in cols]
    priority = sorted(range(len(cols)), key=lambda i: (KEPT_FIRST.index(headers[i])
                                                       if headers[i] in KEPT_FIRST else len(KEPT_FIRST), i))
    fitting, used, limit = set(), -2, width()
    for i in priority:
        if used + 2 + widths[i] > limit:
            break
        used = used + 2 + widths[i]
        fitting.add(i)
    keep = sorted(fitting)
    lines = ["  ".join(r[i].ljust(widths[i]) for i in keep).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * widths[i] for i in keep))
    more = [headers[i] for i in range(len(cols)) if i not in fitting] + hidden
    if more:
        lines.append(wrap_lines("more columns in results.json: " + ", ".join(more)))
    title = (f"lesson {results['lesson']} {results['title']}: {results['model']['name']} "
             f"({_count(results['model']['parameters'])} params) on {results['world_size']} x "
             f"{results['device_name']} ({results['device']}), torch {results['torch']}")
    notes = [wrap_lines(f"note: {n}") for n in [*idle_category_notes(results["variants"]),
                                                 *results.get("notes", [])]]
    return "\n".join([wrap_lines(title), *lines, *notes])


def markdown_table(variants: list[dict[str, Any]], results: dict[str, Any],
                   picked: tuple[str, ...] = (), lead_column: Column | None = None) -> str:
    """The comparison of ``table`` (the same columns and cells, none cut) in markdown, over
    ``variants`` (one run's, or the runs' of one lesson, ``results`` being one), after
    ``lead_column`` if given. ``picked`` names the columns to show instead, by header (``peak``,
    ``loss``...) or variant key. A row with nothing in its columns but its name is left out."""
    cols, _ = columns({**results, "variants": variants})
    if picked:
        standard = {h: (h, f) for h, f in cols if h in STANDARD}
        chosen = [standard.get(k) if k in STANDARD else (_label(k), _cell(k)) for k in picked]
        cols = [cols[0], *[c for c in chosen if c and any(c[1](v) != "-" for v in variants)]]
    lead = 2 if lead_column else 1
    cols = [lead_column, *cols] if lead_column else cols
    rows = [[f(v) for _, f in cols] for v in variants]
    return markdown([[h for h, _ in cols], *[row for row in rows if any(c != "-" for c in row[lead:])]])


# the headers of the columns every table has (when a variant has a value for them)
STANDARD = ("step", "tokens/s", "MFU", "peak", "params", "grads", "optim", "activ", "loss")
_SKIP = {"name", "step_time_s", "tokens_per_s", "mfu", "losses", "step_times_s",
         "peak_memory_bytes", "release"}
# unit suffixes dropped from a key to make its column label (the value shows the unit)
_UNITS = ("_bytes_per_rank", "_bytes", "_parameters", "_params", "_s", "_ratio", "_x")


def human(key: str, value: Any) -> str:
    """One value of a results.json column in a human unit, chosen by its key's suffix."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, str):
        return value
    if key.endswith(("_bytes", "_bytes_per_rank")):
        return fmt_bytes(value)
    if key.endswith(("_parameters", "_params", "_tokens", "_elements")):
        return _count(value)
    if key.endswith("_per_s"):
        return f"{value:.3g}/s"
    if key.endswith(("_s", "_s_per_step")):
        return _seconds(value)
    if key.endswith(("_ratio", "_x", "speedup")):
        return f"{value:.2f}x"
    if key.endswith(("_fraction", "_pct", "_accuracy")):
        return f"{value:.1f}%" if key.endswith("_pct") else f"{value:.1%}"
    if isinstance(value, float):
        return f"{value:.4g}"
    return _count(value) if abs(value) >= 10_000 else str(value)


def _label(key: str) -> str:
    if "." in key:  # a.b: a's label, then b
        return f"{_label(key.split('.')[0])} {key.rsplit('.', 1)[1]}"
    if key.endswith("_per_s"):
        return key[: -len("_per_s")].replace("_", " ") + "/s"
    for suffix in _UNITS:
        if key.endswith(suffix) and len(key) > len(suffix):
            key = key[: -len(suffix)]
            break
    return key.replace("_", " ")


def _cell(key: str) -> Callable[[dict[str, Any]], str]:
    """A variant's value under ``key`` in a human unit; ``a.b`` reads ``v[a][b]``, in a's unit."""
    def cell(v: dict[str, Any]) -> str:
        for part in key.split("."):
            v = v.get(part) if isinstance(v, dict) else None
        return human(key.split(".")[0], v)
    return cell


def _mem(category: str):
    return lambda v: fmt_bytes((v.get("peak_memory_bytes") or {}).get(category))


def _seconds(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x * 1000:.1f} ms" if x < 1 else f"{x:.2f} s"


def _count(n: float | None) -> str:
    """1,234 -> 1.2K, 1,887,232 -> 1.89M: counts in a width a table can hold."""
    if n is None:
        return "-"
    for div, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= div:
            return f"{n / div:.3g}{unit}"
    return f"{n:.0f}" if isinstance(n, float) else str(n)
