"""Lesson 10's settings: one dataclass, ``Config``, whose every field is a ``--flag`` with help.

``config_parser()`` walks ``dataclasses.fields(Config)`` and adds ``--field-name`` for each:
booleans become ``store_true``, ``X | None`` fields take ``X``. A new setting is one new field.
``finalize`` fills what depends on the hardware (model, batch, sequence length, precision), once
the process group says which device this rank has (``setup_run``).
"""

# no "from __future__ import annotations": Config's field types are read at runtime

import dataclasses
import gc
import os
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path

from utilities import distributed as D
from utilities.errors import (
    OneLineParser,
    UsageError,
    bounded,
    positive_float,
    positive_int,
    seed_value,
)
from utilities.measure.memory import check_batch_fits
from utilities.models import get_model_spec
from utilities.precision import default_policy
from utilities.text import HelpFormatter

PRECISIONS = ("auto", "fp32", "bf16", "bf16-fp32-reduce")
# the defaults that depend on the hardware: on a GPU, and on CPU (or with --quick)
GPU_MODEL, CPU_MODEL = "llama-1b", "llama-tiny"
GPU_BATCH_SIZE, CPU_BATCH_SIZE = 4, 8
nonnegative_int = bounded(int, 0)
fraction = bounded(float, 0, 1)


def opt(default, help: str, **argparse_kwargs):
    """A config field: its default, its --help text and any extra argparse settings."""
    return field(default=default, metadata={"help": help, **argparse_kwargs})


@dataclass
class Config:
    # where and what
    model: str | None = opt(None, f"named model (fsdp-course list --models); default {CPU_MODEL} on "
                                  f"CPU, {GPU_MODEL} on GPU")
    device: str = opt("auto", "cuda when a GPU is visible, else cpu", choices=D.DEVICES)
    backend: str = opt("auto", "process-group backend: nccl for cuda, gloo for cpu", choices=D.BACKENDS)
    quick: bool = opt(False, "the small CPU configuration the tests use (few steps, short sequences)")
    out: str | None = opt(None, "output directory: results.json, checkpoints/, trace (default "
                                "runs/10_end_to_end)")
    seed: int = opt(0, "seed for weights and data (same on every rank)", type=seed_value)
    # parallelism
    api: str = opt("fsdp2", "fsdp2 (fully_shard) or fsdp1 (FullyShardedDataParallel)",
                   choices=("fsdp2", "fsdp1"))
    precision: str = opt("auto", "mixed precision policy; auto: bf16 on a bf16-ready GPU, else fp32",
                         choices=PRECISIONS)
    activation_checkpointing: bool = opt(False, "recompute each block's activations in backward")
    ac_every: int = opt(1, "with --activation-checkpointing: checkpoint every N-th block (1: all, "
                           "full; 2: every other, selective)", type=positive_int)
    prefetch: int = opt(0, "FSDP2: all-gather this many blocks ahead explicitly (0: its implicit "
                           "one-ahead); FSDP1: >0 turns on forward_prefetch", type=nonnegative_int)
    compile: bool = opt(False, "torch.compile each block (slow to start; worth it on GPUs)")
    # optimization
    steps: int | None = opt(None, "optimizer steps (default 30 with --quick, else 200)",
                            type=positive_int)
    batch_size: int | None = opt(None, f"micro-batch per rank (default {CPU_BATCH_SIZE} on CPU, "
                                       f"{GPU_BATCH_SIZE} on GPU)",
                                 type=positive_int)
    grad_accum: int = opt(1, "micro-batches per optimizer step (gradient accumulation)",
                          type=positive_int)
    accum_sync: str = opt("last", "with --grad-accum N: reduce-scatter the gradients after the last "
                                  "micro-batch only (last: the unsharded gradients stay until then, "
                                  "one reduce-scatter per unit per step) or after every micro-batch "
                                  "(every: only sharded gradients are kept, N reduce-scatters per "
                                  "unit per step)", choices=("last", "every"))
    seq_len: int | None = opt(None, "tokens per sequence (default 32 with --quick, else the "
                                    "model's)", type=positive_int)
    lr: float = opt(3e-3, "peak learning rate (AdamW)", type=positive_float)
    min_lr_ratio: float = opt(0.1, "the cosine decays to lr * this at the last step", type=fraction)
    warmup_steps: int | None = opt(None, "linear warm-up steps (default: a tenth of --steps)",
                                   type=nonnegative_int)
    weight_decay: float = opt(0.0, "AdamW weight decay", type=fraction)
    grad_clip: float = opt(1.0, "clip the global gradient norm to this (0: no clipping)",
                           type=lambda s: 0.0 if s in ("0", "0.0") else positive_float(s))
    # evaluation, checkpoints, logging
    eval_every: int | None = opt(None, "evaluate on held-out data every N steps (default: a third "
                                       "of --steps) and at the end", type=positive_int)
    eval_batches: int = opt(4, "held-out batches per evaluation", type=positive_int)
    ckpt_every: int | None = opt(None, "save a DCP checkpoint every N steps (default: 10 with "
                                       "--quick, else 100; 0: never)", type=nonnegative_int)
    ckpt_dir: str | None = opt(None, "checkpoint directory (default OUT/checkpoints)")
    keep_last: int = opt(2, "checkpoints to keep (older ones are deleted)", type=positive_int)
    resume: bool = opt(False, "continue from the latest checkpoint in --ckpt-dir (fresh if none)")
    log_every: int = opt(10, "print a log line every N steps on rank 0", type=positive_int)
    profile: bool = opt(False, "record steps 3-4 with torch.profiler into OUT/trace_rank0.json")
    crash_after_step: int | None = opt(None, "testing: every rank hard-exits (os._exit) after this "
                                             "step, as a crash would", type=positive_int)


