"""Lesson 06's point: each strategy keeps the bytes per rank its formula says, and trains the same."""

from __future__ import annotations

import sys

import pytest
from conftest import REPO, assert_prediction_is_the_readmes, flag_error, notebook_results, variant

from utilities.errors import UsageError

sys.path.insert(0, str(REPO / "lessons" / "06_sharding_strategies"))  # the lesson's own formulas

P = 1_887_232  # t5-tiny
SHARDED = ("fsdp1-full-shard", "fsdp1-shard-grad-op", "fsdp2-reshard-true", "fsdp2-reshard-false")
REPLICATED = ("ddp", "fsdp1-no-shard", "fsdp1-hybrid-shard", "fsdp2-hsdp")  # HSDP mesh 2 x 1


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return notebook_results("06", tmp_path_factory)  # the notebook runs `fsdp-course run 06 --quick`


def test_results_have_the_lesson_keys(results):
    assert results["lesson"] == "06" and results["world_size"] == 2
    assert results["model"]["parameters"] == P
    assert {v["name"] for v in results["variants"]} == set(SHARDED + REPLICATED)
    assert "capacity" in results and results["capacity"]["gpus"] == 8
    # no non-trivial divisor of 2: the int reshard_after_forward variant is skipped, with a reason
    assert any("fsdp2-reshard-int skipped" in n for n in results["notes"])


@pytest.mark.parametrize("name", SHARDED + REPLICATED)
def test_resident_bytes_match_theory(results, name):
    v = variant(results, name)
    for cat in ("parameters", "gradients", "optimizer"):
        measured, theory = v["resident_bytes"][cat], v["theory_resident_bytes"][cat]
        assert measured == pytest.approx(theory, rel=0.05), (cat, measured, theory)


def test_fully_sharded_holds_half_of_ddp(results):
    ddp = variant(results, "ddp")["resident_bytes"]
    assert ddp["parameters"] == 4 * P and ddp["optimizer"] == pytest.approx(8 * P, rel=0.01)
    for name in SHARDED:
        r = variant(results, name)["resident_bytes"]
        for cat in ("parameters", "gradients", "optimizer"):
            assert r[cat] == pytest.approx(ddp[cat] / 2, rel=0.05), (name, cat)
    for name in REPLICATED:
        assert variant(results, name)["resident_bytes"]["parameters"] == 4 * P, name


@pytest.mark.parametrize("api", ["fsdp1", "fsdp2"])
def test_shard_grad_op_keeps_every_full_parameter_until_backward(results, api):
    sgo = variant(results, f"{api}-shard-grad-op" if api == "fsdp1" else "fsdp2-reshard-false")
    fs = variant(results, f"{api}-full-shard" if api == "fsdp1" else "fsdp2-reshard-true")
    assert sgo["peak_unsharded_parameter_bytes"] == 4 * P
    assert fs["peak_unsharded_parameter_bytes"] < 0.4 * 4 * P
    assert fs["peak_memory_bytes"]["total"] < sgo["peak_memory_bytes"]["total"]


def test_communication_volume_per_step(results):
    comm = {v["name"]: v["comm_bytes_per_step"] for v in results["variants"]}
    # 2 ranks, ring: an all-gather or reduce-scatter sends half the model bytes
    assert comm["ddp"] == comm["fsdp1-no-shard"] == 2 * 4 * P / 2
    assert comm["fsdp1-full-shard"] == comm["fsdp2-reshard-true"] == 3 * 4 * P / 2
    assert comm["fsdp1-shard-grad-op"] == comm["fsdp2-reshard-false"] == 2 * 4 * P / 2


def test_every_synchronized_strategy_trains_the_same(results):
    reference = variant(results, "ddp")["losses"]
    assert reference[-1] < reference[0] - 1.0, reference
    for v in results["variants"]:
        if v["name"] != "fsdp1-hybrid-shard":
            assert v["losses"] == pytest.approx(reference, abs=5e-3), v["name"]
    # FSDP1 HYBRID_SHARD on a 1-rank shard group falls back to NO_SHARD inside that group and
    # never averages across replicas: the ranks train apart (a trap the lesson documents)
    assert abs(variant(results, "fsdp1-hybrid-shard")["losses"][-1] - reference[-1]) > 5e-3


