"""Lesson 11 (rate limiter): limit_all_gathers changes scheduling, never the losses."""

from __future__ import annotations

import pytest
from conftest import (
    assert_prediction_is_the_readmes,
    assert_same_losses,
    flag_error,
    notebook_results,
    variant,
)

LOSS_ATOL = 1e-5  # the same arithmetic in every variant; only the issue order of gathers differs


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return notebook_results("11", tmp_path_factory)  # the notebook runs `fsdp-course run 11 --quick`


def test_all_three_variants(results):
    assert [v["name"] for v in results["variants"]] == ["fsdp1-limit-all-gathers", "fsdp1-unlimited",
                                                        "fsdp2"]
    assert variant(results, "fsdp1-limit-all-gathers")["limit_all_gathers"] is True
    assert variant(results, "fsdp1-unlimited")["limit_all_gathers"] is False
    for v in results["variants"]:
        assert v["step_time_s"] > 0 and v["peak_memory_bytes"]["total"] > 0, v["name"]
        assert "gpu" in v["memory_maximizer"], v["name"]


def test_rate_limit_never_changes_the_losses(results):
    assert_same_losses(results, "fsdp1-limit-all-gathers", LOSS_ATOL)


def test_cpu_run_says_the_effect_is_gpu_only(results):
    if results["device"] != "cpu":
        pytest.skip("CPU-only statement")
    assert all(v["memory_maximizer"]["gpu"] is False for v in results["variants"])
    assert any("caching allocator" in n for n in results["notes"])


def test_bad_variant_is_one_line_exit_2():
    line = flag_error("11", "--variants", "fsdp1-limitless")
    assert "fsdp1-limitless" in line and "fsdp1-unlimited" in line


def test_the_prediction_on_a_cluster_is_the_readmes(results):
    """results.json carries the step-time model's prediction for every variant (labelled as one),
    the same numbers the README renders from predicted_2x8xh100.json."""
    predicted = results["predicted"]
    assert "PREDICTED" in predicted["what"] and predicted["gpus"] == 16
    assert_prediction_is_the_readmes("11", results, "predicted_2x8xh100.json")


def test_readme_table_is_reproduced_by_the_quick_run(results):
    """The README's results table is rendered from results_cpu.json, the lesson's own `fsdp-course run
    11 --quick`; this quick run reproduces what it claims (the limiter setting, memory at the peak,
    losses)."""
    from conftest import assert_readme_table_is_reproduced

    assert_readme_table_is_reproduced("11", results)
