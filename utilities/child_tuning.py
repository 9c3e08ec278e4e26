"""Child-tuning (Xu et al., 2021, "Raise a Child in Large Language Model", arXiv 2109.05687).

Child-tuning updates only a *child network*: a subset of the weights, chosen by a mask over the
gradients. Between ``loss.backward()`` and ``optimizer.step()`` the gradients are multiplied by the
mask, so the masked-out entries receive no update from the current gradient.

* **ChildTuning-F** (task-free): a fresh Bernoulli(``reserve_p``) mask every step, and the kept
  gradients are scaled by ``1 / reserve_p`` so that the expected gradient is unchanged.
* **ChildTuning-D** (task-driven): before fine-tuning, accumulate the squared gradients (the
  diagonal of the empirical Fisher information) over a few batches of the task's data, then keep,
  for the whole run, the ``reserve_p`` fraction of entries with the largest Fisher values. As in the
  paper, the threshold is one for the whole model, not one per tensor.

Both work on a plain module and on sharded parameters:

* FSDP2 (``fully_shard``): every parameter and its gradient are DTensors; each rank masks only its
  local shard (``grad.to_local()``), which is all it holds after the reduce-scatter. A Bernoulli mask
  needs no coordination: each rank draws its own entries (seeded per rank, so a run repeats).
* ChildTuning-D needs the *global* top-``reserve_p`` threshold, which no single rank can see. We find
  it exactly without gathering the Fisher values: for non-negative float32 numbers, the order of the
  values is the order of their bit patterns read as int32, so we bisect over those 31-bit integers.
  Each of the (at most 31) bisection steps counts, on every rank, the local entries at or above the
  candidate and all-reduces that one number. Memory O(1), traffic 31 x 8 bytes, and the threshold is
  the exact k-th largest value of the full, unsharded Fisher (ties at the threshold are all kept).
* FSDP1 with ``use_orig_params=True`` exposes each rank's part of a parameter as a (possibly empty)
  view; the same code runs on those views.

The mask is applied in place to ``p.grad``; use it from a ``step_fn`` (see ``step_fn``) or call
``apply()`` yourself before ``optimizer.step()``. Note for AdamW: a zero gradient still lets momentum
from earlier steps and weight decay move a weight. ChildTuning-D's fixed mask keeps masked entries
at exactly zero moments, so with ``weight_decay=0`` they never move; ChildTuning-F re-draws its
mask every step, so momentum moves every entry over time (that is the method, not a leak).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from utilities.distributed import reduce_scalar
from utilities.errors import bad_value

MODES = ("F", "D")


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: the local shard of a DTensor, else the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def check_reserve_p(reserve_p: float) -> float:
    if not 0.0 < reserve_p <= 1.0:
        raise bad_value("--reserve-p", reserve_p, "numbers in (0, 1]")
    return float(reserve_p)


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _all_reduce_sum(value: int, device: torch.device) -> int:
    return int(reduce_scalar(int(value), "sum", device))  # counts below 2**53: exact in float64


def global_topk_threshold(values: list[torch.Tensor], k: int) -> float:
    """The k-th largest entry over ``values`` on *all* ranks (each rank passes its local shards).

    Exact, by bisection over the int32 bit patterns of non-negative float32 values; one scalar
    all-reduce per step, at most 31 steps. Every rank returns the same threshold.
    """
    if k < 1:
        return float("inf")
    device = values[0].device if values else torch.device("cpu")
    bits = [v.detach().float().clamp_min(0).contiguous().view(torch.int32).flatten() for v in values]
    lo, hi = 0, 0x7F800000  # 0.0 .. +inf as int32 bit patterns
    # invariant: count(>= lo) >= k  and  count(>= hi + 1) < k
    while lo < hi:
        mid = (lo + hi + 1) // 2
        count = _all_reduce_sum(sum(int((b >= mid).sum()) for b in bits), device)
        if count >= k:
            lo = mid
        else:
            hi = mid - 1
    return torch.tensor([lo], dtype=torch.int32).view(torch.float32).item()


class ChildTuning:
    """A gradient mask over ``params`` (the trainable parameters of a plain or sharded model).

    >>> ct = ChildTuning(model.parameters(), mode="F", reserve_p=0.3)
    >>> loss.backward(); ct.apply(); optimizer.step()

    For mode "D", call ``compute_fisher_mask(model, batches, n)`` once before training.
    """

    def __init__(self, params: Iterable[nn.Parameter], mode: str = "F", reserve_p: float = 0.3,
                 seed: int = 0):
        if mode not in MODES:
            raise bad_value("child-tuning mode", mode, MODES)
        self.mode, self.reserve_p = mode, check_reserve_p(reserve_p)
        self.params = [p for p in params if p.requires_grad]
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.generator = torch.Generator().manual_seed(seed * 7919 + rank)  # per rank: own entries
        self.masks: list[torch.Tensor] | None = None  # D: one bool mask per local shard
        self.threshold: float | None = None
        self.kept_fraction: float | None = None

    # -- ChildTuning-D ----------------------------------------------------------------------------
    def compute_fisher_mask(self, model: nn.Module, batches: Iterator[dict], num_batches: int,
                            step_fn: Callable[[nn.Module, dict], torch.Tensor] | None = None) -> None:
        """Accumulate squared gradients over ``num_batches`` task batches and fix the mask to the
        global top ``reserve_p`` fraction. Under FSDP each gradient is the rank-averaged one (after
        the reduce-scatter), so this is the Fisher of the global batch."""
        step_fn = step_fn or _loss_backward
        fisher = [torch.zeros_like(local(p)) for p in self.params]
        for _ in range(num_batches):
            for p in self.params:
                p.grad = None
            step_fn(model, next(batches))
            with torch.no_grad():
                for f, p in zip(fisher, self.params):
                    if p.grad is not None:
                        f.add_(local(p.grad).float().pow(2))
        for p in self.params:
            p.grad = None
        device = fisher[0].device if fisher else torch.device("cpu")
        total = _all_reduce_sum(sum(f.numel() for f in fisher), device)
        k = max(1, int(round(self.reserve_p * total)))
        self.threshold = global_topk_threshold(fisher, k)
        self.masks = [f >= self.threshold for f in fisher]
        kept = _all_reduce_sum(sum(int(m.sum()) for m in self.masks), device)
        self.kept_fraction = kept / max(total, 1)

    # -- applying the mask ------------------------------------------------------------------------
    @torch.no_grad()
    def apply(self) -> None:
        """Mask the gradients in place (call after backward, before the optimizer step)."""
        if self.mode == "D" and self.masks is None:
            raise RuntimeError("ChildTuning-D needs compute_fisher_mask() before training")
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            g = local(p.grad)
            if g.numel() == 0:
                continue
            if self.mode == "F":
                keep = torch.rand(g.shape, generator=self.generator).to(g.device) < self.reserve_p
                g.mul_(keep.to(g.dtype)).div_(self.reserve_p)
            else:
                g.mul_(self.masks[i].to(g.dtype))

    def step_fn(self, inner: Callable[[nn.Module, dict], torch.Tensor] | None = None):
        """A ``step_fn`` for ``utilities.training.train``: forward + backward, then the mask."""
        inner = inner or _loss_backward

        def step(model: nn.Module, batch: dict) -> torch.Tensor:
            loss = inner(model, batch)
            self.apply()
            return loss

        return step


def _loss_backward(model: nn.Module, batch: dict) -> torch.Tensor:
    loss = model(**batch).loss
    loss.backward()
    return loss
