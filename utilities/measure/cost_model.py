"""The time model's costs: the roofline time of a traced segment's ops, NCCL's time of a
collective, and the optimizer step's.

``segment_time``: per op ``max(flops / (peak x efficiency), bytes / (HBM bandwidth x
efficiency))`` on a GPU of the catalogue (``utilities.measure.gpu_catalogue``), with torch.compile's fusion
and Float8's GEMMs. ``collective_time``: NCCL's own tuning model, a ring (or a tree for an
all-reduce across nodes) over NVLink inside a node and the network across nodes.
``with_tp_collectives``: the TP and CP collectives a trace recorded, added to the compute that
waits for them. ``optimizer_time``: AdamW over a rank's trainable shard, on the GPU or the host.
"""

from __future__ import annotations

import numpy as np

from utilities.measure.gpu_catalogue import GPU, HOST_ADAMW_PARAMS_PER_S, Efficiencies
from utilities.measure.op_recorder import ATTENTION, FSDP_COPY, MATMUL, MEMORY, Segment, UnitInfo


def segment_time(seg: Segment, gpu: GPU, eff: Efficiencies, precision: str, compile: bool,
                 fp8: bool, fsdp_copies: bool = True, tf32: bool = False) -> float:
    """Roofline time of a segment's ops on ``gpu``: per op, the slower of its FLOPs at the
    (efficiency-scaled) peak and its bytes at the (efficiency-scaled) HBM bandwidth."""
    clock = gpu.clock_factor
    bf16 = gpu.peak_flops["bf16"] * clock
    fp32_peak = gpu.peak_flops["tf32" if tf32 else "fp32"] * clock
    mm_peak = np.where(seg.fp32, fp32_peak, bf16) * eff.matmul
    bw = gpu.hbm_bytes_per_s * eff.memory
    flops_t = np.zeros_like(seg.flops)
    is_mm = seg.kind == MATMUL
    flops_t[is_mm] = seg.flops[is_mm] / mm_peak[is_mm]
    is_attn = seg.kind == ATTENTION
    flops_t[is_attn] = seg.flops[is_attn] / (bf16 * eff.attention)
    mem_t = seg.nbytes / bw
    extra = 0.0
    if fp8 and "fp8" in gpu.peak_flops and precision != "fp32":
        conv = seg.fp8_ok
        flops_t[conv] = seg.flops[conv] / (gpu.peak_flops["fp8"] * clock * eff.fp8_matmul)
        mem_t[conv] = seg.nbytes[conv] / 2 / bw  # FP8 operands: half the bytes
        # dynamic tensorwise scaling: an amax pass and a cast of each operand (read 2 + 2,
        # write 1 byte per bf16 byte pair), memory-bound, fused like any elementwise op
        cast = float(seg.nbytes[conv].sum()) * 1.25 / bw
        extra = cast * (eff.compile_memory if compile and seg.unit != "root" else 1.0)
    t = np.maximum(np.maximum(flops_t, mem_t), eff.kernel_floor_s)
    if compile and seg.unit != "root":  # compiled per block, as torchtitan and the course do
        # Inductor fuses each run of consecutive memory-bound ops (between two GEMMs, attention
        # or FSDP copies) into one kernel: one launch, and only the run's inputs and outputs
        # cross HBM (compile_memory of the eager bytes), not its intermediates
        mem = seg.kind == MEMORY
        if mem.any():
            run = np.cumsum(~mem)[mem]
            _, first = np.unique(run, return_index=True)
            run_bytes = np.add.reduceat(seg.nbytes[mem], first)
            extra += float(np.maximum(run_bytes * eff.compile_memory / bw, eff.compile_floor_s).sum())
            t = np.where(mem, 0.0, t)
    if not fsdp_copies:
        t = np.where(seg.kind == FSDP_COPY, 0.0, t)
    return float(t.sum()) + extra


def ring_bytes_per_gpu(kind: str, total_bytes: float, n: int) -> float:
    """Bytes each GPU sends (and receives) in an NCCL ring: all-gather and reduce-scatter move
    (n - 1) / n of the full buffer, all-reduce twice that."""
    if n <= 1:
        return 0.0
    share = (n - 1) / n * total_bytes
    return 2 * share if kind == "all_reduce" else share


