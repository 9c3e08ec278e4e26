"""Plan the code you run: a sharding function and a model builder the course never saw, planned on
fake tensors and held to real 2-rank CPU runs of the same code; what cannot be planned is one line.

The tolerance is lesson 14's plan-vs-run check (``tests/test_lesson_14.py``: within 10% of the peak
the same tracker measures on real tensors)."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import cli_here, lesson_module

from utilities.errors import UsageError
from utilities.measure.planner import largest_batch, plan
from utilities.models import get_model_spec

REPO = Path(__file__).resolve().parents[1]
GPT = REPO / "tests" / "your_gpt.py"
PLAN_VS_RUN = 0.10  # lesson 14's: planned peak within 10% of the measured one
BATCH, SEQ = 4, 64


def _yours(name: str):
    sys.path.insert(0, str(GPT.parent))
    try:
        import your_gpt
    finally:
        sys.path.remove(str(GPT.parent))
    return getattr(your_gpt, name)


def test_lesson_01s_two_wrap_functions_plan_as_measured():
    """``parallelize=`` lesson 01's own ``wrap_fsdp2``, both ways it is called: its plan of each is
    the peak lesson 01 measured (t5-tiny, 2 CPU ranks, fp32, batch 4 x 64) within the tolerance,
    as close as today's plan (the course's own per-block sequence) is on per-block; and the
    one-unit plan, which the course's sequence cannot make, holds the whole model unsharded
    (measured: today's plan and wrap_fsdp2 per block both +2.75%, one unit +2.05%)."""
    lesson = lesson_module("01")
    measured = {v["name"]: v["peak_memory_bytes"]["total"] for v in json.loads(
        (REPO / "lessons/01_auto_wrap/results_cpu.json").read_text())["variants"]}
    block = get_model_spec("t5-tiny").block_class()
    args = ("t5-tiny", 2, 10**12, "full_shard", "fp32", "none", BATCH, SEQ, "cpu")
    today = plan(*args).peak_bytes["total"]
    one = plan(*args, parallelize=lesson.wrap_fsdp2)
    per_block = plan(*args, parallelize=functools.partial(
        lesson.wrap_fsdp2, is_unit=lambda m: isinstance(m, block)))
    err_today = abs(today / measured["fsdp2-per-block"] - 1)
    assert err_today <= PLAN_VS_RUN
    assert per_block.peak_bytes["total"] == pytest.approx(measured["fsdp2-per-block"], rel=PLAN_VS_RUN)
    assert abs(per_block.peak_bytes["total"] / measured["fsdp2-per-block"] - 1) <= err_today + 0.005
    assert one.peak_bytes["total"] == pytest.approx(measured["fsdp2-one-unit"], rel=PLAN_VS_RUN)
    assert one.detail["unsharded_parameters"] > 4 * per_block.detail["unsharded_parameters"]


def test_a_gpt_the_course_never_saw_plans_as_it_runs(tmp_path):
    """``--model tests/your_gpt.py:build --parallelize tests/your_gpt.py:shard``: the planned peak of
    a small GPT sharded by its own function is a real 2-rank gloo run's of the same two functions
    (measured: planned 6,918,876 B, run 6,916,828 B: +0.03%)."""
    out = tmp_path / "real.json"
    subprocess.run([sys.executable, str(REPO / "tests" / "your_code_run.py"), str(out), str(BATCH),
                    str(SEQ)], check=True, cwd=REPO, capture_output=True, timeout=300)
    real = json.loads(out.read_text())
    p = plan(f"{GPT}:build", 2, 10**12, "full_shard", "fp32", "none", BATCH, SEQ, "cpu",
             parallelize=f"{GPT}:shard")
    assert p.model.endswith("your_gpt.py:build sharded by " + f"{GPT}:shard")
    assert p.peak_bytes["total"] == pytest.approx(real["total"], rel=PLAN_VS_RUN), (p.peak_bytes, real)
    assert p.peak_bytes["optimizer"] == pytest.approx(real["optimizer"], rel=0.02)
    python = plan(_yours("build"), 2, 10**12, "full_shard", "fp32", "none", BATCH, SEQ, "cpu",
                  parallelize=_yours("shard"))
    assert python.peak_bytes == p.peak_bytes  # the Python functions: the same plan


def test_the_cli_plans_your_code_with_time_and_max_batch(tmp_path):
    """Everything plan reports comes from your functions: the table, reserved memory, the step
    time (its MFU from the traced FLOPs, and says so), ``--trace`` and ``--max-batch``."""
    trace = tmp_path / "t.json"
    proc = cli_here("plan", "--model", f"{GPT}:build", "--parallelize", f"{GPT}:shard", "--gpus", "2",
                    "--batch", "2", "--seq", "64", "--gpu-memory", "80GB", "--trace", str(trace))
    assert proc.returncode == 0, proc.stderr
    out = " ".join(proc.stdout.split())
    assert "sharded by" in out and "FITS" in out and "reserved (caching allocator" in out
    assert "FLOPs per token of the traced forward and backward" in out and "6N" not in out.split(
        "MFU:")[-1].split("bf16")[0]
    assert json.loads(trace.read_text())["traceEvents"]
    best, p = largest_batch(f"{GPT}:build", 2, 2 * 10**7, strategy="full_shard", precision="fp32",
                            ac="none", seq=SEQ, device_type="cpu", parallelize=f"{GPT}:shard")
    assert best >= 1 and p.fits and p.batch == best
    assert not plan(f"{GPT}:build", 2, 2 * 10**7, "full_shard", "fp32", "none", best + 1, SEQ, "cpu",
                    parallelize=f"{GPT}:shard").fits


def test_a_forward_of_its_own_plans_with_a_batch_function():
    p = plan(f"{GPT}:build_tagger", 2, 10**12, "full_shard", "fp32", "none", 2, 16, "cpu",
             batch_fn=f"{GPT}:tagger_batch")
    assert p.peak_bytes["total"] > 0 and p.detail


@pytest.mark.parametrize("flags, said", [
    (["--model", f"{GPT}:build_raises"], "the builder raised ValueError: no such size"),
    (["--model", f"{GPT}:build_not_a_module"], "returns an nn.Module (it returned int)"),
    (["--model", f"{GPT}:build_tagger"], "does not take input_ids and labels"),
    (["--model", f"{GPT}:no_such_function"], "a function of your_gpt.py: build"),
    (["--model", "/no/such/file.py:build"], "no such file"),
    (["--parallelize", f"{GPT}:nope"], "--parallelize"),
    (["--parallelize", f"{GPT}:build"], "--parallelize"),
    (["--parallelize", f"{GPT}:shard", "--ac", "full"], "your function checkpoints"),
    (["--parallelize", f"{GPT}:shard"], "it raised AttributeError"),  # llama-tiny has no .h
])
def test_what_cannot_be_planned_is_one_line(flags, said):
    """A builder that raises or returns a non-module, a forward without Hugging Face's convention
    (and no --batch-fn: the line says which to write), a missing file or function, a sharding
    function that fails: one line each, exit 2."""
    proc = cli_here("plan", "--gpus", "2", "--no-time", "--model", "llama-tiny", *flags)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and said in lines[0], proc.stderr


def test_an_op_fake_tensors_cannot_run_is_named(tmp_path):
    """A step whose output depends on the data (``nonzero``) is refused naming the op."""
    user = tmp_path / "data_dependent.py"
    user.write_text(
        "import torch\nfrom torch import nn\n\n\nclass M(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.emb = nn.Embedding(16, 8)\n\n"
        "    def forward(self, input_ids, labels):\n"
        "        x = self.emb(input_ids)\n        return x[x > 0].sum()\n\n\n"
        "def build():\n    return M()\n")
    with pytest.raises(UsageError, match=r"aten\.\w+.*cannot run on fake tensors"):
        plan(f"{user}:build", 2, 10**12, "full_shard", "fp32", "none", 1, 8, "cpu")


def test_a_lessons_prediction_traces_the_lessons_own_wrap_function():
    """A variant's ``parallelize`` (lesson 06's ``shard_fsdp2``, behind a spy) is what the cluster
    prediction traces: it gets the model, the planned mesh and the prediction's bf16 policy, and
    its row names it; a variant without one is the course's sequence from its knobs. Where the
    lesson's function shards as the course's sequence does, the time is the same (within 1%)."""
    import torch

    from utilities.measure.predictions import Cluster, predict_variants

    lesson = lesson_module("06")
    block = get_model_spec("llama-tiny").block_class()
    calls = []

    def spy(model, *, mesh, mp_policy):
        calls.append((mesh.size(), mp_policy.param_dtype))
        lesson.shard_fsdp2(model, block, mesh=mesh, reshard_after_forward=True, mp_policy=mp_policy)

    predicted = predict_variants("llama-tiny", Cluster(1, 2, "h100"),
                                 {"own": {"parallelize": spy}, "knobs": {}}, batch=2, seq=64)
    assert calls and set(calls) == {(2, torch.bfloat16)}
    own, knobs = predicted["variants"]
    assert own["traced"].startswith("the lesson's own test_plan_your_code.py:") and "spy" in own["traced"]
    assert "utilities.parallelize" in knobs["traced"]
    assert own["step_s"] == pytest.approx(knobs["step_s"], rel=0.01)


@pytest.mark.parametrize("ac, strategy, takes_policy, offload, said", [
    ("selective", "full_shard", True, False, "ac 'selective' is not allowed"),
    ("none", "no_shard", True, False, "strategy 'no_shard' is not allowed"),
    ("none", "full_shard", False, False, "a function that takes mp_policy"),
    ("none", "full_shard", True, True, "would count twice"),
])
def test_a_knob_the_lessons_function_decides_is_refused_in_one_line(ac, strategy, takes_policy,
                                                                      offload, said):
    """Activation checkpointing, DDP, offload, and bf16 for a function that cannot be given its
    policy: the lesson's function decides them, so a knob saying otherwise is one line, never
    ignored (its checkpointing read from the model it shards: here none)."""
    from utilities.measure.plan_options import PlanOptions
    from utilities.measure.predictions import Cluster, predict_variants

    lesson = lesson_module("13")
    block = get_model_spec("llama-tiny").block_class()

    def with_policy(model, *, mesh, mp_policy):
        if ac == "none":
            raise AssertionError("refused before the trace")
        lesson.shard(model, block, mp_policy)  # no checkpointing

    def without_policy(model, *, mesh):
        raise AssertionError("refused before the trace")

    wrap = with_policy if takes_policy else without_policy
    with pytest.raises(UsageError) as e:
        predict_variants("llama-tiny", Cluster(1, 2, "h100"),
                         {"v": {"parallelize": wrap, "strategy": strategy,
                                "plan_options": PlanOptions(offload=offload)}}, ac=ac, batch=2, seq=64)
    assert said in str(e.value) and "\n" not in str(e.value)


OWN_VS_KNOBS = 0.01  # a lesson's own function against the course's sequence of the same knobs


def _rows(predicted: dict) -> dict:
    return {v["name"]: v for v in predicted["variants"]}


def test_lesson_16s_offload_prediction_reads_the_policy_from_wrap_fsdp2():
    """Lesson 16's fsdp2-offload row traces its ``wrap_fsdp2``; the planner reads the
    CPUOffloadPolicy it passes from the model it shards, so the row is the knob row's (FSDP1's: the
    course's sequence with ``PlanOptions(offload=True)``) within 1%: the time model's copies and
    host AdamW, counted once. Measured on t5-tiny: -0.08%; the offload dropped, -4.8%; the
    policy traced as well (FSDP2's per-parameter copy-in casts under offload), +4.2% (t5-large on
    2 x 8 H100: +2.9%)."""
    import importlib

    from utilities.measure.predictions import Cluster, predict_variants

    lesson = lesson_module("16")
    driver = importlib.import_module("cpu_offload_run")  # beside the script, on sys.path with it
    knobs = driver.prediction_knobs(lesson, ["fsdp2-offload", "fsdp1-offload"],
                                    get_model_spec("t5-tiny").block_class())
    rows = _rows(predict_variants("t5-tiny", Cluster(1, 2, "h100"), knobs, batch=2, seq=64))
    own, knob = rows["fsdp2-offload"], rows["fsdp1-offload"]
    assert own["traced"].startswith("the lesson's own cpu_offload.py:wrap_fsdp2(") and "offload=True" in own[
        "traced"] and "CPUOffloadPolicy" in own["traced"]
    assert "utilities.parallelize" in knob["traced"]
    assert own["step_s"] == pytest.approx(knob["step_s"], rel=OWN_VS_KNOBS)


def test_lesson_13s_prediction_reads_the_checkpointing_of_checkpoint_and_shard():
    """Lesson 13's rows trace its ``checkpoint_and_shard`` (op-level selective checkpointing, then
    ``shard``): within 1% of the course's sequence with ``ac="selective"``, recomputing in
    backward; a knob naming other checkpointing is one line."""
    from utilities.measure.predictions import Cluster, predict_variants

    lesson = lesson_module("13")
    own = functools.partial(lesson.checkpoint_and_shard,
                            block_class=get_model_spec("llama-tiny").block_class())
    cluster = Cluster(1, 2, "h100")
    rows = _rows(predict_variants("llama-tiny", cluster, {"own": {"parallelize": own, "compile": True},
                                                          "knobs": {"compile": True}},
                                  ac="selective", batch=2, seq=64))
    assert rows["own"]["traced"].startswith("the lesson's own fp8_compile.py:checkpoint_and_shard(")
    assert rows["own"]["step_s"] == pytest.approx(rows["knobs"]["step_s"], rel=OWN_VS_KNOBS)
    assert any(e["phase"] == "recompute" for e in rows["own"]["timeline"])
    with pytest.raises(UsageError, match=r"ac 'full' is not allowed.*checkpoints what it checkpoints"):
        predict_variants("llama-tiny", cluster, {"own": {"parallelize": own}}, ac="full", batch=2, seq=64)


def test_lesson_12s_2d_rows_trace_apply_2d_on_the_2d_mesh():
    """Lesson 12's 2-D rows trace its ``apply_2d`` (sequence parallel, op-level checkpointing, bf16)
    on the mesh the trace gives it (it slices ``mesh["tp"]`` and ``mesh["dp"]``: what the function
    decides is read on that mesh too) and are the course's 2-D sequence of the same knobs within 1%
    (llama-8b on 8 H100: -0.1 to -0.4%, the root keeping its weights; the same planned peak)."""
    from utilities.measure.predictions import Cluster, predict_variants

    lesson = lesson_module("12")
    own = lesson.prediction_knobs("llama-tiny", 2, 4)["2d-tp2"]
    knobs = {k: v for k, v in own.items() if k != "parallelize"}
    rows = _rows(predict_variants("llama-tiny", Cluster(1, 4, "h100"), {"own": own, "knobs": knobs},
                                  ac="selective", batch=2, seq=64))
    assert rows["own"]["traced"].startswith("the lesson's own tensor_parallel.py:apply_2d(")
    assert rows["own"]["step_s"] == pytest.approx(rows["knobs"]["step_s"], rel=OWN_VS_KNOBS)
    assert rows["own"]["comm_s"] == pytest.approx(rows["knobs"]["comm_s"], rel=1e-6)


def test_lesson_17s_rows_say_why_its_ring_is_not_traced():
    """Lesson 17's ring (``shard_over_dp_and_cp``, ``use_ring``) is written for its TinyLlama, not
    the Hugging Face Llama its prediction plans: every row is the course's sequence and its
    ``traced`` says why."""
    from utilities.measure.predictions import Cluster, predict_variants

    lesson = lesson_module("17")
    knobs = lesson.prediction_knobs(2)
    assert set(knobs) == {"fsdp-only", "fsdp-cp2"}
    rows = _rows(predict_variants("llama-tiny", Cluster(1, 2, "h100"), {"fsdp-only": knobs["fsdp-only"]},
                                  batch=2, seq=64))
    traced = rows["fsdp-only"]["traced"]
    assert "utilities.parallelize" in traced and "not traced" in traced and "TinyLlama" in traced
