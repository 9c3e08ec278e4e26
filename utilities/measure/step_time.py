"""How long one FSDP training step takes on N GPUs, predicted on a laptop.

``estimate_step_time("llama-8b", gpus=8, ac="selective", batch=2, seq=8192, gpu="h100-96gb")``
returns a ``StepTime``: the step time, its compute, its communication, the part of the
communication that compute does not hide (*exposed*), tokens/s per GPU, MFU and a per-unit
timeline. Three parts, each stated in ``StepTime.assumptions``:

1. **Compute, traced.** One training step (forward, backward, activation-checkpointing recompute)
   of the real model, the one ``fsdp-course plan`` traces for memory (``fake_step.trace``: the
   fake process group, ``FakeTensorMode``, the real ``fully_shard`` units), under a
   ``TorchDispatchMode`` that records every ATen op: its FLOPs (``torch.utils.flop_counter``'s
   formulas; attention as FlashAttention does it), the bytes it reads and writes, and the FSDP unit
   running it (``ModTracker``). Each op takes the roofline time
   ``max(flops / (peak x efficiency), bytes / (HBM bandwidth x efficiency))`` on the chosen GPU
   (``GPUS``), with one set of efficiencies (``CALIBRATED``). Per-rank compute is one node's trace
   of the strategy (beyond a node only FSDP's 1/N copy-in would change), cached: a plan of one
   node reads the very trace its memory came from, and a sweep traces once per strategy.
2. **Communication, from the shards.** Per unit: the all-gather of its parameters in the mixed
   precision policy's parameter dtype, the reduce-scatter of its gradients in the reduce dtype
   (plus the all-reduce across replicas under hybrid_shard, or the gradients' all-reduce under
   no_shard), with FSDP2's per-parameter dim-0 shards padded to a multiple of the group. NCCL's
   own tuning model: a ring, ``base + intra-node steps x hop + (nNodes - 1) x network hop +
   (n - 1) / n x bytes / bandwidth``, over NVLink inside a node and the network across nodes;
   an all-reduce across nodes by NCCL's tree where that is faster (``collective_time``).
3. **The schedule.** Two lanes, compute and communication (collectives run one at a time, in the
   order they are issued). An all-gather is issued ``prefetch`` units ahead (FSDP2's implicit
   prefetching is one unit; 0 is none), a reduce-scatter when its unit's backward ends; a unit's
   compute waits for its all-gather; the optimizer step waits for the last reduce-scatter. FSDP1's
   ``backward_prefetch`` (BACKWARD_PRE / BACKWARD_POST / None) and ``limit_all_gathers`` are
   variants of the issue order. Exposed communication = step - compute.

The efficiencies are fitted by ``benchmarks/time_model_check.py --fit`` from fixed starting values
on the rows marked fit in ``benchmarks/time_model_rows.json`` (published runs and the course's own
H100 measurements, with the compile and Float8 effects of matched pairs); the rows marked held out
are never read by the fit, and the script reports the error on both. Each GPU part has its own
tensor-core fraction where a published run of it exists (``Efficiencies.per_gpu``).

The API (what ``fsdp-course plan`` builds on):

* ``estimate_step_time(model, gpus, strategy, precision, ac, batch, seq, gpu="h100",
  gpus_per_node=8, network_gbps=400, compile=False, fp8=False, prefetch=1, ...) -> StepTime``;
* ``StepTime.as_dict()``: ``{step_s, compute_s, comm_s, exposed_comm_s, tokens_per_s_per_gpu,
  mfu, assumptions}`` (``as_dict(timeline=True)`` adds the events);
* ``format_step_time(t, units=0)``: the table for a terminal, at most 80 columns;
* ``GPUS`` / ``get_gpu(name)``: the catalogue (``GPU.memory_bytes`` for a memory plan);
* ``sweep(model, gpu_counts, strategies, **kw)``: many configurations from one trace.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from utilities.errors import UsageError, bad_value
from utilities.measure.context_parallel import check_cp
from utilities.measure.fake_step import (
    ATTENTION,
    ATTENTION_BACKWARD,
    FSDP_COPY,
    MATMUL,
    MEMORY,
    STRATEGIES,
    Segment,
    StepConfig,
    UnitInfo,
    check_step,
    check_tp,
    trace,
)
from utilities.text import rate_text

__all__ = ["CALIBRATED", "Cluster", "Efficiencies", "Event", "GPU", "GPUS", "StepTime",
           "add_prediction_arguments", "check_prediction_arguments", "collective_time",
           "chrome_trace", "draw_timelines", "estimate_step_time", "format_predicted", "format_step_time",
           "get_gpu", "parse_cluster", "predict_from_arguments", "predict_variants",
           "predicted_batch_text", "predicted_rows", "ring_bytes_per_gpu", "sweep"]

BACKWARD_PREFETCH = ("backward_pre", "backward_post", "none")


# -- the GPU catalogue -----------------------------------------------------------------------------

@dataclass(frozen=True)
class GPU:
    """One GPU part: what the time model needs, dense (not 2:4 sparse) datasheet peaks."""

    name: str
    memory_bytes: int
    peak_flops: dict[str, float]  # dense FLOP/s: "fp32", "tf32", "bf16", "fp8" (absent: no FP8)
    hbm_bytes_per_s: float
    link_bytes_per_s: float  # per GPU, one direction, to the other GPUs of its node
    link: str  # "NVLink" or "PCIe"
    source: str
    clock_factor: float = 1.0  # sustained tensor-core clock vs the datasheet's, where it is capped
    notes: tuple[str, ...] = ()


_H100_PEAKS = {"fp32": 66.9e12, "tf32": 494.7e12, "bf16": 989.4e12, "fp8": 1978.9e12}
_A100_PEAKS = {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12}

GPUS: dict[str, GPU] = {g.name: g for g in (
    GPU("h100", 81559 * 2**20, _H100_PEAKS, 3.35e12, 450e9, "NVLink",
        "NVIDIA H100 SXM5 80GB datasheet (dense peaks: the datasheet's sparse figures / 2; NVLink "
        "900 GB/s total = 450 GB/s each way); memory as nvidia-smi reports it"),
    GPU("h100-96gb", 96 * 10**9, _H100_PEAKS, 2.4e12, 450e9, "NVLink",
        "H100 96GB HBM2e (torchtitan's Grand Teton part, anchors.md): 96 GB, 2.4 TB/s, 500 W "
        "power limit; peaks and NVLink as the NVIDIA H100 SXM5 datasheet (what it sustains at "
        "500 W: CALIBRATED.per_gpu, fitted on torchtitan's runs on it)"),
    GPU("h200", 143771 * 2**20, _H100_PEAKS, 4.8e12, 450e9, "NVLink",
        "NVIDIA H200 SXM datasheet (141 GB HBM3e, 4.8 TB/s, dense peaks as H100 SXM, NVLink "
        "900 GB/s total)"),
    GPU("a100-80gb", 81920 * 2**20, _A100_PEAKS, 2.039e12, 300e9, "NVLink",
        "NVIDIA A100 SXM4 80GB datasheet (2,039 GB/s, NVLink 600 GB/s total); no FP8"),
    GPU("a100-40gb", 40960 * 2**20, _A100_PEAKS, 1.555e12, 300e9, "NVLink",
        "NVIDIA A100 SXM4 40GB datasheet (1,555 GB/s, NVLink 600 GB/s total); no FP8"),
    GPU("l4", 23034 * 2**20, {"fp32": 30.3e12, "tf32": 60e12, "bf16": 121e12, "fp8": 242e12},
        300e9, 32e9, "PCIe",
        "NVIDIA L4 datasheet (24 GB GDDR6, 300 GB/s; no NVLink: PCIe Gen4 x16, 64 GB/s total)"),
)}


def get_gpu(name: str | GPU) -> GPU:
    if isinstance(name, GPU):
        return name
    key = str(name).strip().lower()
    if key not in GPUS:
        raise bad_value("--gpu", name, GPUS)
    return GPUS[key]


# -- the efficiencies ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Efficiencies:
    """The fractions of the datasheet peaks that kernels reach, and the interconnect's constants.
    One set for every model, GPU and configuration."""

    matmul: float  # GEMMs, fraction of the dense peak of their dtype
    attention: float  # fused (flash) attention, fraction of the bf16 dense peak
    memory: float  # memory-bound ops, fraction of the HBM bandwidth
    compile_memory: float  # torch.compile: memory-bound time left after fusion (fraction)
    fp8_matmul: float  # Float8 GEMMs, fraction of the FP8 dense peak
    kernel_floor_s: float  # the shortest kernel: launch and tail, or eager PyTorch's issue time
    link: float  # NCCL bus bandwidth / link bandwidth, inside a node
    network: float  # the same across nodes
    base_latency_s: float  # per collective
    hop_latency_link_s: float  # per ring step inside a node
    hop_latency_network_s: float  # per ring step when the ring spans nodes
    unit_overhead_s: float = 0.0  # FSDP's per-unit hooks, per forward and backward of each unit
    compile_floor_s: float = 2e-6  # torch.compile: the shortest fused kernel (one per run of ops)
    hop_latency_pcie_s: float = 5.7e-6  # per ring step inside a node over PCIe
    net_overhead_s: float = 3e-6  # least time per intra-node step of a ring that spans nodes
    tree_latency_link_s: float = 4.0e-6  # per tree level inside a node (all-reduce)
    tree_latency_network_s: float = 14e-6  # per tree level across nodes (all-reduce)
    per_gpu: dict[str, dict[str, float]] = field(default_factory=dict, compare=False)
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    def part(self, name: str) -> dict[str, float]:
        """``per_gpu``'s entry for part ``name`` (an extrapolated part's: its source part's)."""
        return dict(self.per_gpu.get(name, self.per_gpu.get(_EXTRAPOLATED_FROM.get(name, ""), {})))

    def for_gpu(self, name: str) -> Efficiencies:
        """The efficiencies on one GPU part. ``per_gpu[name]["tensor"]`` scales the tensor-core
        fractions (matmul, attention, fp8_matmul: the clock and power the part sustains against
        the reference H100 SXM's); its other keys replace fields outright."""
        over = self.part(name)
        if not over:
            return self
        t = over.pop("tensor", 1.0)
        changes = {"matmul": self.matmul * t, "attention": self.attention * t,
                   "fp8_matmul": self.fp8_matmul * t}
        changes.update(over)
        return replace(self, per_gpu={}, **changes)


