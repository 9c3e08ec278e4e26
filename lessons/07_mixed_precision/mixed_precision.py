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

    FSDP2: fully_shard(block, mp_policy=MixedPrecisionPolicy(param_dtype=..., reduce_dtype=...))
    FSDP1: FullyShardedDataParallel(model, mixed_precision=MixedPrecision(param_dtype=..., ...))

The policies are importable: utilities.precision.fsdp2_policy(name) / fsdp1_policy(name), and
default_policy() picks bf16 where utilities.bf16_ready() says native bf16 works, else fp32.

Run: fsdp-course run 07 [--quick]   or   torchrun --nproc-per-node 2 mixed_precision.py --device cpu
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without install

from utilities.course.lesson import Lesson, lesson_parser
from utilities.precision import (
    POLICIES,
    attach_scaler,
    default_policy,
    fsdp1_policy,
    fsdp2_policy,
    make_scaler,
    observe_dtypes,
)
from utilities.training import default_step
from utilities.wrapping import APIS, shard_model


def parse_args(argv=None):
    p = lesson_parser(__doc__)
    p.add_argument("--policies", default=",".join(POLICIES),
                   help=f"comma-separated subset of: {', '.join(POLICIES)}")
    p.add_argument("--api", default="fsdp2", choices=APIS,
                   help="fsdp2 (fully_shard + MixedPrecisionPolicy, default) or fsdp1 "
                        "(FullyShardedDataParallel + MixedPrecision)")
    args = p.parse(argv)
    chosen = [v.strip() for v in args.policies.split(",") if v.strip()]
    bad = [v for v in chosen if v not in POLICIES]
    if bad or not chosen:
        p.exit(2, f"error: --policies {bad[0] if bad else args.policies!r} is not allowed; "
                  f"allowed: {', '.join(POLICIES)}\n")
    args.policies = chosen
    return args


def scaled_step(scaler):
    """Forward, then backward on the *scaled* loss (the optimizer step unscales; see attach_scaler)."""
    _quiet_implicit_replication(scaler)

    def step(model, batch):
        loss = model(**batch).loss
        scaler.scale(loss).backward()
        return loss
    return step


def _quiet_implicit_replication(scaler) -> None:
    """Hide one warning, only where it is expected and harmless.

    ``ShardedGradScaler.unscale_`` checks FSDP2's DTensor gradients for inf/NaN with its own
    ``found_inf`` and ``inv_scale`` tensors, which have shape ``[1]``. DTensor replicates such a
    one-element tensor implicitly, which is right here: every rank holds the same scale. It warns
    "Found a non-scalar tensor with numel=1 and ndim!=0" each time (six lines per run). We ignore
    that message, as a UserWarning from DTensor's dispatcher, during ``unscale_`` only.
    """
    import warnings

    unscale = scaler.unscale_

    def quiet_unscale(optimizer):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Found a non-scalar tensor with numel=1",
                                    category=UserWarning, module=r"torch\.distributed\.tensor")
            return unscale(optimizer)

    scaler.unscale_ = quiet_unscale  # GradScaler.step calls self.unscale_(optimizer)


def main(args) -> None:
    # GPU batch 8: at batch 4 T5-large is bound by kernel launches and bf16 shows no gain (H100,
    # 2026-11-22: 0.336 s bf16 vs 0.323 s fp32); at batch 8 a plain step is 1.9x faster in bf16.
    with Lesson("07", args, settings={"api": args.api}) as L:
        block = L.spec.block_class()
        chosen, why = default_policy()
        L.print(f"default_policy() here: {chosen} ({why})")

        for name in args.policies:
            with L.variant(name):  # everything the variant made is freed before the next one
                if args.api == "fsdp2":
                    options = {"mp_policy": fsdp2_policy(name)}
                else:
                    options = {"mixed_precision": fsdp1_policy(name)}
                model = shard_model(L.build_model(), api=args.api, block_class=block, device=L.device,
                                    **options)
                model = L.materialize(model)
                optimizer = L.optimizer(model)
                scaler = make_scaler(name, L.device)
                step_fn, scales = default_step, None
                if scaler is not None:
                    step_fn, scales = scaled_step(scaler), attach_scaler(optimizer, scaler)
                with observe_dtypes(model) as seen:
                    stats = L.train(model, f"{args.api}-{name}", optimizer=optimizer, step_fn=step_fn)
                p = POLICIES[name]
                extra = dict(api=args.api, policy=name, param_dtype=str(p.param)[6:],
                             reduce_dtype=str(p.reduce)[6:], **seen.as_dict())
                if scales is not None:
                    extra["loss_scales"] = scales
                L.results.add(f"{args.api}-{name}", stats, **extra)
                L.print(f"    forward weights {seen.forward_param_dtypes}, reduce-scatter "
                        f"{seen.reduce_dtypes}, zero grads {extra['grad_zero_fraction']:.3%}, "
                        f"below fp16 {extra['grad_fp16_underflow_fraction']:.3%}, reductions with "
                        f"inf/NaN {seen.nonfinite_reductions}/{seen.reductions}")
                del model, optimizer

        L.results.data["default_policy"] = {"name": chosen, "reason": why}
        L.results.note("forward_param_dtypes / reduce_dtypes are observed (a forward pre-hook on "
                       "every Linear; a wrapper around reduce_scatter_single), not read from config.")
        L.results.note("grad_zero_fraction: gradient entries that reached the reduce-scatter as "
                       "exact zeros (some are zero in any dtype: unused embeddings, FSDP padding); "
                       "grad_fp16_underflow_fraction: non-zero entries below 2**-25, which fp16 "
                       "rounds to zero. Both over the reductions whose gradients were all finite.")
        if L.device.type == "cpu":
            L.results.note("CPU run: 16-bit matmuls on CPU are emulated or slow; step times and "
                           "speed-ups are only meaningful on GPUs with bf16/fp16 tensor cores.")


if __name__ == "__main__":
    main(parse_args())
