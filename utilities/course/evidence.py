"""``fsdp-course evidence``: the course's GPU measurements, in chunks that fit a short GPU slot.

A GPU is often lent for minutes (a borrowed cloud GPU, a cluster job with a wall-clock limit).
``--minutes M`` (default 8) runs the most valuable steps that fit in M minutes and have no result yet
for this version of their code in the evidence folder (``--into``); the next slot takes the following
ones, until the folder is complete. A step's version is a hash of the files it runs (the harness, its
own lesson, test or benchmark files, and every repository module those import), so a later slot
neither redoes what is still valid nor trusts what a code change made stale. Each step runs as its
own process group from the repository root; its output lands in ``STEP.log``, the files it is kept
for (a lesson's results.json, a benchmark's JSON, a JUnit file) under ``STEP/``, and its status,
wall time and version in ``manifest.json``. A step that needs a package this machine lacks is left
for a machine that has it, and said so; a failure is recorded and the chunk goes on.

``--pack FILE.tar.gz`` writes the folder into one archive (rewritten after every step, so a slot cut
short still hands back what it did); on a CPU machine ``--unpack FILE.tar.gz`` merges it into the
evidence folder and re-renders every lesson README's "On a GPU" table, the benchmark README's tables
and the time model's calibration row from what is there. ``--plan`` shows what is done, what is next,
and the minutes each step is estimated to take: an estimate for one H100 until a run measured it,
then what it took last time.

    PYTHONUNBUFFERED=1 python3 -m utilities evidence --minutes 8 --pack OUT/evidence.tar.gz
"""

from __future__ import annotations

import argparse
import ast
import datetime
import functools
import hashlib
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from utilities.course.catalog import LESSONS, REPO_ROOT, gpu_claims, shared_gpu_runs
from utilities.errors import UsageError, bad_value
from utilities.json_input import read_json

CHUNK_MINUTES = 8.0
SCHEMA = 2
EVIDENCE_ROOT = Path("benchmarks") / "results" / "gpu"
PACK_LIMIT_BYTES = 16 * 2**20
LOG_LIMIT_BYTES = 2**20  # a log longer than this keeps its last MiB
KEPT_FILE_LIMIT_BYTES = 4 * 2**20
GPU_BLOCK = re.compile(r"(<!-- gpu-results:(\d\d)[^\n]*-->\n)(.*?)(<!-- /gpu-results -->)", re.S)
SAFE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")

# What every lesson run goes through: the command, the launcher and the harness (each followed to
# every repository module it imports), and the planner the launcher asks before ranks share a GPU.
HARNESS = ("utilities/__main__.py", "utilities/course/cli.py", "utilities/course/launch.py",
           "utilities/course/torchrun.py", "utilities/course/lesson.py", "utilities/measure/planner.py")
# Followed only through their module-level imports: the command's lazy imports serve other commands.
SHALLOW = frozenset({"utilities/course/cli.py"})
GPU_TESTS = ("tests/conftest.py", "tests/gpu_cases.py")

# Done: a result for this version. "skipped": every test the step ran skipped itself (the reason is in
# its log); "too-long": killed after it had a whole chunk to itself.
DONE = ("ok", "failed", "skipped", "too-long")
STATUSES = (*DONE, "cut", "unavailable")
# What a loan learns from a step, most first: a GPU claim, a benchmark (or the calibration), memory
# on ranks sharing the GPU, the GPU readiness checks, a lesson's quick run, a lesson at its GPU size.
KINDS = ("claim", "bench", "shared", "readiness", "quick", "lesson")
# The smoke step: one quick lesson through the current harness; a quick run whose own files did not
# change since it passed (only a shared harness file did) is refreshed by it.
SMOKE = "smoke-harness"
MAX_NAME_CHARS = 100


@dataclass(frozen=True)
class Step:
    """One thing to measure: its name (``--only``), the minutes it is estimated to take on one H100,
    the command (argv from the repository root; ``{out}`` is the step's folder in the evidence,
    ``{scratch}`` an empty folder deleted afterwards), what it shows, the files it runs (globs from
    the repository root; its version is the content of these and of every repository module they
    import, ``code_files``), the files under ``{scratch}`` worth keeping, and the Python modules it
    cannot run without."""

    name: str
    minutes: float
    command: tuple[str, ...]
    what: str
    inputs: tuple[str, ...] = HARNESS
    keep: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()
    kind: str = "claim"  # one of KINDS: what a loan learns from it, most first


