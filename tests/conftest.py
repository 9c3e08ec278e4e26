"""Shared fixtures: run a lesson the way a user does (``fsdp-course run NN --quick``) and read its
results.json; skip GPU tests without a GPU."""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import io
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

# CPU_WORKERS test processes share the cores (``pytest_xdist_auto_num_workers``), each starting
# notebook kernels and lesson ranks: every process gets its share of OpenMP threads, and idle
# OpenMP threads sleep instead of spinning. Spinning threads of two oversubscribed processes
# burned up to half the suite's CPU time: two notebooks run side by side took 98 CPU-s, 59 with
# these settings (2 cores). Set before torch is imported; inherited by every process a test starts.
CPU_WORKERS = 2
os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // CPU_WORKERS)))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

from utilities.results import variant  # noqa: E402, F401  (the tests' way to read a variant)

REPO = Path(__file__).resolve().parent.parent


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto`` (pyproject's addopts): two workers on a CPU machine, so that one test's launch
    fills the cores while another waits on imports, kernels or gloo (a serial run left them 39%
    idle on 2 cores); none on a GPU machine, where the tests measure one GPU and must not share it.
    ``PYTEST_XDIST_AUTO_NUM_WORKERS=N`` or ``-n N`` decide otherwise."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    return 0 if torch.cuda.is_available() else CPU_WORKERS


def work_unit(nodeid: str) -> str:
    """The tests one worker runs together: a lesson's (its test file, its notebook's tests, its
    GPU twin: they read one notebook run), or else a file's (its module fixtures run once).
    Lesson 14 checks its planner against lesson 06's run, so the two are one unit."""
    path, _, name = nodeid.partition("::")
    lesson = re.search(r"test_lesson_(\d\d)\.py$", path)
    if lesson is None and path.endswith(("test_gpu_claims_on_cpu.py", "test_notebooks.py")):
        lesson = re.search(r"\[(\d\d)\b", name)
    if lesson is None:
        return path
    return "lessons 06+14" if lesson.group(1) in ("06", "14") else f"lesson {lesson.group(1)}"


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Workers get whole work units (``work_unit``), largest first, as ``--dist loadscope`` does
    with files."""
    from xdist.scheduler import LoadScopeScheduling

    class ByWorkUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return ByWorkUnit(config, log)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    """Every module the suite needs is imported now (torch, transformers, the tests): freeze them,
    so that each gc.collect() a test makes (a process group's teardown, a variant's release) walks
    only what the tests made since: ~0.6 s per collect late in the suite otherwise."""
    gc.collect()
    gc.freeze()


def pytest_unconfigure(config):
    """The suite is over: this process's exit need not walk every object torch made (~2 s)."""
    from utilities.course.gc_at_exit import skip_final_collections

    skip_final_collections()


def cli(*args: str, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m utilities ARGS`` from the repo root and capture its output."""
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    return subprocess.run([sys.executable, "-m", "utilities", *args], cwd=REPO, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


def cli_here(*args: str) -> subprocess.CompletedProcess:
    """``python -m utilities ARGS`` run in this process, where torch is already imported: the same
    ``main()``, exit code and output, for commands that fail or finish before starting a lesson
    (``cli`` keeps the real process for the rest, and for the lesson-flag relay)."""
    from utilities.course.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return subprocess.CompletedProcess(["fsdp-course", *args], code, out.getvalue(), err.getvalue())


def run_lesson(number: str, out: Path, *lesson_flags: str, nproc: int = 2, quick: bool = True,
               device: str = "cpu", timeout: float = 600) -> dict:
    """Run a lesson through the CLI on CPU and return its results.json (fails with its output)."""
    args = ["run", number, "--device", device, "--nproc", str(nproc), "--out", str(out)]
    if quick:
        args.append("--quick")
    if lesson_flags:
        args += ["--", *lesson_flags]
    proc = cli(*args, timeout=timeout)
    assert proc.returncode == 0, f"lesson {number} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    results = json.loads((out / "results.json").read_text())
    # Every lesson run in the suite is also a leak test: a finished variant leaves nothing alive.
    for name, rel in (results.get("releases") or {}).items():
        assert rel["leaked_objects"] == 0 and rel["leaked_tensors"] == 0, (number, name, rel)
    return results


def assert_documented_keys(results: dict, number: str) -> None:
    """The keys every results.json has (README), from the quick CPU run on 2 ranks."""
    for key in ("lesson", "title", "device", "device_name", "machine", "world_size", "torch", "model",
                "variants"):
        assert key in results
    assert results["machine"]["cpu_cores"] >= 1 and results["machine"]["memory_bytes"] > 0
    assert results["lesson"] == number and results["device"] == "cpu" and results["world_size"] == 2


_LESSON_MODULES: dict[str, object] = {}


def lesson_module(number: str):
    """The lesson's script imported as a module, its folder on ``sys.path`` for its own helpers
    (how its notebook imports it)."""
    from utilities.course.catalog import get_lesson

    if number not in _LESSON_MODULES:
        info = get_lesson(number)
        if str(info.path) not in sys.path:
            sys.path.insert(0, str(info.path))
        spec = importlib.util.spec_from_file_location(f"lesson_{number}", info.script_path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _LESSON_MODULES[number] = module
    return _LESSON_MODULES[number]


def parse_lesson_flags(number: str, *flags: str) -> tuple[int, str, str]:
    """Parse ``flags`` with the lesson's own parser, in this process, as ``fsdp-course run NN
    --quick -- FLAGS`` does before it starts torchrun (tests/test_cli.py checks once that the
    command passes the answer on); returns (exit code, stdout, stderr)."""
    from utilities.course.launch import parse_flags_here

    return parse_flags_here(lesson_module(number).parse_args, ["--device", "cpu", "--quick", *flags])


def flag_error(number: str, *flags: str) -> str:
    """The one line a bad lesson flag gets (exit 2, ``error: ...``, no traceback)."""
    code, _, err = parse_lesson_flags(number, *flags)
    line = err.strip()
    assert code == 2 and "\n" not in line and line.startswith("error:"), (code, err)
    return line


def assert_help_lists(number: str, flags: tuple[str, ...]) -> None:
    """The lesson's ``--help`` (what ``fsdp-course run NN -- --help`` prints) explains each flag,
    and the lesson has its README."""
    from utilities.course.catalog import get_lesson

    code, out, _ = parse_lesson_flags(number, "--help")
    assert code == 0
    for flag in flags:
        assert flag in out, flag
    assert (get_lesson(number).path / "README.md").is_file()


def assert_prediction_is_the_readmes(lesson: str, results: dict, committed_file: str) -> None:
    """The lesson's README renders its cluster prediction from ``committed_file`` (unchanged since),
    and the run's own prediction has the same numbers: the time model is deterministic."""
    from readme_claims import MODEL_ARITHMETIC_RTOL

    from utilities.course import readme_tables

    assert readme_tables.check(lesson) == []
    committed = json.loads((readme_tables.lesson_dir(lesson) / committed_file).read_text())
    ran = {v["name"]: v for v in results["predicted"]["variants"]}
    for v in committed["variants"]:
        for key in ("step_s", "comm_s", "exposed_comm_s", "tokens_per_s_per_gpu"):
            assert ran[v["name"]][key] == pytest.approx(v[key], rel=MODEL_ARITHMETIC_RTOL), (v["name"], key)


def assert_readme_table_is_reproduced(lesson: str, results: dict, committed_file: str = "results_cpu.json",
                                      peak_parts: tuple[str, ...] | None = None) -> None:
    """The lesson's README renders its results tables from the committed ``committed_file`` (and
    the lesson's other results files, all unchanged since), and this quick run reproduces what that
    file claims (``readme_claims.claims``: sizes, counts, dtypes, bytes, the memory at the peak, the
    losses of a committed quick run, each within what ``readme_claims.differences`` allows a number
    made on another machine); ``peak_parts`` narrows the memory at the peak compared."""
    from readme_claims import claim_differences, claims

    from utilities.course import readme_tables

    assert readme_tables.check(lesson) == []
    committed = json.loads((readme_tables.lesson_dir(lesson) / committed_file).read_text())
    claimed = claims(lesson, committed)
    if peak_parts is not None:
        for claim in claimed.values():
            if "peak" in claim:
                claim["peak"] = {k: v for k, v in claim["peak"].items() if k in peak_parts}
    differences = claim_differences(claims(lesson, results), claimed)
    assert differences == [], differences


def assert_same_losses(results: dict, reference: str, atol: float) -> None:
    """Every variant's loss curve equals ``reference``'s (which trains): the knob the lesson turns
    changes memory or time, never the numbers."""
    losses = variant(results, reference)["losses"]
    assert losses[-1] < losses[0] - 1.0
    for v in results["variants"]:
        assert v["losses"] == pytest.approx(losses, abs=atol), v["name"]




_NOTEBOOK_RUNS: dict[str, dict] = {}
_NOTEBOOK_DIRS: dict[str, Path] = {}


def execute_notebook(number: str, runs_dir: Path) -> None:
    """Execute a lesson's notebook top to bottom, its runs going to ``runs_dir``; fail on any error."""
    import nbformat
    from nbclient import NotebookClient

    from utilities.course.catalog import get_lesson

    info = get_lesson(number)
    nb = nbformat.read(info.notebook, as_version=4)
    old = {k: os.environ.get(k) for k in ("FSDP_COURSE_RUNS", "MPLBACKEND")}
    os.environ.update(FSDP_COURSE_RUNS=str(runs_dir), MPLBACKEND="Agg")
    try:
        NotebookClient(nb, timeout=900, kernel_name="python3",
                       resources={"metadata": {"path": str(info.path)}}).execute()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def notebook_results(number: str, tmp_path_factory) -> dict:
    """The lesson's quick run as its notebook makes it: the notebook is executed once per test
    session and its results.json shared by the lesson's tests (one run serves both checks)."""
    from utilities.course.catalog import get_lesson

    if number not in _NOTEBOOK_RUNS:
        _NOTEBOOK_DIRS[number] = _shared_notebook_run(number, tmp_path_factory) / get_lesson(number).folder
        _NOTEBOOK_RUNS[number] = json.loads((_NOTEBOOK_DIRS[number] / "results.json").read_text())
    return _NOTEBOOK_RUNS[number]


def _shared_notebook_run(number: str, tmp_path_factory) -> Path:
    """The notebook's runs directory, executed once per session: under pytest-xdist the workers
    share the session's temporary directory, and a worker that needs a notebook another one is
    executing waits for it (a lock per notebook) instead of running it again."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the session's, above each worker's own
    runs, done = base / f"notebook{number}", base / f"notebook{number}.done"
    with FileLock(base / f"notebook{number}.lock"):
        if not done.exists():
            runs.mkdir(exist_ok=True)
            execute_notebook(number, runs)
            done.touch()
    return runs


def notebook_run_dir(number: str, tmp_path_factory) -> Path:
    """The output directory of the notebook's run (checkpoints, traces, extra JSON files)."""
    notebook_results(number, tmp_path_factory)
    return _NOTEBOOK_DIRS[number]


def no_rendezvous_env(monkeypatch) -> None:
    """Unset torchrun's variables for this test, so that ``setup()`` makes a one-rank world on a
    free port (as in a notebook); whatever it sets is undone after the test."""
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(k, "")  # recorded first, so that whatever setup() sets is undone
        monkeypatch.delenv(k)


@pytest.fixture
def world1(monkeypatch):
    """A one-process gloo world, the way a notebook or plain python uses the utilities; the
    torchrun variables it sets are restored afterwards."""
    from utilities.distributed import setup, teardown

    no_rendezvous_env(monkeypatch)
    info = setup("cpu")
    yield info
    teardown()


@pytest.fixture
def tiny(world1):
    """A two-layer FSDP2 model and its AdamW after one step, on the one-rank gloo world: the
    checkpoint tests' subject (a save takes well under a second)."""
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


@pytest.fixture
def lesson_runner(tmp_path):
    def run(number: str, *flags: str, **kw) -> dict:
        return run_lesson(number, tmp_path / f"run_{number}", *flags, **kw)

    return run


@pytest.fixture
def fake_allocator(monkeypatch):
    """A CUDA caching allocator faked on a CPU machine, for Memory_Maximizer's GPU path: returns a
    function that installs it (reserved GiB per call, max reserved GiB) and the stats dict the test
    changes (``num_alloc_retries``...)."""
    import utilities.memory_maximizer as M

    def install(reserved_gib: list[int], max_reserved_gib: int, retries: int) -> dict:
        reserved = iter(reserved_gib)
        stats = {"num_alloc_retries": retries, "num_ooms": 0}
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: None)
        monkeypatch.setattr(torch.cuda, "memory_stats", lambda *a: dict(stats))
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: next(reserved) * 2**30)
        monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda *a: max_reserved_gib * 2**30)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 2 * 2**30)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")
        monkeypatch.setattr(M, "gpu_total_memory", lambda *a: (80 * 2**30, "fake"))
        return stats

    return install


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Appended to every run_ranks script that got to its end: the output flushed, the process group
# destroyed, and the process ended without the interpreter's shutdown, where what is left of the
# group's C++ threads can abort a finished rank ("terminate called without an active exception",
# SIGABRT), as utilities.course.gc_at_exit.end_rank_now does for the lessons' ranks.
RANK_ENDING = """
import os as _os, sys as _sys, torch.distributed as _dist
_sys.stdout.flush(); _sys.stderr.flush()
if _dist.is_initialized():
    _dist.destroy_process_group()
_os._exit(0)
"""


def run_ranks(script: str, *argv: str, ranks: int = 2, timeout: float = 120) -> list[dict]:
    """``script`` on ``ranks`` gloo ranks (torchrun's variables, no torchrun); each rank's last
    output line as JSON."""
    port = free_port()
    procs = []
    script += RANK_ENDING
    for rank in range(ranks):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks),
                   LOCAL_WORLD_SIZE=str(ranks), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   PYTHONPATH=str(REPO))
        procs.append(subprocess.Popen([sys.executable, "-c", script, *argv], env=env, cwd=REPO,
                                      text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            assert p.returncode == 0, err[-4000:]
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return outs
