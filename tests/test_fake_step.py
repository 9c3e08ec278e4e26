"""The one fake step (``utilities.measure.fake_step``) that the planner's memory and the time model
both read: a deep model traced at two small depths and scaled equals the model traced block by
block, to the byte (the peak by category, the states held, the allocator's replay) and to the
microsecond (the predicted step)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from utilities.measure import depth_scaling, fake_step
from utilities.measure import step_time as st
from utilities.measure.fake_step import StepConfig
from utilities.measure.plan_options import PlanOptions
from utilities.models import get_model_spec

# llama-1b: 16 blocks; short sequences keep each trace to a few seconds
CASES = {
    "selective, bf16": dict(world=8, strategy="full_shard", precision="bf16", ac="selective",
                            batch=1, seq=256),
    "HSDP, fp32, accumulation": dict(world=16, strategy="hybrid_shard", precision="fp32", ac="none",
                                     batch=2, seq=128, shard_size=8,
                                     options=PlanOptions(grad_accum=2, accum_sync="last")),
    "2-D, tp 2": dict(world=4, strategy="full_shard", precision="bf16", ac="none", batch=1,
                      seq=128, tp=2),
    "block pairs, LoRA": dict(world=4, strategy="full_shard", precision="bf16",
                              ac="every-2nd-block", batch=1, seq=128,
                              options=PlanOptions(lora_rank=8)),
    "compiled blocks": dict(world=8, strategy="full_shard", precision="bf16", ac="none", batch=1,
                            seq=256, compile=True),
}
# T5 (t5-tiny's blocks, 8 in each stack): the encoder and the decoder extended one after the other
T5_CASES = {
    "T5, full_shard": dict(world=4, strategy="full_shard", precision="bf16", ac="none", batch=1,
                           seq=64),
    "T5, selective": dict(world=4, strategy="full_shard", precision="bf16", ac="selective", batch=1,
                          seq=64),
}
CASES.update(T5_CASES)


T5_SPEC = depth_scaling.with_layers(get_model_spec("t5-tiny"), 8)  # one object: one cache key


def _spec(case):
    return T5_SPEC if case in T5_CASES else get_model_spec("llama-1b")


def _both(case):
    spec = _spec(case)
    kw = dict(CASES[case])
    return (fake_step.trace(spec, StepConfig(scale=True, **kw)),
            fake_step.trace(spec, StepConfig(scale=False, **kw)))


def _assert_same_ops(scaled, full):
    """What the time model reads: the units, the collectives and every op of every segment."""
    assert [u.name for u in scaled.units] == [u.name for u in full.units]
    assert [u.shapes for u in scaled.units] == [u.shapes for u in full.units]
    assert scaled.collectives == full.collectives
    assert scaled.backward_collectives_from == full.backward_collectives_from
    assert len(scaled.segments) == len(full.segments)
    for a, b in zip(scaled.segments, full.segments):
        assert (a.unit, a.phase) == (b.unit, b.phase)
        for name in ("kind", "flops", "nbytes", "fp32", "fp8_ok"):
            assert np.array_equal(getattr(a, name), getattr(b, name)), (a.unit, a.phase, name)


@pytest.mark.parametrize("case", list(CASES))
def test_a_scaled_trace_is_the_full_trace_to_the_byte(case):
    scaled, full = _both(case)
    assert scaled.traced_layers and not full.traced_layers  # it did scale
    assert scaled.peak == full.peak
    assert scaled.states == full.states
    assert scaled.largest_unit_shard == full.largest_unit_shard
    _assert_same_ops(scaled, full)
    if scaled.reserved_scaled_linearly:  # block pairs: the replay is scaled, within 1%
        assert scaled.reserved()["reserved"] == pytest.approx(full.reserved()["reserved"], rel=0.01)
    else:
        assert scaled.reserved() == full.reserved()
        offloaded = frozenset({"Sharded Param", "OptState"})
        assert scaled.reserved(offloaded) == full.reserved(offloaded)


@pytest.mark.parametrize("case", ["selective, bf16", "T5, full_shard"])
def test_a_scaled_trace_predicts_the_step_to_the_microsecond(monkeypatch, case):
    """The cases above, timed (their traces come from the cache the byte test filled)."""
    c = CASES[case]
    kw = dict(model=_spec(case), gpus=c["world"], precision=c["precision"], ac=c["ac"],
              batch=c["batch"], seq=c["seq"])
    scaled = st.estimate_step_time(**kw)
    monkeypatch.setattr(st, "trace", lambda spec, config: fake_step.trace(
        spec, dataclasses.replace(config, scale=False)))
    full = st.estimate_step_time(**kw)
    assert scaled.step_s == pytest.approx(full.step_s, abs=1e-6)
    assert scaled.compute_s == pytest.approx(full.compute_s, abs=1e-6)
    assert scaled.comm_s == pytest.approx(full.comm_s, abs=1e-6)
    assert scaled.per_unit.keys() == full.per_unit.keys()
    for unit in full.per_unit:
        assert scaled.per_unit[unit] == pytest.approx(full.per_unit[unit], abs=1e-6), unit


def test_blocks_that_differ_are_traced_whole():
    """Freezing the first blocks first (``--trainable``) makes blocks differ: no scaling; nor for a
    shallow model, nor T5 with a shallow stack."""
    spec = get_model_spec("llama-1b")
    assert depth_scaling.scaled_depths(spec, "none") == (5, 6)  # one trace; the second for a check
    assert depth_scaling.scaled_depths(spec, "every-2nd-block") == (10, 12)
    assert depth_scaling.scaled_depths(spec, "none", PlanOptions(trainable=0.5)) is None
    assert depth_scaling.scaled_depths(get_model_spec("llama-tiny"), "none") is None
    assert depth_scaling.scaled_depths(get_model_spec("t5-small"), "none") is None  # 6 blocks a stack
    assert depth_scaling.scaled_depths(get_model_spec("t5-base"), "none") == (5, 6)


def test_t5_under_full_checkpointing_is_traced_whole():
    """Under full checkpointing T5's decoder blocks free what blocks beyond their neighbours made:
    extended to 6 blocks per stack, the 5 blocks' trace is not the trace of 6, so it is traced
    whole (``depth_scaling.checked``). Its ops alone (the time model's ``memory=False``) still
    extend from 5 blocks, exactly."""
    spec = T5_SPEC
    kw = dict(T5_CASES["T5, full_shard"], ac="full")
    assert depth_scaling.scaled_depths(spec, "full") == (5, 6)
    # the time model's trace (its ops only; asked first, so that no trace with memory serves it)
    # extends one depth all the same, and its ops are the whole trace's
    fake_step.clear_cache()
    ops = fake_step.trace(spec, StepConfig(scale=True, memory=False, **kw))
    assert ops.traced_layers == (5,) and ops.memory_events is None and not ops.peak
    whole = fake_step.trace(spec, StepConfig(scale=True, **kw))
    assert not whole.traced_layers
    _assert_same_ops(ops, whole)


def test_the_planner_and_the_time_model_share_one_trace():
    """``plan`` with its time prediction traces once: the time model finds the planner's trace in
    the cache."""
    from utilities.measure import plan_cli, planner

    fake_step.clear_cache()
    p = planner.plan("llama-tiny", 4, 80 * 2**30, ac="selective", batch=1, seq=64)
    plan_cli.predict_time(p)
    info = fake_step._trace.cache_info()
    assert (info.misses, info.hits) == (1, 1)


def test_foreach_adamw_scales_from_two_depths(monkeypatch):
    """The path a GPU host takes (AdamW's foreach, whose temporaries span every block), on CPU:
    two depths traced, every sample extended linearly; the peak and the states to the byte, the
    allocator's replay (extended linearly too) within 3%."""
    monkeypatch.setattr(fake_step, "adamw_foreach", lambda device: True)
    fake_step.clear_cache()
    spec = get_model_spec("llama-1b")
    kw = dict(strategy="full_shard", precision="bf16", ac="none", batch=1, seq=128)
    scaled = fake_step.trace(spec, StepConfig(4, scale=True, **kw))
    full = fake_step.trace(spec, StepConfig(4, scale=False, **kw))
    fake_step.clear_cache()
    assert scaled.traced_layers == (5, 6) and scaled.reserved_scaled_linearly
    assert scaled.peak == full.peak and scaled.states == full.states
    assert scaled.reserved()["reserved"] == pytest.approx(full.reserved()["reserved"], rel=0.03)


def test_one_step_configuration_from_the_cli_to_the_time_model():
    """The planner and the time model take one ``StepConfig`` (or the GPU count and its fields, by
    position or by name): the same step either way, the time model's own settings in a
    ``TimeConfig``; a name that is no field of either is a TypeError, as any unknown keyword."""
    from utilities.measure import planner

    config = StepConfig(2, "full_shard", "fp32", "none", 2, 32, "cpu")
    by_config = planner.plan("llama-tiny", config, 10**12)
    assert by_config.as_dict() == planner.plan("llama-tiny", 2, 10**12, "full_shard", "fp32", "none",
                                               2, 32, "cpu").as_dict()
    assert by_config.as_dict() == planner.plan("llama-tiny", gpus=2, gpu_memory_bytes=10**12,
                                               precision="fp32", batch=2, seq=32,
                                               device_type="cpu").as_dict()
    assert by_config.step_config() == dataclasses.replace(config, options=PlanOptions())
    timed = st.estimate_step_time("llama-tiny", config, timing=st.TimeConfig(gpu="h200", prefetch=0))
    named = st.estimate_step_time("llama-tiny", 2, precision="fp32", batch=2, seq=32, gpu="h200",
                                  prefetch=0)
    assert (timed.gpu, timed.step_s) == ("h200", named.step_s)
    with pytest.raises(TypeError):
        planner.plan("llama-tiny", 2, 10**12, batches=2)
    with pytest.raises(TypeError):
        st.estimate_step_time("llama-tiny", 2, gpu_count=8)