@dataclass
class Record:
    """A step's latest result in the folder."""

    status: str  # ok, failed, too-long, cut (the chunk ended first), unavailable
    seconds: float = 0.0
    version: str = ""
    date: str = ""
    device: str = ""
    returncode: int | None = None
    error: str = ""
    log: str = ""
    own: str = ""  # the version of the step's own files (``own_version_of``): the harness left out

    @classmethod
    def from_json(cls, data: object) -> Record:
        """A record from a manifest's JSON; ``ValueError`` unless every field has its type."""
        if not isinstance(data, dict) or not set(data) <= set(cls.__dataclass_fields__):
            raise ValueError("a step's record is not an object of the record's fields")
        record = cls(**data)
        texts = (record.version, record.date, record.device, record.error, record.log, record.own)
        if (record.status not in STATUSES or not all(isinstance(t, str) for t in texts)
                or isinstance(record.seconds, bool) or not isinstance(record.seconds, (int, float))
                or not 0 <= record.seconds < 1e9
                or not (record.returncode is None or type(record.returncode) is int
                        and abs(record.returncode) < 2**31)):
            raise ValueError("a step's record has a field of the wrong type")
        return record


@dataclass
class Manifest:
    folder: str
    schema: int = SCHEMA
    chunks: list[dict] = field(default_factory=list)  # each: the machine, the date, the minutes, the steps
    steps: dict[str, Record] = field(default_factory=dict)

    @classmethod
    def read(cls, path: Path) -> Manifest | None:
        if not path.is_file():
            return None
        try:
            data = read_json(path)
            if data.get("schema") != SCHEMA:
                return None
            folder, chunks, steps = data["folder"], data.get("chunks", []), data.get("steps", {})
            if (not isinstance(folder, str) or not isinstance(chunks, list) or not isinstance(steps, dict)
                    or not all(isinstance(c, dict) and isinstance(c.get("date", ""), str) for c in chunks)
                    or not all(SAFE_NAME.fullmatch(n) and len(n) <= MAX_NAME_CHARS for n in steps)):
                raise ValueError("not a manifest")
            return cls(folder=folder, chunks=chunks,
                       steps={name: Record.from_json(record) for name, record in steps.items()})
        except (UsageError, ValueError, TypeError, KeyError, AttributeError):
            raise UsageError(f"{str(path)!r} is not allowed: not an evidence manifest; allowed: the "
                             "manifest.json `fsdp-course evidence` writes") from None

    def write(self, path: Path) -> None:
        data = {"schema": self.schema, "folder": self.folder, "chunks": self.chunks,
                "steps": {name: asdict(record) for name, record in sorted(self.steps.items())}}
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        os.replace(tmp, path)


# -- the steps, most valuable first ---------------------------------------------------------------
def claim_ids() -> list[str]:
    """The ids of the GPU claims, from the lesson catalog (each a case of tests/gpu_cases.py)."""
    return [claim.id for claim in gpu_claims()]