# Parts without a published run of their own take another part's efficiencies (assumptions, say so)
_EXTRAPOLATED_FROM = {"a100-40gb": "a100-80gb"}

CALIBRATED = Efficiencies(
    matmul=0.626,
    attention=0.35,
    memory=0.95,
    compile_memory=0.239,
    fp8_matmul=0.518,
    kernel_floor_s=1.66e-5,
    link=370 / 450,
    network=0.80,
    base_latency_s=8.4e-6,
    hop_latency_link_s=3.4e-6,
    hop_latency_network_s=14e-6,
    unit_overhead_s=1.89e-3,
    compile_floor_s=0.5e-6,
    hop_latency_pcie_s=5.7e-6,
    net_overhead_s=3e-6,
    tree_latency_link_s=4.0e-6,
    tree_latency_network_s=14e-6,
    per_gpu={
        "h100-96gb": {"tensor": 0.834},
        "h200": {"tensor": 1.09},
        "a100-80gb": {"tensor": 1.19, "attention": 0.62, "link": 240 / 300},
    },
    sources={
        "matmul, memory, compile_memory, compile_floor_s, fp8_matmul, kernel_floor_s, "
        "unit_overhead_s, per_gpu tensor": "fitted by `python benchmarks/time_model_check.py "
        "--fit` from the fixed starting values in benchmarks/time_model_rows.json, on its rows "
        "marked fit only (least squares of log(predicted / published), and of the compile and "
        "Float8 effects of the matched pairs among them); the held-out rows are never read by the "
        "fit (benchmarks/results/time_model_check.json)",
        "per-GPU parts": "H100 SXM (h100) is the reference part: the course's plain-loop H100 runs "
        "and accelerate's 8x H100 SXM pair; h100-96gb (500 W): its tensor-core fraction fitted on "
        "torchtitan's Table 1 (8 GPUs) and torchao's pair; h200: fitted on Trainy's 4-node "
        "torchtitan run; a100-80gb: fitted on fms-fsdp's 128-A100 Llama 2 7B run; a100-40gb: "
        "extrapolated (a100-80gb's); l4: extrapolated (H100 SXM's)",
        "attention": "not fitted: FlashAttention-2 on H100 reaches about 350 of 989 TFLOP/s "
        "(the FlashAttention-3 paper's FA2 baseline, head dim 128); on A100 0.62, the middle of "
        "the FlashAttention-2 paper's 50-73% of the A100's peak (forward + backward)",
        "link": "NCCL's NVLink bus bandwidth (nccl src/graph/topo.h: 20.6 GB/s per link on sm90 x "
        "18 links = 370 GB/s of H100's 450; 20.0 x 12 = 240 GB/s of A100's 300)",
        "network": "assumed: 80% of the NIC's line rate for large messages",
        "latencies": "NCCL's Simple-protocol tuning constants (nccl src/graph/tuning.cc): base 8.4 "
        "us; ring 3.4 us per NVLink step, 5.7 us per PCIe step, 14 us per network step, network "
        "steps nNodes - 1 per ring (2 (nNodes - 1) for all-reduce), intra-node steps at least "
        "3 x the 1 us network overhead on a ring that spans nodes; tree (all-reduce only) 4.0 us "
        "per NVLink level, 14 us per network level, bandwidth x 0.92 x 1/2",
    },
)


# -- the trace -------------------------------------------------------------------------------------

# -- compute time ----------------------------------------------------------------------------------

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


# -- communication ---------------------------------------------------------------------------------

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


# -- the result ------------------------------------------------------------------------------------

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
class StepTime:
    """The predicted time of one training step on every rank (they run in lockstep)."""

    model: str
    gpus: int
    gpu: str
    strategy: str
    precision: str
    ac: str
    batch: int
    seq: int
    compile: bool
    fp8: bool
    step_s: float
    compute_s: float  # the compute lane's busy time, the optimizer step included
    comm_s: float  # the communication lane's busy time
    exposed_comm_s: float  # step - compute: compute waiting for communication
    optimizer_s: float
    tokens_per_s_per_gpu: float
    mfu: float  # tokens/s/GPU x flops per token (6N + 12 L H Q T) / the GPU's bf16 dense peak
    assumptions: list[str] = field(default_factory=list)
    timeline: list[Event] = field(default_factory=list)
    per_unit: dict[str, dict[str, float]] = field(default_factory=dict)
    trace_s: float = 0.0
    unit_fqns: dict[str, str] = field(default_factory=dict)  # unit -> its module's name in torch

    def as_dict(self, timeline: bool = False) -> dict[str, Any]:
        """The summary the CLI's ``--json`` carries (``timeline=True`` adds the events, with their
        args)."""
        keys = ("gpu", "step_s", "compute_s", "comm_s", "exposed_comm_s", "tokens_per_s_per_gpu",
                "mfu", "assumptions")
        out = {k: getattr(self, k) for k in keys}
        if timeline:
            out["timeline"] = [asdict(e) for e in self.timeline]
        return out


