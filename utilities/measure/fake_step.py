"""One fake training step, traced once for the memory plan and the time model.

``trace(spec, world, ...)`` builds the model on ``meta``, applies the plan's options, checkpoints
and ``fully_shard``-s it block by block (FSDP2) on a ``world``-rank fake process group, materializes
it under ``FakeTensorMode`` and runs one training step (the optimizer state already in place) with
two recorders on the same ops:

* ``FSDPMemTracker`` (torch's), through ``EventRecorder``: every allocation and free by category,
  and the peak (what ``planner.plan`` reads, and the allocator model's replay for reserved memory);
* ``OpRecorder``: every ATen op's kind, FLOPs and bytes, the FSDP unit running it and the phase
  (what ``step_time`` turns into seconds).

A transformer's middle blocks are identical, so a model of L blocks is traced at a small depth
(``scaled_depths``: the first two blocks, one middle block, the last two) and extended:

* memory: each allocation, free, category change and tracker sample belongs to the block whose
  work made it; the middle block's events are repeated L - 4 times, each copy's references to
  its neighbours' tensors pointed at the neighbouring copies (``_extended_events``), and the
  extended stream is replayed: the tracker's peak by category (``MemoryEvents.peak``, which on the
  traced depth itself must give the tracker's own peak) and the caching allocator's reserved
  memory. Under block-pair checkpointing, or AdamW's foreach (its temporaries span every block),
  two depths are traced and every sample is extended linearly from them (the allocator's replay
  too, approximately).
* time: the middle block's op segments, collectives and unit are repeated to fill L blocks.

Where the blocks turn out not to be alike, the whole model is traced. ``tests/test_fake_step.py``
checks the scaled trace against the full one, to the byte and to the microsecond.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import re
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from utilities.errors import UsageError, bad_value
from utilities.parallelize import AC_MODES

STRATEGIES = ("full_shard", "shard_grad_op", "hybrid_shard", "no_shard")
PRECISIONS = ("fp32", "bf16")
MAX_GPUS = 65536
# the depths a deep model is traced at: 2 first blocks + the middle + 2 last (see the docstring)
EDGE_BLOCKS = 2


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
    from utilities.measure.plan_options import PlanOptions, apply_to_model, shard_kwargs
    from utilities.parallelize import parallelize_model
    from utilities.precision import fsdp2_policy

    options = options or PlanOptions()
    model = spec.build(device="meta")
    block = spec.block_class()
    apply_to_model(model, [m for m in model.modules() if isinstance(m, block)], options)
    yours = getattr(spec, "parallelize", None)
    if yours is not None:  # the user's own sharding function (utilities.measure.user_code)
        from utilities.measure.user_code import call_parallelize

        call_parallelize(yours, model, mesh, device, spec.name.rpartition(" sharded by ")[2])
    else:
        parallelize_model(model, block_class=block, mesh=mesh, ac=ac, loss_parallel=options.loss_parallel,
                          mp_policy=fsdp2_policy(precision), **shard_kwargs(options, strategy))
    with fake_mode:
        model.to_empty(device=device)
    return model


def fake_batch(spec, batch: int, seq: int, device: torch.device, mask: bool = True):
    """The step's batch: token ids and labels, or for a model with its own batch function
    (``--batch-fn``) the loss of the model as a function of it (``plan_options.step_loss`` takes
    either). A transformers decoder gets no attention mask: a real step's all-ones mask is read
    as unpadded and dropped (SDPA's ``is_causal``, K/V heads not repeated), which a fake mask
    cannot be, so it would plan a seq x seq mask and repeated K/V the run never holds. A seq2seq
    or your own model gets an all-ones mask; under CP (``mask`` False) a 4-D one of one byte."""
    make_batch = getattr(spec, "make_batch", None)
    if make_batch is not None:
        from utilities.measure.user_code import user_batch

        return user_batch(make_batch, batch, seq, spec.name)
    vocab = spec.config().vocab_size
    if getattr(spec, "flops_from_trace", False):  # a builder's model: Hugging Face's two names
        ids = torch.randint(0, vocab, (batch, seq), device=device)
        return {"input_ids": ids, "labels": ids.clone()}
    ids = torch.randint(0, vocab, (batch, seq), device=device)
    if not mask:  # a 4-D mask the model takes as it is, one byte held (CP attention is causal)
        return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones(
            (1, 1, 1, 1), dtype=torch.bool, device=device).expand(batch, 1, seq, seq)}
    if spec.is_seq2seq:
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                "labels": torch.randint(0, vocab, (batch, seq), device=device)}
    if spec.family != "custom":  # transformers' model: no mask, as it runs an unpadded batch
        return {"input_ids": ids, "labels": ids.clone()}
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def adamw_foreach(device: torch.device) -> bool:
    """AdamW's ``foreach`` choice on ``device`` (torch's default: on for CUDA, off for CPU)."""
    return device.type == "cuda"


def largest_unit_shard(model) -> int:
    """Bytes of the largest FSDP unit's parameter shard on this rank (its own parameters)."""
    from utilities.measure.memory import _tensor_bytes

    largest = 0
    for _, own in _unit_parameters(model):
        largest = max(largest, sum(_tensor_bytes(p) for p in own))
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
    from utilities.measure.memory import _tensor_bytes

    units = list(reversed(_unit_parameters(model)))
    modules = dict(model.named_modules())
    seen: set[int] = set()
    out = []
    for fqn, own in units:
        out += [(unit_label(fqn), _tensor_bytes(p), "Sharded Param") for p in own]
    for fqn, _ in reversed(units):  # innermost first: a unit's own buffers
        bufs = [b for b in modules[fqn].buffers() if id(b) not in seen]
        seen.update(id(b) for b in bufs)
        out += [(unit_label(fqn), _tensor_bytes(b), "Buffer") for b in bufs
                if b.device.type == device_type]
    for fqn, own in units:
        for p in own:
            out += [(unit_label(fqn), _tensor_bytes(v), "OptState")
                    for v in optimizer.state.get(p, {}).values()
                    if isinstance(v, torch.Tensor) and v.device.type == device_type]
    return out


