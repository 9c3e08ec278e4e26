"""Lesson 13's driver: each variant on each width built (convert -> shard -> compile, the lesson
script's functions), its compile step timed, trained and made a row; what the flags and the machine
make of the run (widths, dtype, whether FP8 can run).
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import torch
from fp8_helpers import compare, first_step_seconds, flops_per_token, report_crossovers, width_spec
from torch import nn

from utilities.fp8 import float8_module_filter, fp8_available, fp8_linear_names
from utilities.models import ModelSpec
from utilities.precision import default_policy, fsdp2_policy
from utilities.results import variant

VARIANTS = ("eager", "compiled", "fp8-compiled")
GPU_WIDTHS = (1024, 2048, 4096)  # FP8 lost at 1024 on an H100; the sweep finds where it starts to pay
GPU_LAYERS = 4             # enough blocks to see per-block compile reuse, small enough for 1 GPU
GPU_SEQ_LEN = 2048
COMPILE_NOTE = ("compile_s: first step of the compiled variant minus eager's first step; all timed "
                "steps come after it (tokens/s excludes compilation).")


def hidden_list(text: str) -> list[int]:
    """``--hidden 1024,4096``: model widths, each a multiple of 64 (64-wide heads or wider)."""
    out = []
    for part in text.split(","):
        try:
            h = int(part)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{part!r} is not an integer; allowed: comma-separated multiples of 64 >= 64") from None
        if h < 64 or h % 64:
            raise argparse.ArgumentTypeError(
                f"{h} is not allowed; allowed: comma-separated multiples of 64 >= 64")
        out.append(h)
    return out


def takeaway(results: dict) -> str:
    """The lesson's point, from what the run measured (printed last)."""
    eager, compiled = variant(results, "eager"), variant(results, "compiled")
    diff = max(abs(a - b) for a, b in zip(eager["losses"], compiled["losses"]))
    return f"compiled trains as eager does (losses within {diff:.1e})"


def run_settings(args: argparse.Namespace) -> SimpleNamespace:
    """The widths swept (GPU: GPU_WIDTHS at GPU_SEQ_LEN, unless --quick), the compute dtype, whether
    FP8 can run here (and why not), and what a CPU run shows."""
    on_gpu = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    widths = args.hidden or (list(GPU_WIDTHS) if on_gpu and not args.quick else None)
    if widths and on_gpu and args.seq_len is None:
        args.seq_len = GPU_SEQ_LEN
    # bf16 on CPU too: the part of the lesson a laptop can run
    precision = args.precision if args.precision != "auto" else default_policy()[0] if on_gpu else "bf16"
    fp8_ok, fp8_reason = fp8_available("cuda" if on_gpu else "cpu")
    shows = ("inductor's fused CPU kernels" if args.compile_backend == "inductor" else
             f"the {args.compile_backend} backend (graph capture, no generated kernels)")
    cpu_note = (f"CPU run in {precision}: compiled vs eager shows {shows}, not the GPU picture; FP8 "
                "needs a Hopper/Ada GPU (sm_89+).")
    return SimpleNamespace(widths=widths, precision=precision, fp8_ok=fp8_ok, fp8_reason=fp8_reason,
                           cpu_note=cpu_note)


def run_variants(lesson, run: SimpleNamespace, code: SimpleNamespace) -> None:
    """Every variant on every width (those FP8 cannot run skipped, with the reason), then the
    speed-ups, the model that names the run and, for a sweep, where FP8 and compile start to pay.
    The conversion, sharding and compiling are the lesson script's functions, handed in as ``code``."""
    args, widths = lesson.args, run.widths
    lesson.results.columns("first_step_s", "compile_s", "speedup_vs_eager", "speedup_vs_compiled",
                           "compiled_blocks", "fp8_linears")
    block = lesson.spec.block_class()
    specs = [width_spec(h, args.layers or GPU_LAYERS, lesson.seq_len) for h in widths] if widths \
        else [lesson.spec]
    names = [n for n in args.variants if n != "fp8-compiled" or run.fp8_ok]
    if len(names) < len(args.variants):
        label = lambda spec: f"fp8-compiled-h{spec.config().hidden_size}" if widths else "fp8-compiled"
        lesson.print(f"  fp8-compiled skipped: {run.fp8_reason}")
        lesson.results.note(f"fp8-compiled skipped: {run.fp8_reason}")
        for spec in specs:
            lesson.results.skipped(label(spec), run.fp8_reason)
    warm = lesson.data(seed_offset=1000)  # the compile step uses its own batch, not the timed data
    for spec in specs:
        for name in names:
            run_variant(lesson, spec, name, block, run.precision, warm, widths is not None, code)
    lesson.results.extend_variants(compare(lesson.results.data["variants"]))
    if widths and lesson.results.data["variants"]:  # the widest model names the run
        widest = max(specs, key=lambda s: s.config().hidden_size)
        lesson.results.run_model(widest.name,
                                 max(v["parameters"] for v in lesson.results.data["variants"]))
    if widths:  # where FP8 (and compile) start to pay, from the sweep's rows
        report_crossovers(lesson, args.variants, None if run.fp8_ok else run.fp8_reason)


def run_variant(lesson, spec: ModelSpec, name: str, block: type[nn.Module], precision: str, warm,
                by_width: bool, code: SimpleNamespace) -> None:
    """Build one variant (convert -> shard -> compile), time its compile step, train it, record it;
    its model and its compiled code are gone before the next one."""
    label = f"{name}-h{spec.config().hidden_size}" if by_width else name  # compiled-h1024, ...
    with lesson.variant(label):
        lesson.seed()
        model = spec.build(device=lesson.device)
        params = sum(p.numel() for p in model.parameters())
        extra = dict(variant=name, precision=precision, hidden=spec.config().hidden_size,
                     parameters=params)
        if name != "fp8-compiled":
            extra["fp8_linears_if_converted"] = len(fp8_linear_names(model, float8_module_filter()))
        extra.update(code.parallelize(model, name, block, fsdp2_policy(precision),
                                      lesson.args.compile_backend))
        optimizer = lesson.optimizer(model)
        if name == "fp8-compiled":
            optimizer.register_step_post_hook(lambda *_, m=model: code.precompute_fp8_scales(m))
        torch._dynamo.reset()  # so compile cost is measured from scratch for each variant
        extra["first_step_s"] = round(first_step_seconds(model, next(warm), lesson.device), 3)
        lesson.print(f"  {label}: first forward+backward (compile included) {extra['first_step_s']:.2f}s")
        stats = lesson.train(model, label, optimizer=optimizer,
                             flops_per_token=flops_per_token(spec, params, lesson.seq_len))
        lesson.results.add(label, stats, **extra)
        del model, optimizer, stats
        torch._dynamo.reset()  # compiled code of this variant goes too