def gpu_steps(python: str = sys.executable) -> list[Step]:
    """The GPU evidence, most valuable first: the GPU claims, the benchmarks and the calibration,
    memory on ranks sharing the GPU, the readiness checks, the smoke step, every lesson's quick run
    (the failures that would embarrass us), then every lesson at its GPU size for the READMEs. The
    order a chunk takes them in is ``ordered``'s: what was never measured first."""
    course = (python, "-m", "utilities")

    def lesson_files(*numbers):
        return HARNESS + tuple(f"lessons/{LESSONS[n].folder}/*.py" for n in numbers if n in LESSONS)

    def pytest_step(name, minutes, node, what, lessons=(), extra=(), needs=(), kind="claim"):
        file = node.split("::")[0]
        return Step(name, minutes, (python, "-m", "pytest", "-m", "gpu", "-n", "0", "-q", "-p",
                                    "no:cacheprovider", node, *extra, "--junitxml", "{out}/junit.xml"),
                    what, lesson_files(*lessons) + GPU_TESTS + (file,), needs=needs, kind=kind)

    def bench_files(*lessons):
        return lesson_files(*lessons) + ("benchmarks/run_all.py", "benchmarks/report.py")

    ready = [n for n, info in LESSONS.items() if info.ready]
    smoke = "tests/gpu/test_gpu_smoke.py"
    steps = [pytest_step(f"claim-{cid}", 1.0, f"{smoke}::test_gpu_claim[{cid}]",
                         f"GPU claim {cid} (its CPU twin is in the suite)", lessons=(cid[:2],))
             for cid in claim_ids()]
    bench = (python, "benchmarks/run_all.py", "--device", "cuda", "--no-report", "--results-dir", "{out}",
             "--work-dir", "{scratch}", "--only")
    steps.append(Step("bench-end-to-end", 4.0, (*bench, "end_to_end"),
                      "the plain-loop reference and FSDP2's ratio to it, MFU",
                      bench_files("10") + ("benchmarks/end_to_end.py", "benchmarks/reference.py"),
                      kind="bench"))
    steps.append(Step("bench-layer", 1.5, (*bench, "layer"), "one layer: eager, compiled, FP8",
                      bench_files("13") + ("benchmarks/layer.py",), kind="bench"))
    steps.append(Step("calibrate", 0.5, (*course, "plan", "--calibrate", "--calibration",
                                         "{out}/calibration.json"),
                      "the time model's efficiencies measured on this GPU",
                      HARNESS + ("utilities/measure/calibrate.py",), kind="bench"))
    steps.append(Step("bench-memory-maximizer", 2.0, (*bench, "memory_maximizer"),
                      "batch search with and without cudaMalloc retries",
                      bench_files("05") + ("benchmarks/memory_maximizer.py",), kind="bench"))
    steps.append(pytest_step("fp8", 1.5, "tests/gpu/test_fp8_smoke.py", "FP8 + compile (lesson 13)",
                             lessons=("13",), needs=("torchao",), kind="bench"))
    shared = "tests/gpu/test_shared_gpu.py"
    steps += [pytest_step(f"shared-{key}", 1.0, f"{shared}::{run.test}",
                          f"ranks sharing the GPU: {run.test.split('[')[0][5:]}", lessons=(info.number,),
                          kind="shared") for key, (info, run) in shared_gpu_runs().items()]
    steps.append(pytest_step("gpu-readiness", 0.4, smoke, "Memory_Maximizer and bf16_ready on a real GPU",
                             extra=("-k", "not test_gpu_claim"), kind="readiness"))
    steps.append(Step(SMOKE, 0.6, (*course, "run", "01", "--quick", "--device", "cuda", "--out", "{scratch}"),
                      "lesson 01's quick run through the current harness (refreshes the quick runs "
                      "whose own files did not change)", lesson_files("01"), keep=("results.json",),
                      kind="readiness"))
    steps += [Step(f"quick-{n}", LESSONS[n].evidence.quick_minutes,
                   (*course, "run", n, "--quick", "--device", "cuda", "--out", "{scratch}"),
                   f"lesson {n}'s quick run on the GPU", lesson_files(n), keep=("results.json",),
                   kind="quick")
              for n in ready]
    for n in ready:
        because = LESSONS[n].evidence.quick_because
        flags = ("--quick",) if because else ()
        note = f" (--quick: {because})" if because else ""
        steps.append(Step(f"lesson-{n}", LESSONS[n].evidence.minutes,
                          (*course, "run", n, "--device", "cuda", *flags, "--out", "{scratch}"),
                          f"lesson {n} at its GPU size{note}", lesson_files(n), keep=("results.json",),
                          kind="lesson"))
    return steps


def select(steps: list[Step], only: list[str] | None) -> list[Step]:
    """The steps ``--only`` names, in the plan's order; an unknown name is a one-line error."""
    if not only:
        return steps
    names = [s.name for s in steps]
    for name in only:
        if name not in names:
            raise bad_value("--only", name, ", ".join(names[:6]) + ", ... (see --plan)")
    return [s for s in steps if s.name in only]


