"""Every lesson notebook runs top to bottom on a CPU-only machine (what a learner does first)."""

from __future__ import annotations

import pytest
from conftest import notebook_results

from utilities.course.catalog import LESSONS

NOTEBOOKS = [info for info in LESSONS.values() if info.notebook.is_file()]


def test_every_ready_lesson_has_a_notebook_and_readme():
    for info in LESSONS.values():
        if info.ready:
            assert info.notebook.is_file(), f"lesson {info.number} has no notebook"
            assert (info.path / "README.md").is_file(), f"lesson {info.number} has no README.md"


@pytest.mark.parametrize("info", NOTEBOOKS, ids=[i.number for i in NOTEBOOKS])
def test_notebook_runs_top_to_bottom(info, tmp_path_factory):
    # nbclient raises CellExecutionError on the first failing cell; the run must leave results
    results = notebook_results(info.number, tmp_path_factory)
    assert results["lesson"] == info.number and results["variants"]


@pytest.mark.parametrize("info", NOTEBOOKS, ids=[i.number for i in NOTEBOOKS])
def test_notebook_cells_have_unique_ids(info):
    """nbformat 4.5 wants an id on every cell; a notebook without them is "fixed" in memory on
    every read (with a warning) and will be refused by future nbformat. Checked on the file itself."""
    import json

    from nbformat.validator import normalize

    raw = json.loads(info.notebook.read_text())
    ids = [cell.get("id") for cell in raw["cells"]]
    assert None not in ids and len(set(ids)) == len(ids), ids
    changes, _ = normalize(raw)
    assert changes == 0


def test_a_lessons_tests_share_one_worker_and_a_gpu_machine_runs_serially(monkeypatch):
    """Under pytest-xdist, the tests that read one notebook run (the lesson's file, its notebook
    test, its GPU twin) form one work unit, so the notebook runs once; a file's tests stay together
    (module fixtures); and a GPU machine gets no workers (its tests measure one GPU)."""
    import torch
    from conftest import pytest_xdist_auto_num_workers, work_unit
    from gpu_cases import CASES

    for case in CASES:
        unit = work_unit(f"tests/test_lesson_{case.lesson}.py::test_x")
        claim = f"tests/test_gpu_claims_on_cpu.py::test_gpu_claim_holds_on_the_cpu_run[{case.id}]"
        assert work_unit(claim) == unit
        assert work_unit(f"tests/test_notebooks.py::test_notebook_runs_top_to_bottom[{case.lesson}]") == unit
    # lesson 14 reads lesson 06's run
    assert work_unit("tests/test_lesson_14.py::t") == work_unit("tests/test_lesson_06.py::t")
    assert work_unit("tests/test_benchmarks.py::a[x]") == work_unit("tests/test_benchmarks.py::b")
    assert work_unit("tests/test_lesson_01.py::t") != work_unit("tests/test_lesson_02.py::t")
    monkeypatch.delenv("PYTEST_XDIST_AUTO_NUM_WORKERS", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert pytest_xdist_auto_num_workers(None) == 0
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pytest_xdist_auto_num_workers(None) == 2
