"""One fake training step, traced once for the memory plan and the time model.

``trace(spec, StepConfig(world, ...))`` builds the model on ``meta``, applies the plan's options,
checkpoints and ``fully_shard``-s it block by block (FSDP2) on a ``world``-rank fake process group,
materializes it under ``FakeTensorMode`` and runs one training step (the optimizer state already
in place) with two recorders on the same ops:

* ``FSDPMemTracker`` (torch's), through ``EventRecorder``: every allocation and free by category,
  and the peak (what ``planner.plan`` reads, and the allocator model's replay for reserved memory);
* ``OpRecorder`` (``op_recorder``): every ATen op's kind, FLOPs and bytes, the FSDP unit running
  it and the phase (what ``step_time`` turns into seconds).

A transformer's middle blocks are identical, so a model of L blocks is traced at a small depth
(``depth_scaling``; ``scaled_depths``: the first two blocks, one middle block, the last two) and extended:

* memory: each allocation, free, category change and tracker sample belongs to the block whose
  work made it; the middle block's events are repeated L - 4 times, each copy's references to
  its neighbours' tensors pointed at the neighbouring copies (``_extended_events``), and the
  extended stream is replayed (``step_trace``): the tracker's peak by category
  (``MemoryEvents.peak``, which on the traced depth itself must give the tracker's own peak) and
  the caching allocator's reserved memory. Under block-pair checkpointing, or AdamW's foreach (its
  temporaries span every block), two depths are traced and every sample is extended linearly from
  them (the allocator's replay too, approximately).
* time: the middle block's op segments, collectives and unit are repeated to fill L blocks.
  What the time model alone asks for (``StepConfig(memory=False)``) is traced for its ops only:
  for T5, whose memory extension is checked against a second depth, one depth and no check.

Where the blocks turn out not to be alike, the whole model is traced. ``tests/test_fake_step.py``
checks the scaled trace against the full one, to the byte and to the microsecond.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from utilities.errors import UsageError, bad_value
from utilities.measure.depth_scaling import (
    checked,
    extended,
    layers_of,
    linearly_scaled,
    ops_extended,
    scaled_depths,
    stacks_of,
    with_layers,
)
from utilities.measure.op_recorder import OpRecorder, UnitInfo, op_segments, unit_label
from utilities.measure.step_trace import MemoryEvents, MemorySamples, StepTrace
from utilities.parallelize import AC_MODES

STRATEGIES = ("full_shard", "shard_grad_op", "hybrid_shard", "no_shard")
PRECISIONS = ("fp32", "bf16")
MAX_GPUS = 65536


def check_step(gpus, strategy, precision, ac, batch, seq) -> None:
    """One training step's configuration, as the planner and the time model both take it."""
    if not isinstance(gpus, int) or not 1 <= gpus <= MAX_GPUS:
        raise bad_value("--gpus", gpus, f"integers in [1, {MAX_GPUS}] (the fake process group "
                        "takes ~30 s at the top; the largest published training runs used 16,384)")
    if strategy not in STRATEGIES:
        raise bad_value("--strategy", strategy, STRATEGIES)
    if precision not in PRECISIONS:
        raise bad_value("--precision", precision, PRECISIONS)
    if ac not in AC_MODES:
        raise bad_value("--ac", ac, AC_MODES)
    if not isinstance(batch, int) or batch < 1:
        raise bad_value("--batch", batch, "integers >= 1")
    if seq is not None and (not isinstance(seq, int) or seq < 1):
        raise bad_value("--seq", seq, "integers >= 1")


def check_tp(spec, tp, gpus: int, strategy: str, options=None, gpus_per_node: int | None = None
             ) -> None:
    """Tensor parallelism's degree, as the planner and the time model take it: a divisor of the
    GPUs (and of a node's, where TP runs over NVLink), with FSDP's full_shard or shard_grad_op
    across the groups, a model TP can split (``tensor_parallel.check_tensor_parallel``), and
    none of the plan options the 2-D step does not model (accumulation and bf16 parameters
    are)."""
    if not isinstance(tp, int) or tp < 1 or gpus % tp:
        raise bad_value("--tp", tp, f"a divisor of --gpus ({gpus})")
    if tp == 1:
        return
    if gpus_per_node is not None and gpus_per_node % tp:
        raise bad_value("--tp", tp, f"a divisor of --gpus-per-node ({gpus_per_node}): TP runs "
                        "inside a node, over NVLink")
    from utilities.measure.plan_options import check_beside_fsdp2

    check_beside_fsdp2("--tp", tp, strategy, options, "2-D step", "across the TP groups")
    from utilities.measure.tensor_parallel import check_tensor_parallel

    check_tensor_parallel(spec.config(), tp)