# -- versions, estimates and the chunk --------------------------------------------------------------
def _imported(path: Path, shallow: bool) -> list[tuple[str, int]]:
    """The modules a file imports (name, relative level): every import statement, or with
    ``shallow`` only those outside functions."""
    stat = path.stat()
    return _imported_by_content(path, stat.st_mtime_ns, stat.st_size, shallow)


@functools.cache
def _imported_by_content(path: Path, mtime_ns: int, size: int, shallow: bool) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    nodes, found = list(tree.body), []
    while nodes:
        node = nodes.pop()
        if shallow and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if isinstance(node, ast.Import):
            found += [(alias.name, 0) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            found.append((base, node.level))
            found += [(f"{base}.{alias.name}" if base else alias.name, node.level) for alias in node.names]
        nodes.extend(ast.iter_child_nodes(node))
    return found


def _module_files(name: str, level: int, here: Path, root: Path) -> list[Path]:
    """The repository files that importing ``name`` from a file in ``here`` runs: the module (from
    the file's own folder first, as a script's imports are found) and its packages' __init__.py."""
    parts = [p for p in name.split(".") if p]
    bases = [here.parents[level - 2] if level > 1 else here] if level else [here, root]
    for base in bases:
        for candidate in (base.joinpath(*parts).with_suffix(".py"), base.joinpath(*parts, "__init__.py")):
            if parts and candidate.is_file():
                packages = [base.joinpath(*parts[:i], "__init__.py") for i in range(1, len(parts))]
                return [candidate, *(p for p in packages if p.is_file())]
    return []


def code_files(patterns: Iterable[str], root: Path = REPO_ROOT,
               imports: dict[Path, list[Path]] | None = None) -> list[Path]:
    """The files matching ``patterns`` and every repository module they import, at any depth (a
    file in ``SHALLOW`` through its module-level imports only). ``imports``: each file's own
    repository imports, filled as they are found, for several calls on one unchanged checkout."""
    imports = {} if imports is None else imports
    todo = sorted({p for pattern in patterns for p in root.glob(pattern)
                   if p.suffix == ".py" and p.is_file()})
    seen: set[Path] = set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        if path not in imports:
            shallow = path.relative_to(root).as_posix() in SHALLOW
            imports[path] = [f for name, level in _imported(path, shallow)
                             for f in _module_files(name, level, path.parent, root)]
        todo += [f for f in imports[path] if f not in seen]
    return sorted(seen)


def _hash_files(paths: Iterable[Path], root: Path) -> str:
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def version_of(step: Step, root: Path = REPO_ROOT, imports: dict | None = None) -> str:
    """A hash of the content of the files the step runs (``code_files``: sorted paths and bytes)."""
    return _hash_files(code_files(step.inputs, root, imports), root)


def own_version_of(step: Step, root: Path = REPO_ROOT, harness: Iterable[Path] | None = None,
                   imports: dict | None = None) -> str:
    """A hash of the step's own files: those ``version_of`` hashes less the harness's (``HARNESS``
    and what it imports). Equal to a record's ``own`` when only a shared harness file changed."""
    harness = set(code_files(HARNESS, root, imports) if harness is None else harness)
    return _hash_files([p for p in code_files(step.inputs, root, imports) if p not in harness], root)


@dataclass(frozen=True)
class Versions:
    """Each step's version now (``version_of``) and its own files' (``own_version_of``)."""

    full: dict[str, str]
    own: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, steps: Iterable[Step], root: Path = REPO_ROOT) -> Versions:
        steps, imports = list(steps), {}
        harness = code_files(HARNESS, root, imports)
        return cls({s.name: version_of(s, root, imports) for s in steps},
                   {s.name: own_version_of(s, root, harness, imports) for s in steps})


def is_done(record: Record | None, version: str) -> bool:
    return record is not None and record.version == version and record.status in DONE


