"""Wrapping a model in FSDP: FSDP2 (``fully_shard``) and FSDP1 (``FullyShardedDataParallel``).

One call, ``shard_model``, takes the model and the options and returns the sharded model, so a
lesson script shows only the choice it teaches. The policy decides the *units*: the groups of
parameters FSDP all-gathers together. One unit per transformer block means only one block's full
weights exist at a time; one unit for the whole model means every weight is gathered at once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from utilities.errors import bad_value
from utilities.torch_internals import fsdp1_unit_numel

APIS = ("fsdp2", "fsdp1")
POLICIES = ("block", "whole", "size")


def fsdp1_block_policy(block_classes: set[type[nn.Module]] | type[nn.Module]):
    """FSDP1 auto-wrap policy: every instance of the transformer block class becomes a unit."""
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    if isinstance(block_classes, type):
        block_classes = {block_classes}
    return functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=set(block_classes))


def fsdp1_size_policy(min_num_params: int):
    """FSDP1's naive alternative: wrap any subtree holding at least ``min_num_params`` parameters."""
    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy

    return functools.partial(size_based_auto_wrap_policy, min_num_params=min_num_params)


def shard_model(
    model: nn.Module,
    api: str = "fsdp2",
    block_class: type[nn.Module] | None = None,
    policy: str = "block",
    device: torch.device | str = "cpu",
    mesh: Any = None,
    min_num_params: int = 100_000,
    **options: Any,
) -> nn.Module:
    """Shard ``model`` with FSDP2 or FSDP1 and return it.

    FSDP2: ``fully_shard`` on each block (``policy="block"``), then on the root; ``options`` go to
    ``fully_shard`` (``reshard_after_forward``, ``mp_policy``, ``offload_policy``...). FSDP1: wrap
    with an auto-wrap policy; ``options`` go to ``FullyShardedDataParallel`` (``sharding_strategy``,
    ``mixed_precision``, ``backward_prefetch``, ``limit_all_gathers``...). ``policy="size"`` is
    FSDP1's size-based policy (FSDP2 has no such thing: you choose modules yourself).
    """
    if api not in APIS:
        raise bad_value("--api", api, APIS)
    if policy not in POLICIES:
        raise bad_value("--policy", policy, POLICIES)
    if policy == "block" and block_class is None:
        raise ValueError("policy 'block' needs the model's block_class")
    device = torch.device(device)
    if api == "fsdp2":
        if policy == "size":
            raise bad_value("--policy", policy, "block, whole (FSDP2 has no size-based policy)")
        return _shard_fsdp2(model, block_class if policy == "block" else None, mesh, options)
    return _shard_fsdp1(model, block_class, policy, device, mesh, min_num_params, options)


def _shard_fsdp2(model, block_class, mesh, options):
    from utilities.distributed import world_mesh
    from utilities.parallelize import apply_fsdp

    mesh = mesh if mesh is not None else world_mesh()  # this run's device, not the accelerator
    blocks = [] if block_class is None else [m for m in model.modules() if isinstance(m, block_class)]
    return apply_fsdp(model, mesh=mesh, units=blocks, **options)


def _shard_fsdp1(model, block_class, policy, device, mesh, min_num_params, options):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if policy == "block":
        options.setdefault("auto_wrap_policy", fsdp1_block_policy(block_class))
    elif policy == "size":
        options.setdefault("auto_wrap_policy", fsdp1_size_policy(min_num_params))
    if mesh is not None:
        options.setdefault("device_mesh", mesh)
    options.setdefault("device_id", device)
    if any(p.is_meta for p in model.parameters()):
        options.setdefault("param_init_fn", fsdp1_meta_init(model, device))
    return FSDP(model, **options)


def fsdp1_meta_init(root: nn.Module, device: torch.device | str) -> Callable[[nn.Module], None]:
    """FSDP1's ``param_init_fn`` for a model built on the meta device (too big for one host).

    FSDP1 calls it on each unit's modules just before sharding that unit: the module gets memory on
    ``device`` (``to_empty``, its own parameters only) and the weights of the root model's own
    initialization (a Hugging Face model's ``_init_weights``), so one unit at a time is full-size.
    """
    device = torch.device(device)

    def init_unit(module: nn.Module) -> None:
        module.to_empty(device=device, recurse=False)
        if hasattr(root, "_init_weights"):
            root._init_weights(module)

    return init_unit


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The modules that are FSDP units (FSDP1 wrappers or FSDP2 ``fully_shard`` targets)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return [m for m in model.modules() if isinstance(m, (FSDP, FSDPModule))]


def unit_parameter_counts(model: nn.Module) -> list[int]:
    """Unsharded parameter count of each FSDP unit: what it must all-gather at once.

    FSDP1 units own one flat parameter holding what no nested unit owns; an FSDP2 ``fully_shard``
    module manages the parameters not managed by a ``fully_shard`` child.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    units = fsdp_units(model)
    unit_ids = {id(u) for u in units}
    counts = []
    for unit in units:
        if isinstance(unit, FSDP):
            counts.append(fsdp1_unit_numel(unit))
            continue
        seen: set[int] = set()
        n = 0
        stack = [unit]
        while stack:
            m = stack.pop()
            for p in m.parameters(recurse=False):
                if id(p) not in seen:
                    seen.add(id(p))
                    n += _global_numel(p)
            stack.extend(c for c in m.children() if id(c) not in unit_ids)
        counts.append(n)
    return counts


def _global_numel(p: torch.Tensor) -> int:
    return int(torch.Size(p.shape).numel())  # a DTensor's shape is the global, unsharded one
