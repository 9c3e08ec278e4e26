"""Lesson 10: an end-to-end FSDP training program, in one file that reads top to bottom.

Start your own project from this file. It is organised the way it runs:

    1. Config        every setting is a dataclass field, and every field is a --flag with help
    2. setup         join the process group (torchrun sets the rendezvous variables)
    3. build_model   the model, exactly as it would be without FSDP
    4. parallelize   activation checkpointing, torch.compile, FSDP2 (or FSDP1) per block,
                     mixed precision, prefetching: kept apart from the model definition
    5. data          a sharded, deterministic loader that can resume mid-epoch
    6. optimizer     AdamW + linear warm-up and cosine decay (LambdaLR)
    7. checkpoint    DCP: model, optimizer, scheduler, step and data position, every N steps
    8. train loop    gradient accumulation, clipping, eval on held-out data, logging on rank 0
                     (loss, tokens/s, MFU, memory) with a tqdm bar, optional profiler trace
    9. results       results.json for the course's tools and notebook

Run: fsdp-course run 10 [--quick] [-- --api fsdp1 --precision bf16 ...]
 or: torchrun --nproc-per-node 2 lessons/10_end_to_end/train.py --device cpu --quick
"""

# no "from __future__ import annotations": Config's field types are read at runtime

import argparse
import contextlib
import dataclasses
import math
import os
import shutil
import statistics
import sys
import time
import typing
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without install

from utilities import distributed as D
from utilities.activation_checkpointing import apply_activation_checkpointing, block_units
from utilities.course.lesson import (
    LessonParser,
    bounded,
    exit_if_only_checking_flags,
    positive_float,
    positive_int,
)
from utilities.course.results import Results
from utilities.data import ReverseTask, make_loader
from utilities.dcp import check_checkpoint, training_state
from utilities.errors import UsageError
from utilities.measure import MemoryProbe, fmt_bytes
from utilities.models import META_INIT_THRESHOLD, get_model_spec, init_weights
from utilities.precision import default_policy, fsdp1_policy, fsdp2_policy
from utilities.training import TrainStats, peak_flops
from utilities.wrapping import shard_model

TITLE = "end-to-end training codebase"
PRECISIONS = ("auto", "fp32", "bf16", "bf16-fp32-reduce")


# -- 1. Config -------------------------------------------------------------------------------------
nonnegative_int = bounded(int, 0)
fraction = bounded(float, 0, 1)


def opt(default, help: str, **argparse_kwargs):
    """A config field: its default, its --help text and any extra argparse settings."""
    return field(default=default, metadata={"help": help, **argparse_kwargs})


@dataclass
class Config:
    # where and what
    model: str | None = opt(None, "named model (fsdp-course list --models); default llama-tiny on "
                                  "CPU, llama-1b on GPU")
    device: str = opt("auto", "cuda when a GPU is visible, else cpu", choices=D.DEVICES)
    backend: str = opt("auto", "process-group backend: nccl for cuda, gloo for cpu", choices=D.BACKENDS)
    quick: bool = opt(False, "the small CPU configuration the tests use (few steps, short sequences)")
    out: str | None = opt(None, "output directory: results.json, checkpoints/, trace (default "
                                "runs/10_end_to_end)")
    seed: int = opt(0, "seed for weights and data (same on every rank)")
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
    batch_size: int | None = opt(None, "micro-batch per rank (default 8 on CPU, 4 on GPU)",
                                 type=positive_int)
    grad_accum: int = opt(1, "micro-batches per optimizer step (gradient accumulation)",
                          type=positive_int)
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


def config_parser() -> LessonParser:
    """argparse built from Config: --field-name for each field, its type, default and help."""
    p = LessonParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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


def parse_args(argv: list[str] | None = None) -> Config:
    parser = config_parser()
    args = parser.parse(argv)  # one 'error:' line and exit 2 on a bad value
    steps = args.steps or (30 if args.quick else 200)
    if args.warmup_steps is not None and args.warmup_steps >= steps:
        parser.error(f"--warmup-steps {args.warmup_steps} is not allowed; allowed: fewer than "
                     f"--steps ({steps})")
    return Config(**vars(args))


def finalize(cfg: Config, on_gpu: bool) -> Config:
    """Fill the defaults that depend on the hardware and on --quick."""
    cfg.model = cfg.model or ("llama-1b" if on_gpu and not cfg.quick else "llama-tiny")
    cfg.steps = cfg.steps or (30 if cfg.quick else 200)
    cfg.batch_size = cfg.batch_size or (4 if on_gpu and not cfg.quick else 8)
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


