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
import contextlib
import math
import re
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from utilities.errors import OneLineParser, UsageError, bad_value
from utilities.measure import categorize, fmt_bytes
from utilities.models import get_model_spec
from utilities.torch_internals import global_peak_only

STRATEGIES = ("full_shard", "shard_grad_op", "hybrid_shard", "no_shard")
NODE_GPUS = 8  # hybrid_shard's default shard group: one node
PRECISIONS = ("fp32", "bf16")
AC_MODES = ("none", "selective", "full")
HEADROOM = 0.10  # of the GPU's memory, kept for what the trackers cannot see
CATEGORY_ORDER = ("parameters", "gradients", "optimizer", "activations", "temporaries")
# temporaries: everything else alive at the peak (the tracker's "Temp": autograd's short-lived
# tensors such as the logits and the loss's softmax over the vocabulary; the all-gather and
# reduce-scatter buffers; module buffers and the inputs).
TEMPORARY_PARTS = {"temporaries": "autograd temporaries (logits, loss)",
                   "all_gather": "all-gather buffers", "reduce_scatter": "reduce-scatter buffers",
                   "buffers": "module buffers", "inputs": "inputs"}

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


# What ``nvidia-smi`` reports as total memory, in MiB: what users mean by "an 80GB card". H100:
# the course's own H100 run read 79.6 GiB through NVML (gpu-evidence/2026-11-22-h100/check.txt).
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
                        + ") or a size such as 80GiB, 80GB (10^9 bytes), 24e9")
    nbytes = parse_memory(text)
    unit = "10^9" if key.endswith("gb") else "2^30" if key.endswith("gib") else None
    return nbytes, f"{text.strip()} as given" + (f" ({unit} bytes per G)" if unit else "")


def parse_memory(text: str) -> int:
    """Bytes from "80GB" (10**9), "80GiB" (2**30), "24e9" or "1024" ; one-line error otherwise."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise bad_value("--gpu-memory", text, "a size such as 80GB, 80GiB, 24e9 (units: B, KB, MB, "
                        "GB, TB, KiB, MiB, GiB, TiB)")
    value = float(m.group(1)) * _UNITS[unit]
    if not math.isfinite(value):  # 1e999
        raise bad_value("--gpu-memory", text, "finite sizes")
    if value < 1:
        raise bad_value("--gpu-memory", text, "sizes > 0")
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

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# -- the fake world ------------------------------------------------------------------------------

@contextlib.contextmanager
def fake_world(world_size: int):
    """A ``world_size``-rank fake process group seen from rank 0 (restores any real one after)."""
    import torch.distributed as dist

    from utilities.torch_internals import fake_store

    if dist.is_initialized():
        raise RuntimeError("plan() needs a process without a process group (it creates a fake one)")
    dist.init_process_group("fake", store=fake_store(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _prepare(spec, strategy: str, precision: str, ac: str, mesh, fake_mode, device: torch.device):
    """Build on meta, checkpoint, shard per block, then materialize as fake tensors on ``device``."""
    from torch.distributed.fsdp import fully_shard

    from utilities.activation_checkpointing import apply_activation_checkpointing, block_units
    from utilities.precision import fsdp2_policy

    model = spec.build(device="meta")
    block = spec.block_class()
    if ac != "none":
        apply_activation_checkpointing(model, block, every=1 if ac == "full" else 2)
    opts = dict(mesh=mesh, reshard_after_forward=strategy != "shard_grad_op",
                mp_policy=fsdp2_policy(precision))
    for unit in block_units(model, block):
        fully_shard(unit, **opts)
    fully_shard(model, **opts)
    with fake_mode:
        model.to_empty(device=device)
    return model


def _fake_batch(spec, batch: int, seq: int, device: torch.device) -> dict[str, torch.Tensor]:
    vocab = spec.config().vocab_size
    ids = torch.randint(0, vocab, (batch, seq), device=device)
    if spec.is_seq2seq:
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                "labels": torch.randint(0, vocab, (batch, seq), device=device)}
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def _train_step_tracked(model, batch, device: torch.device) -> dict[str, int]:
    """One training step under ``FSDPMemTracker`` with the optimizer state already in place (the
    steady state ``train()`` measures on its second step). The state is created by one AdamW step
    on zero gradients: the same tensors a first real step would create, at no forward's cost."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    from utilities.course.release import TrackerHooks
    from utilities.distributed import T5_POSITION_BIAS_VIEW

    foreach = device.type == "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # foreach: the same state tensors in a fraction of the ops (untracked step)
    for group in optimizer.param_groups:
        group["foreach"] = foreach
    optimizer.zero_grad(set_to_none=True)
    tracker = global_peak_only(FSDPMemTracker(model, optimizer))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Module is None")
        warnings.filterwarnings("ignore", message=T5_POSITION_BIAS_VIEW)
        with TrackerHooks(), tracker:  # the hooks go, so the fake model can be collected
            optimizer.zero_grad(set_to_none=True)
            model(**batch).loss.backward()
            optimizer.step()
    snaps = tracker.get_tracker_snapshot("peak")
    for dev, snap in snaps.items():
        if torch.device(dev).type == device.type:
            return {str(getattr(k, "value", k)): int(v) for k, v in snap.items()}
    return {}


