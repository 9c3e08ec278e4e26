"""``fsdp-course evidence`` on a machine without a GPU, the GPU faked as the other CPU twins fake it:
the plan covers every GPU test and lesson, bad input is one line, consecutive chunks complete the
plan with nothing run twice (each handing back one archive), a stale step is due again, a step cut
short ends with everything it started, and ``--unpack`` merges an archive and renders the READMEs."""

from __future__ import annotations

import argparse
import ast
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time

import pytest
from conftest import REPO, cli_here

from utilities.course import evidence as E


def test_the_plan_names_every_lesson_twice_and_every_gpu_test_and_fits_80_columns():
    proc = cli_here("evidence", "--plan")
    assert proc.returncode == 0, proc.stderr
    assert all(len(line) <= 80 for line in proc.stdout.splitlines())
    names = [s.name for s in E.gpu_steps()]
    assert names[0] == "quick-01" and names.index("quick-14") < names.index("claim-01-wrap")
    assert {f"quick-{n:02d}" for n in range(1, 15)} | {f"lesson-{n:02d}" for n in range(1, 15)} <= set(names)
    assert names.index("calibrate") < names.index("lesson-01")  # every quick pass and claim first
    # every GPU test is some step's: the claims by id, the shared-GPU tests by name
    from gpu_cases import CASES

    assert E.claim_ids() == [c.id for c in CASES]
    shared = ast.parse((REPO / "tests/gpu/test_shared_gpu.py").read_text())
    functions = {f.name for f in shared.body if isinstance(f, ast.FunctionDef) and f.name.startswith("test_")}
    assert {node.split("[")[0] for node in E.SHARED_GPU_TESTS.values()} == functions
    assert len(names) == len(set(names))


@pytest.mark.parametrize("args, says", [
    (["evidence"], "needs a CUDA GPU"),
    (["evidence", "--only", "lesson-99"], "--only 'lesson-99' is not allowed"),
    (["evidence", "--minutes", "inf"], "--minutes 'inf' is not allowed"),
    (["evidence", "--minutes", "0"], "--minutes '0' is not allowed"),
    (["evidence", "--redo"], "--redo is not allowed without --only"),
    (["evidence", "--unpack", "/nonexistent/e.tar.gz"], "is not allowed"),
])
def test_without_a_gpu_or_with_bad_input_it_refuses_in_one_line(args, says):
    proc = cli_here(*args)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("error:") and proc.stderr.strip().count("\n") == 0 and says in proc.stderr


def twin_steps(counter, results_cpu, minutes=3.0):
    """Five CPU twins of 3 estimated minutes each: a lesson's quick run that keeps its results.json,
    three that print, one that fails; each appends its name to ``counter``."""
    py = sys.executable
    note = "import sys; open(sys.argv[1], 'a').write(sys.argv[2] + '\\n'); "
    write = note + ("import shutil, pathlib; "
                    "shutil.copy(sys.argv[3], pathlib.Path(sys.argv[4]) / 'results.json')")
    return [E.Step("quick-01", minutes, (py, "-c", write, str(counter), "quick-01", results_cpu, "{scratch}"),
                   "a lesson run", keep=("results.json",)),
            *[E.Step(f"step-{i}", minutes, (py, "-c", note + "print('fine')", str(counter), f"step-{i}"),
                     "prints") for i in (2, 3, 4)],
            E.Step("step-5", minutes, (py, "-c", note + "sys.exit('error: boom')", str(counter), "step-5"),
                   "fails")]


def fake_machine(date):
    return {"device": "NVIDIA Fake GPU", "driver": "0", "torch": "0", "cuda": "0", "transformers": "0",
            "cpus": "2", "date": date}


def chunk(steps, into, archive, monkeypatch, date, minutes="8"):
    monkeypatch.setattr(E, "describe_machine", lambda: fake_machine(date))
    args = E.add_arguments(argparse.ArgumentParser()).parse_args(
        ["--minutes", minutes, "--into", str(into), "--pack", str(archive)])
    return E.main(args, gpu_available=lambda: True, steps=steps)


