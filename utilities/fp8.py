"""FP8 training with torchao Float8 for FSDP2 models: what lesson 13 and benchmarks/layer.py share.

    ok, reason = fp8_available(device)           # torchao importable, GPU with capability >= 8.9
    fp8_linear_names(model)                      # the Linear layers the filter would convert
    convert_for_fp8(model, recipe="tensorwise")  # swap nn.Linear -> Float8Linear, before fully_shard

Convert *before* ``fully_shard``: it replaces parameters with DTensors, and torchao must see the
plain ``nn.Linear`` modules to swap them. With ``enable_fsdp_float8_all_gather=True`` it wraps the
weights so FSDP2 all-gathers them already cast to float8 (half the bytes of bf16 on the wire).
Lesson 13 (lessons/13_fp8_compile/fp8_compile.py) shows the whole order: convert, then
``fully_shard``, then ``torch.compile`` per block.

Nothing here imports torchao at module level: it is optional, and the filter is plain PyTorch so it
can be tested (and its choices printed) without torchao installed.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterable

import torch
from torch import nn

# Modules never converted to float8: the output projection (its logits need the precision, and its
# vocabulary dimension is often not a multiple of 16) and anything embedding-like.
DEFAULT_SKIP = ("lm_head", "embed", "output")
FP8_MIN_CAPABILITY = (8, 9)  # Ada (sm_89) and Hopper (sm_90) or newer have FP8 tensor cores


def fp8_available(device: torch.device | str | None = None) -> tuple[bool, str]:
    """Whether float8 training can run here, and if not, why (one line, no traceback)."""
    device = torch.device(device) if device is not None else None
    reasons = []
    if device is not None and device.type != "cuda":
        reasons.append(f"FP8 matmuls need a CUDA GPU with compute capability >= 8.9 (this run is "
                       f"on {device.type})")
    elif not torch.cuda.is_available():
        reasons.append("FP8 matmuls need a CUDA GPU with compute capability >= 8.9 (none visible)")
    else:
        cap = torch.cuda.get_device_capability(device)
        if cap < FP8_MIN_CAPABILITY:
            reasons.append(f"{torch.cuda.get_device_name(device)} has compute capability "
                           f"{cap[0]}.{cap[1]}; FP8 needs >= 8.9 (Ada L4/L40S, Hopper H100/H200+)")
    if importlib.util.find_spec("torchao") is None:
        reasons.append("torchao is not installed (pip install torchao)")
    if reasons:
        return False, "; ".join(reasons)
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: F401
    except Exception as e:  # an installed torchao that does not match this torch
        return False, f"torchao.float8 cannot be imported: {type(e).__name__}: {str(e).splitlines()[0]}"
    return True, "torchao float8 on a GPU with compute capability >= 8.9"


def float8_module_filter(min_multiple: int = 16,
                         skip: Iterable[str] = DEFAULT_SKIP) -> Callable[[nn.Module, str], bool]:
    """A torchao ``module_filter_fn(module, fqn) -> bool``: True for the Linear layers to convert.

    FP8 GEMMs (``torch._scaled_mm``) need both matrix dimensions to be multiples of 16; small layers
    would gain nothing anyway. Layers whose fully qualified name contains any of ``skip`` are kept.
    """
    skip = tuple(skip)

    def keep(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear):
            return False
        if any(s in fqn for s in skip):
            return False
        return module.in_features % min_multiple == 0 and module.out_features % min_multiple == 0

    return keep


def fp8_linear_names(model: nn.Module, module_filter: Callable[[nn.Module, str], bool] | None = None
                     ) -> list[str]:
    """The fully qualified names of the Linear layers the filter would convert (no torchao needed)."""
    module_filter = module_filter or float8_module_filter()
    return [name for name, m in model.named_modules() if module_filter(m, name)]


FP8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


def float8_config(recipe: str = "tensorwise", fsdp_float8_all_gather: bool | None = None):
    """torchao's ``Float8LinearConfig`` for a recipe: ``tensorwise`` (one scale per tensor: the
    fastest, and the only one whose weights FSDP2 can all-gather in float8), ``rowwise`` (one
    scale per row: more accurate, a little slower) or ``rowwise_with_gw_hp`` (rowwise, with the
    weight gradient's matmul kept in high precision). ``fsdp_float8_all_gather`` defaults to True
    for tensorwise and must stay off for the others."""
    from torchao.float8 import Float8LinearConfig

    if recipe not in FP8_RECIPES:
        raise ValueError(f"float8 recipe {recipe!r} is not allowed; allowed: {', '.join(FP8_RECIPES)}")
    if recipe == "tensorwise":
        return Float8LinearConfig(enable_fsdp_float8_all_gather=fsdp_float8_all_gather is not False)
    if fsdp_float8_all_gather:
        raise ValueError(f"float8 all-gather needs the tensorwise recipe, not {recipe!r}")
    return Float8LinearConfig.from_recipe_name(recipe)


def convert_for_fp8(model: nn.Module, fsdp_float8_all_gather: bool | None = None,
                    module_filter: Callable[[nn.Module, str], bool] | None = None,
                    recipe: str = "tensorwise") -> list[str]:
    """Swap the filtered ``nn.Linear`` layers for torchao ``Float8Linear`` (``recipe``'s scaling,
    see :func:`float8_config`) in place, *before* ``fully_shard``; return the converted names.
    Needs torchao (see fp8_available)."""
    from torchao.float8 import convert_to_float8_training

    module_filter = module_filter or float8_module_filter()
    names = fp8_linear_names(model, module_filter)
    config = float8_config(recipe, fsdp_float8_all_gather)
    convert_to_float8_training(model, config=config, module_filter_fn=module_filter)
    return names
