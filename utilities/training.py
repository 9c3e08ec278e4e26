"""The training step, timed the way benchmarks should be: synchronized, warm-up excluded, median.

``train`` runs a fixed number of steps and returns what a lesson compares: the losses (averaged over
ranks), the median step time (the slowest rank's, since the step ends when the last rank ends), the
tokens per second, the MFU on GPUs we know the peak of, and peak memory by category measured on one
step after warm-up (the optimizer state exists by then).
"""

from __future__ import annotations

import contextlib
import statistics
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from utilities.distributed import is_main, reduce_scalar
from utilities.measure import MemoryProbe
from utilities.measure.memory import is_oom

# Dense bf16 tensor-core peak, FLOP/s, by the exact name torch.cuda.get_device_name reports (vendor
# datasheets). Exact names, not substrings: an H100 PCIe (756e12) or NVL (835e12) is not an SXM.
PEAK_FLOPS = {
    "NVIDIA H100 80GB HBM3": 989e12, "NVIDIA H100 PCIe": 756e12, "NVIDIA H100 NVL": 835e12,
    "NVIDIA H200": 989e12, "NVIDIA H200 NVL": 835e12,
    "NVIDIA A100-SXM4-80GB": 312e12, "NVIDIA A100-SXM4-40GB": 312e12,
    "NVIDIA A100 80GB PCIe": 312e12, "NVIDIA A100-PCIE-40GB": 312e12,
    "NVIDIA L40S": 362e12, "NVIDIA L4": 121e12, "NVIDIA A10": 125e12,
}


def peak_flops(device: torch.device) -> float | None:
    """The dense bf16 peak of this GPU, or None where we do not know it (CPU included): then no
    MFU is reported rather than one computed against another part's peak."""
    if device.type != "cuda":
        return None
    return PEAK_FLOPS.get(torch.cuda.get_device_name(device).strip())


