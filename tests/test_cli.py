"""The fsdp-course command: list, check, and one-line errors for every bad input."""

from __future__ import annotations

import contextlib
import io
import os

import pytest
import torch
from conftest import REPO, cli, cli_here


def test_list_shows_every_lesson_with_status():
    proc = cli("list")
    assert proc.returncode == 0
    lines = proc.stdout.strip().splitlines()
    from utilities.course.catalog import LESSONS

    assert len(lines) == len(LESSONS) >= 14
    assert [line[:2] for line in lines] == [f"{n:02d}" for n in range(1, len(LESSONS) + 1)]
    assert all("ready" in line and "not yet written" not in line for line in lines), lines


def test_run_all_runs_every_lesson_and_summarizes(monkeypatch, tmp_path, capsys):
    """`fsdp-course run all`: every ready lesson launched once, a failure reported and counted,
    and a summary (lines + summary.json) giving each lesson's measured takeaway, not a CPU step time.
    The launches are stubbed here; each lesson's own test runs it for real."""
    import json

    import utilities.course.cli as C

    launched = []

    def fake_launch(info, device, nproc, out, quick, model, flags):
        launched.append(info.folder)
        if info.folder.startswith("05"):
            return 1
        out.mkdir(parents=True, exist_ok=True)
        variants = [{"name": "slow", "step_time_s": 0.2}, {"name": "fast", "step_time_s": 0.1}]
        said = f"lesson {info.folder[:2]}'s point"
        (out / "results.json").write_text(json.dumps({"variants": variants, "takeaway": said}))
        return 0

    monkeypatch.setattr(C, "launch", fake_launch)
    rc = C.main(["run", "all", "--quick", "--device", "cpu", "--out", str(tmp_path)])
    assert rc == 1  # lesson 05 failed
    assert launched == [info.folder for info in C.LESSONS.values() if info.ready]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [row[0] for row in summary] == list(C.LESSONS)
    assert summary[4][2] == "FAILED" and summary[0][3] == "lesson 01's point"
    out = capsys.readouterr().out
    assert "FAILED" in out and "lesson 14's point" in out and "fastest" not in out


def test_list_models_shows_parameter_counts_without_building_a_model(monkeypatch):
    """``fsdp-course list --models`` took 15 s building every model on meta to count it: the named
    models' counts come from their shapes, and are the counts of the models built."""
    from utilities.models import MODELS, ModelSpec, count_parameters

    def no_build(*args, **kwargs):
        raise AssertionError("list --models built a model")

    with monkeypatch.context() as m:
        m.setattr(ModelSpec, "build", no_build)
        count_parameters.cache_clear()  # counts an earlier test made would hide a build
        proc = cli_here("list", "--models")
    assert proc.returncode == 0
    assert "t5-tiny" in proc.stdout and "llama-8b" in proc.stdout and "8,030.3M" in proc.stdout
    for name, spec in MODELS.items():
        assert spec.known_parameters == count_parameters(spec), name


def test_check_reports_versions_and_bf16():
    proc = cli("check")
    assert proc.returncode == 0
    assert f"torch {torch.__version__}" in proc.stdout
    assert "bf16" in proc.stdout and "lessons:" in proc.stdout
    if not torch.cuda.is_available():  # (long lines fold at the terminal's width)
        assert "no CUDA GPU is visible" in " ".join(proc.stdout.split())


