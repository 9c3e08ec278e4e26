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
from utilities.course import evidence_archive as A
from utilities.course import evidence_command as C


def test_the_plan_names_every_lesson_twice_and_every_gpu_test_and_fits_80_columns():
    proc = cli_here("evidence", "--plan")
    assert proc.returncode == 0, proc.stderr
    assert all(len(line) <= 80 for line in proc.stdout.splitlines())
    steps = E.gpu_steps()
    names = [s.name for s in steps]
    assert names[0] == "claim-01-wrap" and names.index("calibrate") < names.index("quick-01")
    assert {f"quick-{n:02d}" for n in range(1, 15)} | {f"lesson-{n:02d}" for n in range(1, 15)} <= set(names)
    kinds = [s.kind for s in steps]  # the catalog in order of value: claims ... lessons at GPU size
    assert kinds == sorted(kinds, key=E.KINDS.index) and E.SMOKE in names
    # every GPU test is some step's: the claims by id, the shared-GPU tests by name
    from gpu_cases import CASES, CHECKS

    from utilities.course.catalog import shared_gpu_runs

    assert E.claim_ids() == [c.id for c in CASES] and set(CHECKS) == set(E.claim_ids())
    shared = ast.parse((REPO / "tests/gpu/test_shared_gpu.py").read_text())
    functions = {f.name for f in shared.body if isinstance(f, ast.FunctionDef) and f.name.startswith("test_")}
    runs = shared_gpu_runs()
    assert {run.test.split("[")[0] for _, run in runs.values()} == functions
    assert {f"shared-{key}" for key in runs} <= set(names)
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
    monkeypatch.setattr(C, "describe_machine", lambda: fake_machine(date))
    args = E.add_arguments(argparse.ArgumentParser()).parse_args(
        ["--minutes", minutes, "--into", str(into), "--pack", str(archive)])
    return C.main(args, gpu_available=lambda: True, steps=steps)


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
        A.unpack(archive, into=here, known=[s.name for s in steps])
        ran_per_chunk.append(counter.read_text().split() if counter.exists() else [])
        counter.unlink(missing_ok=True)
    # 3-minute estimates in 8-minute chunks: two steps per chunk, then nothing is left
    assert ran_per_chunk == [["quick-01", "step-2"], ["step-3", "step-4"], ["step-5"], []]
    manifest = E.Manifest.read(here / "manifest.json")
    assert {n: r.status for n, r in manifest.steps.items()} == {
        "quick-01": "ok", "step-2": "ok", "step-3": "ok", "step-4": "ok", "step-5": "failed"}
    assert manifest.steps["step-5"].error == "error: boom" and len(manifest.chunks) == 4
    assert (here / "quick-01" / "results.json").is_file() and "fine" in (here / "step-2.log").read_text()
    # the plan now says every step is done, each estimate the time it took
    plan = E.format_plan(steps, manifest, E.Versions.of(steps), 8, "ev")
    rows = [line for line in plan.splitlines() if line[2:].startswith(("quick-", "step-"))]
    assert len(rows) == 5 and all(" ok " in r or " failed " in r for r in rows), plan
    assert not any("*" in r for r in rows) and "0 steps marked" in plan


def test_a_stale_or_unavailable_step_is_due_and_estimates_are_the_last_measured_time():
    steps = [E.Step("a", 3.0, ("x",), "a"), E.Step("b", 3.0, ("x",), "b"), E.Step("c", 3.0, ("x",), "c")]
    manifest = E.Manifest(folder="ev", steps={
        "a": E.Record("ok", seconds=30.0, version="v1"), "b": E.Record("ok", seconds=600.0, version="v1")})
    same = E.Versions({"a": "v1", "b": "v1", "c": "v1"})
    assert [s.name for s in E.plan_chunk(steps, manifest, same, 8, missing=lambda s: [])] == ["c"]
    changed = E.Versions({"a": "v2", "b": "v1", "c": "v1"})  # a's code changed: due, 0.5 min as measured
    assert [s.name for s in E.plan_chunk(steps, manifest, changed, 8, missing=lambda s: [])] == ["c", "a"]
    assert E.estimate(steps[1], manifest.steps["b"]) == 10.0
    assert E.standing(steps[0], 0, manifest, changed, missing=lambda s: []).state == "stale"
    assert E.plan_chunk(steps, manifest, changed, 8, missing=lambda s: ["torchao"]) == []
    needs = E.standing(steps[2], 2, manifest, same, missing=lambda s: ["torchao"])
    assert needs.state == "needs" and "torchao" in needs.why and not needs.due


