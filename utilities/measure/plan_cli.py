"""``fsdp-course plan``: the flags, their checks, and the plan's text for a terminal.

``add_plan_arguments`` declares the flags; ``plan_from_args`` turns them into one checked call of
``planner.plan`` (or ``largest_batch``) and, unless ``--no-time``, the step-time prediction of the
same configuration; ``format_plan``, ``format_time`` and ``format_sweep`` print the answer;
``run_plan`` / ``main`` are the command.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from utilities.errors import OneLineParser, UsageError, bad_value
from utilities.measure import fmt_bytes
from utilities.measure.context_parallel import check_cp
from utilities.measure.fake_step import PRECISIONS, STRATEGIES, StepConfig, check_tp
from utilities.measure.plan_options import HOST_MEMORY_SOURCE, PlanOptions, check_options
from utilities.measure.plan_sweep import SWEEP_GPUS, SWEEP_STRATEGIES, sweep
from utilities.measure.planner import (
    CATEGORY_ORDER,
    GPU_MEMORY_MIB,
    HEADROOM,
    NODE_GPUS,
    TEMPORARY_PARTS,
    Plan,
    check_plan_step,
    hybrid_shard_size,
    largest_batch,
    parse_memory,
    plan,
    resolve_gpu_memory,
)
from utilities.measure.user_code import is_function_ref, planned_spec, resolve_spec
from utilities.models import get_model_spec
from utilities.text import rate_text, wrap_lines


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


PLAN_DESCRIPTION = (
    "Predict the peak memory per GPU, by category (parameters, gradients, optimizer state, "
    "activations), of one training step of a named model on N GPUs, on this machine and without "
    "them: the model is built under FakeTensorMode with a fake process group and the real FSDP2 "
    "step runs under PyTorch's memory tracker. Says whether it fits (90% of --gpu-memory) and, "
    "with --max-batch, the largest batch that does (lesson 14).")


def add_plan_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of ``fsdp-course plan``."""
    _add_step_arguments(parser)
    _add_time_arguments(parser)
    _add_option_arguments(parser)
    return parser


def _add_step_arguments(parser: argparse.ArgumentParser) -> None:
    """The step's flags: the model, the GPUs and their memory, the parallelism, the tokens."""
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


def _add_time_arguments(parser: argparse.ArgumentParser) -> None:
    """The step-time prediction's flags: the GPU part, the cluster, the kernels, a calibration."""
    parser.add_argument("--gpu", default=None,
                        help="the GPU the step time is predicted for (h100, h100-96gb, h200, "
                        "a100-80gb, a100-40gb, l4); also its memory when --gpu-memory is auto; "
                        "default: h100")
    parser.add_argument("--gpus-per-node", default="8",
                        help="GPUs per node on NVLink (the network links the nodes); default 8")
    parser.add_argument("--network-gbps", default="400",
                        help="network bandwidth per GPU between nodes, Gb/s; default 400")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile per block: the step time with inductor's fused kernels, "
                        "and the memory as AOTAutograd's partitioner saves it (the pointwise "
                        "outputs eager saves, such as SiLU's, recomputed in backward instead; "
                        "traced on each uncheckpointed block; applies with --no-time too)")
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