def refreshed(step: Step, manifest: Manifest, versions: Versions) -> bool:
    """A quick run that passed, whose own files are unchanged since, while the smoke step passed
    through the current harness: only a shared file changed, and the smoke run shows it still runs."""
    record, smoke = manifest.steps.get(step.name), manifest.steps.get(SMOKE)
    return (step.kind == "quick" and record is not None and record.status == "ok" and bool(record.own)
            and record.own == versions.own.get(step.name) and smoke is not None and smoke.status == "ok"
            and smoke.version == versions.full.get(SMOKE))


def estimate(step: Step, record: Record | None) -> float:
    """Minutes: what the step took the last time it finished (any version), else the H100 estimate;
    a step cut short, or stopped after a whole chunk, took longer than it ran."""
    if record is None:
        return step.minutes
    if record.status in ("ok", "failed", "skipped"):
        return max(record.seconds / 60, 0.05)
    if record.status in ("cut", "too-long"):
        return max(step.minutes, record.seconds / 60 * 1.5)
    return step.minutes


def missing_modules(step: Step) -> list[str]:
    return [m for m in step.needs if importlib.util.find_spec(m) is None]


@dataclass(frozen=True)
class Due:
    """Where a step stands: its state, whether a chunk should run it, its tier (0: never measured,
    1: a claim, benchmark or check whose code changed, 2: another stale step), the key it is sorted
    by within its tier, and why, in a few words."""

    state: str
    due: bool
    tier: int = 3
    key: tuple = ()
    why: str = ""


def standing(step: Step, position: int, manifest: Manifest, versions: Versions,
             missing: Callable[[Step], list[str]] = missing_modules) -> Due:
    record = manifest.steps.get(step.name)
    value = (KINDS.index(step.kind) if step.kind in KINDS else len(KINDS), position)
    if is_done(record, versions.full[step.name]):
        return Due(record.status, False, why=f"done {record.date[:10]}".strip())
    if refreshed(step, manifest, versions):
        return Due("refreshed", False, why=f"own files same; {SMOKE} ok")
    if missing(step):
        return Due("needs", False, why="a machine with " + ", ".join(missing(step)))
    if record is None or record.status not in DONE:
        why = "never measured" if record is None else f"never finished ({record.status})"
        return Due("to do", True, 0, value, why)
    smoke = manifest.steps.get(SMOKE)
    smoke_failed = smoke is not None and smoke.version == versions.full.get(SMOKE) and smoke.status != "ok"
    if (step.kind == "quick" and record.status == "ok" and record.own
            and record.own == versions.own.get(step.name) and not smoke_failed):
        return Due("stale", False, why=f"harness only: {SMOKE}")
    if step.kind in ("claim", "bench", "shared", "readiness"):
        return Due("stale", True, 1, value, f"code changed ({step.kind})")
    return Due("stale", True, 2, (record.date, *value), f"stale since {record.date[:10]}")


def ordered(steps: list[Step], manifest: Manifest, versions: Versions,
            missing: Callable[[Step], list[str]] = missing_modules) -> list[tuple[Step, Due]]:
    """Every step with where it stands, in the order a loan should take them: what was never
    measured at all (most valuable first), then the claims, benchmarks and checks whose code changed,
    then the other stale steps, oldest first; then the steps no chunk needs to run."""
    stands = [(step, standing(step, i, manifest, versions, missing)) for i, step in enumerate(steps)]
    return sorted(stands, key=lambda sd: (not sd[1].due, sd[1].tier, sd[1].key))


def plan_chunk(steps: list[Step], manifest: Manifest, versions: Versions, minutes: float,
               missing: Callable[[Step], list[str]] = missing_modules) -> list[Step]:
    """The steps this chunk runs: in ``ordered``'s order, each due and runnable here, as long as their
    estimates add up to at most ``minutes`` (a step too long for what is left is passed over for a
    shorter one after it)."""
    chosen, total = [], 0.0
    for step, due in ordered(steps, manifest, versions, missing):
        minutes_needed = estimate(step, manifest.steps.get(step.name))
        if due.due and total + minutes_needed <= minutes:
            chosen.append(step)
            total += minutes_needed
    return chosen