def _stale_repository():
    """The catalog's steps with every quick run and the first claims measured at an older version,
    the rest never measured: the state of a repository after a round of harness changes."""
    steps = E.gpu_steps()
    versions = E.Versions.of(steps)
    manifest = E.Manifest(folder="ev")
    for i, step in enumerate(s for s in steps if s.kind in ("quick", "claim")):
        if step.kind == "quick" or step.name < "claim-03":
            manifest.steps[step.name] = E.Record("ok", 30.0 + i, "old", f"2026-11-{10 + i % 9:02d}T10:00",
                                                 own="old")
    return steps, versions, manifest


def test_a_loan_measures_what_never_ran_first_claims_and_benchmarks_before_stale_quick_runs(
        tmp_path, monkeypatch, capsys):
    steps, versions, manifest = _stale_repository()
    no_torchao = lambda s: [m for m in s.needs if m == "torchao"]
    chunk = E.plan_chunk(steps, manifest, versions, 8, missing=no_torchao)
    kinds = [s.kind for s in chunk]  # the claims and benchmarks first; no stale quick run
    assert kinds[0] == "claim" and "quick" not in kinds and "lesson" not in kinds, [s.name for s in chunk]
    assert {s.name for s in chunk} >= {f"claim-{c}" for c in E.claim_ids()} - set(manifest.steps)
    assert sum(E.estimate(s, manifest.steps.get(s.name)) for s in chunk) <= 8
    never = [s.name for s, due in E.ordered(steps, manifest, versions, no_torchao) if due.tier == 0]
    assert never[0] == "claim-03-full-state-dict" and never.index("calibrate") < never.index("shared-01")
    stale = [(s, due) for s, due in E.ordered(steps, manifest, versions, no_torchao) if due.tier == 2]
    dates = [manifest.steps[s.name].date for s, _ in stale]
    assert dates == sorted(dates) and {s.kind for s, _ in stale} == {"quick"}  # oldest first
    assert all(due.tier == 1 for s, due in E.ordered(steps, manifest, versions, no_torchao)
               if s.name in ("claim-01-wrap", "claim-02-activation-checkpointing"))
    # the command, the GPU faked as the chunk tests fake it, says the same and why
    into = tmp_path / "ev"
    into.mkdir()
    manifest.write(into / "manifest.json")
    monkeypatch.setattr(C, "describe_machine", lambda: fake_machine("2026-11-28T10:00:00+00:00"))
    monkeypatch.setattr(E, "missing_modules", no_torchao)
    args = E.add_arguments(argparse.ArgumentParser()).parse_args(["--plan", "--into", str(into)])
    assert C.main(args, gpu_available=lambda: True) == 0
    out = capsys.readouterr().out
    marked = [line.split()[1] for line in out.splitlines() if line.startswith("> ")]
    assert marked == [s.name for s in chunk] and all(len(line) <= 80 for line in out.splitlines()[1:])
    assert "never measured" in out and "stale since 2026-11-10" in out and "code changed (claim)" in out


def test_quick_runs_whose_own_files_did_not_change_are_refreshed_by_one_smoke_step():
    steps = [s for s in E.gpu_steps() if s.kind == "quick" or s.name == E.SMOKE]
    versions = E.Versions.of(steps)
    quick = [s for s in steps if s.kind == "quick"]
    manifest = E.Manifest(folder="ev", steps={
        s.name: E.Record("ok", 30.0, "old-harness", "2026-11-20", own=versions.own[s.name]) for s in quick})
    manifest.steps[quick[0].name].own = "its-own-file-changed"
    chunk = [s.name for s in E.plan_chunk(steps, manifest, versions, 60, missing=lambda s: [])]
    assert chunk == [E.SMOKE, quick[0].name]  # one smoke step instead of one run per lesson
    manifest.steps[E.SMOKE] = E.Record("ok", 40.0, versions.full[E.SMOKE], "2026-11-28")
    states = {s.name: d.state for s, d in E.ordered(steps, manifest, versions, lambda s: [])}
    assert states[quick[0].name] == "stale" and all(states[s.name] == "refreshed" for s in quick[1:])
    manifest.steps[E.SMOKE].status = "failed"  # the harness broke: every quick run is due again
    assert len(E.plan_chunk(steps, manifest, versions, 60, missing=lambda s: [])) == len(quick)


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
    size = A.pack(folder, tmp_path / "e.tar.gz", limit=150_000)
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
    ({"manifest.json": b"{}"}, "run01", "tar type b'2'"),
    ({"quick-01.log": b"x"}, None, "no manifest.json"),
    ({"a.log": b"x", "manifest.json": b"{}"}, None, "'a.log' is not allowed"),
    ({"manifest.json": json.dumps({"schema": 2, "folder": "/etc", "steps": {}}).encode()}, None,
     "folder '/etc' is not allowed"),
])
def test_unpack_refuses_an_archive_that_could_write_outside_its_folder(tmp_path, members, link, says):
    with pytest.raises(E.UsageError, match=None) as error:
        A.unpack(_archive(tmp_path, members, link), root=tmp_path)
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
    A.pack(incoming, tmp_path / "e.tar.gz")
    folder, taken = A.unpack(tmp_path / "e.tar.gz", into=here)
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
    A.pack(folder, tmp_path / "e.tar.gz")
    calls = []
    monkeypatch.setattr(C, "render_readmes", lambda f: calls.append(("lessons", f)) or ["01"])
    monkeypatch.setattr(C, "render_benchmarks", lambda: calls.append(("benchmarks",)) or "table written")
    args = E.add_arguments(argparse.ArgumentParser()).parse_args(
        ["--unpack", str(tmp_path / "e.tar.gz"), "--into", str(tmp_path / "merged")])
    assert C.main(args) == 0
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


