"""Lesson 12's point: TP computes the same numbers as the unsplit model with 1/tp of the split
weights on each rank, and 2-D (FSDP across, TP inside) keeps both properties."""

from __future__ import annotations

import sys

import pytest
from conftest import (
    REPO,
    assert_help_lists,
    assert_prediction_is_the_readmes,
    flag_error,
    notebook_results,
    run_lesson,
    variant,
)

sys.path.insert(0, str(REPO / "lessons" / "12_tensor_parallel"))  # the lesson's own helpers

TOL = 1e-5  # fp32; splitting a matmul only reorders its sums (measured: ~5e-7 on logits)
LLAMA_TINY = 836_736


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return notebook_results("12", tmp_path_factory)  # the notebook runs `fsdp-course run 12 --quick`


@pytest.fixture(scope="module")
def results4(tmp_path_factory):
    # The one extra launch: 4 gloo ranks on CPU, for tp=4 and a real 2 x 2 (dp, tp) mesh.
    out = tmp_path_factory.mktemp("lesson12_4ranks")
    return run_lesson("12", out, "--variants", "tp4-mlp,dp2xtp2-2d", "--predict-on", "none", nproc=4)


def test_quick_run_has_the_variants(results):
    assert results["lesson"] == "12" and results["world_size"] == 2 and results["device"] == "cpu"
    assert results["model"] == {"name": "llama-tiny", "parameters": LLAMA_TINY}
    names = {v["name"] for v in results["variants"]}
    assert names == {"tp1-mlp", "tp2-mlp", "tp1-llama", "tp2-llama", "tp2-llama-sp", "dp1xtp2-2d"}
    assert any("tp4-mlp" in n and "skipped" in n for n in results["notes"])
    for v in results["variants"]:
        mem = v["peak_memory_bytes"]
        assert mem["total"] > 0 and v["step_time_s"] > 0, v["name"]
        assert v["tp_size"] * v["dp_size"] in (1, 2), v["name"]


def test_split_model_equals_unsplit(results):
    for v in results["variants"]:
        assert v["max_abs_diff_output"] < TOL, (v["name"], v["max_abs_diff_output"])
        assert v["max_abs_diff_grads"] < TOL, (v["name"], v["max_abs_diff_grads"])
        assert v["max_abs_diff_vs_unsplit"] < TOL


def test_training_curves_do_not_depend_on_the_split(results):
    reference = variant(results, "tp1-llama")["losses"]
    assert reference[-1] < reference[0] - 0.5, reference  # the reversal task is being learned
    for name in ("tp2-llama", "tp2-llama-sp", "dp1xtp2-2d"):
        assert variant(results, name)["losses"] == pytest.approx(reference, abs=1e-4), name


def test_mlp_weights_halve_with_tp(results):
    tp1, tp2 = variant(results, "tp1-mlp"), variant(results, "tp2-mlp")
    assert tp2["weight_bytes_per_rank"] * 2 == tp1["weight_bytes_per_rank"]
    assert tp2["weight_ratio_vs_tp1"] == 0.5
    # the peak also falls about by half (the replicated input activation does not split)
    assert 0.45 < tp2["peak_ratio_vs_tp1"] < 0.62, tp2["peak_ratio_vs_tp1"]
    assert tp2["published_ratio_vs_tp1"] == pytest.approx(2.03 / 4.04, abs=1e-3)


def test_llama_split_weights_halve_and_the_rest_is_replicated(results):
    full, tp2 = variant(results, "tp1-llama"), variant(results, "tp2-llama")
    assert full["weight_bytes_per_rank"] == 4 * LLAMA_TINY
    # embeddings, norms and the LM head stay whole on every rank
    replicated = tp2["replicated_weight_bytes_per_rank"]
    assert tp2["split_weight_bytes_per_rank"] * 2 + replicated == full["weight_bytes_per_rank"]
    assert tp2["weight_bytes_per_rank"] < 0.6 * full["weight_bytes_per_rank"]
    two_d = variant(results, "dp1xtp2-2d")  # a dp group of 1: FSDP shards nothing more
    assert two_d["weight_bytes_per_rank"] == tp2["weight_bytes_per_rank"]


