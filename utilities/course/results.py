"""results.json: what every lesson writes, and the table the CLI prints from it.

Keys (later lessons and the tests rely on them): lesson, title, device, device_name, world_size,
torch, model {name, parameters}, variants [{name, step_time_s, tokens_per_s, mfu,
peak_memory_bytes {total, parameters, gradients, optimizer, activations, detail}, losses, ...}].
A variant may carry extra keys of its own (e.g. ``fsdp_units``).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from utilities.measure import fmt_bytes
from utilities.training import TrainStats


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return platform.processor() or platform.machine() or "cpu"


class Results:
    """Collects a lesson's variants and writes them atomically to ``out/results.json``."""

    def __init__(self, lesson: str, title: str, device: torch.device, world_size: int,
                 model_name: str | None, parameters: int | None, settings: dict[str, Any]):
        self.data: dict[str, Any] = {
            "lesson": lesson, "title": title, "device": device.type,
            "device_name": device_name(device), "world_size": world_size,
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

    def note(self, text: str) -> None:
        """A sentence the reader needs next to the numbers (e.g. what only a GPU shows)."""
        self.data["notes"].append(text)

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
        except OSError as e:
            first = e
        try:
            path = Path(tempfile.mkdtemp(prefix=f"fsdp-course-{self.data['lesson']}-")) / "results.json"
            self.data["notes"].append(f"written to {path}: {target} was not writable ({_why(first)})")
            write_json(path, self.data)
        except OSError:
            print(json.dumps(self.data, indent=2), flush=True)
            print(f"error: could not write {target} ({_why(first)}) nor a fallback copy; the "
                  "results are printed above", file=sys.stderr, flush=True)
            raise first from None
        print(f"warning: could not write {target} ({_why(first)}); results written to {path} "
              "instead", file=sys.stderr, flush=True)
        return path


def _why(e: OSError) -> str:
    return f"{type(e).__name__}: {e.strerror or e}"


def write_json(path: Path, data: Any) -> Path:
    """Write JSON to a temporary file beside ``path`` and rename it into place (never half-written)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load(path: str | os.PathLike) -> dict[str, Any]:
    p = Path(path)
    if p.is_dir():
        p = p / "results.json"
    return json.loads(p.read_text())


def table(results: dict[str, Any], extra_columns: tuple[str, ...] = ()) -> str:
    """The comparison as a plain-text table, one row per variant."""
    extras = list(extra_columns)
    for v in results["variants"]:
        for k, val in v.items():
            if k not in extras and isinstance(val, (int, float, str, bool)) and k not in _SKIP:
                extras.append(k)
    head = ["variant", "step s", "tokens/s", "MFU", "peak", "params", "grads", "optim", "activ",
            "loss first->last", *extras]
    rows = [head]
    for v in results["variants"]:
        mem = v.get("peak_memory_bytes") or {}
        losses = v.get("losses") or []
        rows.append([
            v["name"], _num(v.get("step_time_s"), "{:.4f}"), _num(v.get("tokens_per_s"), "{:,.0f}"),
            _num(v.get("mfu"), "{:.1%}"), fmt_bytes(mem.get("total")), fmt_bytes(mem.get("parameters")),
            fmt_bytes(mem.get("gradients")), fmt_bytes(mem.get("optimizer")),
            fmt_bytes(mem.get("activations")),
            f"{losses[0]:.3f}->{losses[-1]:.3f}" if losses else "-",
            *[str(v.get(k, "-")) for k in extras],
        ])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    title = (f"lesson {results['lesson']} {results['title']}: {results['model']['name']} "
             f"({results['model']['parameters']:,} params) on {results['world_size']} x "
             f"{results['device_name']} ({results['device']}), torch {results['torch']}")
    notes = [f"note: {n}" for n in results.get("notes", [])]
    return "\n".join([title, *lines, *notes])


_SKIP = {"name", "step_time_s", "tokens_per_s", "mfu"}


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else fmt.format(x)
