"""Lesson 04 (backward prefetch): prefetching changes timing, never numerics; depth is registered."""

from __future__ import annotations

import pytest
from conftest import (
    assert_prediction_is_the_readmes,
    assert_same_losses,
    flag_error,
    lesson_module,
    notebook_results,
    variant,
)

# Prefetch only reorders when all-gathers are issued; the arithmetic is identical, so the losses
# agree to float32 round-off. Stated in the README.
LOSS_ATOL = 1e-5
VARIANTS = ("fsdp1-no-prefetch", "fsdp1-backward-post", "fsdp1-backward-pre", "fsdp1-pre+forward",
            "fsdp2-implicit", "fsdp2-explicit")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return notebook_results("04", tmp_path_factory)  # the notebook runs `fsdp-course run 04 --quick`


def test_every_variant_measured(results):
    assert [v["name"] for v in results["variants"]] == list(VARIANTS)
    for v in results["variants"]:
        assert v["step_time_s"] > 0, v["name"]
        assert v["peak_memory_bytes"]["total"] > v["peak_memory_bytes"]["parameters"] > 0, v["name"]


def test_prefetch_never_changes_the_losses(results):
    assert_same_losses(results, "fsdp1-no-prefetch", LOSS_ATOL)


def test_prefetching_costs_memory(results):
    """The README's memory claims: BACKWARD_PRE holds a second unit's unsharded parameters at the
    peak (FSDP1 counts them as parameters); FSDP2's deeper explicit prefetch keeps more gathers in
    flight (all-gather buffers), so its peak is higher."""
    def peak(name, key="total"):
        return variant(results, name)["peak_memory_bytes"][key]

    assert peak("fsdp1-backward-pre", "parameters") > peak("fsdp1-backward-post", "parameters")
    assert peak("fsdp1-backward-pre") > peak("fsdp1-backward-post")
    assert peak("fsdp1-backward-post") == peak("fsdp1-no-prefetch")
    assert peak("fsdp2-explicit") > peak("fsdp2-implicit")


def test_gathered_parameters_grow_with_prefetch_depth(results):
    """The README's "gathered params at peak": each unit gathered ahead adds one T5 block (262,656
    fp32 parameters) to what is gathered at the peak. No prefetch holds the block at work;
    BACKWARD_PRE and FSDP2's implicit prefetch one block more; explicit depth N, N blocks more."""
    block = 4 * 262_656
    gathered = {v["name"]: v["peak_gathered_parameter_bytes"] for v in results["variants"]}
    unsharded = {v["name"]: v["peak_unsharded_parameter_bytes"] for v in results["variants"]}
    depth = results["settings"]["prefetch_depth"]
    assert gathered["fsdp1-no-prefetch"] == gathered["fsdp1-backward-post"] == unsharded["fsdp1-no-prefetch"]
    assert gathered["fsdp1-backward-pre"] - gathered["fsdp1-no-prefetch"] == pytest.approx(block, rel=0.01)
    assert gathered["fsdp2-implicit"] - unsharded["fsdp2-implicit"] == pytest.approx(block, rel=0.01)
    assert gathered["fsdp2-explicit"] - unsharded["fsdp2-explicit"] == pytest.approx(depth * block, rel=0.01)
    assert gathered["fsdp2-explicit"] > gathered["fsdp2-implicit"] > gathered["fsdp1-no-prefetch"]


def test_fsdp1_options_recorded(results):
    assert variant(results, "fsdp1-no-prefetch")["backward_prefetch"] is None
    assert variant(results, "fsdp1-backward-post")["backward_prefetch"] == "BACKWARD_POST"
    assert variant(results, "fsdp1-pre+forward")["forward_prefetch"] is True


