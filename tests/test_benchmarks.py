"""The benchmark scripts at their --tiny CPU size: they run, and their JSON holds what the report
needs. One --tiny pass feeds every test: each benchmark's main() in this process, in run_all.py's
order with run_all.py's flags (run_all.py adds only a process per benchmark, to free a GPU's memory
between them); 3 torchrun launches (2 lesson-10 configurations, 1 lesson-05 search) and one process
for the plain reference loops; no test asserts a timing, only
that the numbers are there and agree with each other (a ratio is its two tokens/s divided).
GPU-shaped result files are made up here (synthetic) to check what only a GPU run would produce."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks"
SCRIPTS = ("end_to_end", "reference", "layer", "memory_maximizer", "planner_check", "run_all", "report")
META = ("benchmark", "device", "device_name", "torch", "date", "tiny", "settings")


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """Every benchmark at --tiny into a temporary directory, as run_all.py --tiny runs them;
    returns the results directory."""
    root = tmp_path_factory.mktemp("bench")
    run_all = _module("run_all")
    args = run_all.parse_args(["--tiny", "--device", "cpu", "--results-dir", str(root / "results"),
                               "--work-dir", str(root / "work"), "--no-report"])
    for name in run_all.BENCHMARKS:
        assert _module(name).main(run_all.benchmark_argv(name, args, "cpu")) == 0, name
    return root / "results"


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
    assert "--tiny" in text or name in ("report", "reference")  # these two have no size of their own
    assert text.count("--") >= 3


def test_end_to_end(tiny):
    data = _load(tiny, "end_to_end")
    assert data["settings"]["model"] == "llama-tiny"
    assert [r["config"] for r in data["runs"]] == ["fsdp2-eager-ac_none", "fsdp1-eager-ac_selective"]
    for r in data["runs"]:
        assert r["status"] == "ok"
        assert r["tokens_per_s"] > 0 and r["peak_memory_bytes"] > 0
        assert r["step_time_min_s"] <= r["step_time_median_s"] <= r["step_time_max_s"]
        assert "mfu" in r and r["world_size"] == 2
    none, selective = data["runs"]
    assert selective["lesson_settings"]["ac_every"] == 2 and selective["ac"] == "selective"
    assert none["lesson_settings"]["batch_size"] == 8 and data["settings"]["batch_size"] == 8
    # every other block recomputed: fewer activations kept than with none (measured: about half)
    assert selective["peak_memory_detail"]["activations"] < none["peak_memory_detail"]["activations"]
    assert selective["peak_memory_method"] == "MemTracker"  # FSDP1 (use_orig_params) followed on CPU too


def test_end_to_end_reference_row_and_ratios(tiny):
    """The plain one-device loop ran in the same run, once per MODE-AC setting, and every
    configuration's ratio_to_reference is its tokens/s per device over its reference's tokens/s."""
    data = _load(tiny, "end_to_end")
    refs = {r["config"]: r for r in data["references"]}
    assert list(refs) == ["reference-eager-ac_none", "reference-eager-ac_selective"]
    for r in refs.values():
        assert r["status"] == "ok" and r["tokens_per_s"] > 0 and r["timed_steps"] == 2
        assert r["model"]["name"] == "llama-tiny" and r["batch_size"] == 8 and r["seq_len"] == 32
        assert r["threads"] == 1 and r["optimizer"].startswith("AdamW ")  # one rank's share, fused
        assert r["tokens_per_s"] == pytest.approx(r["tokens_per_step"] / r["step_time_median_s"])
    for run in data["runs"]:
        ref = refs[run["reference"]]
        assert run["reference"] == "reference-" + run["config"].split("-", 1)[1]
        assert run["tokens_per_s_per_device"] == pytest.approx(run["tokens_per_s"] / run["world_size"])
        assert run["ratio_to_reference"] == pytest.approx(
            run["tokens_per_s"] / run["world_size"] / ref["tokens_per_s"], rel=1e-12)
        assert run["ratio_to_reference"] > 0


def test_layer(tiny):
    data = _load(tiny, "layer")
    assert data["settings"]["hidden"] == 64 and data["published"]["bf16_batch8_ms"] == 48.28
    assert [r["variant"] for r in data["rows"]] == ["eager", "compile", "compile-linear"]
    by = {r["variant"]: r for r in data["rows"]}
    assert by["compile"]["compiled"] == "layer" and by["compile-linear"]["compiled"] == "linear"
    for r in data["rows"]:
        assert r["iters"] >= 10 and len(r["samples_ms"]) == r["iters"]
        assert r["min_ms"] <= r["median_ms"] <= r["max_ms"]
        assert r["speedup_vs_eager"] == pytest.approx(by["eager"]["median_ms"] / r["median_ms"])
        assert r["attention"] == "sdpa (auto)"
    # no GPU: every FP8 configuration is skipped, with the one-line reason
    assert [s["variant"] for s in data["skipped"]] == ["fp8-tensorwise", "fp8-rowwise"]
    assert all("compute capability" in s["reason"] and "\n" not in s["reason"] for s in data["skipped"])
    assert data["configs"]["fp8-rowwise"] == {"compiled": "layer", "fp8_recipe": "rowwise"}


def test_memory_maximizer(tiny):
    """The same search as on a GPU, doubling then bisecting, against the CPU budget stand-in: the
    largest batch within budget vs the smallest one over it, in tokens/s."""
    data = _load(tiny, "memory_maximizer")
    assert data["status"] == "ok" and data["bisect"] is True
    trials = {t["batch"]: t for t in data["trials"]}
    assert [(t["batch"], t["phase"]) for t in data["trials"]] == [(2, "grow"), (4, "grow"), (3, "bisect")]
    assert data["retry_free_batch"] == 2 and data["retrying_batch"] == 3
    assert trials[3]["over_budget"] and not trials[2]["over_budget"]
    assert data["retrying_kind"] == "over the memory budget (CPU stand-in)"
    assert data["retry_free_tokens_per_s"] == trials[2]["tokens_per_s"] > 0
    assert data["speedup"] == pytest.approx(trials[2]["tokens_per_s"] / trials[3]["tokens_per_s"] - 1)
    assert data["retry_free_peak_memory_bytes"] > 0
    assert "needs a GPU" in data["notes"][0] and "no claim" in data["notes"][0]


def test_memory_maximizer_finds_the_retry_effect_in_gpu_trials():
    """The GPU comparison on lesson 05's H100 trials (run05.json: 24 clean at 7,935 tokens/s, 25 with
    3 retries at 7,260, 26 with 8, 28 OOM) and on the doubling-only run that missed it (16, then 32
    OOM)."""
    mm = _module("memory_maximizer")

    def t(batch, tps, retries=0, ooms=0):
        verdict = "OOM" if ooms else f"{retries} retries" if retries else "clean"
        return {"batch": batch, "tokens_per_s": tps, "samples_per_s": None, "retries": retries,
                "ooms": ooms, "over_budget": False, "verdict": verdict, "peak_bytes": 1}

    bisected = [t(16, 7797.0), t(32, None, ooms=1), t(24, 7935.3), t(28, None, ooms=1), t(26, 7246.5, 8),
                t(25, 7260.0, 3)]
    found = mm.retry_effect(bisected, 24, on_gpu=True)
    assert (found["retry_free_batch"], found["retrying_batch"], found["retrying_retries"]) == (24, 25, 3)
    assert found["speedup"] == pytest.approx(7935.3 / 7260.0 - 1) and found["why"] is None
    missed = mm.retry_effect([t(16, 7797.0), t(32, None, ooms=1)], 16, on_gpu=True)
    assert missed["speedup"] is None and "straight to OOM" in missed["why"]
    assert mm.parse_args(["--tiny"]).no_bisect is False  # bisection is the default


def test_planner_check_and_report(tiny, tmp_path):
    data = _load(tiny, "planner_check")
    sources = [r["source"] for r in data["rows"]]
    assert any(s.startswith("end_to_end") for s in sources)
    fsdp1 = next(r for r in data["rows"] if r["source"].endswith("fsdp1-eager-ac_selective"))
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
    # the published anchors: torchtitan MFU, TransformerEngine's FP8 layer, torchao Float8 +25%
    assert "48.28 ms" in text and "33-39%" in text and "21.67 ms" in text
    assert "torchao Float8 (Llama3-8B, 8x H100, FSDP2 + compile): +25% tokens/s over bf16" in text
    assert "vs reference (same run)" in text and "reference-eager-ac_none (plain loop" in text
    e2e = _load(tiny, "end_to_end")
    first = e2e["runs"][0]
    assert f"{first['ratio_to_reference']:.2f}x reference-eager-ac_none (per device)" in text


def _synthetic_gpu_results(directory: Path) -> None:
    """GPU-shaped result files (what an H100 run writes; numbers made up, llama-tiny / t5-tiny sizes
    so that the planner's fake step takes seconds): lesson 10's GPU peaks are max_memory_allocated
    beside a "census" split, and memory_maximizer trials carry the allocator's peak."""
    meta = {"device": "cuda", "device_name": "NVIDIA H100 80GB HBM3 (synthetic)", "torch": "2.11.0+cu130",
            "date": "2026-11-22T23:58:13+00:00", "tiny": False}
    run = {"status": "ok", "world_size": 1, "model": {"name": "llama-tiny", "parameters": 836736},
           "tokens_per_s": 54_000.0, "tokens_per_s_per_device": 54_000.0, "mfu": 0.45,
           "step_time_median_s": 0.19, "step_time_min_s": 0.18, "step_time_max_s": 0.27,
           "peak_memory_bytes": 20 * 2**20, "peak_memory_method": "census",
           "lesson_settings": {"model": "llama-tiny", "precision": "bf16", "batch_size": 8, "seq_len": 32}}
    e2e = dict(meta, benchmark="end_to_end", settings={"model": "llama-tiny", "seq_len": 32, "batch_size": 8,
                                                       "precision": "bf16", "nproc": 1},
               references=[{"config": "reference-compile-ac_none", "status": "ok", "tokens_per_s": 60_000.0,
                            "mfu": 0.5, "step_time_median_s": 0.17, "step_time_min_s": 0.16,
                            "step_time_max_s": 0.2, "peak_memory_bytes": 18 * 2**20}],
               runs=[dict(run, config="fsdp2-compile-ac_none", api="fsdp2", compile=True, ac="none",
                          reference="reference-compile-ac_none", ratio_to_reference=0.9)])
    trial = {"tokens_per_s": 1000.0, "samples_per_s": 15.0, "step_time_s": 1.0, "over_budget": False,
             "phase": "grow"}
    mm = dict(meta, benchmark="memory_maximizer", settings={}, status="ok",
              model={"name": "t5-tiny", "parameters": 1887232}, world_size=1, seq_len=64,
              trials=[dict(trial, batch=1, peak_bytes=31 * 2**20, retries=0, ooms=0, verdict="clean"),
                      dict(trial, batch=2, peak_bytes=35 * 2**20, retries=3, ooms=0, verdict="3 retries"),
                      dict(trial, batch=4, peak_bytes=None, retries=0, ooms=1, verdict="OOM")],
              retry_free_batch=1, retry_free_tokens_per_s=1000.0, retrying_batch=2,
              retrying_tokens_per_s=900.0, retrying_kind="cudaMalloc retries", speedup=1000 / 900 - 1,
              retry_free_peak_memory_bytes=31 * 2**20)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "end_to_end-nvidia-h100-synthetic.json").write_text(json.dumps(e2e))
    (directory / "memory_maximizer-nvidia-h100-synthetic.json").write_text(json.dumps(mm))