def _unit_states(model, optimizer) -> dict[str, dict[str, int]]:
    """What each unit's own parameters hold after the step (``memory.census``, unit by unit)."""
    from utilities.measure.memory import _tensor_bytes

    out = {}
    for fqn, own in _unit_parameters(model):
        opt = sum(_tensor_bytes(v) for p in own for v in optimizer.state.get(p, {}).values()
                  if isinstance(v, torch.Tensor))
        out[unit_label(fqn)] = {"parameters": sum(_tensor_bytes(p) for p in own),
                                "gradients": sum(_tensor_bytes(p.grad) for p in own
                                                 if p.grad is not None),
                                "optimizer": opt}
    return out


# -- what the time model reads -------------------------------------------------------------------

MATMUL, ATTENTION, MEMORY, FSDP_COPY = 0, 1, 2, 3
ATTENTION_BACKWARD = 2.5  # FlashAttention's backward work / its forward's (``_attention_flops``)
_FP32, _FP8_OK = 1, 2  # a matmul's flag: computes in fp32; a block Linear's GEMM (Float8-able)


@dataclass
class Segment:
    """Consecutive ops of one unit in one phase ("forward", "recompute", "backward")."""

    unit: str
    phase: str
    kind: np.ndarray  # MATMUL, ATTENTION, MEMORY or FSDP_COPY per op
    flops: np.ndarray
    nbytes: np.ndarray
    fp32: np.ndarray  # the op computes in fp32 (its matmuls run at the fp32 peak)
    fp8_ok: np.ndarray  # a Linear's GEMM inside a block: what Float8Linear converts


@dataclass
class UnitInfo:
    """One FSDP unit and the full shapes of the parameters it manages (not its nested units')."""

    name: str
    shapes: list[tuple[int, ...]]
    is_root: bool
    trainable: list[bool] | None = None  # per shape: requires_grad (None: all train)
    fqn: str = ""  # the module's fully qualified name, as FSDP2's profiler labels show it

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes)

    def shard_numel(self, n: int) -> int:
        """Elements per rank, FSDP2 style: each parameter chunked on dim 0 into n, padded."""
        total = 0
        for s in self.shapes:
            rest = math.prod(s[1:]) if len(s) > 1 else 1
            total += -(-(s[0] if s else 1) // n) * rest
        return total


def _view_like(func) -> bool:
    schema = func._schema
    return any(a.alias_info is not None and not a.alias_info.is_write for a in schema.returns)


_SKIP_NAMESPACES = ("prim", "profiler")
_SKIP_OPS = {"detach", "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided",
             "lift_fresh", "_local_scalar_dense", "set_", "resize_", "record_stream"}


def _classify(func) -> int | None:
    """The kind of an ATen op, or None for ops that launch no kernel (views, allocations)."""
    ns = func.namespace
    name = func.__name__.split(".")[0]
    if ns in _SKIP_NAMESPACES or name in _SKIP_OPS or _view_like(func):
        return None
    if ns == "c10d" or ns == "_c10d_functional":
        return -1
    if ns == "fsdp" or name in ("_foreach_copy_",):
        return FSDP_COPY
    if "attention" in name:
        return ATTENTION
    if name in ("mm", "addmm", "bmm", "baddbmm", "convolution", "convolution_backward",
                "_scaled_mm", "_grouped_mm"):
        return MATMUL
    return MEMORY


def _kernel_bytes(x) -> int:
    """Bytes a kernel touches in ``x``: an expanded (stride-0) dimension is read once, as
    ``torch.utils._runtime_estimation.get_num_bytes`` counts it."""
    if isinstance(x, torch.Tensor):
        n = 1
        for size, stride in zip(x.shape, x.stride()):
            if stride != 0:
                n *= size
        return n * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_kernel_bytes(y) for y in x)
    return 0


def _grouped_mm_flops(a, b) -> float:
    """``_grouped_mm(a, b, offs)``'s work (a mixture of experts' GEMM, which torch's FLOP counter
    does not know): 2 x rows x inner x columns over the groups, whichever operand ``offs`` splits,
    so a token's work counts the experts it was routed to, not every expert."""
    if a.dim() == 2 and b.dim() == 2:  # offs splits the inner dim (a weight's gradient)
        return 2.0 * a.shape[0] * a.shape[1] * b.shape[1]
    if a.dim() == 2:  # (tokens, in) x (experts, in, out)
        return 2.0 * a.shape[0] * a.shape[1] * b.shape[-1]
    if b.dim() == 2:  # (experts, m, in) x (in, columns)
        return 2.0 * a.shape[1] * a.shape[2] * b.shape[1]
    return 2.0 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]  # batched, no offs


def _attention_flops(func, args, kwargs, causal_default: bool) -> float:
    """FlashAttention's work: 4 B H Sq Sk D forward (two GEMMs), 2.5x that backward (five GEMMs,
    S recomputed), halved under a causal mask. ``causal_default``: a decoder-only model's mask is
    causal (Hugging Face passes it as a tensor, where flash kernels take ``is_causal``)."""
    named = dict(zip((a.name for a in func._schema.arguments), args))
    named.update(kwargs)
    q, k = named.get("query"), named.get("key")
    if q is None or k is None or q.dim() != 4:
        return 0.0
    b, h, sq, d = q.shape
    sk = k.shape[-2]
    flops = 4.0 * b * h * sq * sk * d
    if "backward" in func.__name__:
        flops *= ATTENTION_BACKWARD
    causal = bool(named.get("is_causal", False)) or causal_default
    return flops * (0.5 if causal else 1.0)


