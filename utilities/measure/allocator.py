"""What the CUDA caching allocator reserves for a step whose allocations a tracker recorded.

``plan`` predicts what is *allocated* at the peak; ``nvidia-smi``, torchtitan's memory column and an
out-of-memory error are about what is *reserved*: segments the caching allocator took from the
driver and keeps, whether or not a tensor lives in them. ``reserved_peak`` replays the step's
allocations and frees (in the order the memory tracker saw them) through a model of PyTorch's
``CUDACachingAllocator`` (c10/cuda/CUDACachingAllocator.cpp, ``expandable_segments`` off, its
default):

* every request is rounded up to 512 bytes;
* requests up to 1 MiB come from the small pool, carved out of 2 MiB segments; larger ones from
  the large pool: under 10 MiB a 20 MiB segment, otherwise the request rounded up to 2 MiB;
* a request takes the smallest cached free block that holds it (best fit), split when the rest
  is worth keeping (512 B small, over 1 MiB large); a freed block merges with free neighbours of
  its segment and stays cached: segments are never given back (no ``empty_cache``);
* one pool per CUDA stream: a block freed on one stream is reused only by requests on that stream
  (segments belong to the stream that took them). FSDP2 (``_fsdp_collectives.py``) allocates its
  all-gather outputs off the compute stream, and the reduce-scatter's output on its
  reduce-scatter stream: the sharded gradients are views of it ("The RS output is allocated in
  the RS stream and used in the default stream (for optimizer)"), cached there once
  ``zero_grad`` frees them; the reduce-scatter's input is allocated on the compute stream before
  the reduce-scatter stream waits on it. ``streams`` names each allocation's stream (the
  planner: by the tracker's category, "All Gather" and "Sharded Grad", everything else on the
  compute stream);
* the step is replayed twice: the second starts with what the first left cached (the gradient
  blocks ``zero_grad(set_to_none=True)`` freed, the logits', the activations'), as every step
  after the first does; the reserved peak is the larger.

What it leaves out, said in the plan: FSDP2's all-gather copy-in buffers (on their own stream,
booked by the tracker with the compute stream's temporaries), the CUDA context and NCCL's own
buffers (outside the allocator), ``max_split_size_mb`` and ``garbage_collection_threshold`` (off
by default).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

ROUND = 512
SMALL = 1 << 20  # requests up to this come from the small pool
SMALL_SEGMENT = 2 << 20
LARGE_SEGMENT = 20 << 20  # for requests under MIN_LARGE_ALLOC
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20


def round_size(n: int) -> int:
    return max(ROUND, -(-int(n) // ROUND) * ROUND)


def segment_size(n: int) -> int:
    if n <= SMALL:
        return SMALL_SEGMENT
    if n < MIN_LARGE_ALLOC:
        return LARGE_SEGMENT
    return -(-n // ROUND_LARGE) * ROUND_LARGE


@dataclass
class _Block:
    seg: int
    offset: int
    size: int
    free: bool
    small: bool
    stream: int = 0
    prev: _Block | None = None
    next: _Block | None = None

    def key(self) -> tuple[int, int, int]:
        return (self.size, self.seg, self.offset)


class CachingAllocator:
    """A model of the caching allocator: ``malloc(n) -> handle``, ``free(handle)``, and what it
    has allocated and reserved (now and at the peak)."""

    def __init__(self):
        self.pools: dict[tuple[int, bool], list[tuple[int, int, int]]] = {}  # (stream, small?)
        self.free_blocks: dict[tuple[int, int, int], _Block] = {}
        self.live: dict[int, _Block] = {}
        self.allocated = self.reserved = 0
        self.peak_allocated = self.peak_reserved = 0
        self.segments = 0
        self._next = 0

    def _insert_free(self, b: _Block, small: bool) -> None:
        b.free = True
        bisect.insort(self.pools.setdefault((b.stream, small), []), b.key())
        self.free_blocks[b.key()] = b

    def _remove_free(self, b: _Block, small: bool) -> None:
        pool = self.pools[(b.stream, small)]
        i = bisect.bisect_left(pool, b.key())
        del pool[i]
        del self.free_blocks[b.key()]
        b.free = False

    def malloc(self, nbytes: int, stream: int = 0) -> int:
        size = round_size(nbytes)
        small = size <= SMALL
        pool = self.pools.get((stream, small), [])
        i = bisect.bisect_left(pool, (size, -1, -1))
        if i < len(pool):
            b = self.free_blocks[pool[i]]
            self._remove_free(b, small)
        else:
            seg = segment_size(size)
            self.segments += 1
            self.reserved += seg
            self.peak_reserved = max(self.peak_reserved, self.reserved)
            b = _Block(self.segments, 0, seg, False, small, stream)
        rest = b.size - size
        if rest >= ROUND if small else rest > SMALL:
            tail = _Block(b.seg, b.offset + size, rest, True, small, b.stream, prev=b, next=b.next)
            if b.next is not None:
                b.next.prev = tail
            b.next, b.size = tail, size
            self._insert_free(tail, small)
        self._next += 1
        self.live[self._next] = b
        self.allocated += b.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return self._next

    def free(self, handle: int) -> None:
        b = self.live.pop(handle)
        self.allocated -= b.size
        small = b.small
        for other in (b.prev, b.next):
            if other is not None and other.free:
                self._remove_free(other, small)
                if other is b.prev:
                    other.size += b.size
                    other.next = b.next
                    if b.next is not None:
                        b.next.prev = other
                    b = other
                else:
                    b.size += other.size
                    b.next = other.next
                    if other.next is not None:
                        other.next.prev = b
        self._insert_free(b, small)


def reserved_peak(before: list[tuple[str, int, int]], step: list[tuple[str, int, int]],
                  steps: int = 2, streams: dict[Any, int] | None = None) -> dict[str, int]:
    """Replay a step through ``CachingAllocator``: ``before`` (``("alloc", key, bytes)`` /
    ``("free", key, 0)``) is what the rank holds when the step starts, ``step`` the step,
    replayed ``steps`` times; what a step leaves allocated (its gradients) is freed before the
    next, as ``zero_grad(set_to_none=True)`` does, and stays cached. ``streams``: the stream of an
    allocation by key (default 0, the compute stream). The allocated and reserved peaks, the first
    step's reserved peak, and the segments taken."""
    streams = streams or {}
    a = CachingAllocator()
    held: dict[int, int] = {}
    for kind, key, nbytes in before:
        if kind == "alloc":
            held[key] = a.malloc(nbytes)
        elif key in held:
            a.free(held.pop(key))
    per_step = []
    left: dict[int, int] = {}
    for _ in range(steps):
        for h in left.values():
            a.free(h)
        a.peak_allocated, a.peak_reserved = a.allocated, a.reserved
        handles: dict[int, int] = {}
        for kind, key, nbytes in step:
            if kind == "alloc":
                if key in handles:
                    a.free(handles.pop(key))
                handles[key] = a.malloc(nbytes, streams.get(key, 0))
            elif kind == "free" and key in handles:
                a.free(handles.pop(key))
        per_step.append((a.peak_allocated, a.peak_reserved))
        left = handles
    return {"allocated": max(p[0] for p in per_step), "reserved": max(p[1] for p in per_step),
            "first_step_reserved": per_step[0][1], "segments": a.segments}


