"""Lesson 15: each FSDP failure's mistake still shows its measured symptom, and its fix removes it
(a torch release that fixes or changes a failure fails here, and the README must follow)."""

from __future__ import annotations

import pytest
from conftest import assert_documented_keys, assert_help_lists, flag_error, notebook_results, variant

PAIRS = ("optimizer-before-shard", "bf16-weights", "grad-accumulation", "tied-weights",
         "meta-init-buffers", "frozen-fsdp1", "reshard-after-forward", "skipped-collective",
         "hand-clipping", "optimizer-state", "non-forward-method", "memory-vs-rss", "rank-seeds",
         "bf16-reduce")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return notebook_results("15", tmp_path_factory)  # the notebook runs `fsdp-course run 15 --quick`


def test_results_have_the_documented_keys(results):
    assert_documented_keys(results, "15")
    assert [v["name"] for v in results["variants"]] == list(PAIRS)


@pytest.mark.parametrize("name", PAIRS)
def test_the_mistake_shows_its_symptom_and_the_fix_removes_it(results, name):
    v = variant(results, name)
    assert v["symptom_shown"] is True, v
    assert v["fix_works"] is True, v


def test_an_optimizer_built_before_sharding_never_moves_the_model(results):
    v = variant(results, "optimizer-before-shard")
    losses = v["mistake_losses"]  # 4 batches in turn: the same batch, the same weights, the same loss
    assert len(losses) > 4 and losses[4:] == losses[: len(losses) - 4]
    assert v["fix_losses"][-1] < v["fix_losses"][0] - 0.3


def test_bf16_weights_lose_updates_that_fp32_weights_keep(results):
    v = variant(results, "bf16-weights")
    assert (v["mistake_param_dtype"], v["fix_param_dtype"]) == ("bfloat16", "float32")
    assert v["mistake_unchanged_fraction"] > 0.3 and v["fix_unchanged_fraction"] < 0.05
    assert v["mistake_final_loss"] > 1.25 * v["fix_final_loss"]


def test_no_sync_holds_unsharded_gradients_and_syncing_costs_reduce_scatters(results):
    v = variant(results, "grad-accumulation")
    assert v["mistake_peak_gradient_bytes"] == v["unsharded_gradient_bytes"]
    assert v["fix_peak_gradient_bytes"] * 2 == v["unsharded_gradient_bytes"]  # sharded over 2 ranks
    assert v["fix_reduce_scatters"] == v["micro_batches"] * v["mistake_reduce_scatters"]
    assert v["same_update_max_abs_diff"] < 1e-5


def test_the_hang_ends_at_the_timeout_and_detail_names_both_collectives(results):
    v = variant(results, "skipped-collective")
    assert v["mistake_seconds"] >= 0.8 * v["timeout_s"] and v["mistake_error_rank0"]
    assert "_ALLGATHER_BASE" in v["detail_names"] and "ALLREDUCE" in v["detail_names"]
    assert v["detail_seconds"] < v["timeout_s"] / 2
    assert v["fix_error_rank0"] is None


def test_hand_clipping_sees_a_shard_and_each_rank_another(results):
    v = variant(results, "hand-clipping")
    a, b = v["mistake_norms_per_rank"]
    assert a != b and max(a, b) < v["reference_norm"]
    assert v["fsdp1_plain_max_rel_error"] > 0.05 and v["fsdp1_method_max_rel_error"] < 1e-4


def test_the_fixed_resume_is_exact(results):
    v = variant(results, "optimizer-state")
    assert v["fix_max_abs_loss_diff"] == 0.0
    assert v["mistake_error"] is not None or v["mistake_max_abs_loss_diff"] > 1e-4


def test_memory_shows_the_plans_reserved_beside_allocated(results):
    """Mistake 12 reports what nvidia-smi / an OOM would: the step replayed through plan's caching
    allocator model, whose reserved peak is whole segments (multiples of 2 MiB) above the rounded
    allocated peak, itself at least the tracker's."""
    v = variant(results, "memory-vs-rss")
    assert v["tracker_peak_bytes"] <= v["allocator_allocated_bytes"] < v["allocator_reserved_bytes"]
    assert v["allocator_reserved_bytes"] % (2 << 20) == 0
    assert v["reserved_to_allocated_ratio"] > 1
    assert "reserved" in v["fix"]


