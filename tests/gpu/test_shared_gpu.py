"""Several ranks on one GPU: sharding shown with the allocator's own numbers.

Each test launches a lesson through ``fsdp-course run NN --device cuda --nproc N`` so that N ranks
share GPU 0 over gloo, and asserts the lesson's point there. The lesson flags and variant names are
``SHARED_GPU_RUNS`` in tests/gpu_cases.py, whose CPU twins check the same launch (the
decision, backend, refusal and flags) in the normal suite. Skipped without CUDA (marker gpu).
"""

from __future__ import annotations

import sys

import pytest
import torch
from conftest import REPO, run_lesson, variant
from gpu_cases import SHARED_GPU_RUNS, lesson_of

sys.path.insert(0, str(REPO / "lessons" / "06_sharding_strategies"))  # lesson 06's formulas

pytestmark = pytest.mark.gpu


def _run(key: str, tmp_path) -> dict:
    nproc, flags = SHARED_GPU_RUNS[key]
    r = run_lesson(lesson_of(key), tmp_path / key, *flags, nproc=nproc, device="cuda", quick=False)
    assert r["device"] == "cuda" and r["world_size"] == nproc
    s = r["settings"]
    if nproc > torch.cuda.device_count():
        assert s["backend"] == "cpu:gloo,cuda:gloo", s
        assert s["ranks_per_gpu"] >= 2, s
        assert any("step times host-staged: not comparable" in n for n in r["notes"]), r["notes"]
    for v in r["variants"]:
        mem = v.get("peak_memory_bytes") or {}
        if mem:
            assert mem["detail"].get("total_from") == "torch.cuda.max_memory_allocated", v["name"]
    return r


@pytest.mark.parametrize("key", ["06", "06x4"])
def test_lesson_06_full_shard_bytes_per_rank_equal_theory(key, tmp_path):
    """Parameters, gradients and optimizer state each rank keeps: 1/N of the model's, within 2%
    (N = 2: half; N = 4: a quarter)."""
    import sharding as S

    r = _run(key, tmp_path)
    world = r["world_size"]
    n = r["model"]["parameters"]
    theory = S.bytes_per_param("full_shard", world)
    for v in r["variants"]:
        resident = v["resident_bytes"]
        for cat in ("parameters", "gradients", "optimizer"):
            expected = getattr(theory, cat) * n
            assert resident[cat] == pytest.approx(expected, rel=0.02), (v["name"], cat, world)
        print(key, v["name"], {c: resident[c] for c in resident},
              "max_memory_allocated", v["peak_memory_bytes"]["total"])


def test_lesson_01_per_block_unsharded_peak_below_one_unit(tmp_path):
    """What auto-wrap buys: per block, only a block's parameters are gathered at the peak."""
    r = _run("01", tmp_path)
    for api in ("fsdp2", "fsdp1"):
        one = variant(r, f"{api}-one-unit")["peak_unsharded_parameter_bytes"]
        per_block = variant(r, f"{api}-per-block")["peak_unsharded_parameter_bytes"]
        print(api, "unsharded at peak: one unit", one, "per block", per_block)
        assert one is not None and per_block is not None, "the tracker did not run on GPU"
        assert per_block < one, (api, per_block, one)


def test_lesson_14_plan_within_10_percent_of_the_allocator_peak(tmp_path):
    """The planner at 2 ranks against ``torch.cuda.max_memory_allocated`` of each real rank."""
    r = _run("14", tmp_path)
    v = variant(r, "full_shard-fp32")
    predicted, measured = v["predicted_peak_bytes"]["total"], v["peak_memory_bytes"]["total"]
    print("planned", predicted, "max_memory_allocated", measured, "ratio", predicted / measured)
    assert predicted == pytest.approx(measured, rel=0.10)