class OpRecorder:
    """A ``TorchDispatchMode`` that records each op's kind, FLOPs, bytes, unit and phase, and the
    section (unit, phase) the memory tracker's samples fall in. ``modules``: the ``ModTracker``
    that follows the step (the memory tracker's own)."""

    def __init__(self, modules, unit_names: dict[str, str], root: str, causal: bool):
        from torch.distributed.tensor import DTensor
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils.flop_counter import flop_registry

        recorder = self
        self.modules = modules
        self.unit_names = unit_names
        self.entered: dict[str, int] = {}  # unit -> when its forward or backward last began
        self.current = unit_names.get(root, "root")
        self.dirty = True
        self.root = root
        self.causal = causal
        self.recording = True
        self.rows: list[tuple[str, str, int, float, int, int]] = []
        self.collectives: list[tuple[str, str, int]] = []
        self.backward_collectives_from: int | None = None  # the first collective of backward
        self.kinds: dict[Any, int | None] = {}
        self.flop_registry = flop_registry
        self.fake_mode = None  # the step's FakeTensorMode: ops under another (DTensor's) are skipped
        self.cp_group_name = None  # the CP group's name: its collectives are named "cp:<op>"
        # the optimizer step: each parameter's local shard (by id) -> its unit, and the unit of
        # the parameter being updated (AdamW without foreach takes them one by one)
        self.param_units: dict[int, str] = {}
        self.optimizer_unit = "root"

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if any(t is DTensor for t in types):
                    return NotImplemented  # DTensor desugars into local ops, recorded then
                kwargs = kwargs or {}
                if not recorder.recording and args:
                    recorder.optimizer_unit = recorder.param_units.get(id(args[0]),
                                                                       recorder.optimizer_unit)
                out = func(*args, **kwargs)
                if recorder.recording:
                    recorder.record(func, args, kwargs, out)
                return out

        self.mode = Mode()

        def enter(module, *_):
            name = modules.get_known_fqn(module) if module is not None else None
            if name in unit_names:
                self.entered[name] = len(self.entered) + len(self.rows)
            self.dirty = True

        def changed(*_):
            self.dirty = True

        modules.register_user_hooks(pre_fw_hook=enter, post_fw_hook=changed, pre_bw_hook=enter,
                                    post_bw_hook=changed)

    def restart(self) -> None:
        """Forget the rows so far (a new micro-batch: the time model schedules one)."""
        self.rows.clear()
        self.collectives.clear()
        self.backward_collectives_from = None

    def unit(self) -> str:
        """The unit running now: of the units whose forward or backward is open, the one entered
        last (a T5 decoder block's backward stays open until the shared encoder output's gradient
        is complete, so nesting depth alone would keep naming it). In the optimizer step: the
        unit of the parameter being updated."""
        if not self.recording:
            return self.optimizer_unit
        if self.dirty:
            parents = self.modules.parents
            open_units = [n for n in self.unit_names if n in parents]
            name = max(open_units, key=lambda n: self.entered.get(n, -1)) if open_units else self.root
            self.current = self.unit_names.get(name, "root")
            self.dirty = False
        return self.current

    def phase(self) -> str:
        if not self.recording:
            return "optimizer"
        if self.modules.is_bw:
            return "recompute" if torch.is_grad_enabled() else "backward"
        return "forward"

    def record(self, func, args, kwargs, out) -> None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        kind = self.kinds.get(func, 0.5)
        if kind == 0.5:
            kind = self.kinds[func] = _classify(func)
        if kind is None:
            return
        if self.fake_mode is not None:
            from torch._guards import active_fake_mode

            active = active_fake_mode()
            if isinstance(active, FakeTensorMode) and active is not self.fake_mode:
                return  # DTensor's sharding propagation, not a kernel
        unit = self.unit()
        if kind == -1:
            if self.modules.is_bw and self.backward_collectives_from is None:
                self.backward_collectives_from = len(self.collectives)
            name = func.__name__.split(".")[0]
            if self.cp_group_name is not None and any(
                    isinstance(a, str) and a == self.cp_group_name for a in args):
                from utilities.measure.context_parallel import CP_PREFIX

                name = CP_PREFIX + name
            self.collectives.append((name, unit, _kernel_bytes(args[0])))
            return
        phase = self.phase()
        flops = 0.0
        fp32 = False
        if kind == MATMUL:
            f = self.flop_registry.get(func._overloadpacket)
            if f is None and func.__name__.startswith("_grouped_mm"):
                flops = _grouped_mm_flops(args[0], args[1])
            else:
                flops = float(f(*args, **kwargs, out_val=out)) if f else 0.0
            fp32 = isinstance(args[0], torch.Tensor) and args[0].dtype == torch.float32
        elif kind == ATTENTION:
            flops = _attention_flops(func, args, kwargs, self.causal)
        nbytes = _kernel_bytes(list(args)) + _kernel_bytes(list(kwargs.values())) + _kernel_bytes(out)
        fp8_ok = kind == MATMUL and func.__name__.split(".")[0] in ("mm", "addmm") and unit != "root"
        self.rows.append((unit, phase, kind, flops, nbytes, _FP32 if fp32 else _FP8_OK if fp8_ok else 0))


def unit_label(fqn: str) -> str:
    """A unit's short name: its fully qualified name without the model's and the checkpoint
    wrapper's prefixes ("layers.3"), "root" for the root."""
    if not fqn:
        return "root"
    parts = [p for p in fqn.split(".") if p not in ("model", "_checkpoint_wrapped_module")]
    return ".".join(parts) or fqn


def _cp_attention(group):
    """Attention under context parallelism over ``group`` (``context_parallel.cp_attention``),
    or nothing without one."""
    if group is None:
        return contextlib.nullcontext()
    from utilities.measure.context_parallel import cp_attention

    return cp_attention(group)


