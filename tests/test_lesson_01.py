"""Lesson 01's point: one FSDP unit per transformer block keeps fewer parameters unsharded at once."""

from __future__ import annotations

import pytest
from conftest import assert_documented_keys, assert_help_lists, cli, notebook_results, variant


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return notebook_results("01", tmp_path_factory)  # the notebook runs `fsdp-course run 01 --quick`


def test_results_have_the_documented_keys(results):
    assert_documented_keys(results, "01")
    assert results["model"]["parameters"] == 1_887_232
    for v in results["variants"]:
        assert v["step_time_s"] > 0 and v["tokens_per_s"] > 0 and v["mfu"] is None
        mem = v["peak_memory_bytes"]
        assert set(mem) >= {"total", "parameters", "gradients", "optimizer", "activations"}


@pytest.mark.parametrize("api", ["fsdp2", "fsdp1"])
def test_both_wrappings_train(results, api):
    for policy in ("one-unit", "per-block"):
        losses = variant(results, f"{api}-{policy}")["losses"]
        assert losses[-1] < losses[0] - 1.0, losses  # the reversal task is being learned


@pytest.mark.parametrize("api", ["fsdp2", "fsdp1"])
def test_per_block_gathers_less_than_one_unit(results, api):
    one, per_block = variant(results, f"{api}-one-unit"), variant(results, f"{api}-per-block")
    assert one["fsdp_units"] == 1
    assert per_block["fsdp_units"] == 9  # 8 T5 blocks + the root
    # One unit gathers all 1.89M parameters (fp32) at once; per block, far less is ever unsharded.
    assert one["peak_unsharded_parameter_bytes"] == 4 * 1_887_232
    assert per_block["peak_unsharded_parameter_bytes"] < 0.4 * one["peak_unsharded_parameter_bytes"]
    assert per_block["peak_memory_bytes"]["total"] < one["peak_memory_bytes"]["total"]


def test_wrapping_never_changes_the_numbers(results):
    reference = variant(results, "fsdp2-one-unit")["losses"]
    for v in results["variants"]:
        assert v["losses"] == pytest.approx(reference, abs=5e-3), v["name"]


def test_bad_variant_is_one_line_exit_2():
    proc = cli("run", "01", "--quick", "--", "--variants", "fsdp3-per-block")
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0
    assert "fsdp3-per-block" in proc.stderr and "fsdp2-per-block" in proc.stderr


def test_lesson_help_explains_every_flag():
    assert_help_lists("01", ("--variants", "--min-params", "--model", "--device", "--quick", "--steps"))


def test_readme_table_is_reproduced_by_the_quick_run(results):
    """The README's table is rendered from results_cpu.json, the lesson's own `fsdp-course run 01`
    (tests/test_readme_tables.py checks the rendering). The quick run must reproduce what that
    table claims about wrapping and memory, exactly: units, largest unit, unsharded parameters and
    the peak by category."""
    from conftest import assert_readme_table_is_reproduced

    assert_readme_table_is_reproduced("01", results)


def test_the_learners_policy_reaches_the_measured_run(results):
    """The notebook's is_unit picks T5Block; its classes travel as --unit-classes, and the 2-rank
    run's fsdp2-yours has the units the one-rank cell counted (8 blocks + the root)."""
    yours = variant(results, "fsdp2-yours")
    assert yours["policy"] == "yours" and yours["fsdp_units"] == 9
    assert yours["peak_unsharded_parameter_bytes"] == variant(results, "fsdp2-per-block")[
        "peak_unsharded_parameter_bytes"]