def format_plan(steps: list[Step], manifest: Manifest, versions: Versions, minutes: float,
                folder: str, missing: Callable[[Step], list[str]] = missing_modules) -> str:
    """The plan in 80 columns, in the order a loan takes the steps: each step's state, minutes and
    why it stands where it does; the next chunk marked ``>``."""
    nxt = {s.name for s in plan_chunk(steps, manifest, versions, minutes, missing)}
    lines = [f"evidence folder: {folder}", f"  {'step':<34}{'state':<10}{'min':>5}  why"]
    left = 0.0
    for step, due in ordered(steps, manifest, versions, missing):
        record = manifest.steps.get(step.name)
        est = estimate(step, record)
        measured = record is not None and record.status in ("ok", "failed", "skipped")
        if due.due:
            left += est
        mark = ">" if step.name in nxt else " "
        lines.append(f"{mark} {step.name:<34}{due.state[:9]:<10}{est:>5.1f}{' ' if measured else '*'} "
                     f"{due.why[:27]}")
    lines.append(f"next chunk ({minutes:g} min): {len(nxt)} steps marked >; {left:.1f} min of steps "
                 "left in all")
    lines.append("min: the last run's time (* an H100 estimate). Order: never measured, then the")
    lines.append("claims and benchmarks whose code changed, then other stale runs, oldest first.")
    return "\n".join(lines)


# -- running a chunk --------------------------------------------------------------------------------
def scrub(text: str, scratch: str | None = None, root: Path = REPO_ROOT) -> str:
    """Paths of this machine made neutral: the checkout relative, the scratch folder OUT, installed
    packages site-packages/, temporary folders TMP/, the home folder ~."""
    if scratch:
        text = text.replace(scratch, "OUT")
    text = text.replace(sys.executable + " ", "python ")
    text = text.replace(str(root) + os.sep, "").replace(str(root), ".")
    text = re.sub(r"(?<![\w.])/[^\s'\"]*?/(site|dist)-packages/", r"\1-packages/", text)
    text = re.sub(r"(?<![\w.])/tmp/[^\s'\"/]+", "TMP", text)
    home = os.path.expanduser("~")
    if home not in ("", "/"):
        text = text.replace(home + os.sep, "~/")
    return text


def last_error(text: str) -> str:
    """The last line of a step's output that names an error, else its last line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for line in reversed(lines):
        if re.search(r"error|failed|Error|FAILED", line):
            return line[:300]
    return lines[-1][:300] if lines else ""


def all_skipped(junit: Path) -> bool:
    """Whether a pytest JUnit file shows tests that all skipped themselves."""
    if not junit.is_file():
        return False
    head = junit.read_text(errors="replace")[:4000]
    tests = re.search(r'\btests="(\d+)"', head)
    skipped = re.search(r'\bskipped="(\d+)"', head)
    return bool(tests and skipped and int(tests.group(1)) > 0 and tests.group(1) == skipped.group(1))


def skip_reason(junit: Path) -> str:
    reasons = re.findall(r'<skipped [^>]*message="([^"]*)"', junit.read_text(errors="replace"))
    return "; ".join(sorted(set(reasons)))[:300] or "every test skipped itself"


def _stop_group(proc: subprocess.Popen) -> None:
    """End the step and every process it started (torchrun's ranks hold the GPU)."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_step(step: Step, folder: Path, seconds_left: float, whole_chunk: bool,
             cwd: Path = REPO_ROOT) -> Record:
    """Run one step with at most ``seconds_left``; its log and kept files land in ``folder``."""
    out = folder / step.name
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    log_path = folder / f"{step.name}.log"
    with tempfile.TemporaryDirectory(prefix=f"evidence-{step.name}-") as scratch:
        command = [p.replace("{out}", str(out)).replace("{scratch}", scratch) for p in step.command]
        began = time.monotonic()
        status, returncode, error = "ok", None, ""
        with open(log_path, "w+b") as log:
            log.write(f"$ {' '.join(command)}\n".encode())
            log.flush()
            try:
                proc = subprocess.Popen(command, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True)
            except OSError as e:
                status, error = "failed", str(e)
            else:
                try:
                    returncode = proc.wait(timeout=max(1.0, seconds_left))
                    status = "ok" if returncode == 0 else "failed"
                except subprocess.TimeoutExpired:
                    _stop_group(proc)
                    status = "too-long" if whole_chunk else "cut"
                    error = f"stopped after {seconds_left / 60:.1f} min"
                else:
                    _stop_group(proc)  # nothing it started may outlive it
        seconds = round(time.monotonic() - began, 1)
        keep_files(step, Path(scratch), out)
        text = log_path.read_bytes()
        if len(text) > LOG_LIMIT_BYTES:
            text = b"[... earlier output cut ...]\n" + text[-LOG_LIMIT_BYTES:]
        log_text = scrub(text.decode(errors="replace"), scratch)
        log_path.write_text(log_text)
        if status == "failed" and not error:
            error = last_error(log_text)
        if status == "ok" and all_skipped(out / "junit.xml"):
            status, error = "skipped", skip_reason(out / "junit.xml")
    if not any(out.iterdir()):
        out.rmdir()
    return Record(status, seconds, returncode=returncode, error=error, log=log_path.name)


