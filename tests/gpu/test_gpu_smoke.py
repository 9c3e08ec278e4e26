"""GPU smoke tests: run on an H100 / H200 (`pytest -m gpu tests/gpu -s`); skipped without CUDA.

The lesson claims come from ``tests/gpu_cases.py``, whose CPU twins run in the normal suite
(``tests/test_gpu_claims_on_cpu.py``), so a renamed variant or flag fails in CI, not here."""

from __future__ import annotations

import pytest
import torch
from gpu_cases import CASES

from utilities import Memory_Maximizer, bf16_ready

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_gpu_claim(case, tmp_path):
    from conftest import run_lesson

    r = run_lesson(case.lesson, tmp_path, *case.flags, nproc=1, device="cuda",
                   quick=case.gpu_quick, timeout=1200)
    print(case.id, [(v["name"], v.get("step_time_s"), (v.get("peak_memory_bytes") or {}).get("total"))
                    for v in r["variants"]])
    assert r["device"] == "cuda"
    case.check(r)
    if case.gpu_check is not None:
        case.gpu_check(r)


def test_memory_maximizer_reads_real_values():
    x = []
    with Memory_Maximizer() as mm:
        for _ in range(3):
            x.append(torch.empty(256 * 1024**2, dtype=torch.uint8, device="cuda"))
            mm.update()
    r = mm.summary()
    print(Memory_Maximizer.format(r))
    assert r["gpu"] and r["total_gb"] > 10 and r["max_reserved_gb"] >= 0.75
    assert len(r["reserved_gb"]) == 3 and r["reserved_gb"] == sorted(r["reserved_gb"])
    assert r["reserved_gb"][-1] - r["reserved_gb"][0] >= 0.5  # two more 256 MiB blocks
    assert r["cuda_malloc_retries"] == 0 and r["ooms"] == 0  # 768 MiB on a 80 GB GPU: no pressure


def test_bf16_ready_matches_the_compute_capability():
    report = bf16_ready()
    print(report)
    assert bool(report) == (torch.cuda.get_device_capability() >= (8, 0)), report.reasons
