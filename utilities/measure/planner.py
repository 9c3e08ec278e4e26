"""Plan a training run's memory without the hardware: one fake training step, really executed.

``plan`` answers "does llama-8b train on 8 x 80 GB with full sharding, bf16 and full activation
checkpointing at batch 2 x 8192 tokens?" on a laptop. It does not estimate with a formula: it runs
the real code path, in one process, with two stand-ins:

* the ``"fake"`` process group (torch's own, reached through ``utilities.torch_internals``): one process plays
  rank 0 of ``gpus`` ranks; every collective returns at once, but the shapes are those of a real
  ``gpus``-rank job, so each parameter shard is exactly 1/gpus of the model;
* ``FakeTensorMode``: every tensor has a shape, a dtype and a device but no storage, so a model of
  8 billion parameters costs no memory.

The model is built on ``meta``, checkpointed, ``fully_shard``-ed block by block (FSDP2), moved to
the fake device, and trained for one step (forward, backward, AdamW step, with the optimizer state
already in place) under ``FSDPMemTracker``, the tracker the lessons use on real
tensors. Its peak snapshot, folded into the course's categories, is the plan.

What it cannot see: the caching allocator's fragmentation and reserved-but-free memory, the CUDA
context and NCCL buffers (together often 1-3 GB per GPU), and kernels' workspaces. ``plan`` keeps
a headroom (``HEADROOM``, 10% by default) for these: a plan "fits" when its peak is at most 90% of
the GPU's memory.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from utilities.errors import UsageError, bad_value
from utilities.measure import categorize, fmt_bytes
from utilities.measure.context_parallel import check_cp
from utilities.measure.fake_step import (
    StepConfig,
    check_step,
    check_tp,
    fake_device,
    step_config,
    trace,
)
from utilities.measure.plan_options import (
    BF16_ACCURACY_NOTE,
    HOST_MEMORY_SOURCE,
    PlanOptions,
    as_options,
    check_options,
)
from utilities.measure.user_code import (
    check_user_code,
    resolve_spec,
)

NODE_GPUS = 8  # hybrid_shard's default shard group: one node
HEADROOM = 0.10  # of the GPU's memory, kept for what the trackers cannot see
CATEGORY_ORDER = ("parameters", "gradients", "optimizer", "activations", "temporaries")
# temporaries: everything else alive at the peak (the tracker's "Temp": autograd's short-lived
# tensors such as the logits and the loss's softmax over the vocabulary; the all-gather and
# reduce-scatter buffers; module buffers and the inputs).
TEMPORARY_PARTS = {"temporaries": "autograd temporaries (logits, loss)",
                   "cublas_workspaces": "cuBLAS workspaces",
                   "all_gather": "all-gather buffers", "reduce_scatter": "reduce-scatter buffers",
                   "buffers": "module buffers", "inputs": "inputs"}

_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


# What ``nvidia-smi`` reports as total memory, in MiB: what users mean by "an 80GB card". H100:
# the course's own H100 run read 79.6 GiB through NVML (benchmarks/results/gpu/2026-11-22-h100/check.txt).
GPU_MEMORY_MIB = {
    "h100": 81559, "h100-80gb": 81559, "h200": 143771, "a100-80gb": 81920, "a100-40gb": 40960,
    "a100": 40960, "l4": 23034, "a10g": 23028, "t4": 15360, "rtx4090": 24564, "a6000": 49140,
    "v100-16gb": 16384, "v100-32gb": 32768,
}


def resolve_gpu_memory(text: str) -> tuple[int, str]:
    """Bytes per GPU from ``--gpu-memory``, and where the number came from, to print.

    ``auto``: this machine's GPU 0 (NVML, else torch) when there is one, else an H100. A GPU name
    (``h100``, ``a100-40gb``...): its real size (``GPU_MEMORY_MIB``). A size: exactly that, so
    ``80GB`` is 80 x 10^9 bytes = 74.5 GiB, less than an "80GB" card (say ``h100``, 79.6 GiB).
    """
    key = str(text).strip().lower()
    if key == "auto":
        if torch.cuda.is_available():
            from utilities.memory_maximizer import gpu_total_memory

            total, source = gpu_total_memory(0)
            return total, f"this machine's GPU 0, {torch.cuda.get_device_name(0)} (via {source})"
        key = "h100"
        total = GPU_MEMORY_MIB[key] * 2**20
        return total, "auto without a GPU here: an H100 80GB, as nvidia-smi reports it"
    if key in GPU_MEMORY_MIB:
        return GPU_MEMORY_MIB[key] * 2**20, f"{key}: {GPU_MEMORY_MIB[key]:,} MiB, as nvidia-smi reports it"
    if re.fullmatch(r"[a-z][a-z0-9-]*", key):  # a name, not a size
        raise bad_value("--gpu-memory", text, "auto, a GPU name (" + ", ".join(GPU_MEMORY_MIB)
                        + ") or a size with its unit, such as 80GiB, 80GB (10^9 bytes), 24e9B")
    nbytes = parse_memory(text)
    unit = "10^9" if key.endswith("gb") else "2^30" if key.endswith("gib") else None
    return nbytes, f"{text.strip()} as given" + (f" ({unit} bytes per G)" if unit else "")


def parse_memory(text: str, flag: str = "--gpu-memory") -> int:
    """Bytes from "80GB" (10**9), "80GiB" (2**30), "24e9B"; one-line error otherwise. A bare
    number is refused: "80" would plan for 80 bytes, never what anyone means."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS or not unit:
        raise bad_value(flag, text, ("a GPU name or " if flag == "--gpu-memory" else "")
                        + "a size with its unit, such as 80GB, "
                        "80GiB, 24e9B (units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)")
    value = float(m.group(1)) * _UNITS[unit]
    if not math.isfinite(value):  # 1e999
        raise bad_value(flag, text, "finite sizes")
    if value < 1:
        raise bad_value(flag, text, "sizes > 0")
    return int(value)