class EventRecorder:
    """Records a ``MemTracker``'s allocations and frees on one device type as
    ``(kind, key, bytes)`` events, by wrapping its ``_update_snap``."""

    def __init__(self, tracker, device_type: str, where=None):
        self.events: list[tuple[str, int, int]] = []
        self.where = where  # a callable naming where the step is; its answer kept per event
        self.places: list[Any] = []
        # with ``where``: the tracker's category of each event's tensor, and its category changes
        # as ("ref", key, 0) events (what a replay of the tracker's categories needs)
        self.categories: list[str | None] = []
        self.device_type = device_type
        self._orig = tracker._update_snap
        tracker._update_snap = self._update_snap

    def _update_snap(self, u_type, winfo, old_mem_consumed=None, old_reftype=None):
        if self._orig is None:  # released: the tracker's late frees are no longer recorded
            return None
        if winfo.device.type == self.device_type:
            name = getattr(u_type, "name", str(u_type))
            key = id(winfo)
            if self.where is not None:
                self.places.append(self.where())
                self.categories.append(str(getattr(winfo.reftype, "value", winfo.reftype)))
                if name == "REF":
                    self.events.append(("ref", key, 0))
            if name == "ADD":
                self.events.append(("alloc", key, winfo.size * winfo.element_size))
            elif name == "DEL":
                self.events.append(("free", key, 0))
            elif name == "SIZE":  # FSDP2 frees and re-allocates by resizing the storage
                nbytes = winfo.size * winfo.element_size
                self.events.append(("alloc", key, nbytes) if nbytes else ("free", key, 0))
            elif self.where is not None and name != "REF":  # an update kind this torch adds
                self.places.pop()
                self.categories.pop()
        return self._orig(u_type, winfo, old_mem_consumed, old_reftype)

    def mark(self, place: Any) -> None:
        """A point where the tracker takes a sample of its totals (``("sample", 0, 0)``)."""
        self.events.append(("sample", 0, 0))
        self.places.append(place)
        self.categories.append(None)

    def release(self) -> None:
        """Let go of the tracker (and with it the model) once the step is recorded."""
        self._orig = None