def test_consecutive_chunks_complete_the_plan_with_nothing_run_twice_one_archive_each(tmp_path, monkeypatch):
    counter = tmp_path / "ran.txt"
    steps = twin_steps(counter, str(REPO / "lessons/01_auto_wrap/results_cpu.json"))
    here = tmp_path / "checkout" / "ev"  # the evidence folder of the CPU machine's checkout
    ran_per_chunk = []
    for i in range(1, 5):
        gpu = tmp_path / f"gpu{i}" / "ev"  # a fresh GPU machine gets the checkout as it is now
        if here.exists():
            shutil.copytree(here, gpu)
        archive = tmp_path / f"out{i}" / "evidence.tar.gz"
        chunk(steps, gpu, archive, monkeypatch, f"2026-11-2{i}T10:00:00+00:00")
        assert archive.stat().st_size < E.PACK_LIMIT_BYTES
        with tarfile.open(archive) as tar:
            assert "manifest.json" in tar.getnames()
        E.unpack(archive, into=here)
        ran_per_chunk.append(counter.read_text().split() if counter.exists() else [])
        counter.unlink(missing_ok=True)
    # 3-minute estimates in 8-minute chunks: two steps per chunk, then nothing is left
    assert ran_per_chunk == [["quick-01", "step-2"], ["step-3", "step-4"], ["step-5"], []]
    manifest = E.Manifest.read(here / "manifest.json")
    assert {n: r.status for n, r in manifest.steps.items()} == {
        "quick-01": "ok", "step-2": "ok", "step-3": "ok", "step-4": "ok", "step-5": "failed"}
    assert manifest.steps["step-5"].error == "error: boom" and len(manifest.chunks) == 4
    assert (here / "quick-01" / "results.json").is_file() and "fine" in (here / "step-2.log").read_text()
    # the plan now says every step is done and measured
    versions = {s.name: E.version_of(s) for s in steps}
    plan = E.format_plan(steps, manifest, versions, 8, "ev")
    assert "to do" not in plan and "measured" in plan and "0 steps marked" in plan


def test_a_stale_or_unavailable_step_is_due_and_estimates_are_the_last_measured_time():
    steps = [E.Step("a", 3.0, ("x",), "a"), E.Step("b", 3.0, ("x",), "b"), E.Step("c", 3.0, ("x",), "c")]
    manifest = E.Manifest(folder="ev", steps={
        "a": E.Record("ok", seconds=30.0, version="v1"), "b": E.Record("ok", seconds=600.0, version="v1")})
    same = {"a": "v1", "b": "v1", "c": "v1"}
    assert [s.name for s in E.plan_chunk(steps, manifest, same, 8, missing=lambda s: [])] == ["c"]
    changed = {"a": "v2", "b": "v1", "c": "v1"}  # a's code changed: due again, 0.5 min as measured
    assert [s.name for s in E.plan_chunk(steps, manifest, changed, 8, missing=lambda s: [])] == ["a", "c"]
    assert E.estimate(steps[1], manifest.steps["b"]) == 10.0
    assert E.state_of(steps[0], manifest, changed, missing=lambda s: []) == "stale"
    assert E.plan_chunk(steps, manifest, changed, 8, missing=lambda s: ["torchao"]) == []
    assert E.state_of(steps[2], manifest, same, missing=lambda s: ["torchao"]) == "needs torchao"


def test_a_step_cut_short_ends_with_everything_it_started(tmp_path):
    pid_file = tmp_path / "child.pid"
    script = ("import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', "
              "'import time; time.sleep(60)']); open(sys.argv[1], 'w').write(str(c.pid)); time.sleep(60)")
    step = E.Step("slow", 1.0, (sys.executable, "-c", script, str(pid_file)), "sleeps")
    began = time.monotonic()
    record = E.run_step(step, tmp_path / "ev", seconds_left=2.0, whole_chunk=False)
    assert record.status == "cut" and time.monotonic() - began < 30
    child = int(pid_file.read_text())
    time.sleep(0.5)
    status = f"/proc/{child}/status"
    if os.path.exists(status):  # ended, left for its new parent to reap
        state = [ln for ln in open(status).read().splitlines() if ln.startswith("State:")]
        assert state and "Z" in state[0], state
    assert E.run_step(step, tmp_path / "ev", seconds_left=2.0, whole_chunk=True).status == "too-long"


def test_a_pytest_step_whose_tests_all_skipped_is_recorded_as_skipped(tmp_path):
    test = tmp_path / "test_skip.py"
    test.write_text("import pytest\n\ndef test_x():\n    pytest.skip('needs a CUDA GPU')\n")
    step = E.Step("s", 1.0, (sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
                             str(test), "--junitxml", "{out}/junit.xml"), "skips")
    record = E.run_step(step, tmp_path / "ev", seconds_left=120, whole_chunk=True, cwd=tmp_path)
    assert record.status == "skipped" and "needs a CUDA GPU" in record.error