def keep_files(step: Step, scratch: Path, out: Path) -> None:
    """Copy the files the step is kept for from its scratch folder, paths scrubbed, small ones only."""
    for pattern in step.keep:
        for path in sorted(scratch.glob(pattern)):
            if path.is_file() and not path.is_symlink() and path.stat().st_size <= KEPT_FILE_LIMIT_BYTES:
                target = out / path.relative_to(scratch)
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(scrub(path.read_text(errors="replace"), str(scratch)))
    for path in out.rglob("*"):  # what the step wrote into {out} itself
        if path.is_file() and path.suffix in (".json", ".xml", ".txt"):
            path.write_text(scrub(path.read_text(errors="replace"), str(scratch)))


def run_chunk(steps: list[Step], folder: Path, manifest: Manifest, versions: Versions,
              minutes: float, machine: dict[str, str], echo: Callable[[str], None] = print,
              after_step: Callable[[], None] = lambda: None, cwd: Path = REPO_ROOT,
              clock: Callable[[], float] = time.monotonic) -> list[str]:
    """Run the chunk's steps within ``minutes``; the manifest is written after every step. The names
    of the steps run."""
    folder.mkdir(parents=True, exist_ok=True)
    start = clock()
    chunk = {"date": machine["date"], "minutes": minutes, "machine": machine, "steps": []}
    manifest.chunks.append(chunk)
    for i, step in enumerate(steps, 1):
        left = minutes * 60 - (clock() - start)
        needed = estimate(step, manifest.steps.get(step.name)) * 60
        if left < max(needed * 0.75, 20.0):
            echo(f"[{i}/{len(steps)}] {step.name}: left for the next chunk ({left / 60:.1f} min left)")
            continue
        echo(f"[{i}/{len(steps)}] {step.name} (~{needed / 60:.1f} min of {left / 60:.1f} left): {step.what}")
        record = run_step(step, folder, left, whole_chunk=(i == 1 or left >= minutes * 60 * 0.9), cwd=cwd)
        record.version, record.own = versions.full[step.name], versions.own[step.name]
        record.date, record.device = machine["date"], machine["device"]
        manifest.steps[step.name] = record
        chunk["steps"].append(step.name)
        manifest.write(folder / "manifest.json")
        after_step()
        said = f": {record.error}" if record.error else ""
        echo(f"    {record.status} in {record.seconds:.0f} s{said}")
    manifest.write(folder / "manifest.json")
    return chunk["steps"]


# -- README tables ---------------------------------------------------------------------------------
def lesson_run(folder: Path, number: str) -> Path | None:
    """The lesson's run in an evidence folder: at its GPU size, else its quick run."""
    for name in (f"lesson-{number}", f"quick-{number}", f"run{number}"):
        path = folder / name / "results.json"
        if path.is_file():
            return path
    return None