# The names torch.profiler shows for this work in a real FSDP2 step, so Perfetto lines a prediction
# up with a profiled run: FSDP2 wraps its collectives in record_function(self._with_fqn(NAME)) in
# torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py (unshard: "FSDP::all_gather";
# post_backward: "FSDP::post_backward_reduce", the reduce-scatter and HSDP's all-reduce), the
# unit's module FQN in parentheses, none for the root; torch/optim/optimizer.py names the step
# "Optimizer.step#AdamW.step". A unit's compute has no record_function of its own (it runs between
# "FSDP::pre_forward (UNIT)" and "FSDP::post_forward (UNIT)"): "forward (UNIT)" and so on.
TRACE_NAMES = {"all_gather": "FSDP::all_gather", "reduce_scatter": "FSDP::post_backward_reduce",
               "all_reduce": "FSDP::post_backward_reduce", "optimizer": "Optimizer.step#AdamW.step"}


def trace_name(e: Event, fqns: dict[str, str] | None = None) -> str:
    """The slice name of ``e`` in the predicted Chrome trace (``TRACE_NAMES``), its unit named as
    FSDP2 names it (the module's fully qualified name, ``fqns``: "model.layers.3")."""
    name = TRACE_NAMES.get(e.phase, e.phase)
    if e.unit == "all" or (e.unit == "root" and name.startswith("FSDP::")):
        return name
    return f"{name} ({(fqns or {}).get(e.unit) or e.unit})"


def chrome_trace(step: StepTime, title: str = "") -> dict[str, Any]:
    """The predicted step in the Chrome trace format (what ``torch.profiler``'s
    ``export_chrome_trace`` writes and Perfetto or chrome://tracing open): one process, a compute
    thread and a communication thread, one complete slice ("ph": "X", microseconds) per unit's
    forward, backward or optimizer step and per collective, named as a profiled FSDP2 step names
    them (``trace_name``), with the unit, the phase and the event's bytes, FLOPs and op count as
    args. A prediction, not a measurement: the process is named so."""
    name = title or (f"PREDICTED step: {step.model} on {step.gpus} x {step.gpu}, {step.strategy}, "
                     f"{step.precision}, batch {step.batch} x {step.seq}")
    lanes = {"compute": 0, "comm": 1}
    events: list[dict[str, Any]] = [
        {"ph": "M", "pid": 0, "tid": 0, "name": "process_name", "args": {"name": name}},
        {"ph": "M", "pid": 0, "tid": lanes["compute"], "name": "thread_name", "args": {"name": "compute"}},
        {"ph": "M", "pid": 0, "tid": lanes["comm"], "name": "thread_name",
         "args": {"name": "communication"}}]
    for e in step.timeline:
        events.append({"ph": "X", "pid": 0, "tid": lanes.get(e.lane, 1),
                       "name": trace_name(e, step.unit_fqns),
                       "cat": e.lane, "ts": e.start * 1e6, "dur": (e.end - e.start) * 1e6,
                       "args": {"unit": e.unit, "phase": e.phase, **e.args}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"what": "PREDICTED by the course's step-time model, not measured",
                          "step_s": step.step_s, "compute_s": step.compute_s, "comm_s": step.comm_s,
                          "assumptions": step.assumptions}}


# -- the schedule ----------------------------------------------------------------------------------

@dataclass
class _Coll:
    kind: str
    unit: str
    seconds: float
    nbytes: float
    args: dict[str, Any] = field(default_factory=dict)
    issue: float = 0.0
    start: float = 0.0
    end: float = 0.0


class _Lanes:
    """Two lanes: compute runs segments in order; communication runs collectives one at a time in
    the order they are issued (NCCL on one stream per direction, here one lane)."""

    def __init__(self):
        self.compute_free = 0.0
        self.comm_free = 0.0
        self.events: list[Event] = []

    def issue(self, c: _Coll, at: float) -> _Coll:
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


def _schedule(plan_segs, units, ag_fwd, ag_bwd, grad_colls, fwd_depth, bwd_mode, bwd_depth,
              limit_all_gathers, optimizer_s, optimizer_args=None):
    """Run the two lanes. ``plan_segs``: (unit, phase, seconds, args) in execution order; ``ag_fwd`` /
    ``ag_bwd``: unit -> all-gather (absent: none needed); ``grad_colls``: unit -> collectives
    after its backward. Returns the lanes."""
    lanes = _Lanes()
    fwd_order = [u.name for u in units]
    bwd_first: list[str] = []  # units in the order their backward-time compute starts
    last_bwd: dict[str, int] = {}
    for i, (u, ph, *_) in enumerate(plan_segs):
        if ph != "forward":
            if u not in bwd_first:
                bwd_first.append(u)
            last_bwd[u] = i
    issued: dict[tuple[str, str], _Coll] = {}
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


# -- the planner's options: offload copies, accumulation, reshard all-gathers, frozen parameters ----

# Host-device bandwidth per GPU, one direction: the PCIe link of the part (datasheet, theoretical).
PCIE_BYTES_PER_S = {"h100": 64e9, "h100-96gb": 64e9, "h200": 64e9, "a100-80gb": 32e9,
                    "a100-40gb": 32e9, "l4": 32e9}
PCIE_SOURCE = "PCIe Gen5 x16 (H100, H200) / Gen4 x16 (A100, L4): 64 / 32 GB/s each way per GPU"
# AdamW on the host, parameters per second per rank: torch.optim.AdamW (foreach=False, the default
# for CPU tensors) on ONE thread, because torchrun sets OMP_NUM_THREADS=1 for each process when
# --nproc-per-node > 1 (torch/distributed/run.py). Measured, not assumed: 64 M parameters in 64
# tensors, the best of 3 builds' median step, AMD EPYC (Zen 5) KVM guest, torch 2.13
# (benchmarks/plan_options_check.py --only host_adamw: fp32 0.325-0.34 G/s, bf16 0.80 G/s). A host
# with more threads per rank (OMP_NUM_THREADS set) is faster until the node's DRAM bandwidth binds.
HOST_ADAMW_PARAMS_PER_S = {"fp32": 0.33e9, "bf16": 0.80e9}
HOST_ADAMW_SOURCE = ("torch.optim.AdamW on one CPU thread per rank (torchrun's OMP_NUM_THREADS=1), "
                     "measured on an AMD EPYC (Zen 5) core, torch 2.13: "
                     + ", ".join(f"{k} {v / 1e9:.2f} G parameters/s"
                                 for k, v in HOST_ADAMW_PARAMS_PER_S.items()))


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


def accumulated_lanes(micro: _Lanes, last: _Lanes, n: int) -> _Lanes:
    """N micro-batches: N - 1 steps of ``micro`` (no optimizer; with or without their
    reduce-scatters) then ``last``, laid end to end."""
    out = _Lanes()
    span = max(e.end for e in micro.events)
    for k in range(n - 1):
        out.events += [replace(e, start=e.start + k * span, end=e.end + k * span) for e in micro.events]
    shift = (n - 1) * span
    out.events += [replace(e, start=e.start + shift, end=e.end + shift) for e in last.events]
    return out