@dataclass
class Plan:
    """One configuration's predicted peak memory on one rank, and whether it fits."""

    model: str
    parameters_total: int
    gpus: int
    gpu_memory_bytes: int
    strategy: str
    precision: str
    ac: str
    batch: int
    seq: int
    device_type: str
    shard_size: int | None  # hybrid_shard: the ranks that shard among themselves (one replica)
    peak_bytes: dict[str, int]  # total, parameters, gradients, optimizer, activations, temporaries
    detail: dict[str, int]  # the tracker's finer categories (sharded/unsharded params, buffers...)
    budget_bytes: int  # gpu memory minus the headroom
    fits: bool
    overflowing: str | None  # the category whose share of the budget is exceeded the most
    method: str  # how the peak was obtained
    notes: list[str] = field(default_factory=list)
    gpu_memory_source: str = ""  # where gpu_memory_bytes came from (a GPU name, this GPU, a size)
    # parameters, gradients, optimizer state a rank holds between steps (counted after the step)
    model_states: dict[str, int] = field(default_factory=dict)
    # the step-time model's prediction (utilities.measure.step_time), when asked for
    time: dict[str, Any] | None = None
    # what the plan's reader must know first: sizes a config file left to transformers' defaults,
    # a sequence past the model's context
    warnings: list[str] = field(default_factory=list)
    # the options beyond strategy/precision/AC/batch (utilities.measure.plan_options.PlanOptions)
    options: dict[str, Any] = field(default_factory=dict)
    # --offload: the host memory per node the offloaded state takes, and whether it fits
    host: dict[str, Any] | None = None
    # the caching allocator's peak beside the tracker's (utilities.measure.allocator)
    reserved: dict[str, int] | None = None
    tp: int = 1  # tensor parallelism inside groups of tp GPUs, FSDP2 across them
    cp: int = 1  # context parallelism: groups of cp GPUs split every sequence, FSDP2 over all
    compile: bool = False  # each block torch.compile-d: saves for backward as AOTAutograd does
    # under compile: one block's bytes saved for backward eager and compiled, what is recomputed
    compile_memory: dict[str, Any] | None = None

    @property
    def theory(self) -> dict[str, dict[str, int]]:
        return model_state_formulas(self.parameters_total, self.strategy, self.gpus, self.shard_size)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def step_config(self) -> StepConfig:
        """The step this plan is of (what the time model takes for it)."""
        return StepConfig(self.gpus, self.strategy, self.precision, self.ac, self.batch, self.seq,
                          self.device_type, self.shard_size,
                          PlanOptions(**self.options) if self.options else None, self.tp, cp=self.cp,
                          compile=self.compile)


