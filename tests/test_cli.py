"""The fsdp-course command: list, check, and one-line errors for every bad input."""

from __future__ import annotations

import pytest
import torch
from conftest import cli


def test_list_shows_every_lesson_with_status():
    proc = cli("list")
    assert proc.returncode == 0
    lines = proc.stdout.strip().splitlines()
    from utilities.catalog import LESSONS

    assert len(lines) == len(LESSONS) >= 14
    assert [line[:2] for line in lines] == [f"{n:02d}" for n in range(1, len(LESSONS) + 1)]
    assert all("ready" in line and "not yet written" not in line for line in lines), lines


def test_run_all_runs_every_lesson_and_summarizes(monkeypatch, tmp_path, capsys):
    """`fsdp-course run all`: every ready lesson launched once, a failure reported and counted,
    and a summary (table + summary.json) naming each lesson's fastest variant. The launches are
    stubbed here; each lesson's own test runs it for real."""
    import json

    import utilities.cli as C

    launched = []

    def fake_launch(info, device, nproc, out, quick, model, flags):
        launched.append(info.folder)
        if info.folder.startswith("05"):
            return 1
        out.mkdir(parents=True, exist_ok=True)
        variants = [{"name": "slow", "step_time_s": 0.2}, {"name": "fast", "step_time_s": 0.1}]
        (out / "results.json").write_text(json.dumps({"variants": variants}))
        return 0

    monkeypatch.setattr(C, "launch", fake_launch)
    rc = C.main(["run", "all", "--quick", "--device", "cpu", "--out", str(tmp_path)])
    assert rc == 1  # lesson 05 failed
    assert launched == [info.folder for info in C.LESSONS.values() if info.ready]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [row[0] for row in summary] == list(C.LESSONS)
    assert summary[4][2] == "FAILED" and summary[0][3:] == ["fast", "0.1000s"]
    assert "FAILED" in capsys.readouterr().out


def test_list_models_shows_parameter_counts():
    proc = cli("list", "--models")
    assert proc.returncode == 0
    assert "t5-tiny" in proc.stdout and "llama-8b" in proc.stdout and "8,030.3M" in proc.stdout


def test_check_reports_versions_and_bf16():
    proc = cli("check")
    assert proc.returncode == 0
    assert f"torch {torch.__version__}" in proc.stdout
    assert "bf16" in proc.stdout and "lessons:" in proc.stdout
    if not torch.cuda.is_available():
        assert "no CUDA GPU is visible" in proc.stdout


@pytest.mark.parametrize(
    "args, must_mention",
    [
        (["run", "42"], ["'42'", "01"]),
        (["run", "01", "--model", "gpt-17"], ["gpt-17", "t5-tiny"]),
        (["run", "01", "--nproc", "0"], ["--nproc", "0"]),
        (["run", "01", "--device", "tpu"], ["tpu", "cuda"]),
        (["run", "01", "--", "--steps", "0"], ["0", "integers >= 1"]),
        (["run", "01", "--", "--model", "gpt-17"], ["gpt-17", "t5-tiny"]),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, must_mention):
    proc = cli(*args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = proc.stderr.strip()
    assert err.startswith("error:") and "\n" not in err, err
    assert "Traceback" not in proc.stdout + proc.stderr
    for text in must_mention:
        assert text in err, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU answers")
def test_cuda_requests_without_gpu_are_refused():
    proc = cli("run", "01", "--device", "cuda")
    assert proc.returncode == 2 and "no CUDA GPU" in proc.stderr and "\n" not in proc.stderr.strip()


def test_nproc_larger_than_gpus_is_refused(monkeypatch, capsys):
    from utilities import cli as cli_module

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    rc = cli_module.main(["run", "01", "--device", "cuda", "--nproc", "4"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "--nproc 4" in err and "1..2" in err and "\n" not in err