def _fake_device(device_type: str) -> tuple[torch.device, list[str]]:
    """The device the fake tensors claim. FakeTensorMode alone can claim "cuda" without a GPU, but
    the device mesh and FSDP2's CUDA streams need a CUDA runtime: without one we use "cpu"."""
    if device_type == "cuda" and not torch.cuda.is_available():
        return torch.device("cpu"), [
            "no GPU here: the fake tensors live on 'cpu' (same byte sizes; AdamW runs without "
            "foreach, whose temporaries a GPU run adds)"]
    return torch.device(device_type), []


def plan(model: str, gpus: int, gpu_memory_bytes: int, strategy: str = "full_shard",
         precision: str = "bf16", ac: str = "none", batch: int = 1, seq: int | None = None,
         device_type: str = "cuda", shard_size: int | None = None) -> Plan:
    """Predict the per-rank peak of one training step by running it on fake tensors.

    ``hybrid_shard`` (HSDP) runs FSDP2 on a 2-D ``(gpus / shard_size, shard_size)`` mesh: shards
    within a group of ``shard_size`` ranks (default: one node of 8, or all GPUs if fewer),
    replicas across the groups."""
    spec = get_model_spec(model)
    _check(gpus, gpu_memory_bytes, strategy, precision, ac, batch, seq)
    shard_size = _shard_size(strategy, gpus, shard_size)
    seq = seq or spec.default_seq_len
    device, notes = _fake_device(device_type)
    if strategy == "no_shard":
        # FSDP2 has no NO_SHARD: nothing is sharded on a 1-rank mesh, as under DDP.
        world, notes = 1, notes + [
            "no_shard (DDP): simulated as 1-rank FSDP2 (every rank holds the whole model) plus "
            "DDP's fp32 gradient buckets, added analytically, minus the gathered parameter copies "
            "FSDP2 makes and DDP does not (an analytic correction, not a DDP measurement)"]
    else:
        world = gpus
    budget = int(gpu_memory_bytes * (1 - HEADROOM))
    floor = _resident_floor(spec.num_parameters, shard_size or world)
    if floor["total"] > budget:
        # No need to run anything: what every rank holds at all times already overflows.
        return Plan(
            model=spec.name, parameters_total=spec.num_parameters, gpus=gpus,
            gpu_memory_bytes=gpu_memory_bytes, strategy=strategy, precision=precision, ac=ac,
            batch=batch, seq=seq, device_type=device.type, shard_size=shard_size,
            peak_bytes=floor, detail={},
            budget_bytes=budget, fits=False, overflowing=_overflowing(floor, budget),
            method="lower bound: fp32 parameter shards + AdamW state alone exceed the budget "
                   "(activations not simulated)", notes=notes)
    snap = _simulate(spec, world, strategy, precision, ac, batch, seq, device, shard_size)
    cats = categorize(snap)
    detail = cats.pop("detail")
    if strategy == "no_shard":
        buckets = 4 * spec.num_parameters  # DDP's fp32 gradient buckets, allocated once, kept
        cats["gradients"] += buckets
        cats["total"] += buckets
        detail["ddp_gradient_buckets"] = buckets
        gathered = detail.get("unsharded_parameters", 0)  # DDP computes with the parameters
        cats["parameters"] -= gathered
        cats["total"] -= gathered
        detail["unsharded_parameters_removed"] = gathered
    known = sum(cats[c] for c in ("parameters", "gradients", "optimizer", "activations"))
    cats["temporaries"] = max(0, cats["total"] - known)
    fits = cats["total"] <= budget
    return Plan(
        model=spec.name, parameters_total=spec.num_parameters, gpus=gpus,
        gpu_memory_bytes=gpu_memory_bytes, strategy=strategy, precision=precision, ac=ac,
        batch=batch, seq=seq, device_type=device.type, shard_size=shard_size,
        peak_bytes={k: int(v) for k, v in cats.items()}, detail=detail, budget_bytes=budget,
        fits=fits, overflowing=None if fits else _overflowing(cats, budget),
        method="FSDPMemTracker on FakeTensorMode + fake process group", notes=notes)


