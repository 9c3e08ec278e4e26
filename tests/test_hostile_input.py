"""Files and values a user (or an attacker) hands the course are answered in one line, within
bounds: a results file cannot write HTML or a marker into a README; a JSON file too deep or too
large, a 20-digit number, a seed or a size no machine holds, a bad torchrun variable, a rank killed
mid-run: one line each, never a traceback."""

from __future__ import annotations

import json
import shutil
import time

import pytest
from conftest import REPO, cli_here

from utilities.errors import UsageError
from utilities.json_input import MAX_JSON_BYTES, json_depth, read_json
from utilities.text import markdown, markdown_escape

INJECTION = "ok <!-- /results --> <img src=x onerror=alert(1)> &copy"


# -- item 11: README marker injection ---------------------------------------------------------------

def test_markdown_cells_and_text_are_inert_and_escaping_twice_changes_nothing():
    assert markdown_escape(INJECTION) == "ok &lt;!-- /results --> &lt;img src=x onerror=alert(1)> &amp;copy"
    assert markdown_escape(markdown_escape(INJECTION)) == markdown_escape(INJECTION)
    assert markdown_escape("6.386->4.436 &lt; &#92;") == "6.386->4.436 &lt; &#92;"
    table = markdown([["name", "value"], ["a|b\n# heading", "<script>x</script>"]])
    rows = table.splitlines()
    assert len(rows) == 3 and rows[2] == "| a\\|b # heading | &lt;script>x&lt;/script> |"


def test_a_results_file_cannot_break_its_readme(tmp_path, monkeypatch):
    """A results file holding the end marker and raw HTML in its takeaway, a variant's name and a
    key: ``--write`` keeps every marker where it was, the README holds no tag from the file, and a
    second ``--write`` (and the check) finds nothing to change."""
    from utilities.course import readme_tables

    folder = tmp_path / "lessons" / "01_auto_wrap"
    folder.mkdir(parents=True)
    source = REPO / "lessons" / "01_auto_wrap"
    shutil.copy(source / "README.md", folder / "README.md")
    results = json.loads((source / "results_cpu.json").read_text())
    results["takeaway"] = INJECTION
    results["variants"][0]["name"] = INJECTION
    results["variants"][0][INJECTION] = 1
    results["device_name"] = "cpu\n\n<!-- results:01 results_cpu.json -->"
    (folder / "results_cpu.json").write_text(json.dumps(results))
    monkeypatch.setattr(readme_tables, "REPO", tmp_path)
    before = (folder / "README.md").read_text()
    assert readme_tables.check("01", write=True)  # the new content is written
    after = (folder / "README.md").read_text()
    for marker in ("<!-- /results -->", "<!-- results:", "<!--"):  # a lone "-->" ends nothing
        assert after.count(marker) == before.count(marker), marker
    assert "<img" not in after and "&lt;img src=x" in after
    outside = before.split("<!-- /results -->", 1)[1]
    assert after.split("<!-- /results -->", 1)[1] == outside
    assert readme_tables.check("01") == []
    readme_tables.check("01", write=True)
    assert (folder / "README.md").read_text() == after


# -- item 11: deep, huge and sparse JSON --------------------------------------------------------------

def test_a_json_file_too_deep_too_large_or_not_regular_is_one_line(tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(UsageError, match="nested deeper than 64 levels"):
        read_json(deep)
    shallow_but_past = tmp_path / "past.json"
    shallow_but_past.write_text("[" * 65 + "]" * 65)  # parses, then is refused
    with pytest.raises(UsageError, match="nested deeper than 64 levels"):
        read_json(shallow_but_past)
    assert json_depth(json.loads("[" * 64 + "]" * 64)) == 64
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(64 * 2**30)  # sparse: 64 GiB that costs no disk, and must cost no memory
    start = time.perf_counter()
    with pytest.raises(UsageError, match=f"more than the {MAX_JSON_BYTES:,} a JSON file"):
        read_json(big)
    assert time.perf_counter() - start < 1
    with pytest.raises(UsageError, match="not a regular file"):
        read_json(tmp_path)


@pytest.mark.parametrize("content", ["deep", "sparse"])
def test_plan_refuses_a_deep_or_huge_config_in_one_line(tmp_path, content):
    path = tmp_path / "config.json"
    if content == "deep":
        path.write_text('{"model_type": "llama", "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    else:
        with open(path, "wb") as f:
            f.truncate(64 * 2**30)
    proc = cli_here("plan", "--model", str(path), "--no-time")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("error:") and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert ("nested deeper" if content == "deep" else "more than the") in proc.stderr


def test_a_deep_results_file_is_one_line(tmp_path, monkeypatch, capsys):
    from utilities.course import readme_tables
    from utilities.measure.results import load

    folder = tmp_path / "lessons" / "01_auto_wrap"
    folder.mkdir(parents=True)
    shutil.copy(REPO / "lessons" / "01_auto_wrap" / "README.md", folder / "README.md")
    (folder / "results_cpu.json").write_text('{"variants": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(UsageError, match="results file .* cannot be read: it is nested deeper"):
        load(folder / "results_cpu.json")
    monkeypatch.setattr(readme_tables, "REPO", tmp_path)
    assert readme_tables.main(["01"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: lesson 01: results file") and err.strip().count("\n") == 0
