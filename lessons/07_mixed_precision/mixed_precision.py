"""Lesson 07: mixed precision (and the bf16 checker).

FSDP keeps the sharded parameters the optimizer updates in fp32, but it can all-gather them in a
16-bit dtype, so forward and backward compute in 16 bits, and it can reduce-scatter the gradients
in 16 bits too: half the communication, half the unsharded parameter and activation memory, and on
GPUs with tensor cores, much faster matmuls. A policy names the dtypes:

    fp32              param fp32, reduce fp32   the baseline
    bf16              param bf16, reduce bf16   same range as fp32, 8 bits of mantissa
    bf16-fp32-reduce  param bf16, reduce fp32   gradients averaged in fp32 (safer with many ranks)
    fp16              param fp16, reduce fp16   with ShardedGradScaler (loss scaling)
    fp16-no-scaler    param fp16, reduce fp16   no scaler: small gradients flush to zero

Every variant trains the same model on the same data. For each one the script records what it
*observed*: the dtype of every Linear weight as its forward starts, and the dtype of every gradient
FSDP hands to reduce-scatter (with the fraction of entries that are exactly zero or inf/NaN there),
plus the step time, the peak memory and the loss curve.

The same policies by name, for your own code: utilities.precision.fsdp2_policy(name) /
fsdp1_policy(name), the classic bfSixteen / fpSixteen / fp32_policy, and default_policy(), which
picks bf16 where utilities.bf16_ready() says native bf16 works, else fp32.

Run: fsdp-course run 07 [--quick]   or   torchrun --nproc-per-node 2 mixed_precision.py --device cpu
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without install

import torch
from mixed_precision_run import run_policies, takeaway
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

from utilities.course.lesson import Lesson, lesson_parser
from utilities.distributed import world_mesh
from utilities.wrapping import fsdp1_meta_init

# -- the code this lesson teaches -----------------------------------------------------------------
# FSDP2: fully_shard(module, mp_policy=...). param_dtype: what the fp32 shards are all-gathered (and
# computed) in; reduce_dtype: what the gradients are reduce-scattered (averaged) in.
FSDP2_POLICIES: dict[str, MixedPrecisionPolicy] = {
    "fp32": MixedPrecisionPolicy(),  # every dtype None: nothing is cast
    "bf16": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16),
    "bf16-fp32-reduce": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    "fp16": MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float16),
    "fp16-no-scaler": MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float16),
}
# FSDP1: FullyShardedDataParallel(model, mixed_precision=...); None is no mixed precision. It also
# casts buffers (buffer_dtype), which FSDP2 leaves in their own dtype.
FSDP1_POLICIES: dict[str, MixedPrecision | None] = {
    "fp32": None,
    "bf16": MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                           buffer_dtype=torch.bfloat16),
    "bf16-fp32-reduce": MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                       buffer_dtype=torch.bfloat16),
    "fp16": MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float16,
                           buffer_dtype=torch.float16),
    "fp16-no-scaler": MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float16,
                                     buffer_dtype=torch.float16),
}
NEEDS_SCALER = {"fp16"}  # fp16-no-scaler shows what goes wrong without one
APIS = ("fsdp2", "fsdp1")


def shard_fsdp2(model: nn.Module, block_class: type[nn.Module], mp_policy: MixedPrecisionPolicy) -> nn.Module:
    """The same policy on every ``fully_shard`` call. It may differ per call (a block kept in fp32,
    say); a unit's forward casts its floating-point inputs to its ``param_dtype``."""
    blocks = [m for m in model.modules() if isinstance(m, block_class)]
    mesh = world_mesh()  # every rank, on this run's device (not the machine's accelerator)
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    return model


def shard_fsdp1(model: nn.Module, block_class: type[nn.Module], mixed_precision: MixedPrecision | None,
                device: torch.device) -> nn.Module:
    """One ``MixedPrecision`` for every unit the auto-wrap policy makes. ``device_id``: this rank's
    GPU, or the CPU (without it FSDP1 looks for an accelerator)."""
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={block_class})
    on_meta = any(p.is_meta for p in model.parameters())  # too big for one host: built on meta
    return FSDP(model, auto_wrap_policy=policy, mixed_precision=mixed_precision, device_id=device,
                param_init_fn=fsdp1_meta_init(model, device) if on_meta else None)


def fp16_scaler(device: torch.device) -> ShardedGradScaler:
    """fp16's loss scaler: it multiplies the loss (by 65536 at first) so that small gradients stay
    above fp16's smallest number, divides them back before the optimizer step, and skips a step
    (halving the scale) when any rank saw inf/NaN. bf16 has fp32's range and needs none."""
    return ShardedGradScaler(device=device.type, init_scale=2.0**16)


def scaled_step(scaler: ShardedGradScaler) -> Callable[[nn.Module, dict], torch.Tensor]:
    """Forward, then backward on the *scaled* loss; ``attach_scaler`` makes ``optimizer.step()``
    do ``scaler.step(optimizer); scaler.update()``."""
    def step(model, batch):
        loss = model(**batch).loss
        scaler.scale(loss).backward()
        return loss
    return step


# -- the lesson run -------------------------------------------------------------------------------
NOTES = (
    "forward_param_dtypes / reduce_dtypes are observed (a forward pre-hook on every Linear; a wrapper "
    "around reduce_scatter_single), not read from config, on the untimed steps (warm-up and memory): "
    "the probe syncs the host per reduce-scatter, so no timed step runs with it.",
    "grad_zero_fraction: gradient entries that reached the reduce-scatter as exact zeros (some are "
    "zero in any dtype: unused embeddings, FSDP padding); grad_fp16_underflow_fraction: non-zero "
    "entries below 2**-25, which fp16 rounds to zero. Both over the reductions whose gradients were "
    "all finite.",
)
CPU_NOTE = ("CPU run: 16-bit matmuls on CPU are emulated or slow; step times and speed-ups are only "
            "meaningful on GPUs with bf16/fp16 tensor cores.")


def main(args: argparse.Namespace) -> None:
    # GPU batch 8: at batch 4 T5-large is bound by kernel launches and bf16 shows no gain (H100,
    # 2026-11-22: 0.336 s bf16 vs 0.323 s fp32); at batch 8 a plain step is 1.9x faster in bf16.
    with Lesson("07", args, settings={"api": args.api}, notes=NOTES, cpu_note=CPU_NOTE,
                takeaway=takeaway) as lesson:
        run_policies(lesson, args, SimpleNamespace(**globals()))  # the policies above, observed


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = lesson_parser(__doc__)
    p.add_argument("--policies", default=",".join(FSDP2_POLICIES),
                   help=f"comma-separated subset of: {', '.join(FSDP2_POLICIES)}")
    p.add_argument("--api", default="fsdp2", choices=APIS,
                   help="fsdp2 (fully_shard + MixedPrecisionPolicy, default) or fsdp1 "
                        "(FullyShardedDataParallel + MixedPrecision)")
    args = p.parse(argv)
    chosen = [v.strip() for v in args.policies.split(",") if v.strip()]
    bad = [v for v in chosen if v not in FSDP2_POLICIES]
    if bad or not chosen:
        p.exit(2, f"error: --policies {bad[0] if bad else args.policies!r} is not allowed; "
                  f"allowed: {', '.join(FSDP2_POLICIES)}\n")
    args.policies = chosen
    return args


if __name__ == "__main__":
    main(parse_args())