def test_explicit_depth_is_registered_by_fsdp2(results):
    # prefetch_plan is read back from each block's FSDP state after the lesson's prefetch_ahead
    depth = results["settings"]["prefetch_depth"]
    assert depth == 2
    plan = variant(results, "fsdp2-explicit")["prefetch_plan"]
    n = len(plan)
    assert n == 8  # t5-tiny: 4 encoder + 4 decoder blocks, in forward order
    for i, p in enumerate(plan):
        assert p["forward"] == list(range(i + 1, min(n, i + 1 + depth)))
        assert p["backward"] == list(range(i - 1, max(-1, i - 1 - depth), -1))
    implicit = variant(results, "fsdp2-implicit")["prefetch_plan"]
    assert all(p == {"forward": [], "backward": []} for p in implicit)


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_taught_loop_registers_what_the_library_loop_does(world1, depth):
    """The lesson teaches the prefetch loop as ``prefetch_ahead``; lesson 10 and users call the
    library's ``set_explicit_prefetch``. Both must register the same lists on the same blocks."""
    from utilities import get_model_spec
    from utilities.prefetch import prefetch_plan, set_explicit_prefetch

    lesson = lesson_module("04")
    spec = get_model_spec("t5-tiny")
    plans = []
    for set_prefetch in (lesson.prefetch_ahead, set_explicit_prefetch):
        blocks = lesson.shard_blocks(spec.build("cpu"), spec.block_class())
        set_prefetch(blocks, depth)
        plans.append(prefetch_plan(blocks))
    assert plans[0] == plans[1]
    assert plans[0][0]["forward"] == list(range(1, 1 + depth))


def test_bad_depth_is_one_line_exit_2():
    line = flag_error("04", "--prefetch-depth", "0")
    assert "0" in line and ">= 1" in line


@pytest.mark.parametrize("comm, compute, exposed", [
    ([(0, 10)], [], 10),                          # nothing to hide behind
    ([(0, 10)], [(0, 10)], 0),                    # fully overlapped
    ([(0, 10)], [(2, 4), (6, 7)], 7),             # two holes covered, 7 left
    ([(0, 4), (3, 10)], [(5, 20)], 5),            # overlapping comm kernels count once
    ([(0, 10)], [(1, 3), (2, 5), (9, 30)], 5),    # overlapping compute kernels count once
    ([(10, 20)], [(0, 5), (25, 30)], 10),         # compute entirely outside
])
def test_exposed_communication_is_the_uncovered_time(comm, compute, exposed):
    from utilities.prefetch import uncovered

    assert uncovered(comm, compute) == pytest.approx(exposed)


def test_exposed_communication_reads_nccl_kernels_from_a_profile():
    """GPU profiles are read by kernel name: nccl* kernels are communication, the rest compute."""
    from types import SimpleNamespace

    import torch

    from utilities.prefetch import exposed_communication

    def kernel(name, start, end, device=torch.autograd.DeviceType.CUDA):
        return SimpleNamespace(name=name, device_type=device,
                               time_range=SimpleNamespace(start=start, end=end))

    prof = SimpleNamespace(events=lambda: [
        kernel("ncclDevKernel_AllGather_RING_LL", 0, 100), kernel("ampere_sgemm_128x64", 40, 80),
        kernel("ncclDevKernel_ReduceScatter_Sum_f32", 200, 260), kernel("vectorized_elementwise", 250, 400),
        kernel("aten::mm", 0, 1000, torch.autograd.DeviceType.CPU),  # CPU ops are not kernels
    ])
    got = exposed_communication(prof)
    assert got["comm_s"] == pytest.approx(160e-6) and got["exposed_s"] == pytest.approx(110e-6)


def test_cpu_trace_is_written(tmp_path):
    """--trace on CPU: a Chrome trace a learner can open in Perfetto (no exposed time: no CUDA)."""
    import json

    import torch

    from utilities.prefetch import profile_steps

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    data = iter([{"x": torch.randn(4, 8)}] * 3)
    out = profile_steps(model, torch.optim.SGD(model.parameters(), lr=0.1), data, torch.device("cpu"),
                        tmp_path / "t.json", steps=2, step_fn=lambda m, b: m(b["x"]).sum().backward())
    trace = json.loads((tmp_path / "t.json").read_text())
    assert out["profiled_steps"] == 2 and out["exposed_comm_s_per_step"] is None
    assert any("addmm" in e.get("name", "") for e in trace["traceEvents"])