# -- 3. the model, as it would be without FSDP -------------------------------------------------------
def build_model(cfg: Config, device: torch.device):
    """Same seed on every rank, so every rank starts from the same weights before sharding.
    Models too large for one host are built on the meta device and materialized after sharding."""
    spec = get_model_spec(cfg.model)
    torch.manual_seed(cfg.seed)
    on_meta = spec.num_parameters > META_INIT_THRESHOLD
    return spec.build(device="meta" if on_meta else device)


def ac_label(cfg: Config) -> str:
    """none, full (every block) or selective (every N-th block, N > 1)."""
    if not cfg.activation_checkpointing:
        return "none"
    return "full" if cfg.ac_every == 1 else f"selective (every {cfg.ac_every})"


# -- 4. parallelize: everything FSDP, apart from the model ------------------------------------------
def parallelize(model, cfg: Config, device: torch.device):
    block = get_model_spec(cfg.model).block_class()
    if cfg.api == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        if cfg.activation_checkpointing:  # FSDP2: checkpoint first, then shard the wrappers
            apply_activation_checkpointing(model, block, every=cfg.ac_every, api="fsdp2")
        units = block_units(model, block)  # each block (or its checkpoint wrapper), in forward order
        mp = fsdp2_policy(cfg.precision)
        for unit in units:
            if cfg.compile:
                unit.compile()  # per block, in place: parameter names do not change
            fully_shard(unit, mp_policy=mp)
        fully_shard(model, mp_policy=mp)  # the root: embeddings, final norm, head
        if cfg.prefetch:
            from utilities.prefetch import set_explicit_prefetch

            set_explicit_prefetch(units, cfg.prefetch)
        if any(p.is_meta for p in model.parameters()):
            model.to_empty(device=device)
            torch.manual_seed(cfg.seed)
            init_weights(model)
        return model
    # FSDP1: wrap first (auto-wrap policy per block), then checkpoint inside the units
    if cfg.compile:
        for m in [m for m in model.modules() if isinstance(m, block)]:
            m.compile()
    model = shard_model(model, api="fsdp1", block_class=block, policy="block", device=device,
                        mixed_precision=fsdp1_policy(cfg.precision), use_orig_params=True,
                        forward_prefetch=cfg.prefetch > 0)
    if cfg.activation_checkpointing:
        apply_activation_checkpointing(model, block, every=cfg.ac_every, api="fsdp1")
    return model


