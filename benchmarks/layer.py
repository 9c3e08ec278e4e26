"""Layer benchmark: one transformer layer, forward + backward, bf16 eager vs compiled vs FP8.

The layer is built here from plain torch modules (pre-norm, as TransformerEngine's
TransformerLayer): LayerNorm -> q/k/v Linear -> F.scaled_dot_product_attention (causal) -> out
Linear -> residual -> LayerNorm -> Linear(hidden, ffn) -> GELU -> Linear(ffn, hidden) -> residual.
The shape is TransformerEngine's published example: hidden 4096, ffn 16384, 32 heads, seq 2048,
batch 4 and 8 (their figures: batch 8 bf16 PyTorch 48.28 ms, TE + FP8 21.67 ms; batch 4 fp8
27.8 ms, on an H100). Our FP8 variant is torchao Float8Linear (utilities.fp8), compiled,
not TransformerEngine's fused layer.

The choices torchao and torch.compile offer are named configurations (--variants), so the result
says which choice gave what:

    eager                   bf16, no compile: the baseline of every ratio (speedup_vs_eager)
    compile                 the whole layer compiled: inductor can fuse the norms, GELU, residual
                            adds and the casts around the matmuls
    compile-linear          only each Linear compiled (as early FP8 recipes did): nothing between
                            the matmuls is fused
    fp8-tensorwise          Float8Linear, one scale per tensor, whole layer compiled
    fp8-rowwise             Float8Linear, one scale per row (more accurate), whole layer compiled
    fp8-tensorwise-linear   tensorwise, only each Linear compiled
    fp8-tensorwise-eager    tensorwise, not compiled (shows why FP8 needs compile)

In every configuration the attention is F.scaled_dot_product_attention in the layer's dtype (bf16
on a GPU): FP8 converts only the Linear layers, and SDPA dispatches to the flash kernel on an
H100 (--attention flash insists on it). FP8 rows also get speedup_vs_compile (the torchao
comparison: Float8 +25% over bf16, both compiled). A configuration that fails (a recipe this
torchao or GPU lacks) is recorded under `skipped` with its one-line error; the others still run.
`fp8` is accepted as the old name of fp8-tensorwise.

Rules: each variant runs --warmup untimed forward+backward passes (compilation happens there), then
--iters timed ones, each synchronized; the median, min and max are reported in milliseconds.

--tiny (CPU): hidden 64, ffn 256, 4 heads, seq 32, batch 2, fp32, eager, compile and
compile-linear (aot_eager backend: the same graph capture, without inductor's C++ code
generation); the FP8 configurations are skipped with the reason.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.nn.functional as F
from common import base_parser, metadata, output_path, pick_device, save, time_it
from torch import nn

NAME = "layer"
PUBLISHED = {  # TransformerEngine, H100, per forward+backward of one TransformerLayer
    "bf16_batch8_ms": 48.28, "te_fp8_batch8_ms": 21.67, "fp8_batch4_ms": 27.8,
    "source": "TransformerEngine, one TransformerLayer on an H100 (the course's reference/anchors.md)",
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# name -> (what is compiled: None / "layer" / "linear", float8 recipe or None)
CONFIGS = {
    "eager": (None, None),
    "compile": ("layer", None),
    "compile-linear": ("linear", None),
    "fp8-tensorwise": ("layer", "tensorwise"),
    "fp8-rowwise": ("layer", "rowwise"),
    "fp8-tensorwise-linear": ("linear", "tensorwise"),
    "fp8-tensorwise-eager": (None, "tensorwise"),
}
ALIASES = {"fp8": "fp8-tensorwise"}
TINY_VARIANTS = ["eager", "compile", "compile-linear", "fp8-tensorwise", "fp8-rowwise"]
ATTENTION = ("auto", "flash", "efficient", "cudnn", "math")


class Layer(nn.Module):
    def __init__(self, hidden: int, ffn: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(hidden)
        self.q = nn.Linear(hidden, hidden)
        self.k = nn.Linear(hidden, hidden)
        self.v = nn.Linear(hidden, hidden)
        self.o = nn.Linear(hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, ffn)
        self.down = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        y = self.norm1(x)

        def split(t: torch.Tensor) -> torch.Tensor:  # (b, s, h) -> (b, heads, s, h / heads)
            return t.view(b, s, self.heads, h // self.heads).transpose(1, 2)

        attn = F.scaled_dot_product_attention(split(self.q(y)), split(self.k(y)), split(self.v(y)),
                                              is_causal=True)
        x = x + self.o(attn.transpose(1, 2).reshape(b, s, h))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


def parse_args(argv=None):
    p = base_parser(__doc__)
    p.add_argument("--hidden", type=int, default=None, help="hidden size (default 4096; 64 tiny)")
    p.add_argument("--ffn", type=int, default=None, help="MLP inner size (default 16384; 256 tiny)")
    p.add_argument("--heads", type=int, default=None, help="attention heads (default 32; 4 tiny)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 2048; 32 tiny)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=None,
                   help="batch sizes to time (default 4 8; 2 tiny)")
    p.add_argument("--dtype", default=None, choices=tuple(DTYPES),
                   help="parameter and activation dtype (default bf16 on GPU; fp32 tiny/CPU)")
    p.add_argument("--variants", nargs="+", default=None, choices=(*CONFIGS, *ALIASES), metavar="VARIANT",
                   help=f"configurations to time (default: all on GPU; {' '.join(TINY_VARIANTS)} tiny); "
                        f"choices: {' '.join(CONFIGS)}; FP8 ones are skipped, with the reason, where "
                        "utilities.fp8.fp8_available says no")
    p.add_argument("--attention", default="auto", choices=ATTENTION,
                   help="scaled_dot_product_attention backend: auto (PyTorch picks; flash for bf16 on "
                        "an H100) or one to insist on (default auto)")
    p.add_argument("--compile-backend", default=None,
                   help="torch.compile backend for the compile and fp8 variants (default inductor; "
                        "aot_eager with --tiny: traces the same graphs without minutes of C++ codegen "
                        "on a shared CPU)")
    p.add_argument("--warmup", type=int, default=None, help="untimed passes first (default 5; 2 tiny)")
    p.add_argument("--iters", type=int, default=None, help="timed passes (default 20; 10 tiny), >= 10")
    args = p.parse_args(argv)
    on_gpu = pick_device(args.device).type == "cuda"
    small = args.tiny or not on_gpu
    args.hidden = args.hidden or (64 if small else 4096)
    args.ffn = args.ffn or (256 if small else 16384)
    args.heads = args.heads or (4 if small else 32)
    args.seq_len = args.seq_len or (32 if small else 2048)
    args.batch_sizes = args.batch_sizes or ([2] if small else [4, 8])
    args.dtype = args.dtype or ("bf16" if on_gpu and not args.tiny else "fp32")
    args.compile_backend = args.compile_backend or ("aot_eager" if args.tiny else "inductor")
    args.variants = list(dict.fromkeys(ALIASES.get(v, v) for v in args.variants or
                                       (TINY_VARIANTS if args.tiny else list(CONFIGS))))
    if "eager" not in args.variants:  # the baseline every ratio is taken against
        args.variants.insert(0, "eager")
    args.warmup = args.warmup if args.warmup is not None else (2 if small else 5)
    args.iters = args.iters or (10 if small else 20)
    if args.iters < 10:
        p.error(f"--iters {args.iters} is not allowed; allowed: integers >= 10 (the median of >= 10)")
    if args.hidden % args.heads:
        p.error(f"--hidden {args.hidden} is not allowed; allowed: multiples of --heads ({args.heads})")
    return args


def build(args, device: torch.device, variant: str) -> nn.Module:
    compiled, recipe = CONFIGS[variant]
    torch.manual_seed(0)
    layer = Layer(args.hidden, args.ffn, args.heads).to(device=device, dtype=DTYPES[args.dtype])
    if recipe:
        from utilities.fp8 import convert_for_fp8

        convert_for_fp8(layer, fsdp_float8_all_gather=False, recipe=recipe)  # no FSDP here
    if compiled == "layer":
        layer = torch.compile(layer, backend=args.compile_backend)
    elif compiled == "linear":
        for m in layer.modules():
            if isinstance(m, nn.Linear):  # torchao's Float8Linear is an nn.Linear too
                m.compile(backend=args.compile_backend)
    return layer


def attention_context(name: str):
    """The SDPA backend to insist on, or nothing for auto."""
    import contextlib

    if name == "auto":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
               "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}[name]
    return sdpa_kernel([backend])


def add_ratios(rows: list[dict]) -> None:
    """speedup_vs_eager on every row, speedup_vs_compile on the FP8 ones (same batch, same run)."""
    by = {(r["variant"], r["batch"]): r for r in rows}
    for r in rows:
        eager, compiled = by.get(("eager", r["batch"])), by.get(("compile", r["batch"]))
        r["speedup_vs_eager"] = eager["median_ms"] / r["median_ms"] if eager else None
        if r.get("fp8_recipe") and compiled:
            r["speedup_vs_compile"] = compiled["median_ms"] / r["median_ms"]


def time_variant(args, device: torch.device, variant: str) -> list[dict]:
    """Build one configuration and time it at every batch size; one row per batch."""
    compiled, recipe = CONFIGS[variant]
    layer = build(args, device, variant)
    rows = []
    for batch in args.batch_sizes:
        x = torch.randn(batch, args.seq_len, args.hidden, device=device, dtype=DTYPES[args.dtype],
                        requires_grad=True)
        grad = torch.randn_like(x)

        def step(layer=layer, x=x, grad=grad):
            layer(x).backward(grad)
            x.grad = None
            for p in layer.parameters():
                p.grad = None

        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        with attention_context(args.attention):
            t = time_it(step, device, args.warmup, args.iters)
        row = {"variant": variant, "batch": batch, "dtype": args.dtype, **t,
               "compiled": compiled, "fp8_recipe": recipe, "attention": f"sdpa ({args.attention})",
               "compile_backend": args.compile_backend if compiled else None}
        if device.type == "cuda":
            row["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device)
        rows.append(row)
        print(f"{variant:22s} batch {batch}: median {t['median_ms']:.3f} ms (min {t['min_ms']:.3f}, "
              f"max {t['max_ms']:.3f}) over {t['iters']} iterations", flush=True)
        del x, grad
    del layer
    return rows


def main(argv=None) -> int:
    from utilities.fp8 import fp8_available

    args = parse_args(argv)
    device = pick_device(args.device)
    data = metadata(NAME, device, args)
    data.update(published=PUBLISHED, configs={k: {"compiled": c, "fp8_recipe": r}
                                              for k, (c, r) in CONFIGS.items()}, rows=[], skipped=[])
    fp8_ok, fp8_reason = fp8_available(device)
    for variant in args.variants:
        if CONFIGS[variant][1] and not fp8_ok:
            data["skipped"].append({"variant": variant, "reason": fp8_reason})
            print(f"{variant}: skipped ({fp8_reason})", flush=True)
            continue
        try:
            data["rows"] += time_variant(args, device, variant)
        except Exception as e:  # a recipe this torchao / GPU lacks, an OOM: say so, go on
            reason = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"
            data["skipped"].append({"variant": variant, "reason": reason})
            print(f"{variant}: failed ({reason})", flush=True)
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
            torch._dynamo.reset()
    add_ratios(data["rows"])
    if device.type == "cpu":
        data["notes"] = ["CPU, tiny: a shape check of the benchmark, not comparable to the published "
                         "H100 figures."]
    save(data, output_path(NAME, device, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