def test_planner_check_compares_every_gpu_configuration(tmp_path):
    """GPU runs say "census" for their category split but their total is max_memory_allocated:
    every one is compared (compiled runs marked; FSDP1 ones too, as the tiny run shows), and every
    memory-maximizer trial that did not OOM; the planner runs on fake tensors, so a CPU can check
    GPU files. Three plans (about 5 s each on a 2-core machine)."""
    results = tmp_path / "results"
    _synthetic_gpu_results(results)
    out = results / "planner_check-cpu-checking-gpu.json"
    assert _module("planner_check").main(["--device", "cpu", "--measured-on", "cuda", "--results-dir",
                                          str(results), "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["measured_on"] == "cuda"
    rows = {r["source"].split(":", 1)[1]: r for r in data["rows"]}
    assert set(rows) == {"fsdp2-compile-ac_none", "batch-1", "batch-2"}  # not the OOM trial
    for r in rows.values():
        assert r["measured_method"] == "torch.cuda.max_memory_allocated" and r["measured_on"] == "cuda"
        assert r["predicted_bytes"] > 0
        assert r["relative_error"] == pytest.approx(r["predicted_bytes"] / r["measured_bytes"] - 1)
    assert rows["fsdp2-compile-ac_none"]["caveats"] == ["compiled run, eager planned"]
    assert rows["fsdp2-compile-ac_none"]["precision"] == "bf16"
    assert rows["batch-2"]["caveats"] == ["3 retries trial"] and rows["batch-1"]["caveats"] == []

    # the report puts them in the GPU rows, beside the synthetic GPU end_to_end and memory rows
    text = _module("report").table(results)
    assert "measured on GPU, planned on" in text and "(torch.cuda.max_memory_allocated)" in text
    assert "0.90x reference-compile-ac_none (per device)" in text and "1.00 (the reference)" in text
    assert "+11.1% retry-free over retrying" in text


def test_planner_speed_readme_lines_are_rendered_from_the_committed_run(tmp_path):
    """benchmarks/README.md's planner speed is the committed result file rendered, with the
    machine and its load; the script runs (--tiny), timing the CLI in fresh processes."""
    import json
    import sys

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "benchmarks"))
    import planner_speed

    data = json.loads((root / "benchmarks/results/planner_speed-cpu.json").read_text())
    block = planner_speed.README_BLOCK.search((root / "benchmarks/README.md").read_text())
    assert block and block.group(2) == planner_speed.render(data)
    assert set(data["runs"]) == set(planner_speed.GOALS_S) and data["machine"]["cores"]
    out = tmp_path / "speed.json"
    assert planner_speed.main(["--tiny", "--out", str(out)]) == 0
    tiny = json.loads(out.read_text())
    assert all(r["s"] > 0 for r in tiny["runs"].values())
