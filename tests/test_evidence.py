"""``fsdp-course evidence`` on a machine without a GPU: its plan fits the 25 minutes a GPU is lent
for, it refuses to run in one line, and its orchestration (budget, failures, the manifest) and its
README rendering work, with the GPU steps replaced by CPU twins."""

from __future__ import annotations

import argparse
import json
import shutil
import sys

import pytest
from conftest import REPO, cli_here

from utilities.course import evidence as E


def test_the_plan_fits_25_minutes_on_one_h100_and_names_every_lesson():
    proc = cli_here("evidence", "--plan")
    assert proc.returncode == 0, proc.stderr
    steps = E.gpu_steps()
    assert steps[0].name == "gpu-tests" and sum(s.minutes for s in steps) <= 25
    assert {f"lesson-{n:02d}" for n in range(1, 15)} <= {s.name for s in steps}
    assert "total" in proc.stdout and all(len(line) <= 80 for line in proc.stdout.splitlines())


@pytest.mark.parametrize("args, says", [
    (["evidence"], "needs a CUDA GPU"),
    (["evidence", "--only", "lesson-99"], "--only 'lesson-99' is not allowed"),
    (["evidence", "--budget", "inf"], "--budget 'inf' is not allowed"),
])
def test_without_a_gpu_or_with_bad_input_it_refuses_in_one_line(args, says):
    proc = cli_here(*args)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("error:") and proc.stderr.strip().count("\n") == 0 and says in proc.stderr


def twin_steps(results_cpu: str) -> list[E.Step]:
    """CPU twins: one that passes and writes a lesson run, one that fails, one the budget skips."""
    py = sys.executable
    write_run = ("import pathlib, shutil, sys; d = pathlib.Path(sys.argv[1]) / 'run01'; "
                 "d.mkdir(parents=True); shutil.copy(sys.argv[2], d / 'results.json')")
    return [E.Step("lesson-01", 1.0, (py, "-c", write_run, "{out}", results_cpu), "a lesson run"),
            E.Step("gpu-tests", 1.0, (py, "-c", "import sys; print('x'); sys.exit('error: boom')"),
                   "fails"),
            E.Step("benchmarks", 30.0, (py, "-c", "print(1)"), "over the budget")]


def test_a_failing_step_is_recorded_and_the_run_goes_on(tmp_path):
    said = []
    outcomes = E.run_steps(twin_steps(str(REPO / "lessons/01_auto_wrap/results_cpu.json")),
                           tmp_path / "ev", budget_minutes=10, echo=said.append)
    assert [(o.name, o.status) for o in outcomes] == [("lesson-01", "ok"), ("gpu-tests", "failed"),
                                                       ("benchmarks", "skipped")]
    assert outcomes[1].returncode == 1 and outcomes[1].error == "error: boom"
    assert (tmp_path / "ev" / "run01" / "results.json").is_file()
    assert "x" in (tmp_path / "ev" / "gpu-tests.log").read_text()
    assert any("min left" in line for line in said) and "skipped" in said[-1]


def test_the_command_writes_a_manifest_and_renders_the_readme_tables(tmp_path, monkeypatch):
    lessons = tmp_path / "lessons"
    for name in ("01_auto_wrap", "02_activation_checkpointing"):
        (lessons / name).mkdir(parents=True)
        (lessons / name / "README.md").write_text(
            f"## On a GPU\n\n<!-- gpu-results:{name[:2]} -->\nnot yet measured on a GPU\n"
            "<!-- /gpu-results -->\n")
    cpu_run = str(REPO / "lessons/01_auto_wrap/results_cpu.json")
    monkeypatch.setattr(E, "gpu_steps", lambda: twin_steps(cpu_run))
    real_render = E.render_readmes
    monkeypatch.setattr(E, "render_readmes", lambda folder: real_render(folder, lessons))
    args = E.add_arguments(argparse.ArgumentParser()).parse_args(["--out", str(tmp_path / "ev"),
                                                                  "--budget", "10"])
    assert E.main(args, gpu_available=lambda: True) == 1  # one step failed
    manifest = json.loads((tmp_path / "ev" / "manifest.json").read_text())
    assert set(manifest) >= {"device", "driver", "torch", "cuda", "commit", "date", "steps"}
    assert [s["status"] for s in manifest["steps"]] == ["ok", "failed", "skipped"]
    rendered = (lessons / "01_auto_wrap" / "README.md").read_text()
    results = json.loads((REPO / "lessons/01_auto_wrap/results_cpu.json").read_text())
    assert "not yet measured" not in rendered
    from utilities.course.readme_tables import render

    table = render("01", results, "../../ev/run01/results.json")  # as the lesson's CPU table
    assert table in rendered and "`fsdp-course run 01 --device cpu`" in table
    for v in results["variants"]:
        assert f"| {v['name']} | " in rendered
    assert "not yet measured" in (lessons / "02_activation_checkpointing" / "README.md").read_text()
    shutil.rmtree(tmp_path / "ev")


def test_every_lesson_readme_has_the_block_evidence_renders_into():
    for readme in sorted((REPO / "lessons").glob("*/README.md")):
        blocks = [m.group(2) for m in E.GPU_BLOCK.finditer(readme.read_text())]
        assert blocks == [readme.parent.name[:2]], readme
