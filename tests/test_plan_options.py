"""`plan`'s options (utilities.measure.plan_options): each moves memory and time as its mechanism
says, matches a real 2-rank CPU run of the same setting within the planner's 10%, lesson 09's
measured frozen-encoder savings, and answers a bad value in one line. And the reserved peak: the
caching allocator's model beside the tracker's allocated peak."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO, cli_here

from utilities.measure import plan_cli, plan_sweep
from utilities.measure import planner as P
from utilities.measure.allocator import CachingAllocator
from utilities.measure.plan_options import PlanOptions
from utilities.measure.step_time import estimate_step_time
from utilities.models import get_model_spec

MODEL, BATCH, SEQ = "llama-tiny", 2, 64
REAL_CONFIGS = [{}, {"grad_accum": 3, "accum_sync": "last"}, {"grad_accum": 3},
                {"reshard_after_forward": False}, {"trainable": 0.5}, {"lora_rank": 8},
                {"param_dtype": "bf16"},
                {"param_dtype": "bf16", "grad_accum": 3, "accum_sync": "last", "reduce_dtype": "fp32"}]


def tiny(gpus: int = 2, **options) -> P.Plan:
    return P.plan(MODEL, gpus, 10**12, "full_shard", "bf16", "none", BATCH, SEQ, "cpu",
                  options=options)


@pytest.fixture(scope="module")
def real_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("plan_options") / "real.json"
    subprocess.run([sys.executable, str(REPO / "tests" / "plan_options_run.py"), str(out), MODEL,
                    str(BATCH), str(SEQ), json.dumps(REAL_CONFIGS)], check=True, cwd=REPO,
                   capture_output=True, timeout=600)
    return json.loads(out.read_text())


@pytest.mark.parametrize("index", range(len(REAL_CONFIGS)),
                         ids=[json.dumps(c) for c in REAL_CONFIGS])
def test_each_option_matches_a_real_cpu_run(real_runs, index):
    """The real run: gloo, 2 ranks, real tensors, FSDPMemTracker (lessons' MemoryProbe); planned:
    fake tensors, fake process group (measured: +1.8% to +3.3%)."""
    row = real_runs[index]
    assert row["options"] == REAL_CONFIGS[index]
    p = tiny(2, **row["options"])
    for c in ("total", "optimizer"):
        assert p.peak_bytes[c] == pytest.approx(row["measured"][c], rel=0.10), c


def test_offload_leaves_what_is_gathered_and_the_activations():
    base, off = tiny(4), tiny(4, offload=True)
    moved = base.detail["sharded_parameters"] + base.peak_bytes["optimizer"]
    assert off.peak_bytes["optimizer"] == 0
    assert off.peak_bytes["total"] == base.peak_bytes["total"] - moved + off.detail["offload_staging"]
    assert off.peak_bytes["activations"] == base.peak_bytes["activations"]
    psi = base.parameters_total
    assert off.host["per_node_bytes"] == pytest.approx(16 * psi, rel=0.01)  # 16 B/param / 4 x 4 ranks
    assert off.host["fits"]
    small = P.plan(MODEL, 4, 10**12, "full_shard", "bf16", "none", 2, 64, "cpu",
                   options=PlanOptions(offload=True, host_memory_bytes=10**6))
    assert not small.host["fits"] and not small.fits
    t0 = estimate_step_time(MODEL, 16, batch=2, seq=64)
    t1 = estimate_step_time(MODEL, 16, batch=2, seq=64, plan_options=PlanOptions(offload=True))
    assert t1.optimizer_s > 100 * t0.optimizer_s and t1.comm_s > t0.comm_s
    assert any("PCIe" in a and "host CPU" in a for a in t1.assumptions)


def test_offload_host_optimizer_is_the_measured_one_thread_rate():
    """--offload's optimizer step is the rank's trainable shard at the host AdamW rate of one thread
    (torchrun's OMP_NUM_THREADS=1), fp32 and bf16 parameters each at their own rate, and those
    rates are the ones benchmarks/plan_options_check.py measured and committed."""
    from utilities.measure.gpu_catalogue import HOST_ADAMW_PARAMS_PER_S

    psi = tiny().parameters_total
    for dtype in ("fp32", "bf16"):
        t = estimate_step_time(MODEL, 16, batch=2, seq=64,
                               plan_options=PlanOptions(offload=True, param_dtype=dtype))
        assert t.optimizer_s == pytest.approx(psi / 16 / HOST_ADAMW_PARAMS_PER_S[dtype], rel=0.05)
    bench = json.loads((REPO / "benchmarks" / "results" / "plan_options_check.json").read_text())
    row = next(r for r in bench["rows"] if r["source"].startswith("measured here"))
    one = {c["dtype"]: c["params_per_s"] for c in row["cases"]
           if c["threads"] == 1 and not c["foreach"]}
    assert HOST_ADAMW_PARAMS_PER_S["fp32"] == pytest.approx(one["float32"], rel=0.10)
    assert HOST_ADAMW_PARAMS_PER_S["bf16"] == pytest.approx(one["bfloat16"], rel=0.10)


def test_accumulation_holds_sharded_or_unsharded_gradients():
    """every: the fp32 gradient shards (4 B / param / N) stay between micro-batches; last: the
    unsharded bf16 gradients of the whole model (2 B / param), as set_requires_gradient_sync(False)
    keeps them; time: a reduce-scatter per micro-batch only under every."""
    base, every, last = tiny(4), tiny(4, grad_accum=4), tiny(4, grad_accum=4, accum_sync="last")
    psi = base.parameters_total
    assert base.peak_bytes["gradients"] == 0
    assert every.peak_bytes["gradients"] == pytest.approx(4 * psi / 4, rel=0.02)
    assert last.peak_bytes["gradients"] == pytest.approx(2 * psi, rel=0.02)
    one = estimate_step_time(MODEL, 16, batch=2, seq=64)
    te = estimate_step_time(MODEL, 16, batch=2, seq=64, plan_options=PlanOptions(grad_accum=4))
    tl = estimate_step_time(MODEL, 16, batch=2, seq=64,
                            plan_options=PlanOptions(grad_accum=4, accum_sync="last"))
    assert te.step_s == pytest.approx(4 * one.step_s, rel=0.05)
    assert tl.comm_s < te.comm_s


def test_an_fp32_reduction_holds_fp32_unsharded_gradients_across_micro_batches():
    """bf16 parameters, gradients synced on the last micro-batch only: with an fp32 reduction
    FSDP2 upcasts the unsharded gradients to fp32 after the first micro-batch and accumulates them
    there (``FSDPParam.unsharded_accumulated_grad``), so the peak holds 2 bytes more per parameter
    than with a bf16 reduction, llama-tiny's 836,736 parameters: 1,673,472 bytes, and at most one
    block's bf16 gradients more (184,576 parameters, 369,152 bytes: a unit's gradients while they
    are upcast). Synced every micro-batch, the sharded gradients stay bf16: the peak moves by
    less than that one block's (a reduce-scatter buffer in fp32)."""
    base = dict(param_dtype="bf16", grad_accum=4)
    last_bf16 = tiny(2, **base, accum_sync="last")
    last_fp32 = tiny(2, **base, accum_sync="last", reduce_dtype="fp32")
    parameters = get_model_spec(MODEL).num_parameters
    assert parameters == 836_736
    # booked as gradients (the tracker's unsharded gradients), not temporaries: every parameter's
    assert (last_bf16.peak_bytes["gradients"], last_fp32.peak_bytes["gradients"]) == (2 * parameters,
                                                                                      4 * parameters)
    held = last_fp32.peak_bytes["total"] - last_bf16.peak_bytes["total"]
    assert 2 * parameters <= held <= 2 * parameters + 369_152, held
    every = [tiny(2, **base, reduce_dtype=r).peak_bytes["total"] for r in ("bf16", "fp32")]
    assert 0 <= every[1] - every[0] < 369_152, every


def test_planner_check_holds_the_accumulation_runs_to_the_plan():
    """benchmarks/results/planner_check-cpu.json: planner_check_accum.py's real 2-rank steps (bf16
    parameters, 4 micro-batches, both syncs, bf16 and fp32 reductions) against the plan, within
    2% (the same tracker on both: measured 0.0%); the fp32 reduction synced last re-planned now
    within 2% of its measured peak, which a plan without --reduce-dtype misses by 12%."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import planner_check_accum as accum

    rows = json.loads((REPO / "benchmarks/results/planner_check-cpu.json").read_text())["rows"]
    mine = {r["source"].split(":", 1)[1]: r for r in rows if r["source"].startswith(accum.NAME)}
    assert sorted(mine) == sorted(accum.config_name(*c) for c in accum.CONFIGS)
    for r in mine.values():
        assert abs(r["relative_error"]) <= 0.02, r["source"]
    row = mine[accum.config_name("last", "fp32")]
    fresh = P.plan(row["model"], row["gpus"], 10**12, precision=row["precision"], ac=row["ac"],
                   batch=row["batch"], seq=row["seq"], device_type="cpu", options=row["options"])
    assert fresh.peak_bytes["total"] == pytest.approx(row["measured_bytes"], rel=0.02)


def test_reshard_after_forward_false_keeps_the_gathered_parameters_and_skips_backward_gathers():
    keep = tiny(4, reshard_after_forward=False)
    assert keep.peak_bytes["parameters"] > tiny(4).peak_bytes["parameters"]
    assert keep.peak_bytes == P.plan(MODEL, 4, 10**12, "shard_grad_op", "bf16", "none", 2, 64,
                                     "cpu").peak_bytes
    t = {r: estimate_step_time(MODEL, 16, batch=2, seq=64,
                               plan_options=PlanOptions(reshard_after_forward=r)).comm_s
         for r in (True, False, 8)}
    assert t[False] < t[8] <= t[True]


def test_frozen_and_lora_parameters_have_no_gradients_or_optimizer_state():
    base, half, lora = tiny(4), tiny(4, trainable=0.5), tiny(4, lora_rank=4)
    assert half.model_states["optimizer"] == pytest.approx(base.model_states["optimizer"] / 2, rel=0.05)
    assert lora.model_states["optimizer"] < base.model_states["optimizer"] / 10
    t0 = estimate_step_time(MODEL, 16, batch=2, seq=64)
    th = estimate_step_time(MODEL, 16, batch=2, seq=64, plan_options=PlanOptions(trainable=0.5))
    assert th.comm_s < t0.comm_s and th.optimizer_s < t0.optimizer_s


def test_bf16_parameters_halve_the_states_and_say_what_they_cost():
    base, bf = tiny(4), tiny(4, param_dtype="bf16")
    assert sum(bf.model_states.values()) == pytest.approx(sum(base.model_states.values()) / 2,
                                                          rel=0.01)
    assert any("mantissa" in w and "lesson 15" in w for w in bf.warnings)


def test_plan_trainable_agrees_with_lesson_09s_frozen_encoder():
    """Lesson 09's committed run freezes t5-tiny's encoder (58.3% of the parameters train):
    `plan --trainable` freezes the same tensors (optimizer state to the byte) and its saving in
    peak memory is the measured one within 10% (planned 9.23 MB, measured 9.44 MB)."""
    results = json.loads((REPO / "lessons" / "09_fine_tuning" / "results_cpu.json").read_text())
    v = {x["name"]: x for x in results["variants"]}
    full, frozen = v["full"], v["frozen-encoder"]
    fraction = frozen["trainable_parameters"] / (frozen["trainable_parameters"]
                                                 + frozen["frozen_parameters"])
    s = results["settings"]
    args = ("t5-tiny", results["world_size"], 10**12, "full_shard", "fp32", "none",
            s["batch_size"], s["seq_len"], "cpu")
    a, b = P.plan(*args), P.plan(*args, options={"trainable": fraction})
    measured = full["peak_memory_bytes"]["total"] - frozen["peak_memory_bytes"]["total"]
    assert a.peak_bytes["total"] - b.peak_bytes["total"] == pytest.approx(measured, rel=0.10)
    assert b.model_states["optimizer"] == frozen["peak_memory_bytes"]["optimizer"]


def test_reserved_is_the_allocators_replay_of_the_trackers_step():
    """On CPU, the replay's allocated peak is the tracker's (512 B rounding apart, within 1%);
    reserved is at least that."""
    p = tiny(2)
    r = p.reserved
    assert r["allocated"] == pytest.approx(p.peak_bytes["total"], rel=0.01)
    assert r["reserved"] >= r["allocated"]
    assert "reserved (caching allocator" in plan_cli.format_plan(p)


def test_the_allocator_rounds_splits_and_caches():
    a = CachingAllocator()
    small = a.malloc(1)
    assert a.allocated == 512 and a.reserved == 2 << 20
    big = a.malloc(5 << 20)  # a large request under 10 MiB takes a 20 MiB segment
    assert a.reserved == (2 << 20) + (20 << 20)
    a.free(big)
    a.malloc(15 << 20)  # reuses the cached segment: nothing new reserved
    assert a.reserved == (2 << 20) + (20 << 20)
    a.malloc(30 << 20)  # a new segment, rounded to 2 MiB
    assert a.reserved == (2 << 20) + (20 << 20) + (30 << 20)
    a.free(small)
    assert a.allocated == (15 << 20) + (30 << 20)


def test_json_max_batch_and_sweep_carry_the_options():
    proc = cli_here("plan", "--model", MODEL, "--gpus", "4", "--batch", "2", "--seq", "64",
                    "--gpu-memory", "80GiB", "--offload", "--grad-accum", "2", "--json")
    assert proc.returncode == 0, proc.stderr
    p = json.loads(proc.stdout)
    assert p["options"]["offload"] and p["options"]["grad_accum"] == 2
    assert p["host"]["fits"] and p["reserved"]["reserved"] >= p["reserved"]["allocated"]
    assert any("PCIe" in a for a in p["time"]["assumptions"])
    best, bp = P.largest_batch(MODEL, 2, 10**9, strategy="full_shard", precision="bf16", ac="none",
                               seq=64, device_type="cpu", limit=2, options={"lora_rank": 4})
    assert best == 2 and bp.options["lora_rank"] == 4
    plans = plan_sweep.sweep(MODEL, gpu_counts=(2, 4), precision="bf16", batch=2, seq=64,
                    device_type="cpu", options={"param_dtype": "bf16"})
    assert plans and all(p.options["param_dtype"] == "bf16" for p in plans)


def test_help_names_every_option():
    proc = cli_here("plan", "--help")
    for flag in ("--offload", "--host-memory", "--grad-accum", "--accum-sync",
                 "--reshard-after-forward", "--trainable", "--lora-rank", "--param-dtype",
                 "--reduce-dtype"):
        assert flag in proc.stdout
    assert max(len(line) for line in proc.stdout.splitlines()) <= 80


@pytest.mark.parametrize("flags, named", [
    (("--grad-accum", "0"), "--grad-accum"),
    (("--accum-sync", "sometimes"), "--accum-sync"),
    (("--reshard-after-forward", "maybe"), "--reshard-after-forward"),
    (("--reshard-after-forward", "3"), "--reshard-after-forward"),
    (("--trainable", "1.5"), "--trainable"),
    (("--trainable", "nan"), "--trainable"),
    (("--lora-rank", "-1"), "--lora-rank"),
    (("--trainable", "0.5", "--lora-rank", "4"), "--lora-rank"),
    (("--param-dtype", "fp8"), "--param-dtype"),
    (("--param-dtype", "bf16", "--precision", "fp32"), "--param-dtype"),
    (("--reduce-dtype", "fp16"), "--reduce-dtype"),
    (("--reduce-dtype", "bf16", "--precision", "fp32"), "--reduce-dtype"),
    (("--offload", "--strategy", "no_shard"), "--offload"),
    (("--offload", "--host-memory", "lots"), "--host-memory"),
])
def test_a_bad_option_is_one_line(flags, named):
    proc = cli_here("plan", "--model", MODEL, "--gpus", "4", "--no-time", *flags)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().count("\n") == 0 and named in proc.stderr and "allowed" in proc.stderr


def test_reshard_after_forward_n_files_the_kept_shards_under_parameters():
    """reshard_after_forward=2 keeps each unit's parameters on groups of 2 ranks until backward:
    parameters (as False files the whole gathered ones), not activations."""
    base, kept, whole = tiny(4), tiny(4, reshard_after_forward=2), tiny(4, reshard_after_forward=False)
    assert kept.detail["unsharded_parameters"] > base.detail["unsharded_parameters"]
    assert kept.peak_bytes["activations"] <= whole.peak_bytes["activations"]
    assert kept.peak_bytes["parameters"] > base.peak_bytes["parameters"]


def test_lora_under_selective_checkpointing_keeps_no_more_than_full_fine_tuning():
    """Op-level selective AC saves every second matmul's output: a LoRA Linear's adapter matmuls
    are not counted as matmuls of their own, so LoRA keeps no more activations than full
    fine-tuning (it kept 1.4x on llama-1b when they were)."""
    def activations(**options):
        return P.plan(MODEL, 2, 10**12, "full_shard", "bf16", "selective", 4, 256, "cpu",
                      options=options).peak_bytes["activations"]

    assert activations(lora_rank=8) <= activations()


def test_trainable_says_the_fraction_of_whole_tensors_planned():
    """--trainable trains whole tensors: the plan says how many parameters that is, which can be
    far more than asked."""
    import re

    from utilities.measure.plan_options import freeze_fraction
    from utilities.models import get_model_spec

    p = tiny(2, trainable=0.01)
    note = next(n for n in p.notes if n.startswith("--trainable 0.01 planned"))
    spec = get_model_spec(MODEL)
    model = spec.build(device="meta")
    blocks = [m for m in model.modules() if isinstance(m, spec.block_class())]
    trained = freeze_fraction(model, blocks, 0.01)
    assert f"{trained:,} of {spec.num_parameters:,}" in note
    shown = float(re.search(r"\(([\d.]+)%\)", note).group(1))
    assert shown == pytest.approx(100 * trained / spec.num_parameters, abs=0.01) and shown > 1


def test_an_odd_rotary_head_dim_is_one_line(tmp_path):
    """hidden 4000 over 32 heads: head_dim 125, which rotary embeddings cannot rotate."""
    path = tmp_path / "odd.json"
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 4000, "intermediate_size": 512,
                                "num_hidden_layers": 2, "num_attention_heads": 32,
                                "num_key_value_heads": 32, "vocab_size": 256}))
    r = cli_here("plan", "--model", str(path), "--no-time")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "head_dim" in lines[0] and "125" in lines[0], r.stderr
