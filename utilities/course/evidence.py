"""``fsdp-course evidence``: everything the course can only measure on a GPU, in one command.

A GPU is lent for a short time (30 minutes with the machine's start). This runs, in order of value,
what a CPU cannot show: the GPU tests, each lesson's GPU run, the benchmarks, and the time model's
calibration where it exists. Each step runs as its own process from the repository root, its
output kept in ``STEP.log``; a failing step is recorded with its exit code and last error line and
the run goes on; a step whose estimate no longer fits the budget is skipped and said so. Everything
lands in one folder (default ``benchmarks/results/gpu/<date>-<gpu>/``) with ``manifest.json``:
device, driver, torch, CUDA, commit, date, and each step's status and wall time. Then
``render_readmes`` writes each lesson README's "On a GPU" table from the lesson runs in that
folder (between ``<!-- gpu-results:NN -->`` and ``<!-- /gpu-results -->``).

Minutes per step are estimates for one H100 until a run measures them: ``--plan`` prints them and
their total; the manifest records what each step really took.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from utilities.course.catalog import LESSONS, REPO_ROOT
from utilities.errors import UsageError, bad_value

BUDGET_MINUTES = 25.0
GPU_BLOCK = re.compile(r"(<!-- gpu-results:(\d\d)[^\n]*-->\n)(.*?)(<!-- /gpu-results -->)", re.S)


@dataclass(frozen=True)
class Step:
    """One thing to measure: its name (for ``--only``), the estimated minutes on one H100, the
    command (argv, run from the repository root; ``{out}`` becomes the evidence folder) and what
    it shows."""

    name: str
    minutes: float
    command: tuple[str, ...]
    what: str


@dataclass
class Outcome:
    name: str
    status: str  # ok, failed, timeout, skipped
    seconds: float = 0.0
    returncode: int | None = None
    error: str = ""  # the last line that names an error, for a failed step
    log: str = ""


@dataclass
class Manifest:
    device: str
    driver: str
    torch: str
    cuda: str
    commit: str
    date: str
    budget_minutes: float
    steps: list[Outcome] = field(default_factory=list)


def gpu_steps(python: str = sys.executable) -> list[Step]:
    """The GPU evidence, most valuable first. Lessons run ``--quick`` where the full GPU size would
    not fit the budget (02, 05: their batch searches; 10: a full training run), and say so."""
    course = (python, "-m", "utilities")
    quick = {"02": "its batch search is long", "05": "its batch search is long",
             "10": "a full training run is long"}
    steps = [Step("gpu-tests", 6.0, (python, "-m", "pytest", "-m", "gpu", "-n", "0", "-q", "tests/gpu",
                                     "--junitxml", "{out}/gpu-tests.xml"),
                  "the GPU tests (each has a CPU twin in the suite)")]
    minutes = {"01": 0.8, "02": 1.0, "03": 0.6, "04": 1.0, "05": 1.0, "06": 0.8, "07": 1.0,
               "08": 0.6, "09": 0.8, "10": 1.0, "11": 0.8, "12": 0.6, "13": 1.5, "14": 1.0}
    for number, info in LESSONS.items():
        if not info.ready:
            continue
        flags = ("--quick",) if number in quick else ()
        note = f" (--quick: {quick[number]})" if number in quick else ""
        steps.append(Step(f"lesson-{number}", minutes.get(number, 1.0),
                          (*course, "run", number, "--device", "cuda", *flags, "--out",
                           f"{{out}}/run{number}"),
                          f"lesson {number}'s GPU run{note}"))
    steps.append(Step("benchmarks", 5.0, (python, "benchmarks/run_all.py", "--device", "cuda",
                                          "--results-dir", "{out}"),
                       "benchmarks: reference ratio, MFU, FP8 layer, compile"))
    steps.append(Step("calibrate", 1.0, (*course, "plan", "--calibrate", "--calibration",
                                         "{out}/calibration.json"),
                      "the time model's efficiencies measured on this GPU"))
    return steps


def select(steps: list[Step], only: list[str] | None) -> list[Step]:
    """The steps ``--only`` names, in the plan's order; an unknown name is a one-line error."""
    if not only:
        return steps
    names = [s.name for s in steps]
    for name in only:
        if name not in names:
            raise bad_value("--only", name, names)
    return [s for s in steps if s.name in only]


def format_steps(steps: list[Step], budget: float) -> str:
    lines = [f"{'step':<12}{'min':>6}  what"]
    lines += [f"{s.name:<12}{s.minutes:>6.1f}  {s.what}" for s in steps]
    total = sum(s.minutes for s in steps)
    lines.append(f"{'total':<12}{total:>6.1f}  minutes on one H100 (estimates); budget {budget:g}")
    return "\n".join(lines)


