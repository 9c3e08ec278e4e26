"""The CPU twin of every GPU claim in ``tests/gpu_cases.py``.

Each twin (1) parses the GPU test's exact flags with the lesson's own parser, so a renamed flag or
variant fails here, and (2) asserts the claim's hardware-independent part on the lesson's CPU run
(2 gloo ranks, tiny model, through ``fsdp-course run NN --quick``: the run the lesson's notebook
makes, shared with the lesson's own tests, so the twins cost no extra run). The variants the GPU
test names are all in that run."""

from __future__ import annotations

import pytest
from conftest import lesson_module, notebook_results
from gpu_cases import CASES


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_gpu_flags_parse_with_the_lessons_parser(case):
    args = lesson_module(case.lesson).parse_args(list(case.flags))
    chosen = getattr(args, "variants", None) or getattr(args, "policies", None)
    if chosen is not None and isinstance(chosen, list):
        assert chosen, case.id


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_gpu_claim_holds_on_the_cpu_run(case, tmp_path_factory):
    case.check(notebook_results(case.lesson, tmp_path_factory))
