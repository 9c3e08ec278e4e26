"""The step-time model (utilities.measure.step_time): its ring arithmetic, the shards it
communicates against the collectives FSDP2 really issued in the trace, what each schedule knob
does, a timeline whose lanes add up to the step, and the published llama-8b anchor."""

from __future__ import annotations

import pytest
import torch

from utilities.errors import UsageError
from utilities.measure import cost_model, gpu_catalogue
from utilities.measure import step_time as st
from utilities.measure.fake_step import StepConfig, trace

SMALL = dict(model="llama-1b", batch=1, seq=2048)  # communication-heavy at 16+ GPUs


def test_ring_all_gather_moves_n_minus_1_over_n_of_the_bytes():
    gpu, eff = gpu_catalogue.get_gpu("h100"), gpu_catalogue.CALIBRATED
    size = 2**30
    for n in (2, 8):
        assert cost_model.ring_bytes_per_gpu("all_gather", size, n) == pytest.approx((n - 1) / n * size)
        assert cost_model.ring_bytes_per_gpu("reduce_scatter", size, n) == pytest.approx((n - 1) / n * size)
        assert cost_model.ring_bytes_per_gpu("all_reduce", size, n) == pytest.approx(2 * (n - 1) / n * size)
        # the time grows by exactly the moved bytes over the link's bandwidth (alpha-beta)
        one = cost_model.collective_time("all_gather", size, n, gpu, eff, 8, 400)
        two = cost_model.collective_time("all_gather", 2 * size, n, gpu, eff, 8, 400)
        assert two - one == pytest.approx((n - 1) / n * size / (gpu.link_bytes_per_s * eff.link))
    # across nodes the network sets the pace: 400 Gb/s per GPU is slower than NVLink
    assert (cost_model.collective_time("all_gather", size, 16, gpu, eff, 8, 400)
            > cost_model.collective_time("all_gather", size, 8, gpu, eff, 8, 400) * 5)
    assert cost_model.collective_time("all_gather", size, 1, gpu, eff, 8, 400) == 0


