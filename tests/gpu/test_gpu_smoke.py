"""GPU smoke tests: run on an H100 / H200 (`pytest -m gpu tests/gpu -s`); skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from utilities import Memory_Maximizer, bf16_ready

pytestmark = pytest.mark.gpu


def test_memory_maximizer_reads_real_values():
    x = []
    with Memory_Maximizer() as mm:
        for _ in range(3):
            x.append(torch.empty(256 * 1024**2, dtype=torch.uint8, device="cuda"))
            mm.update()
    r = mm.summary()
    print(Memory_Maximizer.format(r))
    assert r["gpu"] and r["total_gb"] > 10 and r["max_reserved_gb"] >= 0.75
    assert r["reserved_gb"] == sorted(r["reserved_gb"]) and r["cuda_malloc_retries"] >= 0


def test_bf16_ready_on_hopper():
    report = bf16_ready()
    print(report)
    name = torch.cuda.get_device_name()
    if "H100" in name or "H200" in name:
        assert report, report.reasons


def test_lesson_01_runs_on_one_gpu(tmp_path):
    from conftest import run_lesson

    r = run_lesson("01", tmp_path, "--variants", "fsdp2-one-unit,fsdp2-per-block,fsdp1-per-block",
                   "--steps", "6", nproc=1, device="cuda", quick=False)
    print(r["model"], [(v["name"], v["step_time_s"], v["peak_memory_bytes"]["total"]) for v in r["variants"]])
    assert r["device"] == "cuda" and r["variants"][0]["mfu"] is not None
