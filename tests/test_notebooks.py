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