@dataclass
class TrainStats:
    """What one variant's run measured."""

    losses: list[float] = field(default_factory=list)
    step_times_s: list[float] = field(default_factory=list)
    tokens_per_step: int = 0
    peak_memory_bytes: dict[str, Any] = field(default_factory=dict)
    mfu: float | None = None

    @property
    def step_time_s(self) -> float | None:
        return statistics.median(self.step_times_s) if self.step_times_s else None

    @property
    def tokens_per_s(self) -> float | None:
        t = self.step_time_s
        return self.tokens_per_step / t if t else None


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def default_step(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Forward and backward for a Hugging Face model whose batch carries ``labels``."""
    loss = model(**batch).loss
    loss.backward()
    return loss


@dataclass(frozen=True)
class StepOptions:
    """How ``train`` runs each step beyond its step function, and what it watches on the side.

    ``warmup``: the first steps, not timed. ``grad_clip``: clip the global gradient norm to this
    (FSDP1's own ``clip_grad_norm_`` where the model has one). ``memory_tracker``: the measured
    step's ``MemoryProbe(use_tracker=...)``. ``untimed``: a context entered around each untimed step
    only (warm-up and memory): an observer whose cost must not reach the step times (lesson 07's
    dtype probe)."""

    warmup: int = 1
    grad_clip: float | None = None
    memory_tracker: bool | None = None
    untimed: Callable[[], contextlib.AbstractContextManager] | None = None


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data: Iterator[dict[str, torch.Tensor]],
    steps: int,
    device: torch.device,
    measure_memory: bool = True,
    flops_per_token: float | None = None,
    step_fn: Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor] = default_step,
    progress: str | None = None,
    options: StepOptions = StepOptions(),
) -> TrainStats:
    """Train ``steps`` steps; the first ``options.warmup`` are not timed, and one extra step is
    measured for memory (trackers slow a step down, so it is never timed either)."""
    warmup, grad_clip, memory_tracker, untimed = (options.warmup, options.grad_clip,
                                                  options.memory_tracker, options.untimed)
    stats = TrainStats()
    world = dist.get_world_size() if dist.is_initialized() else 1
    bar = _progress(steps, progress)
    mem_step = warmup if measure_memory else -1
    for step in range(steps):
        batch = next(data)
        tokens = _tokens(batch) * world
        sync(device)
        t0 = time.perf_counter()
        oom: BaseException | None = None
        timed = step >= warmup and step != mem_step
        observer = untimed() if untimed is not None and not timed else contextlib.nullcontext()
        try:
            with observer:
                loss, probe_peak = _step_maybe_measured(
                    model, optimizer, batch, step_fn, grad_clip, device, memory_tracker,
                    step == mem_step)
            if probe_peak is not None:
                stats.peak_memory_bytes = probe_peak
            loss_value = loss.detach().item()
        except Exception as exc:
            if world == 1 or not is_oom(exc):
                raise
            oom, loss_value = exc, 0.0  # the step's collectives below are made all the same
            traceback.clear_frames(exc.__traceback__)
        loss = None
        sync(device)
        elapsed = time.perf_counter() - t0
        if timed:
            stats.step_times_s.append(_max_over_ranks(elapsed, device))
            stats.tokens_per_step = tokens
        mean_loss, failed = _mean_loss_and_failures(loss_value, oom is not None, device)
        if failed:
            if oom is not None:
                raise oom
            raise torch.OutOfMemoryError(f"out of memory on another rank (step {step})")
        stats.losses.append(mean_loss)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{stats.losses[-1]:.3f}")
    if bar is not None:
        bar.close()
    peak = peak_flops(device)
    if peak and flops_per_token and stats.tokens_per_s:
        stats.mfu = stats.tokens_per_s * flops_per_token / (peak * world)
    return stats


def _step_maybe_measured(model, optimizer, batch, step_fn, grad_clip, device, memory_tracker,
                         measured: bool) -> tuple[torch.Tensor, dict[str, Any] | None]:
    """One step, and its peak memory by category when ``measured`` (else None)."""
    if not measured:
        return _one_step(model, optimizer, batch, step_fn, grad_clip), None
    with MemoryProbe(model, optimizer, device, use_tracker=memory_tracker) as probe:
        loss = _one_step(model, optimizer, batch, step_fn, grad_clip)
    return loss, probe.peak


def _one_step(model, optimizer, batch, step_fn, grad_clip):
    optimizer.zero_grad(set_to_none=True)
    loss = step_fn(model, batch)
    if grad_clip:
        clip = getattr(model, "clip_grad_norm_", None)  # FSDP1 needs its own sharded-aware clip
        if clip is not None:
            clip(grad_clip)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    return loss


def _tokens(batch: dict[str, torch.Tensor]) -> int:
    n = int(batch["input_ids"].numel())
    labels = batch.get("labels")
    if labels is not None and labels.shape != batch["input_ids"].shape:
        n += int(labels.numel())
    return n


def _mean_loss_and_failures(loss: float, failed: bool, device: torch.device) -> tuple[float, int]:
    """The loss averaged over ranks and how many ranks ran out of memory in this step, in the one
    collective every rank makes at the end of every step, failed or not (so an out-of-memory error
    on one rank after the step's last FSDP collective never leaves the others waiting in one it
    skipped; ``find_max_batch`` then records the trial as an OOM on every rank alike)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return loss, int(failed)
    t = torch.tensor([loss, float(failed)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    total, failures = t.tolist()
    return total / dist.get_world_size(), int(failures)


def _max_over_ranks(value: float, device: torch.device) -> float:
    return reduce_scalar(value, "max", device)


def _progress(total: int, desc: str | None):
    if desc is None or not is_main():
        return None
    from tqdm.auto import tqdm

    # disable=None: a bar on a terminal, nothing in logs, CI or a notebook's captured output
    return tqdm(total=total, desc=desc, leave=False, dynamic_ncols=True, disable=None)