def test_logs_and_kept_files_hold_no_path_of_the_machine(tmp_path):
    text = (f"{sys.executable} -m x\n{REPO}/lessons/01_auto_wrap/auto_wrap.py\n"
            "/opt/torch/.venv/lib/python3.12/site-packages/torch/x.py\n/tmp/pytest-of-root/p1/x\n"
            f"{os.path.expanduser('~')}/.cache/x\n/scratch/abc/results.json")
    clean = E.scrub(text, "/scratch/abc")
    assert clean.splitlines() == ["python -m x", "lessons/01_auto_wrap/auto_wrap.py",
                                  "site-packages/torch/x.py", "TMP/p1/x", "~/.cache/x", "OUT/results.json"]


def test_an_archive_over_the_limit_keeps_the_logs_tails(tmp_path):
    folder = tmp_path / "ev"
    folder.mkdir()
    (folder / "manifest.json").write_text("{}")
    (folder / "big.log").write_bytes(os.urandom(400_000).hex().encode()[:600_000] + b"\nTHE END\n")
    size = E.pack(folder, tmp_path / "e.tar.gz", limit=150_000)
    assert size <= 150_000
    with tarfile.open(tmp_path / "e.tar.gz") as tar:
        log = tar.extractfile("big.log").read()
    assert log.endswith(b"THE END\n") and log.startswith(b"[... earlier output cut ...]")


def _archive(tmp_path, members: dict[str, bytes], link: str | None = None):
    path = tmp_path / "bad.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        if link:
            info = tarfile.TarInfo(link)
            info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
            tar.addfile(info)
    return path


@pytest.mark.parametrize("members, link, says", [
    ({"../escape.log": b"x", "manifest.json": b"{}"}, None, "'../escape.log' is not allowed"),
    ({"manifest.json": b"{}"}, "run01", "'run01' is not allowed"),
    ({"a.log": b"x"}, None, "no manifest.json"),
    ({"manifest.json": json.dumps({"schema": 2, "folder": "/etc", "steps": {}}).encode()}, None,
     "folder '/etc' is not allowed"),
])
def test_unpack_refuses_an_archive_that_could_write_outside_its_folder(tmp_path, members, link, says):
    with pytest.raises(E.UsageError, match=None) as error:
        E.unpack(_archive(tmp_path, members, link), root=tmp_path)
    assert says in str(error.value)
    assert not (tmp_path.parent / "escape.log").exists()


def test_unpack_keeps_the_newer_result_and_renders_the_readme_tables(tmp_path, monkeypatch):
    here = tmp_path / "ev"
    newer = E.Manifest(folder="ev", steps={"quick-01": E.Record("ok", 10, "v", "2026-11-28")})
    here.mkdir()
    newer.write(here / "manifest.json")
    results = json.loads((REPO / "lessons/01_auto_wrap/results_cpu.json").read_text())
    incoming = tmp_path / "incoming"
    (incoming / "quick-01").mkdir(parents=True)
    (incoming / "quick-01" / "results.json").write_text(json.dumps(results))
    E.Manifest(folder="ev", steps={"quick-01": E.Record("failed", 5, "v", "2026-11-27"),
                                   "lesson-01": E.Record("ok", 5, "v", "2026-11-27")}).write(
        incoming / "manifest.json")
    (incoming / "lesson-01").mkdir()
    (incoming / "lesson-01" / "results.json").write_text(json.dumps(results))
    E.pack(incoming, tmp_path / "e.tar.gz")
    folder, taken = E.unpack(tmp_path / "e.tar.gz", into=here)
    assert taken == ["lesson-01"] and E.Manifest.read(here / "manifest.json").steps["quick-01"].status == "ok"
    lessons = tmp_path / "lessons"
    (lessons / "01_auto_wrap").mkdir(parents=True)
    (lessons / "01_auto_wrap" / "README.md").write_text(
        "## On a GPU\n\n<!-- gpu-results:01 -->\nnot yet measured on a GPU\n<!-- /gpu-results -->\n")
    assert E.render_readmes(here, lessons) == ["01"]
    rendered = (lessons / "01_auto_wrap" / "README.md").read_text()
    assert "not yet measured" not in rendered and "../../ev/lesson-01/results.json" in rendered
    for v in results["variants"]:
        assert f"| {v['name']} | " in rendered