def _own_batch(spec):
    """While the planner's own batch runs: one sequence per row, as transformers would read from
    it (``hf_masks``); a ``--batch-fn`` batch is the user's, read as it is."""
    if getattr(spec, "make_batch", None) is not None:
        return contextlib.nullcontext()
    from utilities.measure.hf_masks import one_sequence_per_row

    return one_sequence_per_row()


def _segments(rows) -> list[Segment]:
    out: list[Segment] = []
    start = 0
    for i in range(1, len(rows) + 1):
        if i == len(rows) or rows[i][:2] != rows[start][:2]:
            chunk = rows[start:i]
            flags = np.array([r[5] for r in chunk], dtype=np.int8)
            out.append(Segment(
                unit=chunk[0][0], phase=chunk[0][1],
                kind=np.array([r[2] for r in chunk], dtype=np.int8),
                flops=np.array([r[3] for r in chunk], dtype=np.float64),
                nbytes=np.array([r[4] for r in chunk], dtype=np.float64),
                fp32=flags == _FP32, fp8_ok=flags == _FP8_OK))
            start = i
    return out


# -- memory samples --------------------------------------------------------------------------------

class _Samples:
    """The memory tracker's samples (its total and categories after every op and at every module
    boundary), grouped in runs: consecutive samples taken in one (unit, phase)."""

    def __init__(self, ops: OpRecorder, device_type: str):
        self.ops = ops
        self.device_type = device_type
        self.keys: tuple | None = None  # the tracker's categories, in its order ("Total" last)
        self.runs: list[tuple[tuple[str, str], list[tuple[int, ...]]]] = []
        self.event_places: list[tuple[str, str]] = []  # (unit, phase) of each memory event
        self.recorder = None  # the allocation recorder, told where each sample falls

    def __call__(self, current: dict) -> None:
        for dev, snap in current.items():
            if torch.device(dev).type != self.device_type:
                continue
            if self.keys is None:
                self.keys = tuple(snap)
            where = (self.ops.unit(), self.ops.phase())
            if self.recorder is not None:
                self.recorder.mark(where)
            if not self.runs or self.runs[-1][0] != where:
                self.runs.append((where, []))
            self.runs[-1][1].append(tuple(snap.get(k, 0) for k in self.keys))


@dataclass
class StepTrace:
    """One traced step: what the planner and the time model read.

    Memory: ``peak`` (the tracker's categories at the peak, by their names), ``states`` (the
    parameters, gradients and optimizer state held after the step), ``largest_unit_shard``;
    ``reserved(without)`` replays the allocations through the caching-allocator model. Time:
    ``segments`` (op segments in execution order, the last micro-batch's forward and backward),
    ``units`` (forward order), ``collectives`` (op, unit at issue, bytes)."""

    model: str
    precision: str
    ac: str
    batch: int
    seq: int
    world: int
    peak: dict[str, int]
    states: dict[str, int]
    largest_unit_shard: int
    segments: list[Segment]
    units: list[UnitInfo]
    collectives: list[tuple[str, str, int]]
    trace_s: float
    backward_collectives_from: int = 0  # where backward's collectives begin
    layers: int | None = None  # blocks in the model
    traced_layers: tuple[int, ...] = ()  # the depths traced, when scaled from smaller ones
    memory_events: MemoryEvents | None = field(default=None, repr=False)
    unit_states: dict[str, dict[str, int]] = field(default_factory=dict, repr=False)
    reserved_scaled_linearly: bool = False  # the replay could not be extended block by block

    def reserved(self, without: frozenset[str] = frozenset()) -> dict[str, int] | None:
        """The caching allocator's peaks for this step (``allocator.reserved_peak``), leaving out
        the allocations whose tracker category is in ``without`` (offloaded to the host)."""
        return self.memory_events.reserved(without) if self.memory_events else None


# FSDP2's own CUDA streams, by the tracker's category of what is allocated on them: the
# all-gather outputs off the compute stream, the reduce-scatter's output on its stream, which the
# sharded gradients are views of (``allocator``); the rest (the reduce-scatter's input too): 0
STREAMS = {"All Gather": 1, "Sharded Grad": 2}