def collective_time(kind: str, total_bytes: float, n: int, gpu: GPU, eff: Efficiencies,
                    gpus_per_node: int, network_gbps: float) -> float:
    """Time of one NCCL collective over ``n`` ranks whose full buffer is ``total_bytes``, as NCCL's
    own tuning model charges it (nccl src/graph/tuning.cc, Simple protocol; the model torch's
    ``_inductor/comm_analysis.py`` adapts). Ring: a base latency, then per step the intra-node
    hop latency, except the ``nNodes - 1`` steps (``2 (nNodes - 1)`` for all-reduce) that cross a
    node boundary, which pay the network's; on a ring that spans nodes each intra-node step costs
    at least NCCL's network overhead (3 x 1 us, x86). Bandwidth: (n - 1) / n of the buffer (twice
    for all-reduce) over the group's slowest link, NVLink inside a node, else each GPU's share of
    the network (comm_analysis's correction of NCCL's ``nNodes <= 2`` bandwidth choice).
    All-reduce across nodes: NCCL's tree where it predicts less time (latency ``2 ((ppn - 1) x
    intra + log2(nNodes) x net)``, bandwidth 0.92 x 1/2 of the bus bandwidth)."""
    if n <= 1:
        return 0.0
    ppn = min(n, gpus_per_node)
    nodes = -(-n // ppn)
    reps = 2 if kind == "all_reduce" else 1
    steps = (n - 1) * reps
    intra = eff.hop_latency_link_s if gpu.link == "NVLink" else eff.hop_latency_pcie_s
    if nodes > 1:
        bw = network_gbps * 1e9 / 8 * eff.network
        inter_steps = (nodes - 1) * reps
        intra = max(intra, eff.net_overhead_s)
    else:
        bw = gpu.link_bytes_per_s * eff.link
        inter_steps = 0
    ring = (eff.base_latency_s + (steps - inter_steps) * intra + inter_steps * eff.hop_latency_network_s
            + ring_bytes_per_gpu(kind, total_bytes, n) / bw)
    if kind != "all_reduce" or nodes == 1:
        return ring
    tree_intra = eff.tree_latency_link_s if gpu.link == "NVLink" else eff.hop_latency_pcie_s
    levels = max(1, nodes.bit_length() - 1)  # NCCL's log2i: floor(log2(nNodes))
    tree = (eff.base_latency_s + 2 * ((ppn - 1) * tree_intra + levels * eff.tree_latency_network_s)
            + total_bytes / (bw * 0.92 * 0.5))
    return min(ring, tree)


def trainable_shard_numel(u: UnitInfo, n: int) -> int:
    """Elements per rank of the unit's trainable parameters (all of them when none is frozen)."""
    if u.trainable is None or all(u.trainable):
        return u.shard_numel(n)
    return UnitInfo(u.name, [s for s, t in zip(u.shapes, u.trainable) if t], u.is_root).shard_numel(n)


def ag_item_bytes(precision: str) -> int:
    return 4 if precision == "fp32" else 2


def optimizer_bytes(trained_shard: int, po) -> int:
    """AdamW's memory traffic over the trainable shard: 32 bytes per parameter in fp32 storage,
    16 in bf16."""
    return (16 if po.param_dtype == "bf16" else 32) * trained_shard


def optimizer_time(trained_shard: int, po, g: GPU, eff: Efficiencies) -> float:
    """AdamW over the trainable shard: on the GPU at HBM speed (``optimizer_bytes``), or with
    --offload on the host CPU, one thread per rank (``HOST_ADAMW_PARAMS_PER_S``)."""
    if po.offload:
        return trained_shard / HOST_ADAMW_PARAMS_PER_S[po.param_dtype or "fp32"]
    return optimizer_bytes(trained_shard, po) / (g.hbm_bytes_per_s * eff.memory)


TP_COLLECTIVES = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
                  "all_reduce": "all_reduce"}  # the functional collectives DTensor (TP) issues


def with_tp_collectives(plan_segs, profile, tp, g, eff, gpus_per_node, network_gbps, cp=1):
    """``plan_segs`` with the TP collectives the trace recorded (DTensor's functional all-gathers,
    reduce-scatters, all-reduces inside each tp group; FSDP2's own are c10d's) and CP's (named
    ``cp:<op>``, over each cp group: K/V all-gathers, dK/dV passes to the next rank) added to
    the compute of the unit and phase that issued them: eager TP waits for them on the compute
    stream, and CP is put there too (``cp_assumption``)."""
    from utilities.measure.context_parallel import CP_PREFIX

    seconds: dict[tuple[str, str], dict[str, float]] = {}
    for i, (op, unit, nbytes) in enumerate(profile.collectives):
        group, n = ("cp", cp) if op.startswith(CP_PREFIX) else ("tp", tp)
        op = op.removeprefix(CP_PREFIX)
        kind = TP_COLLECTIVES.get(op)
        if group == "cp" and op == "all_to_all_single":  # a pass to the next rank: one ring step
            secs = collective_time("all_gather", 2 * nbytes, 2, g, eff, gpus_per_node, network_gbps)
        elif kind is None:
            continue
        else:
            total = nbytes * n if kind == "all_gather" else nbytes  # the input is one rank's part
            secs = collective_time(kind, total, n, g, eff, gpus_per_node, network_gbps)
        stage = "forward" if i < profile.backward_collectives_from else "backward"
        waits = seconds.setdefault((unit, stage), {})
        waits[f"{group}_comm_s"] = waits.get(f"{group}_comm_s", 0.0) + secs
    out = []
    for unit, phase, secs, args in plan_segs:
        waits = seconds.pop((unit, "forward" if phase == "forward" else "backward"), {})
        out.append((unit, phase, secs + sum(waits.values()), dict(args, **waits) if waits else args))
    return out
