"""Lesson 14's point: a plan made on fake tensors with a fake process group predicts the peak a real
run measures; it says when a configuration cannot fit and which category overflows; the largest
batch search returns a batch that fits while the next one does not; bad values are one line."""

from __future__ import annotations

import pytest
from conftest import cli_here, notebook_results, variant

from utilities.errors import UsageError
from utilities.measure.planner import largest_batch, parse_memory, plan


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return notebook_results("14", tmp_path_factory)  # the notebook runs `fsdp-course run 14 --quick`


def test_prediction_matches_the_measured_run_within_10_percent(results):
    assert results["lesson"] == "14" and results["world_size"] == 2
    v = variant(results, "full_shard-fp32")
    predicted, measured = v["predicted_peak_bytes"]["total"], v["peak_memory_bytes"]["total"]
    assert measured > 0 and predicted == pytest.approx(measured, rel=0.10)
    for other in results["variants"]:  # every configuration the lesson trains
        assert other["prediction_ratio"]["total"] == pytest.approx(1.0, abs=0.10), other["name"]


@pytest.mark.parametrize("name, strategy, shard_size", [
    ("fsdp2-reshard-true", "full_shard", None),
    ("fsdp2-reshard-false", "shard_grad_op", None),
    ("fsdp2-hsdp", "hybrid_shard", 1),  # lesson 06's (2, 1) mesh: shard groups of one rank
    ("ddp", "no_shard", None),
])
def test_every_strategy_matches_lesson_06s_measured_peak(tmp_path_factory, name, strategy, shard_size):
    """The planner against lesson 06's real 2-rank runs of each strategy (t5-tiny, fp32, same batch
    and sequence): within 10%, like the lesson's own check (measured: 0.3%-2.5%)."""
    measured_run = notebook_results("06", tmp_path_factory)
    s = measured_run["settings"]
    measured = variant(measured_run, name)["peak_memory_bytes"]["total"]
    p = plan(measured_run["model"]["name"], measured_run["world_size"], 10**12, strategy, "fp32",
             "none", s["batch_size"], s["seq_len"], "cpu", shard_size=shard_size)
    assert p.peak_bytes["total"] == pytest.approx(measured, rel=0.10), (name, p.peak_bytes, measured)


def test_hybrid_shard_holds_what_full_shard_over_one_group_holds():
    """HSDP's per-rank memory is FSDP's over its shard group: 4 GPUs in groups of 2 = 2 GPUs."""
    hsdp = plan("t5-tiny", 4, 10**12, "hybrid_shard", "fp32", "none", 2, 64, "cpu", shard_size=2)
    fsdp = plan("t5-tiny", 2, 10**12, "full_shard", "fp32", "none", 2, 64, "cpu")
    assert hsdp.peak_bytes == fsdp.peak_bytes and hsdp.shard_size == 2
    with pytest.raises(UsageError, match="--shard-size"):
        plan("t5-tiny", 4, 10**12, "hybrid_shard", shard_size=3)
    with pytest.raises(UsageError, match="--shard-size"):
        plan("t5-tiny", 4, 10**12, "full_shard", shard_size=2)


def test_impossible_configuration_names_the_overflowing_category():
    p = plan("llama-8b", gpus=1, gpu_memory_bytes=parse_memory("16GB"), strategy="full_shard",
             precision="fp32", ac="none", batch=1, seq=2048)
    assert not p.fits and p.overflowing == "optimizer"
    assert p.peak_bytes["total"] > p.budget_bytes


def test_largest_batch_fits_and_the_next_does_not():
    one = plan("llama-tiny", 2, 10**12, "full_shard", "fp32", "none", 1, 64, "cpu")
    two = plan("llama-tiny", 2, 10**12, "full_shard", "fp32", "none", 2, 64, "cpu")
    per_sample = two.peak_bytes["total"] - one.peak_bytes["total"]
    memory = int((one.peak_bytes["total"] + 2.5 * per_sample) / 0.9)  # room for about batch 3
    best, best_plan = largest_batch("llama-tiny", 2, memory, strategy="full_shard", precision="fp32",
                                    ac="none", seq=64, device_type="cpu")
    assert best >= 2 and best_plan.fits and best_plan.batch == best
    assert not plan("llama-tiny", 2, memory, "full_shard", "fp32", "none", best + 1, 64, "cpu").fits


def test_memory_sizes_parse():
    assert parse_memory("80GB") == 80 * 10**9
    assert parse_memory("80GiB") == 80 * 2**30
    assert parse_memory("24e9B") == 24 * 10**9
    with pytest.raises(UsageError, match="80XB"):
        parse_memory("80XB")


def test_bad_memory_value_is_one_line():
    proc = cli_here("plan", "--gpu-memory", "80XB")
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and proc.stderr.startswith("error:")
    assert "'80XB'" in proc.stderr


def test_the_documented_command_plans_llama_8b_on_a_laptop():
    """The documented command, as a user types it: a per-category breakdown and a verdict (the
    plan `fsdp-course run 14` records without --quick; the quick run plans no big model)."""
    import json

    proc = cli_here("plan", "--model", "llama-8b", "--gpus", "8", "--gpu-memory", "80GB", "--strategy",
                    "full_shard", "--precision", "bf16", "--ac", "full", "--batch", "2", "--seq", "8192",
                    "--json")
    assert proc.returncode == 0, proc.stderr
    p = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert p["fits"] is True and p["gpus"] == 8 and p["batch"] == 2 and p["seq"] == 8192
    peak = p["peak_bytes"]
    assert set(peak) >= {"parameters", "gradients", "optimizer", "activations", "total"}
    # fp32 AdamW moments of an 8B model, sharded 8 ways: 2 x 4 bytes x 8.03e9 / 8
    assert peak["optimizer"] == pytest.approx(2 * 4 * 8_030_261_248 / 8, rel=0.01)
    assert peak["total"] < p["budget_bytes"]


def test_readme_table_is_reproduced_by_the_quick_run(results):
    """The README's results table is rendered from results_cpu.json, the lesson's own `fsdp-course
    run 14 --quick`; this quick run reproduces what it claims (the planned and measured peak by category)."""
    from conftest import assert_readme_table_is_reproduced

    assert_readme_table_is_reproduced("14", results)
