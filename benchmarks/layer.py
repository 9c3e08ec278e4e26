"""Layer benchmark: one transformer layer, forward + backward, bf16 eager vs compiled vs FP8.

The layer is built here from plain torch modules (pre-norm, as TransformerEngine's
TransformerLayer): LayerNorm -> q/k/v Linear -> F.scaled_dot_product_attention (causal) -> out
Linear -> residual -> LayerNorm -> Linear(hidden, ffn) -> GELU -> Linear(ffn, hidden) -> residual.
The shape is TransformerEngine's published example: hidden 4096, ffn 16384, 32 heads, seq 2048,
batch 4 and 8 (their figures: batch 8 bf16 PyTorch 48.28 ms, TE + FP8 21.67 ms; batch 4 fp8
27.8 ms, on an H100). Our FP8 variant is torchao Float8Linear (utilities.low_precision), compiled,
not TransformerEngine's fused layer.

Rules: each variant runs --warmup untimed forward+backward passes (compilation happens there), then
--iters timed ones, each synchronized; the median, min and max are reported in milliseconds.

--tiny (CPU): hidden 64, ffn 256, 4 heads, seq 32, batch 2, fp32, eager and compiled (aot_eager
backend: the same graph capture, without inductor's C++ code generation).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from common import base_parser, metadata, output_path, pick_device, save, time_it  # noqa: E402
from torch import nn  # noqa: E402

NAME = "layer"
PUBLISHED = {  # TransformerEngine, H100, per forward+backward of one TransformerLayer
    "bf16_batch8_ms": 48.28, "te_fp8_batch8_ms": 21.67, "fp8_batch4_ms": 27.8,
    "source": "TransformerEngine, one TransformerLayer on an H100 (the course's reference/anchors.md)",
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


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
    p.add_argument("--variants", nargs="+", default=None, choices=("eager", "compile", "fp8"),
                   help="what to time (default: eager compile fp8; fp8 is skipped, with the reason, "
                        "where utilities.low_precision.fp8_available says no)")
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
    args.variants = args.variants or ["eager", "compile", "fp8"]
    args.warmup = args.warmup if args.warmup is not None else (2 if small else 5)
    args.iters = args.iters or (10 if small else 20)
    if args.iters < 10:
        p.error(f"--iters {args.iters} is not allowed; allowed: integers >= 10 (the median of >= 10)")
    if args.hidden % args.heads:
        p.error(f"--hidden {args.hidden} is not allowed; allowed: multiples of --heads ({args.heads})")
    return args


def build(args, device: torch.device, variant: str) -> nn.Module:
    torch.manual_seed(0)
    layer = Layer(args.hidden, args.ffn, args.heads).to(device=device, dtype=DTYPES[args.dtype])
    if variant == "fp8":
        from utilities.low_precision import convert_for_fp8

        convert_for_fp8(layer, fsdp_float8_all_gather=False)  # no FSDP here
    if variant in ("compile", "fp8"):  # fp8 without compile is slower than bf16 (see lesson 13)
        layer = torch.compile(layer, backend=args.compile_backend)
    return layer


def main(argv=None) -> int:
    from utilities.low_precision import fp8_available

    args = parse_args(argv)
    device = pick_device(args.device)
    data = metadata(NAME, device, args)
    data.update(published=PUBLISHED, rows=[], skipped=[])
    fp8_ok, fp8_reason = fp8_available(device)
    for variant in args.variants:
        if variant == "fp8" and not fp8_ok:
            data["skipped"].append({"variant": "fp8", "reason": fp8_reason})
            print(f"fp8: skipped ({fp8_reason})", flush=True)
            continue
        layer = build(args, device, variant)
        for batch in args.batch_sizes:
            x = torch.randn(batch, args.seq_len, args.hidden, device=device, dtype=DTYPES[args.dtype],
                            requires_grad=True)
            grad = torch.randn_like(x)

            def step(layer=layer, x=x, grad=grad):
                layer(x).backward(grad)
                x.grad = None
                for p in layer.parameters():
                    p.grad = None

            t = time_it(step, device, args.warmup, args.iters)
            row = {"variant": variant, "batch": batch, "dtype": args.dtype, **t,
                   "compile_backend": args.compile_backend if variant != "eager" else None}
            if device.type == "cuda":
                row["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device)
                torch.cuda.reset_peak_memory_stats(device)
            data["rows"].append(row)
            print(f"{variant:8s} batch {batch}: median {t['median_ms']:.3f} ms (min {t['min_ms']:.3f}, "
                  f"max {t['max_ms']:.3f}) over {t['iters']} iterations", flush=True)
        del layer
    if device.type == "cpu":
        data["notes"] = ["CPU, tiny: a shape check of the benchmark, not comparable to the published "
                         "H100 figures."]
    save(data, output_path(NAME, device, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