def test_the_predicted_trace_names_its_slices_as_a_profiled_fsdp2_step(tmp_path):
    """``plan --trace``'s slices carry the names torch.profiler gives FSDP2's work: every FSDP name
    (and the optimizer's) in the predicted trace of t5-tiny on 2 ranks is in the CPU profiler
    trace this lesson writes of the same step (``--trace``), so Perfetto lines the two up."""
    import json
    from pathlib import Path

    from conftest import run_lesson

    from utilities.measure import step_time as st

    results = run_lesson("04", tmp_path, "--trace", "--variants", "fsdp2-implicit", "--steps", "2",
                         "--predict-on", "none")
    real = json.loads(Path(variant(results, "fsdp2-implicit")["trace"]).read_text())
    real_names = {e.get("name") for e in real["traceEvents"]}
    s = results["settings"]
    t = st.estimate_step_time("t5-tiny", 2, precision="fp32", batch=s["batch_size"], seq=s["seq_len"])
    predicted = {e["name"] for e in st.chrome_trace(t)["traceEvents"] if e["ph"] == "X"}
    named = {n for n in predicted if n.startswith(("FSDP::", "Optimizer."))}
    assert "FSDP::all_gather (encoder.block.0)" in named and "FSDP::post_backward_reduce" in named
    assert named <= real_names, sorted(named - real_names)


def test_the_prediction_on_a_cluster_shows_what_prefetching_hides(results):
    """results.json carries the step-time model's prediction for every variant on 2 x 8 H100,
    labelled as one: without prefetch more communication is exposed than with BACKWARD_PRE, and
    BACKWARD_POST lies between (the classic lesson's order); the lanes of each timeline end
    within the step."""
    predicted = results["predicted"]
    assert "PREDICTED" in predicted["what"] and predicted["gpus"] == 16
    by = {v["name"]: v for v in predicted["variants"]}
    assert list(by) == list(VARIANTS)
    none, post, pre = (by[f"fsdp1-{k}"] for k in ("no-prefetch", "backward-post", "backward-pre"))
    assert none["exposed_comm_s"] > post["exposed_comm_s"] > pre["exposed_comm_s"]
    assert none["step_s"] > pre["step_s"] and none["comm_s"] == pytest.approx(pre["comm_s"])
    for v in predicted["variants"]:
        assert max(e["end"] for e in v["timeline"]) == pytest.approx(v["step_s"], rel=1e-6)


def test_the_readme_prediction_is_what_the_run_predicts(results):
    assert_prediction_is_the_readmes("04", results, "predicted_2x8xh100.json")


def test_readme_table_is_reproduced_by_the_quick_run(results):
    """The README's results table is rendered from results_cpu.json, the lesson's own `fsdp-course run
    04 --quick` (its depth-2 variants); this quick run reproduces what it claims (prefetch
    settings, gathered and unsharded parameters at the peak, memory, losses)."""
    from conftest import assert_readme_table_is_reproduced

    assert_readme_table_is_reproduced("04", results)


def test_the_prose_quotes_the_committed_prediction():
    """"The model predicts N% ... and M% over no prefetch" is BACKWARD_PRE's step against
    BACKWARD_POST's and against no prefetch, in the committed prediction, so a re-made prediction
    cannot leave the prose behind."""
    import json
    import re

    from conftest import REPO

    folder = REPO / "lessons/04_backward_prefetch"
    predicted = json.loads((folder / "predicted_2x8xh100.json").read_text())
    step = {v["name"]: v["step_s"] for v in predicted["variants"]}
    text = " ".join((folder / "README.md").read_text().split())
    said = re.search(r"The model predicts (\d+)% for .*? and (\d+)% over no prefetch", text)
    assert said, "the README's prose moved: update this test"
    pre = step["fsdp1-backward-pre"]
    assert int(said.group(1)) == round(100 * (step["fsdp1-backward-post"] / pre - 1))
    assert int(said.group(2)) == round(100 * (step["fsdp1-no-prefetch"] / pre - 1))
