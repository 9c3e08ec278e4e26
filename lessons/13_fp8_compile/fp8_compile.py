"""Lesson 13: FP8 training with torch.compile.

FP8 (float8) matmuls run twice as fast as bf16 on Hopper / Ada tensor cores, and an FSDP2 all-gather
of float8 weights moves half the bytes. torchao's Float8Linear does the scaling: per tensor, it
measures the absolute maximum (amax), scales into float8's narrow range, multiplies in float8 and
rescales the result. That scaling is many small elementwise kernels, so FP8 only pays *compiled*
(inductor fuses them) and only on matmuls *large enough* that the 2x GEMM speed beats the scaling
overhead: at hidden 4096 it pays, at hidden 1024 it barely does.

The order is: convert Linear -> Float8Linear, then fully_shard, then torch.compile (per block).

Variants, each trained on the same data from the same weights:

    eager          FSDP2, bf16 (CPU too), no compile                 the baseline
    compiled       the same, each transformer block torch.compile'd
    fp8-compiled   torchao Float8Linear (tensorwise, float8 all-gather) + compile: GPU sm_89+ only

With --hidden (and on a GPU by default: 1024, 2048 and 4096) the lesson builds one Llama per width
and names every variant <variant>-h<hidden> (compiled-h1024, fp8-compiled-h4096, ...). It then
reports where FP8 starts to pay: fp8_crossover_hidden in results.json is the smallest width from
which fp8-compiled has more tokens/s than compiled at that width and every wider one measured
(compile_crossover_hidden: the same for compiled over eager).

On CPU the lesson runs eager and compiled in bf16 (--precision fp32 makes them agree to ~1e-7)
and records why FP8 was skipped. Compile time is the first step, reported apart from the timed steps.

Run: fsdp-course run 13 [--quick]   or   fsdp-course run 13 -- --hidden 1024,2048,4096 (GPU)
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# Compile in this process rather than in a pool of workers: two ranks on a small machine each
# forking a compile pool oversubscribe it (and were seen to abort once in five runs on 2 cores).
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without install

import torch
from fp8_helpers import compare, first_step_seconds, flops_per_token, report_crossovers, width_spec
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from utilities.course.lesson import Lesson, lesson_parser
from utilities.distributed import world_mesh
from utilities.fp8 import float8_module_filter, fp8_available, fp8_linear_names
from utilities.measure.predictions import add_prediction_arguments, predict_from_arguments
from utilities.models import ModelSpec
from utilities.precision import default_policy, fsdp2_policy
from utilities.results import variant


# -- the code this lesson teaches: convert -> shard -> compile, in that order ---------------------
def convert_to_fp8(model: nn.Module) -> list[str]:
    """1. Swap the filtered nn.Linear layers for torchao's Float8Linear, *before* fully_shard (it
    must see plain Linears, not DTensor parameters). Tensorwise scaling with float8 all-gather:
    FSDP2 casts each shard to float8 before gathering it, half the bytes of bf16. Needs torchao
    (optional) and an sm_89+ GPU."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    keep = float8_module_filter()  # dims multiples of 16; never lm_head or embeddings
    names = fp8_linear_names(model, keep)
    convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True),
                               module_filter_fn=keep)
    return names


def shard(model: nn.Module, block_class: type[nn.Module], mp_policy: MixedPrecisionPolicy) -> None:
    """2. FSDP2: each transformer block one unit, the root takes what is left."""
    mesh = world_mesh()  # every rank, on this run's device (not the machine's accelerator)
    for module in list(model.modules()):
        if isinstance(module, block_class):
            fully_shard(module, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)


def compile_blocks(model: nn.Module, block_class: type[nn.Module], backend: str = "inductor") -> int:
    """3. torch.compile each block in place, last, over the finished modules (torchtitan's way).
    Identical blocks share one compiled graph (compile time does not grow with depth); FSDP2's
    all-gather and reduce-scatter hooks stay at the block boundaries, outside the graphs; and
    Module.compile keeps parameter names (no "_orig_mod."), so checkpoints load either way."""
    blocks = [m for m in model.modules() if isinstance(m, block_class)]
    for block in blocks:
        block.compile(backend=backend, dynamic=False)
    return len(blocks)


def parallelize(model: nn.Module, variant: str, block_class: type[nn.Module],
                mp_policy: MixedPrecisionPolicy, backend: str) -> dict[str, int]:
    """The three steps for one variant; returns what was converted and compiled."""
    done = {}
    if variant == "fp8-compiled":
        done["fp8_linears"] = len(convert_to_fp8(model))
    shard(model, block_class, mp_policy)
    if variant != "eager":
        done["compiled_blocks"] = compile_blocks(model, block_class, backend)
    return done


def precompute_fp8_scales(model: nn.Module) -> None:
    """After optimizer.step(): every float8 weight's scale in one fused amax, not one per layer
    (an optimization only: a torchao without it computes each scale at its all-gather)."""
    try:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
    except ImportError:
        return
    precompute_float8_dynamic_scale_for_fsdp(model)


# -- the lesson's variants -----------------------------------------------------------------------
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