@dataclass
class MemoryEvents:
    """The step's memory, as a replay needs it: ``resident`` (unit, bytes, category) held before
    the step (parameter shards and buffers, then the optimizer state, unit by unit), ``step`` its
    ``(kind, key, bytes, category)`` events in order ("alloc", "free", "ref": a tensor changes
    category, "sample": the tracker takes its totals); or, where a scaled trace could not be
    extended event by event, two traced depths and the factor between them (``linear``)."""

    resident: list[tuple[str, int, str]] = field(default_factory=list)
    step: list[tuple[str, Any, int, str | None]] = field(default_factory=list)
    device_type: str = "cpu"
    linear: tuple[MemoryEvents, MemoryEvents, float] | None = None

    def reserved(self, without: frozenset[str] = frozenset()) -> dict[str, int] | None:
        from utilities.measure.allocator import reserved_peak

        if self.linear is not None:
            a, b, factor = (self.linear[0].reserved(without), self.linear[1].reserved(without),
                            self.linear[2])
            if a is None or b is None:
                return None
            return {k: int(round(a[k] + factor * (b[k] - a[k]))) for k in a}
        before = [("alloc", ("resident", i), n) for i, (_, n, kind) in enumerate(self.resident)
                  if kind not in without]
        # each allocation by its own name (a tracker's key is reused once its tensor is gone),
        # left out when its category then is in ``without``, on the stream its category says
        step: list[tuple[str, Any, int]] = []
        streams: dict[Any, int] = {}
        live: dict[Any, Any] = {}
        for count, (kind, key, n, category) in enumerate(self.step):
            if kind == "alloc":
                if key in live:
                    step.append(("free", live.pop(key), 0))
                live[key] = (key, count)
                if category not in without:
                    step.append(("alloc", live[key], n))
            elif kind == "free" and key in live:
                step.append(("free", live.pop(key), 0))
            if category in STREAMS and key in live:  # booked as such when allocated or just after
                streams[live[key]] = STREAMS[category]
        return reserved_peak(before, step, streams=streams) if step else None

    def peak(self) -> dict[str, int]:
        """The tracker's peak snapshot (bytes by category, and "Total"), replayed: each tensor
        counts its bytes (rounded up to 512 on CUDA, as the tracker rounds) in its category, and
        the peak is the first sample with the largest total."""
        unit = 512 if self.device_type == "cuda" else 1
        cur: dict[str, int] = {}
        live: dict[Any, tuple[str, int]] = {}
        for _, n, category in self.resident:
            cur[category] = cur.get(category, 0) + -(-n // unit) * unit
        total = best = sum(cur.values())
        snap = dict(cur)
        for kind, key, n, category in self.step:
            if kind == "sample":
                if total > best:
                    best, snap = total, dict(cur)
                continue
            old = live.pop(key, None) if kind != "ref" else live.get(key)
            if old is not None:
                cur[old[0]] -= old[1]
                total -= old[1]
            if kind == "alloc" or (kind == "ref" and old is not None):
                size = -(-n // unit) * unit if kind == "alloc" else old[1]
                live[key] = (category, size)
                cur[category] = cur.get(category, 0) + size
                total += size
        snap = {k: v for k, v in snap.items() if v}
        snap["Total"] = best
        return snap


# -- tracing -------------------------------------------------------------------------------------

def _run(spec, config: StepConfig) -> tuple[StepTrace, _Samples]:
    """One step of ``spec`` in ``config`` under both recorders: the ``StepTrace`` and the
    tracker's samples.

    The optimizer state is created by one untracked AdamW step on zero gradients: the same tensors
    a first real step would create, at no forward's cost. Both steps take the same ``foreach``: a
    tracked step that dispatches ops the untracked one did not misses DTensor's sharding-propagation
    cache, and propagation then runs those ops at their full (unsharded) size under the planner's
    own FakeTensorMode, which the tracker books as optimizer state. Under tensor parallelism the
    forward and backward run DTensor ops too: one untracked forward and backward come first."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh

    from utilities.distributed import T5_POSITION_BIAS_VIEW
    from utilities.measure.allocator import EventRecorder
    from utilities.measure.memory import TrackerHooks, census
    from utilities.measure.plan_options import (
        PlanOptions,
        accumulate,
        step_loss,
        traced_micro_batches,
        trainable_parameters,
    )
    from utilities.measure.tensor_parallel import HEAD_VIEW_WARNING, loss_parallel_context
    from utilities.torch_internals import fsdp_mem_tracker, global_peak_only, mod_tracker_of

    world, strategy, precision, ac = config.world, config.strategy, config.precision, config.ac
    batch, seq, shard_size, tp, cp = config.batch, config.seq, config.shard_size, config.tp, config.cp
    device = torch.device(config.device_type)
    options = config.options or PlanOptions()
    t0 = time.perf_counter()
    with fake_world(world), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The module hierarchy tracking")
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
        warnings.filterwarnings("ignore", message="Module is None")
        warnings.filterwarnings("ignore", message=T5_POSITION_BIAS_VIEW)
        warnings.filterwarnings("ignore", message=HEAD_VIEW_WARNING)
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
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        model = prepare(spec, strategy, precision, ac, mesh, fake_mode, device, options, tp)
        root_name = type(model).__name__
        units: dict[str, UnitInfo] = {}
        tracker_names: dict[str, str] = {}
        for fqn, own in _unit_parameters(model):
            label = unit_label(fqn)
            units[label] = UnitInfo(label, [tuple(p.shape) for p in own], is_root=not fqn,
                                    trainable=[p.requires_grad for p in own], fqn=fqn)
            tracker_names[root_name + ("." + fqn if fqn else "")] = label
        with fake_mode, _cp_attention(cp_group) as cp_calls, _own_batch(spec):
            data = fake_batch(spec, batch, seq // cp, device, mask=cp == 1)
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
            tracker = fsdp_mem_tracker()(model, optimizer)

            def between():
                tracker.reset_mod_stats()  # FSDPMemTracker follows one forward per module
                ops.restart()

            ops = OpRecorder(mod_tracker_of(tracker), tracker_names, root_name,
                             causal=not spec.is_seq2seq)
            ops.fake_mode = fake_mode
            ops.cp_group_name = cp_group.group_name if cp_group is not None else None
            samples = _Samples(ops, device.type)
            global_peak_only(tracker, observe=samples)
            recorder = EventRecorder(tracker, device.type, where=lambda: (ops.unit(), ops.phase()))
            samples.recorder = recorder

            with ops.mode, TrackerHooks(), tracker:  # the hooks go, so the model can be collected
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
            held = census(model, optimizer)
            peak = {}
            for dev, snap in tracker.get_tracker_snapshot("peak").items():
                if torch.device(dev).type == device.type:
                    peak = {str(getattr(k, "value", k)): int(v) for k, v in snap.items()}
            states = {k: int(held[k]) for k in ("parameters", "gradients", "optimizer")}
            shard = largest_unit_shard(model)
            resident = _resident(model, optimizer, device.type)
            unit_states = _unit_states(model, optimizer)
    segments = _segments(ops.rows)
    order: list[str] = []
    for s in segments:
        if s.phase == "forward" and s.unit not in order:
            order.append(s.unit)
    order += [u for u in units if u not in order]
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
                     memory_events=memory, unit_states=unit_states)
    samples.event_places = places
    return step, samples


@dataclass(frozen=True)
class StepConfig:
    """One training step's configuration, as the trace takes it and caches it by: ``world``
    ranks, the FSDP ``strategy`` (and HSDP's ``shard_size``), ``precision``, activation
    checkpointing ``ac``, ``batch`` x ``seq`` tokens per rank, the fake tensors' ``device_type``,
    the plan's ``options`` (``PlanOptions``), tensor parallelism ``tp``, ``scale`` (trace a
    deep model at small depths and extend it), and context parallelism ``cp`` (each rank of a
    CP group runs seq / cp of the tokens, ``utilities.measure.context_parallel``)."""

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


def trace(spec, world: int | StepConfig, strategy: str = "full_shard", precision: str = "bf16",
          ac: str = "none", batch: int = 1, seq: int | None = None, device_type: str = "cuda",
          shard_size: int | None = None, options=None, scale: bool = True, tp: int = 1,
          cp: int = 1) -> StepTrace:
    """One fake training step of ``spec`` (a ``ModelSpec`` or a course model's name) on ``world``
    ranks (or in the ``StepConfig`` given instead), cached by its ``StepConfig``: the planner and
    the time model of one configuration share it. ``tp``: tensor parallelism inside groups of
    ``tp`` ranks, FSDP2 across them; ``cp``: context parallelism over groups of ``cp`` ranks
    (FSDP2 over every rank). ``scale``: trace a deep model at two small depths and scale
    (the module's docstring); False traces every block. Read it, do not change it (the cache
    hands the same object to every caller)."""
    from utilities.measure.plan_options import PlanOptions
    from utilities.models import get_model_spec
    from utilities.torch_internals import untraceable_op

    spec = get_model_spec(spec) if isinstance(spec, str) else spec
    config = world if isinstance(world, StepConfig) else StepConfig(
        world, strategy, precision, ac, batch, seq, device_type, shard_size, options, tp, scale, cp)
    config = dataclasses.replace(config, seq=config.seq or spec.default_seq_len,
                                 device_type=fake_device(config.device_type)[0].type,
                                 options=config.options or PlanOptions())
    try:
        return _trace(spec, config)
    except Exception as e:
        op = untraceable_op(e)
        if op is None:
            raise
        raise UsageError(f"model {spec.name} is not allowed: its step runs {op}, which cannot run on "
                         "fake tensors (no fake kernel, or an output that depends on the data); "
                         "allowed: a step whose every op has a shape known without the data") from None


@functools.lru_cache(maxsize=16)
def _trace(spec, config: StepConfig) -> StepTrace:
    device = torch.device(config.device_type)
    depths = scaled_depths(spec, config.ac, config.options) if config.scale else None
    if depths is None:
        return _whole(spec, config)
    t0 = time.perf_counter()
    small, small_samples = _run(_with_layers(spec, depths[0]), config)
    if not adamw_foreach(device):
        scaled = _extended(spec, small, small_samples, depths[0], depths[1] - depths[0])
    else:  # AdamW's foreach: its temporaries span every block; two depths, extended linearly
        large, large_samples = _run(_with_layers(spec, depths[1]), config)
        scaled = _scale(spec, small, small_samples, large, large_samples, depths)
    if scaled is None:  # the blocks are not alike: trace them all
        return _whole(spec, config)
    scaled.trace_s = time.perf_counter() - t0
    return scaled


def _whole(spec, config: StepConfig) -> StepTrace:
    step, _ = _run(spec, config)
    step.layers = _layers(spec)
    return step


# -- scaling a deep model from two small depths ------------------------------------------------------

def _layers(spec) -> int | None:
    """The model's block count (``num_hidden_layers``), or None where it has several stacks (T5's
    encoder and decoder) or none the config names."""
    if spec.is_seq2seq:
        return None
    n = getattr(spec.config(), "num_hidden_layers", None)
    return n if isinstance(n, int) else None


def _period(ac: str) -> int:
    """How many blocks repeat: checkpointing every second block makes pairs."""
    return 2 if ac == "every-2nd-block" else 1


def scaled_depths(spec, ac: str, options=None) -> tuple[int, int] | None:
    """The depth a model is traced at and the next one (traced too where the events cannot be
    extended: AdamW's foreach), or None when it is traced whole: a shallow model, one with
    several stacks, a freezing that differs block by block (``--trainable``), or an odd number
    of blocks under block-pair checkpointing. A depth is two periods of blocks at each end and
    one in the middle (a period: one block, or two under block-pair checkpointing)."""
    layers = _layers(spec)
    p = _period(ac)
    if layers is None or (options is not None and options.trainable is not None):
        return None
    small = (2 * EDGE_BLOCKS + 1) * p
    if layers <= small + p or layers % p:
        return None
    return small, small + p


def _periods(index: dict[str, int], p: int) -> dict[str, int]:
    """Each block unit's period (blocks ``p`` at a time), for ``_role``."""
    return {unit: i // p for unit, i in index.items()}


def _with_layers(spec, n: int):
    """``spec`` with ``n`` blocks (its config's ``num_hidden_layers``)."""
    make = spec.make_config

    def config():
        cfg = make()
        cfg.num_hidden_layers = n
        return cfg

    return dataclasses.replace(spec, make_config=config, known_parameters=None,
                               name=f"{spec.name} [{n} blocks]")


_BLOCK = re.compile(r"^(.*?)(\d+)$")


def _block_index(units: list[UnitInfo]) -> tuple[str, dict[str, int]] | None:
    """The blocks' common prefix and each block unit's index, from the units in forward order;
    None unless they are named ``prefix0``, ``prefix1``, ... in order."""
    blocks = [u.name for u in units if not u.is_root]
    found = [_BLOCK.match(b) for b in blocks]
    if not blocks or not all(found) or len({m.group(1) for m in found}) != 1:
        return None
    if [int(m.group(2)) for m in found] != list(range(len(blocks))):
        return None
    return found[0].group(1), {b: i for i, b in enumerate(blocks)}


def _role(unit: str, index: dict[str, int], depth: int) -> int | str:
    """A unit's place, the same at any depth: "root", 0 and 1 (the first blocks), -2 and -1 (the
    last), or "middle". ``index`` and ``depth`` count blocks, or periods of blocks
    (``_periods``)."""
    if unit not in index:
        return "root"
    i = index[unit]
    if i < EDGE_BLOCKS:
        return i
    if i >= depth - EDGE_BLOCKS:
        return i - depth
    return "middle"


def _roles(units: list[str], index, depth) -> list:
    """Each entry's place, the same at any depth: a block's role (``_role``), or for the root's
    entries the role of the block that ran last before them, as ("after", role) (the root's
    work between two blocks belongs with the block before it)."""
    out, after = [], "start"
    for unit in units:
        role = _role(unit, index, depth)
        if role == "root":
            out.append("middle" if after == "middle" else ("after", after))
        else:
            out.append(role)
            after = role
    return out


def _keyed_runs(samples: _Samples, index, depth):
    """The runs outside the middle blocks, each keyed by (role, phase, its count so far)."""
    out, seen = [], {}
    roles = _roles([unit for (unit, _), _ in samples.runs], index, depth)
    for role, ((_, phase), values) in zip(roles, samples.runs):
        if role == "middle":
            continue
        n = seen[(role, phase)] = seen.get((role, phase), -1) + 1
        out.append(((role, phase, n), values))
    return out


def _scaled_peak(small: _Samples, large: _Samples, index_small, index_large, depths,
                 factor: float) -> dict[str, int] | None:
    """The largest sample of the deep model and its categories, each sample extended linearly
    from the two depths; None when the runs of the two depths do not match."""
    a = _keyed_runs(small, index_small, depths[0])
    b = _keyed_runs(large, index_large, depths[1])
    if [k for k, _ in a] != [k for k, _ in b] or small.keys != large.keys or not small.keys:
        return None
    total = small.keys.index("Total")
    best, best_values = None, None
    for (_, va), (_, vb) in zip(a, b):
        if len(va) == len(vb):
            pairs = zip(va, vb)
        else:  # a run whose length grows with the depth (the optimizer's per-parameter ops)
            pairs = [(max(va, key=lambda s: s[total]), max(vb, key=lambda s: s[total]))]
        for sa, sb in pairs:
            t = sa[total] + factor * (sb[total] - sa[total])
            if best is None or t > best:
                best = t
                best_values = [x + factor * (y - x) for x, y in zip(sa, sb)]
    return {k: int(round(v)) for k, v in zip(small.keys, best_values)}


def _renamed(seq, name_of, backward_from, index, prefix, depth, layers, p):
    """``seq`` (segments, collectives or units of the trace at ``depth``, whose middle blocks are
    one period ``p``; its backward from index ``backward_from``) with the middle entries repeated
    to fill ``layers`` blocks, in ascending order in forward and descending in backward, and
    every block renamed to its index in the deep model."""
    def rename(unit, shift=0):
        if unit not in index:
            return unit
        i = index[unit]
        return f"{prefix}{i + shift if i < depth - EDGE_BLOCKS * p else i + layers - depth}"

    copies = (layers - 2 * EDGE_BLOCKS * p) // p
    roles = _roles([name_of(x) for x in seq], _periods(index, p), depth // p)
    out, i = [], 0
    while i < len(seq):
        if roles[i] != "middle":
            out.append((seq[i], rename(name_of(seq[i]))))
            i += 1
            continue
        j = i
        while j < len(seq) and roles[j] == "middle":
            j += 1
        order = range(copies) if i < backward_from else range(copies - 1, -1, -1)
        out += [(x, rename(name_of(x), p * c)) for c in order for x in seq[i:j]]
        i = j
    return out


def _repeated(spec, small: StepTrace, depth: int, p: int, **memory) -> StepTrace | None:
    """The deep model's ``StepTrace`` from the trace at ``depth`` blocks (its middle: one period of
    ``p`` blocks): op segments, collectives and units with the middle repeated and renamed, and
    the memory given (``peak``, ``states``, ``memory_events``). None unless the blocks are named
    ``prefix0``, ``prefix1``, ... in order."""
    named = _block_index(small.units)
    if named is None:
        return None
    layers = _layers(spec)
    prefix, index = named
    where = (index, prefix, depth, layers, p)
    backward = next((i for i, s in enumerate(small.segments) if s.phase != "forward"),
                    len(small.segments))
    segments = [dataclasses.replace(s, unit=name) for s, name in _renamed(
        small.segments, lambda s: s.unit, backward, *where)]
    collectives = [(c[0], name, c[2]) for c, name in _renamed(
        small.collectives, lambda c: c[1], small.backward_collectives_from, *where)]
    units = [dataclasses.replace(u, name=name, fqn=re.sub(r"\d+$", _BLOCK.match(name).group(2), u.fqn)
                                 if _BLOCK.match(name) else u.fqn)
             for u, name in _renamed(small.units, lambda u: u.name, len(small.units), *where)]
    return StepTrace(model=spec.name, precision=small.precision, ac=small.ac, batch=small.batch,
                     seq=small.seq, world=small.world, largest_unit_shard=small.largest_unit_shard,
                     segments=segments, units=units, collectives=collectives, trace_s=0.0,
                     layers=layers, backward_collectives_from=len(_renamed(
                         small.collectives[:small.backward_collectives_from], lambda c: c[1],
                         small.backward_collectives_from, *where)), **memory)


def _extended(spec, small: StepTrace, samples: _Samples, depth: int, p: int) -> StepTrace | None:
    """A deep model from one trace at ``depth`` blocks: its memory events extended block by block
    (``_extended_events``) and replayed for the peak, each unit's states summed, its ops repeated.
    None where the replay of the trace itself is not the tracker's peak, or the blocks differ."""
    named = _block_index(small.units)
    if named is None or small.memory_events.peak() != {k: v for k, v in small.peak.items() if v}:
        return None
    periods = _periods(named[1], p)
    copies = (_layers(spec) - 2 * EDGE_BLOCKS * p) // p
    events = _extended_events(small.memory_events, samples.event_places, periods, depth // p,
                              copies)
    if events is None:
        return None
    states = {k: 0 for k in small.states}
    for unit, held in small.unit_states.items():
        for k in states:
            states[k] += held[k] * (copies if _role(unit, periods, depth // p) == "middle" else 1)
    peak = dict.fromkeys(small.peak, 0)  # the tracker's categories, zeros included
    peak.update(events.peak())
    return _repeated(spec, small, depth, p, peak=peak, states=states, memory_events=events,
                     traced_layers=(depth,))


def _scale(spec, small: StepTrace, small_samples: _Samples, large: StepTrace,
           large_samples: _Samples, depths: tuple[int, int]) -> StepTrace | None:
    """A deep model from two traces: each memory sample extended linearly (``_scaled_peak``), the
    states and the allocator's replay too; the ops of the smaller repeated."""
    p = depths[1] - depths[0]
    named_small, named_large = _block_index(small.units), _block_index(large.units)
    if named_small is None or named_large is None:
        return None
    factor = (_layers(spec) - depths[0]) / p
    peak = _scaled_peak(small_samples, large_samples, _periods(named_small[1], p),
                        _periods(named_large[1], p), (depths[0] // p, depths[1] // p), factor)
    if peak is None:
        return None
    states = {k: int(round(small.states[k] + factor * (large.states[k] - small.states[k])))
              for k in small.states}
    return _repeated(spec, small, depths[0], p, peak=peak, states=states, traced_layers=depths,
                     memory_events=MemoryEvents(linear=(small.memory_events, large.memory_events,
                                                        factor)),
                     reserved_scaled_linearly=True)


def _extended_events(events: MemoryEvents, places, index, depth: int, copies: int
                     ) -> MemoryEvents | None:
    """The memory events of the step at ``depth`` periods of blocks (``index``: each block's
    period) extended to a deep model: the middle period's events (allocations, frees, category
    changes, the tracker's samples) repeated ``copies`` times, once per middle period of the
    deep model.

    Each allocation belongs to the block whose work made it (the root's work between two blocks
    belongs with the block before it) and is known by its rank among that block's allocations, so
    the same allocation of another block is found: an event of the n-th middle copy that refers
    to what the block before made refers to copy n - 1's (block 1's for the first), what the block
    after made to copy n + 1's; an event outside the middle refers to the copy beside it. None
    where the blocks' allocations differ."""
    units = [u for u, _ in places]
    roles = [r[1] if isinstance(r, tuple) else r for r in _roles(units, index, depth)]
    roles = ["root" if r == "start" else r for r in roles]
    owner: dict[Any, tuple[Any, int]] = {}  # key -> (block, rank) of its current allocation
    count: dict[Any, int] = {}
    sizes: dict[Any, list[int]] = {}
    tagged = []  # (kind, identity, bytes, category, the identity an alloc replaces)
    for (kind, key, n, category), role in zip(events.step, roles):
        if kind == "alloc":
            previous = owner.get(key)
            rank = count[role] = count.get(role, -1) + 1
            sizes.setdefault(role, []).append(n)
            owner[key] = (role, rank)
            tagged.append(("alloc", (role, rank), n, category, previous))
        elif kind == "free":
            tagged.append(("free", owner.pop(key, None), 0, category, None))
        else:  # "ref" (of a live allocation) or "sample"
            tagged.append((kind, owner.get(key) if kind == "ref" else None, 0, category, None))
    if not (sizes.get(1) == sizes.get("middle") == sizes.get(-2)):
        return None

    def mapped(ident, copy, side):
        """The deep model's name of allocation ``ident`` as seen from ``copy`` of the middle
        (None: outside it, on ``side`` 0 = before the middle, 1 = after)."""
        block, rank = ident
        if copy is None:
            return ("middle", rank, 0 if side == 0 else copies - 1) if block == "middle" else ident
        if block == "middle":
            return ("middle", rank, copy)
        if block == 1:
            return ident if copy == 0 else ("middle", rank, copy - 1)
        if block == -2:
            return ident if copy == copies - 1 else ("middle", rank, copy + 1)
        return ident

    def emit(out, i, copy, side):
        kind, ident, n, category, previous = tagged[i]
        if kind == "sample":
            out.append(("sample", None, 0, None))
        elif kind == "alloc":
            if previous is not None:  # re-allocated in place: the old block goes first
                out.append(("free", mapped(previous, copy, side), 0, category))
            name = ("middle", ident[1], copy) if copy is not None else ident
            out.append(("alloc", name, n, category))
        elif ident is not None:
            out.append((kind, mapped(ident, copy, side), 0, category))

    step: list[tuple[str, Any, int, str | None]] = []
    side, i = 0, 0
    while i < len(tagged):
        if roles[i] != "middle":
            if roles[i] in (-2, -1):
                side = 1
            elif roles[i] in (0, 1):
                side = 0
            emit(step, i, None, side)
            i += 1
            continue
        j = i
        while j < len(tagged) and roles[j] == "middle":
            j += 1
        forward = places[i][1] not in ("backward", "recompute")
        for copy in (range(copies) if forward else range(copies - 1, -1, -1)):
            for k in range(i, j):
                emit(step, k, copy, None)
        i = j
    resident, i = [], 0
    while i < len(events.resident):  # the middle period's entries: repeated as a group
        j = i + 1
        if _role(events.resident[i][0], index, depth) == "middle":
            while j < len(events.resident) and _role(events.resident[j][0], index,
                                                     depth) == "middle":
                j += 1
            resident += events.resident[i:j] * copies
        else:
            resident.append(events.resident[i])
        i = j
    return MemoryEvents(resident=resident, step=step, device_type=events.device_type)
