"""Lesson 13 on one GPU (`pytest -m gpu tests/gpu/test_fp8_smoke.py -s`): the fp8-compiled variant
runs where torchao and an sm_89+ GPU are present, and is skipped with its reason otherwise; FP8 pays
at hidden 4096 (a whole step on one GPU, by at least FP8_STEP_GAIN_AT_4096), and the lesson reports
where it starts to pay.

The flags and variant names live in the constants below: tests/test_lesson_13.py (the CPU twins)
imports them, runs the same code path with the same flags on a tiny model with --device cpu, and
checks the names, so a rename here or in the lesson fails on CPU too."""

from __future__ import annotations

import pytest
import torch

from utilities.fp8 import fp8_available

pytestmark = pytest.mark.gpu

# hidden 1024, 2 layers, seq 1024: FP8 runs and learns (on an H100 it is slower than compiled bf16)
SMOKE_FLAGS = ("--hidden", "1024", "--layers", "2", "--steps", "8", "--seq-len", "1024")
SMOKE_VARIANTS = ("eager-h1024", "compiled-h1024", "fp8-compiled-h1024")
# hidden 1024 and 4096, 4 layers: FP8 pays at 4096, and the crossover lies at or below it
PAYS_FLAGS = ("--hidden", "1024,4096", "--layers", "4", "--steps", "14", "--variants",
              "compiled,fp8-compiled")
PAYS_VARIANTS = ("compiled-h1024", "fp8-compiled-h1024", "compiled-h4096", "fp8-compiled-h4096")
# What one GPU can claim for a whole training step at hidden 4096: FP8 pays, by a margin above
# timing noise. Not the published +25%: that is Llama 3 8B on 8 GPUs, where float8 all-gathers also
# halve the communication; on one rank there is none, and attention (SDPA in bf16), the norms, the
# loss and AdamW's step are the same work in both.
FP8_STEP_GAIN_AT_4096 = 1.05


def test_fp8_compiled_runs_on_one_gpu(tmp_path):
    from conftest import run_lesson, variant

    ok, reason = fp8_available("cuda")
    if not ok:
        pytest.skip(reason)
    r = run_lesson("13", tmp_path, *SMOKE_FLAGS, nproc=1, device="cuda", quick=False)
    for v in r["variants"]:
        print(v["name"], v["tokens_per_s"], v["peak_memory_bytes"]["total"], v.get("compile_s"))
    assert [v["name"] for v in r["variants"]] == list(SMOKE_VARIANTS)
    fp8 = variant(r, "fp8-compiled-h1024")
    bf16 = variant(r, "compiled-h1024")
    assert fp8["fp8_linears"] == 2 * 7 and fp8["tokens_per_s"] > 0
    assert all(torch.isfinite(torch.tensor(fp8["losses"])))
    assert fp8["losses"][-1] < fp8["losses"][0]
    # float8 rounds far more coarsely than bf16, but the curves stay close on a short run
    assert fp8["losses"][-1] == pytest.approx(bf16["losses"][-1], rel=0.1)


def test_fp8_pays_at_hidden_4096(tmp_path):
    """The lesson's claim on one H100: a whole fp8-compiled step at hidden 4096 gives at least
    ``FP8_STEP_GAIN_AT_4096`` times the tokens/s of a compiled bf16 one (FP8 pays there; how much is
    measured, not promised), so the measured crossover (fp8_crossover_hidden) exists and is at most
    4096."""
    from conftest import run_lesson, variant

    ok, reason = fp8_available("cuda")
    if not ok:
        pytest.skip(reason)
    r = run_lesson("13", tmp_path, *PAYS_FLAGS, nproc=1, device="cuda", quick=False, timeout=1800)
    assert [v["name"] for v in r["variants"]] == list(PAYS_VARIANTS)
    bf16, fp8 = variant(r, "compiled-h4096"), variant(r, "fp8-compiled-h4096")
    ratio = fp8["tokens_per_s"] / bf16["tokens_per_s"]
    print(f"fp8 / bf16 compiled tokens/s: {r['fp8_crossover']['ratios']}; crossover "
          f"{r['fp8_crossover_hidden']} ({r['fp8_crossover']['why']})")
    assert ratio >= FP8_STEP_GAIN_AT_4096
    assert r["fp8_crossover_hidden"] is not None and r["fp8_crossover_hidden"] <= 4096
