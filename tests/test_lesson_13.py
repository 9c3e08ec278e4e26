"""Lesson 13's points: per-block torch.compile changes the speed, not the numbers; FP8 is skipped
with its reason where it cannot run; the float8 filter converts only Linear layers whose dims are
multiples of 16 (and never the lm_head or embeddings)."""

from __future__ import annotations

import pytest
from conftest import REPO, cli, notebook_results, variant
from torch import nn

from utilities.low_precision import (
    compile_blocks,
    float8_module_filter,
    fp8_available,
    fp8_linear_names,
)
from utilities.models import get_model_spec

# bf16 compute on CPU (the "bf16 eager / compiled part"): inductor fuses ops and keeps some
# intermediates in fp32 where eager rounds them to bf16, so after 6 AdamW steps the losses differ by
# ~3e-4 (measured: 2.9e-4); 2e-3 leaves room for other CPUs. In fp32 they agree to ~3e-7.
COMPILE_LOSS_TOLERANCE = 2e-3


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return notebook_results("13", tmp_path_factory)  # the notebook runs `fsdp-course run 13 --quick`


def test_results_have_the_documented_keys(results):
    assert results["lesson"] == "13" and results["device"] == "cpu" and results["world_size"] == 2
    assert results["settings"]["precision"] == "bf16"
    assert [v["name"] for v in results["variants"]] == ["eager", "compiled"]
    for v in results["variants"]:
        assert v["step_time_s"] > 0 and v["tokens_per_s"] > 0 and v["first_step_s"] > 0
        assert v["peak_memory_bytes"]["total"] > 0


def test_compiled_and_eager_give_the_same_losses(results):
    eager, compiled = variant(results, "eager"), variant(results, "compiled")
    assert len(eager["losses"]) == len(compiled["losses"]) == results["settings"]["steps"]
    assert compiled["losses"] == pytest.approx(eager["losses"], abs=COMPILE_LOSS_TOLERANCE)
    assert eager["losses"][-1] < eager["losses"][0] - 1.0  # and the task is being learned


def test_compile_time_is_reported_apart(results):
    compiled = variant(results, "compiled")
    assert compiled["compiled_blocks"] == 4  # llama-tiny: one compiled graph per decoder block
    # The first step carries the compilation; the timed (median) steps do not.
    assert compiled["first_step_s"] > compiled["step_time_s"]
    assert compiled["compile_s"] == pytest.approx(
        compiled["first_step_s"] - variant(results, "eager")["first_step_s"], abs=1e-2)


def test_fp8_is_skipped_with_its_reason(results):
    ok, reason = fp8_available("cpu")
    assert not ok and reason and "\n" not in reason
    assert results["skipped"]["fp8-compiled"] == reason
    assert any(n.startswith("fp8-compiled skipped: ") for n in results["notes"])


def test_fp8_filter_converts_only_dims_multiple_of_16():
    model = nn.Sequential()
    model.add_module("embed_tokens", nn.Embedding(384, 128))
    model.add_module("q_proj", nn.Linear(128, 128))      # converted
    model.add_module("odd_in", nn.Linear(100, 128))      # 100 % 16 != 0
    model.add_module("odd_out", nn.Linear(128, 24))      # 24 % 16 != 0
    model.add_module("up_proj", nn.Linear(128, 352))     # 352 = 22 * 16: converted
    model.add_module("lm_head", nn.Linear(128, 384))     # multiple of 16, but skipped by name
    model.add_module("norm", nn.LayerNorm(128))
    assert fp8_linear_names(model) == ["q_proj", "up_proj"]
    assert fp8_linear_names(model, float8_module_filter(min_multiple=4)) == \
        ["q_proj", "odd_in", "odd_out", "up_proj"]


def test_fp8_filter_on_llama_tiny():
    model = get_model_spec("llama-tiny").build(device="meta")
    names = fp8_linear_names(model)
    # 4 blocks x (q, k, v, o, gate, up, down); hidden 128, kv 64, ffn 352: all multiples of 16
    assert len(names) == 28 and all(n.startswith("model.layers.") for n in names)
    assert "lm_head" not in names


def test_compile_blocks_keeps_parameter_names():
    spec = get_model_spec("llama-tiny")
    model = spec.build(device="meta")
    before = [n for n, _ in model.named_parameters()]
    assert compile_blocks(model, spec.block_class()) == 4  # lazy: nothing compiles until called
    assert [n for n, _ in model.named_parameters()] == before  # no "_orig_mod." in checkpoints


def test_bad_hidden_is_one_line_exit_2():
    proc = cli("run", "13", "--quick", "--", "--hidden", "100")
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and proc.stderr.startswith("error:")
    assert "100" in proc.stderr and "multiples of 64" in proc.stderr


def test_bad_variant_is_one_line_exit_2():
    proc = cli("run", "13", "--quick", "--", "--variants", "fp4-compiled")
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "fp8-compiled" in proc.stderr


def test_lesson_help_explains_every_flag():
    proc = cli("run", "13", "--", "--help")
    assert proc.returncode == 0
    for flag in ("--variants", "--hidden", "--layers", "--precision", "--quick", "--steps"):
        assert flag in proc.stdout
    assert (REPO / "lessons/13_fp8_compile/README.md").is_file()
