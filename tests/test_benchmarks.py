"""The benchmark scripts at their --tiny CPU size: they run, and their JSON holds what the report
needs. One run_all.py --tiny (4 torchrun launches: 3 lesson-10 configurations, 1 lesson-05 search)
feeds every test; no test asserts a timing."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks"
SCRIPTS = ("end_to_end", "layer", "memory_maximizer", "planner_check", "run_all", "report")
META = ("benchmark", "device", "device_name", "torch", "date", "tiny", "settings")


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """run_all.py --tiny into a temporary directory; returns the results directory."""
    root = tmp_path_factory.mktemp("bench")
    results = root / "results"
    proc = subprocess.run([sys.executable, str(BENCH / "run_all.py"), "--tiny", "--device", "cpu",
                           "--results-dir", str(results), "--work-dir", str(root / "work"), "--no-report"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"run_all failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return results


def _load(results: Path, name: str) -> dict:
    data = json.loads((results / f"{name}-cpu.json").read_text())
    for key in META:
        assert key in data, f"{name}: no {key!r}"
    assert data["benchmark"] == name and data["device"] == "cpu" and data["tiny"] is True
    assert data["device_name"] and data["torch"] and data["date"].endswith("+00:00")
    assert data["settings"]["tiny"] is True
    return data


@pytest.mark.parametrize("name", SCRIPTS)
def test_help_documents_every_flag(name, capsys):
    module = _module(name)
    entry = module.parse_args if hasattr(module, "parse_args") else module.main
    with pytest.raises(SystemExit) as e:
        entry(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert "--tiny" in text or name == "report"
    assert text.count("--") >= 3


def test_end_to_end(tiny):
    data = _load(tiny, "end_to_end")
    assert data["settings"]["model"] == "llama-tiny"
    assert [r["config"] for r in data["runs"]] == ["fsdp2-eager-ac_none", "fsdp2-eager-ac_selective",
                                                   "fsdp1-eager-ac_full"]
    for r in data["runs"]:
        assert r["status"] == "ok"
        assert r["tokens_per_s"] > 0 and r["peak_memory_bytes"] > 0
        assert r["step_time_min_s"] <= r["step_time_median_s"] <= r["step_time_max_s"]
        assert "mfu" in r and r["world_size"] == 2
    none, selective, full = data["runs"]
    assert selective["lesson_settings"]["ac_every"] == 2 and selective["ac"] == "selective"
    # every other block recomputed: fewer activations kept than with none
    assert selective["peak_memory_detail"]["activations"] < none["peak_memory_detail"]["activations"]
    assert full["peak_memory_method"] == "MemTracker"  # FSDP1 (use_orig_params) followed on CPU too


def test_layer(tiny):
    data = _load(tiny, "layer")
    assert data["settings"]["hidden"] == 64 and data["published"]["bf16_batch8_ms"] == 48.28
    assert {r["variant"] for r in data["rows"]} == {"eager", "compile"}
    for r in data["rows"]:
        assert r["iters"] >= 10 and len(r["samples_ms"]) == r["iters"]
        assert r["min_ms"] <= r["median_ms"] <= r["max_ms"]
    assert [s["variant"] for s in data["skipped"]] == ["fp8"]  # no GPU: skipped, with the reason


def test_memory_maximizer(tiny):
    data = _load(tiny, "memory_maximizer")
    assert data["status"] == "ok" and data["trials"]
    assert data["retry_free_batch"] >= 1 and data["retry_free_peak_memory_bytes"] > 0
    assert "needs a GPU" in data["notes"][0]


def test_planner_check_and_report(tiny, tmp_path):
    data = _load(tiny, "planner_check")
    sources = [r["source"] for r in data["rows"]]
    assert any(s.startswith("end_to_end") for s in sources)
    fsdp1 = next(r for r in data["rows"] if r["source"].endswith("fsdp1-eager-ac_full"))
    assert fsdp1["caveats"] == ["FSDP1 run, FSDP2 planned"]
    assert any(s.startswith("memory_maximizer") for s in sources)
    for r in data["rows"]:
        assert r["predicted_bytes"] > 0 and r["measured_bytes"] > 0 and "relative_error" in r

    readme = tmp_path / "README.md"
    readme.write_text("# B\n\n<!-- results:start -->\nOLD-TABLE\n<!-- results:end -->\ntail\n")
    _module("report").main(["--results-dir", str(tiny), "--readme", str(readme)])
    text = readme.read_text()
    assert "OLD-TABLE" not in text and text.endswith("tail\n")
    assert "not yet measured: no GPU in this task" in text and "CPU, tiny" in text
    assert "48.28 ms" in text and "33-39%" in text and "+25%" in text