def options_assumptions(po, g: GPU) -> list[str]:
    out = []
    if po.offload:
        out.append(f"--offload: host-device copies over {PCIE_SOURCE} (catalogue, theoretical), "
                   "each unit's shard before each all-gather and each gradient shard after its "
                   "reduce-scatter, on the communication lane; AdamW on the host CPU: "
                   f"{HOST_ADAMW_SOURCE}")
    if po.grad_accum > 1:
        out.append(f"--grad-accum {po.grad_accum}: {po.grad_accum - 1} micro-batch(es) without the "
                   "optimizer, then a full step; " + (
                       "a reduce-scatter per micro-batch" if po.accum_sync == "every" else
                       "one reduce-scatter, in the last micro-batch"))
    if po.reshard_after_forward is not None and not isinstance(po.reshard_after_forward, bool):
        out.append(f"--reshard-after-forward {po.reshard_after_forward}: backward all-gathers "
                   f"over groups of {po.reshard_after_forward} ranks")
    if po.frozen:
        out.append("frozen parameters: no weight gradients in the traced backward, no "
                   "reduce-scatter and no optimizer step for them")
    return out


# -- the public function ---------------------------------------------------------------------------

def estimate_step_time(model, gpus: int, strategy: str = "full_shard", precision: str = "bf16",
                       ac: str = "none", batch: int = 1, seq: int | None = None,
                       gpu: str | GPU = "h100", gpus_per_node: int = 8,
                       network_gbps: float = 400.0, compile: bool = False, fp8: bool = False,
                       prefetch: int = 1, backward_prefetch: str | None = None,
                       forward_prefetch: int | None = None, limit_all_gathers: bool = False,
                       shard_size: int | None = None, tf32: bool = False,
                       efficiencies: Efficiencies | None = None, plan_options=None,
                       tp: int = 1, cp: int = 1) -> StepTime:
    """Predict one training step of ``model`` (a name from ``utilities.models`` or a ``ModelSpec``)
    on ``gpus`` GPUs of kind ``gpu`` (``GPUS``), per-rank ``batch`` x ``seq`` tokens.

    Schedule knobs: ``prefetch`` is FSDP2's depth, forward and backward (1: FSDP2's default
    implicit prefetch of the next unit; 0: none; 2+: ``set_modules_to_*_prefetch`` further
    ahead); ``forward_prefetch`` overrides the forward depth. ``backward_prefetch`` picks FSDP1's
    backward order instead ("backward_pre": the next all-gather before this unit's compute, as
    FSDP2; "backward_post": after its compute, before its reduce-scatter; "none": after its
    reduce-scatter). ``limit_all_gathers``: FSDP1's rate limiter, at most two units' parameters
    gathered at once. ``strategy``: full_shard (re-gather in backward), shard_grad_op (keep the
    gathered parameters to the backward), hybrid_shard (shard within ``shard_size`` GPUs, default
    one node, all-reduce across the replicas), no_shard (DDP: all-reduce the gradients only).
    ``tf32``: fp32 matmuls on the TF32 tensor cores (``torch.backends.cuda.matmul.allow_tf32``;
    PyTorch's default, and the course's, is the FP32 peak). ``plan_options``: the planner's
    ``PlanOptions`` (offload copies and the host optimizer, accumulation's micro-batches,
    reshard_after_forward's all-gathers, frozen parameters' gradients, bf16 parameters).
    ``tp``: tensor parallelism inside groups of ``tp`` GPUs (2-D: FSDP across the groups); the
    trace runs TP's own ops and collectives (``parallelize.parallelize_model``), which block the
    compute lane; ``batch`` is one TP group's. ``cp``: context parallelism over groups of
    ``cp`` GPUs (each runs seq / cp of every sequence's tokens; FSDP over every GPU); the trace
    runs CP's K/V all-gathers and dK/dV passes (``context_parallel``), timed over the CP group on
    the compute lane; ``batch`` is one CP group's.
    """
    from utilities.measure.plan_options import PlanOptions

    po = plan_options or PlanOptions()
    from utilities.models import get_model_spec

    spec = get_model_spec(model) if isinstance(model, str) else model
    g = get_gpu(gpu)
    eff = (efficiencies or CALIBRATED).for_gpu(g.name)
    _check(gpus, strategy, precision, ac, batch, seq, gpus_per_node, network_gbps, prefetch,
           backward_prefetch, forward_prefetch)
    check_tp(spec, tp, gpus, strategy, po, gpus_per_node)
    seq = seq or spec.default_seq_len
    check_cp(spec, cp, gpus, strategy, seq, tp, po, gpus_per_node)
    if strategy == "hybrid_shard":
        shard_size = shard_size or min(gpus, gpus_per_node)
        if gpus % shard_size:
            raise bad_value("shard_size", shard_size, f"a divisor of gpus ({gpus})")
    elif shard_size is not None:
        raise bad_value("shard_size", shard_size, "only with strategy hybrid_shard")
    # Per-rank compute from one node's trace: for a plan of one node, the planner's own trace of
    # this configuration (one fake step serves memory and time). Beyond a node only FSDP's
    # copy-in (1/N of a unit) would change, so one trace serves every GPU count (a sweep). DDP
    # (no_shard) computes what an FSDP rank computes: the full_shard trace (the planner's 1-rank
    # stand-in for DDP casts each parameter on its own, which DDP does not); HSDP a shard group's.
    node = min(gpus, gpus_per_node)
    traced = strategy if strategy in ("full_shard", "shard_grad_op") else "full_shard"
    world = min(node, shard_size) if strategy == "hybrid_shard" else node
    profile = trace(spec, StepConfig(world, traced, precision, ac, batch, seq, "cuda", None, po, tp,
                                     cp=cp))
    notes = [f"GPU: {g.name}: {g.source}", *g.notes, _efficiency_note(g.name)]
    fp8_used = fp8 and "fp8" in g.peak_flops and precision != "fp32"
    if fp8 and not fp8_used:
        notes.append(f"--fp8 ignored: {g.name} has no FP8 tensor cores" if "fp8" not in g.peak_flops
                     else "--fp8 ignored with fp32 precision")

    # compute, per segment
    copies = strategy != "no_shard"
    plan_segs = [(s.unit, s.phase, segment_time(s, g, eff, precision, compile, fp8_used, copies,
                                                tf32),
                  {"flops": float(s.flops.sum()), "bytes": float(s.nbytes.sum()), "ops": len(s.kind)})
                 for s in profile.segments]
    if tp > 1 or cp > 1:
        plan_segs = _with_tp_collectives(plan_segs, profile, tp, g, eff, gpus_per_node,
                                         network_gbps, cp)
    if copies and eff.unit_overhead_s:
        seen: set[tuple[str, str]] = set()
        for i, (unit, phase, secs, args) in enumerate(plan_segs):
            key = (unit, "forward" if phase == "forward" else "backward")
            if key not in seen:
                seen.add(key)
                plan_segs[i] = (unit, phase, secs + eff.unit_overhead_s, args)

    # communication, per unit
    p_item = 4 if precision == "fp32" else 2
    r_item = 4 if precision == "fp32" else 2
    group = {"full_shard": gpus // tp, "shard_grad_op": gpus // tp,
             "hybrid_shard": shard_size or gpus, "no_shard": 1}[strategy]
    per_rank = group * tp  # a 2-D parameter: split over tp, then sharded over the group
    replicas = gpus // group if strategy == "hybrid_shard" else 1

    def coll(kind, unit, nbytes, n, per_node=gpus_per_node):
        return _Coll(kind, unit, collective_time(kind, nbytes, n, g, eff, per_node, network_gbps),
                     nbytes, {"bytes": nbytes, "bytes_per_gpu": ring_bytes_per_gpu(kind, nbytes, n),
                              "gpus": n})

    ag_fwd, ag_bwd, grads = {}, {}, {}
    for u in profile.units:
        shard = u.shard_numel(per_rank)
        if strategy == "no_shard":
            grads[u.name] = [coll("all_reduce", u.name, u.numel * r_item, gpus)]
            continue
        ag_item = p_item
        if fp8_used and not u.is_root:
            ag_item = 1  # FP8 all-gather of the Linear weights (norm weights stay bf16, ignored)
        full = shard * group
        if group > 1:
            ag_fwd[u.name] = coll("all_gather", u.name, full * ag_item, group)
            if strategy != "shard_grad_op" and not u.is_root:
                ag_bwd[u.name] = coll("all_gather", u.name, full * ag_item, group)
        grad_full = trainable_shard_numel(u, per_rank) * group
        gc = [coll("reduce_scatter", u.name, grad_full * r_item, group)] if group > 1 and grad_full else []
        if replicas > 1:
            gc.append(coll("all_reduce", u.name, trainable_shard_numel(u, group) * r_item,
                           replicas, per_node=1))
        grads[u.name] = gc

    # the optimizer step: AdamW over this rank's fp32 shard, memory-bound
    shard_total = sum(u.shard_numel(per_rank) if strategy != "no_shard" else u.numel
                      for u in profile.units)
    opt_bytes = 32 * shard_total  # read param, grad, 2 moments; write param, 2 moments; the clip's read
    optimizer_s = opt_bytes / (g.hbm_bytes_per_s * eff.memory)
    if not po.default:
        trained = sum(trainable_shard_numel(u, group) if strategy != "no_shard" else
                      trainable_shard_numel(u, 1) for u in profile.units)
        optimizer_s = optimizer_time(trained, po, g, eff)
        opt_bytes = optimizer_bytes(trained, po)
        ag_bwd = reshard_all_gathers(ag_bwd, ag_fwd, profile.units, group, po, ag_item_bytes(
            precision), coll)
        if po.offload:
            offload_copies(ag_fwd, ag_bwd, grads, profile.units, group, po, g)

    if backward_prefetch is not None:
        bwd_mode = backward_prefetch
        bwd_depth = 1 if backward_prefetch == "backward_pre" else 0
        fwd_depth = forward_prefetch if forward_prefetch is not None else (
            1 if limit_all_gathers else len(profile.units))
    else:
        bwd_mode, bwd_depth = "fsdp2", prefetch
        fwd_depth = prefetch if forward_prefetch is None else forward_prefetch
    lanes = _schedule(plan_segs, profile.units, ag_fwd, ag_bwd, grads, fwd_depth, bwd_mode,
                      bwd_depth, limit_all_gathers, optimizer_s, {"bytes": opt_bytes})
    if po.grad_accum > 1:
        micro = _schedule(plan_segs, profile.units, ag_fwd, ag_bwd,
                          grads if po.accum_sync == "every" else {}, fwd_depth, bwd_mode,
                          bwd_depth, limit_all_gathers, 0.0)
        lanes = accumulated_lanes(micro, lanes, po.grad_accum)

    compute_s = sum(e.end - e.start for e in lanes.events if e.lane == "compute")
    comm_s = sum(e.end - e.start for e in lanes.events if e.lane == "comm")
    step_s = max(e.end for e in lanes.events)
    # a TP (and CP) group's tokens per step, per GPU of the group
    tps = batch * seq * po.grad_accum / step_s / (tp * cp)
    if getattr(spec, "flops_from_trace", False):  # a model of yours: the FLOPs its traced ops do
        flops_per_token, counted = traced_flops_per_token(profile, batch * seq // cp), ""
    else:
        flops_per_token, counted = model_flops_per_token(spec, profile, seq)
    mfu = tps * flops_per_token / g.peak_flops["bf16"]
    per_unit: dict[str, dict[str, float]] = {}
    for e in lanes.events:
        d = per_unit.setdefault(e.unit, {})
        d[e.phase] = d.get(e.phase, 0.0) + (e.end - e.start)
    notes += _assumptions(strategy, precision, compile, fp8_used, gpus, gpus_per_node, network_gbps,
                          group, replicas, eff, g, bwd_mode, fwd_depth, bwd_depth,
                          limit_all_gathers, profile, tf32)
    notes += options_assumptions(po, g)
    if counted:
        notes.append(counted)
    if getattr(spec, "flops_from_trace", False):
        notes = [n for n in notes if not n.startswith("MFU: ")] + [TRACED_MFU_NOTE]
    if tp > 1:
        notes.append(f"tensor parallelism: {tp} GPUs per group (Megatron-style, sequence "
                     "parallel, as torchtitan: q/k/v and gate/up split by columns, o and down by "
                     "rows), FSDP2 across the groups; the collectives TP issued in the trace are "
                     "timed inside the group and wait on the compute lane (no async TP); tokens/s "
                     f"per GPU is a group's tokens / {tp}; "
                     + ("loss parallel: the logits split over the vocabulary, the loss's "
                        "all-reduces traced" if po.loss_parallel else
                        "whole logits gathered on every rank (--no-loss-parallel)"))
    if cp > 1:
        notes.append(cp_assumption(cp, tp))
    return StepTime(
        model=spec.name, gpus=gpus, gpu=g.name, strategy=strategy, precision=precision, ac=ac,
        batch=batch, seq=seq, compile=compile, fp8=fp8_used, step_s=step_s, compute_s=compute_s,
        comm_s=comm_s, exposed_comm_s=step_s - compute_s, optimizer_s=optimizer_s,
        tokens_per_s_per_gpu=tps, mfu=mfu, assumptions=notes, timeline=lanes.events,
        per_unit=per_unit, trace_s=profile.trace_s,
        unit_fqns={u.name: u.fqn for u in profile.units if u.fqn})


def model_flops_per_token(spec, profile, seq: int) -> tuple[float, str]:
    """MFU's FLOPs per token: the convention's ``6N + 12 x layers x heads x head_dim x seq``
    counting only the work that runs, and the assumption that says so ("" when all of it runs).

    A mixture of experts runs ``num_experts_per_tok`` of its experts per token: the experts' 3-D
    weights count that share of their parameters. Frozen parameters skip their weight-gradient
    matmuls, and the backward stops below the lowest trainable one: each term is scaled by the
    traced step's backward work against a full backward's (2 x the forward's matmuls,
    ``ATTENTION_BACKWARD`` x its attention), both from the ops the fake step ran."""
    from utilities.models import EXPERT_FIELDS, _attention_shape

    config = spec.config()
    layers, heads, head_dim = _attention_shape(config)
    attention = 12.0 * layers * heads * head_dim * seq
    dense = spec.flops_per_token(seq) - attention
    said = []
    experts = next((getattr(config, f) for f in EXPERT_FIELDS
                    if isinstance(getattr(config, f, None), int)), 0)
    active = getattr(config, "num_experts_per_tok", None)
    if isinstance(active, int) and 0 < active < experts:
        idle = sum(math.prod(s) for u in profile.units for s in u.shapes
                   if len(s) == 3 and s[0] == experts) * (1 - active / experts)
        if idle:
            dense -= 6.0 * idle
            said.append(f"{active} of {experts} experts per token ({idle / 1e9:.1f}B idle "
                        "parameters left out of N)")
    work = {(phase, kind): 0.0 for phase in ("forward", "backward") for kind in (MATMUL, ATTENTION)}
    for s in profile.segments:
        for kind in (MATMUL, ATTENTION):
            if (s.phase, kind) in work:
                work[(s.phase, kind)] += float(s.flops[s.kind == kind].sum())
    shares = []
    for kind, backward in ((MATMUL, 2.0), (ATTENTION, ATTENTION_BACKWARD)):
        forward = work[("forward", kind)]
        share = (forward + work[("backward", kind)]) / ((1 + backward) * forward) if forward else 1.0
        shares.append(1.0 if share > 1 - 1e-6 else share)  # a forward-only op (rotary) is noise
    if shares[0] < 1 or shares[1] < 1:
        said.append(f"the traced backward runs {shares[0]:.1%} of a full step's matmul work and "
                    f"{shares[1]:.1%} of its attention work (frozen parameters: no weight "
                    "gradients, no backward below the lowest trainable one)")
    flops = dense * shares[0] + attention * shares[1]
    if not said:
        return flops, ""
    return flops, (f"MFU counts what runs: {flops / 1e9:.2f} GFLOP per token, not the "
                   f"convention's {spec.flops_per_token(seq) / 1e9:.2f}: " + "; ".join(said))


TRACED_MFU_NOTE = ("MFU: tokens/s/GPU x the FLOPs per token of the traced forward and backward "
                   "(matmuls and attention, as the trace ran them; no recomputation) / the GPU's "
                   "bf16 dense peak: a model of yours has no 6N formula the course knows")


def traced_flops_per_token(profile, tokens: int) -> float:
    """The FLOPs per token the traced step's forward and backward ran (recomputation left out,
    as MFU leaves it out), over its ``tokens`` per rank."""
    return sum(float(s.flops.sum()) for s in profile.segments
               if s.phase in ("forward", "backward")) / max(tokens, 1)


def _efficiency_note(name: str) -> str:
    """Where this part's efficiencies come from: its own published runs, or another part's."""
    if name in CALIBRATED.per_gpu:
        return (f"efficiencies for {name}: the reference H100 SXM fractions with this part's own, "
                "fitted on its published runs (CALIBRATED.per_gpu)")
    if name in _EXTRAPOLATED_FROM:
        return (f"efficiencies for {name}: extrapolated, {_EXTRAPOLATED_FROM[name]}'s (no published "
                "run of this part in the check)")
    if name == "h100":
        return "efficiencies for h100: the reference part, fitted on published H100 SXM runs"
    return (f"efficiencies for {name}: extrapolated, H100 SXM's (no published run of this part in "
            "the check)")


def _assumptions(strategy, precision, compile, fp8, gpus, gpus_per_node, network_gbps, group,
                 replicas, eff, g, bwd_mode, fwd_depth, bwd_depth, limit, profile,
                 tf32=False) -> list[str]:
    nodes = -(-gpus // gpus_per_node)
    out = [
        f"compute traced from one fake step of the real model ({profile.model}, {len(profile.units)}"
        f" FSDP units, {sum(len(s.kind) for s in profile.segments):,} kernels); per op "
        f"max(FLOPs / ({eff.matmul:.0%} of the dense peak), bytes / ({eff.memory:.0%} of HBM "
        f"bandwidth)), attention at {eff.attention:.0%} of the bf16 peak (FlashAttention, causal: "
        "half the FLOPs), at least "
        f"{eff.kernel_floor_s * 1e6:.0f} us per kernel",
        "matmuls in " + ("bf16 at the BF16 dense peak" if precision != "fp32" else
                         "fp32 on TF32 tensor cores (allow_tf32)" if tf32 else
                         "fp32 at the FP32 (non-tensor-core) peak: torch's default matmul "
                         "precision; tf32=True for TF32"),
        f"topology: {nodes} node(s) x {min(gpus, gpus_per_node)} GPUs, {g.link} "
        f"{g.link_bytes_per_s / 1e9:.0f} GB/s per GPU each way at {eff.link:.0%} inside a node, "
        f"{network_gbps:g} Gb/s per GPU at {eff.network:.0%} across nodes; NCCL's tuning model "
        f"(Simple protocol): ring {eff.base_latency_s * 1e6:.1f} us + "
        f"{eff.hop_latency_link_s * 1e6:.1f} us per NVLink step, "
        f"{eff.hop_latency_network_s * 1e6:.0f} us per step that crosses a node boundary "
        "(nNodes - 1 of them); all-reduce across nodes by NCCL's tree where it is faster; NVLS "
        "(NVLink SHARP) and PAT not modelled",
        "collectives run one at a time on one lane (FSDP2's all-gather and reduce-scatter "
        "streams share the links); communication kernels do not slow the compute they overlap",
        f"FSDP's per-unit hooks (Python, stream waits) stall the compute lane "
        f"{eff.unit_overhead_s * 1e3:.2f} ms per unit, once in forward and once in backward",
        "optimizer: AdamW over the rank's fp32 shard, memory-bound (32 bytes per parameter: "
        "read parameter, gradient, 2 moments, write parameter, 2 moments, the clip's read)",
    ]
    if strategy == "no_shard":
        out.append(f"no_shard: DDP, every rank holds the model; one gradient all-reduce per unit "
                   f"over {gpus} GPUs after its backward; FSDP's copy kernels left out")
    elif strategy == "hybrid_shard":
        out.append(f"hybrid_shard: shard groups of {group}, gradient shards all-reduced across "
                   f"{replicas} replicas over the network")
    elif strategy == "shard_grad_op":
        out.append("shard_grad_op: parameters stay gathered from forward to backward (no "
                   "all-gather in backward)")
    else:
        out.append("full_shard: every block unit is all-gathered in forward and again in "
                   "backward; the root unit stays gathered (FSDP2 does not reshard the root)")
    if bwd_mode == "fsdp2":
        out.append(f"FSDP2 prefetch depth: forward {fwd_depth}, backward {bwd_depth} "
                   "(1 = FSDP2's default implicit prefetch; 0 = all-gather issued when the unit "
                   "is reached)")
    else:
        out.append(f"FSDP1 backward_prefetch={bwd_mode.upper()}; forward: "
                   + ("limit_all_gathers (at most 2 units gathered)" if limit else
                      "the CPU runs ahead, every all-gather issued at once"))
    if compile:
        out.append(f"torch.compile per block: each run of consecutive memory-bound ops between "
                   "two GEMMs (or attention, or FSDP's copies) is one fused kernel: one launch "
                   f"(at least {eff.compile_floor_s * 1e6:.1f} us) moving {eff.compile_memory:.0%} "
                   "of the run's eager bytes (its intermediates stay in registers); matmuls, "
                   "attention, FSDP's copies and the root (embedding, output layer, loss) "
                   "unchanged")
    if fp8:
        out.append(f"fp8: torchao Float8Linear (tensorwise) for the blocks' Linears: their "
                   f"three GEMMs (forward, grad input, grad weight) at {eff.fp8_matmul:.0%} of the "
                   "FP8 dense peak reading half the bytes; an amax and a cast pass per operand "
                   "(1.25 x the bf16 operand bytes, memory-bound, fused like any elementwise op "
                   "under compile); FP8 all-gather of block parameters (1 byte each); embedding, "
                   "output layer and attention stay bf16")
    out.append("MFU: tokens/s/GPU x (6N + 12 x layers x heads x head_dim x seq) / the GPU's "
               "bf16 dense peak (the course's and torchtitan's convention)")
    return out


TP_COLLECTIVES = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
                  "all_reduce": "all_reduce"}  # the functional collectives DTensor (TP) issues


def cp_assumption(cp: int, tp: int) -> str:
    """How the time model treats context parallelism (``context_parallel``)."""
    per_rank = f" (each of them a TP group of {tp})" if tp > 1 else ""
    return (f"context parallelism: {cp} GPUs per CP group{per_rank} run the same sequences, "
            f"each 1/{cp} of every sequence's tokens (chunks r and "
            f"2x{cp}-1-r: the causal work balanced), FSDP2 over every GPU (torchtitan's "
            "dp_shard_cp); torch's all-gather rotation (its default): per layer the local K and V "
            "all-gathered over the CP group in forward, again in backward (and again in a "
            "checkpoint's recomputation, which torch's cached ring-attention op skips under "
            f"selective checkpointing), and the dK/dV accumulators passed {cp} times to the next "
            "rank; these "
            "are timed on the compute lane, not overlapped with attention (an upper bound: torch "
            "overlaps them partly with the local chunk's attention); attention FLOPs: the local "
            f"queries over all keys, causal, 1/{cp} of the unsplit work per GPU; tokens/s per GPU "
            f"is a CP group's tokens / {cp * tp}")


def _with_tp_collectives(plan_segs, profile, tp, g, eff, gpus_per_node, network_gbps, cp=1):
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


def _check(gpus, strategy, precision, ac, batch, seq, gpus_per_node, network_gbps, prefetch,
           backward_prefetch, forward_prefetch) -> None:
    check_step(gpus, strategy, precision, ac, batch, seq)
    if not isinstance(gpus_per_node, int) or gpus_per_node < 1:
        raise bad_value("--gpus-per-node", gpus_per_node, "integers >= 1")
    if not network_gbps > 0:
        raise bad_value("--network-gbps", network_gbps, "numbers > 0")
    for name, v in (("prefetch", prefetch), ("forward_prefetch", forward_prefetch)):
        if v is not None and (not isinstance(v, int) or v < 0):
            raise bad_value(name, v, "integers >= 0")
    if backward_prefetch is not None and backward_prefetch not in BACKWARD_PREFETCH:
        raise bad_value("backward_prefetch", backward_prefetch, BACKWARD_PREFETCH)


# -- the terminal table ----------------------------------------------------------------------------

def format_step_time(t: StepTime, units: int = 0) -> str:
    """A table that fits 80 columns: the totals, then (``units`` > 0) the slowest units."""
    cfg = (f"{t.model} on {t.gpus} x {t.gpu}: {t.strategy}, {t.precision}"
           f"{' + fp8' if t.fp8 else ''}{' + compile' if t.compile else ''}, AC {t.ac}, "
           f"batch {t.batch} x seq {t.seq} per GPU")
    import textwrap

    lines = textwrap.wrap(cfg, 80) + [f"{'':<28}{'seconds':>12}{'of step':>10}"]
    rows = (("step", t.step_s), ("compute (incl. optimizer)", t.compute_s),
            ("  optimizer step", t.optimizer_s), ("communication", t.comm_s),
            ("  exposed (not overlapped)", t.exposed_comm_s))
    for name, v in rows:
        lines.append(f"{name:<28}{v:>12.4f}{v / t.step_s:>10.1%}")
    lines.append(f"tokens/s per GPU {rate_text(t.tokens_per_s_per_gpu):>14}   MFU {t.mfu:.1%}")
    if units:
        lines.append(f"{'unit':<20}{'forward':>10}{'backward':>10}{'all-gather':>12}"
                     f"{'grad comm':>11}")
        ranked = sorted(t.per_unit.items(), key=lambda kv: -sum(kv[1].values()))
        for name, d in ranked[:units]:
            bwd = d.get("backward", 0.0) + d.get("recompute", 0.0)
            grad = d.get("reduce_scatter", 0.0) + d.get("all_reduce", 0.0)
            lines.append(f"{name[:20]:<20}{d.get('forward', 0.0):>10.4f}{bwd:>10.4f}"
                         f"{d.get('all_gather', 0.0):>12.4f}{grad:>11.4f}")
    return "\n".join(lines)


def sweep(model, gpu_counts: Sequence[int], strategies: Sequence[str] = STRATEGIES,
          **kw) -> list[StepTime]:
    """``estimate_step_time`` over GPU counts x strategies (one trace serves them all)."""
    return [estimate_step_time(model, n, s, **kw) for n in gpu_counts for s in strategies
            if not (s == "hybrid_shard" and n % min(n, kw.get("gpus_per_node", 8)))]


def with_efficiencies(eff: Efficiencies, **changes) -> Efficiencies:
    """A copy of ``eff`` with some fields changed (what a calibration run produces)."""
    return replace(eff, **changes)


# -- predictions for the speed lessons -------------------------------------------------------------

@dataclass(frozen=True)
class Cluster:
    """Where a lesson's variants are predicted: ``nodes`` x ``gpus_per_node`` GPUs of kind ``gpu``,
    NVLink inside a node and ``network_gbps`` per GPU between nodes."""

    nodes: int = 2
    gpus_per_node: int = 8
    gpu: str = "h100"
    network_gbps: float = 400.0

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def describe(self) -> str:
        return (f"{self.nodes} node(s) x {self.gpus_per_node} {self.gpu} (NVLink inside a node, "
                f"{self.network_gbps:g} Gb/s per GPU between nodes)")


CLUSTER_FORMAT = "NODESxGPUSxGPU, e.g. 2x8xh100 (GPU: " + ", ".join(GPUS) + ")"


def parse_cluster(text: str, flag: str = "--predict-on") -> Cluster:
    """``2x8xh100`` -> Cluster(2, 8, "h100"); anything else is a one-line error."""
    parts = str(text).strip().lower().split("x", 2)
    try:
        nodes, per_node = int(parts[0]), int(parts[1])
        gpu = get_gpu(parts[2]).name
    except (ValueError, IndexError, UsageError):
        raise bad_value(flag, text, CLUSTER_FORMAT) from None
    if nodes < 1 or per_node < 1:
        raise bad_value(flag, text, CLUSTER_FORMAT + "; counts >= 1")
    return Cluster(nodes, per_node, gpu)


DEFAULT_MODEL_HELP = "the lesson's GPU size"


def add_prediction_arguments(parser: argparse.ArgumentParser, model: str, batch: int,
                             cluster: str = "2x8xh100", batch_help: str | None = None,
                             model_help: str | None = None) -> argparse._ArgumentGroup:
    """``--predict-on``, ``--predict-model`` and ``--predict-batch``: after a script's
    measurements, this model's prediction of its variants on a cluster (what a knob does to time
    where there is an interconnect), for ``model`` at ``batch`` per GPU unless the flags say
    otherwise (``predict_from_arguments``). Returns the flags' group, for a lesson's own."""
    from utilities.errors import positive_int

    g = parser.add_argument_group("prediction on a cluster (a model, not a measurement)")
    g.add_argument("--predict-on", default=cluster,
                   help=f"cluster to predict the variants' step time on: {CLUSTER_FORMAT}; "
                        f"'none' to skip (default {cluster})")
    g.add_argument("--predict-model", default=model,
                   help=f"model to predict for (default {model}, "
                        f"{model_help or DEFAULT_MODEL_HELP})")
    g.add_argument("--predict-batch", type=positive_int, default=batch,
                   help=f"{batch_help or 'per-GPU batch to predict for'} (default {batch})")
    return g


def check_prediction_arguments(args: argparse.Namespace) -> None:
    """Refuse a ``--predict-on`` or ``--predict-model`` that cannot be predicted (UsageError)."""
    if args.predict_on != "none":
        from utilities.models import get_model_spec

        parse_cluster(args.predict_on)
        get_model_spec(args.predict_model)


def predict_from_arguments(args: argparse.Namespace, variants: dict[str, dict[str, Any]],
                           precision: str = "bf16", ac: str = "none",
                           seq: int | None = None) -> dict[str, Any] | None:
    """A lesson's ``predicted`` block (``predict_variants``) from its prediction flags, made on
    rank 0 *before* the lesson joins its process group: the model traces one step on a fake group
    of its own. Other ranks, and ``--predict-on none``, get None."""
    if args.predict_on == "none" or int(os.environ.get("RANK", "0")) != 0:
        return None
    return predict_variants(args.predict_model, parse_cluster(args.predict_on), variants,
                            precision=precision, ac=ac, batch=args.predict_batch, seq=seq)


def predict_variants(model, cluster: Cluster, variants: dict[str, dict[str, Any]],
                     precision: str = "bf16", ac: str = "none", batch: int = 1,
                     seq: int | None = None) -> dict[str, Any]:
    """A lesson's ``predicted`` block: each variant's knobs (``estimate_step_time`` keywords) on
    ``cluster``, with its step time, exposed communication, tokens/s per GPU and timeline. One
    trace serves every variant. A prediction, not a measurement: the block says so. A variant's
    knobs may carry its own ``batch`` (with ``tp``, a TP group's): its row records it."""
    from utilities.models import get_model_spec

    seq = seq or get_model_spec(model).default_seq_len
    rows = []
    for name, knobs in variants.items():
        kw = {"precision": precision, "ac": ac, "batch": batch, "seq": seq, **knobs}
        t = estimate_step_time(model, cluster.gpus, gpu=cluster.gpu,
                               gpus_per_node=cluster.gpus_per_node,
                               network_gbps=cluster.network_gbps, **kw)
        rows.append({"name": name, **({"batch": knobs["batch"]} if "batch" in knobs else {}),
                     "step_s": t.step_s, "compute_s": t.compute_s, "comm_s": t.comm_s,
                     "exposed_comm_s": t.exposed_comm_s,
                     "tokens_per_s_per_gpu": t.tokens_per_s_per_gpu, "mfu": t.mfu,
                     "timeline": [asdict(e) for e in t.timeline]})
    return {"what": "PREDICTED by the course's step-time model (utilities.measure.step_time), "
                    "not measured", "cluster": cluster.describe(), "gpus": cluster.gpus,
            "model": getattr(model, "name", model), "precision": precision, "ac": ac,
            "batch": batch, "seq": seq, "variants": rows}


def predicted_rows(block: dict[str, Any]) -> list[list[str]]:
    """The prediction's table, a header and a row per variant: what the lesson prints under its
    measurements and its README renders (``utilities.course.readme_tables``). Where variants carry
    their own batch (a TP group's) it is a column; where they carry the planner's peak
    (``peak_bytes``, ``fits``), so is the memory per GPU."""
    ms = lambda seconds: f"{seconds * 1e3:.1f}ms"  # noqa: E731
    variants = block["variants"]
    own_batch = any("batch" in v for v in variants)
    memory = bool(variants) and all("peak_bytes" in v for v in variants)

    def peak(v: dict[str, Any]) -> list[str]:
        if not memory:
            return []
        return [f"{v['peak_bytes'] / 2**30:.1f} GiB" + ("" if v.get("fits", True) else " (no fit)")]

    return [["variant", *(["batch"] if own_batch else []), "step", "comm", "exposed",
             "tokens/s/GPU", *(["peak/GPU"] if memory else [])],
            *[[v["name"], *([str(v.get("batch", block["batch"]))] if own_batch else []),
               ms(v["step_s"]), ms(v["comm_s"]), ms(v["exposed_comm_s"]),
               f"{v['tokens_per_s_per_gpu']:,.0f}", *peak(v)] for v in variants]]


def predicted_batch_text(block: dict[str, Any]) -> str:
    """The block's batch as its title says it: per GPU (or per what its ``batch_per`` names: a CP
    group), and, where variants carry their own (a TP group's), where the table gives it."""
    text = f"batch {block['batch']} x {block['seq']} per {block.get('batch_per', 'GPU')}"
    if any("batch" in v for v in block["variants"]):
        text += " (a variant with its own batch, a TP group's, says it in the batch column)"
    return text


def format_predicted(block: dict[str, Any]) -> str:
    """The prediction as a table under the lesson's measurements (80 columns)."""
    import textwrap

    title = (f"PREDICTED (the step-time model, not a measurement): {block['model']}, "
             f"{predicted_batch_text(block)}, on {block['cluster']}")
    table = predicted_rows(block)
    if len(table[0]) == 5:
        rows = [f"{name[:22]:<22}{step:>10}{comm:>10}{exposed:>10}{tokens:>14}"
                for name, step, comm, exposed, tokens in table]
    else:  # a batch or memory column: the names get the width they need
        width = min(22, max(len(r[0]) for r in table) + 2)
        rows = [f"{r[0][:width]:<{width}}" + "".join(f"{c:>{14 if h == 'tokens/s/GPU' else 10}}"
                                                    for h, c in zip(table[0][1:], r[1:]))
                for r in table]
    return "\n".join([*textwrap.wrap(title, 80), *rows])


def draw_timelines(predicted: dict[str, Any], names: list[str]) -> Any:
    """The step-time model's timelines of two or more of a lesson's variants, side by side: per
    variant a compute lane and a communication lane, each bar a unit's forward, backward,
    all-gather or reduce-scatter (``results["predicted"]``, a prediction, not a measurement)."""
    import matplotlib.pyplot as plt

    colors = {"forward": "tab:blue", "recompute": "tab:cyan", "backward": "tab:green",
              "optimizer": "tab:gray", "all_gather": "tab:orange", "reduce_scatter": "tab:red",
              "all_reduce": "tab:purple"}
    by_name = {v["name"]: v for v in predicted["variants"]}
    fig, axes = plt.subplots(len(names), 1, figsize=(14, 1.8 * len(names)), sharex=True, squeeze=False)
    for ax, name in zip(axes[:, 0], names):
        v = by_name[name]
        for row, lane in enumerate(("comm", "compute")):
            for e in (e for e in v["timeline"] if e["lane"] == lane):
                ax.broken_barh([(e["start"] * 1e3, (e["end"] - e["start"]) * 1e3)], (row * 10, 8),
                               color=colors.get(e["phase"], "k"))
        ax.set_yticks([4, 14], ["communication", "compute"])
        ax.set_title(f"{name}: step {v['step_s'] * 1e3:.1f} ms, exposed communication "
                     f"{v['exposed_comm_s'] * 1e3:.1f} ms", fontsize=10, loc="left")
    axes[-1, 0].set_xlabel("ms from the step's start (PREDICTED by the step-time model)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    fig.suptitle(f"{predicted['model']} on {predicted['cluster']}", fontsize=10)
    fig.tight_layout()
    fig.legend(handles, list(colors), loc="upper center", bbox_to_anchor=(0.5, 0.0),
               ncol=len(colors), fontsize=8)
    return fig