# -- the fake world ------------------------------------------------------------------------------

@contextlib.contextmanager
def fake_world(world_size: int):
    """A ``world_size``-rank fake process group seen from rank 0 (restores any real one after)."""
    import torch.distributed as dist

    from utilities.distributed import forget_world_meshes
    from utilities.torch_internals import fake_store

    if dist.is_initialized():
        raise RuntimeError("plan() needs a process without a process group (it creates a fake one)")
    dist.init_process_group("fake", store=fake_store(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        forget_world_meshes()  # ``world_mesh()`` of the fake world, if the user's code asked
        dist.destroy_process_group()


def fake_device(device_type: str) -> tuple[torch.device, list[str]]:
    """The device the fake tensors claim. FakeTensorMode alone can claim "cuda" without a GPU, but
    the device mesh and FSDP2's CUDA streams need a CUDA runtime: without one we use "cpu"."""
    if device_type == "cuda" and not torch.cuda.is_available():
        return torch.device("cpu"), [
            "no GPU here: the fake tensors live on 'cpu' (same byte sizes; AdamW runs without "
            "foreach, whose temporaries a GPU run adds)"]
    return torch.device(device_type), []


def prepare(spec, strategy: str, precision: str, ac: str, mesh, fake_mode, device: torch.device,
            options=None, tp: int = 1):
    """Build on meta, apply the options (bf16 storage, freezing, adapters), shard it with the
    user's function (``spec.parallelize``, ``--parallelize``) or the library's sequence
    (``utilities.parallelize.parallelize_model``: TP on the mesh's "tp" dim when ``tp`` > 1,
    checkpointing, FSDP2 per block and the root), then materialize it as fake tensors on
    ``device``."""
    from utilities.measure.plan_options import PlanOptions, apply_to_model, policy_name, shard_kwargs
    from utilities.parallelize import parallelize_model
    from utilities.precision import fsdp2_policy

    options = options or PlanOptions()
    policy = fsdp2_policy(policy_name(precision, options))
    model = spec.build(device="meta")
    block = spec.block_class()
    apply_to_model(model, [m for m in model.modules() if isinstance(m, block)], options)
    yours = getattr(spec, "parallelize", None)
    if yours is not None:  # the user's own sharding function (utilities.measure.user_code)
        from utilities.measure.user_code import call_parallelize

        call_parallelize(yours, model, mesh, device, spec.name.rpartition(" sharded by ")[2],
                         mp_policy=policy, take_offload=options.offload)
    else:
        parallelize_model(model, block_class=block, mesh=mesh, ac=ac, loss_parallel=options.loss_parallel,
                          mp_policy=policy, **shard_kwargs(options, strategy))
    with fake_mode:
        model.to_empty(device=device)
    return model


def fake_batch(spec, batch: int, seq: int, device: torch.device, mask: bool = True):
    """The step's batch: token ids and labels, or for a model with its own batch function
    (``--batch-fn``) the loss of the model as a function of it (``plan_options.step_loss`` takes
    either). A transformers decoder gets no attention mask, with or without CP: a real step's
    all-ones mask is read as unpadded and dropped (SDPA's ``is_causal``, K/V heads not repeated),
    which a fake mask cannot be, so it would plan a seq x seq mask and repeated K/V the run never
    holds. A seq2seq or your own model gets an all-ones mask; your own under CP (``mask`` False)
    a 4-D one of one byte."""
    make_batch = getattr(spec, "make_batch", None)
    if make_batch is not None:
        from utilities.measure.user_code import user_batch

        return user_batch(make_batch, batch, seq, spec.name)
    vocab = spec.config().vocab_size
    if getattr(spec, "flops_from_trace", False):  # a builder's model: Hugging Face's two names
        ids = torch.randint(0, vocab, (batch, seq), device=device)
        return {"input_ids": ids, "labels": ids.clone()}
    ids = torch.randint(0, vocab, (batch, seq), device=device)
    if spec.family != "custom" and not spec.is_seq2seq:  # transformers' decoder: an unpadded batch
        return {"input_ids": ids, "labels": ids.clone()}
    if not mask:  # a 4-D mask the model takes as it is, one byte held (CP attention is causal)
        return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones(
            (1, 1, 1, 1), dtype=torch.bool, device=device).expand(batch, 1, seq, seq)}
    if spec.is_seq2seq:
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                "labels": torch.randint(0, vocab, (batch, seq), device=device)}
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def adamw_foreach(device: torch.device) -> bool:
    """AdamW's ``foreach`` choice on ``device`` (torch's default: on for CUDA, off for CPU)."""
    return device.type == "cuda"


