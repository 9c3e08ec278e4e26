"""A new user's rough edges. All cheap: no lesson launch, no simulated plan.

The README set-up block, README results tables rendered from the lesson's own run, the planner's
"temporaries" and GPU sizes, lesson 07's DTensor warnings, notebook 07's plot labels.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import types
import warnings

import pytest
import torch
from conftest import REPO

from utilities.course import readme_tables as T
from utilities.errors import UsageError
from utilities.measure import plan_cli
from utilities.measure import planner as P


# -- the README's set-up block ---------------------------------------------------------------------
def test_setup_block_installs_cpu_torch_before_the_requirements():
    """Someone who copies the block line by line on a CPU box must get the CPU build of torch:
    the CPU line is inside the block, marked, and comes before `pip install -r requirements.txt`."""
    text = (REPO / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.S).group(1).splitlines()
    requirements = next(i for i, line in enumerate(block) if "pip install -r requirements.txt" in line)
    cpu = next(i for i, line in enumerate(block)
               if line.startswith('pip install "torch') and "download.pytorch.org/whl/cpu" in line)
    assert cpu < requirements
    assert any("CPU-only machine" in line for line in block[:cpu])
    # the CPU line pins the range requirements.txt accepts, so the next line keeps that build
    pinned = re.search(r'"(torch[^"]+)"', block[cpu]).group(1)
    assert pinned in (REPO / "requirements.txt").read_text().splitlines()


# -- README results tables come from a run ------------------------------------------------------------
def test_marked_readme_tables_match_their_committed_runs():
    """Every lesson's README has a results table rendered from a run committed beside it, which
    names its machine; every committed run is rendered somewhere (none left behind)."""
    from utilities.course.catalog import LESSONS

    lessons = T.marked_lessons()
    assert set(lessons) == set(LESSONS)
    for lesson in lessons:
        assert T.check(lesson) == [], f"python -m utilities.course.readme_tables --write {lesson}"
        folder = T.lesson_dir(lesson)
        readme = (folder / "README.md").read_text()
        blocks = [m for m in T.BLOCK.finditer(readme) if m.group(2) == lesson]
        assert blocks, lesson
        rendered = {name for m in blocks for name in m.group(3).split(",")}
        assert rendered == {p.name for p in folder.glob("results_cpu*.json")}, lesson
        for name in rendered:
            results = json.loads((folder / name).read_text())
            assert results["lesson"] == lesson and results["device"] == "cpu", (lesson, name)
            assert results["machine"]["cpu_cores"] and results["machine"]["memory_bytes"], (lesson, name)
            caption = next(line for line in readme.splitlines() if f"[`{name}`]({name})" in line)
            assert ("--quick" in caption) == bool(results["settings"].get("quick")), (lesson, name)


def test_a_hand_edited_number_is_caught(tmp_path, monkeypatch):
    """The check can fail: change one number in a copy of lesson 07's README and it differs."""
    folder = tmp_path / "lessons" / "07_mixed_precision"
    folder.mkdir(parents=True)
    src = T.lesson_dir("07")
    (folder / "results_cpu.json").write_text((src / "results_cpu.json").read_text())
    text = (src / "README.md").read_text()
    assert "| 27.89 MiB |" in text  # bf16's peak, rendered from the run
    (folder / "README.md").write_text(text.replace("| 27.89 MiB |", "| 28.89 MiB |", 1))
    monkeypatch.setattr(T, "REPO", tmp_path)
    problems = T.check("07")
    assert any("28.89" in p for p in problems) and any("27.89" in p for p in problems)
    T.check("07", write=True)
    assert T.check("07") == []