def test_sequence_parallel_shards_the_activations_between_blocks(results):
    """SP: same numbers (checked above), less activation memory per rank than plain TP (the norms
    and the residual stream hold 1/tp of the tokens), and only the norms left replicated."""
    tp2, sp = variant(results, "tp2-llama"), variant(results, "tp2-llama-sp")
    # (the quick run's 32 tokens leave little to shard: measured 7.16 vs 7.28 MiB; 6.15 vs 7.28 at
    # the README's 64 tokens)
    assert sp["peak_memory_bytes"]["activations"] < tp2["peak_memory_bytes"]["activations"]
    assert sp["peak_memory_bytes"]["total"] < tp2["peak_memory_bytes"]["total"]
    norms = (2 * 4 + 1) * 128 * 4  # llama-tiny: 4 blocks x 2 RMSNorms + the final one, hidden 128, fp32
    assert sp["replicated_weight_bytes_per_rank"] == norms
    assert sp["split_weight_bytes_per_rank"] * 2 + norms == 4 * LLAMA_TINY


def test_tp_ranks_of_one_dp_group_see_the_same_batches():
    """The data loader shards over dp ranks only: both TP ranks of a group, which pass the same
    (dp_rank, dp_size), get identical batches; the two dp groups get disjoint examples."""
    import torch
    from tp_helpers import data_parallel_loader

    from utilities.data import ReverseTask

    ds = ReverseTask(32, 12, mode="causal", seed=0)

    def ids(dp_rank):
        return [b["input_ids"] for b in data_parallel_loader(ds, 4, dp_rank, 2, seed=0)]

    tp_rank0, tp_rank1, other_group = ids(0), ids(0), ids(1)
    assert len(tp_rank0) == 4 and all(torch.equal(a, b) for a, b in zip(tp_rank0, tp_rank1))
    mine = {tuple(r.tolist()) for b in tp_rank0 for r in b}
    theirs = {tuple(r.tolist()) for b in other_group for r in b}
    assert len(mine) == 16 and not mine & theirs


def test_four_ranks_tp4_and_two_d(results, results4):
    assert results4["world_size"] == 4
    tp1 = variant(results, "tp1-mlp")  # same MLP size (--quick) in both runs
    tp4 = variant(results4, "tp4-mlp")
    assert tp4["weight_bytes_per_rank"] * 4 == tp1["weight_bytes_per_rank"]
    two_d = variant(results4, "dp2xtp2-2d")
    assert two_d["tp_size"] == 2 and two_d["dp_size"] == 2
    assert two_d["max_abs_diff_vs_unsplit"] < TOL
    # TP halves the split weights; FSDP over dp=2 halves everything a TP rank holds again, the
    # TP-replicated embeddings, norms and head included: exactly half of the tp2-llama rank.
    assert two_d["weight_bytes_per_rank"] * 2 == variant(results, "tp2-llama")["weight_bytes_per_rank"]


def test_bad_flag_value_is_one_line_exit_2():
    line = flag_error("12", "--variants", "tp3-mlp")
    assert "tp3-mlp" in line and "tp2-llama" in line


def test_readme_table_is_reproduced_by_the_quick_run(results):
    """The README's results table is rendered from results_cpu.json, the lesson's own `fsdp-course run
    12 --device cpu` (2 ranks); this quick run reproduces what it claims (the Llama variants' split
    and replicated weight bytes, parameters and optimizer state at the peak)."""
    from conftest import assert_readme_table_is_reproduced

    assert_readme_table_is_reproduced("12", results)


def test_lesson_help_explains_every_flag():
    assert_help_lists("12", ("--variants", "--mlp-dim", "--predict-on", "--predict-model",
                             "--predict-batch", "--predict-seq", "--device", "--quick"))


def test_a_prediction_model_tp_cannot_split_is_one_line_exit_2():
    line = flag_error("12", "--predict-model", "t5-tiny")
    assert "--predict-model" in line and "llama-8b" in line