def test_ranks_seeded_apart_train_a_mix_the_check_names_before_sharding(results):
    v = variant(results, "rank-seeds")
    assert 0 < v["mistake_tensors_as_a_rank_built"] < v["tensors"]  # only what every seed builds alike
    assert v["mistake_max_abs_diff_from_nearest_build"] > 0.1
    assert v["mistake_doctor"].startswith("rank-divergent-build: ") and v["fix_doctor"] is None
    assert v["fix_tensors_as_a_rank_built"] == v["tensors"] and v["fix_max_abs_diff_from_nearest_build"] == 0


def test_the_doctor_names_the_method_that_fails_before_it_is_called(results):
    v = variant(results, "non-forward-method")
    assert v["mistake_error"] and "model.generate" in v["mistake_doctor"] and "embed" in v["mistake_doctor"]
    assert v["fix_error"] is None and v["fix_doctor"] is None


def test_a_bf16_reduction_is_measured_and_reported(results):
    v = variant(results, "bf16-reduce")
    assert (v["mistake_reduce_dtypes"], v["fix_reduce_dtypes"]) == (["bfloat16"], ["float32"])
    assert 1e-4 < v["mistake_grad_rel_error"] < 0.05  # bf16's rounding, not a wrong gradient
    assert v["mistake_doctor"].startswith("low-precision-reduce: ") and v["fix_doctor"] is None


def test_the_header_and_no_warning_of_the_lessons_own(world1, tmp_path, capsys):
    """One rank in this process: the tied-weights pair reads a gap off tensors that require grad,
    and frozen-fsdp1 makes FSDP1 warn once per mixed unit; neither reaches the output."""
    import warnings

    from conftest import lesson_module

    lesson = lesson_module("15")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lesson.main(lesson.parse_args(["--device", "cpu", "--quick", "--out", str(tmp_path),
                                       "--variants", "tied-weights,frozen-fsdp1"]))
    out = " ".join(capsys.readouterr().out.split())
    header = out[out.index("lesson 15 ("):]
    assert "each failure at the steps and batches its row needs" in header[:300]
    assert "steps, batch" not in out
    said = [f"{w.filename}: {w.message}" for w in caught
            if w.filename == lesson.__file__ or "requires_grad=True and False" in str(w.message)]
    assert said == []


def test_readme_table_is_reproduced_by_the_quick_run(results):
    from conftest import assert_readme_table_is_reproduced

    assert_readme_table_is_reproduced("15", results)


def test_bad_flags_are_one_line():
    assert "--hang-timeout" in flag_error("15", "--hang-timeout", "0")
    assert "--variants" in flag_error("15", "--variants", "no-such-failure")


def test_lesson_help_explains_every_flag():
    assert_help_lists("15", ("--variants", "--bf16-steps", "--bf16-lr", "--micro-batches",
                             "--hang-timeout", "--fail-steps"))


def test_the_readmes_8b_reserved_figures_are_the_committed_check():
    """The README's 8B reserved-vs-allocated example quotes benchmarks/results/plan_options_check.json
    (its torchtitan row at 8 GPUs), so a re-made check cannot leave the prose behind."""
    import json
    import re

    from conftest import REPO

    rows = json.loads((REPO / "benchmarks/results/plan_options_check.json").read_text())["rows"]
    row = next(r for r in rows if "planned_reserved_8_GiB" in r)
    text = (REPO / "lessons/15_when_fsdp_goes_wrong/README.md").read_text()
    said = re.search(r"Llama 3.1 8B: ([\d.]+) GiB reserved planned vs ([\d.]+) allocated", text)
    assert said, "the README's 8B example moved: update this test"
    assert float(said.group(1)) == pytest.approx(row["planned_reserved_8_GiB"], abs=0.01)
    assert float(said.group(2)) == pytest.approx(row["planned_allocated_8_GiB"], abs=0.01)
