"""A plan over GPU counts x strategies (``fsdp-course plan --sweep``), tracing as few steps as is
exact: the counts between the smallest and the largest re-sharded by arithmetic (``reshard``)
where that matches the largest's own trace."""

from __future__ import annotations

from typing import Any

from utilities.measure.plan_options import PlanOptions, as_options
from utilities.measure.planner import Plan, overflowing_category, plan
from utilities.models import get_model_spec

SWEEP_GPUS = (8, 16, 32, 64, 128, 256)


SWEEP_STRATEGIES = ("full_shard", "shard_grad_op", "no_shard")


def sharded_state_bytes(spec, world: int) -> int:
    """Bytes of one rank's fp32 parameter shard under FSDP2 on ``world`` ranks, tensor by tensor:
    each parameter is split on dim 0 into chunks of ceil(dim0 / world) rows, and rank 0 holds a
    whole chunk (FSDP2 pads the others)."""
    model = spec.build(device="meta")
    total = 0
    for p in model.parameters():
        rows = p.shape[0] if p.dim() else 1
        total += -(-rows // world) * (p.numel() // max(rows, 1)) * 4
    return total


def reshard(base: Plan, gpus: int, shard_bytes: dict[int, int]) -> Plan:
    """``base`` moved to ``gpus`` GPUs by arithmetic: the fp32 parameter shard and AdamW's two
    moments (and the sharded gradients held at the peak) scale with ``sharded_state_bytes``; the
    units unsharded in flight, activations and temporaries stay, since the per-rank batch does.
    Exact for the model states; it assumes the peak stays at the same moment of the step, which
    ``sweep`` checks by tracing the far end."""
    old, new = shard_bytes[base.gpus], shard_bytes[gpus]
    cats = dict(base.peak_bytes)
    detail = dict(base.detail)
    grads = detail.get("sharded_gradients", 0)
    new_grads = grads * new // old if old else 0
    delta = {"parameters": new - old, "optimizer": 2 * (new - old), "gradients": new_grads - grads}
    for c, d in delta.items():
        cats[c] += d
        cats["total"] += d
    detail["sharded_parameters"] = detail.get("sharded_parameters", 0) + delta["parameters"]
    detail["sharded_gradients"] = new_grads
    budget = base.budget_bytes
    states = {"parameters": new, "gradients": new, "optimizer": 2 * new}
    reserved = base.reserved and dict(base.reserved, reserved=base.reserved["reserved"]
                                      + cats["total"] - base.peak_bytes["total"])
    return Plan(**dict(base.as_dict(), gpus=gpus, peak_bytes=cats, detail=detail, reserved=reserved,
                       fits=cats["total"] <= budget,
                       overflowing=None if cats["total"] <= budget else overflowing_category(cats, budget),
                       method=f"re-sharded by arithmetic from the plan traced at {base.gpus} GPUs",
                       notes=list(base.notes), model_states=states))


def sweep(model, gpu_counts=SWEEP_GPUS, strategies=SWEEP_STRATEGIES, gpu_memory_bytes: int = 80 * 2**30,
          precision: str = "bf16", ac: str = "none", batch: int = 1, seq: int | None = None,
          device_type: str = "cuda", options: PlanOptions | dict[str, Any] | None = None) -> list[Plan]:
    """Plans over GPU counts x strategies, tracing as few steps as is exact: no_shard once (no
    rank holds less with more GPUs); full_shard and shard_grad_op at the smallest and the largest
    count, the counts between by ``reshard`` from the smallest, kept only when ``reshard`` of the
    largest matches its trace within 0.5% (else every count is traced). Each plan's ``method``
    says which it is."""
    counts = sorted(set(gpu_counts))
    spec = get_model_spec(model)
    o = as_options(options)
    plans: list[Plan] = []
    for strategy in strategies:
        if strategy == "no_shard" and (o.offload or o.reshard_after_forward is not None):
            continue  # neither exists without sharding
        if strategy == "shard_grad_op" and o.reshard_after_forward is not None:
            continue  # shard_grad_op is reshard_after_forward=False
        if strategy == "no_shard":
            base = plan(spec, counts[0], gpu_memory_bytes, strategy, precision, ac, batch, seq,
                        device_type, options=o)
            plans += [Plan(**dict(base.as_dict(), gpus=n,
                                  method=base.method + " (no_shard: the same on every GPU count)"))
                      for n in counts]
            continue
        if strategy not in ("full_shard", "shard_grad_op") or not o.default:
            # re-sharding by arithmetic knows the default step's states only: trace each count
            plans += [plan(spec, n, gpu_memory_bytes, strategy, precision, ac, batch, seq,
                           device_type, options=o) for n in counts]
            continue
        first = plan(spec, counts[0], gpu_memory_bytes, strategy, precision, ac, batch, seq, device_type)
        if len(counts) == 1:
            plans.append(first)
            continue
        last = plan(spec, counts[-1], gpu_memory_bytes, strategy, precision, ac, batch, seq, device_type)
        shard_bytes = {n: sharded_state_bytes(spec, n) for n in counts}
        traceable = bool(first.detail) and bool(last.detail)
        check = reshard(first, counts[-1], shard_bytes) if traceable else None
        exact = check is not None and abs(check.peak_bytes["total"] - last.peak_bytes["total"]) <= (
            0.005 * last.peak_bytes["total"])
        middle = [reshard(first, n, shard_bytes) if exact else
                  plan(spec, n, gpu_memory_bytes, strategy, precision, ac, batch, seq, device_type)
                  for n in counts[1:-1]]
        plans += [first, *middle, last]
    return plans