# -- 5. data: sharded, deterministic, resumable -----------------------------------------------------
def data_stream(cfg: Config, dataset, rank: int, world: int, device: torch.device, skip: int = 0):
    """Endless batches for this rank. ``skip`` batches already consumed are passed over, so a
    resumed run sees exactly the batches the uninterrupted run would have seen."""
    loader = make_loader(dataset, cfg.batch_size, rank, world, seed=cfg.seed)
    epoch, skip_in_epoch = divmod(skip, len(loader))
    while True:
        loader.sampler.set_epoch(epoch)  # a different shuffle each epoch, the same on every rank
        for i, batch in enumerate(loader):
            if i >= skip_in_epoch:  # real data: skip in the sampler instead of loading to discard
                yield {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        epoch, skip_in_epoch = epoch + 1, 0


def tokens_in(batch) -> int:
    n = batch["input_ids"].numel()
    return n + (batch["labels"].numel() if batch["labels"].shape != batch["input_ids"].shape else 0)


# -- 6. optimizer and schedule ---------------------------------------------------------------------
def adamw_implementation(device: torch.device) -> dict[str, bool]:
    """AdamW's fused kernel where this torch has one for the device (CUDA and CPU since torch 2.4;
    it accepts FSDP2's DTensor parameters and FSDP1's flat ones), else the foreach one. The
    default for-loop AdamW launches about ten small kernels per parameter, and on FSDP2 each of
    them goes through DTensor's dispatch: measured on llama-tiny (2 CPU ranks) 36 ms per step
    against 9 ms with foreach and 6 ms fused."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices as fused_on
    except ImportError:  # a private helper: should it move, foreach is still one kernel per op
        return {"foreach": True}
    return {"fused": True} if device.type in fused_on() else {"foreach": True}


def make_optimizer(model, cfg: Config, device: torch.device):
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                                  **adamw_implementation(device))

    def lr_factor(step: int) -> float:  # multiplies cfg.lr; step counts optimizer steps from 0
        if step < cfg.warmup_steps:
            return (step + 1) / (cfg.warmup_steps + 1)
        progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)


# -- 7. checkpoints: DCP, every rank writes its own shards ------------------------------------------
def save_checkpoint(ckpt_dir: Path, model, optimizer, scheduler, step: int, batches: int,
                    keep_last: int) -> Path:
    """Write into .step_N.tmp and publish it with utilities.dcp's crash-safe swap (old -> .old,
    new -> step_N, delete .old): a kill at any instant leaves a complete checkpoint that
    latest_checkpoint finds. The scheduler is Stateful: DCP calls its state_dict()."""
    from utilities.dcp import prepare_save, publish_save, recover_checkpoints

    final = ckpt_dir / f"step_{step:06d}"
    state = training_state(model, optimizer, step, batches)  # model + optimizer + step + data position
    state["scheduler"] = scheduler
    if dist.get_rank() == 0:
        recover_checkpoints(ckpt_dir)  # finish or undo what a kill left of earlier saves
    tmp = prepare_save(final)
    dcp.save(state, checkpoint_id=str(tmp))
    publish_save(tmp, final)  # a fresh run in an old directory replaces the same step's checkpoint
    if dist.get_rank() == 0:
        for old in sorted(ckpt_dir.glob("step_*"))[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)  # half-deleted, it is older and incomplete: skipped
    dist.barrier()
    return final


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    """The newest complete checkpoint, including one a kill left mid-publish (.step_N.tmp /
    .step_N.old); an unfinished save never counts. Only reads: every rank gets the same answer."""
    from utilities.dcp import latest_checkpoint as newest_complete

    return newest_complete(ckpt_dir, "step_*")


def load_checkpoint(path: Path, model, optimizer, scheduler) -> tuple[int, int]:
    """Load into the already sharded model and optimizer; returns (step, batches consumed).
    Nothing in the files can run code (utilities.dcp.dcp_load: checked metadata and entries)."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    from utilities.dcp import dcp_load

    path = check_checkpoint(path)
    state = training_state(model, optimizer)
    state["scheduler"] = scheduler  # DCP calls scheduler.load_state_dict() after reading
    dcp_load(state, path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return int(state["trainer"]["step"]), int(state["trainer"]["batches_consumed"])


# -- 8. the training loop ----------------------------------------------------------------------------
def clip_gradients(model, max_norm: float) -> torch.Tensor:
    """Clip the global gradient norm; return the norm as a tensor, not a float: ``float()`` would
    make the CPU wait for the GPU in the middle of every step (the log line converts it)."""
    if hasattr(model, "clip_grad_norm_"):  # FSDP1 computes the norm over its flat shards
        return model.clip_grad_norm_(max_norm)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)  # FSDP2: DTensor-aware
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def no_gradient_sync(model, last_micro_batch: bool, accumulating: bool = True):
    """Accumulate without reducing gradients until the last micro-batch of the step (nothing to do
    without accumulation: FSDP2's flag walks every module, so it is not set on every step)."""
    if not accumulating:
        return contextlib.nullcontext()
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(last_micro_batch)
        return contextlib.nullcontext()
    return contextlib.nullcontext() if last_micro_batch else model.no_sync()  # FSDP1


@torch.no_grad()
def evaluate(model, batches, n: int, device: torch.device) -> float:
    model.eval()
    loss = sum(float(model(**next(batches)).loss) for _ in range(n)) / n
    model.train()
    return D.all_reduce_mean(loss, device)


def reduce_steps(local_losses: list[torch.Tensor], local_times: list[float],
                 device: torch.device) -> tuple[list[float], list[float]]:
    """The losses averaged over ranks and the slowest rank's time, for every step since the last
    call: two collectives for all those steps together. Reducing them step by step costs two
    collectives and two device-to-host waits per step; the loop asks only when it prints, evaluates
    or finishes."""
    world = dist.get_world_size()
    losses = torch.stack(local_losses).to(device=device, dtype=torch.float64)
    times = torch.tensor(local_times, dtype=torch.float64, device=device)
    if world > 1:
        dist.all_reduce(losses)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return (losses / world).tolist(), times.tolist()