def _add_option_arguments(parser: argparse.ArgumentParser) -> None:
    """What to plan (a largest batch, a sweep), the plan's options, your code, the output."""
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
    parser.add_argument("--reduce-dtype", default=None,
                        help="bf16 or fp32: the gradients' reduce-scatter dtype (default: the "
                        "precision's own); "
                        "fp32 with --precision bf16 is torchtitan's default, and with --accum-sync "
                        "last FSDP2 then holds the unsharded gradients in fp32 between micro-batches")
    parser.add_argument("--parallelize", default=None, metavar="FILE.py:FUNCTION",
                        help="plan your own sharding function, FUNCTION(model, *, mesh, "
                        "world_size, device, mp_policy) in your FILE.py (imported as `python FILE.py` would; "
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
        reduce_dtype=getattr(args, "reduce_dtype", None),
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


def timing_from_args(args: argparse.Namespace):
    """The step-time model's settings (``step_time.TimeConfig``) from the flags (checked), or
    None with --no-time."""
    from utilities.measure.gpu_catalogue import get_gpu
    from utilities.measure.step_time import TimeConfig

    gpu = get_gpu(args.gpu or "h100")
    if getattr(args, "no_time", False):
        return None
    options = dict(gpu=gpu.name, gpus_per_node=_int_arg("--gpus-per-node", args.gpus_per_node),
                   network_gbps=_float_arg("--network-gbps", args.network_gbps),
                   compile=bool(args.compile), fp8=bool(args.fp8))
    if getattr(args, "calibration", None):
        from utilities.measure.calibrate import load_efficiencies

        options["efficiencies"] = load_efficiencies(args.calibration)
    return TimeConfig(**options)


def resolve_memory_for(args: argparse.Namespace) -> tuple[int, str]:
    """--gpu-memory, or with it left at auto, the memory of the --gpu part."""
    if args.gpu and str(args.gpu_memory).strip().lower() == "auto":
        from utilities.measure.gpu_catalogue import get_gpu

        gpu = get_gpu(args.gpu)
        if gpu.name in GPU_MEMORY_MIB:
            return resolve_gpu_memory(gpu.name)
        return gpu.memory_bytes, f"{gpu.name} (--gpu): {gpu.memory_bytes / 2**30:.2f} GiB"
    return resolve_gpu_memory(args.gpu_memory)


def predict_time(p: Plan, timing=None):
    """The step-time prediction for plan ``p``'s step (a ``StepTime``), timed as ``timing``
    (``step_time.TimeConfig``, default: an H100 node's) says."""
    from utilities.measure.step_time import estimate_step_time

    return estimate_step_time(planned_spec(p.model), p.step_config(), timing=timing)


def config_from_args(args: argparse.Namespace) -> StepConfig:
    """The step the flags name (``StepConfig``), each number checked (one line for a bad one);
    ``checked_config`` checks the rest once the model is known."""
    config = StepConfig(_int_arg("--gpus", args.gpus), args.strategy, args.precision, args.ac,
                        seq=_int_arg("--seq", args.seq),
                        shard_size=_int_arg("--shard-size", args.shard_size),
                        tp=_int_arg("--tp", args.tp), cp=_int_arg("--cp", getattr(args, "cp", "1")),
                        compile=bool(getattr(args, "compile", False)))
    return dataclasses.replace(config, batch=_int_arg("--batch", args.batch))


def checked_config(args: argparse.Namespace, spec, config: StepConfig, gpu_memory_bytes: int,
                   timing) -> StepConfig:
    """``config`` checked against the model (``spec``) and the GPU memory, with the options the
    flags name (``PlanOptions``)."""
    gpus, strategy, precision = config.world, config.strategy, config.precision
    check_plan_step(gpus, gpu_memory_bytes, strategy, precision, config.ac, config.batch, config.seq)
    hybrid_shard_size(strategy, gpus, config.shard_size)
    options = options_from_args(args)
    check_options(options, strategy, precision,
                  hybrid_shard_size(strategy, gpus, config.shard_size) or gpus)
    per_node = timing.gpus_per_node if timing is not None else None
    check_tp(spec, config.tp, gpus, strategy, options, per_node)
    check_cp(spec, config.cp, gpus, strategy, config.seq or spec.default_seq_len, config.tp,
             options, per_node, parallelize=getattr(args, "parallelize", None))
    return dataclasses.replace(config, options=options)


def plan_from_args(args: argparse.Namespace) -> tuple[Plan, int | None]:
    gpu_memory_bytes, source = resolve_memory_for(args)
    timing = timing_from_args(args)
    config = config_from_args(args)
    spec = resolve_spec(args.model, parallelize=getattr(args, "parallelize", None),
                        batch_fn=getattr(args, "batch_fn", None))  # the user's files imported, once
    config = checked_config(args, spec, config, gpu_memory_bytes, timing)
    if getattr(args, "trace", None):  # a FIFO or a device there: one line before the plan runs
        from utilities.safe_files import check_output_file

        check_output_file(args.trace, "--trace")
    if args.max_batch:
        best, p = largest_batch(spec, config, gpu_memory_bytes)
    else:
        best, p = None, plan(spec, config, gpu_memory_bytes)
    p.gpu_memory_source = source
    trace = getattr(args, "trace", None)
    if trace and timing is None:
        raise UsageError("--trace is not allowed with --no-time; allowed: --trace FILE.json with the "
                         "step-time prediction on")
    if timing is not None and p.detail:
        step = predict_time(p, timing)
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
             f"AC {p.ac}{', compiled per block' if p.compile else ''}, batch {p.batch} x seq {p.seq} "
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
    options = timing_from_args(args)
    batch, seq = _int_arg("--batch", args.batch), _int_arg("--seq", args.seq)
    get_model_spec(args.model)
    check_plan_step(8, gpu_memory_bytes, "full_shard", args.precision, args.ac, batch, seq)
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
    """``python -m utilities.measure.plan_cli ...`` (what ``fsdp-course plan`` calls)."""
    import sys

    parser = add_plan_arguments(OneLineParser(prog="fsdp-course plan", description=PLAN_DESCRIPTION))
    try:
        return run_plan(parser.parse_args(argv))
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
