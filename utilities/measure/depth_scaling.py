"""A deep model's step from a trace at a small depth: its middle blocks are alike.

A model of L blocks is traced at a small depth (``scaled_depths``: the first two blocks, one
middle block, the last two) and extended (``extended``): each memory event belongs to the block
whose work made it; the middle block's events are repeated L - 4 times, each copy's references to
its neighbours' tensors pointed at the neighbouring copies (``_extended_events``), and replayed.
Where the events cannot be extended (AdamW's foreach), two depths are traced and every sample is
extended linearly from them (``linearly_scaled``). The op segments, collectives and units are repeated to
fill L blocks (``_repeated``). None wherever the blocks turn out not to be alike.

T5's two stacks (encoder, decoder) are extended one after the other, the other stack's blocks
counted as the root's work; as the decoder's first block works for every later block (the
relative attention bias), the extension is trusted only where it reproduces the trace at the
next depth to the byte (``checked``). Under AdamW's foreach T5 is traced whole.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from utilities.measure.op_recorder import UnitInfo
from utilities.measure.step_trace import MemoryEvents, MemorySamples, StepTrace

# the depths a deep model is traced at: 2 first blocks + the middle + 2 last (see the docstring)
EDGE_BLOCKS = 2


def layers_of(spec) -> int | None:
    """The model's block count (``num_hidden_layers``), or None where it has several stacks (T5's
    encoder and decoder) or none the config names."""
    if spec.is_seq2seq:
        return None
    n = getattr(spec.config(), "num_hidden_layers", None)
    return n if isinstance(n, int) else None


def stacks_of(spec) -> dict[str | None, int] | None:
    """Each stack's block-name prefix (None: whatever the trace names it) and its block count: a
    decoder's one stack, or T5's encoder and decoder; None where the config names none."""
    if spec.is_seq2seq:
        if spec.family != "t5":
            return None
        cfg = spec.config()
        return {"encoder.block.": cfg.num_layers, "decoder.block.": cfg.num_decoder_layers}
    layers = layers_of(spec)
    return None if layers is None else {None: layers}


def _period(ac: str) -> int:
    """How many blocks repeat: checkpointing every second block makes pairs."""
    return 2 if ac == "every-2nd-block" else 1


def scaled_depths(spec, ac: str, options=None) -> tuple[int, int] | None:
    """The depth a model is traced at and the next one (traced too where the events cannot be
    extended: AdamW's foreach), or None when it is traced whole: a shallow model, one with
    several stacks, a freezing that differs block by block (``--trainable``), or an odd number
    of blocks under block-pair checkpointing. A depth is two periods of blocks at each end and
    one in the middle (a period: one block, or two under block-pair checkpointing)."""
    stacks = stacks_of(spec)
    p = _period(ac)
    if stacks is None or (options is not None and options.trainable is not None):
        return None
    small = (2 * EDGE_BLOCKS + 1) * p
    if any(layers <= small + p or layers % p for layers in stacks.values()):
        return None
    return small, small + p


def _periods(index: dict[str, int], p: int) -> dict[str, int]:
    """Each block unit's period (blocks ``p`` at a time), for ``_role``."""
    return {unit: i // p for unit, i in index.items()}


def with_layers(spec, n: int):
    """``spec`` with ``n`` blocks in each stack (its config's ``num_hidden_layers``, and T5's
    ``num_decoder_layers``)."""
    make = spec.make_config

    def config():
        cfg = make()
        cfg.num_hidden_layers = n
        if spec.is_seq2seq:
            cfg.num_decoder_layers = n
        return cfg

    return dataclasses.replace(spec, make_config=config, known_parameters=None,
                               name=f"{spec.name} [{n} blocks]")


_BLOCK = re.compile(r"^(.*?)(\d+)$")


def _block_index(units: list[UnitInfo]) -> tuple[str, dict[str, int]] | None:
    """The blocks' common prefix and each block unit's index, from the units in forward order;
    None unless they are named ``prefix0``, ``prefix1``, ... in order."""
    blocks = [u.name for u in units if not u.is_root]
    found = [_BLOCK.match(b) for b in blocks]
    if not blocks or not all(found) or len({m.group(1) for m in found}) != 1:
        return None
    if [int(m.group(2)) for m in found] != list(range(len(blocks))):
        return None
    return found[0].group(1), {b: i for i, b in enumerate(blocks)}


def _stacks(spec, units: list[UnitInfo]) -> list[tuple[str, dict[str, int], int]] | None:
    """Each stack's block prefix, its block units' indices (``_block_index``) and its block count
    in the deep model; None unless every block unit belongs to a stack and each stack's blocks
    are named ``prefix0``, ``prefix1``, ... in order."""
    stacks = stacks_of(spec)
    if stacks is None:
        return None
    if list(stacks) == [None]:
        named = _block_index(units)
        return None if named is None else [(*named, stacks[None])]
    out = []
    for prefix, layers in stacks.items():
        named = _block_index([u for u in units if u.name.startswith(prefix)])
        if named is None or named[0] != prefix:
            return None
        out.append((prefix, named[1], layers))
    if sum(len(index) for _, index, _ in out) != sum(not u.is_root for u in units):
        return None
    return out


def _role(unit: str, index: dict[str, int], depth: int) -> int | str:
    """A unit's place, the same at any depth: "root", 0 and 1 (the first blocks), -2 and -1 (the
    last), or "middle". ``index`` and ``depth`` count blocks, or periods of blocks
    (``_periods``)."""
    if unit not in index:
        return "root"
    i = index[unit]
    if i < EDGE_BLOCKS:
        return i
    if i >= depth - EDGE_BLOCKS:
        return i - depth
    return "middle"


def _roles(units: list[str], index, depth) -> list:
    """Each entry's place, the same at any depth: a block's role (``_role``), or for the root's
    entries the role of the block that ran last before them, as ("after", role) (the root's
    work between two blocks belongs with the block before it)."""
    out, after = [], "start"
    for unit in units:
        role = _role(unit, index, depth)
        if role == "root":
            out.append("middle" if after == "middle" else ("after", after))
        else:
            out.append(role)
            after = role
    return out


def _keyed_runs(samples: MemorySamples, index, depth):
    """The runs outside the middle blocks, each keyed by (role, phase, its count so far)."""
    out, seen = [], {}
    roles = _roles([unit for (unit, _), _ in samples.runs], index, depth)
    for role, ((_, phase), values) in zip(roles, samples.runs):
        if role == "middle":
            continue
        n = seen[(role, phase)] = seen.get((role, phase), -1) + 1
        out.append(((role, phase, n), values))
    return out


def _scaled_peak(small: MemorySamples, large: MemorySamples, index_small, index_large, depths,
                 factor: float) -> dict[str, int] | None:
    """The largest sample of the deep model and its categories, each sample extended linearly
    from the two depths; None when the runs of the two depths do not match."""
    a = _keyed_runs(small, index_small, depths[0])
    b = _keyed_runs(large, index_large, depths[1])
    if [k for k, _ in a] != [k for k, _ in b] or small.keys != large.keys or not small.keys:
        return None
    total = small.keys.index("Total")
    best, best_values = None, None
    for (_, va), (_, vb) in zip(a, b):
        if len(va) == len(vb):
            pairs = zip(va, vb)
        else:  # a run whose length grows with the depth (the optimizer's per-parameter ops)
            pairs = [(max(va, key=lambda s: s[total]), max(vb, key=lambda s: s[total]))]
        for sa, sb in pairs:
            t = sa[total] + factor * (sb[total] - sa[total])
            if best is None or t > best:
                best = t
                best_values = [x + factor * (y - x) for x, y in zip(sa, sb)]
    return {k: int(round(v)) for k, v in zip(small.keys, best_values)}


def _renamed(seq, name_of, index, prefix, depth, layers, p):
    """``seq`` (segments, collectives or units of the trace at ``depth``, whose middle blocks are
    one period ``p``) with the middle entries repeated to fill ``layers`` blocks, in ascending
    order after the first blocks and descending after the last (``_ascending``), and every block
    renamed to its index in the deep model."""
    def rename(unit, shift=0):
        if unit not in index:
            return unit
        i = index[unit]
        return f"{prefix}{i + shift if i < depth - EDGE_BLOCKS * p else i + layers - depth}"

    copies = (layers - 2 * EDGE_BLOCKS * p) // p
    roles = _roles([name_of(x) for x in seq], _periods(index, p), depth // p)
    out, i, ascending = [], 0, True
    while i < len(seq):
        if roles[i] != "middle":
            out.append((seq[i], rename(name_of(seq[i]))))
            ascending = _ascending(roles[i], ascending)
            i += 1
            continue
        j = i
        while j < len(seq) and roles[j] == "middle":
            j += 1
        order = range(copies) if ascending else range(copies - 1, -1, -1)
        out += [(x, rename(name_of(x), p * c)) for c in order for x in seq[i:j]]
        i = j
    return out


def _ascending(role, before: bool) -> bool:
    """Whether middle blocks met next run in ascending order: after one of the first blocks
    (forward, the optimizer), not after one of the last (backward); ``before`` elsewhere."""
    role = role[1] if isinstance(role, tuple) else role
    return True if role in (0, 1) else False if role in (-2, -1) else before


def _repeated(spec, small: StepTrace, depth: int, p: int, **memory) -> StepTrace | None:
    """The deep model's ``StepTrace`` from the trace at ``depth`` blocks (its middle: one period of
    ``p`` blocks): op segments, collectives and units with the middle repeated and renamed, and
    the memory given (``peak``, ``states``, ``memory_events``). None unless the blocks are named
    ``prefix0``, ``prefix1``, ... in order."""
    stacks = _stacks(spec, small.units)
    if stacks is None:
        return None

    def renamed(seq, name_of):
        """(entry, its name in the deep model) for each entry of the deep model, stack by stack."""
        named = [(x, name_of(x)) for x in seq]
        for prefix, index, layers in stacks:
            named = [(x, name) for (x, _), name in _renamed(named, lambda xn: xn[1], index, prefix,
                                                             depth, layers, p)]
        return named

    segments = [dataclasses.replace(s, unit=name) for s, name in renamed(small.segments, lambda s: s.unit)]
    collectives = [(c[0], name, c[2]) for c, name in renamed(small.collectives, lambda c: c[1])]
    units = [dataclasses.replace(u, name=name, fqn=re.sub(r"\d+$", _BLOCK.match(name).group(2), u.fqn)
                                 if _BLOCK.match(name) else u.fqn)
             for u, name in renamed(small.units, lambda u: u.name)]
    return StepTrace(model=spec.name, precision=small.precision, ac=small.ac, batch=small.batch,
                     seq=small.seq, world=small.world, largest_unit_shard=small.largest_unit_shard,
                     segments=segments, units=units, collectives=collectives, trace_s=0.0,
                     layers=layers_of(spec), backward_collectives_from=len(renamed(
                         small.collectives[:small.backward_collectives_from], lambda c: c[1])),
                     **memory)


def extended(spec, small: StepTrace, samples: MemorySamples, depth: int, p: int) -> StepTrace | None:
    """A deep model from one trace at ``depth`` blocks: its memory events extended block by block
    (``_extended_events``) and replayed for the peak, each unit's states summed, its ops repeated.
    None where the replay of the trace itself is not the tracker's peak, or the blocks differ."""
    stacks = _stacks(spec, small.units)
    if stacks is None or small.memory_events.peak() != {k: v for k, v in small.peak.items() if v}:
        return None
    events, places = small.memory_events, samples.event_places
    times = dict.fromkeys(small.unit_states, 1)  # how many of each unit the deep model holds
    for _, index, layers in stacks:  # one stack at a time, the others' blocks as the root's work
        periods = _periods(index, p)
        copies = (layers - 2 * EDGE_BLOCKS * p) // p
        extension = _extended_events(events, places, periods, depth // p, copies)
        if extension is None:
            return None
        events, places = extension
        for unit in times:
            if _role(unit, periods, depth // p) == "middle":
                times[unit] = copies
    states = {k: 0 for k in small.states}
    for unit, held in small.unit_states.items():
        for k in states:
            states[k] += held[k] * times[unit]
    peak = dict.fromkeys(small.peak, 0)  # the tracker's categories, zeros included
    peak.update(events.peak())
    return _repeated(spec, small, depth, p, peak=peak, states=states, memory_events=events,
                     traced_layers=(depth,))


def ops_extended(spec, small: StepTrace, depth: int, p: int) -> StepTrace | None:
    """A deep model's ops, collectives and units from one trace at ``depth`` blocks (the middle
    repeated, ``_repeated``), without its memory (``peak`` and ``states`` empty, no events): what
    the time model reads. None where the blocks are not named in order."""
    return _repeated(spec, small, depth, p, peak={}, states={}, memory_events=None,
                     traced_layers=(depth,))


def checked(spec, small: StepTrace, small_samples: MemorySamples, large: StepTrace,
            depths: tuple[int, int]) -> StepTrace | None:
    """``extended`` for a model of several stacks (T5), whose blocks work for blocks beyond their
    neighbours (the decoder's first block computes the attention bias every block reads): the
    extension is trusted only where, extended to the larger depth instead, it is that depth's
    trace (``large``) to the byte: the peak, the states and the allocator's replay."""
    p = depths[1] - depths[0]
    check = extended(with_layers(spec, depths[1]), small, small_samples, depths[0], p)
    offloaded = frozenset({"Sharded Param", "OptState"})
    if check is None or any(getattr(check, k) != getattr(large, k) for k in ("peak", "states")) or any(
            check.reserved(without) != large.reserved(without) for without in (frozenset(), offloaded)):
        return None
    scaled = extended(spec, small, small_samples, depths[0], p)
    if scaled is not None:
        scaled.traced_layers = depths
    return scaled


def linearly_scaled(spec, small: StepTrace, small_samples: MemorySamples, large: StepTrace,
           large_samples: MemorySamples, depths: tuple[int, int]) -> StepTrace | None:
    """A deep model from two traces: each memory sample extended linearly (``_scaled_peak``), the
    states and the allocator's replay too; the ops of the smaller repeated."""
    p = depths[1] - depths[0]
    named_small, named_large = _block_index(small.units), _block_index(large.units)
    if named_small is None or named_large is None:
        return None
    factor = (layers_of(spec) - depths[0]) / p
    peak = _scaled_peak(small_samples, large_samples, _periods(named_small[1], p),
                        _periods(named_large[1], p), (depths[0] // p, depths[1] // p), factor)
    if peak is None:
        return None
    states = {k: int(round(small.states[k] + factor * (large.states[k] - small.states[k])))
              for k in small.states}
    return _repeated(spec, small, depths[0], p, peak=peak, states=states, traced_layers=depths,
                     memory_events=MemoryEvents(linear=(small.memory_events, large.memory_events,
                                                        factor)),
                     reserved_scaled_linearly=True)


def _extended_events(events: MemoryEvents, places, index, depth: int, copies: int
                     ) -> tuple[MemoryEvents, list] | None:
    """The memory events of the step at ``depth`` periods of blocks (``index``: each block's
    period) extended to a deep model: the middle period's events (allocations, frees, category
    changes, the tracker's samples) repeated ``copies`` times, once per middle period of the
    deep model, in ascending order after the first blocks and descending after the last; with each
    event's place (unit, phase). Blocks ``index`` does not name count as the root's work.

    Each allocation belongs to the block whose work made it (the root's work between two blocks
    belongs with the block before it) and is known by its rank among that block's allocations, so
    the same allocation of another block is found: an event of the n-th middle copy that refers
    to what the block before made refers to copy n - 1's (block 1's for the first), what the block
    after made to copy n + 1's; an event outside the middle refers to the copy beside it. None
    where the blocks' allocations differ."""
    units = [u for u, _ in places]
    roles = [r[1] if isinstance(r, tuple) else r for r in _roles(units, index, depth)]
    roles = ["root" if r == "start" else r for r in roles]
    tagged, sizes = _tagged(events.step, roles)
    # block 1 may differ in size where it works for block 0 (prefetching T5's relative attention
    # bias with it), not in its count of allocations
    middle = sizes.get("middle")
    if middle is None or sizes.get(-2) != middle or len(sizes.get(1, ())) != len(middle):
        return None

    def mapped(ident, copy, side):
        """The deep model's name of allocation ``ident`` as seen from ``copy`` of the middle
        (None: outside it, on ``side`` 0 = before the middle, 1 = after)."""
        block, rank = ident
        if copy is None:
            return ("middle", rank, 0 if side == 0 else copies - 1) if block == "middle" else ident
        if block == "middle":
            return ("middle", rank, copy)
        if block == 1:
            return ident if copy == 0 else ("middle", rank, copy - 1)
        if block == -2:
            return ident if copy == copies - 1 else ("middle", rank, copy + 1)
        return ident

    def emit(out, i, copy, side):
        kind, ident, n, category, previous = tagged[i]
        if kind == "sample":
            out.append(("sample", None, 0, None))
        elif kind == "alloc":
            if previous is not None:  # re-allocated in place: the old block goes first
                out.append(("free", mapped(previous, copy, side), 0, category))
                out_places.append(places[i])
            name = ("middle", ident[1], copy) if copy is not None else ident
            out.append(("alloc", name, n, category))
        elif ident is not None:
            out.append((kind, mapped(ident, copy, side), 0, category))
        else:
            return
        out_places.append(places[i])

    step: list[tuple[str, Any, int, str | None]] = []
    out_places: list = []
    side, i = 0, 0
    while i < len(tagged):
        if roles[i] != "middle":
            if roles[i] in (-2, -1):
                side = 1
            elif roles[i] in (0, 1):
                side = 0
            emit(step, i, None, side)
            i += 1
            continue
        j = i
        while j < len(tagged) and roles[j] == "middle":
            j += 1
        for copy in (range(copies) if side == 0 else range(copies - 1, -1, -1)):
            for k in range(i, j):
                emit(step, k, copy, None)
        i = j
    return MemoryEvents(resident=_extended_resident(events.resident, index, depth, copies),
                        step=step, device_type=events.device_type), out_places


def _tagged(step_events, roles) -> tuple[list, dict[Any, list[int]]]:
    """Each event as (kind, identity, bytes, category, the identity an alloc replaces), an
    allocation's identity its block's role and its rank among that block's allocations; and each
    block's allocation sizes in order."""
    owner: dict[Any, tuple[Any, int]] = {}  # key -> (block, rank) of its current allocation
    count: dict[Any, int] = {}
    sizes: dict[Any, list[int]] = {}
    tagged = []  # (kind, identity, bytes, category, the identity an alloc replaces)
    for (kind, key, n, category), role in zip(step_events, roles):
        if kind == "alloc":
            previous = owner.get(key)
            rank = count[role] = count.get(role, -1) + 1
            sizes.setdefault(role, []).append(n)
            owner[key] = (role, rank)
            tagged.append(("alloc", (role, rank), n, category, previous))
        elif kind == "free":
            tagged.append(("free", owner.pop(key, None), 0, category, None))
        else:  # "ref" (of a live allocation) or "sample"
            tagged.append((kind, owner.get(key) if kind == "ref" else None, 0, category, None))
    return tagged, sizes


def _extended_resident(resident_events, index, depth: int, copies: int) -> list:
    """What a step begins with, the middle period's entries repeated ``copies`` times as a group."""
    resident, i = [], 0
    while i < len(resident_events):
        j = i + 1
        if _role(resident_events[i][0], index, depth) == "middle":
            while j < len(resident_events) and _role(resident_events[j][0], index,
                                                     depth) == "middle":
                j += 1
            resident += resident_events[i:j] * copies
        else:
            resident.append(resident_events[i])
        i = j
    return resident