def plan(model, gpus: int | StepConfig, gpu_memory_bytes: int, *step: Any, parallelize: Any = None,
         batch_fn: Any = None, **settings: Any) -> Plan:
    """Predict the per-rank peak of one training step by running it on fake tensors.

    The step (``fake_step.StepConfig``): ``gpus`` GPUs, then its other fields by position in
    their order (``strategy``, ``precision``, ``ac``, ``batch``, ``seq``, ``device_type``,
    ``shard_size``, ``options``, ``tp``) or by name (``cp`` too); or ``gpus`` a ``StepConfig``.

    ``hybrid_shard`` (HSDP) runs FSDP2 on a 2-D ``(gpus / shard_size, shard_size)`` mesh: shards
    within a group of ``shard_size`` ranks (default: one node of 8, or all GPUs if fewer),
    replicas across the groups. ``options``: ``PlanOptions`` or a dict of its fields (offload,
    gradient accumulation, reshard_after_forward, frozen/LoRA parameters, bf16 parameters).

    Your own code (``utilities.measure.user_code``): ``model`` may be a function that builds an
    ``nn.Module`` (or ``"FILE.py:FUNCTION"``); ``parallelize`` your sharding function
    ``fn(model, *, mesh, world_size, device, mp_policy)``, traced instead of the course's sequence;
    ``batch_fn`` ``fn(batch, seq) -> (inputs, loss_fn)`` for a forward that does not follow
    Hugging Face's convention.

    ``cp``: context parallelism (``utilities.measure.context_parallel``): groups of ``cp`` GPUs
    run the same ``batch`` sequences, each GPU 1/cp of every sequence's tokens; FSDP2 shards over
    every GPU."""
    config = step_config(gpus, *step, **settings)
    spec = resolve_spec(model, parallelize, batch_fn)
    config, warnings = _checked_plan(spec, config, gpu_memory_bytes, parallelize)
    gpus, strategy, o = config.world, config.strategy, config.options
    device, notes = fake_device(config.device_type)
    if strategy == "no_shard":
        # FSDP2 has no NO_SHARD: nothing is sharded on a 1-rank mesh, as under DDP.
        world, notes = 1, notes + [
            "no_shard (DDP): simulated as 1-rank FSDP2 (every rank holds the whole model) plus "
            "DDP's fp32 gradient buckets, added analytically, minus the gathered parameter copies "
            "FSDP2 makes and DDP does not (an analytic correction, not a DDP measurement)"]
    else:
        world = gpus
    budget = int(gpu_memory_bytes * (1 - HEADROOM))
    floor = _resident_floor(spec.num_parameters, config.shard_size or world, o)
    head = dict(model=spec.name, parameters_total=spec.num_parameters, gpus=gpus,
                gpu_memory_bytes=gpu_memory_bytes, strategy=strategy, precision=config.precision,
                ac=config.ac, batch=config.batch, seq=config.seq, device_type=device.type,
                shard_size=config.shard_size, budget_bytes=budget, notes=notes,
                warnings=warnings, options=o.as_dict(), tp=config.tp, cp=config.cp,
                compile=config.compile)
    if floor["total"] > budget:
        # No need to run anything: what every rank holds at all times already overflows.
        return Plan(**head, peak_bytes=floor, detail={}, fits=False,
                    overflowing=overflowing_category(floor, budget),
                    method="lower bound: parameter shards + AdamW state alone exceed the budget "
                           "(activations not simulated)")
    step = trace(spec, dataclasses.replace(config, world=world, device_type=device.type))
    notes += _trace_notes(step, config)
    cats = categorize(dict(step.peak))
    detail, states = cats.pop("detail"), dict(step.states)
    if strategy == "no_shard":
        _as_ddp(cats, detail, states, spec.num_parameters)
    host, offloaded = (_offload(cats, detail, states, step.largest_unit_shard, gpus, o, notes)
                       if o.offload else (None, set()))
    workspaces = 0
    if config.device_type == "cuda":  # a GPU's step: cuBLAS's workspaces, which no tracker sees
        workspaces, note = cublas_workspaces()
        cats["total"] += workspaces
        detail["cublas_workspaces"] = workspaces
        notes.append(note)
    known = sum(cats[c] for c in ("parameters", "gradients", "optimizer", "activations"))
    cats["temporaries"] = max(0, cats["total"] - known)
    reserved = _reserved(step, offloaded, cats["total"], workspaces)
    fits = cats["total"] <= budget and (host is None or host["fits"])
    if o.grad_accum > 1:
        notes.append(grad_accum_note(o))
    return Plan(
        **head, peak_bytes={k: int(v) for k, v in cats.items()}, detail=detail, fits=fits,
        overflowing=None if cats["total"] <= budget else overflowing_category(cats, budget),
        method="FSDPMemTracker on FakeTensorMode + fake process group", model_states=states,
        host=host, reserved=reserved, compile_memory=_compile_memory(step, config))


