"""FP8 training (torchao Float8) and per-block ``torch.compile`` for FSDP2 models.

The order matters and is always the same::

    ok, reason = fp8_available(device)           # torchao importable, GPU with capability >= 8.9
    convert_for_fp8(model)                       # 1. swap nn.Linear -> Float8Linear (filtered)
    shard_model(model, block_class=..., ...)     # 2. fully_shard each block, then the root
    compile_blocks(model, block_class)           # 3. torch.compile each block in place

1. *Convert first*: ``fully_shard`` replaces parameters with DTensors; torchao must see the plain
   ``nn.Linear`` modules to swap them, and with ``enable_fsdp_float8_all_gather=True`` it wraps the
   weights so FSDP2 all-gathers them already cast to float8 (half the bytes of bf16 on the wire).
2. *Shard second*: FSDP2 then shards the (float8-aware) weights of each block.
3. *Compile last*: without compile, Float8Linear's scaling (amax, scale, cast) runs as many small
   eager kernels and is *slower* than bf16; inductor fuses them into the matmul's neighbours.

Nothing here imports torchao at module level: it is optional, and the filter is plain PyTorch so it
can be tested (and its choices printed) without torchao installed.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable, Iterable
from typing import Any

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


def fp8_precompute_scales(model: nn.Module) -> None:
    """With float8 all-gather, compute every weight's scale in one fused op after optimizer.step()
    (torchao's ``precompute_float8_dynamic_scale_for_fsdp``; a no-op when unavailable)."""
    try:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
    except ImportError:
        return
    precompute_float8_dynamic_scale_for_fsdp(model)


def compile_blocks(model: nn.Module, block_class: type[nn.Module], **compile_kwargs) -> int:
    """``torch.compile`` each transformer block in place (``Module.compile``) and return how many.

    Per block, as torchtitan does, rather than the whole model: every block has the same shapes, so
    inductor compiles one graph and reuses it for all of them (compile time does not grow with
    depth); FSDP2's all-gather / reduce-scatter hooks stay outside the graphs, at the block
    boundaries where FSDP wants them; and parameter names do not change (no ``_orig_mod.``), so
    checkpoints load into eager and compiled models alike.
    """
    compile_kwargs.setdefault("dynamic", False)
    n = 0
    for module in model.modules():
        if isinstance(module, block_class):
            module.compile(**compile_kwargs)
            n += 1
    return n


class Stopwatch:
    """``with Stopwatch() as t: ...; t.seconds`` (synchronizes CUDA so GPU work is counted)."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.seconds = 0.0

    def __enter__(self) -> Stopwatch:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.seconds = time.perf_counter() - self._t0


def crossover_hidden(variants: list[dict[str, Any]], candidate: str, baseline: str) -> dict[str, Any]:
    """Where ``candidate`` starts to pay over ``baseline`` (e.g. fp8-compiled over compiled).

    ``variants`` are results.json variants with ``variant``, ``hidden`` and ``tokens_per_s``. For
    every width measured with both, the ratio candidate / baseline tokens/s; the crossover is the
    smallest width from which the candidate is faster at that width *and every wider one measured*
    (a single lucky width below a slower one is not a crossover). Returns ``{"hidden": int | None,
    "ratios": {width: ratio}, "why": str}``; ``hidden`` is None when the candidate never pays at
    the widest width, or when no width has both."""
    tps = {(v["variant"], v.get("hidden")): v.get("tokens_per_s") for v in variants}
    ratios = {h: tps[(candidate, h)] / tps[(baseline, h)]
              for (name, h) in tps if name == candidate and h is not None
              and tps.get((candidate, h)) and tps.get((baseline, h))}
    widths = sorted(ratios)
    hidden = None
    for h in reversed(widths):
        if ratios[h] <= 1.0:
            break
        hidden = h
    if not widths:
        why = f"no width was measured with both {candidate} and {baseline}"
    elif hidden is None:
        why = (f"{candidate} was not faster than {baseline} at the widest width measured "
               f"({widths[-1]}): the crossover, if any, is above it")
    elif hidden == widths[0]:
        why = (f"{candidate} was faster at every width measured: the crossover is at or below "
               f"{hidden}")
    else:
        below = max(h for h in widths if h < hidden)
        why = f"{candidate} is slower at {below} and faster from {hidden} on"
    return {"hidden": hidden, "ratios": {h: round(r, 4) for h, r in sorted(ratios.items())}, "why": why}
