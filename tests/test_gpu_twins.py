"""The CPU twin of every GPU claim in ``tests/gpu_cases.py``: the same lesson, variant names and
flags, on 2 gloo ranks with the tiny model, checking what holds on any hardware. When a lesson
renames a variant or a flag, this fails in CI instead of on the next GPU machine."""

from __future__ import annotations

import pytest
from conftest import run_lesson
from gpu_cases import CASES, cpu_flags


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_gpu_claim_cpu_twin(case, tmp_path):
    r = run_lesson(case.lesson, tmp_path, *cpu_flags(case), device="cpu", quick=True)
    case.check(r)