def _checked_plan(spec, config: StepConfig, gpu_memory_bytes: int, parallelize: Any
                  ) -> tuple[StepConfig, list[str]]:
    """``config`` checked (one line for a bad value), with hybrid_shard's ``shard_size``, the
    ``seq`` (default: the model's) and the ``options`` (``PlanOptions``) filled in; and the
    warnings the plan's reader must see first."""
    gpus, strategy, precision, ac, tp, cp = (config.world, config.strategy, config.precision,
                                             config.ac, config.tp, config.cp)
    check_plan_step(gpus, gpu_memory_bytes, strategy, precision, ac, config.batch, config.seq)
    shard_size = hybrid_shard_size(strategy, gpus, config.shard_size)
    o = as_options(config.options)
    check_options(o, strategy, precision, shard_size or gpus)
    check_user_code(spec, strategy, ac, o)
    check_tp(spec, tp, gpus, strategy, o)
    seq = config.seq or spec.default_seq_len
    check_cp(spec, cp, gpus, strategy, seq, tp, o, parallelize=parallelize)
    check_tokens(spec, config.batch, seq // cp, precision, gpu_memory_bytes)
    warnings = [*spec.warnings, *context_warnings(spec, seq)]
    if o.param_dtype == "bf16":
        warnings.append(BF16_ACCURACY_NOTE)
    return dataclasses.replace(config, shard_size=shard_size, seq=seq, options=o), warnings


def _trace_notes(step, config: StepConfig) -> list[str]:
    """What the plan's trace assumed: the depths it traced, the fraction trained, TP's loss, CP."""
    o, notes = config.options, []
    if step.traced_layers:
        depths = " and ".join(map(str, step.traced_layers))
        blocks, deep = ("blocks", step.layers) if step.layers else ("blocks per stack", "each stack's depth")
        notes.append(f"traced at {depths} {blocks} and scaled to {deep}: the middle blocks "
                     "are alike, " + ("the memory samples and the reserved memory's replay are "
                                      "extended linearly" if step.reserved_scaled_linearly else
                                      "the middle block's allocations repeated"))
    if o.trainable is not None and o.trainable < 1:
        notes.append(trainable_note(step.units, o.trainable))
    if config.tp > 1:
        notes.append(loss_parallel_note(o.loss_parallel, config.tp))
    if config.cp > 1:
        notes.append(cp_note(config.cp))
    if config.compile:
        from utilities.measure.compile_memory import compile_note

        notes.append(compile_note(step.compiled_regions, config.ac))
    return notes


def _compile_memory(step, config: StepConfig) -> dict[str, Any] | None:
    """Under compile: one (middle) block's bytes saved for backward, eager and compiled, and the
    ops whose saved outputs are recomputed instead (``compile_memory``); None when eager."""
    if not config.compile:
        return None
    from utilities.measure.compile_memory import COMPILE_MEMORY_NOTE

    regions = step.compiled_regions
    block = dict(regions[len(regions) // 2]) if regions else {}
    return {"what": COMPILE_MEMORY_NOTE, "compiled_blocks": len(regions), "per_block": block}


def _as_ddp(cats: dict[str, int], detail: dict[str, int], states: dict[str, int],
            num_parameters: int) -> None:
    """The 1-rank FSDP2 step as DDP holds it: plus DDP's fp32 gradient buckets, minus the
    gathered parameter copies FSDP2 makes and DDP does not."""
    buckets = 4 * num_parameters  # DDP's fp32 gradient buckets, allocated once, kept
    cats["gradients"] += buckets
    cats["total"] += buckets
    states["gradients"] += buckets
    detail["ddp_gradient_buckets"] = buckets
    gathered = detail.get("unsharded_parameters", 0)  # DDP computes with the parameters
    cats["parameters"] -= gathered
    cats["total"] -= gathered
    detail["unsharded_parameters_removed"] = gathered


def grad_accum_note(o: PlanOptions) -> str:
    """What a plan with gradient accumulation traced, and what it holds."""
    return (f"--grad-accum {o.grad_accum} --accum-sync {o.accum_sync}: two micro-batches "
            "traced; the second's forward holds what every later one holds ("
            + ("the sharded gradients, reduce-scattered each micro-batch)" if
               o.accum_sync == "every" else "the unsharded gradients, kept until the "
               "last micro-batch: FSDP2 set_requires_gradient_sync(False), FSDP1 "
               "no_sync())"))


def cp_note(cp: int) -> str:
    """What a CP plan's memory assumes (``context_parallel``)."""
    return (f"context parallelism: each GPU of a CP group holds 1/{cp} of every sequence's tokens "
            "(embeddings, norms, MLP, logits and loss on them) and its attention runs the local "
            "queries over all keys: torch's all-gather rotation (its default, torchtitan's), the "
            "whole sequence's K and V gathered per layer (as the model hands them to attention: "
            "a Llama's K/V heads repeated to the query heads, as Hugging Face's and torchtitan's "
            "Llama do before SDPA), held while its attention runs in forward and again in "
            "backward; autograd keeps only the local q, k, v, output and log-sum-exp")


def loss_parallel_note(loss_parallel: bool, tp: int) -> str:
    """What a 2-D plan assumes of the loss (``PlanOptions.loss_parallel``)."""
    if loss_parallel:
        return (f"loss parallel (torchtitan's default with TP): the LM head's logits stay split "
                f"over the vocabulary, 1/{tp} on each rank of a TP group, and the loss is computed "
                "on the shards (torch.distributed.tensor.parallel.loss_parallel); "
                "--no-loss-parallel gathers the whole logits on every rank")
    return ("--no-loss-parallel: the LM head gathers the whole logits (batch x seq x vocabulary) "
            "on every rank of a TP group before the loss")


def trainable_note(units, asked: float) -> str:
    """What ``--trainable`` planned: whole tensors stay trainable, so the fraction trained is at
    least the one asked and can be far more (a 525M-parameter LM head is 6.5% of llama-8b)."""
    total = trained = 0
    where = []
    for u in units:
        flags = u.trainable or [True] * len(u.shapes)
        n = sum(math.prod(s) for s, t in zip(u.shapes, flags) if t)
        total += u.numel
        trained += n
        if n:
            where.append(u.name)
    shown = ", ".join(where[:4]) + (f" and {len(where) - 4} more" if len(where) > 4 else "")
    return (f"--trainable {asked:g} planned {trained:,} of {total:,} parameters trainable "
            f"({trained / max(total, 1):.2%}): whole tensors, the earliest blocks frozen first, "
            f"at least the fraction asked; trainable tensors in {shown or 'no unit'}")


# the tracker's categories an offloaded rank keeps on the host
OFFLOADED = {"Sharded Param": "sharded_parameters", "Sharded Grad": "sharded_gradients",
             "Optstate": "optimizer", "OptState": "optimizer"}


def _offload(cats: dict[str, int], detail: dict[str, int], states: dict[str, int],
             largest_unit_shard: int, gpus: int, o: PlanOptions, notes: list[str]
             ) -> tuple[dict[str, Any], set[str]]:
    """Move the parameter shards, gradient shards and AdamW state off the GPU's peak (they live on
    the host), add the staging copies of two units' shards (the one gathered and the one
    prefetched), and count the host memory per node."""
    moved = {"parameters": detail.get("sharded_parameters", 0),
             "gradients": detail.get("sharded_gradients", 0), "optimizer": cats["optimizer"]}
    for c, n in moved.items():
        cats[c] -= n
        cats["total"] -= n
    staging = 2 * largest_unit_shard
    cats["parameters"] += staging
    cats["total"] += staging
    detail["offload_staging"] = staging
    detail["offloaded_at_peak"] = sum(moved.values())
    ranks = min(gpus, o.gpus_per_node)
    per_rank = sum(states.values())
    per_node = per_rank * ranks
    notes.append("--offload: parameter shards, gradient shards and AdamW state live on the host "
                 "(FSDP2 CPUOffloadPolicy, FSDP1 CPUOffload(offload_params=True)), planned by "
                 "taking them off the traced peak and adding two units' shards copied to the GPU; "
                 "the optimizer steps on the host")
    host = {"per_rank_bytes": per_rank, "ranks_per_node": ranks, "per_node_bytes": per_node,
            "host_memory_bytes": o.host_memory_bytes,
            "host_memory_source": (HOST_MEMORY_SOURCE if o.host_memory_bytes
                                   == PlanOptions().host_memory_bytes else "--host-memory"),
            "fits": per_node <= o.host_memory_bytes}
    return host, set(OFFLOADED)


def _reserved(step, offloaded: set[str], allocated: int, workspaces: int = 0
              ) -> dict[str, int] | None:
    """The caching allocator's reserved peak for the traced step (``allocator.reserved_peak``),
    plus the cuBLAS workspaces (a segment each, allocated once, kept)."""
    r = step.reserved(frozenset(offloaded))
    if r is None:
        return None
    for k in ("allocated", "reserved", "first_step_reserved"):
        r[k] += workspaces
    r["tracker_allocated"] = int(allocated)
    return r


# torch's default cuBLAS workspace per handle (CUBLAS_WORKSPACE_CONFIG unset: ":4096:8" on sm90 and
# later, ":4096:2:16:8" before), one handle for the forward's thread and one for autograd's
CUBLAS_WORKSPACE_BYTES = {"sm90": 4096 * 2**10 * 8, "before_sm90": 4096 * 2**10 * 2 + 16 * 2**10 * 8}
CUBLAS_HANDLES = 2


def cublas_workspaces() -> tuple[int, str]:
    """Bytes of the cuBLAS workspaces a GPU step allocates through the caching allocator
    (``max_memory_allocated`` counts them, the memory trackers do not), and the plan's note: this
    GPU's generation, or Hopper's where there is none here (the planner's default GPU)."""
    kind, where = "sm90", "Hopper's (no GPU here; the default GPU, an H100)"
    if torch.cuda.is_available():
        try:
            kind = "sm90" if torch.cuda.get_device_capability(0)[0] >= 9 else "before_sm90"
            where = f"this GPU ({kind})"
        except (RuntimeError, AssertionError):  # a CUDA runtime that cannot name its GPU
            pass
    each = CUBLAS_WORKSPACE_BYTES[kind]
    return CUBLAS_HANDLES * each, (
        f"cuBLAS workspaces: {CUBLAS_HANDLES} x {fmt_bytes(each)}, {where}, one for the forward's "
        "thread and one for autograd's, in temporaries: max_memory_allocated counts them, the "
        "trackers do not (on an H200 the lessons' measured peaks were the tracker's plus 64 MiB)")


# The largest memory of one GPU the planner knows (an H200's); no step needing more can run.
LARGEST_GPU = max(GPU_MEMORY_MIB, key=GPU_MEMORY_MIB.get)
LARGEST_GPU_BYTES = GPU_MEMORY_MIB[LARGEST_GPU] * 2**20


class TooManyTokens(UsageError):
    """A batch x seq per rank whose logits alone no GPU could hold (``need_bytes``)."""

    def __init__(self, message: str, need_bytes: int):
        super().__init__(message)
        self.need_bytes = need_bytes


def check_tokens(spec, batch: int, seq: int, precision: str, gpu_memory_bytes: int) -> None:
    """Refuse, before tracing, a batch x seq per rank that no GPU could hold in a step: the
    logits alone (batch x seq x vocabulary, 2 bytes each in bf16, 4 in fp32) and the token ids
    (8 bytes each) exceed the larger of the largest GPU the planner knows and ``--gpu-memory``."""
    vocab = getattr(spec.config(), "vocab_size", None)
    if not isinstance(vocab, int) or vocab < 1:
        return
    per_logit = 2 if precision == "bf16" else 4
    per_token = vocab * per_logit + 8
    cap = max(LARGEST_GPU_BYTES, gpu_memory_bytes)
    if batch * seq * per_token <= cap:
        return
    raise TooManyTokens(
        f"--batch {batch} x --seq {seq} is not allowed: {batch * seq:,} tokens per rank need "
        f"{fmt_bytes(batch * seq * per_token)} for their logits and ids alone ({vocab:,} x "
        f"{per_logit} + 8 bytes per token), more than any GPU holds (the largest the planner knows: "
        f"{LARGEST_GPU}, {fmt_bytes(LARGEST_GPU_BYTES)}); allowed: batch x seq <= "
        f"{cap // per_token:,} tokens per rank", batch * seq * per_token)


def context_warnings(spec, seq: int) -> list[str]:
    """A warning when ``seq`` is past the model's context (``max_position_embeddings``)."""
    limit = getattr(spec.config(), "max_position_embeddings", None)
    if not isinstance(limit, int) or isinstance(limit, bool) or not 0 < limit < seq:
        return []
    return [f"--seq {seq:,} is past the model's context (max_position_embeddings {limit:,}): planned "
            "as asked, but a model with learned positions (GPT-2, BERT) cannot run it and one with "
            "rotary positions was not trained for it"]


def hybrid_shard_size(strategy: str, gpus: int, shard_size: int | None) -> int | None:
    """hybrid_shard's shard group size (checked; ``gpus`` already is), None for the others."""
    if strategy != "hybrid_shard":
        if shard_size is not None:
            raise bad_value("--shard-size", shard_size, "only with --strategy hybrid_shard")
        return None
    if shard_size is None:
        shard_size = min(gpus, NODE_GPUS)
    if not isinstance(shard_size, int) or shard_size < 1 or gpus % shard_size:
        raise bad_value("--shard-size", shard_size, f"a divisor of --gpus ({gpus})")
    return shard_size


def _resident_floor(num_parameters: int, world: int, o: PlanOptions | None = None) -> dict[str, int]:
    """Bytes every rank holds for the whole step, whatever the batch: its parameter shard (4
    bytes per parameter / world, 2 in bf16) and AdamW's two moments (8 bytes / world, 4 in bf16;
    only the trainable ones'; none on the GPU with --offload). The peak is at least this much
    (gradients and activations come on top, at some point of the step)."""
    o = o or PlanOptions()
    shard = -(-num_parameters // world)
    item = 2 if o.param_dtype == "bf16" else 4
    trained = 0 if o.lora_rank is not None else (o.trainable or 1)
    on_gpu = 0 if o.offload else 1
    cats = {"parameters": item * shard * on_gpu, "gradients": 0,
            "optimizer": int(2 * item * shard * trained) * on_gpu, "activations": 0,
            "temporaries": 0}
    cats["total"] = sum(cats.values())
    return cats


def model_state_formulas(num_parameters: int, strategy: str, gpus: int,
                         shard_size: int | None = None) -> dict[str, dict[str, int]]:
    """Bytes per rank of parameters, gradients and AdamW state by formula, two ways.

    ``fsdp2``: what FSDP2 keeps between steps under any precision policy: fp32 parameter shards
    (4 bytes per parameter), fp32 gradient shards (4) and AdamW's two fp32 moments (8): 16 bytes
    per parameter over the ranks that shard (all of them for full_shard and shard_grad_op, the
    shard group for hybrid_shard, one for no_shard, where DDP's fp32 gradient buckets add 4 more).
    ``zero``: the ZeRO paper's mixed-precision split (Rajbhandari et al. 2020, Figure 1): fp16
    parameters (2) and gradients (2), fp32 master weights + moments (12); stage 3 shards all
    three, stage 2 (shard_grad_op) keeps the fp16 parameters whole, stage 0 (no_shard) shards
    nothing. Same 16 bytes in total for stage 3, split differently. What no formula holds: the
    units unsharded at the peak, activations, logits and the collectives' buffers.
    """
    n = {"no_shard": 1, "hybrid_shard": shard_size or min(gpus, NODE_GPUS)}.get(strategy, gpus)
    per = -(-num_parameters // n)
    fsdp2 = {"parameters": 4 * per, "gradients": 4 * per + (4 * num_parameters if n == 1 and
                                                             strategy == "no_shard" else 0),
             "optimizer": 8 * per}
    zero_params = 2 * num_parameters if strategy in ("shard_grad_op", "no_shard") else 2 * per
    zero = {"parameters": zero_params, "gradients": 2 * per, "optimizer": 12 * per}
    for d in (fsdp2, zero):
        d["total"] = d["parameters"] + d["gradients"] + d["optimizer"]
    return {"fsdp2": fsdp2, "zero": zero}


def overflowing_category(cats: dict[str, int], budget: int) -> str:
    """The category that overflows: the largest one, i.e. the one that alone takes the biggest
    share of the budget (the first one to cut: shard it, checkpoint it, or shrink the batch)."""
    return max(CATEGORY_ORDER, key=lambda c: cats.get(c, 0))


def check_plan_step(gpus, gpu_memory_bytes, strategy, precision, ac, batch, seq) -> None:
    if gpu_memory_bytes < 1:
        raise bad_value("--gpu-memory", gpu_memory_bytes, "sizes > 0")
    check_step(gpus, strategy, precision, ac, batch, seq)


def largest_batch(model, gpus: int | StepConfig, gpu_memory_bytes: int, *, limit: int = 4096,
                  parallelize: Any = None, batch_fn: Any = None, **settings: Any
                  ) -> tuple[int, Plan | None]:
    """The largest per-rank batch that fits (0 when even batch 1 does not), and its plan: the
    step as ``plan`` takes it (``gpus`` a ``StepConfig``, or the number of GPUs and the step's
    other fields by name), at most ``limit``.

    Memory grows about linearly with the batch (parameters and optimizer state are fixed,
    activations and logits come per sample): plans at batch 1 and 2 draw a line, the next plan is
    the batch where that line meets the budget. When that plan lies on the line (within 0.1%) and
    the line puts the next batch over, the answer is exact in 3 traced steps. Otherwise each new
    plan redraws the line through the last two and the search narrows between the largest batch
    known to fit and the smallest known not to (secant steps inside a bracket).
    """
    config = step_config(gpus, **settings)

    def run(b: int) -> Plan:
        try:
            return plan(model, dataclasses.replace(config, batch=b), gpu_memory_bytes,
                        parallelize=parallelize, batch_fn=batch_fn)
        except TooManyTokens as e:  # batch 1 is refused; a larger batch does not fit
            if b == 1:
                raise
            return Plan(**dict(first.as_dict(), batch=b, fits=False,
                               peak_bytes=dict(first.peak_bytes, total=e.need_bytes)))

    first = run(1)
    if not first.fits or limit == 1:
        return (1 if first.fits else 0), first
    budget = first.budget_bytes
    points = [(1, first.peak_bytes["total"])]
    good, good_plan, bad = 1, first, None
    guess = 2
    while True:
        p = run(guess)
        total = p.peak_bytes["total"]
        predicted = _on_line(points[-2:], guess) if len(points) >= 2 else None
        points.append((guess, total))
        if p.fits:
            good, good_plan = guess, p
        else:
            bad = guess
        if (bad is not None and bad - good <= 1) or good >= limit:
            return good, good_plan
        (b0, t0), (b1, t1) = points[-2:]
        slope = (t1 - t0) / (b1 - b0)
        if (p.fits and predicted is not None and abs(total - predicted) <= 1e-3 * predicted
                and total + slope > budget):
            p.notes.append(f"largest batch from the line through batches {points[-3][0]} and "
                           f"{b0} ({fmt_bytes(slope)} per sample), checked at batch {guess}")
            return guess, p
        nxt = guess + int((budget - total) // slope) if slope > 0 else 2 * good
        guess = max(good + 1, min(nxt, bad - 1 if bad is not None else limit))


def _on_line(two: list[tuple[int, int]], batch: int) -> float:
    """The total the line through two (batch, total) points gives at ``batch``."""
    (b0, t0), (b1, t1) = two
    return t1 + (t1 - t0) / (b1 - b0) * (batch - b1)