def test_the_unpack_command_renders_the_benchmark_tables_and_the_calibration_row(tmp_path, monkeypatch):
    folder = tmp_path / "2026-11-27-nvidia-fake"
    (folder / "calibrate").mkdir(parents=True)
    (folder / "calibrate" / "calibration.json").write_text(json.dumps({
        "device_name": "NVIDIA Fake", "date": "2026-11-27T10:00:00+00:00",
        "measured": {"matmul_tflops": 650.0, "attention_tflops": 400.0, "memory_gbytes_per_s": 2900.0},
        "efficiencies": {"matmul": 0.657, "attention": 0.404, "memory": 0.866}}))
    sys.path.insert(0, str(REPO / "benchmarks"))
    import report

    monkeypatch.setattr(E, "evidence_folders", lambda root=None: [folder])
    row = report.calibration_table()
    assert ("| NVIDIA Fake | 2026-11-27 | 650 TFLOP/s (0.657) | 400 TFLOP/s (0.404) | "
            "2,900 GB/s (0.866)") in row
    block = report.render_block("a\n<!-- calibration:start -->\nold\n<!-- calibration:end -->\nb\n",
                                report.CALIBRATION_START, report.CALIBRATION_END, row)
    assert "old" not in block and row in block and block.startswith("a\n") and block.endswith("\nb\n")
    # the command: merge, then the lesson and benchmark READMEs re-rendered
    E.Manifest(folder="x", steps={}).write(folder / "manifest.json")
    E.pack(folder, tmp_path / "e.tar.gz")
    calls = []
    monkeypatch.setattr(E, "render_readmes", lambda f: calls.append(("lessons", f)) or ["01"])
    monkeypatch.setattr(E, "render_benchmarks", lambda: calls.append(("benchmarks",)) or "table written")
    args = E.add_arguments(argparse.ArgumentParser()).parse_args(
        ["--unpack", str(tmp_path / "e.tar.gz"), "--into", str(tmp_path / "merged")])
    assert E.main(args) == 0
    assert calls == [("lessons", tmp_path / "merged"), ("benchmarks",)]


def test_every_lesson_readme_has_the_block_evidence_renders_into():
    for readme in sorted((REPO / "lessons").glob("*/README.md")):
        blocks = [m.group(2) for m in E.GPU_BLOCK.finditer(readme.read_text())]
        assert blocks == [readme.parent.name[:2]], readme


def test_the_paste_line_is_documented_where_a_gpu_user_looks():
    line = "PYTHONUNBUFFERED=1 python3 -m utilities evidence --minutes 8 --pack OUT/evidence.tar.gz"
    for doc in ("README.md", "benchmarks/README.md"):
        assert line in (REPO / doc).read_text(), doc
    proc = subprocess.run([sys.executable, "-m", "utilities", "evidence", "--help"], cwd=REPO,
                          capture_output=True, text=True)
    assert proc.returncode == 0 and "--unpack" in proc.stdout and "--minutes" in proc.stdout


def test_a_steps_version_is_the_code_it_imports_and_nothing_else(tmp_path, monkeypatch):
    """A step's version follows its files' imports at any depth (function-level ones too), from the
    script's own folder and the repository root; a module it never imports cannot make it stale."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "used.py").write_text("X = 1\n")
    (tmp_path / "pkg" / "unused.py").write_text("Y = 1\n")
    (tmp_path / "lesson").mkdir()
    (tmp_path / "lesson" / "helper.py").write_text("def f():\n    from pkg import used\n")
    (tmp_path / "lesson" / "script.py").write_text("import helper\n")
    (tmp_path / "cli.py").write_text("import pkg\n\ndef other():\n    from pkg import unused\n")
    monkeypatch.setattr(E, "SHALLOW", frozenset({"cli.py"}))
    step = E.Step("s", 1.0, ("x",), "s", inputs=("lesson/*.py", "cli.py"))
    files = {p.relative_to(tmp_path).as_posix() for p in E.code_files(step.inputs, tmp_path)}
    assert files == {"cli.py", "lesson/script.py", "lesson/helper.py", "pkg/__init__.py", "pkg/used.py"}
    before = E.version_of(step, tmp_path)
    (tmp_path / "pkg" / "unused.py").write_text("Y = 2\n")
    assert E.version_of(step, tmp_path) == before
    (tmp_path / "pkg" / "used.py").write_text("X = 2\n")
    assert E.version_of(step, tmp_path) != before