def test_prediction_holds_the_global_batch_and_tp_blocks_the_compute(results):
    """FSDP2 alone and 2-D with TP over 2, 4, 8 GPUs of one node, each TP group taking tp x the
    per-GPU batch (the same tokens per step); TP's collectives sit on the compute lane (their
    time in the compute slices' ``tp_comm_s``), FSDP's shrink with the TP degree, and each
    variant carries the planner's peak per GPU."""
    predicted = results["predicted"]
    assert predicted["gpus"] == 8 and predicted["model"] == "llama-8b" and predicted["ac"] == "selective"
    names = [v["name"] for v in predicted["variants"]]
    assert names == ["fsdp-only", "2d-tp2", "2d-tp4", "2d-tp8"]
    by = {v["name"]: v for v in predicted["variants"]}
    assert "batch" not in by["fsdp-only"]
    for tp in (2, 4, 8):
        assert by[f"2d-tp{tp}"]["batch"] == tp * predicted["batch"]
    tokens = predicted["batch"] * predicted["seq"] * predicted["gpus"]  # per step, every variant
    for name, v in by.items():
        tp = int(name[5:]) if name.startswith("2d-tp") else 1
        assert v["tokens_per_s_per_gpu"] == pytest.approx(tokens / v["step_s"] / predicted["gpus"])
        tp_comm = sum(e["args"].get("tp_comm_s", 0.0) for e in v["timeline"])
        assert (tp_comm > 0) == (tp > 1), name
        assert all(e["lane"] == "compute" for e in v["timeline"] if "tp_comm_s" in e["args"])
        assert v["peak_bytes"] > 0 and v["fits"], name
    comm = [by[n]["comm_s"] for n in names]
    assert comm == sorted(comm, reverse=True)  # each GPU gathers 1/tp of a block


def test_readme_prediction_is_the_runs(results):
    assert_prediction_is_the_readmes("12", results, "predicted_1x8xh100.json")


def _styles(plan: dict) -> dict:
    """A TP plan as comparable data: each submodule's style class and its layouts."""
    return {name: (type(style).__name__, vars(style)) for name, style in plan.items()}


@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_the_lessons_plans_are_the_planners(sequence_parallel):
    """The lesson writes its TP plans out; the planner keeps its own: the same styles, layouts and
    local outputs, submodule by submodule, or a prediction would split another model."""
    from conftest import lesson_module

    from utilities.measure import tensor_parallel as planner

    lesson = lesson_module("12")
    assert _styles(lesson.mlp_tp_plan()) == _styles(planner.mlp_plan())
    assert (_styles(lesson.llama_tp_plan(sequence_parallel))
            == _styles(planner.llama_block_plan(sequence_parallel)))
    assert _styles(lesson.llama_model_sp_plan()) == _styles(planner.llama_root_plan(loss_parallel=False))
    assert _styles(lesson.llama_model_sp_plan()) != _styles(planner.llama_root_plan(loss_parallel=True))


def test_the_lessons_apply_llama_tp_places_every_weight_as_the_library_does(world1):
    """On a one-rank mesh: every llama-tiny parameter the lesson's ``apply_llama_tp`` splits is a
    DTensor with the same placements as after the library's ``apply_tp`` (what the planner traces)."""
    from conftest import lesson_module
    from torch.distributed.device_mesh import init_device_mesh

    from utilities.models import get_model_spec
    from utilities.parallelize import apply_tp

    lesson = lesson_module("12")
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    for sequence_parallel in (True, False):
        ours = lesson.apply_llama_tp(get_model_spec("llama-tiny").build("cpu"), mesh["tp"],
                                     sequence_parallel)
        theirs = apply_tp(get_model_spec("llama-tiny").build("cpu"), tp_mesh=mesh["tp"],
                          sequence_parallel=sequence_parallel)
        placements = [{n: getattr(p, "placements", None) for n, p in m.named_parameters()}
                      for m in (ours, theirs)]
        assert placements[0] == placements[1]
        assert sum(v is not None for v in placements[0].values()) >= 7 * len(ours.model.layers)


def test_the_prediction_prose_quotes_the_committed_tp_collectives():
    """"about 23, 61 and 138 ms a step at tp 2, 4 and 8" is the sum of the timelines' tp_comm_s
    in the committed prediction, so a re-made prediction cannot leave the prose behind."""
    import json
    import re

    from conftest import REPO

    folder = REPO / "lessons/12_tensor_parallel"
    rows = {v["name"]: v for v in json.loads((folder / "predicted_1x8xh100.json").read_text())["variants"]}
    text = " ".join((folder / "README.md").read_text().split())
    said = re.search(r"about (\d+), (\d+) and (\d+) ms a step at tp 2, 4 and 8", text)
    assert said, "the README's prose moved: update this test"
    for quoted, name in zip(said.groups(), ("2d-tp2", "2d-tp4", "2d-tp8")):
        ms = 1e3 * sum(e.get("args", {}).get("tp_comm_s", 0) for e in rows[name]["timeline"])
        assert abs(int(quoted) - ms) <= 0.6, name
