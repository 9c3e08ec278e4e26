"""The planner's memory mechanisms, each as the real code runs it: a transformers decoder's fake
batch attends as a real unpadded batch does (no seq x seq mask, K/V of the key/value heads only),
and ``--ac op`` keeps exactly what torchtitan's op-level selective policy keeps."""

from __future__ import annotations

import contextlib

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


# -- torch.compile's memory (utilities.measure.compile_memory) -----------------------------------

def _activation_high_water(events) -> int:
    """The most bytes booked as activations at any point of the step (the forward's end)."""
    held: dict = {}
    now = best = 0
    for kind, key, nbytes, category in events.step:
        if kind == "sample":
            continue
        old = held.pop(key, None) if kind != "ref" else held.get(key)
        if old is not None:
            now -= old[1] if old[0] == "Activation" else 0
        if kind == "alloc" or (kind == "ref" and old is not None):
            held[key] = (category, nbytes if kind == "alloc" else old[1])
            now += held[key][1] if category == "Activation" else 0
        best = max(best, now)
    return best


@pytest.fixture(scope="module")
def eager_and_compiled():
    from utilities.measure.fake_step import StepConfig, trace

    return [trace("llama-tiny", StepConfig(2, "full_shard", "bf16", "none", 2, 64, compile=c))
            for c in (False, True)]


def test_compile_saves_less_by_the_recomputed_pointwise_outputs(eager_and_compiled):
    """Each compiled block drops the pointwise outputs eager saves (SiLU's, RMSNorm's fp32
    upcast) and holds the block's bf16 input instead: the activations shrink by exactly the bytes
    dropped less the bytes held, block by block."""
    eager, compiled = eager_and_compiled
    regions = compiled.compiled_regions
    layers = get_model_spec("llama-tiny").config().num_hidden_layers
    assert not eager.compiled_regions and len(regions) == layers
    for r in regions:
        assert {"silu", "_to_copy"} <= set(r["recomputed_ops"])
        assert set(r["recomputed_ops"]) <= {"silu", "mul", "_to_copy", "add", "pow", "neg", "cat"}
        assert r["saved_compiled"] < r["saved_eager"]
        assert r["saved_eager"] - r["saved_compiled"] == r["recomputed_bytes"] - r["held_bytes"] > 0
    saved = sum(r["recomputed_bytes"] - r["held_bytes"] for r in regions)
    assert (_activation_high_water(eager.memory_events)
            - _activation_high_water(compiled.memory_events)) == saved


def test_compile_keeps_matmul_and_attention_outputs_saved(eager_and_compiled):
    """What cannot be recomputed stays saved: every block's compiled save set holds mm and
    attention outputs, and no recomputed op is a matmul or attention."""
    for r in eager_and_compiled[1].compiled_regions:
        assert "mm" in r["saved_ops"] and any("attention" in op for op in r["saved_ops"])
        assert not any(op in ("mm", "addmm", "bmm") or "attention" in op for op in r["recomputed_ops"])


def test_min_cut_saves_the_cheapest_recomputable_frontier():
    """The partitioner's cut on a hand-made graph: x (input, 2 B) -> mm (banned, 4 B) -> silu
    (4 B) -> mul (4 B); backward needs silu's and mul's outputs: the mm output is saved, the
    two pointwise outputs are not. With a cast (8 B) of x needed, x (2 B) is saved instead."""
    from utilities.measure.compile_memory import _Node, min_cut

    def node(nbytes, banned, op):
        return _Node(nbytes, banned, op, None)

    nodes = [node(2, True, ""), node(4, True, "mm"), node(4, False, "silu"), node(4, False, "mul"),
             node(8, False, "_to_copy")]
    edges = [(0, 1), (1, 2), (2, 3), (1, 3), (0, 4)]
    assert min_cut(nodes, edges, {2, 3}) == {1}
    assert min_cut(nodes, edges, {2, 3, 4}) == {0, 1}
    assert min_cut(nodes, edges, {1}) == {1}


def _plan_json(capsys, *flags) -> dict:
    import json

    from utilities.measure.plan_cli import main

    assert main(["--model", "llama-tiny", "--gpus", "2", "--batch", "2", "--seq", "64",
                 "--gpu-memory", "80GiB", "--no-time", "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)


def test_compile_without_time_still_plans_its_memory(capsys):
    """``--compile --no-time``: no step time, but the memory is the compiled step's, and the JSON
    says what compiling did to it."""
    eager, compiled = _plan_json(capsys), _plan_json(capsys, "--compile")
    assert compiled["time"] is None and compiled["compile"] and not eager["compile"]
    assert compiled["peak_bytes"]["activations"] < eager["peak_bytes"]["activations"]
    block = compiled["compile_memory"]["per_block"]
    assert block["saved_compiled"] < block["saved_eager"] and "silu" in block["recomputed_ops"]
    assert "recomputed in backward" in compiled["compile_memory"]["what"]
    assert any("--compile" in n and "recomputed" in n for n in compiled["notes"])
    assert eager["compile_memory"] is None


def test_help_says_what_compile_does_to_memory(capsys):
    from utilities.measure.plan_cli import main

    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    said = text[text.index("--compile torch.compile"):]
    said = said[:said.index("--fp8")]
    assert "memory" in said and "recomputed in backward" in said and "--no-time" in said


@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
def test_compiled_saves_match_aotautograds_own_partitioner():
    """The traced model against the real thing on CPU: a llama-tiny layer compiled with
    AOTAutograd and inductor's partitioner (``min_cut_rematerialization_partition``, no code
    generated) saves, outside its parameters, the bytes the traced model says a compiled block
    saves; fewer than eager saves."""
    from functorch.compile import min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd  # the partitioner without inductor's codegen
    from torch.multiprocessing.reductions import StorageWeakRef

    from utilities.measure.compile_memory import CompiledRegions
    from utilities.measure.hf_masks import one_sequence_per_row

    spec = get_model_spec("llama-tiny")
    block = spec.block_class()

    def model_and_layers():
        torch.manual_seed(0)
        model = spec.build(device="meta").to_empty(device="cpu").to(torch.bfloat16)
        for p in model.parameters():
            torch.nn.init.normal_(p, std=0.02)
        return model, [m for m in model.modules() if isinstance(m, block)]

    ids = torch.randint(0, spec.config().vocab_size, (2, SEQ))
    model, _ = model_and_layers()
    traced = CompiledRegions(model, block, contextlib.nullcontext())
    with one_sequence_per_row(), traced.mode:
        model(input_ids=ids, labels=ids).loss.backward()

    model, layers = model_and_layers()
    params = {StorageWeakRef(p.untyped_storage()) for p in model.parameters()}
    backend = aot_autograd(fw_compiler=lambda gm, _: gm, bw_compiler=lambda gm, _: gm,
                           partition_fn=min_cut_rematerialization_partition)
    saved: list[int] = []
    layer = layers[1]
    compiled = torch.compile(layer.forward, backend=backend)

    def run(*args, **kwargs):
        storages: dict = {}

        def pack(t):
            key = StorageWeakRef(t.untyped_storage())
            if key not in params:
                storages[key] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = compiled(*args, **kwargs)
        saved.append(sum(storages.values()))
        return out

    layer.forward = run
    with one_sequence_per_row():
        model(input_ids=ids, labels=ids).loss.backward()
    ours = traced.regions[1]
    assert saved == [ours["saved_compiled"]] and ours["saved_compiled"] < ours["saved_eager"]