def _simulate(spec, world, strategy, precision, ac, batch, seq, device,
              shard_size: int | None = None) -> dict[str, int]:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh

    with fake_world(world):
        if shard_size:  # HSDP: replicate across the first dim, shard along the second
            mesh = init_device_mesh(device.type, (world // shard_size, shard_size),
                                    mesh_dim_names=("replicate", "shard"))
        else:
            mesh = init_device_mesh(device.type, (world,))
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        model = _prepare(spec, strategy, precision, ac, mesh, fake_mode, device)
        with fake_mode:
            data = _fake_batch(spec, batch, seq, device)
            return _train_step_tracked(model, data, device)


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


def _resident_floor(num_parameters: int, world: int) -> dict[str, int]:
    """Bytes every rank holds for the whole step, whatever the batch: its fp32 parameter shard
    (4 bytes per parameter / world) and AdamW's two fp32 moments (8 bytes / world). The peak is at
    least this much (gradients and activations come on top, at some point of the step)."""
    shard = -(-num_parameters // world)
    cats = {"parameters": 4 * shard, "gradients": 0, "optimizer": 8 * shard, "activations": 0,
            "temporaries": 0}
    cats["total"] = sum(cats.values())
    return cats


def _overflowing(cats: dict[str, int], budget: int) -> str:
    """The category that overflows: the largest one, i.e. the one that alone takes the biggest
    share of the budget (the first one to cut: shard it, checkpoint it, or shrink the batch)."""
    return max(CATEGORY_ORDER, key=lambda c: cats.get(c, 0))


def _check(gpus, gpu_memory_bytes, strategy, precision, ac, batch, seq) -> None:
    if not isinstance(gpus, int) or gpus < 1:
        raise bad_value("--gpus", gpus, "integers >= 1")
    if gpu_memory_bytes < 1:
        raise bad_value("--gpu-memory", gpu_memory_bytes, "sizes > 0")
    if strategy not in STRATEGIES:
        raise bad_value("--strategy", strategy, STRATEGIES)
    if precision not in PRECISIONS:
        raise bad_value("--precision", precision, PRECISIONS)
    if ac not in AC_MODES:
        raise bad_value("--ac", ac, AC_MODES)
    if not isinstance(batch, int) or batch < 1:
        raise bad_value("--batch", batch, "integers >= 1")
    if seq is not None and (not isinstance(seq, int) or seq < 1):
        raise bad_value("--seq", seq, "integers >= 1")


def largest_batch(model: str, gpus: int, gpu_memory_bytes: int, strategy: str = "full_shard",
                  precision: str = "bf16", ac: str = "none", seq: int | None = None,
                  device_type: str = "cuda", limit: int = 4096,
                  shard_size: int | None = None) -> tuple[int, Plan | None]:
    """The largest per-rank batch that fits (0 when even batch 1 does not), and its plan.

    Doubling until a batch does not fit, then bisection between the last fit and the first miss:
    about 2 * log2(batch) plans.
    """
    def run(b: int) -> Plan:
        return plan(model, gpus, gpu_memory_bytes, strategy, precision, ac, b, seq, device_type,
                    shard_size)

    first = run(1)
    if not first.fits:
        return 0, first
    good, good_plan, bad = 1, first, None
    while bad is None and good < limit:
        b = min(good * 2, limit)
        p = run(b)
        if p.fits:
            good, good_plan = b, p
        else:
            bad = b
    while bad is not None and bad - good > 1:
        mid = (good + bad) // 2
        p = run(mid)
        if p.fits:
            good, good_plan = mid, p
        else:
            bad = mid
    return good, good_plan


# -- command line ----------------------------------------------------------------------------------

PLAN_DESCRIPTION = (
    "Predict the peak memory per GPU, by category (parameters, gradients, optimizer state, "
    "activations), of one training step of a named model on N GPUs, on this machine and without "
    "them: the model is built under FakeTensorMode with a fake process group and the real FSDP2 "
    "step runs under PyTorch's memory tracker. Says whether it fits (90% of --gpu-memory) and, "
    "with --max-batch, the largest batch that does (lesson 14).")


def add_plan_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of ``fsdp-course plan``."""
    parser.add_argument("--model", default="llama-8b", help="named model (see `fsdp-course list "
                        "--models`); default llama-8b")
    parser.add_argument("--gpus", default="8", help="number of GPUs (ranks); default 8")
    parser.add_argument("--gpu-memory", default="auto",
                        help="memory per GPU: a GPU name (" + ", ".join(GPU_MEMORY_MIB) + "), its "
                        "real size; or a size: 80GiB (2^30), 80GB (10^9 bytes: 74.5 GiB, less than "
                        "an '80GB' card), 24e9; default auto: this machine's GPU, else an h100")
    parser.add_argument("--strategy", default="full_shard",
                        help=f"one of {', '.join(STRATEGIES)}; default full_shard")
    parser.add_argument("--shard-size", default=None,
                        help="hybrid_shard only: GPUs that shard among themselves, a divisor of "
                             f"--gpus (default {NODE_GPUS}, one node, or --gpus if fewer)")
    parser.add_argument("--precision", default="bf16", help=f"one of {', '.join(PRECISIONS)}")
    parser.add_argument("--ac", default="none", help=f"activation checkpointing: {', '.join(AC_MODES)}")
    parser.add_argument("--batch", default="1", help="per-rank batch size; default 1")
    parser.add_argument("--seq", default=None, help="sequence length (default: the model's)")
    parser.add_argument("--max-batch", action="store_true",
                        help="find the largest per-rank batch that fits instead")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    return parser


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


def plan_from_args(args: argparse.Namespace) -> tuple[Plan, int | None]:
    gpu_memory_bytes, source = resolve_gpu_memory(args.gpu_memory)
    kw = dict(model=args.model, gpus=_int_arg("--gpus", args.gpus),
              gpu_memory_bytes=gpu_memory_bytes, strategy=args.strategy,
              precision=args.precision, ac=args.ac, seq=_int_arg("--seq", args.seq),
              shard_size=_int_arg("--shard-size", args.shard_size))
    batch = _int_arg("--batch", args.batch)
    get_model_spec(kw["model"])
    _check(kw["gpus"], kw["gpu_memory_bytes"], kw["strategy"], kw["precision"], kw["ac"], batch,
           kw["seq"])
    _shard_size(kw["strategy"], kw["gpus"], kw["shard_size"])
    if args.max_batch:
        best, p = largest_batch(**kw)
    else:
        best, p = None, plan(batch=batch, **kw)
    p.gpu_memory_source = source
    return p, best


def format_plan(p: Plan, largest: int | None = None) -> str:
    lines = [f"{p.model} ({p.parameters_total:,} parameters) on {p.gpus} x "
             f"{fmt_bytes(p.gpu_memory_bytes)}: {p.strategy}"
             f"{f' (shard groups of {p.shard_size})' if p.shard_size else ''}, {p.precision}, "
             f"AC {p.ac}, batch {p.batch} x seq {p.seq} per rank",
             f"{'category':<14}{'peak per rank' if p.detail else 'at least':>16}{'share':>8}"]
    total = max(p.peak_bytes["total"], 1)
    for c in CATEGORY_ORDER:
        mark = "  <- overflows" if c == p.overflowing else ""
        lines.append(f"{c:<14}{fmt_bytes(p.peak_bytes[c]):>16}{p.peak_bytes[c] / total:>8.0%}{mark}")
    lines.append(f"{'total':<14}{fmt_bytes(p.peak_bytes['total']):>16}{1:>8.0%}")
    lines.append(temporaries_line(p))
    if p.gpu_memory_source:
        lines.append(f"GPU memory used: {p.gpu_memory_bytes / 2**30:.2f} GiB per GPU "
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
    lines += [f"note: {n}" for n in p.notes]
    lines.append(f"method: {p.method}")
    return "\n".join(lines)


def temporaries_line(p: Plan) -> str:
    """What "temporaries" holds in this plan, largest part first."""
    parts = sorted(((p.detail.get(k, 0), label) for k, label in TEMPORARY_PARTS.items()
                    if p.detail.get(k, 0) > 0), reverse=True)
    held = "; ".join(f"{label} {fmt_bytes(n)}" for n, label in parts)
    return ("temporaries: what else is alive at the peak, freed within the step: "
            + (held if held else "nothing simulated (a lower bound)"))


def run_plan(args: argparse.Namespace) -> int:
    """``fsdp-course plan``: print the table and the verdict; bad values raise ``UsageError``."""
    p, largest = plan_from_args(args)
    if getattr(args, "json", False):
        import json

        print(json.dumps(dict(p.as_dict(), largest_batch=largest), indent=2))
    else:
        print(format_plan(p, largest))
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