def largest_unit_shard(model) -> int:
    """Bytes of the largest FSDP unit's parameter shard on this rank (its own parameters)."""
    from utilities.measure.memory import tensor_bytes

    largest = 0
    for _, own in _unit_parameters(model):
        largest = max(largest, sum(tensor_bytes(p) for p in own))
    return largest


def _unit_parameters(model) -> list[tuple[str, list]]:
    """Each FSDP unit's fully qualified name and the parameters it manages (not its nested
    units'), innermost units first."""
    from torch.distributed.fsdp import FSDPModule

    seen: set[int] = set()
    out = []
    for fqn, m in reversed([(n, m) for n, m in model.named_modules() if isinstance(m, FSDPModule)]):
        own = [p for p in m.parameters() if id(p) not in seen]
        seen.update(id(p) for p in own)
        out.append((fqn, own))
    return out


def _resident(model, optimizer, device_type: str) -> list[tuple[str, int, str]]:
    """What the rank holds when a step begins, unit by unit (the root first, then the blocks in
    order): each unit's parameter shards and buffers, then each unit's AdamW state, as
    (unit, bytes, the tracker's category)."""
    from utilities.measure.memory import tensor_bytes

    units = list(reversed(_unit_parameters(model)))
    modules = dict(model.named_modules())
    seen: set[int] = set()
    out = []
    for fqn, own in units:
        out += [(unit_label(fqn), tensor_bytes(p), "Sharded Param") for p in own]
    for fqn, _ in reversed(units):  # innermost first: a unit's own buffers
        bufs = [b for b in modules[fqn].buffers() if id(b) not in seen]
        seen.update(id(b) for b in bufs)
        out += [(unit_label(fqn), tensor_bytes(b), "Buffer") for b in bufs
                if b.device.type == device_type]
    for fqn, own in units:
        for p in own:
            out += [(unit_label(fqn), tensor_bytes(v), "OptState")
                    for v in optimizer.state.get(p, {}).values()
                    if isinstance(v, torch.Tensor) and v.device.type == device_type]
    return out


def _unit_states(model, optimizer) -> dict[str, dict[str, int]]:
    """What each unit's own parameters hold after the step (``memory.census``, unit by unit)."""
    from utilities.measure.memory import tensor_bytes

    out = {}
    for fqn, own in _unit_parameters(model):
        opt = sum(tensor_bytes(v) for p in own for v in optimizer.state.get(p, {}).values()
                  if isinstance(v, torch.Tensor))
        out[unit_label(fqn)] = {"parameters": sum(tensor_bytes(p) for p in own),
                                "gradients": sum(tensor_bytes(p.grad) for p in own
                                                 if p.grad is not None),
                                "optimizer": opt}
    return out


def _own_batch(spec):
    """While the planner's own batch runs: one sequence per row, as transformers would read from
    it (``hf_masks``); a ``--batch-fn`` batch is the user's, read as it is."""
    if getattr(spec, "make_batch", None) is not None:
        return contextlib.nullcontext()
    from utilities.measure.hf_masks import one_sequence_per_row

    return one_sequence_per_row()


