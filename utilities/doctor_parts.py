"""What every doctor check is made of: the ``Finding`` it returns, and how it reads a sharded
model (a DTensor's local shard, each tensor once, names as the user wrote the model, the units
and the modules each one manages). ``utilities.doctor`` runs the checks."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from utilities.text import wrap_lines

COLUMNS = 80  # a printed finding is folded to this width
WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


@dataclass(frozen=True)
class Finding:
    """One problem: ``check`` names it, ``problem`` says what is wrong (with the numbers),
    ``why`` why it matters, ``fix`` what to do. ``str()`` is the finding as one line folded at
    ``COLUMNS``; ``line`` the same unfolded."""

    check: str
    problem: str
    why: str
    fix: str

    @property
    def line(self) -> str:
        return f"{self.check}: {self.problem}; {self.why}. Fix: {self.fix}"

    def __str__(self) -> str:
        return wrap_lines(self.line, COLUMNS, indent="    ")


# -- reading a sharded model ------------------------------------------------------------------------

def is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard, or the tensor itself."""
    return t.to_local() if is_dtensor(t) else t


def unique_tensors(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    seen, out = set(), []
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def named_unique(named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    seen, out = set(), []
    for name, t in named:
        if id(t) not in seen:
            seen.add(id(t))
            out.append((clean_name(name), t))
    return out


def elements(tensors: Iterable[torch.Tensor]) -> int:
    """Parameters (elements) in ``tensors``, at their global (unsharded) shape."""
    return sum(int(torch.Size(t.shape).numel()) for t in tensors)


def clean_name(name: str) -> str:
    """A module or parameter name as the user wrote the model (no FSDP1 / checkpoint wrappers)."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def some_names(names: list[str], shown: int = 2) -> str:
    more = f", +{len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def unwrapped(module: nn.Module) -> nn.Module:
    """The module inside FSDP1's and activation checkpointing's wrappers."""
    while True:
        inner = (getattr(module, "_fsdp_wrapped_module", None)
                 or getattr(module, "_checkpoint_wrapped_module", None))
        if inner is None:
            return module
        module = inner


def top_units(units: list[nn.Module]) -> list[nn.Module]:
    """The units no other unit contains (the root, normally the model itself)."""
    inside = {id(m) for u in units for m in u.modules() if m is not u}
    return [u for u in units if id(u) not in inside]


def unit_names(model: nn.Module, units: list[nn.Module]) -> dict[int, str]:
    unit_ids = {id(u) for u in units}
    return {id(m): (clean_name(n) or "(root)") for n, m in model.named_modules() if id(m) in unit_ids}


def modules_with_units(model: nn.Module,
                        units: list[nn.Module]) -> Iterator[tuple[str, nn.Module, nn.Module]]:
    """Every module (a shared one once per place it is used), its name, and the unit whose
    parameters it uses: the nearest unit at or above it."""
    unit_ids = {id(u) for u in units}
    stack = [("", model, model)]
    while stack:
        name, module, unit = stack.pop()
        if id(module) in unit_ids:
            unit = module
        yield name, module, unit
        for child_name, child in module.named_children():
            stack.append((f"{name}.{child_name}" if name else child_name, child, unit))