def render_readmes(folder: Path, lessons_dir: Path = REPO_ROOT / "lessons") -> list[str]:
    """Write each marked "On a GPU" table from the lesson's run in ``folder``, rendered as the
    lesson's CPU table is (``readme_tables.render``: the same columns, a caption naming the run);
    the lessons whose README changed. A lesson without a run in the folder keeps its table."""
    from utilities.course.readme_tables import render
    from utilities.results import load
    from utilities.safe_files import atomic_write_text

    def replace(m: re.Match, readme: Path) -> str:
        results_path = lesson_run(folder, m.group(2))
        if results_path is None:
            return m.group(0)
        table = render(m.group(2), load(results_path),
                       os.path.relpath(results_path.resolve(), readme.parent.resolve()))
        return m.group(1) + table + m.group(4)

    changed = []
    for readme in sorted(lessons_dir.glob("*/README.md")):
        text = readme.read_text()
        new = GPU_BLOCK.sub(lambda m, readme=readme: replace(m, readme), text)
        if new != text:
            atomic_write_text(readme, new, "README")
            changed.append(readme.parent.name[:2])
    return changed


def render_benchmarks(python: str = sys.executable, root: Path = REPO_ROOT) -> str:
    """benchmarks/README.md's tables re-rendered from the CPU results and every evidence folder
    (``benchmarks/report.py``, which also writes the calibration row)."""
    proc = subprocess.run([python, "benchmarks/report.py"], cwd=root, text=True, capture_output=True)
    if proc.returncode != 0:
        raise UsageError(f"benchmarks/report.py failed: {last_error(proc.stdout + proc.stderr)}")
    return proc.stdout.strip()


# -- the command -----------------------------------------------------------------------------------
def describe_machine() -> dict[str, str]:
    import torch

    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                text=True, capture_output=True, timeout=20).stdout.strip().splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        driver = "unknown"
    try:
        import transformers

        transformers_version = transformers.__version__
    except ImportError:
        transformers_version = "none"
    return {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
            "driver": driver, "torch": torch.__version__, "cuda": str(torch.version.cuda),
            "transformers": transformers_version, "cpus": str(os.cpu_count()),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def slug(device: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-") or "gpu"


def evidence_folders(root: Path = REPO_ROOT) -> list[Path]:
    """The chunked evidence folders (those with a manifest of this schema), oldest first."""
    base = root / EVIDENCE_ROOT
    found = []
    for path in sorted(base.glob("*/manifest.json")) if base.is_dir() else []:
        try:
            if Manifest.read(path) is not None:
                found.append(path.parent)
        except UsageError:
            continue
    return found


def default_folder(device: str | None, date: str, root: Path = REPO_ROOT) -> Path | None:
    """The newest evidence folder for this GPU (any GPU when ``device`` is None), else a new
    ``DATE-GPU`` folder (None when there is no GPU to name it after)."""
    folders = evidence_folders(root)
    if device is not None:
        folders = [f for f in folders if f.name.endswith("-" + slug(device))]
    if folders:
        return folders[-1]
    return None if device is None else root / EVIDENCE_ROOT / f"{date[:10]}-{slug(device)}"


def minutes_value(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value <= 600:
        raise bad_value("--minutes", text, "minutes in (0, 600]")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--minutes", default=str(CHUNK_MINUTES),
                        help=f"the chunk's length (default {CHUNK_MINUTES:g}): the most valuable steps "
                             "not yet done whose estimates fit, each stopped when the minutes run out")
    parser.add_argument("--into", default=None, metavar="DIR",
                        help="evidence folder (default: the newest benchmarks/results/gpu/DATE-GPU for "
                             "this GPU, else a new one)")
    parser.add_argument("--plan", action="store_true",
                        help="print each step's state and minutes, and what the next chunk runs")
    parser.add_argument("--only", nargs="+", default=None, metavar="STEP",
                        help="consider only these steps (names as --plan prints them)")
    parser.add_argument("--redo", action="store_true",
                        help="run the steps --only names even if they are done")
    parser.add_argument("--pack", default=None, metavar="FILE.tar.gz",
                        help="write the evidence folder into this archive (after every step)")
    parser.add_argument("--unpack", default=None, metavar="FILE.tar.gz",
                        help="on any machine: merge an archive --pack wrote into its evidence folder, "
                             "then re-render the READMEs' GPU tables")
    return parser


def repo_relative(path: Path, root: Path = REPO_ROOT) -> str:
    try:
        return path.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return str(path)