def last_error(text: str) -> str:
    """The last line of a step's output that names an error, else its last line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for line in reversed(lines):
        if re.search(r"error|failed|Error|FAILED", line):
            return line[:300]
    return lines[-1][:300] if lines else ""


def run_steps(steps: list[Step], out: Path, budget_minutes: float,
              clock: Callable[[], float] = time.monotonic, echo: Callable[[str], None] = print,
              cwd: Path = REPO_ROOT) -> list[Outcome]:
    """Run each step in order within the budget; a failure is recorded and the run goes on."""
    out.mkdir(parents=True, exist_ok=True)
    start = clock()
    outcomes = []
    for i, step in enumerate(steps, 1):
        left = budget_minutes - (clock() - start) / 60
        if step.minutes > left:
            outcomes.append(Outcome(step.name, "skipped", error=f"{step.minutes:.1f} min estimated, "
                                                                f"{left:.1f} min of budget left"))
            echo(f"[{i}/{len(steps)}] {step.name}: skipped ({step.minutes:.1f} min estimated, "
                 f"{left:.1f} left)")
            continue
        echo(f"[{i}/{len(steps)}] {step.name} (~{step.minutes:.1f} min; {left:.1f} min left): {step.what}")
        log = out / f"{step.name}.log"
        command = [part.replace("{out}", str(out)) for part in step.command]
        began = clock()
        try:
            proc = subprocess.run(command, cwd=cwd, text=True, capture_output=True,
                                  timeout=max(60.0, left * 60))
            text = f"$ {' '.join(command)}\n{proc.stdout}\n{proc.stderr}"
            status = "ok" if proc.returncode == 0 else "failed"
            outcome = Outcome(step.name, status, returncode=proc.returncode,
                              error="" if status == "ok" else last_error(proc.stdout + "\n" + proc.stderr))
        except subprocess.TimeoutExpired as e:
            text = f"$ {' '.join(command)}\n{_text(e.stdout)}\n{_text(e.stderr)}"
            outcome = Outcome(step.name, "timeout", error="stopped at the end of the budget")
        except OSError as e:
            text = f"$ {' '.join(command)}\n{e}"
            outcome = Outcome(step.name, "failed", error=str(e))
        log.write_text(text)
        outcome.seconds, outcome.log = round(clock() - began, 1), log.name
        outcomes.append(outcome)
        said = f": {outcome.error}" if outcome.error else ""
        echo(f"    {outcome.status} in {outcome.seconds:.0f} s{said}")
    return outcomes


def _text(output: str | bytes | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


# -- README tables ---------------------------------------------------------------------------------
def render_readmes(folder: Path, lessons_dir: Path = REPO_ROOT / "lessons") -> list[str]:
    """Write each marked "On a GPU" table from ``folder/runNN/results.json``, rendered as the
    lesson's CPU table is (``readme_tables.render``: the same columns, a caption naming the run);
    the lessons whose README changed. A lesson without a run in the folder keeps its table."""
    from utilities.course.readme_tables import render
    from utilities.measure.results import load

    def replace(m: re.Match, readme: Path) -> str:
        results_path = folder / f"run{m.group(2)}" / "results.json"
        if not results_path.is_file():
            return m.group(0)
        table = render(m.group(2), load(results_path),
                       os.path.relpath(results_path.resolve(), readme.parent.resolve()))
        return m.group(1) + table + m.group(4)

    changed = []
    for readme in sorted(lessons_dir.glob("*/README.md")):
        text = readme.read_text()
        new = GPU_BLOCK.sub(lambda m, readme=readme: replace(m, readme), text)
        if new != text:
            readme.write_text(new)
            changed.append(readme.parent.name[:2])
    return changed


# -- the command -----------------------------------------------------------------------------------
def describe_machine() -> dict[str, str]:
    import torch

    driver = ""
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                text=True, capture_output=True, timeout=20).stdout.strip().splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        driver = "unknown"
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, text=True,
                            capture_output=True).stdout.strip() or "unknown"
    return {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
            "driver": driver, "torch": torch.__version__, "cuda": str(torch.version.cuda),
            "commit": commit,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def default_folder(machine: dict[str, str]) -> Path:
    slug = re.sub(r"[^a-z0-9]+", "-", machine["device"].lower()).strip("-") or "gpu"
    return REPO_ROOT / "benchmarks" / "results" / "gpu" / f"{machine['date'][:10]}-{slug}"


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--plan", action="store_true",
                        help="print each step with its estimated minutes on one H100, and the total")
    parser.add_argument("--only", nargs="+", default=None, metavar="STEP",
                        help="run only these steps (names as --plan prints them)")
    parser.add_argument("--budget", default=str(BUDGET_MINUTES),
                        help=f"minutes available (default {BUDGET_MINUTES:g}); a step whose estimate "
                             "no longer fits is skipped")
    parser.add_argument("--out", default=None,
                        help="evidence folder (default benchmarks/results/gpu/DATE-GPU)")
    return parser


def main(args: argparse.Namespace, gpu_available: Callable[[], bool] | None = None) -> int:
    try:
        budget = float(args.budget)
    except ValueError:
        budget = float("nan")
    if not budget > 0 or budget == float("inf"):
        raise bad_value("--budget", args.budget, "minutes > 0")
    steps = select(gpu_steps(), args.only)
    if args.plan:
        print(format_steps(steps, budget))
        return 0
    if gpu_available is None:
        import torch

        gpu_available = torch.cuda.is_available
    if not gpu_available():
        raise UsageError("fsdp-course evidence needs a CUDA GPU and none is visible here; "
                         "`fsdp-course evidence --plan` shows what it would run")
    machine = describe_machine()
    out = Path(args.out) if args.out else default_folder(machine)
    manifest = Manifest(**machine, budget_minutes=budget)
    manifest.steps = run_steps(steps, out, budget)
    (out / "manifest.json").write_text(json.dumps(asdict(manifest), indent=2) + "\n")
    changed = render_readmes(out)
    print(f"evidence in {out}; READMEs re-rendered: {', '.join(changed) or 'none'}")
    return 0 if all(o.status == "ok" for o in manifest.steps) else 1