def test_largest_model_ordering(results):
    cap = {r["strategy"]: r for r in results["capacity"]["at_gpus"]}
    assert cap["ddp"]["bytes_per_param"] == pytest.approx(16, rel=0.01)
    assert cap["full_shard"]["bytes_per_param"] == pytest.approx(16 / 8, rel=0.01)
    assert cap["shard_grad_op"]["bytes_per_param"] == pytest.approx(4 + 16 / 8, rel=0.01)  # + a full copy
    ddp, sgo, fs = (cap[s]["largest_model"] for s in ("ddp", "shard_grad_op", "full_shard"))
    assert ddp < sgo < fs
    assert ddp == pytest.approx(24e9 / 16, rel=0.01)


def test_sharding_formulas_refuse_bad_values():
    import sharding as S

    with pytest.raises(UsageError, match="non-trivial divisors"):
        S.bytes_per_param("reshard_to", 2, reshard_to=2)
    with pytest.raises(UsageError, match="full_shard"):
        S.bytes_per_param("zero3", 2)
    assert S.bytes_per_param("reshard_to", 16, reshard_to=8).unsharded_parameters == 0.5
    hsdp = S.comm_bytes_per_step("hybrid_shard", 16, 1000, replicate=2)
    assert hsdp["all_reduce_replicas"] == pytest.approx(2 * 4000 / 8 * 0.5)


def test_bad_variant_is_one_line_exit_2():
    line = flag_error("06", "--variants", "zero3")
    assert "zero3" in line and "fsdp1-shard-grad-op" in line


def test_the_prediction_on_a_cluster_ranks_the_strategies_communication(results):
    """results.json carries the step-time model's prediction on 2 x 8 H100: per step full_shard
    communicates more than shard_grad_op (no backward all-gather), which communicates more than
    DDP (gradients only); HSDP keeps most of it inside a node."""
    predicted = results["predicted"]
    assert "PREDICTED" in predicted["what"] and predicted["gpus"] == 16
    by = {v["name"]: v for v in predicted["variants"]}
    assert by["fsdp2-reshard-true"]["comm_s"] > by["fsdp2-reshard-false"]["comm_s"] > by["ddp"]["comm_s"]
    assert by["fsdp1-full-shard"]["comm_s"] == pytest.approx(by["fsdp2-reshard-true"]["comm_s"])
    assert by["fsdp2-hsdp"]["comm_s"] < by["fsdp2-reshard-true"]["comm_s"]


def test_the_readme_prediction_is_what_the_run_predicts(results):
    assert_prediction_is_the_readmes("06", results, "predicted_2x8xh100.json")


def test_readme_table_is_reproduced_by_the_quick_run(results):
    """The README's results table is rendered from results_cpu.json, the lesson's own `fsdp-course run
    06 --device cpu`; this quick run reproduces what it claims (state kept between steps, unsharded
    parameters and memory at the peak, bytes sent)."""
    from conftest import assert_readme_table_is_reproduced

    assert_readme_table_is_reproduced("06", results)


def test_the_prediction_prose_quotes_the_committed_prediction():
    """The prose under the predicted table quotes its rows (full_shard's and DDP's communication,
    their ratio, HSDP's) and the time model's fitted per-unit cost, so a re-made prediction or a
    re-fit cannot leave it behind."""
    import json
    import re

    from conftest import REPO

    from utilities.measure.gpu_catalogue import CALIBRATED

    folder = REPO / "lessons/06_sharding_strategies"
    rows = {v["name"]: v for v in json.loads((folder / "predicted_2x8xh100.json").read_text())["variants"]}
    text = " ".join((folder / "README.md").read_text().split())
    said = re.search(r"full_shard communicates ([\d.]+)x DDP's time \((\d+) vs (\d+) ms", text)
    assert said, "the README's prose moved: update this test"
    comm = {name: rows[name]["comm_s"] * 1e3 for name in ("fsdp2-reshard-true", "ddp", "fsdp2-hsdp")}
    assert float(said.group(2)) == pytest.approx(comm["fsdp2-reshard-true"], abs=0.5)
    assert float(said.group(3)) == pytest.approx(comm["ddp"], abs=0.5)
    assert float(said.group(1)) == pytest.approx(comm["fsdp2-reshard-true"] / comm["ddp"], abs=0.005)
    assert f"across the two ({comm['fsdp2-hsdp']:.0f} ms)" in text
    assert f"fitted {CALIBRATED.unit_overhead_s * 1e3:.2f} ms per unit and pass" in text