def test_shards_match_the_collectives_fsdp2_issued_in_the_trace():
    """The model's all-gather sizes (per-parameter dim-0 chunks, padded to a multiple of the
    group) are the bytes FSDP2's all-gathers carried in the traced step, unit by unit, in forward
    order; reduce-scatter outputs are one rank's shard. 3 ranks: every dim 0 here needs padding."""
    prof = trace("llama-tiny", StepConfig(3, "full_shard", "bf16", "none", 1, 64))
    gathers = [(u, b) for op, u, b in prof.collectives if op == "_allgather_base_"]
    expected = [(u.name, u.shard_numel(3) * 3 * 2) for u in prof.units]  # bf16: 2 bytes
    assert gathers[:len(expected)] == expected
    assert sum(u.shard_numel(3) for u in prof.units) > -(-sum(u.numel for u in prof.units) // 3)
    scattered = sorted(b for op, _, b in prof.collectives if op == "_reduce_scatter_base_")
    assert scattered == sorted(u.shard_numel(3) * 2 for u in prof.units)
    # every parameter of the model belongs to exactly one unit
    from utilities.models import get_model_spec

    assert sum(u.numel for u in prof.units) == get_model_spec("llama-tiny").num_parameters


def test_exposed_communication_grows_when_prefetch_is_off():
    on = st.estimate_step_time(gpus=16, prefetch=1, **SMALL)
    off = st.estimate_step_time(gpus=16, prefetch=0, **SMALL)
    assert off.exposed_comm_s > on.exposed_comm_s * 1.1
    assert off.compute_s == pytest.approx(on.compute_s)  # the same work, waiting longer
    assert off.step_s > on.step_s
    # FSDP1's backward orders: BACKWARD_PRE hides most, BACKWARD_POST less, none least
    pre, post, none = (st.estimate_step_time(gpus=8, backward_prefetch=b, **SMALL)
                       for b in ("backward_pre", "backward_post", "none"))
    assert pre.exposed_comm_s < post.exposed_comm_s < none.exposed_comm_s


def test_full_shard_communicates_more_than_shard_grad_op_and_no_shard():
    for gpus in (8, 16):
        full, sgo, ddp = (st.estimate_step_time(gpus=gpus, strategy=s, **SMALL)
                          for s in ("full_shard", "shard_grad_op", "no_shard"))
        assert full.comm_s > sgo.comm_s and full.comm_s > ddp.comm_s
        # shard_grad_op skips exactly the backward all-gathers
        bwd_gathers = sum(e.end - e.start for e in full.timeline
                          if e.phase == "all_gather" and e.unit != "root") / 2
        assert full.comm_s - sgo.comm_s == pytest.approx(bwd_gathers, rel=1e-6)


def test_per_gpu_throughput_does_not_rise_from_8_to_128_gpus():
    rates = [st.estimate_step_time(gpus=n, **SMALL).tokens_per_s_per_gpu for n in (8, 16, 32, 128)]
    assert all(b <= a * 1.0001 for a, b in zip(rates, rates[1:])), rates
    assert rates[-1] < rates[0]
    hsdp = st.estimate_step_time(gpus=128, strategy="hybrid_shard", **SMALL)
    assert hsdp.tokens_per_s_per_gpu > rates[-1]  # sharding within a node: NVLink all-gathers


@pytest.mark.parametrize("kw", [dict(), dict(prefetch=0), dict(strategy="no_shard"),
                                dict(strategy="hybrid_shard", gpus=32),
                                dict(backward_prefetch="none", limit_all_gathers=True)])
def test_the_timeline_lanes_add_up_to_the_step(kw):
    args = dict(SMALL, gpus=16, ac="selective")
    args.update(kw)
    t = st.estimate_step_time(**args)
    compute = [e for e in t.timeline if e.lane == "compute"]
    comm = [e for e in t.timeline if e.lane == "comm"]
    assert max(e.end for e in t.timeline) == pytest.approx(t.step_s)
    assert sum(e.end - e.start for e in compute) == pytest.approx(t.compute_s)
    assert t.compute_s + t.exposed_comm_s == pytest.approx(t.step_s)
    assert sum(e.end - e.start for e in comm) == pytest.approx(t.comm_s)
    for lane in (compute, comm):  # one thing at a time on each lane
        for a, b in zip(lane, lane[1:]):
            assert b.start >= a.end - 1e-12
    assert compute[-1].phase == "optimizer" and compute[-1].end == pytest.approx(t.step_s)
    phases = {e.phase for e in compute}
    assert {"forward", "backward", "recompute"} <= phases  # selective AC recomputes half
    assert t.tokens_per_s_per_gpu == pytest.approx(args["batch"] * args["seq"] / t.step_s)


def test_knobs_and_output():
    base = st.estimate_step_time(gpus=8, gpu="h100", **SMALL)
    compiled = st.estimate_step_time(gpus=8, gpu="h100", compile=True, **SMALL)
    assert compiled.compute_s < base.compute_s
    # Float8 pays for its casts only where they are fused (torchao's advice: compile it)
    fp8 = st.estimate_step_time(gpus=8, gpu="h100", compile=True, fp8=True, **SMALL)
    assert fp8.compute_s < compiled.compute_s

    latency = cost_model.collective_time("all_gather", 0, 8, gpu_catalogue.get_gpu("h100"),
                                         gpu_catalogue.CALIBRATED, 8, 400)

    def block_gathers(t):  # the bandwidth part of the blocks' all-gathers
        ev = [e for e in t.timeline if e.phase == "all_gather" and e.unit != "root"]
        return sum(e.end - e.start for e in ev) - len(ev) * latency

    # FP8 all-gather: one byte per block parameter instead of bf16's two
    assert block_gathers(fp8) == pytest.approx(block_gathers(compiled) / 2, rel=0.01)
    assert st.estimate_step_time(gpus=8, gpu="h200", **SMALL).step_s < base.step_s
    fp32 = st.estimate_step_time(gpus=8, precision="fp32", **SMALL)
    assert fp32.step_s > 3 * base.step_s and fp32.comm_s > 1.9 * base.comm_s
    tf32 = st.estimate_step_time(gpus=8, precision="fp32", tf32=True, **SMALL)
    assert base.step_s < tf32.step_s < fp32.step_s
    a100 = st.estimate_step_time(gpus=8, gpu="a100-80gb", fp8=True, **SMALL)
    assert not a100.fp8 and any("no FP8" in a for a in a100.assumptions)
    d = base.as_dict()
    assert set(d) == {"gpu", "step_s", "compute_s", "comm_s", "exposed_comm_s", "tokens_per_s_per_gpu",
                      "mfu", "assumptions"}
    assert 0 < d["mfu"] < 1 and all(isinstance(a, str) for a in d["assumptions"])
    table = st.format_step_time(base, units=5)
    assert all(len(line) <= 80 for line in table.splitlines()) and "MFU" in table
    for bad in (dict(strategy="zero3"), dict(gpu="h900"), dict(prefetch=-1),
                dict(backward_prefetch="early"), dict(strategy="full_shard", shard_size=4)):
        with pytest.raises(UsageError):
            st.estimate_step_time(**dict(SMALL, gpus=8, **bad))
    for g in gpu_catalogue.GPUS.values():
        assert g.source and g.peak_flops["bf16"] > g.peak_flops["fp32"] > 0


def test_compile_and_float8_effects_on_torchtitans_table_1():
    """torchtitan, Llama 3.1 8B, 8 x H100 96GB, bf16, selective AC, batch 2 x 8192 (fit rows):
    5,762 tokens/s/GPU; + compile 6,667 (x1.157); + compile + Float8 8,532 (x1.280). The
    model's effects, each the ratio of two predictions, within 0.07 of the published ones."""
    kw = dict(model="llama-8b", gpus=8, gpu="h100-96gb", precision="bf16", ac="selective",
              batch=2, seq=8192)
    eager, compiled, fp8 = (st.estimate_step_time(**kw, **extra) for extra in
                            (dict(), dict(compile=True), dict(compile=True, fp8=True)))
    assert abs(compiled.tokens_per_s_per_gpu / eager.tokens_per_s_per_gpu - 6667 / 5762) < 0.07
    assert abs(fp8.tokens_per_s_per_gpu / compiled.tokens_per_s_per_gpu - 8532 / 6667) < 0.07
    for t in (eager, compiled, fp8):
        assert t.exposed_comm_s < 0.05 * t.step_s  # 8 GPUs on NVLink: compute-bound


def test_ring_latency_is_nccls_per_node_boundary_and_tree_at_scale():
    """NCCL's tuning model (src/graph/tuning.cc): a ring pays the network hop latency on the
    nNodes - 1 steps that cross a node boundary, the NVLink one (at least 3 us of network
    overhead) on the others; an all-reduce across many nodes goes by tree when that is faster."""
    gpu, eff = gpu_catalogue.get_gpu("h100"), gpu_catalogue.CALIBRATED
    for n in (16, 128, 1024):
        nodes = n // 8
        expected = (eff.base_latency_s + (n - nodes) * max(eff.hop_latency_link_s, eff.net_overhead_s)
                    + (nodes - 1) * eff.hop_latency_network_s)
        assert cost_model.collective_time("all_gather", 0, n, gpu, eff, 8, 400) == pytest.approx(expected)
    ring_ar = (eff.base_latency_s + 2 * (1024 - 128) * eff.hop_latency_link_s
               + 2 * 127 * eff.hop_latency_network_s)
    tree = cost_model.collective_time("all_reduce", 0, 1024, gpu, eff, 8, 400)
    assert tree < ring_ar / 5  # log2(128) network levels instead of 254 steps
    # large messages: the ring's bandwidth (2 (n-1)/n) beats the tree's (2 / 0.92)
    size = 2**30
    big = cost_model.collective_time("all_reduce", size, 16, gpu, eff, 8, 400)
    bw = 400e9 / 8 * eff.network
    assert big == pytest.approx(eff.base_latency_s + 2 * 14 * eff.hop_latency_link_s
                                + 2 * 1 * eff.hop_latency_network_s + 2 * 15 / 16 * size / bw)
    # 1,024 GPUs lose little to latency: torchtitan's llama-8b setup within 5% of 128 GPUs' rate
    kw = dict(model="llama-8b", gpu="h100-96gb", ac="selective", batch=2, seq=8192)
    r128, r1024 = (st.estimate_step_time(gpus=n, **kw).tokens_per_s_per_gpu for n in (128, 1024))
    assert r1024 > 0.95 * r128


def test_each_gpu_part_has_its_efficiencies_and_says_where_they_come_from():
    for name in ("h100-96gb", "h200", "a100-80gb"):
        assert name in gpu_catalogue.CALIBRATED.per_gpu
    a100 = gpu_catalogue.CALIBRATED.for_gpu("a100-80gb")
    assert a100.link == pytest.approx(240 / 300) and a100.attention == pytest.approx(0.62)
    assert gpu_catalogue.CALIBRATED.for_gpu("a100-40gb") == a100  # extrapolated, and says so
    notes = st.estimate_step_time(gpus=8, gpu="a100-40gb", **SMALL).assumptions
    assert any("extrapolated" in n and "a100-80gb" in n for n in notes)
    assert gpu_catalogue.CALIBRATED.for_gpu("h100") == gpu_catalogue.CALIBRATED


def test_each_unit_gets_its_own_compute():
    """Per-unit attribution: identical blocks get identical forward and backward FLOPs, also in
    T5's decoder, whose blocks all take the encoder's output (their backward stays open until its
    gradient is complete); checkpointed blocks recompute their forward in backward."""
    prof = trace("t5-tiny", StepConfig(2, "full_shard", "fp32", "every-2nd-block", 2, 32))
    flops: dict[tuple[str, str], float] = {}
    for s in prof.segments:
        flops[(s.unit, s.phase)] = flops.get((s.unit, s.phase), 0.0) + float(s.flops.sum())
    for stack in ("encoder", "decoder"):
        blocks = [u.name for u in prof.units if u.name.startswith(stack + ".")]
        assert len(blocks) == 4
        for phase in ("forward", "backward"):
            values = [flops.get((b, phase), 0.0) for b in blocks]
            assert min(values) > 0 and max(values) == pytest.approx(min(values)), (stack, phase)
        recomputed = [b for b in blocks if flops.get((b, "recompute"), 0) > 0]
        assert len(recomputed) == 2  # every other block


def _check_module():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import time_model_check

    return time_model_check


def test_committed_check_is_current_and_calibrated_is_the_fit():
    """benchmarks/results/time_model_check.json was made by ``--fit`` with today's model: CALIBRATED
    holds what the fit gave, its rows are the data file's, the fit and held-out rows are disjoint,
    and the torchtitan Table 1 rows are what the model predicts now. (The held-out error is
    reported as it comes out: no test holds it to a tolerance.)"""
    import json
    from pathlib import Path

    from readme_claims import MODEL_ARITHMETIC_RTOL

    tmc = _check_module()
    data = json.loads((Path(__file__).resolve().parents[1] / "benchmarks" / "results"
                       / "time_model_check.json").read_text())
    assert data["fitted_here"]
    for k, v in data["efficiencies"].items():
        assert getattr(gpu_catalogue.CALIBRATED, k) == pytest.approx(v, rel=MODEL_ARITHMETIC_RTOL), k
    assert tmc.fitted_params(gpu_catalogue.CALIBRATED, data["fitted"]) == data["fitted"]
    rows = tmc.load_data()["rows"]
    assert [r["id"] for r in data["rows"]] == [r["id"] for r in rows]
    assert data["fit_rows"] == [r["id"] for r in rows if r["role"] == "fit"]
    assert not set(data["fit_rows"]) & set(data["held_out_rows"])
    by_id = {r["id"]: r for r in data["rows"]}
    for i, extra in (("torchtitan-8b-fsdp2", {}), ("torchtitan-8b-fsdp2-compile", {"compile": True})):
        t = st.estimate_step_time("llama-8b", 8, ac="selective", batch=2, seq=8192, gpu="h100-96gb",
                                  **extra)
        assert by_id[i]["predicted_tokens_per_s_per_gpu"] == pytest.approx(
            t.tokens_per_s_per_gpu, rel=MODEL_ARITHMETIC_RTOL, abs=0.05)


def test_the_fit_never_reads_held_out_rows():
    """The fit sees the fit rows only: a predictor that records what it is asked shows it, and
    changing every held-out row (published figure and setup) leaves the fitted values unchanged."""
    import copy

    tmc = _check_module()
    data = tmc.load_data()
    seen: set[str] = set()

    def fake(row, eff):  # a cheap stand-in for the model: a smooth function of the efficiencies
        seen.add(row["id"])
        rate = 1e4 * eff.matmul * (1 + 0.1 * len(row["id"])) * (1 + eff.memory) / (1 + eff.kernel_floor_s)
        return type("T", (), {"tokens_per_s_per_gpu": rate * (1.2 if row["config"].get("fp8") else 1)})

    fitted = tmc.fit_from_data(data, rounds=1, predictor=fake)
    assert seen == {r["id"] for r in data["rows"] if r["role"] == "fit"}
    changed = copy.deepcopy(data)
    for r in changed["rows"]:
        if r["role"] == "held_out":
            r["published"] *= 3
            r["config"]["batch"] = 99
    assert tmc.fit_from_data(changed, rounds=1, predictor=fake) == fitted


def test_the_check_runs_and_reports(tmp_path):
    """``--fit`` on a small data file of the same form: it fits, predicts every row and reports
    the fit and held-out errors, the effects and the rows it cannot express."""
    import json

    tmc = _check_module()
    data = tmc.load_data()
    tiny = dict(model="llama-tiny", gpus=2, gpu="h100", precision="bf16", ac="none", batch=2, seq=64)
    data["rows"] = [dict(id="a", role="fit", source="s", setup="x", published=5e5, config=tiny),
                    dict(id="b", role="fit", source="s", setup="x", published=6e5,
                         config=dict(tiny, compile=True)),
                    dict(id="c", role="held_out", source="s", setup="x", published=5e5,
                         config=dict(tiny, batch=4))]
    data["pairs"] = [dict(effect="compile", base="a", variant="b")]
    data["fit_ranges"] = {k: data["fit_ranges"][k] for k in ("matmul", "compile_memory")}
    (tmp_path / "rows.json").write_text(json.dumps(data))
    assert tmc.main(["--fit", "--data", str(tmp_path / "rows.json"), "--out", str(tmp_path / "o.json")]) == 0
    out = json.loads((tmp_path / "o.json").read_text())
    assert out["summary"]["held_out"]["rows"] == 1 and out["summary"]["fit"]["rows"] == 2
    assert out["effects"][0]["role"] == "fit" and out["not_expressible"]
    assert "| c | held out |" in tmc.render(out)


def test_the_benchmarks_readme_table_is_rendered_from_the_committed_check():
    """The README's time model table is the committed result file rendered, nothing typed by hand."""
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    time_model_check = _check_module()
    data = json.loads((root / "benchmarks/results/time_model_check.json").read_text())
    for readme in time_model_check.READMES:
        block = time_model_check.README_BLOCK.search(readme.read_text())
        assert block and block.group(2) == time_model_check.render(data), readme


def test_calibration_twin_measures_saves_and_is_used(tmp_path):
    """The --calibrate path on CPU (small sizes, the same code a GPU runs): three efficiencies
    measured and saved; a plan with --calibration predicts with them (half the GEMM efficiency,
    a slower step); a file that is not a calibration is one line."""
    import json

    from conftest import cli_here

    from utilities.measure import calibrate as C

    result = C.measure(gpu_catalogue.get_gpu("h100"), torch.device("cpu"),
                       sizes={"matmul": 128, "attention": (1, 2, 64, 16), "memory": 2**16})
    assert set(result["efficiencies"]) == {"matmul", "attention", "memory"}
    assert all(v > 0 for v in result["efficiencies"].values())
    slow = dict(result, efficiencies={"matmul": gpu_catalogue.CALIBRATED.matmul / 2, "attention": 0.35,
                                      "memory": gpu_catalogue.CALIBRATED.memory})
    (tmp_path / "slow.json").write_text(json.dumps(slow))
    assert C.load_efficiencies(tmp_path / "slow.json").matmul == pytest.approx(
        gpu_catalogue.CALIBRATED.matmul / 2)
    # measured on an H200: the H200 takes it as measured, the other parts by their fraction over it
    (tmp_path / "h200.json").write_text(json.dumps(dict(slow, gpu="h200")))
    on_h200 = C.load_efficiencies(tmp_path / "h200.json")
    h200_tensor = gpu_catalogue.CALIBRATED.part("h200")["tensor"]
    assert on_h200.for_gpu("h200").matmul == pytest.approx(gpu_catalogue.CALIBRATED.matmul / 2)
    assert on_h200.for_gpu("h100").matmul == pytest.approx(gpu_catalogue.CALIBRATED.matmul / 2 / h200_tensor)
    assert on_h200.for_gpu("a100-40gb").attention == gpu_catalogue.CALIBRATED.for_gpu("a100-40gb").attention
    # --calibrate without --gpu names the part from GPU 0 (the CPU twin: the names torch reports)
    parts = {("NVIDIA H200", 141): "h200", ("NVIDIA H100 80GB HBM3", 79.6): "h100",
             ("NVIDIA H100", 94.5): "h100-96gb", ("NVIDIA A100-SXM4-80GB", 79.2): "a100-80gb",
             ("NVIDIA A100-SXM4-40GB", 39.4): "a100-40gb", ("NVIDIA L4", 22.5): "l4",
             ("NVIDIA GeForce RTX 4090", 24): None}
    for (name, gib), part in parts.items():
        assert C.catalogue_part(name, int(gib * 2**30)) == part, name
    kw = dict(model="llama-1b", gpus=8, batch=2, seq=2048)  # GEMM-bound enough to show it
    base = st.estimate_step_time(**kw)
    calibrated = st.estimate_step_time(**kw, efficiencies=C.load_efficiencies(tmp_path / "slow.json"))
    assert calibrated.compute_s > 1.05 * base.compute_s  # half the GEMM speed: a slower step
    args = ("plan", "--model", "llama-tiny", "--batch", "2", "--seq", "64", "--json")
    used = cli_here(*args, "--calibration", str(tmp_path / "slow.json"))
    assert used.returncode == 0 and json.loads(used.stdout)["time"]["step_s"] > 0
    (tmp_path / "bad.json").write_text("{}")
    bad = cli_here(*args, "--calibration", str(tmp_path / "bad.json"))
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "--calibration" in bad.stderr
    refused = cli_here("plan", "--calibrate")
    assert refused.returncode == 2 and "needs a CUDA GPU" in refused.stderr


def test_plan_trace_is_a_chrome_trace_whose_slices_add_up_to_the_predicted_step(tmp_path):
    """``plan --trace FILE.json``: every slice has what a Chrome-trace reader needs (ph, ts, dur, pid,
    tid, in microseconds), the lanes end at the predicted step and the compute lane's slices add up
    to the predicted compute time (within 1 us), collectives are named as FSDP2's record_function
    names them; with --no-time or --sweep it is one line."""
    import json

    from conftest import cli_here

    path = tmp_path / "step.json"
    proc = cli_here("plan", "--model", "llama-tiny", "--gpus", "8", "--batch", "2", "--json",
                    "--trace", str(path))
    assert proc.returncode == 0, proc.stderr
    time = json.loads(proc.stdout)["time"]
    trace = json.loads(path.read_text())
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert slices and all({"ph", "ts", "dur", "pid", "tid", "name", "args"} <= set(e) for e in slices)
    assert all(isinstance(e[k], (int, float)) and e["dur"] >= 0 for e in slices for k in ("ts", "dur"))
    assert {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"} == {
        "compute", "communication"}
    assert max(e["ts"] + e["dur"] for e in slices) == pytest.approx(time["step_s"] * 1e6, abs=1)
    compute = sum(e["dur"] for e in slices if e["cat"] == "compute")
    assert compute == pytest.approx(time["compute_s"] * 1e6, abs=1)
    names = {e["name"] for e in slices}
    assert {"FSDP::all_gather (model.layers.0)", "FSDP::post_backward_reduce (model.layers.0)",
            "FSDP::all_gather", "forward (model.layers.0)", "Optimizer.step#AdamW.step"} <= names
    for flags, says in ((["--no-time"], "--trace is not allowed with --no-time"),
                        (["--sweep"], "--trace is not allowed with --sweep")):
        bad = cli_here("plan", "--model", "llama-tiny", "--trace", str(tmp_path / "x.json"), *flags)
        assert bad.returncode == 2 and says in bad.stderr and bad.stderr.strip().count("\n") == 0


@pytest.mark.parametrize("strategy, gpus", [("full_shard", 8), ("hybrid_shard", 16)])
def test_trace_slices_carry_the_bytes_and_flops_the_time_model_charged(strategy, gpus):
    """Each collective slice's ``bytes`` is the buffer the time model priced (a unit's padded
    parameters in bf16 for an all-gather, its gradients for a reduce-scatter, one shard across the
    replicas for HSDP's all-reduce) and ``bytes_per_gpu`` what the ring moves per GPU; the compute
    slices carry the traced segments' FLOPs, bytes and op count (all of them, once), the optimizer
    its 32 bytes per shard parameter."""
    t = st.estimate_step_time("llama-tiny", gpus, strategy, batch=2, seq=64)
    prof = trace("llama-tiny", StepConfig(8, "full_shard", "bf16", "none", 2, 64))  # the one node traced
    units = {u.name: u for u in prof.units}
    priced = {"all_gather": lambda u: u.shard_numel(8) * 8 * 2,
              "reduce_scatter": lambda u: u.shard_numel(8) * 8 * 2,
              "all_reduce": lambda u: u.shard_numel(8) * 2}
    slices = [e for e in st.chrome_trace(t)["traceEvents"] if e["ph"] == "X"]
    comm = [e for e in slices if e["cat"] == "comm"]
    assert {e["args"]["phase"] for e in comm} == ({"all_gather", "reduce_scatter"} |
                                                  ({"all_reduce"} if strategy == "hybrid_shard" else set()))
    for e in comm:
        a = e["args"]
        assert a["bytes"] > 0 and a["bytes"] == priced[a["phase"]](units[a["unit"]]), e
        assert a["bytes_per_gpu"] == pytest.approx(
            cost_model.ring_bytes_per_gpu(a["phase"], a["bytes"], a["gpus"]))
    work = [e["args"] for e in slices if e["cat"] == "compute" and e["args"]["phase"] != "optimizer"]
    assert sum(a["flops"] for a in work) == pytest.approx(sum(s.flops.sum() for s in prof.segments))
    assert sum(a["bytes"] for a in work) == pytest.approx(sum(s.nbytes.sum() for s in prof.segments))
    assert sum(a["ops"] for a in work) == sum(len(s.kind) for s in prof.segments)
    (opt,) = [e["args"] for e in slices if e["args"]["phase"] == "optimizer"]
    assert opt["bytes"] == 32 * sum(u.shard_numel(8) for u in prof.units)
    assert t.as_dict(timeline=True)["timeline"][0]["args"]


# -- MFU counts the work that runs ------------------------------------------------------------------

def test_mfu_of_a_frozen_model_counts_the_backward_that_runs():
    """``--trainable 0.01`` on llama-8b (the LM head trains, the backward stops there): the
    convention's 6N would put MFU over 100% at batch 8; counting the traced backward keeps it
    below, and says so. Full training counts exactly the convention."""
    from utilities.measure.plan_options import PlanOptions
    from utilities.models import get_model_spec

    spec = get_model_spec("llama-8b")
    t = st.estimate_step_time(spec, 8, batch=8, seq=2048, plan_options=PlanOptions(trainable=0.01))
    peak = gpu_catalogue.get_gpu("h100").peak_flops["bf16"]
    convention = t.tokens_per_s_per_gpu * spec.flops_per_token(2048) / peak
    assert convention > 1 > t.mfu > 0.25 * convention
    assert any(a.startswith("MFU counts what runs") for a in t.assumptions)
    dense = trace("llama-1b", StepConfig(8, "full_shard", "bf16", "none", 1, 2048))
    count, said = st.model_flops_per_token(get_model_spec("llama-1b"), dense, 2048)
    assert count == pytest.approx(get_model_spec("llama-1b").flops_per_token(2048), rel=1e-12)
    assert said == ""


TINY_MOE = {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "hidden_size": 64,
            "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "num_local_experts": 8, "num_experts_per_tok": 2,
            "vocab_size": 256, "max_position_embeddings": 256}


def test_mfu_of_a_mixture_of_experts_counts_its_active_experts(tmp_path):
    """A mixture of experts (Mixtral's grouped GEMMs) runs num_experts_per_tok of its experts per
    token: the trace counts those GEMMs' FLOPs (3 per expert: gate, up, down), and MFU's N leaves
    the idle experts' parameters out."""
    import json

    from utilities.models import attention_shape, get_model_spec

    path = tmp_path / "moe.json"
    path.write_text(json.dumps(TINY_MOE))
    spec = get_model_spec(str(path))
    seq, c = 64, TINY_MOE
    prof = trace(spec, StepConfig(2, "full_shard", "bf16", "none", 2, seq))
    tokens = 2 * seq
    grouped = sum(float(s.flops[s.kind == st.MATMUL].sum()) for s in prof.segments
                  if s.phase == "forward" and s.unit != "root") / tokens
    experts = 2 * c["num_experts_per_tok"] * 3 * c["hidden_size"] * c["intermediate_size"]
    assert grouped >= experts * c["num_hidden_layers"]  # the experts' GEMMs are counted
    assert grouped < (experts * c["num_local_experts"] / c["num_experts_per_tok"]
                      * c["num_hidden_layers"])  # not every expert's
    count, said = st.model_flops_per_token(spec, prof, seq)
    idle = (c["num_local_experts"] - c["num_experts_per_tok"]) * 3 * c["hidden_size"] * c[
        "intermediate_size"] * c["num_hidden_layers"]
    layers, heads, head_dim = attention_shape(spec.config())
    assert count == pytest.approx(6 * (spec.num_parameters - idle) + 12 * layers * heads * head_dim * seq)
    assert "2 of 8 experts" in said
    assert 0 < st.estimate_step_time(spec, 2, batch=2, seq=seq).mfu <= 1


@pytest.mark.parametrize("knobs", [
    dict(ac="selective", plan_options={"lora_rank": 8}),
    dict(ac="every-2nd-block", fp8=True, compile=True, gpu="h100"),
    dict(tp=2, batch=16, compile=True, gpu="a100-80gb"),
    dict(model="t5-small", seq=512, batch=32, precision="fp32", plan_options={"trainable": 0.5}),
], ids=["lora-selective", "fp8-compile", "tp2", "t5-fp32-trainable"])
def test_mfu_is_at_most_one_for_every_knob(knobs):
    """MFU never passes 100% of the bf16 peak, whatever the knob (llama-1b at a batch where the
    matmuls dominate)."""
    from utilities.measure.plan_options import PlanOptions

    knobs = dict(knobs)
    po = knobs.pop("plan_options", None)
    model, batch, seq = knobs.pop("model", "llama-1b"), knobs.pop("batch", 8), knobs.pop("seq", 2048)
    t = st.estimate_step_time(model, 8, batch=batch, seq=seq,
                              plan_options=PlanOptions(**po) if po else None, **knobs)
    assert 0 < t.mfu <= 1
