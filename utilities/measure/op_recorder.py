"""What the time model reads from a fake step: every ATen op's kind, FLOPs and bytes, the FSDP
unit running it and the phase.

``OpRecorder`` is a ``TorchDispatchMode`` run beside the memory tracker (``fake_step.trace``);
its rows become ``Segment``-s (consecutive ops of one unit in one phase, ``op_segments``), which
``cost_model.segment_time`` turns into seconds. ``UnitInfo``: one FSDP unit and the shapes of the
parameters it manages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from utilities.measure.transfers import collective_name

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


def classify_op(func) -> int | None:
    """The kind of an ATen op, or None for ops that launch no kernel (views, allocations)."""
    ns = func.namespace
    name = func.__name__.split(".")[0]
    if ns in _SKIP_NAMESPACES or name in _SKIP_OPS or _view_like(func):
        return None
    if collective_name(func) is not None:
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
            kind = self.kinds[func] = classify_op(func)
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
            name = collective_name(func)
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


def op_segments(rows) -> list[Segment]:
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