def parse_args(argv=None):
    p = lesson_parser(__doc__)
    p.add_variants(VARIANTS)
    add_prediction_arguments(p, "llama-8b", 2, cluster="1x8xh100-96gb")
    p.add_argument("--hidden", type=hidden_list, default=None,
                   help="model width(s) to compare, e.g. 1024,4096 (a Llama block per width; "
                        f"default: {','.join(map(str, GPU_WIDTHS))} on GPU, the tiny model on CPU)")
    p.add_argument("--layers", type=int, default=None,
                   help=f"transformer blocks for --hidden models (default {GPU_LAYERS})")
    p.add_argument("--precision", default="auto", choices=("auto", "bf16", "fp32"),
                   help="FSDP2 compute dtype: auto = bf16 (on CPU too; fp32 on a GPU without "
                        "native bf16); fp32 makes compiled and eager agree to ~1e-7")
    p.add_argument("--compile-backend", default="inductor",
                   help="torch.compile backend of the compiled variants (default inductor, the one "
                        "that fuses; aot_eager captures the same graphs without generating kernels: "
                        "for debugging, and for the CPU tests)")
    args = p.parse(argv)
    if args.layers is not None and args.layers < 1:
        p.exit(2, f"error: --layers {args.layers} is not allowed; allowed: integers >= 1\n")
    if args.model is None:
        args.model = "llama-tiny"  # decoder-only: the Llama block is what torchao and torchtitan use
    return args


# torchtitan's published Llama 3.1 8B run (8 x H100 96GB, batch 2 x 8192, op-level selective AC):
# the lesson's variants predicted where published numbers exist to hold them against
PREDICTED_KNOBS = {"eager": {}, "compiled": dict(compile=True), "fp8-compiled": dict(compile=True, fp8=True)}
PREDICTED_SEQ, PREDICTED_AC = 8192, "selective"


def takeaway(results: dict) -> str:
    """The lesson's point, from what the run measured (printed last)."""
    eager, compiled = variant(results, "eager"), variant(results, "compiled")
    diff = max(abs(a - b) for a, b in zip(eager["losses"], compiled["losses"]))
    return f"compiled trains as eager does (losses within {diff:.1e})"


def main(args) -> None:
    predicted = predict_from_arguments(args, {n: PREDICTED_KNOBS[n] for n in args.variants},
                                   ac=PREDICTED_AC, seq=PREDICTED_SEQ)
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

    with Lesson("13", args, settings=dict(precision=precision, widths=widths,
                                          compile_backend=args.compile_backend),
                notes=(COMPILE_NOTE,), cpu_note=cpu_note, takeaway=takeaway) as lesson:
        lesson.results.columns("first_step_s", "compile_s", "speedup_vs_eager", "speedup_vs_compiled",
                               "compiled_blocks", "fp8_linears")
        block = lesson.spec.block_class()
        specs = [width_spec(h, args.layers or GPU_LAYERS, lesson.seq_len) for h in widths] if widths \
            else [lesson.spec]
        names = [n for n in args.variants if n != "fp8-compiled" or fp8_ok]
        if len(names) < len(args.variants):
            label = lambda spec: f"fp8-compiled-h{spec.config().hidden_size}" if widths else "fp8-compiled"
            lesson.print(f"  fp8-compiled skipped: {fp8_reason}")
            lesson.results.note(f"fp8-compiled skipped: {fp8_reason}")
            for spec in specs:
                lesson.results.skipped(label(spec), fp8_reason)
        warm = lesson.data(seed_offset=1000)  # the compile step uses its own batch, not the timed data
        for spec in specs:
            for name in names:
                run_variant(lesson, spec, name, block, precision, warm, widths is not None)
        lesson.results.extend_variants(compare(lesson.results.data["variants"]))
        if widths and lesson.results.data["variants"]:  # the widest model names the run
            widest = max(specs, key=lambda s: s.config().hidden_size)
            lesson.results.run_model(widest.name,
                                     max(v["parameters"] for v in lesson.results.data["variants"]))
        if widths:  # where FP8 (and compile) start to pay, from the sweep's rows
            report_crossovers(lesson, args.variants, None if fp8_ok else fp8_reason)
        lesson.results.predicted(predicted)


def run_variant(lesson, spec: ModelSpec, name: str, block: type[nn.Module], precision: str, warm,
                by_width: bool) -> None:
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
        extra.update(parallelize(model, name, block, fsdp2_policy(precision), lesson.args.compile_backend))
        optimizer = lesson.optimizer(model)
        if name == "fp8-compiled":
            optimizer.register_step_post_hook(lambda *_, m=model: precompute_fp8_scales(m))
        torch._dynamo.reset()  # so compile cost is measured from scratch for each variant
        extra["first_step_s"] = round(first_step_seconds(model, next(warm), lesson.device), 3)
        lesson.print(f"  {label}: first forward+backward (compile included) {extra['first_step_s']:.2f}s")
        stats = lesson.train(model, label, optimizer=optimizer,
                             flops_per_token=flops_per_token(spec, params, lesson.seq_len))
        lesson.results.add(label, stats, **extra)
        del model, optimizer, stats
        torch._dynamo.reset()  # compiled code of this variant goes too


if __name__ == "__main__":
    main(parse_args())
