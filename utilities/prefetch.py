"""Communication scheduling helpers: FSDP2 explicit prefetching and a profiler trace per variant.

FSDP2 prefetches implicitly: in forward the next unit's all-gather is issued when the current one
starts (one unit ahead, found from the order of the previous forward); in backward the unit that ran
before in forward is gathered when the current one starts its backward. ``set_explicit_prefetch``
replaces that with a fixed list of ``depth`` units ahead, the torchtitan recipe.

``profile_steps`` records a few training steps with ``torch.profiler`` and writes a Chrome trace
(open it in chrome://tracing or https://ui.perfetto.dev). ``exposed_communication`` reads the GPU
kernels of that trace: the time a collective (NCCL) kernel runs while no compute kernel runs is
*exposed* communication, the time prefetching exists to hide. On CPU there are no kernels and gloo
runs collectives synchronously, so it returns ``None``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from utilities.errors import bad_value
from utilities.torch_internals import fsdp2_prefetch_states, fsdp2_state
from utilities.training import default_step, sync


def set_explicit_prefetch(blocks: Sequence[nn.Module], depth: int) -> None:
    """Prefetch ``depth`` blocks ahead, in forward and in backward, on FSDP2 ``fully_shard`` blocks.

    ``blocks`` must be in forward execution order. Block i prefetches blocks i+1..i+depth in forward,
    and blocks i-1..i-depth (the next ones to run backward) in backward. Depth 1 is what implicit
    prefetching already does; a larger depth issues all-gathers earlier and keeps more unsharded
    parameters alive (more memory) in exchange for more slack to hide communication.
    """
    from torch.distributed.fsdp import FSDPModule

    if depth < 1:
        raise bad_value("prefetch depth", depth, "integers >= 1")
    blocks = list(blocks)
    for b in blocks:
        if not isinstance(b, FSDPModule):
            raise TypeError(f"{type(b).__name__} is not a fully_shard module")
    for i, block in enumerate(blocks):
        ahead = blocks[i + 1:i + 1 + depth]
        behind = blocks[max(0, i - depth):i][::-1]  # nearest first: backward runs in reverse
        if ahead:
            block.set_modules_to_forward_prefetch(ahead)
        if behind:
            block.set_modules_to_backward_prefetch(behind)


def prefetch_plan(blocks: Sequence[nn.Module]) -> list[dict[str, list[int]]]:
    """What each FSDP2 block will prefetch, as indices into ``blocks`` (empty: implicit default).

    Read from the module's FSDP state, so it shows what FSDP registered, not what we asked for.
    """
    index = {id(fsdp2_state(b)): i for i, b in enumerate(blocks)}
    plan = []
    for b in blocks:
        forward, backward = fsdp2_prefetch_states(b)
        plan.append({"forward": [index.get(id(s), -1) for s in forward],
                     "backward": [index.get(id(s), -1) for s in backward]})
    return plan


def profile_steps(model: nn.Module, optimizer: torch.optim.Optimizer,
                  data: Iterator[dict[str, torch.Tensor]], device: torch.device, path: Path,
                  steps: int = 3,
                  step_fn: Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor] = default_step,
                  ) -> dict[str, Any]:
    """Run ``steps`` training steps under ``torch.profiler``; write a Chrome trace to ``path``.

    Returns the trace's path and, on GPU, the exposed communication time per step (seconds).
    """
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sync(device)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            optimizer.zero_grad(set_to_none=True)
            step_fn(model, next(data))
            optimizer.step()
        sync(device)
    prof.export_chrome_trace(str(path))
    exposed = exposed_communication(prof) if device.type == "cuda" else None
    return {"trace": str(path), "profiled_steps": steps,
            "exposed_comm_s_per_step": None if exposed is None else exposed["exposed_s"] / steps,
            "comm_s_per_step": None if exposed is None else exposed["comm_s"] / steps}


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in intervals)


def uncovered(comm: list[tuple[float, float]], compute: list[tuple[float, float]]) -> float:
    """Length of the union of ``comm`` not covered by the union of ``compute`` (same units)."""
    comm, compute = _union(comm), _union(compute)
    covered, j = 0.0, 0
    for s, e in comm:
        while j < len(compute) and compute[j][1] <= s:
            j += 1
        k = j
        while k < len(compute) and compute[k][0] < e:
            covered += min(e, compute[k][1]) - max(s, compute[k][0])
            k += 1
    return _length(comm) - covered


def exposed_communication(prof) -> dict[str, float] | None:
    """Communication kernel time and the part of it no compute kernel overlaps, in seconds; None
    when the trace holds no NCCL kernel (no GPU, or collectives over gloo: unknown, not zero)."""
    comm, compute = [], []
    for ev in prof.events():
        if getattr(ev, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue
        span = (ev.time_range.start, ev.time_range.end)  # microseconds
        (comm if "nccl" in ev.name.lower() else compute).append(span)
    if not comm:  # no NCCL kernel: the communication (gloo's, say) is unknown here, not zero
        return None
    return {"comm_s": _length(_union(comm)) / 1e6, "exposed_s": uncovered(comm, compute) / 1e6}
