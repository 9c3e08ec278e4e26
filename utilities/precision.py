"""Mixed-precision policies for FSDP, by name, for both APIs; and probes that *observe* the dtypes.

A policy names three dtypes:

* ``param``:  the dtype FSDP all-gathers the parameters in, so the one forward and backward compute in;
* ``reduce``: the dtype the gradients are reduce-scattered (averaged across ranks) in;
* ``buffer``: the dtype of buffers (FSDP1 only; FSDP2 leaves buffers alone).

The sharded parameters the optimizer updates stay fp32 in every policy: that is what makes it
*mixed* precision, and why the optimizer state never shrinks.

    from utilities.precision import fsdp2_policy, fsdp1_policy, default_policy
    fully_shard(block, mp_policy=fsdp2_policy("bf16"))
    FSDP(model, mixed_precision=fsdp1_policy("bf16"))
    name, reason = default_policy()      # "bf16" where bf16_ready(), else "fp32", and why

fp16 needs a loss scaler (``make_scaler``): its smallest normal number is 6e-5 and gradients are
often smaller, so without scaling they flush to zero.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from utilities.bf16 import bf16_ready
from utilities.distributed import watch_reduce_scatters
from utilities.errors import bad_value


@dataclass(frozen=True)
class Precision:
    """One named policy: the dtypes FSDP should use, and whether it needs a loss scaler."""

    name: str
    param: torch.dtype
    reduce: torch.dtype
    buffer: torch.dtype
    scaler: bool = False
    summary: str = ""


POLICIES: dict[str, Precision] = {
    p.name: p
    for p in (
        Precision("fp32", torch.float32, torch.float32, torch.float32,
                  summary="no mixed precision: the baseline"),
        Precision("bf16", torch.bfloat16, torch.bfloat16, torch.bfloat16,
                  summary="compute and gradient reduction in bf16"),
        Precision("bf16-fp32-reduce", torch.bfloat16, torch.float32, torch.bfloat16,
                  summary="compute in bf16, gradients averaged in fp32 (safer for many ranks)"),
        Precision("fp16", torch.float16, torch.float16, torch.float16, scaler=True,
                  summary="compute and reduction in fp16, with ShardedGradScaler"),
        Precision("fp16-no-scaler", torch.float16, torch.float16, torch.float16,
                  summary="fp16 without a loss scaler: small gradients underflow to zero"),
    )
}


def get_precision(name: str) -> Precision:
    if name not in POLICIES:
        raise bad_value("precision policy", name, POLICIES)
    return POLICIES[name]


def fsdp2_policy(name: str):
    """FSDP2's ``MixedPrecisionPolicy`` for ``fully_shard(..., mp_policy=...)``.

    ``cast_forward_inputs`` (default True) casts the floating-point inputs of each unit's forward
    to ``param_dtype``; the output of the root stays in that dtype unless ``output_dtype`` is set.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    p = get_precision(name)
    if p.param == torch.float32 and p.reduce == torch.float32:
        return MixedPrecisionPolicy()  # all None: no casting at all
    return MixedPrecisionPolicy(param_dtype=p.param, reduce_dtype=p.reduce)


def fsdp1_policy(name: str):
    """FSDP1's ``MixedPrecision`` for ``FullyShardedDataParallel(..., mixed_precision=...)``;
    ``None`` for fp32 (FSDP1's way of saying "no mixed precision")."""
    from torch.distributed.fsdp import MixedPrecision

    p = get_precision(name)
    if p.param == torch.float32 and p.reduce == torch.float32:
        return None
    return MixedPrecision(param_dtype=p.param, reduce_dtype=p.reduce, buffer_dtype=p.buffer)


# -- the classic tutorials' policy names ------------------------------------------------------------
# Code descended from the classic PyTorch FSDP tutorial imports these module-level FSDP1
# ``MixedPrecision`` objects and writes ``mixed_precision=bfSixteen if verify_bfloat_support else
# fp32_policy``. They are kept with the tutorial's dtypes (fp32_policy is an all-fp32
# ``MixedPrecision``, not ``None``) so such code runs unchanged; for FSDP2's ``fully_shard`` use
# ``fsdp2_policy(name)`` instead: it takes a ``MixedPrecisionPolicy``, not these.
def _classic(param: torch.dtype, reduce: torch.dtype, buffer: torch.dtype):
    from torch.distributed.fsdp import MixedPrecision

    return MixedPrecision(param_dtype=param, reduce_dtype=reduce, buffer_dtype=buffer)


fpSixteen = _classic(torch.float16, torch.float16, torch.float16)  # noqa: N816 - classic name
"""fp16 compute, reduction and buffers (needs a loss scaler: ``make_scaler("fp16")``)."""
bfSixteen = _classic(torch.bfloat16, torch.bfloat16, torch.bfloat16)  # noqa: N816 - classic name
"""bf16 compute, reduction and buffers: ``POLICIES["bf16"]``."""
bfSixteen_working = _classic(torch.float32, torch.bfloat16, torch.bfloat16)  # noqa: N816
"""fp32 compute, gradients reduced in bf16 (the classic 'working' variant)."""
fp32_policy = _classic(torch.float32, torch.float32, torch.float32)
"""Everything in fp32: the classic fallback when bf16 is not ready."""


