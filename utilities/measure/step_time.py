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
  gpus_per_node=8, network_gbps=400, compile=False, fp8=False, prefetch=1, ...) -> StepTime``:
  the step a ``fake_step.StepConfig`` (or the GPU count and its fields), the rest a
  ``TimeConfig`` (``timing=``) or its fields by name;
* ``StepTime.as_dict()``: ``{step_s, compute_s, comm_s, exposed_comm_s, tokens_per_s_per_gpu,
  mfu, assumptions}`` (``as_dict(timeline=True)`` adds the events);
* ``format_step_time(t, units=0)``: the table for a terminal, at most 80 columns;
* ``sweep(model, gpu_counts, strategies, **kw)``: many configurations from one trace.

Its parts, each a module of its own: the GPU catalogue and the fitted efficiencies
(``gpu_catalogue``), the roofline, NCCL and optimizer costs (``cost_model``), the two lanes
(``schedule``), the lessons' predictions on a cluster (``predictions``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from utilities.errors import bad_value
from utilities.measure.context_parallel import check_cp
from utilities.measure.cost_model import (
    ag_item_bytes,
    collective_time,
    optimizer_bytes,
    optimizer_time,
    ring_bytes_per_gpu,
    segment_time,
    trainable_shard_numel,
    with_tp_collectives,
)
from utilities.measure.fake_step import STRATEGIES, StepConfig, check_step, check_tp, step_config, trace
from utilities.measure.gpu_catalogue import (
    CALIBRATED,
    GPU,
    HOST_ADAMW_SOURCE,
    PCIE_SOURCE,
    Efficiencies,
    efficiency_note,
    get_gpu,
)
from utilities.measure.op_recorder import ATTENTION, ATTENTION_BACKWARD, MATMUL
from utilities.measure.schedule import (
    BACKWARD_PREFETCH,
    Collective,
    Event,
    accumulated_lanes,
    offload_copies,
    reshard_all_gathers,
    run_schedule,
)
from utilities.text import rate_text

__all__ = ["StepTime", "TimeConfig", "chrome_trace", "estimate_step_time", "format_step_time", "sweep"]


# -- the result ------------------------------------------------------------------------------------


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

@dataclass(frozen=True)
class TimeConfig:
    """What the time model takes beside the step (``StepConfig``): the GPU part ``gpu``
    (``GPUS``), ``gpus_per_node`` on NVLink and ``network_gbps`` per GPU between nodes, the
    kernels (``compile``, ``fp8``, ``tf32``), FSDP's schedule (``prefetch``,
    ``backward_prefetch``, ``forward_prefetch``, ``limit_all_gathers``) and the ``efficiencies``
    (default ``CALIBRATED``); ``estimate_step_time`` says what each does."""

    gpu: str | GPU = "h100"
    gpus_per_node: int = 8
    network_gbps: float = 400.0
    compile: bool = False
    fp8: bool = False
    prefetch: int = 1
    backward_prefetch: str | None = None
    forward_prefetch: int | None = None
    limit_all_gathers: bool = False
    tf32: bool = False
    efficiencies: Efficiencies | None = None


TIME_FIELDS = tuple(f.name for f in fields(TimeConfig))


def time_settings(gpus: int | StepConfig, step: tuple, timing: TimeConfig | None,
                  settings: dict[str, Any]) -> tuple[StepConfig, TimeConfig]:
    """The step and the time model's settings from ``estimate_step_time``'s arguments: the step's
    fields by position (``step_config``), each keyword the field of that name in the one that has
    it (``plan_options``: the step's ``options``)."""
    settings = dict(settings)
    if "plan_options" in settings:
        settings["options"] = settings.pop("plan_options")
    timed = {k: settings.pop(k) for k in list(settings) if k in TIME_FIELDS}
    return step_config(gpus, *step, **settings), replace(timing or TimeConfig(), **timed)


@dataclass
class _Timed:
    """One configuration on its way through the time model: the step (checked, its ``seq``,
    ``shard_size`` and ``options`` resolved), its timing, the GPU, its efficiencies, the trace."""

    spec: Any
    config: StepConfig
    timing: TimeConfig
    gpu: GPU
    eff: Efficiencies
    profile: Any = None
    fp8: bool = False  # FP8 is used: asked for, and the GPU and precision have it
    group: int = 1  # the ranks that shard among themselves
    replicas: int = 1  # hybrid_shard's replicas