def _evidence_archive(tmp_path, steps: dict, files: dict[str, bytes], name="e.tar.gz", folder="ev"):
    """An archive as --pack writes one: a schema-2 manifest with ``steps`` (name -> record fields)
    and ``files`` (member name -> bytes)."""
    manifest = {"schema": 2, "folder": folder, "chunks": [], "steps": steps}
    path = tmp_path / name
    with tarfile.open(path, "w:gz") as tar:
        for member, data in {"manifest.json": json.dumps(manifest).encode(), **files}.items():
            info = tarfile.TarInfo(member)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def _record(date="2026-11-28"):
    return {"status": "ok", "seconds": 1.0, "version": "v", "date": date}


@pytest.mark.parametrize("step", ["/tmp/x", "../../../../lessons", "2026-11-27-nvidia-h200", "..", "a/b"])
def test_no_step_name_in_an_archive_decides_what_unpack_writes_or_deletes(tmp_path, step):
    """A step name from the archive's manifest is not a path: only the catalog's step names are
    taken, so nothing outside the evidence folder is deleted, replaced or copied in."""
    gpu = tmp_path / "results" / "gpu"
    committed = gpu / "2026-11-27-nvidia-h200"
    committed.mkdir(parents=True)
    (committed / "manifest.json").write_text("kept")
    (tmp_path / "lessons").mkdir()
    (tmp_path / "lessons" / "kept.md").write_text("kept")
    archive = _evidence_archive(tmp_path, {step: _record()}, {})
    for into in (gpu, gpu / "new"):
        with pytest.raises(E.UsageError) as error:
            A.unpack(archive, into=into, root=tmp_path)
        assert "\n" not in str(error.value)
    assert (committed / "manifest.json").read_text() == "kept"
    assert (tmp_path / "lessons" / "kept.md").read_text() == "kept" and not (gpu / "new").exists()


def test_unpack_replaces_only_what_its_folder_owns(tmp_path):
    here = tmp_path / "ev"
    here.mkdir()
    user = tmp_path / "users-folder"
    user.mkdir()
    (user / "precious.txt").write_text("kept")
    archive = _evidence_archive(tmp_path, {"quick-01": _record(), "quick-02": _record()},
                                {"quick-01/results.json": b"{}", "quick-01.log": b"new log",
                                 "quick-02.log": b"new log"})
    # a link where a step's folder goes, though the manifest lists the step: refused, nothing moved
    E.Manifest(folder="ev", steps={"quick-01": E.Record("ok", 1, "v", "2026-11-01")}).write(
        here / "manifest.json")
    (here / "quick-01").symlink_to(user, target_is_directory=True)
    with pytest.raises(E.UsageError, match="in the way"):
        A.unpack(archive, into=here)
    assert (user / "precious.txt").read_text() == "kept" and (here / "quick-01").is_symlink()
    # a file of the user's where a step's log goes, the step not in the folder's manifest: refused
    (here / "quick-01").unlink()
    (here / "quick-02.log").write_text("the user's")
    with pytest.raises(E.UsageError, match="quick-02.log"):
        A.unpack(archive, into=here)
    assert (here / "quick-02.log").read_text() == "the user's"
    # out of the way: merged, the old step folder replaced, no staging folder left behind
    (here / "quick-02.log").unlink()
    (here / "quick-01").mkdir()
    (here / "quick-01" / "old.json").write_text("old")
    assert A.unpack(archive, into=here)[1] == ["quick-01", "quick-02"]
    assert sorted(p.name for p in here.iterdir()) == ["manifest.json", "quick-01", "quick-01.log",
                                                      "quick-02.log"]
    assert [p.name for p in (here / "quick-01").iterdir()] == ["results.json"]
    # --into a folder that holds other things and no evidence manifest: refused
    with pytest.raises(E.UsageError, match="--into"):
        A.unpack(archive, into=tmp_path)