def default_policy() -> tuple[str, str]:
    """bf16 where native bf16 is ready (see ``bf16_ready``), else fp32; and the reason, in words."""
    report = bf16_ready()
    if report:
        return "bf16", str(report)
    return "fp32", str(report)


def make_scaler(name: str, device: torch.device | str | None = None, init_scale: float = 2.0**16):
    """A ``ShardedGradScaler`` for policies that need one (fp16), else ``None``.

    The scaler multiplies the loss before backward so small gradients stay representable in fp16,
    divides them back before the optimizer step, skips any step whose gradients hold inf/NaN (on
    any rank: it all-reduces the check) and adapts the scale.
    """
    if not get_precision(name).scaler:
        return None
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return ShardedGradScaler(device=torch.device(device).type, init_scale=init_scale)


def attach_scaler(optimizer: torch.optim.Optimizer, scaler) -> list[float]:
    """Make ``optimizer.step()`` do ``scaler.step(optimizer); scaler.update()`` (the usual pair).

    For a training loop that calls ``optimizer.step()`` itself (``utilities.training.train``).
    Returns a list that receives the scale after every step, so a lesson can show skipped steps.
    """
    plain_step = optimizer.step
    scales: list[float] = []

    def step(*args, **kwargs):
        optimizer.step = plain_step  # scaler.step calls optimizer.step: it must be the plain one
        try:
            scaler.step(optimizer, *args, **kwargs)
            scaler.update()
        finally:
            optimizer.step = step
        scales.append(float(scaler.get_scale()))

    optimizer.step = step
    return scales


# -- observing what FSDP actually does ------------------------------------------------------------

FP16_ROUNDS_TO_ZERO = 2.0**-25  # below this, a value rounds to 0 in fp16 (smallest subnormal 2**-24)


@dataclass
class DtypeProbe:
    """What was seen: parameter dtypes inside forward, gradient dtypes at the reduce-scatter, and
    among reductions whose gradients were all finite, how many entries were exactly zero and how many
    were non-zero but so small that fp16 would round them to zero."""

    forward_param_dtypes: set[str] = field(default_factory=set)
    reduce_dtypes: set[str] = field(default_factory=set)
    reductions: int = 0
    nonfinite_reductions: int = 0  # reductions holding inf/NaN (an fp16 overflow: the scaler skips)
    elements: int = 0
    zeros: int = 0
    fp16_underflows: int = 0

    def as_dict(self) -> dict:
        n = max(self.elements, 1)
        return {
            "forward_param_dtypes": sorted(self.forward_param_dtypes),
            "reduce_dtypes": sorted(self.reduce_dtypes),
            "grad_zero_fraction": self.zeros / n,
            "grad_fp16_underflow_fraction": self.fp16_underflows / n,
            "reductions": self.reductions,
            "nonfinite_reductions": self.nonfinite_reductions,
        }

    def record(self, grad: torch.Tensor) -> None:
        self.reduce_dtypes.add(_dtype_name(grad.dtype))
        self.reductions += 1
        if not bool(torch.isfinite(grad).all()):
            self.nonfinite_reductions += 1
            return
        self.elements += grad.numel()
        self.zeros += int((grad == 0).sum())
        magnitude = grad.abs()
        self.fp16_underflows += int(((magnitude > 0) & (magnitude <= FP16_ROUNDS_TO_ZERO)).sum())


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@contextlib.contextmanager
def observe_dtypes(model: nn.Module, probe: DtypeProbe | None = None) -> Iterator[DtypeProbe]:
    """Record, while active, the dtype of every ``nn.Linear`` weight as its forward starts and the
    dtype (and zero / underflow / inf counts) of every gradient tensor FSDP hands to reduce-scatter
    (into ``probe`` when given, so several observed steps add up; else a new one).

    The counts cost three host syncs per reduce-scatter: never time a step while this is active
    (``utilities.training.StepOptions.untimed`` runs it around the steps it does not time).

    What is recorded is what FSDP handed to the collective
    (``utilities.distributed.watch_reduce_scatters``), not what the config says. Padding FSDP adds
    to make shards even is counted too (a few zeros; the same in every policy).
    """
    probe = DtypeProbe() if probe is None else probe

    def pre_hook(module, _inputs):
        probe.forward_param_dtypes.add(_dtype_name(module.weight.dtype))

    handles = [m.register_forward_pre_hook(pre_hook) for m in model.modules()
               if isinstance(m, nn.Linear)]
    try:
        with watch_reduce_scatters(probe.record):
            yield probe
    finally:
        for h in handles:
            h.remove()
