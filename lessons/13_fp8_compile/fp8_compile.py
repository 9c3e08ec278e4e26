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

from utilities.course.lesson import Lesson, lesson_parser
from utilities.fp8 import (
    Stopwatch,
    compile_blocks,
    convert_for_fp8,
    crossover_hidden,
    float8_module_filter,
    fp8_available,
    fp8_linear_names,
    fp8_precompute_scales,
)
from utilities.models import ModelSpec, _llama
from utilities.precision import fsdp2_policy
from utilities.wrapping import shard_model

VARIANTS = ("eager", "compiled", "fp8-compiled")
GPU_WIDTHS = (1024, 2048, 4096)  # FP8 lost at 1024 on an H100; the sweep finds where it starts to pay
GPU_LAYERS = 4             # enough blocks to see per-block compile reuse, small enough for 1 GPU
GPU_SEQ_LEN = 2048


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


def width_spec(hidden: int, layers: int, seq_len: int) -> ModelSpec:
    """A Llama of the given width: head dim 128 (64 below 1024), 4x fewer KV heads, FFN ~3.5x."""
    head_dim = 128 if hidden >= 1024 else 64
    heads = hidden // head_dim
    kv = max(1, heads // 4)
    inter = 16 * round(3.5 * hidden / 16)  # a multiple of 16, as FP8 GEMMs need
    return ModelSpec(f"llama-h{hidden}", "llama", _llama(hidden, inter, layers, heads, kv),
                     "LlamaDecoderLayer", seq_len)


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def flops_per_token(spec: ModelSpec, params: int, seq_len: int) -> float:
    cfg = spec.config()
    return 6.0 * params + 12.0 * cfg.num_hidden_layers * cfg.hidden_size * seq_len


def main(args) -> None:
    on_gpu = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    widths = args.hidden or (list(GPU_WIDTHS) if on_gpu and not args.quick else None)
    if widths and on_gpu and args.seq_len is None:
        args.seq_len = GPU_SEQ_LEN
    if args.precision == "auto":  # bf16 on CPU too: the part of the lesson a laptop can run
        from utilities.precision import default_policy

        precision = default_policy()[0] if on_gpu else "bf16"
    else:
        precision = args.precision
    fp8_ok, fp8_reason = fp8_available("cuda" if on_gpu else "cpu")

    with Lesson("13", args,
                settings=dict(precision=precision, widths=widths,
                              compile_backend=args.compile_backend)) as L:
        block = L.spec.block_class()
        specs = [width_spec(h, args.layers or GPU_LAYERS, L.seq_len) for h in widths] if widths \
            else [L.spec]
        def variant_label(name: str, spec: ModelSpec) -> str:  # with --hidden: compiled-h1024, ...
            return f"{name}-h{spec.config().hidden_size}" if widths else name

        if "fp8-compiled" in args.variants and not fp8_ok:
            L.print(f"  fp8-compiled skipped: {fp8_reason}")
            L.results.note(f"fp8-compiled skipped: {fp8_reason}")
            L.results.data["skipped"] = {variant_label("fp8-compiled", spec): fp8_reason for spec in specs}
        warm = L.data(seed_offset=1000)  # the compile step uses its own batch, not the timed data

        for spec in specs:
            for name in args.variants:
                if name == "fp8-compiled" and not fp8_ok:
                    continue
                variant_name = variant_label(name, spec)
                with L.variant(variant_name):  # freed before the next variant
                    L.seed()
                    model = spec.build(device=L.device)
                    params = count_parameters(model)
                    extra = dict(variant=name, precision=precision, hidden=spec.config().hidden_size,
                                 parameters=params)
                    # 1. convert (before sharding: torchao must see plain nn.Linear modules)
                    if name == "fp8-compiled":
                        extra["fp8_linears"] = len(convert_for_fp8(model))
                    else:
                        extra["fp8_linears_if_converted"] = len(fp8_linear_names(
                            model, float8_module_filter()))
                    # 2. shard: each block, then the root
                    model = shard_model(model, block_class=block, device=L.device,
                                        mp_policy=fsdp2_policy(precision))
                    # 3. compile each block in place
                    if name != "eager":
                        extra["compiled_blocks"] = compile_blocks(model, block,
                                                                  backend=args.compile_backend)
                    optimizer = L.optimizer(model)
                    if name == "fp8-compiled":  # one fused amax for all float8 weights after each step
                        optimizer.register_step_post_hook(lambda *_, m=model: fp8_precompute_scales(m))

                    torch._dynamo.reset()  # so compile cost is measured from scratch for each variant
                    with Stopwatch(L.device) as first:
                        model(**next(warm)).loss.backward()
                    model.zero_grad(set_to_none=True)
                    extra["first_step_s"] = round(first.seconds, 3)
                    L.print(f"  {variant_name}: first forward+backward (compile included) "
                            f"{first.seconds:.2f}s")

                    stats = L.train(model, variant_name, optimizer=optimizer,
                                    flops_per_token=flops_per_token(spec, params, L.seq_len))
                    L.results.add(variant_name, stats, **extra)
                    del model, optimizer
                    torch._dynamo.reset()  # compiled code of this variant goes too

        # Compile time = the compiled variant's first step minus the eager one's (same shapes).
        by_name = {v["name"]: v for v in L.results.data["variants"]}
        for v in L.results.data["variants"]:
            suffix = v["name"][len(v["variant"]):]
            eager = by_name.get("eager" + suffix)
            if v["variant"] != "eager" and eager is not None:
                v["compile_s"] = round(v["first_step_s"] - eager["first_step_s"], 3)
                v["speedup_vs_eager"] = round(v["tokens_per_s"] / eager["tokens_per_s"], 3)
            compiled = by_name.get("compiled" + suffix)
            if v["variant"] == "fp8-compiled" and compiled is not None:
                v["speedup_vs_compiled"] = round(v["tokens_per_s"] / compiled["tokens_per_s"], 3)

        if widths:
            widest = max(specs, key=lambda s: s.config().hidden_size)
            L.results.data["model"] = {"name": widest.name, "parameters": max(
                v["parameters"] for v in L.results.data["variants"])} if L.results.data["variants"] \
                else L.results.data["model"]
        L.results.note("compile_s: first step of the compiled variant minus eager's first step; "
                       "all timed steps come after it (tokens/s excludes compilation).")
        # Where FP8 starts to pay (and compile, on the bf16 rows): the lesson's measured crossover.
        measured = L.results.data["variants"]
        for key, candidate, baseline in (("fp8", "fp8-compiled", "compiled"),
                                         ("compile", "compiled", "eager")):
            if not widths or candidate not in args.variants or baseline not in args.variants:
                continue
            if candidate == "fp8-compiled" and not fp8_ok:
                found = {"hidden": None, "ratios": {}, "why": f"fp8-compiled skipped: {fp8_reason}"}
            else:
                found = crossover_hidden(measured, candidate, baseline)
            L.results.data[f"{key}_crossover_hidden"] = found["hidden"]
            L.results.data[f"{key}_crossover"] = found
            ratios = "".join(f", h{h}: {r:.2f}x" for h, r in found["ratios"].items())
            L.print(f"  {key} crossover (tokens/s {candidate} / {baseline}{ratios}): "
                    f"{found['hidden'] if found['hidden'] is not None else 'none'} ({found['why']})")
            L.results.note(f"{key}_crossover_hidden = {found['hidden']}: {found['why']}")
        if L.device.type == "cpu":
            shows = ("inductor's fused CPU kernels" if args.compile_backend == "inductor" else
                     f"the {args.compile_backend} backend (graph capture, no generated kernels)")
            L.results.note(f"CPU run in {precision}: compiled vs eager shows {shows}, not the GPU "
                           "picture; FP8 needs a Hopper/Ada GPU (sm_89+).")


if __name__ == "__main__":
    main(parse_args())
