"""The planner's memory mechanisms, each as the real code runs it: a transformers decoder's fake
batch attends as a real unpadded batch does (no seq x seq mask, K/V of the key/value heads only),
and ``--ac op`` keeps exactly what torchtitan's op-level selective policy keeps."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from utilities.models import get_model_spec

SEQ = 32


class _AttentionCalls(TorchDispatchMode):
    """Each SDPA kernel's (query heads, key heads) and the largest bool tensor any op made."""

    def __init__(self):
        super().__init__()
        self.heads: list[tuple[int, int]] = []
        self.largest_bool = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if "scaled_dot_product" in str(func) and "backward" not in str(func):
            self.heads.append((args[0].shape[1], args[1].shape[1]))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.bool:
                self.largest_bool = max(self.largest_bool, t.numel())
        return out


def _attention_of(batch_of) -> _AttentionCalls:
    from utilities.measure.hf_masks import one_sequence_per_row

    spec = get_model_spec("llama-tiny")
    model = spec.build(device="meta")
    calls = _AttentionCalls()
    with FakeTensorMode(allow_non_fake_inputs=True), one_sequence_per_row():
        model.to_empty(device="cpu")
        batch = batch_of(spec)
        with calls:
            model(**batch).loss.backward()
    return calls


def test_a_decoders_fake_batch_attends_as_a_real_unpadded_batch():
    """The planner's batch (no mask, one sequence per row) reaches SDPA with K/V of the
    key/value heads and no seq x seq mask, as a real step with an all-ones mask does; a fake
    all-ones mask, whose values transformers cannot read, repeats K/V and builds the mask."""
    from utilities.measure.fake_step import fake_batch

    config = get_model_spec("llama-tiny").config()
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    assert kv_heads < heads  # grouped-query attention, else the test shows nothing
    planned = _attention_of(lambda spec: fake_batch(spec, 2, SEQ, torch.device("cpu")))
    assert "attention_mask" not in fake_batch(get_model_spec("llama-tiny"), 2, SEQ, torch.device("cpu"))
    assert planned.heads and set(planned.heads) == {(heads, kv_heads)}
    assert planned.largest_bool < SEQ * SEQ

    def all_ones_mask(spec):
        ids = torch.randint(0, 100, (2, SEQ))
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}

    masked = _attention_of(all_ones_mask)
    assert set(masked.heads) == {(heads, heads)} and masked.largest_bool >= SEQ * SEQ


class _Ctx:
    def __init__(self, is_recompute: bool):
        self.is_recompute = is_recompute


def test_op_policy_saves_torchtitans_list_but_every_second_mm():
    """torchtitan's December 2024 ``_custom_policy``: mm outputs kept but every second one of a
    block (counted afresh in the recomputation), attention and the reduce-scatter kept, the rest
    (addmm, bmm, pointwise) recomputed."""
    from torch.utils.checkpoint import CheckpointPolicy

    from utilities.activation_checkpointing import torchtitan_op_policy

    aten = torch.ops.aten
    policy = torchtitan_op_policy()
    save = CheckpointPolicy.MUST_SAVE

    def kept(op, recompute=False):
        return policy(_Ctx(recompute), op) == save

    assert [kept(aten.mm.default) for _ in range(7)] == [True, False] * 3 + [True]
    assert kept(aten.mm.default, recompute=True) and not kept(aten.mm.default, recompute=True)
    assert kept(aten._scaled_dot_product_flash_attention.default)
    assert kept(torch.ops._c10d_functional.reduce_scatter_tensor.default)
    for op in (aten.addmm.default, aten.bmm.default, aten.silu.default, aten.mul.Tensor):
        assert not kept(op)


@pytest.mark.parametrize("model, same", [("llama-tiny", True)])
def test_op_mode_plans_torchtitans_policy_through_apply_ac(model, same):
    """``--ac op`` goes through ``parallelize.apply_ac``: on a Llama (no biases: every
    projection an mm, attention flash) it keeps what the course's selective keeps, and both keep
    less than no checkpointing and more than full."""
    from utilities.measure.planner import plan

    def activations(ac):
        return plan(model, 2, 10**12, "full_shard", "bf16", ac, 2, 64, "cpu").peak_bytes["activations"]

    op = activations("op")
    assert (op == activations("selective")) is same
    assert activations("full") < op < activations("none")


def test_sharded_gradients_stay_cached_on_the_reduce_scatter_stream():
    """FSDP2 allocates the reduce-scatter's output, which the sharded gradients are views of, on
    its reduce-scatter stream, and the reduce-scatter's input on the compute stream: freed by
    ``zero_grad``, gradient blocks are cached where the next step's activations cannot take
    them, reduce-scatter inputs where they can. The fake step's trace books the gradients under
    the category the replay puts on that stream."""
    from utilities.measure.fake_step import StepConfig, trace
    from utilities.measure.step_trace import STREAMS, MemoryEvents

    mib = 1 << 20

    def reserved(category):
        step = [("alloc", "x", 64 * mib, "Temp"), ("ref", "x", 0, category), ("free", "x", 0, None),
                ("alloc", "act", 64 * mib, "Activation"), ("free", "act", 0, None)]
        return MemoryEvents(step=step, device_type="cuda").reserved()["reserved"]

    assert reserved("Sharded Grad") == 128 * mib  # a pool of its own
    assert reserved("Reduce Scatter") == 64 * mib  # the compute stream's blocks, reused
    events = trace("llama-tiny", StepConfig(2, "full_shard", "bf16", "none", 2, 64)).memory_events
    booked = {category for kind, _, _, category in events.step if kind in ("alloc", "ref")}
    assert {"Sharded Grad", "All Gather"} <= booked and set(STREAMS) <= booked
