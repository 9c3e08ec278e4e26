"""What ``torch.compile`` per block saves for backward, traced on the fake step (``plan --compile``).

Eager autograd saves, op by op, what each op's backward formula needs: a SwiGLU MLP keeps SiLU's
input and output, the product's two factors, RMSNorm's fp32 upcast and its normalized output. A
compiled region's backward is one graph, and AOTAutograd's min-cut partitioner
(``torch._functorch.partitioners.min_cut_rematerialization_partition``) chooses what crosses from
its forward to its backward: the set of forward tensors of fewest bytes from which backward can
compute everything it needs, where matmuls, attention, collectives, random ops and ops whose output
is 4x smaller than their inputs (reductions) cannot be recomputed, nor a tensor a matmul or
attention reads (its backward reads it again in a kernel of its own, so recomputing it is not
free: ``ban_recompute_materialized_backward``), and every other op (pointwise, casts) can, inside
the region. Pointwise outputs recomputable from what is saved anyway are not saved: they are
recomputed in backward (fused into its kernels): SiLU's output, RMSNorm's fp32 upcast; the
SwiGLU product and the normalized inputs of the projections stay saved.

``CompiledRegions`` traces that on the fake step. Each block that runs uncheckpointed is a region
(torchtitan compiles per block; accelerate's regional compile too): while its forward runs, a
dispatch mode records each op's inputs and outputs (by storage) and a ``saved_tensors_hooks``
receives what autograd saves. When the forward returns, ``min_cut`` takes the recorded graph: its
source what cannot be recomputed (the region's inputs, the parameters at no cost, the outputs of
the ops above), its sink what eager saved, each tensor's bytes the capacity of cutting it. The
eager-saved tensors the cut leaves out are dropped (their memory freed as the region returns;
in backward each is recreated as a temporary of its shape when autograd unpacks it: the recompute),
and the tensors the cut holds that eager did not (a block's bf16 input in place of its fp32
upcast) are held until the region's backward has used the dropped ones.

What it leaves out: inductor's fusion inside the forward (a pointwise chain's intermediates are
never materialized; here they are allocated and freed as eager does, which the allocated peak at
the start of backward does not see, but the reserved model's cached blocks can), the partitioner's
tie-breaking weights (``dist_from_bw``), and checkpointed blocks: under ``--ac`` the checkpoint's
own hooks take the saves and the compiled region's choice is not traced (the plan says so).
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from utilities.measure.op_recorder import MEMORY, classify_op

COMPILE_MEMORY_NOTE = (
    "--compile: memory as torch.compile per block saves it (AOTAutograd's min-cut partitioner, "
    "traced): within each uncheckpointed block, the pointwise outputs eager autograd saves "
    "(SiLU's, RMSNorm's fp32 upcast) that can be recomputed from tensors saved anyway (matmul "
    "and attention outputs and their inputs, small reductions, the block's input) are not saved "
    "but recomputed in backward")


def compile_note(regions: list[dict[str, Any]], ac: str) -> str:
    """The plan's note: what compiling the blocks changed in the saved activations."""
    if not regions:
        return (COMPILE_MEMORY_NOTE + f"; under --ac {ac} every block is checkpointed: the "
                "checkpoint's saves are kept as eager keeps them (what a compiled checkpointed "
                "region saves is not traced)")
    r = regions[len(regions) // 2]
    mib = 2**20
    ops = ", ".join(sorted(r["recomputed_ops"]))
    return (COMPILE_MEMORY_NOTE + f"; per block {r['saved_eager'] / mib:,.1f} MiB saved eager -> "
            f"{r['saved_compiled'] / mib:,.1f} MiB compiled (recomputed: {ops or 'nothing'}). "
            "Not modelled: inductor's fusion of forward temporaries; checkpointed blocks")


@dataclass
class _Node:
    nbytes: int
    banned: bool  # cannot be recomputed: the region's input, a matmul's output, ...
    op: str  # the op that made it ("" for the region's inputs)
    ref: Any  # a weak reference to a tensor on its storage
    param: bool = False


class _Saved:
    """What autograd holds for one saved tensor: the tensor, or once the partitioner drops it, its
    shape (recreated as a temporary when backward unpacks it) and what its recompute needs."""

    __slots__ = ("tensor", "node", "meta", "keep", "fake_mode")

    def __init__(self, tensor, node: int | None, fake_mode):
        self.tensor = tensor
        self.node = node
        self.meta = None
        self.keep = None
        self.fake_mode = fake_mode

    def drop(self, keep: list) -> None:
        t = self.tensor
        self.meta = (tuple(t.shape), tuple(t.stride()), t.dtype, t.device)
        self.tensor, self.keep = None, keep

    def unpack(self):
        if self.tensor is not None:
            return self.tensor
        shape, stride, dtype, device = self.meta
        with self.fake_mode:
            return torch.empty_strided(shape, stride, dtype=dtype, device=device)


def _storage_key(t):
    from torch.multiprocessing.reductions import StorageWeakRef

    try:
        return StorageWeakRef(t.untyped_storage())
    except (RuntimeError, NotImplementedError, TypeError):
        return None


@dataclass
class _Region:
    """One compiled region's forward: its ops' graph (by storage) and what autograd saved."""

    params: set
    fake_mode: Any
    nodes: list[_Node] = field(default_factory=list)
    edges: list[tuple[int, int]] = field(default_factory=list)
    latest: dict = field(default_factory=dict)  # storage -> its node now
    saved: list[_Saved] = field(default_factory=list)

    def node_of(self, t) -> int | None:
        key = _storage_key(t)
        if key is None:
            return None
        n = self.latest.get(key)
        if n is None:  # made outside the region: its input, a parameter, a constant
            n = self.latest[key] = len(self.nodes)
            self.nodes.append(_Node(t.untyped_storage().nbytes(), True, "", weakref.ref(t),
                                    param=key in self.params))
        return n

    def op(self, func, kind: int, args, kwargs, out) -> None:
        ins = [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        outs = [x for x in tree_leaves(out) if isinstance(x, torch.Tensor)]
        sources = {n for n in (self.node_of(x) for x in ins) if n is not None}
        in_keys = {_storage_key(x) for x in ins}
        in_bytes = sum(self.nodes[n].nbytes for n in sources)
        name = func.__name__.split(".")[0]
        random = torch.Tag.nondeterministic_seeded in func.tags
        for t in outs:
            key = _storage_key(t)
            if key is None or key in in_keys:  # in place, or a view of an input
                continue
            nbytes = t.untyped_storage().nbytes()
            banned = kind != MEMORY or random or 4 * nbytes < in_bytes
            n = self.latest[key] = len(self.nodes)
            self.nodes.append(_Node(nbytes, banned, name, weakref.ref(t)))
            self.edges += [(s, n) for s in sources]
        if kind != MEMORY:  # its backward reads its inputs in a kernel of its own: materialized
            for s in sources:
                self.nodes[s].banned = True

    def pack(self, t):
        saved = _Saved(t, self.node_of(t) if isinstance(t, torch.Tensor) else None, self.fake_mode)
        self.saved.append(saved)
        return saved

    def partition(self) -> dict[str, Any]:
        """Drop what the min cut does not save; hold what it saves that eager did not."""
        eager = {s.node for s in self.saved if s.node is not None}
        compiled = min_cut(self.nodes, self.edges, eager)
        dropped, held = eager - compiled, compiled - eager
        keep: list = []
        for n in held:
            node = self.nodes[n]
            if node.param:
                continue
            t = node.ref()
            if t is None:  # freed by eager already: a stand-in of its bytes, as compile keeps it
                with self.fake_mode:
                    t = torch.empty(node.nbytes, dtype=torch.uint8,
                                    device=next(iter(s.tensor.device for s in self.saved
                                                     if s.tensor is not None)))
            keep.append(t)
        for s in self.saved:
            if s.node in dropped:
                s.drop(keep)

        def total(ns):
            return sum(self.nodes[n].nbytes for n in ns if not self.nodes[n].param)

        return {"saved_eager": total(eager), "saved_compiled": total(compiled),
                "recomputed_bytes": total(dropped), "held_bytes": total(held),
                "recomputed_ops": sorted({self.nodes[n].op for n in dropped}),
                "saved_ops": sorted({self.nodes[n].op or "input" for n in compiled})}


def min_cut(nodes: list[_Node], edges: list[tuple[int, int]], needed: set[int]) -> set[int]:
    """The tensors a compiled region saves: the cheapest set (by bytes, parameters free) that
    separates what cannot be recomputed (``_Node.banned``) from what backward ``needed``, as
    AOTAutograd's partitioner cuts its joint graph (each tensor an in -> out edge of its bytes)."""
    import networkx as nx

    g = nx.DiGraph()
    for n, node in enumerate(nodes):
        g.add_edge(("in", n), ("out", n), capacity=0 if node.param else node.nbytes)
        if node.banned:
            g.add_edge("source", ("in", n))
    for a, b in edges:
        g.add_edge(("out", a), ("in", b))
    for n in needed:
        g.add_edge(("out", n), "sink")
    if not needed:
        return set()
    _, (reach, _) = nx.minimum_cut(g, "source", "sink")
    return {n for n in range(len(nodes)) if ("in", n) in reach and ("out", n) not in reach}


class CompiledRegions:
    """The blocks of ``model`` that run uncheckpointed, each traced as a compiled region: enter
    ``mode`` (a dispatch mode) around the step; ``regions`` holds each region's forward's
    figures (bytes saved eager and compiled, what was recomputed)."""

    def __init__(self, model, block_class, fake_mode):
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
        from torch.utils._python_dispatch import TorchDispatchMode

        self.fake_mode = fake_mode
        self.active: _Region | None = None
        self.regions: list[dict[str, Any]] = []
        inside_checkpoint = {id(m) for w in model.modules() if isinstance(w, CheckpointWrapper)
                             for m in w.modules()}
        for block in model.modules():
            if isinstance(block, block_class) and id(block) not in inside_checkpoint:
                block.forward = functools.partial(self._region, block, block.forward)
        kinds: dict = {}
        regions = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                region = regions.active
                if region is not None:
                    kind = kinds[func] if func in kinds else kinds.setdefault(func, classify_op(func))
                    if kind is not None:
                        region.op(func, kind, args, kwargs or {}, out)
                return out

        self.mode = Mode()

    def _region(self, block, forward, *args, **kwargs):
        if self.active is not None or not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        params = {_storage_key(p) for p in block.parameters()}
        region = self.active = _Region(params, self.fake_mode)
        try:
            with torch.autograd.graph.saved_tensors_hooks(region.pack, _Saved.unpack):
                out = forward(*args, **kwargs)
        finally:
            self.active = None
        self.regions.append(region.partition())
        return out
