"""Freeing a finished variant completely, and proving it was freed.

Lessons train several configurations one after another in the same processes. If one of them
stays alive, the next one's peak memory includes it: on an H100, lesson 04's six variants once
reported peaks rising by the size of the AdamW state each time. ``VariantScope`` (used through
``Lesson.variant``) records weak references to everything a variant trained, frees it at the end
and reports what survived, so a leak shows up as a number in results.json and fails the tests.

Why ``del model`` is not enough for FSDP1: the module's original parameters become *views* of its
``FlatParameter``; a view holds its base through C++ (autograd), and the flat parameter's own
attributes point back at the modules. Python's garbage collector cannot see the C++ edge, so the
cycle is never collected and every FSDP1 variant stays allocated. ``break_fsdp1_cycles`` cuts the
Python side of that loop once the model is no longer used.
"""

from __future__ import annotations

import gc
import warnings
import weakref
from typing import Any

import torch
from torch import nn

from utilities.torch_internals import (
    FLAT_PARAM_BACKREFS,
    FLAT_PARAM_HOOKS,
    clear_cublas_workspaces,
    flat_param_types,
    fsdp1_flat_param,
    is_flat_param,
)


def break_fsdp1_cycles(model: nn.Module) -> int:
    """Cut the flat-parameter <-> module reference loops of an FSDP1 model (see the module
    docstring); returns how many flat parameters were cut. The model is unusable afterwards."""
    cut = 0
    for p in list(model.parameters()) + [fsdp1_flat_param(m) for m in model.modules()]:
        if p is not None and is_flat_param(p):
            _cut_flat_param(p)
            cut += 1
    return cut


def _cut_flat_param(p: torch.Tensor) -> None:
    for name in FLAT_PARAM_BACKREFS:
        p.__dict__.pop(name, None)
    # A unit with frozen parameters reshards through a multi-grad hook on its inputs, whose
    # handle FSDP1 keeps until the next forward: its closure holds autograd nodes.
    for name in FLAT_PARAM_HOOKS:
        held = p.__dict__.pop(name, None)
        for handle in held if isinstance(held, tuple) else (held,):
            if hasattr(handle, "remove"):
                handle.remove()


def _flat_params() -> list[torch.Tensor]:
    """Every live FSDP1 FlatParameter, found by the garbage collector: the FSDP wrapper of a
    finished model can be collected while its flat parameter and inner modules stay in the loop.
    Compared by exact type (FSDP1 makes them as ``FlatParameter`` or plain ``nn.Parameter``): an
    ``isinstance`` on each of the process's million objects costs a tenth of a second per call."""
    kinds = flat_param_types()
    return [o for o in gc.get_objects() if type(o) in kinds and is_flat_param(o)]


def _instances(cls: type) -> list[Any]:
    """Every live object of ``cls`` the garbage collector knows (a dead ``weakref.proxy`` among
    them answers ``isinstance`` with ReferenceError: skipped)."""
    found = []
    with warnings.catch_warnings():
        # isinstance on torch.distributed.reduce_op (deprecated) warns; it is only looked at here
        warnings.simplefilter("ignore", FutureWarning)
        for o in gc.get_objects():
            try:
                if isinstance(o, cls):
                    found.append(o)
            except ReferenceError:
                continue
    return found




def _tensors_of(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, nn.Module):
        return [*obj.parameters(), *obj.buffers(), *(p.grad for p in obj.parameters()
                                                      if p.grad is not None)]
    if isinstance(obj, torch.optim.Optimizer):
        return [t for state in obj.state.values() for t in state.values()
                if isinstance(t, torch.Tensor)]
    return []


def _settled_allocated(device: torch.device) -> int:
    """The bytes the caching allocator holds for tensors on ``device``, counting the same fixed
    things before and after every variant.

    cuBLAS keeps a workspace per (handle, stream): 32 MiB each on sm90, one for this thread and one
    for the autograd thread, made at their first matmul through the caching allocator (so
    ``memory_allocated`` counts them) and never freed by ``empty_cache``. Before each reading a
    small matmul forward and backward makes sure both exist, then torch's own call
    (``clear_cublas_workspaces``) frees what it can: on a torch without it, both readings include
    the workspaces; with it, neither does. Either way the first variant is not charged for them."""
    torch.cuda.synchronize(device)
    _make_cublas_workspaces(device)
    torch.cuda.synchronize(device)
    clear_cublas_workspaces()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(device)


def _make_cublas_workspaces(device: torch.device) -> None:
    """One matmul forward (this thread's cuBLAS handle) and backward (the autograd thread's)."""
    x = torch.ones(8, 8, device=device, requires_grad=True)
    (x @ x).sum().backward()


class VariantScope:
    """Weak references to one variant's models and optimizers, and the freeing at its end.

    On a GPU it also compares ``memory_allocated`` before and after the variant
    (``_settled_allocated``: cuBLAS's workspaces counted alike in both readings)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._objects: list[weakref.ref] = []
        self._tensors: list[weakref.ref] = []
        self.allocated_before: int | None = None
        self._flat_before: set[int] = set()

    def start(self) -> VariantScope:
        """Note the memory in use before the variant (on a GPU collected first, so it is the
        baseline; on CPU the previous variant's release has just collected)."""
        self._flat_before = {id(t) for t in _flat_params()}
        if self.device.type == "cuda":
            gc.collect()
            self.allocated_before = _settled_allocated(self.device)
        return self

    def track(self, *objs: Any) -> None:
        """Remember models / optimizers (and their tensors as they are now), weakly."""
        for obj in objs:
            if obj is None:
                continue
            self._objects.append(weakref.ref(obj))
            self._tensors.extend(weakref.ref(t) for t in _tensors_of(obj))

    def release(self) -> dict[str, Any]:
        """Free what is no longer referenced and report what survived (all zeros when clean)."""
        for ref in self._objects:
            obj = ref()
            if isinstance(obj, nn.Module):
                break_fsdp1_cycles(obj)
            elif isinstance(obj, torch.optim.Optimizer):
                obj.state.clear()
        obj = None
        # FSDP1 flat parameters made during the variant that the loop kept alive after their
        # model was dropped (also those of models the lesson made without the harness).
        for flat in _flat_params():
            if id(flat) not in self._flat_before:
                _cut_flat_param(flat)
        flat = None
        gc.collect()
        report: dict[str, Any] = {
            "leaked_objects": sum(r() is not None for r in self._objects),
            "leaked_tensors": sum(r() is not None for r in self._tensors),
        }
        if self.device.type == "cuda":
            after = _settled_allocated(self.device)
            report.update(allocated_before_bytes=self.allocated_before, allocated_after_bytes=after)
        return report


def live_parameters() -> int:
    """How many ``nn.Parameter`` objects this process still holds (a leak check at exit)."""
    gc.collect()
    return len(_instances(nn.Parameter))