def _cp_attention(group):
    """Attention under context parallelism over ``group`` (``context_parallel.cp_attention``),
    or nothing without one."""
    if group is None:
        return contextlib.nullcontext()
    from utilities.measure.context_parallel import cp_attention

    return cp_attention(group)


# -- tracing -------------------------------------------------------------------------------------

def _run(spec, config: StepConfig) -> tuple[StepTrace, MemorySamples]:
    """One step of ``spec`` in ``config`` under both recorders: the ``StepTrace`` and the
    tracker's samples.

    The optimizer state is created by one untracked AdamW step on zero gradients: the same tensors
    a first real step would create, at no forward's cost. Both steps take the same ``foreach``: a
    tracked step that dispatches ops the untracked one did not misses DTensor's sharding-propagation
    cache, and propagation then runs those ops at their full (unsharded) size under the planner's
    own FakeTensorMode, which the tracker books as optimizer state. Under tensor parallelism the
    forward and backward run DTensor ops too: one untracked forward and backward come first."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from utilities.imports import collect_from_here
    from utilities.measure.memory import TrackerHooks
    from utilities.measure.plan_options import PlanOptions, accumulate, traced_micro_batches
    from utilities.measure.tensor_parallel import loss_parallel_context
    from utilities.torch_internals import fsdp_mem_tracker

    world, strategy, precision, ac = config.world, config.strategy, config.precision, config.ac
    batch, seq, tp, cp = config.batch, config.seq, config.tp, config.cp
    device = torch.device(config.device_type)
    options = config.options or PlanOptions()
    t0 = time.perf_counter()
    with fake_world(world), warnings.catch_warnings():
        _quiet_warnings()
        mesh, cp_group = step_meshes(config, device)
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        model = prepare(spec, strategy, precision, ac, mesh, fake_mode, device, options, tp)
        units, tracker_names, root_name = _unit_infos(model)
        compiled = _compiled_regions(model, spec, fake_mode, config.compile)
        with fake_mode, _cp_attention(cp_group) as cp_calls, _own_batch(spec):
            data = fake_batch(spec, batch, seq // cp, device, mask=cp == 1)
            optimizer = _optimizer_in_place(model, data, device, tp)
            collect_from_here()  # the tracked step runs with the garbage collector on
            tracker = fsdp_mem_tracker()(model, optimizer)

            def between():
                tracker.reset_mod_stats()  # FSDPMemTracker follows one forward per module
                ops.restart()

            ops, samples, recorder = _recorders(tracker, tracker_names, root_name, spec, fake_mode,
                                                cp_group, device.type)

            compiled.regions.clear()  # the untracked steps' regions
            # the hooks go, so the model can be collected
            with ops.mode, TrackerHooks(), tracker, compiled.mode:
                start = len(recorder.events)
                optimizer.zero_grad(set_to_none=True)
                with loss_parallel_context(model):
                    accumulate(model, data, options, traced_micro_batches(options), between)
                ops.param_units = {id(getattr(p, "_local_tensor", p)): unit_label(fqn)
                                   for fqn, own in _unit_parameters(model) for p in own}
                ops.recording = False
                optimizer.step()
            if cp_calls is not None:
                from utilities.measure.context_parallel import check_cp_ran

                check_cp_ran(cp_calls, spec.name)
            peak, states, shard, resident, unit_states = _held(model, optimizer, tracker,
                                                               device.type)
    segments = op_segments(ops.rows)
    order = _forward_order(segments, units)
    recorder.release()
    memory = MemoryEvents(resident=resident, device_type=device.type,
                          step=[(*e, c) for e, c in zip(recorder.events[start:],
                                                        recorder.categories[start:])])
    places = recorder.places[start:]
    del model, optimizer
    samples.keys = tuple(str(getattr(k, "value", k)) for k in samples.keys or ())
    step = StepTrace(model=spec.name, precision=precision, ac=ac, batch=batch, seq=seq,
                     world=world, peak=peak, states=states, largest_unit_shard=shard,
                     segments=segments, units=[units[u] for u in order],
                     collectives=list(ops.collectives), trace_s=time.perf_counter() - t0,
                     backward_collectives_from=(len(ops.collectives) if ops.backward_collectives_from
                                                is None else ops.backward_collectives_from),
                     memory_events=memory, unit_states=unit_states,
                     compiled_regions=compiled.regions)
    samples.event_places = places
    return step, samples


def _quiet_warnings() -> None:
    """Silence what torch and the course's own code warn of on every fake step (inside a
    ``warnings.catch_warnings()``)."""
    from utilities.distributed import T5_POSITION_BIAS_VIEW
    from utilities.measure.tensor_parallel import HEAD_VIEW_WARNING

    warnings.filterwarnings("ignore", message="The module hierarchy tracking")
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    warnings.filterwarnings("ignore", message="Module is None")
    warnings.filterwarnings("ignore", message=T5_POSITION_BIAS_VIEW)
    warnings.filterwarnings("ignore", message=HEAD_VIEW_WARNING)


def _compiled_regions(model, spec, fake_mode, compile: bool):
    """The blocks traced as ``torch.compile`` regions (``compile_memory.CompiledRegions``), or
    nothing to trace when the step is eager."""
    if not compile:
        return _Eager()
    from utilities.measure.compile_memory import CompiledRegions

    return CompiledRegions(model, spec.block_class(), fake_mode)


class _Eager:
    """No compiled region: an empty list of them and no mode."""

    def __init__(self):
        self.regions: list = []
        self.mode = contextlib.nullcontext()


def step_meshes(config: StepConfig, device: torch.device):
    """The step's device mesh (1-D; HSDP's or TP's 2-D) on the fake world, and the CP group of
    rank 0 (None without context parallelism)."""
    from torch.distributed.device_mesh import init_device_mesh

    world, shard_size, tp, cp = config.world, config.shard_size, config.tp, config.cp
    if tp > 1:  # 2-D: FSDP2 across the "dp" dim, TP inside a group of tp ranks
        mesh = init_device_mesh(device.type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
    elif shard_size:  # HSDP: replicate across the first dim, shard along the second
        mesh = init_device_mesh(device.type, (world // shard_size, shard_size),
                                mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(device.type, (world,))
    cp_group = None
    if cp > 1:  # context parallelism: the CP group of rank 0; FSDP2 still over every rank
        from utilities.measure.context_parallel import cp_ranks

        cp_group = torch.distributed.new_group(cp_ranks(world, cp, tp))
    return mesh, cp_group


def _unit_infos(model) -> tuple[dict[str, UnitInfo], dict[str, str], str]:
    """Each FSDP unit's ``UnitInfo`` by its label, the tracker's name of each unit's module ->
    the label, and the root module's class name."""
    root_name = type(model).__name__
    units: dict[str, UnitInfo] = {}
    tracker_names: dict[str, str] = {}
    for fqn, own in _unit_parameters(model):
        label = unit_label(fqn)
        units[label] = UnitInfo(label, [tuple(p.shape) for p in own], is_root=not fqn,
                                trainable=[p.requires_grad for p in own], fqn=fqn)
        tracker_names[root_name + ("." + fqn if fqn else "")] = label
    return units, tracker_names, root_name


