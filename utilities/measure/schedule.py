"""The time model's schedule: two lanes, compute and communication.

Compute runs the traced segments in order; the collectives run one at a time in the order they
are issued. An all-gather is issued ``prefetch`` units ahead (FSDP2's implicit prefetching is one
unit; 0 is none), a reduce-scatter when its unit's backward ends; a unit's compute waits for its
all-gather; the optimizer step waits for the last reduce-scatter. FSDP1's ``backward_prefetch``
and ``limit_all_gathers`` are variants of the issue order. The planner's options change what is
issued: ``reshard_all_gathers``, ``offload_copies``, ``accumulated_lanes``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from utilities.measure.cost_model import trainable_shard_numel
from utilities.measure.gpu_catalogue import GPU, PCIE_BYTES_PER_S

BACKWARD_PREFETCH = ("backward_pre", "backward_post", "none")


@dataclass
class Event:
    """One bar of the timeline: a unit's compute or one collective, in seconds from the step's start."""

    lane: str  # "compute" or "comm"
    unit: str
    phase: str  # forward, recompute, backward, optimizer; all_gather, reduce_scatter, all_reduce
    start: float
    end: float
    args: dict[str, Any] = field(default_factory=dict)  # bytes, FLOPs, ops: the trace's slice args


@dataclass
class Collective:
    kind: str
    unit: str
    seconds: float
    nbytes: float
    args: dict[str, Any] = field(default_factory=dict)
    issue: float = 0.0
    start: float = 0.0
    end: float = 0.0


class Lanes:
    """Two lanes: compute runs segments in order; communication runs collectives one at a time in
    the order they are issued (NCCL on one stream per direction, here one lane)."""

    def __init__(self):
        self.compute_free = 0.0
        self.comm_free = 0.0
        self.events: list[Event] = []

    def issue(self, c: Collective, at: float) -> Collective:
        c.issue = at
        c.start = max(at, self.comm_free)
        c.end = c.start + c.seconds
        self.comm_free = c.end
        if c.seconds > 0:
            self.events.append(Event("comm", c.unit, c.kind, c.start, c.end, c.args))
        return c

    def compute(self, unit: str, phase: str, seconds: float, after: float = 0.0,
                args: dict[str, Any] | None = None) -> tuple[float, float]:
        start = max(self.compute_free, after)
        end = start + seconds
        self.compute_free = end
        self.events.append(Event("compute", unit, phase, start, end, args or {}))
        return start, end


def run_schedule(plan_segs, units, ag_fwd, ag_bwd, grad_colls, depths: tuple[str, int, int],
                 limit_all_gathers: bool, optimizer_s: float, optimizer_args=None):
    """Run the two lanes. ``plan_segs``: (unit, phase, seconds, args) in execution order; ``ag_fwd`` /
    ``ag_bwd``: unit -> all-gather (absent: none needed); ``grad_colls``: unit -> collectives
    after its backward; ``depths``: the backward's mode ("fsdp2" or FSDP1's backward_prefetch),
    the forward's prefetch depth and the backward's. Returns the lanes."""
    bwd_mode, fwd_depth, bwd_depth = depths
    lanes = Lanes()
    fwd_order = [u.name for u in units]
    bwd_first: list[str] = []  # units in the order their backward-time compute starts
    last_bwd: dict[str, int] = {}
    for i, (u, ph, *_) in enumerate(plan_segs):
        if ph != "forward":
            if u not in bwd_first:
                bwd_first.append(u)
            last_bwd[u] = i
    issued: dict[tuple[str, str], Collective] = {}
    compute_end: dict[str, float] = {}  # forward compute end per unit (the rate limiter's free)

    def issue(key, coll, at):
        if coll is None or key in issued:
            return
        issued[key] = lanes.issue(coll, at)

    def limit_at(order, k, now):
        if not limit_all_gathers or k < 2:
            return now
        return max(now, compute_end.get(order[k - 2], now))

    started: set[tuple[str, str]] = set()
    for i, (u, ph, secs, args) in enumerate(plan_segs):
        stage = "fwd" if ph == "forward" else "bwd"
        order = fwd_order if stage == "fwd" else bwd_first
        k = order.index(u)
        first = (u, stage) not in started
        if first:
            started.add((u, stage))
            need = (ag_fwd if stage == "fwd" else ag_bwd).get(u)
            depth = fwd_depth if stage == "fwd" else bwd_depth
            if need is not None and (u, stage) not in issued:  # not prefetched: issued on arrival
                issue((u, stage), need, limit_at(order, k, lanes.compute_free))
            ready = issued[(u, stage)].end if (u, stage) in issued else 0.0
            start, end = lanes.compute(u, ph, secs, after=ready, args=args)
            # prefetch: the next ``depth`` units' all-gathers, issued as this unit starts
            if stage == "bwd" and bwd_mode == "backward_post":
                depth = 0
            for j in range(k + 1, min(k + 1 + depth, len(order))):
                nxt = order[j]
                coll = (ag_fwd if stage == "fwd" else ag_bwd).get(nxt)
                issue((nxt, stage), coll, limit_at(order, j, start))
        else:
            start, end = lanes.compute(u, ph, secs, args=args)
        if stage == "fwd":
            compute_end[u] = end
        if stage == "bwd" and last_bwd.get(u) == i:
            if bwd_mode == "backward_post" and k + 1 < len(order):
                nxt = order[k + 1]
                issue((nxt, "bwd"), ag_bwd.get(nxt), end)  # before this unit's reduce-scatter
            for c in grad_colls.get(u, []):
                lanes.issue(c, end)
    done = max(lanes.compute_free, lanes.comm_free)
    lanes.compute("all", "optimizer", optimizer_s, after=done, args=optimizer_args)
    return lanes


def reshard_all_gathers(ag_bwd, ag_fwd, units, group, po, item, coll):
    """Backward all-gathers under reshard_after_forward: none (False), over the whole group (True,
    as planned), or over groups of N ranks (an int: the resharded copy is gathered in N-ways)."""
    r = po.reshard_after_forward
    if r is False:
        return {}
    if r is True or r is None:
        if r is True and not ag_bwd:  # shard_grad_op told to reshard
            return {u.name: coll("all_gather", u.name, u.shard_numel(group) * group * item, group)
                    for u in units if not u.is_root and u.name in ag_fwd}
        return ag_bwd
    return {u.name: coll("all_gather", u.name, u.shard_numel(group) * group * item, r)
            for u in units if not u.is_root and u.name in ag_fwd and r > 1}


def offload_copies(ag_fwd, ag_bwd, grads, units, group, po, g: GPU) -> None:
    """--offload: each all-gather first copies the unit's parameter shard host -> device, each
    gradient shard goes device -> host after its reduce-scatter; both over PCIe, on the
    communication lane (``PCIE_BYTES_PER_S``)."""
    pcie = PCIE_BYTES_PER_S.get(g.name, 32e9)
    item = 2 if po.param_dtype == "bf16" else 4
    for u in units:
        h2d = u.shard_numel(group) * item / pcie
        for ag in (ag_fwd.get(u.name), ag_bwd.get(u.name)):
            if ag is not None:
                ag.seconds += h2d
        colls = grads.get(u.name)
        if colls:
            colls[-1].seconds += trainable_shard_numel(u, group) * item / pcie


def accumulated_lanes(micro: Lanes, last: Lanes, n: int) -> Lanes:
    """N micro-batches: N - 1 steps of ``micro`` (no optimizer; with or without their
    reduce-scatters) then ``last``, laid end to end."""
    out = Lanes()
    span = max(e.end for e in micro.events)
    for k in range(n - 1):
        out.events += [replace(e, start=e.start + k * span, end=e.end + k * span) for e in micro.events]
    shift = (n - 1) * span
    out.events += [replace(e, start=e.start + shift, end=e.end + shift) for e in last.events]
    return out
