"""What every benchmark script shares: the metadata block, the default output path, timing rules.

Every result file holds ``benchmark``, ``device`` (cpu/cuda), ``device_name``, ``torch``, ``date``
(UTC, ISO 8601), ``tiny`` and ``settings`` (every flag the script ran with), then the script's own
measurements. Files go to ``benchmarks/results/<name>-<device>.json`` unless ``--out`` says otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run from a checkout without install
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402 (after the sys.path fallback above)

from utilities.results import write_json  # noqa: E402
from utilities.text import HelpFormatter  # noqa: E402

RESULTS_DIR = REPO / "benchmarks" / "results"
NO_GPU = "not yet measured: no GPU in this task"


def cpu_name() -> str:
    """This machine's CPU model ("model name" in /proc/cpuinfo where there is one)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def pick_device(name: str = "auto") -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or "cpu"


def device_slug(device: torch.device) -> str:
    """``cpu``, or the GPU's name in lower case with dashes (``nvidia-h100-80gb-hbm3``)."""
    if device.type != "cuda":
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "-", device_name(device).lower()).strip("-")


def metadata(name: str, device: torch.device, args: argparse.Namespace) -> dict[str, Any]:
    def rel(v):  # paths inside the checkout are kept relative to it (results are committed)
        return os.path.relpath(v, REPO) if isinstance(v, str) and v.startswith(str(REPO) + os.sep) else v

    settings = {k: rel(v) for k, v in vars(args).items() if k != "out"}
    return {
        "benchmark": name,
        "device": device.type,
        "device_name": device_name(device),
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "tiny": bool(getattr(args, "tiny", False)),
        "settings": settings,
    }


def output_path(name: str, device: torch.device, out: str | None) -> Path:
    return Path(out) if out else RESULTS_DIR / f"{name}-{device_slug(device)}.json"


def save(data: dict[str, Any], path: Path) -> Path:
    path = write_json(Path(path), data)
    print(f"results written to {path}", flush=True)
    return path


def base_parser(description: str | None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description,
                                formatter_class=HelpFormatter)
    p.add_argument("--tiny", action="store_true",
                   help="the small CPU configuration the tests use (seconds, not minutes)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="cuda when a GPU is visible, else cpu (default: auto)")
    p.add_argument("--out", default=None,
                   help="result file (default benchmarks/results/<name>-<device>.json)")
    return p


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_it(fn: Callable[[], Any], device: torch.device, warmup: int, iters: int) -> dict[str, Any]:
    """The rules: ``warmup`` untimed calls, then ``iters`` timed calls, each synchronized before and
    after; report the median, min and max in milliseconds, and every sample."""
    for _ in range(warmup):
        fn()
    sync(device)
    samples = []
    for _ in range(iters):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        samples.append((time.perf_counter() - t0) * 1e3)
    return {"median_ms": statistics.median(samples), "min_ms": min(samples), "max_ms": max(samples),
            "iters": iters, "warmup": warmup, "samples_ms": samples}


def run_lesson(number: str, out: Path, device: str, nproc: int, flags: list[str],
               timeout: float | None = None) -> tuple[int, dict[str, Any] | None, str]:
    """Launch a lesson through the course CLI (torchrun underneath); return (exit status, its
    results.json or None, the last lines of its output)."""
    cmd = [sys.executable, "-m", "utilities", "run", number, "--device", device, "--nproc",
           str(nproc), "--out", str(out), "--", *flags]
    print("$", " ".join(cmd[1:]), flush=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    tail = (proc.stdout + proc.stderr)[-3000:]
    results = out / "results.json"
    if proc.returncode != 0 or not results.exists():
        print(tail, file=sys.stderr, flush=True)
        return proc.returncode or 1, None, tail
    return 0, json.loads(results.read_text()), tail