def _optimizer_in_place(model, data, device: torch.device, tp: int):
    """AdamW with its state already in place: one untracked step on zero gradients (under TP, one
    untracked forward and backward first; ``_run`` says why)."""
    from utilities.measure.plan_options import step_loss, trainable_parameters
    from utilities.measure.tensor_parallel import loss_parallel_context

    if tp > 1:
        with loss_parallel_context(model):
            step_loss(model, data).backward()
        model.zero_grad(set_to_none=True)
    params = trainable_parameters(model)
    optimizer = torch.optim.AdamW(params, lr=1e-3, foreach=adamw_foreach(device))
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return optimizer


def _recorders(tracker, tracker_names: dict[str, str], root_name: str, spec, fake_mode, cp_group,
               device_type: str):
    """The recorders beside the tracker: the ops (``OpRecorder``), the tracker's samples and the
    allocations (``EventRecorder``), each told where in the step it is."""
    from utilities.measure.allocator import EventRecorder
    from utilities.torch_internals import global_peak_only, mod_tracker_of

    ops = OpRecorder(mod_tracker_of(tracker), tracker_names, root_name, causal=not spec.is_seq2seq)
    ops.fake_mode = fake_mode
    ops.cp_group_name = cp_group.group_name if cp_group is not None else None
    samples = MemorySamples(ops, device_type)
    global_peak_only(tracker, observe=samples)
    recorder = EventRecorder(tracker, device_type, where=lambda: (ops.unit(), ops.phase()))
    samples.recorder = recorder
    return ops, samples, recorder