def config_parser(description: str | None = None) -> OneLineParser:
    """argparse built from Config: --field-name for each field, its type, default and help."""
    p = OneLineParser(description=description, formatter_class=HelpFormatter)
    hints = typing.get_type_hints(Config)
    for f in dataclasses.fields(Config):
        flag = "--" + f.name.replace("_", "-")
        kwargs = dict(f.metadata)
        kwargs["help"] += f" (default: {f.default})" if f.default not in (None, False) else ""
        if hints[f.name] is bool:
            p.add_argument(flag, action="store_true", **kwargs)
        else:
            base = [t for t in typing.get_args(hints[f.name]) if t is not type(None)] or [hints[f.name]]
            kwargs.setdefault("type", base[0])
            p.add_argument(flag, default=f.default, **kwargs)
    return p


def parse_args(argv: list[str] | None = None, description: str | None = None) -> Config:
    parser = config_parser(description)
    args = parser.parse_args(argv)  # one 'error:' line and exit 2 on a bad value
    if args.model is not None:
        try:
            get_model_spec(args.model)
        except UsageError as e:
            parser.exit(2, f"error: {e}\n")
    steps = args.steps or (30 if args.quick else 200)
    if args.warmup_steps is not None and args.warmup_steps >= steps:
        parser.error(f"--warmup-steps {args.warmup_steps} is not allowed; allowed: fewer than "
                     f"--steps ({steps})")
    return Config(**vars(args))


def finalize(cfg: Config, on_gpu: bool) -> Config:
    """Fill the defaults that depend on the hardware and on --quick."""
    full_size = on_gpu and not cfg.quick
    cfg.model = cfg.model or (GPU_MODEL if full_size else CPU_MODEL)
    cfg.steps = cfg.steps or (30 if cfg.quick else 200)
    cfg.batch_size = cfg.batch_size or (GPU_BATCH_SIZE if full_size else CPU_BATCH_SIZE)
    cfg.seq_len = cfg.seq_len or (32 if cfg.quick else get_model_spec(cfg.model).default_seq_len)
    cfg.warmup_steps = max(1, cfg.steps // 10) if cfg.warmup_steps is None else cfg.warmup_steps
    cfg.eval_every = cfg.eval_every or max(1, cfg.steps // 3)
    cfg.ckpt_every = (10 if cfg.quick else 100) if cfg.ckpt_every is None else cfg.ckpt_every
    cfg.out = cfg.out or str(Path("runs") / "10_end_to_end")
    cfg.ckpt_dir = cfg.ckpt_dir or str(Path(cfg.out) / "checkpoints")
    if cfg.precision == "auto":
        cfg.precision = default_policy()[0] if on_gpu else "fp32"
    if cfg.warmup_steps >= cfg.steps:  # parse_args checks this too, before torchrun starts
        raise UsageError(f"--warmup-steps {cfg.warmup_steps} is not allowed; allowed: fewer than "
                         f"--steps ({cfg.steps})")
    return cfg


def setup_run(cfg: Config) -> D.DistInfo:
    """Join the process group (torchrun set the rendezvous variables; NCCL with one GPU per
    process, or gloo on CPU), then finalize ``cfg`` in place for this rank's device. A bad value
    ends every rank with one line and exit code 2."""
    D.quiet_torch_internal_warnings()
    try:
        info = D.setup(cfg.device, cfg.backend)
    except UsageError as e:
        D.exit_on_error(e)
    if os.environ.get("TORCHELASTIC_RUN_ID"):  # a rank torchrun started: what lives now (torch,
        gc.collect()  # transformers, the process group) lives until exit, so the collector's full
        gc.freeze()  # passes, and the ~1 s of them at exit, can skip it
    try:
        finalize(cfg, on_gpu=info.device.type == "cuda")
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", info.world_size))
        check_batch_fits(get_model_spec(cfg.model).config().vocab_size, cfg.batch_size, cfg.seq_len,
                         info.device, info.ranks_per_gpu if info.device.type == "cuda" else local_ranks)
    except UsageError as e:  # every rank finds the same error: one line, exit 2, no tear-down
        D.print0(f"error: {e}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(2)
    return info


def ac_label(cfg: Config) -> str:
    """none, full (every block) or selective (every N-th block, N > 1)."""
    if not cfg.activation_checkpointing:
        return "none"
    return "full" if cfg.ac_every == 1 else f"selective (every {cfg.ac_every})"
