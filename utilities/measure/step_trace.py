"""One traced step's record, and the replay of its memory events.

``StepTrace``: what the planner and the time model read from a fake step (the tracker's peak by
category, the states held after it, the op segments, units and collectives). ``MemoryEvents``:
the step's allocations, frees, category changes and tracker samples in order, replayed for the
tracker's peak (``MemoryEvents.peak``) and the caching allocator's reserved memory
(``MemoryEvents.reserved``). ``MemorySamples``: the tracker's samples, grouped in runs by unit and
phase (what ``depth_scaling`` extends).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from utilities.measure.op_recorder import OpRecorder, Segment, UnitInfo


class MemorySamples:
    """The memory tracker's samples (its total and categories after every op and at every module
    boundary), grouped in runs: consecutive samples taken in one (unit, phase)."""

    def __init__(self, ops: OpRecorder, device_type: str):
        self.ops = ops
        self.device_type = device_type
        self.keys: tuple | None = None  # the tracker's categories, in its order ("Total" last)
        self.runs: list[tuple[tuple[str, str], list[tuple[int, ...]]]] = []
        self.event_places: list[tuple[str, str]] = []  # (unit, phase) of each memory event
        self.recorder = None  # the allocation recorder, told where each sample falls

    def __call__(self, current: dict) -> None:
        for dev, snap in current.items():
            if torch.device(dev).type != self.device_type:
                continue
            if self.keys is None:
                self.keys = tuple(snap)
            where = (self.ops.unit(), self.ops.phase())
            if self.recorder is not None:
                self.recorder.mark(where)
            if not self.runs or self.runs[-1][0] != where:
                self.runs.append((where, []))
            self.runs[-1][1].append(tuple(snap.get(k, 0) for k in self.keys))


@dataclass
class StepTrace:
    """One traced step: what the planner and the time model read.

    Memory: ``peak`` (the tracker's categories at the peak, by their names), ``states`` (the
    parameters, gradients and optimizer state held after the step), ``largest_unit_shard``;
    ``reserved(without)`` replays the allocations through the caching-allocator model. Time:
    ``segments`` (op segments in execution order, the last micro-batch's forward and backward),
    ``units`` (forward order), ``collectives`` (op, unit at issue, bytes)."""

    model: str
    precision: str
    ac: str
    batch: int
    seq: int
    world: int
    peak: dict[str, int]
    states: dict[str, int]
    largest_unit_shard: int
    segments: list[Segment]
    units: list[UnitInfo]
    collectives: list[tuple[str, str, int]]
    trace_s: float
    backward_collectives_from: int = 0  # where backward's collectives begin
    layers: int | None = None  # blocks in the model
    traced_layers: tuple[int, ...] = ()  # the depths traced, when scaled from smaller ones
    memory_events: MemoryEvents | None = field(default=None, repr=False)
    unit_states: dict[str, dict[str, int]] = field(default_factory=dict, repr=False)
    reserved_scaled_linearly: bool = False  # the replay could not be extended block by block
    # under compile: each compiled region's saved bytes, eager and compiled (``compile_memory``)
    compiled_regions: list[dict[str, Any]] = field(default_factory=list, repr=False)

    def reserved(self, without: frozenset[str] = frozenset()) -> dict[str, int] | None:
        """The caching allocator's peaks for this step (``allocator.reserved_peak``), leaving out
        the allocations whose tracker category is in ``without`` (offloaded to the host)."""
        return self.memory_events.reserved(without) if self.memory_events else None


# FSDP2's own CUDA streams, by the tracker's category of what is allocated on them: the
# all-gather outputs off the compute stream, the reduce-scatter's output on its stream, which the
# sharded gradients are views of (``allocator``); the rest (the reduce-scatter's input too): 0
STREAMS = {"All Gather": 1, "Sharded Grad": 2}


@dataclass
class MemoryEvents:
    """The step's memory, as a replay needs it: ``resident`` (unit, bytes, category) held before
    the step (parameter shards and buffers, then the optimizer state, unit by unit), ``step`` its
    ``(kind, key, bytes, category)`` events in order ("alloc", "free", "ref": a tensor changes
    category, "sample": the tracker takes its totals); or, where a scaled trace could not be
    extended event by event, two traced depths and the factor between them (``linear``)."""

    resident: list[tuple[str, int, str]] = field(default_factory=list)
    step: list[tuple[str, Any, int, str | None]] = field(default_factory=list)
    device_type: str = "cpu"
    linear: tuple[MemoryEvents, MemoryEvents, float] | None = None

    def reserved(self, without: frozenset[str] = frozenset()) -> dict[str, int] | None:
        from utilities.measure.allocator import reserved_peak

        if self.linear is not None:
            a, b, factor = (self.linear[0].reserved(without), self.linear[1].reserved(without),
                            self.linear[2])
            if a is None or b is None:
                return None
            return {k: int(round(a[k] + factor * (b[k] - a[k]))) for k in a}
        before = [("alloc", ("resident", i), n) for i, (_, n, kind) in enumerate(self.resident)
                  if kind not in without]
        # each allocation by its own name (a tracker's key is reused once its tensor is gone),
        # left out when its category then is in ``without``, on the stream its category says
        step: list[tuple[str, Any, int]] = []
        streams: dict[Any, int] = {}
        live: dict[Any, Any] = {}
        for count, (kind, key, n, category) in enumerate(self.step):
            if kind == "alloc":
                if key in live:
                    step.append(("free", live.pop(key), 0))
                live[key] = (key, count)
                if category not in without:
                    step.append(("alloc", live[key], n))
            elif kind == "free" and key in live:
                step.append(("free", live.pop(key), 0))
            if category in STREAMS and key in live:  # booked as such when allocated or just after
                streams[live[key]] = STREAMS[category]
        return reserved_peak(before, step, streams=streams) if step else None

    def peak(self) -> dict[str, int]:
        """The tracker's peak snapshot (bytes by category, and "Total"), replayed: each tensor
        counts its bytes (rounded up to 512 on CUDA, as the tracker rounds) in its category, and
        the peak is the first sample with the largest total."""
        unit = 512 if self.device_type == "cuda" else 1
        cur: dict[str, int] = {}
        live: dict[Any, tuple[str, int]] = {}
        for _, n, category in self.resident:
            cur[category] = cur.get(category, 0) + -(-n // unit) * unit
        total = best = sum(cur.values())
        snap = dict(cur)
        for kind, key, n, category in self.step:
            if kind == "sample":
                if total > best:
                    best, snap = total, dict(cur)
                continue
            old = live.pop(key, None) if kind != "ref" else live.get(key)
            if old is not None:
                cur[old[0]] -= old[1]
                total -= old[1]
            if kind == "alloc" or (kind == "ref" and old is not None):
                size = -(-n // unit) * unit if kind == "alloc" else old[1]
                live[key] = (category, size)
                cur[category] = cur.get(category, 0) + size
                total += size
        snap = {k: v for k, v in snap.items() if v}
        snap["Total"] = best
        return snap