def _raw_tar_gz(path, headers_and_data: list[tuple[bytes, bytes]]):
    import gzip

    with gzip.open(path, "wb") as raw:
        for header, data in headers_and_data:
            raw.write(header + data + bytes(-len(data) % 512))
        raw.write(bytes(1024))
    return path


def _header(name: str, kind: bytes, size: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.type = size, kind
    return info.tobuf(format=tarfile.USTAR_FORMAT)


@pytest.mark.parametrize("case", ["pax-header", "pax-size", "long-name", "many-folders", "file-then-folder",
                                  "long-member-name", "truncated", "not-gzip", "fifo"])
def test_unpack_bombs_and_odd_archives_are_refused_in_one_line_within_bounds(tmp_path, case):
    path = tmp_path / "bomb.tar.gz"
    if case == "pax-header":  # a 8 MiB pax header: refused from its size, before tarfile reads it
        _raw_tar_gz(path, [(_header("././@PaxHeader", tarfile.XHDTYPE, 8 * 2**20), b"0" * (8 * 2**20))])
    elif case == "pax-size":  # a small pax header restating the next member's size as 1 GiB
        record = b"size=1073741824\n"
        record = str(len(record) + 3).encode() + b" " + record
        _raw_tar_gz(path, [(_header("././@PaxHeader", tarfile.XHDTYPE, len(record)), record),
                           (_header("quick-01.log", tarfile.REGTYPE, 0), b"")])
    elif case == "long-name":
        _raw_tar_gz(path, [(_header("././@LongLink", tarfile.GNUTYPE_LONGNAME, 2**20), b"a" * 2**20)])
    elif case == "many-folders":
        _raw_tar_gz(path, [(_header(f"d{i}", tarfile.DIRTYPE, 0), b"") for i in range(A.MAX_MEMBERS + 1)])
    elif case == "file-then-folder":
        path = _evidence_archive(tmp_path, {"quick-01": _record()},
                                 {"quick-01/a": b"x", "quick-01/a/b": b"y"}, name="bomb.tar.gz")
    elif case == "long-member-name":
        path = _evidence_archive(tmp_path, {"quick-01": _record()}, {"quick-01/" + "a" * 300: b"x"},
                                 name="bomb.tar.gz")
    elif case == "truncated":
        good = _evidence_archive(tmp_path, {"quick-01": _record()}, {"quick-01.log": os.urandom(50_000)})
        path.write_bytes(good.read_bytes()[:30_000])
    elif case == "not-gzip":
        path.write_bytes(b"PK\x03\x04 not a tar")
    elif case == "fifo":
        _raw_tar_gz(path, [(_header("quick-01.log", tarfile.FIFOTYPE, 0), b"")])
    began = time.monotonic()
    proc = cli_here("evidence", "--unpack", str(path), "--into", str(tmp_path / "ev"))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: ")
    assert len(proc.stderr) < 600 and time.monotonic() - began < 30
    assert not (tmp_path / "ev").exists() or not any((tmp_path / "ev").iterdir())


@pytest.mark.parametrize("manifest", [
    {"schema": 2, "folder": "ev", "chunks": "not a list", "steps": {}},
    {"schema": 2, "folder": "ev", "chunks": [7], "steps": {}},
    {"schema": 2, "folder": "ev", "chunks": [], "steps": {"quick-01": {**_record(), "date": 20261128}}},
    {"schema": 2, "folder": "ev", "chunks": [], "steps": {"quick-01": {**_record(), "seconds": "1"}}},
    {"schema": 2, "folder": "ev", "chunks": [], "steps": {"quick-01": {**_record(), "status": "great"}}},
    {"schema": 2, "folder": 7, "chunks": [], "steps": {}},
])
def test_a_manifest_of_the_wrong_types_is_refused_in_one_line(tmp_path, manifest):
    path = tmp_path / "e.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        data = json.dumps(manifest).encode()
        info = tarfile.TarInfo("manifest.json")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    with pytest.raises(E.UsageError, match="not an evidence manifest"):
        A.unpack(path, into=tmp_path / "ev")
    assert not (tmp_path / "ev").exists()