def estimate_step_time(model, gpus: int | StepConfig, *step: Any, timing: TimeConfig | None = None,
                       **settings: Any) -> StepTime:
    """Predict one training step of ``model`` (a name from ``utilities.models`` or a ``ModelSpec``)
    in the step ``gpus`` names (a ``StepConfig``: ``world`` GPUs, per-rank ``batch`` x ``seq``
    tokens...; or the number of GPUs, the step's other fields following by position in
    ``StepConfig``'s order or by name) on GPUs of kind ``gpu`` (``GPUS``), timed as ``timing``
    (``TimeConfig``) says, whose fields may be given by name too (``plan_options`` is the step's
    ``options``): ``estimate_step_time("llama-8b", gpus=8, ac="selective", gpu="h200")``.

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
    from utilities.models import get_model_spec

    config, timing = time_settings(gpus, step, timing, settings)
    spec = get_model_spec(model) if isinstance(model, str) else model
    g = get_gpu(timing.gpu)
    run = _Timed(spec, config, timing, g, (timing.efficiencies or CALIBRATED).for_gpu(g.name))
    run.config = _checked(spec, config, timing)
    run.profile = _traced(spec, run.config, timing)
    c, profile = run.config, run.profile
    notes = [f"GPU: {g.name}: {g.source}", *g.notes, efficiency_note(g.name)]
    run.fp8 = timing.fp8 and "fp8" in g.peak_flops and c.precision != "fp32"
    if timing.fp8 and not run.fp8:
        notes.append(f"--fp8 ignored: {g.name} has no FP8 tensor cores" if "fp8" not in g.peak_flops
                     else "--fp8 ignored with fp32 precision")
    plan_segs = _compute_segments(run)
    ag_fwd, ag_bwd, grads, coll = _unit_collectives(run)
    optimizer_s, opt_bytes, ag_bwd = _optimizer_step(run, ag_fwd, ag_bwd, grads, coll)
    lanes, depths = _lanes(run, plan_segs, ag_fwd, ag_bwd, grads, optimizer_s, opt_bytes)
    compute_s = sum(e.end - e.start for e in lanes.events if e.lane == "compute")
    comm_s = sum(e.end - e.start for e in lanes.events if e.lane == "comm")
    step_s = max(e.end for e in lanes.events)
    # a TP (and CP) group's tokens per step, per GPU of the group
    tps = c.batch * c.seq * c.options.grad_accum / step_s / (c.tp * c.cp)
    if getattr(spec, "flops_from_trace", False):  # a model of yours: the FLOPs its traced ops do
        flops_per_token, counted = traced_flops_per_token(profile, c.batch * c.seq // c.cp), ""
    else:
        flops_per_token, counted = model_flops_per_token(spec, profile, c.seq)
    per_unit: dict[str, dict[str, float]] = {}
    for e in lanes.events:
        d = per_unit.setdefault(e.unit, {})
        d[e.phase] = d.get(e.phase, 0.0) + (e.end - e.start)
    notes += _all_assumptions(run, depths, counted)
    return StepTime(
        model=spec.name, gpus=c.world, gpu=g.name, strategy=c.strategy, precision=c.precision,
        ac=c.ac, batch=c.batch, seq=c.seq, compile=timing.compile, fp8=run.fp8, step_s=step_s,
        compute_s=compute_s, comm_s=comm_s, exposed_comm_s=step_s - compute_s,
        optimizer_s=optimizer_s, tokens_per_s_per_gpu=tps,
        mfu=tps * flops_per_token / g.peak_flops["bf16"], assumptions=notes,
        timeline=lanes.events, per_unit=per_unit, trace_s=profile.trace_s,
        unit_fqns={u.name: u.fqn for u in profile.units if u.fqn})


def _checked(spec, config: StepConfig, timing: TimeConfig) -> StepConfig:
    """``config`` checked, with its ``seq`` (default: the model's), hybrid_shard's ``shard_size``
    (default: one node) and ``options`` (default: none) filled in."""
    from utilities.measure.plan_options import PlanOptions

    po = config.options or PlanOptions()
    gpus, strategy, shard_size, gpus_per_node = (config.world, config.strategy, config.shard_size,
                                                 timing.gpus_per_node)
    _check(config, timing)
    check_tp(spec, config.tp, gpus, strategy, po, gpus_per_node)
    seq = config.seq or spec.default_seq_len
    check_cp(spec, config.cp, gpus, strategy, seq, config.tp, po, gpus_per_node)
    if strategy == "hybrid_shard":
        shard_size = shard_size or min(gpus, gpus_per_node)
        if gpus % shard_size:
            raise bad_value("shard_size", shard_size, f"a divisor of gpus ({gpus})")
    elif shard_size is not None:
        raise bad_value("shard_size", shard_size, "only with strategy hybrid_shard")
    return replace(config, seq=seq, shard_size=shard_size, options=po)


def _traced(spec, config: StepConfig, timing: TimeConfig):
    """The trace the prediction reads.

    Per-rank compute from one node's trace: for a plan of one node, the planner's own trace of
    this configuration (one fake step serves memory and time). Beyond a node only FSDP's
    copy-in (1/N of a unit) would change, so one trace serves every GPU count (a sweep). DDP
    (no_shard) computes what an FSDP rank computes: the full_shard trace (the planner's 1-rank
    stand-in for DDP casts each parameter on its own, which DDP does not); HSDP a shard group's.
    Its ops only (``memory=False``): the time model reads no memory."""
    strategy = config.strategy
    node = min(config.world, timing.gpus_per_node)
    traced = strategy if strategy in ("full_shard", "shard_grad_op") else "full_shard"
    world = min(node, config.shard_size) if strategy == "hybrid_shard" else node
    return trace(spec, replace(config, world=world, strategy=traced, device_type="cuda",
                               shard_size=None, memory=False))


def _compute_segments(run: _Timed) -> list[tuple[str, str, float, dict[str, Any]]]:
    """Each traced segment's (unit, phase, seconds, args): its roofline time, the TP and CP
    collectives it waits for, and FSDP's per-unit overhead once per unit and pass."""
    c, t, g, eff, profile = run.config, run.timing, run.gpu, run.eff, run.profile
    copies = c.strategy != "no_shard"
    plan_segs = [(s.unit, s.phase, segment_time(s, g, eff, c.precision, t.compile, run.fp8, copies,
                                                t.tf32),
                  {"flops": float(s.flops.sum()), "bytes": float(s.nbytes.sum()), "ops": len(s.kind)})
                 for s in profile.segments]
    if c.tp > 1 or c.cp > 1:
        plan_segs = with_tp_collectives(plan_segs, profile, c.tp, g, eff, t.gpus_per_node,
                                        t.network_gbps, c.cp)
    if copies and eff.unit_overhead_s:
        seen: set[tuple[str, str]] = set()
        for i, (unit, phase, secs, args) in enumerate(plan_segs):
            key = (unit, "forward" if phase == "forward" else "backward")
            if key not in seen:
                seen.add(key)
                plan_segs[i] = (unit, phase, secs + eff.unit_overhead_s, args)
    return plan_segs


def _unit_collectives(run: _Timed):
    """Per unit: its forward and backward all-gathers and its gradients' collectives (sets
    ``run.group`` and ``run.replicas``), and the function that makes a collective."""
    from utilities.measure.plan_options import reduce_item

    c, t, g, eff = run.config, run.timing, run.gpu, run.eff
    gpus, strategy, tp = c.world, c.strategy, c.tp
    p_item = 4 if c.precision == "fp32" else 2
    r_item = reduce_item(c.precision, c.options)
    group = {"full_shard": gpus // tp, "shard_grad_op": gpus // tp,
             "hybrid_shard": c.shard_size or gpus, "no_shard": 1}[strategy]
    per_rank = group * tp  # a 2-D parameter: split over tp, then sharded over the group
    replicas = gpus // group if strategy == "hybrid_shard" else 1
    run.group, run.replicas = group, replicas

    def coll(kind, unit, nbytes, n, per_node=t.gpus_per_node):
        return Collective(kind, unit, collective_time(kind, nbytes, n, g, eff, per_node,
                                                      t.network_gbps),
                          nbytes, {"bytes": nbytes, "bytes_per_gpu": ring_bytes_per_gpu(kind, nbytes, n),
                                   "gpus": n})

    ag_fwd, ag_bwd, grads = {}, {}, {}
    for u in run.profile.units:
        shard = u.shard_numel(per_rank)
        if strategy == "no_shard":
            grads[u.name] = [coll("all_reduce", u.name, u.numel * r_item, gpus)]
            continue
        ag_item = p_item
        if run.fp8 and not u.is_root:
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
    return ag_fwd, ag_bwd, grads, coll


def _optimizer_step(run: _Timed, ag_fwd, ag_bwd, grads, coll):
    """The optimizer step's seconds and bytes (AdamW over this rank's fp32 shard, memory-bound),
    and the backward all-gathers, as the plan's options change them (its options also add the
    offload copies to ``ag_fwd``, ``ag_bwd`` and ``grads``)."""
    c, g, eff, group = run.config, run.gpu, run.eff, run.group
    po, units = c.options, run.profile.units
    per_rank = group * c.tp
    shard_total = sum(u.shard_numel(per_rank) if c.strategy != "no_shard" else u.numel for u in units)
    opt_bytes = 32 * shard_total  # read param, grad, 2 moments; write param, 2 moments; the clip's read
    optimizer_s = opt_bytes / (g.hbm_bytes_per_s * eff.memory)
    if not po.default:
        trained = sum(trainable_shard_numel(u, group) if c.strategy != "no_shard" else
                      trainable_shard_numel(u, 1) for u in units)
        optimizer_s = optimizer_time(trained, po, g, eff)
        opt_bytes = optimizer_bytes(trained, po)
        ag_bwd = reshard_all_gathers(ag_bwd, ag_fwd, units, group, po, ag_item_bytes(c.precision), coll)
        if po.offload:
            offload_copies(ag_fwd, ag_bwd, grads, units, group, po, g)
    return optimizer_s, opt_bytes, ag_bwd


def _lanes(run: _Timed, plan_segs, ag_fwd, ag_bwd, grads, optimizer_s, opt_bytes):
    """The step's two lanes (every micro-batch's, with accumulation), and the prefetch depths
    (backward mode, forward depth, backward depth)."""
    t, units, po = run.timing, run.profile.units, run.config.options
    if t.backward_prefetch is not None:
        bwd_mode = t.backward_prefetch
        bwd_depth = 1 if t.backward_prefetch == "backward_pre" else 0
        fwd_depth = t.forward_prefetch if t.forward_prefetch is not None else (
            1 if t.limit_all_gathers else len(units))
    else:
        bwd_mode, bwd_depth = "fsdp2", t.prefetch
        fwd_depth = t.prefetch if t.forward_prefetch is None else t.forward_prefetch
    depths = (bwd_mode, fwd_depth, bwd_depth)
    lanes = run_schedule(plan_segs, units, ag_fwd, ag_bwd, grads, depths, t.limit_all_gathers,
                         optimizer_s, {"bytes": opt_bytes})
    if po.grad_accum > 1:
        micro = run_schedule(plan_segs, units, ag_fwd, ag_bwd,
                             grads if po.accum_sync == "every" else {}, depths,
                             t.limit_all_gathers, 0.0)
        lanes = accumulated_lanes(micro, lanes, po.grad_accum)
    return lanes, depths


def _all_assumptions(run: _Timed, depths: tuple[str, int, int], counted: str) -> list[str]:
    """Every assumption the prediction states, after the GPU's: the model's, the options', the
    MFU count's, TP's and CP's."""
    po, tp, cp = run.config.options, run.config.tp, run.config.cp
    notes = _assumptions(run, *depths)
    notes += options_assumptions(po, run.gpu)
    if counted:
        notes.append(counted)
    if getattr(run.spec, "flops_from_trace", False):
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
    return notes


def model_flops_per_token(spec, profile, seq: int) -> tuple[float, str]:
    """MFU's FLOPs per token: the convention's ``6N + 12 x layers x heads x head_dim x seq``
    counting only the work that runs, and the assumption that says so ("" when all of it runs).

    A mixture of experts runs ``num_experts_per_tok`` of its experts per token: the experts' 3-D
    weights count that share of their parameters. Frozen parameters skip their weight-gradient
    matmuls, and the backward stops below the lowest trainable one: each term is scaled by the
    traced step's backward work against a full backward's (2 x the forward's matmuls,
    ``ATTENTION_BACKWARD`` x its attention), both from the ops the fake step ran."""
    from utilities.models import EXPERT_FIELDS, attention_shape

    config = spec.config()
    layers, heads, head_dim = attention_shape(config)
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


def _assumptions(run: _Timed, bwd_mode: str, fwd_depth: int, bwd_depth: int) -> list[str]:
    c, t = run.config, run.timing
    strategy, precision, gpus, profile = c.strategy, c.precision, c.world, run.profile
    compile, fp8, tf32, limit = t.compile, run.fp8, t.tf32, t.limit_all_gathers
    gpus_per_node, network_gbps = t.gpus_per_node, t.network_gbps
    group, replicas, eff, g = run.group, run.replicas, run.eff, run.gpu
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


def _check(config: StepConfig, timing: TimeConfig) -> None:
    c, t = config, timing
    check_step(c.world, c.strategy, c.precision, c.ac, c.batch, c.seq)
    gpus_per_node, network_gbps = t.gpus_per_node, t.network_gbps
    prefetch, backward_prefetch, forward_prefetch = t.prefetch, t.backward_prefetch, t.forward_prefetch
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
    return [estimate_step_time(model, n, strategy=s, **kw) for n in gpu_counts for s in strategies
            if not (s == "hybrid_shard" and n % min(n, kw.get("gpus_per_node", 8)))]
