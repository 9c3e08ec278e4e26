"""The GPU memory a plan is for: the names and sizes a user gives, this GPU's own (else an
H100's), and the plan's report of it and of the autograd temporaries. No plan is simulated."""

from __future__ import annotations

import argparse

import pytest
import torch

from utilities.errors import UsageError
from utilities.measure import plan_cli
from utilities.measure import planner as P


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