@pytest.mark.parametrize(
    "args, must_mention",
    [
        (["run", "42"], ["'42'", "01"]),
        (["run", "01", "--model", "gpt-17"], ["gpt-17", "t5-tiny"]),
        (["run", "01", "--nproc", "0"], ["--nproc", "0"]),
        (["run", "01", "--device", "tpu"], ["tpu", "cuda"]),
        (["run", "01", "--", "--steps", "0"], ["0", "integers >= 1"]),
        (["run", "01", "--", "--model", "gpt-17"], ["gpt-17", "t5-tiny"]),
        (["run", "01", "--out", "/proc/forbidden"], ["--out", "/proc/forbidden"]),
        # a flag shortened as argparse allows: the answer names the flag as typed
        (["run", "01", "--", "--batch", "-3"], ["argument --batch (short for --batch-size): -3"]),
        (["run", "01", "--", "--seq", "3x"], ["argument --seq (short for --seq-len): '3x'"]),
        (["run", "01", "--dev", "tpu"], ["argument --dev (short for --device)", "tpu"]),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, must_mention):
    # lesson flags go through the lesson script's own process (the relay); the rest stops in main()
    proc = cli(*args) if "--" in args else cli_here(*args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = proc.stderr.strip()
    assert err.startswith("error:") and "\n" not in err, err
    assert "Traceback" not in proc.stdout + proc.stderr
    for text in must_mention:
        assert text in err, err


def test_a_shortened_flag_is_named_as_typed():
    """argparse takes any unambiguous prefix of a flag; its errors named only the full flag, so
    ``--batch -3`` was answered about ``--batch-size``."""
    from utilities.errors import OneLineParser, positive_int

    p = OneLineParser(prog="x")
    p.add_argument("-n", "--nproc", type=positive_int)
    p.add_argument("--batch-size", type=positive_int)
    p.add_argument("--backend", choices=["gloo", "nccl"])
    for argv, said in ((["--batch", "-3"], "argument --batch (short for --batch-size): -3 is"),
                       (["--batch-s=0"], "argument --batch-s (short for --batch-size): 0 is"),
                       (["--npr", "x"], "argument --npr (short for -n/--nproc): 'x' is"),
                       (["--back", "mpi"], "argument --back (short for --backend): invalid choice"),
                       (["--batch-size", "-3"], "argument --batch-size: -3 is"),
                       (["--ba", "1"], "ambiguous option: --ba could match")):
        err = io.StringIO()
        with contextlib.redirect_stderr(err), pytest.raises(SystemExit):
            p.parse_args(argv)
        assert err.getvalue().startswith(f"error: {said}"), (argv, err.getvalue())
    assert p.parse_args(["--batch", "4"]).batch_size == 4


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU answers")
def test_cuda_requests_without_gpu_are_refused():
    proc = cli_here("run", "01", "--device", "cuda")
    assert proc.returncode == 2 and "no CUDA GPU" in proc.stderr and "\n" not in proc.stderr.strip()


def test_nproc_larger_than_gpus_shares_them(monkeypatch, capsys, tmp_path):
    """More ranks than GPUs: they share the GPUs over gloo (tests/test_shared_gpu_launch.py
    has the rest), planned first, and say so on the first line."""
    from utilities.course import cli as cli_module

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(cli_module, "check_fit", lambda *a, **k: "planned: stub")
    calls = []
    monkeypatch.setattr(cli_module.subprocess, "call", lambda cmd, env=None: calls.append(cmd) or 0)
    rc = cli_module.main(["run", "01", "--device", "cuda", "--nproc", "4", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0 and "--nproc-per-node=4" in calls[0]
    assert out.startswith("4 ranks on 2 GPUs, 2 per GPU, over cpu:gloo,cuda:gloo")


def test_a_run_with_lesson_flags_checks_them_in_the_process_that_starts_the_ranks(tmp_path):
    """With lesson flags, ``launch.main`` is started on the script: it parses them with the
    script's own parse_args (a bad one stops it in one line), prints the torchrun line and becomes
    torchrun; the ranks run the script without the request. Without flags, plain torchrun; ranks
    sharing a GPU keep the separate check (before their plan)."""
    import json

    from utilities.course import cli as cli_module
    from utilities.course.launch import LAUNCH_ENV

    info = cli_module.get_lesson("01")
    run = cli_module.prepare_launch(info, "cpu", 2, tmp_path, True, None, ["--steps", "2"],
                                    check_then_launch=True)
    assert run.cmd[1:] == ["-m", "utilities.course.launch", str(info.script_path), "--device", "cpu",
                           "--out", str(tmp_path), "--quick", "--steps", "2"]
    assert run.header == []
    launch = json.loads(run.env[LAUNCH_ENV])
    assert launch["torchrun"] == ["--standalone", "--nproc-per-node=2"]
    (command,) = launch["header"]  # folded with " \\" at the terminal's width
    assert " ".join(command.replace(" \\\n", " ").split()) == (
        f"$ torchrun --standalone --nproc-per-node=2 {os.path.relpath(info.script_path)} "
        f"--device cpu --out {tmp_path} --quick --steps 2")
    plain = cli_module.prepare_launch(info, "cpu", 2, tmp_path, True, None, [], check_then_launch=True)
    assert plain.cmd[1:3] == ["-m", "utilities.course.torchrun"] and LAUNCH_ENV not in plain.env


def test_unwritable_out_is_refused_before_launch(monkeypatch, capsys, tmp_path):
    """`--out` that cannot be written: one line, exit 2, nothing started. A
    folder under a regular file cannot be created even by root."""
    from utilities.course import cli as cli_module

    calls = []
    monkeypatch.setattr(cli_module.subprocess, "call", lambda cmd, env=None: calls.append(cmd) or 0)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for argv in (["run", "01", "--quick", "--device", "cpu", "--out", str(blocker / "out")],
                 ["run", "all", "--quick", "--device", "cpu", "--out", str(blocker / "out")]):
        rc = cli_module.main(argv)
        err = capsys.readouterr().err.strip()
        assert rc == 2 and not calls, err
        assert err.startswith(f"error: --out '{blocker / 'out'}' is not allowed") and "\n" not in err


def _results(tmp_path):
    from utilities.results import Results
    from utilities.training import TrainStats

    r = Results("01", "transformer auto-wrap", torch.device("cpu"), 2, "t5-tiny", 1_887_232, {})
    r.add("per-block", TrainStats(losses=[2.0, 1.0], step_times_s=[0.1],
                                  peak_memory_bytes={"total": 123}))
    return r


def test_results_go_to_a_fallback_when_out_fails_at_the_end(tmp_path, monkeypatch, capsys):
    """The run's end: ``--out`` passed the launcher's check but cannot be written now. What was
    measured is kept: written under the temporary directory, with one line saying where."""
    import json
    import tempfile

    from utilities.results import table

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    blocker = tmp_path / "gone"
    blocker.write_text("")  # the output folder's place is now taken by a file
    r = _results(tmp_path)
    path = r.write(blocker)
    err = capsys.readouterr().err.strip()
    assert path.parent.parent == tmp_path / "tmp" and path.name == "results.json"
    saved = json.loads(path.read_text())
    assert saved["variants"][0]["name"] == "per-block" and saved["variants"][0]["losses"] == [2.0, 1.0]
    assert err.startswith(f"warning: could not write {blocker / 'results.json'}") and "\n" not in err
    assert str(path) in err and str(path) in saved["notes"][-1]
    assert "per-block" in table(r.data)  # what the lesson then prints, as usual
    # a writable folder is used as before, with no note
    ok = _results(tmp_path).write(tmp_path / "ok")
    assert ok == tmp_path / "ok" / "results.json" and json.loads(ok.read_text())["notes"] == []


def test_results_are_printed_when_no_copy_can_be_written(tmp_path, monkeypatch, capsys):
    import json
    import tempfile

    def no_temp(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "mkdtemp", no_temp)
    blocker = tmp_path / "gone"
    blocker.write_text("")
    from utilities.errors import UsageError

    with pytest.raises((OSError, UsageError)):  # a file where the folder should be: refused in one line
        _results(tmp_path).write(blocker)
    captured = capsys.readouterr()
    assert json.loads(captured.out)["variants"][0]["losses"] == [2.0, 1.0]
    assert captured.err.strip().startswith("error: could not write")


def test_the_launcher_runs_every_check_of_the_scripts_parse_args(monkeypatch, capsys):
    """``launch.main`` (what ``fsdp-course run`` starts) runs the script's whole ``parse_args``,
    including the checks a script makes after argparse (lesson 05's --max-batch against
    --start-batch): a bad value is one line and exit 2, good flags exit 0 when nothing asks it to
    launch. It freezes its objects first, so its exit skips Python's final collections; the same
    check in this process (``parse_flags_here``: a notebook's, a test's) leaves the collector alone."""
    from conftest import lesson_module

    from utilities.course import launch
    from utilities.course.catalog import get_lesson

    frozen = []
    monkeypatch.setattr(launch, "skip_final_collections", lambda: frozen.append(True))
    monkeypatch.delenv(launch.LAUNCH_ENV, raising=False)
    script = str(get_lesson("05").script_path)
    for flags, code in ((["--start-batch", "4", "--max-batch", "2"], 2), (["--steps", "0"], 2),
                        (["--steps", "2"], 0)):
        with pytest.raises(SystemExit) as e:
            launch.main([script, "--device", "cpu", "--quick", *flags])
        err = capsys.readouterr().err
        assert e.value.code == code and frozen == [True], flags
        assert len(err.strip().splitlines()) == (1 if code else 0) and (flags[-2] in err) == bool(code), err
        frozen.clear()
    assert launch.parse_flags_here(lesson_module("05").parse_args, ["--steps", "0"])[0] == 2
    assert frozen == []


@pytest.mark.parametrize("columns", [80, 120])
def test_tables_fit_the_terminal_and_never_split_a_value(monkeypatch, columns):
    """A committed lesson run's table at the terminal's width (COLUMNS, as the launcher passes it
    to the ranks): no line is wider, and every value shown is whole (a column that does not fit is
    dropped and named, never wrapped)."""
    import json

    from utilities.results import table

    monkeypatch.setenv("COLUMNS", str(columns))
    committed = sorted((REPO / "lessons").glob("*/results_cpu*.json"))
    assert len(committed) >= 14  # every lesson's README table
    for path in committed:
        results = json.loads(path.read_text())
        lines = table(results).splitlines()
        assert max(len(line) for line in lines) <= columns, path
        for v in results["variants"]:
            assert any(line.startswith(v["name"] + " ") or line == v["name"] for line in lines), (path, v)


@pytest.mark.parametrize("columns", [60, 80, 120])
def test_tables_keep_activations_and_say_why_a_category_is_not_a_column(monkeypatch, columns):
    """At every width (a terminal, or 120 in a notebook or a log) each committed run's table shows
    the peak's activations; a category that is 0 at the peak in every variant (gradients, freed
    by zero_grad before the forward peak) is no ``0 B`` column but a note under the table, in the
    printed table and the README's alike."""
    import json

    from utilities.results import idle_categories, markdown_table, table

    monkeypatch.setenv("COLUMNS", str(columns))
    idle_seen = 0
    for path in sorted((REPO / "lessons").glob("*/results_cpu*.json")):
        results = json.loads(path.read_text())
        lines = table(results).splitlines()
        header = next(line for line in lines if line.startswith("variant "))
        idle = idle_categories(results["variants"])
        if any((v.get("peak_memory_bytes") or {}).get("activations") for v in results["variants"]):
            assert " activ " in f"{header} ", (path, header)
        markdown_header = markdown_table(results["variants"], results).splitlines()[0]
        for label, key in (("grads", "gradients"), ("activ", "activations")):
            if key in idle:
                idle_seen += 1
                assert f" {label} " not in f"{header} " and f"| {label} |" not in markdown_header, path
                assert any(line.startswith(f"note: {key}: 0 B at the peak in every variant")
                           for line in lines), path
    assert idle_seen >= 5
    r01 = json.loads((REPO / "lessons/01_auto_wrap/results_cpu.json").read_text())
    assert "zero_grad freed" in " ".join(table(r01).split())
    assert "zero_grad freed" in (REPO / "lessons/01_auto_wrap/README.md").read_text()


def test_lesson_help_never_splits_a_variant_name(monkeypatch):
    """``fsdp-course run NN -- --help`` at 80 columns: each variant name the help lists is whole on
    one line (argparse's own wrap breaks after hyphens: ``fsdp1-limit-`` / ``all-gathers``)."""
    monkeypatch.setenv("COLUMNS", "80")
    checked = 0
    for name, parser in _parsers_of_every_lesson_and_the_cli():
        lines = parser.format_help().splitlines()
        if not name.startswith("cli"):  # a lesson's docstring is refilled at the width
            assert max(len(line) for line in lines) <= 80, (name, max(lines, key=len))
        variants = getattr(parser, "_variants", None)
        if not variants:
            continue
        start = next(i for i, line in enumerate(lines) if line.startswith("  --variants"))
        end = next((i for i in range(start + 1, len(lines)) if not lines[i].startswith(" " * 8)), len(lines))
        words = {w.strip(",.;:()") for line in lines[start:end] for w in line.split()}
        for variant in variants:
            assert variant in words, (name, variant, lines[start:end])
        checked += 1
    assert checked >= 10  # the lessons with --variants


def _parsers_of_every_lesson_and_the_cli():
    """(name, parser) for every lesson's own parser (caught as its ``parse_args`` uses it) and for
    each ``fsdp-course`` command and ``fsdp-course plan``: new flags are covered without a list."""
    import argparse

    from conftest import lesson_module

    from utilities.course.catalog import LESSONS
    from utilities.course.cli import _parser
    from utilities.errors import OneLineParser
    from utilities.measure.plan_cli import add_plan_arguments

    class Caught(Exception):
        pass

    found = []
    real = OneLineParser.parse_known_args

    def catch(self, *args, **kwargs):
        found.append((number, self))
        raise Caught

    for info in LESSONS.values():
        if not info.script_path.is_file():
            continue
        number = info.number
        OneLineParser.parse_known_args = catch
        try:
            lesson_module(number).parse_args(["--device", "cpu", "--quick"])
        except Caught:
            pass
        finally:
            OneLineParser.parse_known_args = real
    top = _parser()
    for action in top._actions:
        if isinstance(action, argparse._SubParsersAction):
            found += [(f"cli {name}", sub) for name, sub in action.choices.items()]
    found.append(("cli plan", add_plan_arguments(OneLineParser(prog="fsdp-course plan"))))
    return found


def _float_flags(parser) -> list[str]:
    flags = []
    for action in parser._actions:
        if not action.option_strings or not callable(action.type):
            continue
        try:
            probe = action.type("0.5")
        except Exception:  # noqa: BLE001 - an int, a name, ...: not a float flag
            continue
        if isinstance(probe, float):
            flags.append(action.option_strings[-1])
    return flags


def test_every_float_flag_refuses_nan_and_inf_in_one_line():
    """NaN passes every range check (its comparisons are false): ``--lr nan`` trained to a 64-line
    traceback, ``--lr inf`` to NaN losses and exit 0."""
    from conftest import flag_error

    parsers = _parsers_of_every_lesson_and_the_cli()
    assert len({name for name, _ in parsers if not name.startswith("cli")}) >= 10
    checked = []
    for name, parser in parsers:
        for flag in _float_flags(parser):
            for value in ("nan", "inf", "-inf", "NaN", "1e999"):
                given = f"{flag}={value}"  # "--lr -inf" would read -inf as a flag
                if name.startswith("cli"):
                    code, err = _parse_exit(parser, [given])
                else:
                    code, err = 2, flag_error(name, given)
                assert code == 2 and err.startswith("error:") and "\n" not in err, (name, flag, err)
                assert flag in err and value in err and "finite" in err, (name, flag, err)
            checked.append(f"{name} {flag}")
    for expected in ("10 --lr", "10 --min-lr-ratio", "10 --grad-clip", "10 --weight-decay",
                     "06 --activation-gb", "01 --lr"):
        assert expected in checked, checked
    for value in ("1e999", "nan", "inf"):  # the planner reads its sizes itself
        proc = cli_here("plan", "--gpu-memory", value)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert "Traceback" not in proc.stderr


def _parse_exit(parser, argv) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            parser.parse_args(argv)
            code = 0
        except SystemExit as e:
            code = e.code
    return code, err.getvalue().strip()


def test_ctrl_c_is_one_line_and_exit_130(monkeypatch, capsys, tmp_path):
    """Ctrl-C mid-run gave up to 118 lines and 3 tracebacks: the launcher's SignalException, and a
    KeyboardInterrupt from every rank. The launcher now says it in one line and exits 130, the ranks
    end silently, and the CLI waits for the launcher instead of killing it."""
    import signal

    import torch.distributed.run
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from utilities import distributed as D
    from utilities.course import cli as cli_module
    from utilities.course.torchrun import run

    for error in (SignalException("got signal: 2", sigval=signal.SIGINT), KeyboardInterrupt()):
        def interrupted(argv, error=error):
            raise error

        monkeypatch.setattr(torch.distributed.run, "main", interrupted)
        with pytest.raises(SystemExit) as e:
            run(["--nproc-per-node=2", "x.py"])
        assert e.value.code == 130
        assert capsys.readouterr().err == "error: interrupted by SIGINT: every rank was stopped\n"

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")  # a rank: Ctrl-C ends it at once, silently
    before = signal.getsignal(signal.SIGINT)
    try:
        D.quiet_on_interrupt()
        handler = signal.getsignal(signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, before)
    exits = []
    monkeypatch.setattr(os, "_exit", exits.append)
    handler(signal.SIGINT, None)
    assert exits == [130]

    seen = []
    # Python's own handler, as in a terminal (a shell's background job starts with SIGINT ignored)
    before_run = signal.signal(signal.SIGINT, signal.default_int_handler)

    def launcher(cmd, env=None):  # gets the Ctrl-C too (one process group): stops, exits 130
        handler = signal.getsignal(signal.SIGINT)
        seen.append(handler is not signal.default_int_handler)
        handler(signal.SIGINT, None)  # the CLI's own Ctrl-C: nothing happens, it keeps waiting
        return 130

    monkeypatch.setattr(cli_module.subprocess, "call", launcher)
    try:
        assert cli_module.main(["run", "01", "--device", "cpu", "--nproc", "2", "--out",
                                str(tmp_path)]) == 130
        assert seen == [True] and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, before_run)
    launched = []

    def interrupted_launch(info, *args):  # `run all`: Ctrl-C in the first lesson stops the rest
        launched.append(info.number)
        return 130

    monkeypatch.setattr(cli_module, "launch", interrupted_launch)
    assert cli_module.main(["run", "all", "--quick", "--device", "cpu", "--out",
                            str(tmp_path / "all")]) == 130
    assert launched == ["01"]


def test_every_lesson_has_its_measured_takeaway():
    """Each lesson's script says its point from its own run: run on each committed CPU run, its
    ``takeaway`` gives the line that run printed (the numbers with it); a run without a variant
    the line reads gets the range of peaks instead (``Lesson``'s fallback)."""
    import json

    from utilities.course.catalog import LESSONS
    from utilities.course.launch import load_script
    from utilities.course.lesson import Lesson
    from utilities.results import peak_range

    for number, info in LESSONS.items():
        if number == "10":  # train.py writes its own (TrainingLog.takeaway): tests/test_lesson_10.py
            continue
        said = Lesson(number, None, takeaway=load_script(info.script_path).takeaway).takeaway_line
        for path in sorted(info.path.glob("results_cpu*.json")):
            committed = json.loads(path.read_text())
            assert said(committed) == committed["takeaway"], path
    r01 = json.loads((REPO / "lessons/01_auto_wrap/results_cpu.json").read_text())
    assert r01["takeaway"].startswith("per-block wrapping: 7.20 MiB -> 1.19 MiB unsharded at the peak")
    partial = dict(r01, variants=[v for v in r01["variants"] if v["name"] != "fsdp2-one-unit"])
    lesson = Lesson("01", None, takeaway=load_script(LESSONS["01"].script_path).takeaway)
    assert lesson.takeaway_line(partial) == peak_range(partial)
    assert "peak per rank from" in peak_range(partial)


def _course_imports(name: str) -> set[str]:
    """The ``utilities.course`` modules a course file imports, in any spelling, by its ast."""
    import ast

    found = set()
    for node in ast.walk(ast.parse((REPO / "utilities/course" / name).read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
    return {n.removeprefix("utilities.course.") for n in found if n.startswith("utilities.course.")}


def test_the_harness_and_torchrun_do_not_import_each_other():
    """``lesson.py`` (the harness a rank runs) and ``torchrun.py`` (the launcher's torchrun) never
    import each other; ``launch.py`` never imports the harness."""
    assert "torchrun" not in _course_imports("lesson.py")
    assert "lesson" not in _course_imports("torchrun.py")
    assert "lesson" not in _course_imports("launch.py")


def test_making_a_lesson_only_stores_its_arguments():
    """``Lesson(...)`` neither exits nor execs nor starts anything: its ``__init__`` is
    assignments only, calling nothing but ``list``/``dict``/``tuple`` (the set-up is ``with``'s)."""
    import ast
    import inspect
    import textwrap

    from utilities.course.lesson import Lesson

    init = ast.parse(textwrap.dedent(inspect.getsource(Lesson.__init__))).body[0]
    body = init.body[1:] if isinstance(init.body[0], ast.Expr) else init.body  # (a docstring)
    assert body and all(isinstance(s, (ast.Assign, ast.AnnAssign)) for s in body)
    calls = [n for s in body for n in ast.walk(s) if isinstance(n, ast.Call)]
    assert all(isinstance(c.func, ast.Name) and c.func.id in {"list", "dict", "tuple"} for c in calls)


def test_what_a_learner_runs_first_fits_80_columns(monkeypatch, capsys, tmp_path):
    """The README's first commands at 80 columns: ``fsdp-course check``, ``fsdp-course plan`` (with
    its step-time prediction) and the torchrun line ``fsdp-course run`` prints before the lesson:
    no line is wider (prose folds at spaces, the command folds with `` \\`` as a shell reads it)."""
    import json
    from pathlib import Path

    from utilities.course import cli as cli_module
    from utilities.course.launch import LAUNCH_ENV

    monkeypatch.setenv("COLUMNS", "80")
    assert cli_module.main(["check"]) == 0
    assert cli_module.main(["plan", "--model", "llama-tiny", "--gpus", "8", "--gpu-memory", "80GB",
                            "--batch", "2", "--seq", "256"]) == 0
    out = capsys.readouterr().out
    assert "step time, PREDICTED" in out and "assumes:" in out
    info = cli_module.get_lesson("01")
    monkeypatch.chdir(tmp_path)
    run = cli_module.prepare_launch(info, "cpu", 2, Path("runs/01_auto_wrap"), False,
                                    "t5-tiny", ["--steps", "40"], check_then_launch=True)
    command = json.loads(run.env[LAUNCH_ENV])["header"][-1].splitlines()
    assert command[0].startswith("$ torchrun --standalone") and command[0].endswith(" \\")
    lines = out.splitlines() + command
    assert max(len(line) for line in lines) <= 80, max(lines, key=len)


def test_output_cut_short_by_its_reader_ends_quietly():
    """``fsdp-course evidence --plan | head -3``: the reader gone, the command ends without a
    traceback (the pipe closed before the first line is written, so the write surely fails)."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "utilities", "list"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 1 and "Traceback" not in err and "BrokenPipe" not in err, err