def test_the_two_numbers_of_issue_14_are_what_the_runs_say():
    r07 = json.loads((T.lesson_dir("07") / "results_cpu.json").read_text())
    reduce32 = next(v for v in r07["variants"] if v["name"] == "fsdp2-bf16-fp32-reduce")
    fp32 = next(v for v in r07["variants"] if v["name"] == "fsdp2-fp32")
    diff = max(abs(a - b) for a, b in zip(reduce32["losses"], fp32["losses"]))
    readme07 = (T.lesson_dir("07") / "README.md").read_text()
    assert f"{diff:.3f}" == "0.025" and "at most 0.025 from fp32" in readme07
    assert "0.032" not in readme07
    r01 = json.loads((T.lesson_dir("01") / "results_cpu.json").read_text())
    per_block = next(v for v in r01["variants"] if v["name"] == "fsdp2-per-block")
    # 1.19 MiB = one decoder block (262,528) + the root unit (49,408 parameters), 4 bytes each
    assert per_block["peak_unsharded_parameter_bytes"] == 4 * (262_528 + 49_408)
    readme01 = (T.lesson_dir("01") / "README.md").read_text()
    assert "plus the prefetched one" not in readme01 and "49,408 parameters" in readme01


# -- the planner: "temporaries", and the GPU size the user means ---------------------------------
@pytest.mark.parametrize("text, gib, says", [
    ("h100", 79.65, "h100"), ("H100", 79.65, "h100"), ("a100-40gb", 40.0, "a100-40gb"),
    ("h200", 140.4, "h200"), ("80GB", 74.51, "10^9"), ("80GiB", 80.0, "2^30"),
])
def test_gpu_memory_accepts_names_and_sizes(text, gib, says):
    nbytes, source = P.resolve_gpu_memory(text)
    assert nbytes / 2**30 == pytest.approx(gib, abs=0.01) and says in source


def test_gpu_memory_auto_is_this_gpu_or_an_h100(monkeypatch):
    import utilities.memory_maximizer as M

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert P.resolve_gpu_memory("auto")[0] == P.GPU_MEMORY_MIB["h100"] * 2**20
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(M, "gpu_total_memory", lambda *a: (85_520_809_984, "nvml"))
    nbytes, source = P.resolve_gpu_memory("auto")
    assert nbytes == 85_520_809_984 and "H100" in source and "nvml" in source
    with pytest.raises(UsageError, match="h999.*a GPU name"):
        P.resolve_gpu_memory("h999")


def _plan(**kw) -> P.Plan:
    peak = {"parameters": 5, "gradients": 1, "optimizer": 8, "activations": 12, "temporaries": 16,
            "total": 42}
    base = dict(model="llama-8b", parameters_total=8_030_261_248, gpus=8,
                gpu_memory_bytes=P.GPU_MEMORY_MIB["h100"] * 2**20, strategy="full_shard",
                precision="bf16", ac="full", batch=2, seq=8192, device_type="cpu", shard_size=None,
                peak_bytes={k: v * 2**30 for k, v in peak.items()},
                detail={"temporaries": 15 * 2**30, "all_gather": 2**29, "reduce_scatter": 2**29},
                budget_bytes=67 * 2**30, fits=True, overflowing=None, method="test")
    return P.Plan(**dict(base, **kw))


def test_plan_names_temporaries_and_what_they_hold():
    text = plan_cli.format_plan(_plan(gpu_memory_source="h100: 81,559 MiB, as nvidia-smi reports it"))
    rows = [line.split()[0] for line in text.splitlines()[2:8]]
    assert rows == ["parameters", "gradients", "optimizer", "activations", "temporaries", "total"]
    assert "other" not in rows
    line = next(x for x in text.splitlines() if x.startswith("temporaries:"))
    assert "autograd temporaries (logits, loss) 15.00 GiB" in line and "all-gather" in line
    assert "GPU memory: 79.65 GiB per GPU (h100" in text


def test_plan_cli_reports_the_size_it_used(monkeypatch):
    seen = {}

    def fake_plan(model, config, gpu_memory_bytes):
        seen.update(gpu_memory_bytes=gpu_memory_bytes)
        return _plan(gpu_memory_bytes=gpu_memory_bytes)

    monkeypatch.setattr(plan_cli, "plan", fake_plan)
    parser = plan_cli.add_plan_arguments(argparse.ArgumentParser())
    p, _ = plan_cli.plan_from_args(parser.parse_args(["--gpu-memory", "a100-80gb", "--model", "t5-tiny"]))
    assert seen["gpu_memory_bytes"] == 80 * 2**30
    assert "GPU memory: 80.00 GiB per GPU (a100-80gb" in plan_cli.format_plan(p)
    assert parser.parse_args([]).gpu_memory == "auto"


