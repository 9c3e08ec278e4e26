"""Host <-> device copies and reduce-scatters counted, and where each piece of training state lives.

CPU offload keeps the parameters, gradients and optimizer state in host memory; FSDP copies a
unit's parameter shards to the GPU before its all-gather (forward, and again in backward for units
resharded after forward) and each reduce-scattered gradient shard back to the host. ``count_copies``
watches one step and books those copies by what they move, recognized by storage, not by FSDP's
private names:

* **to device**: a ``Tensor.to(device)`` whose source shares storage with a parameter's local
  shard (the shards the step started with; on a CPU run the compute device is the CPU);
* **to host**: a ``Tensor.to(cpu)`` or a ``copy_`` whose result is a gradient at the end of the
  step, that very tensor (same start, same size; FSDP2 moves each reduce-scattered shard with
  ``.to``, FSDP1 copies into its host gradient buffer with ``copy_``).

Each copy counts as *issued*; it also counts as *moved* when bytes changed place (a ``.to`` that
returned a new tensor, or a ``copy_`` between two storages). On a CPU-only run the host and the
device are the same memory: FSDP2 issues its copies all the same (``.to(cpu)`` returns the tensor
itself, nothing moves), FSDP1 checks the device first and issues none to the device, and only its
copy into the host gradient buffer moves bytes. On a GPU, issued and moved agree.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from utilities.measure.memory import tensor_bytes


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)  # a DTensor (FSDP2): its shard on this rank
    return to_local() if callable(to_local) else t


def _storage(t: Any) -> int | None:
    if not isinstance(t, torch.Tensor):
        return None
    try:
        return _local(t).untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # meta or storage-less tensors
        return None


def _exact(t: Any) -> tuple[int, int] | None:
    """Where a tensor starts and how many bytes it spans: the same tensor, not just its storage."""
    if not isinstance(t, torch.Tensor):
        return None
    try:
        return _local(t).data_ptr(), tensor_bytes(t)
    except (RuntimeError, NotImplementedError):
        return None


def _target_device(args: tuple, kwargs: dict) -> torch.device | None:
    """The device a ``Tensor.to`` call names (None for a dtype-only call)."""
    for a in (*args[1:], kwargs.get("device")):
        if isinstance(a, (torch.device, str)):
            try:
                return torch.device(a)
            except RuntimeError:
                return None
        if isinstance(a, torch.Tensor):
            return a.device
    return None


@dataclass
class CopyCount:
    """What one watched step copied, by direction: calls issued and bytes, and what really moved."""

    to_device_copies: int = 0
    to_device_bytes: int = 0
    to_device_moved_bytes: int = 0
    to_host_copies: int = 0
    to_host_bytes: int = 0
    to_host_moved_bytes: int = 0
    _calls: list[tuple[str, int | None, tuple[int, int] | None, int, bool, str | None]] = field(
        default_factory=list, repr=False)

    def as_dict(self) -> dict[str, int]:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}

    def classify(self, parameter_storages: set[int], gradients: set[tuple[int, int]]) -> None:
        """Book every recorded call by what it moved: the parameters' storages the step began with,
        the gradient tensors it ended with (exactly: a copy into a buffer a gradient is a view of
        is not the gradient's copy)."""
        for kind, src, out, nbytes, moved, target in self._calls:
            if kind == "to" and src in parameter_storages:
                self.to_device_copies += 1
                self.to_device_bytes += nbytes
                self.to_device_moved_bytes += nbytes if moved else 0
            elif out in gradients and (kind == "copy_" or target == "host"):
                self.to_host_copies += 1
                self.to_host_bytes += nbytes
                self.to_host_moved_bytes += nbytes if moved else 0
        self._calls.clear()


@contextlib.contextmanager
def _recording(count: CopyCount) -> Iterator[None]:
    """``Tensor.to`` and ``Tensor.copy_`` recorded while active. The methods themselves are
    wrapped, for the step's duration only: FSDP issues its gradient copies from backward hooks,
    which the autograd engine runs outside any ``TorchFunctionMode``."""
    to, copy_ = torch.Tensor.to, torch.Tensor.copy_

    def recorded_to(self, *args, **kwargs):
        out = to(self, *args, **kwargs)
        device = _target_device((self, *args), kwargs)
        if device is not None:
            target = "host" if device.type == "cpu" else "device"
            count._calls.append(("to", _storage(self), _exact(out), tensor_bytes(self), out is not self,
                                 target))
        return out

    def recorded_copy_(self, src, *args, **kwargs):
        out = copy_(self, src, *args, **kwargs)
        if isinstance(src, torch.Tensor):
            count._calls.append(("copy_", _storage(src), _exact(self), tensor_bytes(src), True, None))
        return out

    torch.Tensor.to, torch.Tensor.copy_ = recorded_to, recorded_copy_
    try:
        yield
    finally:
        torch.Tensor.to, torch.Tensor.copy_ = to, copy_


def parameter_storages(model: nn.Module) -> set[int]:
    """The storages of the parameters' local shards (FSDP2's DTensors, FSDP1's flat parameters)."""
    return {s for p in model.parameters() if (s := _storage(p)) is not None}


def local_parameter_bytes(model: nn.Module) -> int:
    """The bytes of this rank's parameter shards (FSDP1's with their padding)."""
    return sum(tensor_bytes(p) for p in model.parameters())


def gradient_tensors(model: nn.Module) -> set[tuple[int, int]]:
    """Where each gradient's local shard starts and how many bytes it spans."""
    return {g for p in model.parameters() if p.grad is not None and (g := _exact(p.grad)) is not None}


@contextlib.contextmanager
def count_copies(model: nn.Module) -> Iterator[CopyCount]:
    """Count the host <-> device copies of the step run inside (forward and backward: the copies
    happen there; the optimizer step runs where its state lives and copies nothing)."""
    count = CopyCount()
    params = parameter_storages(model)
    with _recording(count):
        yield count
    count.classify(params, gradient_tensors(model))


def placement(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Where each piece of training state lives on this rank: the devices of the parameters' local
    shards, their gradients and the optimizer state, and whether the parameter shards are in pinned
    (page-locked) host memory, which lets the copies to the GPU run asynchronously."""
    def devices(tensors) -> str:
        found = sorted({str(_local(t).device) for t in tensors})
        return ",".join(found) if found else "-"

    params = [p for p in model.parameters()]
    state = [] if optimizer is None else [v for s in optimizer.state.values() for v in s.values()
                                          if isinstance(v, torch.Tensor) and v.dim() > 0]
    pinned = False
    with contextlib.suppress(RuntimeError):  # no accelerator: nothing can be pinned
        pinned = bool(params) and all(_local(p).is_pinned() for p in params if p.numel())
    return {"parameters": devices(params), "gradients": devices(p.grad for p in params
                                                                if p.grad is not None),
            "optimizer": devices(state), "pinned": pinned}


COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional")  # the dispatcher's collectives


def collective_name(func) -> str | None:
    """The name of the collective an ATen op issues (``_allgather_base_``,
    ``reduce_scatter_tensor``...), or None for an op that is not a collective."""
    if getattr(func, "namespace", "") in COLLECTIVE_NAMESPACES:
        return func.__name__.split(".")[0]
    return None


def collective_kind(name: str) -> str:
    """A collective's name as a kind: "all_gather" and "reduce_scatter" whatever the variant
    (``_allgather_base_``, ``all_gather_into_tensor``, ``reduce_scatter_tensor_coalesced_``...),
    any other one by its own name without underscores at the ends ("allreduce", "broadcast")."""
    name = name.lower().strip("_")
    return "all_gather" if "allgather" in name or "all_gather" in name else \
        "reduce_scatter" if "reduce_scatter" in name else name


def _tensors(args) -> list[torch.Tensor]:
    return [t for a in args for t in (a if isinstance(a, (list, tuple)) else [a])
            if isinstance(t, torch.Tensor)]


class CollectiveCounter:
    """The collectives this process issues while active, as torch's dispatcher sees them, by kind
    (``collective_kind``): ``counts`` (calls), ``dtypes`` (of the tensors they moved) and
    ``bytes`` (each call's largest tensor argument: the unsharded side, a reduce-scatter's input or
    an all-gather's output). ``with CollectiveCounter() as counter:``."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        self.counts: dict[str, int] = {}
        self.dtypes: dict[str, set[str]] = {}
        self.bytes: dict[str, int] = {}
        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = collective_name(func)
                if name is not None:
                    counter.record(collective_kind(name), _tensors(args))
                return func(*args, **(kwargs or {}))

        self.mode = Mode()

    def record(self, kind: str, moved: list[torch.Tensor]) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1
        self.dtypes.setdefault(kind, set()).update(str(t.dtype).removeprefix("torch.") for t in moved)
        self.bytes[kind] = self.bytes.get(kind, 0) + max((tensor_bytes(t) for t in moved), default=0)

    def __enter__(self) -> CollectiveCounter:
        self.mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.mode.__exit__(*exc)


@dataclass
class ReduceScatterCount:
    calls: int = 0
    bytes: int = 0  # the inputs' bytes: the unsharded gradients handed to the collective


@contextlib.contextmanager
def count_reduce_scatters() -> Iterator[ReduceScatterCount]:
    """Count the reduce-scatters this process issues while active, and their input bytes
    (``CollectiveCounter``'s "reduce_scatter"), filled in when the block ends."""
    count = ReduceScatterCount()
    with CollectiveCounter() as counter:
        yield count
    count.calls = counter.counts.get("reduce_scatter", 0)
    count.bytes = counter.bytes.get("reduce_scatter", 0)
