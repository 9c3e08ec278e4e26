"""Every lesson on one GPU (`pytest -m gpu tests/gpu -s`): the quick configuration through NCCL and
CUDA, the same code path as on CPU. Skipped without CUDA. What each lesson claims at GPU size is
measured by `fsdp-course run NN` and the benchmarks (benchmarks/README.md)."""

from __future__ import annotations

import pytest
import torch

from utilities.course.catalog import LESSONS

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("number", [n for n, info in LESSONS.items() if info.ready])
def test_lesson_quick_on_one_gpu(number, tmp_path):
    from conftest import run_lesson

    r = run_lesson(number, tmp_path, nproc=1, device="cuda", quick=True)
    print(number, [(v["name"], v.get("step_time_s"), (v.get("peak_memory_bytes") or {}).get("total"))
                   for v in r["variants"]])
    assert r["device"] == "cuda" and r["device_name"] == torch.cuda.get_device_name()
    assert r["variants"], "no variant ran"
    for v in r["variants"]:
        losses = v.get("losses") or []
        assert all(torch.isfinite(torch.tensor(losses))), v["name"]