def _held(model, optimizer, tracker, device_type: str):
    """After the step: the tracker's peak by category, the states held, the largest unit's shard,
    what a step begins with (``_resident``) and each unit's states."""
    from utilities.measure.memory import census

    held = census(model, optimizer)
    peak = {}
    for dev, snap in tracker.get_tracker_snapshot("peak").items():
        if torch.device(dev).type == device_type:
            peak = {str(getattr(k, "value", k)): int(v) for k, v in snap.items()}
    states = {k: int(held[k]) for k in ("parameters", "gradients", "optimizer")}
    return (peak, states, largest_unit_shard(model), _resident(model, optimizer, device_type),
            _unit_states(model, optimizer))


def _forward_order(segments, units) -> list[str]:
    """The units in the order their forward runs (those without forward work last)."""
    order: list[str] = []
    for s in segments:
        if s.phase == "forward" and s.unit not in order:
            order.append(s.unit)
    return order + [u for u in units if u not in order]


@dataclass(frozen=True)
class StepConfig:
    """One training step's configuration, as the trace takes it and caches it by: ``world``
    ranks, the FSDP ``strategy`` (and HSDP's ``shard_size``), ``precision``, activation
    checkpointing ``ac``, ``batch`` x ``seq`` tokens per rank, the fake tensors' ``device_type``,
    the plan's ``options`` (``PlanOptions``), tensor parallelism ``tp``, ``scale`` (trace a
    deep model at small depths and extend it), and context parallelism ``cp`` (each rank of a
    CP group runs seq / cp of the tokens, ``utilities.measure.context_parallel``), and ``compile``
    (each uncheckpointed block saves for backward what ``torch.compile`` saves,
    ``utilities.measure.compile_memory``), and ``memory`` (False: the time model's trace, whose
    memory nobody reads: a model of several stacks is extended from one small depth without the
    second depth that checks its memory, and its trace carries no memory; a trace with its memory
    serves it too where that costs no more)."""

    world: int
    strategy: str = "full_shard"
    precision: str = "bf16"
    ac: str = "none"
    batch: int = 1
    seq: int | None = None
    device_type: str = "cuda"
    shard_size: int | None = None
    options: Any = None
    tp: int = 1
    scale: bool = True
    cp: int = 1
    compile: bool = False
    memory: bool = True


def step_config(config: int | StepConfig | None = None, *fields: Any, **settings: Any) -> StepConfig:
    """A ``StepConfig`` from ``config`` (one, or its ``world``: the number of GPUs) and its other
    fields, by position in their order or by name (``gpus`` is ``world``): what ``planner.plan``
    and ``step_time.estimate_step_time`` take, so ``plan(model, 8, memory, ac="full")`` and
    ``plan(model, StepConfig(8, ac="full"), memory)`` are the same call. Given a ``StepConfig``,
    the names change its fields."""
    if "gpus" in settings:
        settings["world"] = settings.pop("gpus")
    if isinstance(config, StepConfig):
        if fields:
            raise TypeError("a StepConfig and fields by position: name the fields to change")
        return dataclasses.replace(config, **settings)
    if config is not None:
        fields = (config, *fields)
    return StepConfig(*fields, **settings)


