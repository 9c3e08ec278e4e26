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

import argparse
import json
import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from utilities.errors import OneLineParser, UsageError, bad_value
from utilities.measure import categorize, fmt_bytes
from utilities.measure.context_parallel import check_cp
from utilities.measure.fake_step import (
    PRECISIONS,
    STRATEGIES,
    StepConfig,
    check_step,
    check_tp,
    fake_device,
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
    is_function_ref,
    planned_spec,
    resolve_spec,
)
from utilities.models import get_model_spec
from utilities.text import rate_text, wrap_lines

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

    @property
    def theory(self) -> dict[str, dict[str, int]]:
        return model_state_formulas(self.parameters_total, self.strategy, self.gpus, self.shard_size)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def plan(model: str, gpus: int, gpu_memory_bytes: int, strategy: str = "full_shard",
         precision: str = "bf16", ac: str = "none", batch: int = 1, seq: int | None = None,
         device_type: str = "cuda", shard_size: int | None = None,
         options: PlanOptions | dict[str, Any] | None = None, tp: int = 1,
         parallelize: Any = None, batch_fn: Any = None, cp: int = 1) -> Plan:
    """Predict the per-rank peak of one training step by running it on fake tensors.

    ``hybrid_shard`` (HSDP) runs FSDP2 on a 2-D ``(gpus / shard_size, shard_size)`` mesh: shards
    within a group of ``shard_size`` ranks (default: one node of 8, or all GPUs if fewer),
    replicas across the groups. ``options``: ``PlanOptions`` or a dict of its fields (offload,
    gradient accumulation, reshard_after_forward, frozen/LoRA parameters, bf16 parameters).

    Your own code (``utilities.measure.user_code``): ``model`` may be a function that builds an
    ``nn.Module`` (or ``"FILE.py:FUNCTION"``); ``parallelize`` your sharding function
    ``fn(model, *, mesh, world_size, device)``, traced instead of the course's sequence;
    ``batch_fn`` ``fn(batch, seq) -> (inputs, loss_fn)`` for a forward that does not follow
    Hugging Face's convention.

    ``cp``: context parallelism (``utilities.measure.context_parallel``): groups of ``cp`` GPUs
    run the same ``batch`` sequences, each GPU 1/cp of every sequence's tokens; FSDP2 shards over
    every GPU."""
    spec = resolve_spec(model, parallelize, batch_fn)
    _check(gpus, gpu_memory_bytes, strategy, precision, ac, batch, seq)
    shard_size = _shard_size(strategy, gpus, shard_size)
    o = as_options(options)
    check_options(o, strategy, precision, shard_size or gpus)
    check_user_code(spec, strategy, ac, o)
    check_tp(spec, tp, gpus, strategy, o)
    seq = seq or spec.default_seq_len
    check_cp(spec, cp, gpus, strategy, seq, tp, o, parallelize=parallelize)
    check_tokens(spec, batch, seq // cp, precision, gpu_memory_bytes)
    warnings = [*spec.warnings, *context_warnings(spec, seq)]
    if o.param_dtype == "bf16":
        warnings.append(BF16_ACCURACY_NOTE)
    device, notes = fake_device(device_type)
    if strategy == "no_shard":
        # FSDP2 has no NO_SHARD: nothing is sharded on a 1-rank mesh, as under DDP.
        world, notes = 1, notes + [
            "no_shard (DDP): simulated as 1-rank FSDP2 (every rank holds the whole model) plus "
            "DDP's fp32 gradient buckets, added analytically, minus the gathered parameter copies "
            "FSDP2 makes and DDP does not (an analytic correction, not a DDP measurement)"]
    else:
        world = gpus
    budget = int(gpu_memory_bytes * (1 - HEADROOM))
    floor = _resident_floor(spec.num_parameters, shard_size or world, o)
    if floor["total"] > budget:
        # No need to run anything: what every rank holds at all times already overflows.
        return Plan(
            model=spec.name, parameters_total=spec.num_parameters, gpus=gpus,
            gpu_memory_bytes=gpu_memory_bytes, strategy=strategy, precision=precision, ac=ac,
            batch=batch, seq=seq, device_type=device.type, shard_size=shard_size,
            peak_bytes=floor, detail={},
            budget_bytes=budget, fits=False, overflowing=_overflowing(floor, budget),
            method="lower bound: parameter shards + AdamW state alone exceed the budget "
                   "(activations not simulated)", notes=notes, warnings=warnings,
            options=o.as_dict(), tp=tp, cp=cp)
    step = trace(spec, StepConfig(world, strategy, precision, ac, batch, seq, device.type, shard_size,
                                  o, tp, cp=cp))
    snap, states = dict(step.peak), dict(step.states)
    if step.traced_layers:
        depths = " and ".join(map(str, step.traced_layers))
        notes.append(f"traced at {depths} blocks and scaled to {step.layers}: the middle blocks "
                     "are alike, " + ("the memory samples and the reserved memory's replay are "
                                      "extended linearly" if step.reserved_scaled_linearly else
                                      "the middle block's allocations repeated"))
    if o.trainable is not None and o.trainable < 1:
        notes.append(trainable_note(step.units, o.trainable))
    if tp > 1:
        notes.append(loss_parallel_note(o.loss_parallel, tp))
    if cp > 1:
        notes.append(cp_note(cp))
    cats = categorize(snap)
    detail = cats.pop("detail")
    if strategy == "no_shard":
        buckets = 4 * spec.num_parameters  # DDP's fp32 gradient buckets, allocated once, kept
        cats["gradients"] += buckets
        cats["total"] += buckets
        states["gradients"] += buckets
        detail["ddp_gradient_buckets"] = buckets
        gathered = detail.get("unsharded_parameters", 0)  # DDP computes with the parameters
        cats["parameters"] -= gathered
        cats["total"] -= gathered
        detail["unsharded_parameters_removed"] = gathered
    host = None
    offloaded = set()
    if o.offload:
        host, offloaded = _offload(cats, detail, states, step.largest_unit_shard, gpus, o, notes)
    workspaces = 0
    if device_type == "cuda":  # a GPU's step: cuBLAS's workspaces, which no tracker sees
        workspaces, note = cublas_workspaces()
        cats["total"] += workspaces
        detail["cublas_workspaces"] = workspaces
        notes.append(note)
    known = sum(cats[c] for c in ("parameters", "gradients", "optimizer", "activations"))
    cats["temporaries"] = max(0, cats["total"] - known)
    reserved = _reserved(step, offloaded, cats["total"], workspaces)
    fits = cats["total"] <= budget and (host is None or host["fits"])
    if o.grad_accum > 1:
        notes.append(f"--grad-accum {o.grad_accum} --accum-sync {o.accum_sync}: two micro-batches "
                     "traced; the second's forward holds what every later one holds ("
                     + ("the sharded gradients, reduce-scattered each micro-batch)" if
                        o.accum_sync == "every" else "the unsharded gradients, kept until the "
                        "last micro-batch: FSDP2 set_requires_gradient_sync(False), FSDP1 "
                        "no_sync())"))
    return Plan(
        model=spec.name, parameters_total=spec.num_parameters, gpus=gpus,
        gpu_memory_bytes=gpu_memory_bytes, strategy=strategy, precision=precision, ac=ac,
        batch=batch, seq=seq, device_type=device.type, shard_size=shard_size,
        peak_bytes={k: int(v) for k, v in cats.items()}, detail=detail, budget_bytes=budget,
        fits=fits, overflowing=None if cats["total"] <= budget else _overflowing(cats, budget),
        method="FSDPMemTracker on FakeTensorMode + fake process group", notes=notes,
        model_states=states, warnings=warnings, options=o.as_dict(), host=host,
        reserved=reserved, tp=tp, cp=cp)


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


def _shard_size(strategy: str, gpus: int, shard_size: int | None) -> int | None:
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


def _overflowing(cats: dict[str, int], budget: int) -> str:
    """The category that overflows: the largest one, i.e. the one that alone takes the biggest
    share of the budget (the first one to cut: shard it, checkpoint it, or shrink the batch)."""
    return max(CATEGORY_ORDER, key=lambda c: cats.get(c, 0))


def _check(gpus, gpu_memory_bytes, strategy, precision, ac, batch, seq) -> None:
    if gpu_memory_bytes < 1:
        raise bad_value("--gpu-memory", gpu_memory_bytes, "sizes > 0")
    check_step(gpus, strategy, precision, ac, batch, seq)


def largest_batch(model: str, gpus: int, gpu_memory_bytes: int, strategy: str = "full_shard",
                  precision: str = "bf16", ac: str = "none", seq: int | None = None,
                  device_type: str = "cuda", limit: int = 4096,
                  shard_size: int | None = None,
                  options: PlanOptions | dict[str, Any] | None = None,
                  tp: int = 1, parallelize: Any = None, batch_fn: Any = None, cp: int = 1
                  ) -> tuple[int, Plan | None]:
    """The largest per-rank batch that fits (0 when even batch 1 does not), and its plan.

    Memory grows about linearly with the batch (parameters and optimizer state are fixed,
    activations and logits come per sample): plans at batch 1 and 2 draw a line, the next plan is
    the batch where that line meets the budget. When that plan lies on the line (within 0.1%) and
    the line puts the next batch over, the answer is exact in 3 traced steps. Otherwise each new
    plan redraws the line through the last two and the search narrows between the largest batch
    known to fit and the smallest known not to (secant steps inside a bracket).
    """
    def run(b: int) -> Plan:
        try:
            extra = {} if options is None else {"options": options}
            return plan(model, gpus, gpu_memory_bytes, strategy, precision, ac, b, seq, device_type,
                        shard_size, tp=tp, parallelize=parallelize, batch_fn=batch_fn, cp=cp, **extra)
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


# -- sweeps ---------------------------------------------------------------------------------------

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
                       overflowing=None if cats["total"] <= budget else _overflowing(cats, budget),
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


def format_sweep(plans: list[Plan]) -> str:
    """One row per strategy, one column per GPU count: the planned peak per GPU, '*' when it does
    not fit."""
    counts = sorted({p.gpus for p in plans})
    strategies = list(dict.fromkeys(p.strategy for p in plans))
    first = plans[0]
    lines = [f"{first.model}, {first.precision}, AC {first.ac}, batch {first.batch} x {first.seq} per "
             f"rank: peak per GPU (GiB)",
             f"budget {first.budget_bytes / 2**30:.1f} GiB; * = does not fit",
             f"{'strategy':<14}" + "".join(f"{n:>9}" for n in counts)]
    for strategy in strategies:
        row = {p.gpus: p for p in plans if p.strategy == strategy}
        cells = "".join(f"{row[n].peak_bytes['total'] / 2**30:>8.1f}{' ' if row[n].fits else '*'}"
                        for n in counts)
        lines.append(f"{strategy:<14}{cells}".rstrip())
    if all(p.time for p in plans):
        lines += ["", f"tokens/s per GPU, PREDICTED by the time model on {plans[0].time['gpu']} "
                      "(not measured); * = does not fit in memory",
                  f"{'strategy':<14}" + "".join(f"{n:>9}" for n in counts)]
        for strategy in strategies:
            row = {p.gpus: p for p in plans if p.strategy == strategy}
            lines.append((f"{strategy:<14}" + "".join(
                f"{rate_text(row[n].time['tokens_per_s_per_gpu']):>8}{' ' if row[n].fits else '*'}"
                for n in counts)).rstrip())
    lines += [f"warning: {w}" for w in dict.fromkeys(w for p in plans for w in p.warnings)]
    methods = sorted({p.method for p in plans})
    lines += [f"method: {m}" for m in methods]
    return "\n".join(lines)


# -- command line ----------------------------------------------------------------------------------

PLAN_DESCRIPTION = (
    "Predict the peak memory per GPU, by category (parameters, gradients, optimizer state, "
    "activations), of one training step of a named model on N GPUs, on this machine and without "
    "them: the model is built under FakeTensorMode with a fake process group and the real FSDP2 "
    "step runs under PyTorch's memory tracker. Says whether it fits (90% of --gpu-memory) and, "
    "with --max-batch, the largest batch that does (lesson 14).")


def add_plan_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of ``fsdp-course plan``."""
    parser.add_argument("--model", default="llama-8b",
                        help="a course model (see `fsdp-course list --models`), or your own: a "
                        "Hugging Face config.json or a folder holding one (built with random "
                        "weights on meta; nothing downloaded), or FILE.py:FUNCTION, your "
                        "function that builds the nn.Module (your code, imported as `python "
                        "FILE.py` would); default llama-8b")
    parser.add_argument("--gpus", default="8", help="number of GPUs (ranks); default 8")
    parser.add_argument("--gpu-memory", default="auto",
                        help="memory per GPU: a GPU name (" + ", ".join(GPU_MEMORY_MIB) + "), its "
                        "real size; or a size with its unit: 80GiB (2^30), 80GB (10^9 bytes: 74.5 GiB, "
                        "less than an '80GB' card), 24e9B; default auto: this machine's GPU, else an h100")
    parser.add_argument("--strategy", default="full_shard",
                        help=f"one of {', '.join(STRATEGIES)}; default full_shard")
    parser.add_argument("--shard-size", default=None,
                        help="hybrid_shard only: GPUs that shard among themselves, a divisor of "
                             f"--gpus (default {NODE_GPUS}, one node, or --gpus if fewer)")
    parser.add_argument("--tp", default="1",
                        help="tensor parallelism: GPUs per TP group (a divisor of --gpus and of a "
                        "node's), FSDP2 across the groups (2-D, as torchtitan; Llama models); "
                        "--batch is then one group's; default 1 (FSDP only)")
    parser.add_argument("--cp", default="1",
                        help="context parallelism: GPUs per CP group (a divisor of --gpus and of a "
                        "node's), each running 1/cp of every sequence's tokens, K/V all-gathered "
                        "per layer (torch's context_parallel default), FSDP2 over every GPU (as "
                        "torchtitan; causal decoders; --seq a multiple of 2 x cp); --batch is then "
                        "one CP group's; default 1")
    parser.add_argument("--no-loss-parallel", action="store_true",
                        help="with --tp: gather the whole logits on every rank of a TP group "
                        "(default: loss parallel, torchtitan's, the LM head's logits split over "
                        "the vocabulary and the loss computed on the shards)")
    parser.add_argument("--precision", default="bf16", help=f"one of {', '.join(PRECISIONS)}")
    parser.add_argument("--ac", default="none",
                        help="activation checkpointing: none; selective (op-level, as torchtitan: "
                        "keep matmul and attention outputs, recompute the rest); op (torchtitan's "
                        "own save list, as its Llama 3 runs); every-2nd-block "
                        "(block-level, lesson 02's 'selective'); full (every block)")
    parser.add_argument("--batch", default="1",
                        help="per-rank batch size (with --tp: per TP group, whose ranks all run "
                        "the same tokens; with --cp: per CP group, whose ranks split the same "
                        "sequences); default 1")
    parser.add_argument("--seq", default=None, help="sequence length (default: the model's)")
    parser.add_argument("--gpu", default=None,
                        help="the GPU the step time is predicted for (h100, h100-96gb, h200, "
                        "a100-80gb, a100-40gb, l4); also its memory when --gpu-memory is auto; "
                        "default: h100")
    parser.add_argument("--gpus-per-node", default="8",
                        help="GPUs per node on NVLink (the network links the nodes); default 8")
    parser.add_argument("--network-gbps", default="400",
                        help="network bandwidth per GPU between nodes, Gb/s; default 400")
    parser.add_argument("--compile", action="store_true",
                        help="predict the step time with torch.compile per block")
    parser.add_argument("--fp8", action="store_true",
                        help="predict the step time with Float8 linears and FP8 all-gathers")
    parser.add_argument("--calibrate", action="store_true",
                        help="on a GPU: measure the time model's efficiencies (a bf16 matmul, "
                        "attention, a memory-bound op; under a minute) on GPU 0 (its part named "
                        "from the GPU, or --gpu) and save them to --calibration (default "
                        "calibration.json), then stop")
    parser.add_argument("--calibration", default=None, metavar="FILE",
                        help="predict with the efficiencies a --calibrate run saved in FILE "
                        "(default: the committed ones, fitted on published figures)")
    parser.add_argument("--no-time", action="store_true",
                        help="memory only: skip the step-time prediction (one trace fewer)")
    parser.add_argument("--max-batch", action="store_true",
                        help="find the largest per-rank batch that fits instead")
    parser.add_argument("--sweep", action="store_true",
                        help="plan every strategy of " + ", ".join(SWEEP_STRATEGIES) + " on "
                        + ", ".join(map(str, SWEEP_GPUS)) + " GPUs (ignores --gpus and --strategy): "
                        "a table of the peak per GPU and whether it fits")
    parser.add_argument("--offload", action="store_true",
                        help="parameters, gradients and optimizer state on the host (FSDP2 "
                        "CPUOffloadPolicy, FSDP1 CPUOffload): the GPU holds what is gathered and "
                        "the activations; the time adds PCIe copies and AdamW on the host CPU")
    parser.add_argument("--host-memory", default=None,
                        help="--offload: host memory per node, a size with its unit (default "
                        + HOST_MEMORY_SOURCE + ")")
    parser.add_argument("--grad-accum", default="1", metavar="N",
                        help="micro-batches per optimizer step (--batch each); default 1")
    parser.add_argument("--accum-sync", default="every",
                        help="with --grad-accum: every (reduce-scatter each micro-batch; sharded "
                        "gradients held) or last (set_requires_gradient_sync(False) / no_sync(): "
                        "unsharded gradients held to the last); default every")
    parser.add_argument("--reshard-after-forward", default=None,
                        help="true, false, or N: reshard to groups of N ranks after forward "
                        "(default: the strategy's own: full_shard true, shard_grad_op false)")
    parser.add_argument("--trainable", default=None, metavar="FRACTION",
                        help="train only FRACTION of the parameters (the earliest blocks frozen "
                        "first): gradients and optimizer state for those only")
    parser.add_argument("--lora-rank", default=None, metavar="R",
                        help="LoRA: every parameter frozen, rank-R adapters on the blocks' "
                        "nn.Linear layers trained")
    parser.add_argument("--param-dtype", default="fp32",
                        help="fp32 (default: fp32 master parameters) or bf16 (the model stored in "
                        "bf16, no fp32 masters: half the state, lost small updates)")
    parser.add_argument("--parallelize", default=None, metavar="FILE.py:FUNCTION",
                        help="plan your own sharding function, FUNCTION(model, *, mesh, "
                        "world_size, device) in your FILE.py (imported as `python FILE.py` would; "
                        "its module level runs), instead of the course's: it shards the model "
                        "as your training script does, on the fake process group of --gpus ranks")
    parser.add_argument("--batch-fn", default=None, metavar="FILE.py:FUNCTION",
                        help="with --model FILE.py:FUNCTION whose forward is not Hugging Face's "
                        "(input_ids, labels -> loss): FUNCTION(batch, seq) returns (inputs, "
                        "loss_fn)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--trace", default=None, metavar="FILE.json",
                        help="also write the predicted step's timeline (compute and communication "
                             "lanes, a slice per unit's forward, backward and collective) as a Chrome "
                             "trace that Perfetto or chrome://tracing opens")
    return parser


def options_from_args(args: argparse.Namespace) -> PlanOptions:
    """The ``PlanOptions`` the flags name (each checked; one line for a bad one)."""
    from utilities.measure.plan_options import parse_fraction, parse_reshard

    host = getattr(args, "host_memory", None)
    o = PlanOptions(
        offload=bool(getattr(args, "offload", False)),
        grad_accum=_int_arg("--grad-accum", getattr(args, "grad_accum", "1")),
        accum_sync=str(getattr(args, "accum_sync", "every")),
        reshard_after_forward=parse_reshard(getattr(args, "reshard_after_forward", None)),
        trainable=parse_fraction("--trainable", getattr(args, "trainable", None)),
        lora_rank=_int_arg("--lora-rank", getattr(args, "lora_rank", None)),
        param_dtype=str(getattr(args, "param_dtype", "fp32")),
        host_memory_bytes=(parse_memory(host, "--host-memory") if host is not None
                           else PlanOptions().host_memory_bytes),
        gpus_per_node=_int_arg("--gpus-per-node", getattr(args, "gpus_per_node", "8")),
        loss_parallel=not getattr(args, "no_loss_parallel", False))
    check_options(o)
    return o


def _int_arg(flag: str, text: str | None) -> int | None:
    if text is None:
        return None
    try:
        value = int(text)
    except (TypeError, ValueError):
        raise bad_value(flag, text, "integers >= 1") from None
    if value < 1:
        raise bad_value(flag, text, "integers >= 1")
    return value


def _float_arg(flag: str, text: str) -> float:
    import math

    try:
        value = float(text)
    except (TypeError, ValueError):
        value = float("nan")
    if not math.isfinite(value) or value <= 0:
        raise bad_value(flag, text, "finite numbers > 0")
    return value


def time_options(args: argparse.Namespace) -> dict[str, Any] | None:
    """The step-time model's options from the flags (checked), or None with --no-time."""
    from utilities.measure.step_time import get_gpu

    gpu = get_gpu(args.gpu or "h100")
    if getattr(args, "no_time", False):
        return None
    options = dict(gpu=gpu.name, gpus_per_node=_int_arg("--gpus-per-node", args.gpus_per_node),
                   network_gbps=_float_arg("--network-gbps", args.network_gbps),
                   compile=bool(args.compile), fp8=bool(args.fp8))
    if getattr(args, "calibration", None):
        from utilities.measure.calibrate import load_efficiencies

        options["efficiencies"] = load_efficiencies(args.calibration)
    return options


def resolve_memory_for(args: argparse.Namespace) -> tuple[int, str]:
    """--gpu-memory, or with it left at auto, the memory of the --gpu part."""
    if args.gpu and str(args.gpu_memory).strip().lower() == "auto":
        from utilities.measure.step_time import get_gpu

        gpu = get_gpu(args.gpu)
        if gpu.name in GPU_MEMORY_MIB:
            return resolve_gpu_memory(gpu.name)
        return gpu.memory_bytes, f"{gpu.name} (--gpu): {gpu.memory_bytes / 2**30:.2f} GiB"
    return resolve_gpu_memory(args.gpu_memory)


def predict_time(p: Plan, options: dict[str, Any]):
    """The step-time prediction for plan ``p``'s configuration (a ``StepTime``)."""
    from utilities.measure.step_time import estimate_step_time

    return estimate_step_time(planned_spec(p.model), p.gpus, p.strategy, p.precision, p.ac, p.batch,
                              p.seq, shard_size=p.shard_size,
                              plan_options=PlanOptions(**p.options) if p.options else None,
                              tp=p.tp, cp=p.cp, **options)


def plan_from_args(args: argparse.Namespace) -> tuple[Plan, int | None]:
    gpu_memory_bytes, source = resolve_memory_for(args)
    options = time_options(args)
    kw = dict(model=args.model, gpus=_int_arg("--gpus", args.gpus),
              gpu_memory_bytes=gpu_memory_bytes, strategy=args.strategy,
              precision=args.precision, ac=args.ac, seq=_int_arg("--seq", args.seq),
              shard_size=_int_arg("--shard-size", args.shard_size), tp=_int_arg("--tp", args.tp),
              cp=_int_arg("--cp", getattr(args, "cp", "1")))
    batch = _int_arg("--batch", args.batch)
    yours = dict(parallelize=getattr(args, "parallelize", None), batch_fn=getattr(args, "batch_fn", None))
    spec = resolve_spec(kw["model"], **yours)  # the user's files imported here, once
    kw["model"] = spec
    _check(kw["gpus"], kw["gpu_memory_bytes"], kw["strategy"], kw["precision"], kw["ac"], batch,
           kw["seq"])
    _shard_size(kw["strategy"], kw["gpus"], kw["shard_size"])
    kw["options"] = options_from_args(args)
    check_options(kw["options"], kw["strategy"], kw["precision"],
                  _shard_size(kw["strategy"], kw["gpus"], kw["shard_size"]) or kw["gpus"])
    check_tp(spec, kw["tp"], kw["gpus"], kw["strategy"], kw["options"],
             _int_arg("--gpus-per-node", args.gpus_per_node) if options is not None else None)
    check_cp(spec, kw["cp"], kw["gpus"], kw["strategy"], kw["seq"] or spec.default_seq_len, kw["tp"],
             kw["options"], _int_arg("--gpus-per-node", args.gpus_per_node) if options is not None
             else None, parallelize=yours["parallelize"])
    if getattr(args, "trace", None):  # a FIFO or a device there: one line before the plan runs
        from utilities.safe_files import check_output_file

        check_output_file(args.trace, "--trace")
    if args.max_batch:
        best, p = largest_batch(**kw)
    else:
        best, p = None, plan(batch=batch, **kw)
    p.gpu_memory_source = source
    trace = getattr(args, "trace", None)
    if trace and options is None:
        raise UsageError("--trace is not allowed with --no-time; allowed: --trace FILE.json with the "
                         "step-time prediction on")
    if options is not None and p.detail:
        step = predict_time(p, options)
        p.time = step.as_dict()
        if trace:
            write_trace(step, trace)
    return p, best


def write_trace(step, path: str) -> None:
    """The predicted step as a Chrome trace at ``path`` (``step_time.chrome_trace``); one line if
    it cannot be written."""
    from utilities.measure.step_time import chrome_trace
    from utilities.safe_files import atomic_write_text

    try:
        atomic_write_text(path, json.dumps(chrome_trace(step)), "--trace")
    except OSError as e:
        raise UsageError(f"--trace {path!r} is not allowed: {e.strerror}; allowed: a writable "
                         "file path") from None


def format_plan(p: Plan, largest: int | None = None) -> str:
    theory = p.theory
    lines = [f"{p.model} ({p.parameters_total:,} parameters) on {p.gpus} x "
             f"{fmt_bytes(p.gpu_memory_bytes)}: {p.strategy}"
             f"{f' (shard groups of {p.shard_size})' if p.shard_size else ''}"
             f"{f' across TP groups of {p.tp}' if p.tp > 1 else ''}"
             f"{f' with CP groups of {p.cp}' if p.cp > 1 else ''}, {p.precision}, "
             f"AC {p.ac}, batch {p.batch} x seq {p.seq} "
             + (f"per CP group (each of its {p.cp} ranks runs 1/{p.cp} of every sequence's tokens"
                + (f"; a TP group of {p.tp} per CP rank" if p.tp > 1 else "") + ")" if p.cp > 1 else
                f"per TP group (each of its {p.tp} ranks runs these tokens)" if p.tp > 1 else
                "per rank"),
             f"{'category':<13}{'peak per rank' if p.detail else 'at least':>14}{'share':>7}"
             f"{'FSDP2 formula':>15}{'ZeRO paper':>12}"]
    total = max(p.peak_bytes["total"], 1)
    for c in CATEGORY_ORDER:
        mark = "  <- overflows" if c == p.overflowing else ""
        fsdp2, zero = (fmt_bytes(theory[k][c]) if c in theory[k] else "-" for k in ("fsdp2", "zero"))
        lines.append(f"{c:<13}{fmt_bytes(p.peak_bytes[c]):>14}{p.peak_bytes[c] / total:>7.0%}"
                     f"{fsdp2:>15}{zero:>12}{mark}")
    lines.append(f"{'total':<13}{fmt_bytes(p.peak_bytes['total']):>14}{1:>7.0%}"
                 f"{fmt_bytes(theory['fsdp2']['total']):>15}{fmt_bytes(theory['zero']['total']):>12}")
    lines.append(temporaries_line(p))
    lines.append(model_states_line(p))
    lines += options_lines(p)
    if p.gpu_memory_source:
        lines.append(f"GPU memory: {p.gpu_memory_bytes / 2**30:.2f} GiB per GPU "
                     f"({p.gpu_memory_source})")
    lines.append(f"budget: {fmt_bytes(p.budget_bytes)} ({1 - HEADROOM:.0%} of "
                 f"{fmt_bytes(p.gpu_memory_bytes)}; the rest is headroom for the CUDA context, "
                 "NCCL and fragmentation)")
    if largest is not None:
        verdict = (f"largest batch that fits: {largest}" if largest else
                   f"does NOT fit even at batch 1: {p.overflowing} is the biggest category")
    elif p.fits:
        verdict = f"FITS: {p.peak_bytes['total'] / p.budget_bytes:.0%} of the budget"
    else:
        verdict = (f"does NOT fit: {p.peak_bytes['total'] / p.budget_bytes:.0%} of the budget; "
                   f"{p.overflowing} is the biggest category")
    lines.append(verdict)
    lines += [f"warning: {w}" for w in p.warnings]
    lines += [f"note: {n}" for n in p.notes]
    lines.append(f"method: {p.method}")
    return "\n".join(lines)


def options_lines(p: Plan) -> list[str]:
    """The options beside the defaults, the reserved peak, and the host memory with --offload."""
    lines = []
    o = PlanOptions(**p.options) if p.options else PlanOptions()
    set_ = [f"{k.replace('_', '-')} {v}" for k, v in p.options.items()
            if k not in ("host_memory_bytes", "gpus_per_node") and v != getattr(PlanOptions(), k)]
    if set_:
        lines.append("options: " + ", ".join(set_))
    if p.reserved:
        r = p.reserved
        lines.append(f"reserved (caching allocator, modelled): {fmt_bytes(r['reserved'])} at the "
                     f"peak beside {fmt_bytes(p.peak_bytes['total'])} allocated "
                     f"(+{r['reserved'] / max(p.peak_bytes['total'], 1) - 1:.1%}: 512 B rounding, "
                     "2/20 MiB segments, blocks cached from the previous step); nvidia-smi adds "
                     "the CUDA context and NCCL")
    if p.host:
        h = p.host
        lines.append(f"host (--offload): {fmt_bytes(h['per_rank_bytes'])} per rank x "
                     f"{h['ranks_per_node']} = {fmt_bytes(h['per_node_bytes'])} per node of "
                     f"{fmt_bytes(h['host_memory_bytes'])} ({h['host_memory_source']}): "
                     + ("fits" if h["fits"] else "does NOT fit"))
    del o
    return lines


def model_states_line(p: Plan) -> str:
    """Where the formulas stop: the model states counted between steps against FSDP2's 16 bytes
    per parameter, and what the peak holds that no formula has."""
    formula = p.theory["fsdp2"]["total"]
    head = ("formulas: bytes a rank keeps between steps (FSDP2: 4+4+8, ZeRO: 2+2+12 per "
            f"parameter, sharded as {p.strategy} shards them)")
    if not p.model_states:
        return head + "; this plan traced no step"
    held = sum(p.model_states.values())
    gathered = p.detail.get("unsharded_parameters", 0)
    return (head + f"\n  traced between steps: {fmt_bytes(held)} ({held / max(formula, 1):.1%} of "
            f"FSDP2's formula); only the trace sees the units unsharded at the peak "
            f"({fmt_bytes(gathered)}), activations and temporaries")


def temporaries_line(p: Plan) -> str:
    """What "temporaries" holds in this plan, largest part first."""
    parts = sorted(((p.detail.get(k, 0), label) for k, label in TEMPORARY_PARTS.items()
                    if p.detail.get(k, 0) > 0), reverse=True)
    held = "; ".join(f"{label} {fmt_bytes(n)}" for n, label in parts)
    return ("temporaries: what else is alive at the peak, freed within the step: "
            + (held if held else "nothing simulated (a lower bound)"))


def run_plan(args: argparse.Namespace) -> int:
    """``fsdp-course plan``: print the table and the verdict; bad values raise ``UsageError``."""
    if getattr(args, "calibrate", False):
        from utilities.measure.calibrate import calibrate

        out = args.calibration or "calibration.json"
        result = calibrate(args.gpu, out)
        print(json.dumps({k: result[k] for k in ("gpu", "device_name", "measured", "efficiencies")},
                         indent=2))
        print(f"saved to {out}; predict with it: fsdp-course plan ... --calibration {out}")
        return 0
    if getattr(args, "sweep", False):
        return run_sweep(args)
    p, largest = plan_from_args(args)
    if getattr(args, "json", False):
        print(json.dumps(dict(p.as_dict(), largest_batch=largest), indent=2))
    else:
        print(wrap_lines(format_plan(p, largest)))
        if p.time:
            print(wrap_lines(format_time(p.time)))
    return 0


def format_time(time: dict[str, Any]) -> str:
    """The step-time prediction under the memory plan: labelled as one, with its assumptions."""
    lines = [f"step time, PREDICTED by the time model (not measured; see its assumptions): "
             f"{time['step_s']:.3f} s",
             f"  compute {time['compute_s']:.3f} s, communication {time['comm_s']:.3f} s, of which "
             f"exposed {time['exposed_comm_s']:.3f} s",
             f"  tokens/s per GPU {rate_text(time['tokens_per_s_per_gpu'])}, MFU {time['mfu']:.1%}"]
    lines += [f"  assumes: {a}" for a in time["assumptions"]]
    return "\n".join(lines)


def run_sweep(args: argparse.Namespace) -> int:
    if getattr(args, "cp", "1") not in ("1", 1):
        raise UsageError(f"--cp {args.cp} is not allowed with --sweep (the sweep's strategies "
                         "include no_shard and hybrid_shard); allowed: --cp with a single plan or "
                         "--max-batch")
    if getattr(args, "tp", "1") not in ("1", 1):
        raise UsageError(f"--tp {args.tp} is not allowed with --sweep (the sweep's strategies "
                         "include no_shard); allowed: --tp with a single plan or --max-batch")
    if getattr(args, "trace", None):
        raise UsageError("--trace is not allowed with --sweep (one trace is one configuration); "
                         "allowed: --trace with a single plan")
    for flag in ("parallelize", "batch_fn", "model"):
        value = getattr(args, flag, None)
        if value and (flag != "model" or is_function_ref(value)):
            raise UsageError(f"--{flag.replace('_', '-')} {value} is not allowed with --sweep; "
                             "allowed: your own code with a single plan or --max-batch")
    gpu_memory_bytes, _ = resolve_memory_for(args)
    options = time_options(args)
    batch, seq = _int_arg("--batch", args.batch), _int_arg("--seq", args.seq)
    get_model_spec(args.model)
    _check(8, gpu_memory_bytes, "full_shard", args.precision, args.ac, batch, seq)
    o = options_from_args(args)
    check_options(o, "full_shard", args.precision)
    plans = sweep(args.model, gpu_memory_bytes=gpu_memory_bytes, precision=args.precision, ac=args.ac,
                  batch=batch, seq=seq, options=o)
    if options is not None:
        for p in plans:  # one node's trace per strategy serves every count (it is cached)
            p.time = predict_time(p, options).as_dict()
    if getattr(args, "json", False):
        print(json.dumps([p.as_dict() for p in plans], indent=2))
    else:
        print(wrap_lines(format_sweep(plans)))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m utilities.measure.planner ...`` (what ``fsdp-course plan`` calls)."""
    import sys

    parser = add_plan_arguments(OneLineParser(prog="fsdp-course plan", description=PLAN_DESCRIPTION))
    try:
        return run_plan(parser.parse_args(argv))
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
