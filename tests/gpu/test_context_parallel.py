"""Lesson 17 on two GPUs (`pytest -m gpu tests/gpu -s`): torch's own ``context_parallel`` as a user
calls it, one rank per GPU over NCCL, equal to SDPA on the whole sequence, beside the lesson's ring.
The same flags and variant names run on the CPU in the normal suite (the catalog's
``17-context-parallel`` claim's twin, on the lesson's quick run). Skipped without two GPUs; one GPU runs the
``gpu_cases`` case (a ring of one)."""

from __future__ import annotations

import pytest
import torch
from conftest import run_lesson, variant
from gpu_cases import TORCH_CP_TOLERANCE, _context_parallel

from utilities.course.catalog import CP_VARIANTS

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs: one rank each, over NCCL")
def test_torch_context_parallel_over_two_gpus_equals_unsplit_attention(tmp_path):
    r = run_lesson("17", tmp_path, "--variants", ",".join(CP_VARIANTS), "--steps", "4", nproc=2,
                   device="cuda", quick=True, timeout=1200)
    assert r["device"] == "cuda" and r["world_size"] == 2
    _context_parallel(r)
    torch_cp = variant(r, "torch-cp")
    print(f"torch-cp over 2 GPUs: max |diff| {torch_cp['max_abs_diff']:.1e}; ring-balanced "
          f"{variant(r, 'ring-balanced')['max_abs_diff']:.1e}")
    assert torch_cp["max_abs_diff"] < TORCH_CP_TOLERANCE
    assert variant(r, "ring-balanced")["score_blocks_per_rank"] == [5, 5]