def trace(spec, config: StepConfig) -> StepTrace:
    """One fake training step of ``spec`` (a ``ModelSpec`` or a course model's name) in ``config``
    (``StepConfig``: its ``world`` ranks, FSDP strategy, precision, checkpointing, tokens,
    options, ``tp``, ``cp``, ``scale``), cached by its ``StepConfig``: the planner and the time
    model of one configuration share it. ``tp``: tensor parallelism inside groups of ``tp`` ranks,
    FSDP2 across them; ``cp``: context parallelism over groups of ``cp`` ranks (FSDP2 over every
    rank). ``scale``: trace a deep model at two small depths and scale (the module's docstring);
    False traces every block. Read it, do not change it (the cache hands the same object to every
    caller)."""
    from utilities.measure.plan_options import PlanOptions
    from utilities.models import get_model_spec
    from utilities.torch_internals import untraceable_op

    spec = get_model_spec(spec) if isinstance(spec, str) else spec
    config = dataclasses.replace(config, seq=config.seq or spec.default_seq_len,
                                 device_type=fake_device(config.device_type)[0].type,
                                 options=traced_options(spec, config.options or PlanOptions()))
    if not config.memory and (not _ops_alone_cost_less(spec, config)
                              or (spec, dataclasses.replace(config, memory=True)) in _WITH_MEMORY):
        config = dataclasses.replace(config, memory=True)  # one cache entry with the planner's
    try:
        return _trace(spec, config)
    except Exception as e:
        op = untraceable_op(e)
        if op is None:
            raise
        raise UsageError(f"model {spec.name} is not allowed: its step runs {op}, which cannot run on "
                         "fake tensors (no fake kernel, or an output that depends on the data); "
                         "allowed: a step whose every op has a shape known without the data") from None


def traced_options(spec, options):
    """``options`` as far as the traced step reads them, so that steps the trace cannot tell apart
    share one cache entry: the host's memory is arithmetic on the trace, and so is ``offload``
    for the course's sequence (``shard_kwargs``); a function of your own (``--parallelize``) is
    traced with its ``CPUOffloadPolicy`` taken off only under ``offload``."""
    from utilities.measure.plan_options import HOST_MEMORY_BYTES

    own = getattr(spec, "parallelize", None) is not None
    return dataclasses.replace(options, host_memory_bytes=HOST_MEMORY_BYTES,
                               offload=options.offload and own)


def _ops_alone_cost_less(spec, config: StepConfig) -> bool:
    """Whether tracing ``config``'s ops without its memory saves a trace: a model of several stacks
    (T5) scaled from small depths, whose memory needs a second depth to be checked against."""
    stacks = stacks_of(spec)
    return (config.scale and stacks is not None and len(stacks) > 1
            and scaled_depths(spec, config.ac, config.options) is not None
            and not adamw_foreach(torch.device(config.device_type)))


# the steps traced with their memory lately: the time model's trace of one of them is that trace
_WITH_MEMORY: collections.deque = collections.deque(maxlen=16)


def clear_cache() -> None:
    """Forget every traced step: the next ``trace`` of any configuration traces it again."""
    _trace.cache_clear()
    _WITH_MEMORY.clear()


@functools.lru_cache(maxsize=16)
def _trace(spec, config: StepConfig) -> StepTrace:
    if config.memory:
        _WITH_MEMORY.append((spec, config))
    device = torch.device(config.device_type)
    depths = scaled_depths(spec, config.ac, config.options) if config.scale else None
    several_stacks = layers_of(spec) is None  # T5: extended event by event only, and checked
    if depths is None or (several_stacks and adamw_foreach(device)):
        return _whole(spec, config)
    t0 = time.perf_counter()
    small, small_samples = _run(with_layers(spec, depths[0]), config)
    if not config.memory:  # several stacks (``_ops_alone_cost_less``): the ops, extended
        scaled = ops_extended(spec, small, depths[0], depths[1] - depths[0])
    elif several_stacks:
        large, _ = _run(with_layers(spec, depths[1]), config)
        scaled = checked(spec, small, small_samples, large, depths)
    elif not adamw_foreach(device):
        scaled = extended(spec, small, small_samples, depths[0], depths[1] - depths[0])
    else:  # AdamW's foreach: its temporaries span every block; two depths, extended linearly
        large, large_samples = _run(with_layers(spec, depths[1]), config)
        scaled = linearly_scaled(spec, small, small_samples, large, large_samples, depths)
    if scaled is None:  # the blocks are not alike: trace them all
        return _whole(spec, config)
    scaled.compiled_regions = small.compiled_regions
    scaled.trace_s = time.perf_counter() - t0
    return scaled


def _whole(spec, config: StepConfig) -> StepTrace:
    step, _ = _run(spec, config)
    step.layers = layers_of(spec)
    return step