def main(cfg: Config) -> None:
    exit_if_only_checking_flags()
    # -- 2. setup
    D.quiet_torch_internal_warnings()
    info = D.setup(cfg.device, cfg.backend)
    device, rank, world = info.device, info.rank, info.world_size
    try:
        cfg = finalize(cfg, on_gpu=device.type == "cuda")
    except UsageError as e:  # every rank finds the same error: one line, exit 2, no tear-down
        D.print0(f"error: {e}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(2)
    spec = get_model_spec(cfg.model)
    out, ckpt_dir = Path(cfg.out), Path(cfg.ckpt_dir)

    # -- 3, 4. the model, then FSDP around it
    model = parallelize(build_model(cfg, device), cfg, device)
    D.print0(f"lesson 10 ({TITLE}): {spec.name} ({spec.num_parameters:,} parameters), {world} "
             f"rank(s) on {device.type}/{info.backend}, {cfg.api}, precision {cfg.precision}, "
             f"AC {ac_label(cfg)}, {cfg.steps} steps of "
             f"{cfg.grad_accum} x {cfg.batch_size} x {cfg.seq_len} tokens per rank")

    # -- 6. optimizer and schedule; 7. resume if asked and possible
    optimizer, scheduler = make_optimizer(model, cfg, device)
    start_step, consumed = 0, 0
    latest = latest_checkpoint(ckpt_dir) if cfg.resume else None
    if latest is not None:
        start_step, consumed = load_checkpoint(latest, model, optimizer, scheduler)
        D.print0(f"resumed from {latest} (step {start_step}, {consumed} batches consumed)")
        if start_step >= cfg.steps:
            D.print0(f"nothing to do: the checkpoint is at step {start_step} and --steps is "
                     f"{cfg.steps} (raise --steps to train further); {out} is left as it is")
            D.teardown()
            return
    elif cfg.resume:
        D.print0(f"--resume: no checkpoint in {ckpt_dir}, starting from step 0")
    elif latest_checkpoint(ckpt_dir) is not None:
        D.print0(f"note: {ckpt_dir} holds checkpoints of an earlier run; this fresh run saves beside "
                 "them (and replaces those of the same step): use --resume to continue, or another --out")

    # -- 5. data: training and held-out (another seed: examples the model never trains on)
    mode = "seq2seq" if spec.is_seq2seq else "causal"
    n_train = max(cfg.batch_size * world * cfg.grad_accum * cfg.steps, 64)
    train_set = ReverseTask(n_train, cfg.seq_len, mode=mode, seed=cfg.seed)
    eval_set = ReverseTask(cfg.batch_size * world * cfg.eval_batches, cfg.seq_len, mode=mode,
                           seed=cfg.seed + 10_000)
    batches = data_stream(cfg, train_set, rank, world, device, skip=consumed)

    # -- 8. the loop
    flops_per_token = spec.flops_per_token(cfg.seq_len)
    peak = peak_flops(device)
    losses, lrs, times, evals, ckpts, memory = [], [], [], [], [], {}
    tokens_per_step = 0
    profiler = contextlib.nullcontext(None)
    if cfg.profile:
        from torch.profiler import ProfilerActivity, profile, schedule

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        out.mkdir(parents=True, exist_ok=True)
        profiler = profile(activities=activities, schedule=schedule(wait=1, warmup=1, active=2),
                           on_trace_ready=lambda p: p.export_chrome_trace(
                               str(out / f"trace_rank{rank}.json")))
    from tqdm.auto import tqdm

    bar = tqdm(total=cfg.steps, initial=start_step, desc="train", disable=None if rank == 0 else True,
               dynamic_ncols=True)
    # Per step the loop keeps its numbers on the device and this rank's time; they are reduced over
    # ranks and read back only when a line is printed, an eval runs or the run ends (reduce_steps):
    # no .item(), float() or collective of its own in the steady state, so a GPU is never left
    # idle while the CPU waits for a number nobody reads yet.
    pending: list[tuple[int, torch.Tensor, float, bool]] = []  # step, loss, local time, timed?
    elapsed = 0.0

    def catch_up() -> None:
        nonlocal elapsed
        if not pending:
            return
        step_losses, step_times = reduce_steps([p[1] for p in pending], [p[2] for p in pending],
                                               device)
        for (_, _, _, timed), loss_value, t in zip(pending, step_losses, step_times):
            losses.append(loss_value)
            if timed:
                times.append(t)
        elapsed = step_times[-1]  # a step ends with its slowest rank
        pending.clear()
        bar.set_postfix(loss=f"{losses[-1]:.3f}", lr=f"{lrs[-1]:.2e}")

    model.train()
    accumulating = cfg.grad_accum > 1
    batch = next(batches)  # each micro-batch fetches the next one while the device still computes
    with profiler as prof:
        for step in range(start_step + 1, cfg.steps + 1):
            probe_memory = step == start_step + 2  # once, after the optimizer state exists
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            # FSDPMemTracker follows one forward per step: with accumulation, count live tensors instead
            tracker = None if cfg.grad_accum == 1 else False
            probe = MemoryProbe(model, optimizer, device, use_tracker=tracker) if probe_memory else None
            with probe or contextlib.nullcontext():
                optimizer.zero_grad(set_to_none=True)
                loss_sum, tokens = None, 0
                for micro in range(cfg.grad_accum):
                    tokens += tokens_in(batch) * world
                    with no_gradient_sync(model, micro == cfg.grad_accum - 1, accumulating):
                        loss = model(**batch).loss / cfg.grad_accum
                        loss.backward()
                    loss = loss.detach().to(torch.float64)
                    loss_sum = loss if loss_sum is None else loss_sum + loss
                    batch = next(batches)  # host work, overlapping the backward on a GPU
                grad_norm = clip_gradients(model, cfg.grad_clip) if cfg.grad_clip else None
                lrs.append(scheduler.get_last_lr()[0])
                optimizer.step()
                scheduler.step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            # the first step (warm-up) and the probed one are not timed
            pending.append((step, loss_sum, time.perf_counter() - t0,
                            not probe_memory and step > start_step + 1))
            consumed += cfg.grad_accum
            if probe_memory:
                memory = probe.peak
            elif step > start_step + 1:
                tokens_per_step = tokens
            if prof is not None:
                prof.step()
            bar.update(1)

            if step % cfg.log_every == 0 or step == cfg.steps:
                catch_up()
                tps = tokens / elapsed
                mfu = f", MFU {tps * flops_per_token / (peak * world):.1%}" if peak else ""
                mem = (torch.cuda.max_memory_allocated(device) if device.type == "cuda"
                       else memory.get("total"))
                norm = f", grad norm {float(grad_norm):.2f}" if grad_norm is not None else ""
                if rank == 0:
                    bar.write(f"step {step:5d} | loss {losses[-1]:.4f} | lr {lrs[-1]:.2e}{norm} | "
                              f"{tps:,.0f} tokens/s{mfu} | peak memory/rank {fmt_bytes(mem)}")
            if step % cfg.eval_every == 0 or step == cfg.steps:
                eval_batches = data_stream(cfg, eval_set, rank, world, device)
                evals.append([step, evaluate(model, eval_batches, cfg.eval_batches, device)])
                if rank == 0:
                    bar.write(f"step {step:5d} | eval loss {evals[-1][1]:.4f} (held-out)")
            if cfg.ckpt_every and step % cfg.ckpt_every == 0:
                path = save_checkpoint(ckpt_dir, model, optimizer, scheduler, step, consumed,
                                       cfg.keep_last)
                ckpts.append(step)
                if rank == 0:
                    bar.write(f"step {step:5d} | checkpoint {path}")
            if cfg.crash_after_step == step:
                bar.close()
                D.print0(f"--crash-after-step {step}: exiting every rank without cleanup")
                sys.stdout.flush()
                os._exit(3)
    bar.close()

    # -- 9. results.json
    step_time = statistics.median(times) if times else None
    tokens_per_s = tokens_per_step / step_time if step_time else None
    stats = TrainStats(losses=losses, step_times_s=times, tokens_per_step=tokens_per_step,
                       peak_memory_bytes=memory,
                       mfu=tokens_per_s * flops_per_token / (peak * world) if peak and tokens_per_s
                       else None)
    settings = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("out", "ckpt_dir")}
    results = Results("10", TITLE, device, world, spec.name, spec.num_parameters,
                      dict(settings, backend=info.backend))
    results.add(cfg.api, stats, start_step=start_step, first_loss_step=start_step + 1, lrs=lrs,
                eval_losses=evals, checkpoints=ckpts, resumed_from=str(latest) if latest else None,
                precision=cfg.precision, activation_checkpointing=ac_label(cfg))
    if device.type == "cpu":
        results.note("CPU run: memory from torch.distributed._tools trackers (one step); step times "
                     "on a shared CPU are only indicative; MFU needs a GPU with a known peak.")
    if rank == 0:
        path = results.write(out)
        last_eval = f", eval loss {evals[-1][1]:.4f}" if evals else ""
        print(f"\ntrain loss {losses[0]:.4f} -> {losses[-1]:.4f}{last_eval}; median step "
              f"{step_time or 0:.4f}s, {tokens_per_s or 0:,.0f} tokens/s; results written to {path}",
              flush=True)
    D.teardown()


if __name__ == "__main__":
    main(parse_args())