# -- lesson 07: no DTensor UserWarnings from the loss scaler --------------------------------------
def _lesson07():
    spec = importlib.util.spec_from_file_location(
        "lesson07_trust", REPO / "lessons/07_mixed_precision/mixed_precision.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _WithLoss(torch.nn.Module):
    """What the lesson's step reads: ``model(**batch).loss``."""

    def __init__(self, net: torch.nn.Module):
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> types.SimpleNamespace:
        return types.SimpleNamespace(loss=self.net(x).float().sum())


def _fp16_steps(quiet: bool) -> list[str]:
    """Two fp16 steps of a sharded model through the lesson's ``scaled_step``; the DTensor
    warnings they raise. ``quiet``: with the filters every lesson run and notebook applies."""
    from torch.distributed.fsdp import fully_shard

    from utilities.precision import attach_scaler, fsdp2_policy, make_scaler

    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    fully_shard(net[0], mp_policy=fsdp2_policy("fp16"))
    fully_shard(net, mp_policy=fsdp2_policy("fp16"))
    model = _WithLoss(net)
    opt = torch.optim.AdamW(net.parameters())
    scaler = make_scaler("fp16", "cpu")
    step = _lesson07().scaled_step(scaler)
    attach_scaler(opt, scaler)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if quiet:
            from utilities.distributed import quiet_torch_internal_warnings

            quiet_torch_internal_warnings()
        for _ in range(2):
            step(model, {"x": torch.randn(2, 8)})
            opt.step()
            opt.zero_grad()
    return [str(w.message) for w in caught if "numel=1" in str(w.message)]


def test_lesson07_scaler_step_prints_no_dtensor_warning(world1):
    """ShardedGradScaler unscales FSDP2's DTensor gradients with [1]-shaped tensors: DTensor warns
    (the cause, reproduced without the course's filters); the filters a lesson run applies hide it,
    with no patch of the scaler in the lesson."""
    assert _fp16_steps(quiet=False)
    assert _fp16_steps(quiet=True) == []


# -- notebook 07: the plot says fp16-with-scaler's first step was skipped ---------------------------
def test_notebook07_plot_says_the_scaler_skipped_a_step(monkeypatch):
    import matplotlib
    import nbformat

    matplotlib.use("Agg")
    nb = nbformat.read(REPO / "lessons/07_mixed_precision/07_mixed_precision.ipynb", as_version=4)
    cell = next(c for c in nb.cells if "axes[1].bar(" in c.source)
    results = json.loads((T.lesson_dir("07") / "results_cpu.json").read_text())
    scope = {"results": results}
    import matplotlib.pyplot as plt

    monkeypatch.setattr(plt, "show", lambda *a, **k: None)
    exec(cell.source, scope)  # noqa: S102 - the notebook's own plotting cell
    labels = [t.get_text() for t in scope["axes"][1].get_xticklabels()]
    assert "fp16 (scaler):\nfirst step skipped" in labels
    assert any("not a real saving" in t.get_text() for t in scope["axes"][1].texts)
    plt.close("all")


def test_a_run_reproduces_the_readme_claims_within_the_peaks_timing_only():
    """Units, sizes, parameters and optimizer state must be equal; the peak's activations may
    differ by one short-lived tensor's timing (3%), not more."""
    from readme_claims import claim_differences, claims

    committed = claims("01", json.loads((T.lesson_dir("01") / "results_cpu.json").read_text()))
    ran = json.loads(json.dumps(committed))
    ran["fsdp2-per-block"]["peak"]["activations"] += 589_816  # seen under load: 1.5 logits
    assert claim_differences(ran, committed) == []
    ran["fsdp2-per-block"]["peak"]["activations"] += 10**6
    ran["fsdp2-one-unit"]["peak"]["optimizer"] += 4
    assert len(claim_differences(ran, committed)) == 2
