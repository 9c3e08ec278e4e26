"""What lesson 10's training loop measures and says, kept out of the loop: step time (the slowest
rank's), tokens/s, MFU, peak memory, the log lines and tqdm bar on rank 0, the profiler trace and
results.json.

Per step the loop leaves its loss on the device and this rank's time here; they are reduced over
ranks and read back only when a line is printed, an eval runs or the run ends (``reduce_steps``):
no ``.item()``, ``float()`` or collective of its own in the steady state, so a GPU is never left
idle while the CPU waits for a number nobody reads yet.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from train_config import Config, ac_label

from utilities import distributed as D
from utilities.measure import MemoryProbe, fmt_bytes
from utilities.measure.memory import live_gradient_bytes, shard_numels
from utilities.measure.transfers import count_reduce_scatters
from utilities.models import ModelSpec
from utilities.results import Results, table
from utilities.training import TrainStats, peak_flops

TITLE = "end-to-end training codebase"


def tokens_in(batch: dict[str, torch.Tensor]) -> int:
    """Tokens a batch trains on: the inputs, plus the targets of an encoder-decoder model."""
    n = batch["input_ids"].numel()
    return n + (batch["labels"].numel() if batch["labels"].shape != batch["input_ids"].shape else 0)


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


class TrainingLog:
    """The run's numbers and rank 0's output. ``step()`` wraps one optimizer step (timing, and
    once, after the optimizer state exists, the memory probe); ``micro_batch`` adds a loss and its
    tokens; ``progress``, ``eval`` and ``checkpoint`` print; ``finish`` writes results.json."""

    def __init__(self, cfg: Config, spec: ModelSpec, info: D.DistInfo):
        self.cfg, self.spec, self.info, self.device = cfg, spec, info, info.device
        self.rank, self.world = info.rank, info.world_size
        self.out = Path(cfg.out)
        self.flops_per_token = spec.flops_per_token(cfg.seq_len)
        self.peak = peak_flops(self.device)
        self.losses: list[float] = []
        self.lrs: list[float] = []
        self.times: list[float] = []
        self.evals: list[list[float]] = []
        self.checkpoints: list[int] = []
        self.memory: dict[str, Any] = {}
        self.reduce_scatters: dict[str, int] = {}  # the probed step's: calls and input bytes
        self.between: list[dict[str, int]] = []  # the probed step's gradients after each micro-batch
        self._probed_model: nn.Module | None = None
        self._shards: dict[int, int] = {}
        self.tokens_per_step = 0
        self.start_step = 0
        self._pending: list[tuple[torch.Tensor, float, bool]] = []  # loss, local time, timed?
        self._elapsed = 0.0
        self._loss: torch.Tensor | None = None
        self._tokens = 0
        self._bar = self._profiler = None
        D.print0(f"lesson 10 ({TITLE}): {spec.name} ({spec.num_parameters:,} parameters), "
                 f"{self.world} rank(s) on {self.device.type}/{info.backend}, {cfg.api}, precision "
                 f"{cfg.precision}, AC {ac_label(cfg)}, {cfg.steps} steps of "
                 f"{cfg.grad_accum} x {cfg.batch_size} x {cfg.seq_len} tokens per rank")

    # -- around the loop ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def running(self, start_step: int) -> Iterator[None]:
        """The tqdm bar on rank 0 (silent in logs and notebooks) and, with --profile, the profiler
        (steps 3-4 into OUT/trace_rank{R}.json)."""
        from tqdm.auto import tqdm

        self.start_step = start_step
        self._bar = tqdm(total=self.cfg.steps, initial=start_step, desc="train", dynamic_ncols=True,
                         disable=None if self.rank == 0 else True)
        profiler = self._make_profiler() if self.cfg.profile else contextlib.nullcontext(None)
        with profiler as self._profiler:
            yield
        self._bar.close()

    def _make_profiler(self):
        from torch.profiler import ProfilerActivity, profile, schedule

        cuda = [ProfilerActivity.CUDA] if self.device.type == "cuda" else []
        self.out.mkdir(parents=True, exist_ok=True)
        trace = str(self.out / f"trace_rank{self.rank}.json")
        return profile(activities=[ProfilerActivity.CPU, *cuda],
                       schedule=schedule(wait=1, warmup=1, active=2),
                       on_trace_ready=lambda p: p.export_chrome_trace(trace))

    @contextlib.contextmanager
    def step(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
             scheduler: torch.optim.lr_scheduler.LRScheduler) -> Iterator[None]:
        """One optimizer step: its learning rate, its time (the first step, a warm-up, and the
        probed one are not timed) and, on the second step, the memory by category."""
        probe_memory = step == self.start_step + 2  # once, after the optimizer state exists
        self._sync()
        t0 = time.perf_counter()
        self._loss, self._tokens = None, 0
        self.lrs.append(scheduler.get_last_lr()[0])
        # FSDPMemTracker follows one forward per step: with accumulation, count live tensors instead
        tracker = None if self.cfg.grad_accum == 1 else False
        probe = MemoryProbe(model, optimizer, self.device, use_tracker=tracker) if probe_memory else None
        counting = count_reduce_scatters() if probe_memory else contextlib.nullcontext()
        self._probed_model = model if probe_memory else None
        if not self._shards:  # before the first forward, every parameter is sharded (an eval's
            self._shards = shard_numels(model)  # forward leaves FSDP2's root unsharded)
        with probe or contextlib.nullcontext(), counting as reduce_scatters:
            yield
        self._probed_model = None
        if reduce_scatters is not None:
            self.reduce_scatters = {"calls": reduce_scatters.calls, "bytes": reduce_scatters.bytes}
        self._sync()
        timed = not probe_memory and step > self.start_step + 1
        self._pending.append((self._loss, time.perf_counter() - t0, timed))
        if probe_memory:
            self.memory = probe.peak
        elif timed:
            self.tokens_per_step = self._tokens
        if self._profiler is not None:
            self._profiler.step()
        self._bar.update(1)

    def micro_batch(self, loss: torch.Tensor, tokens: int) -> None:
        """A micro-batch's (already scaled) loss, kept on the device, and the tokens it trained on."""
        loss = loss.detach().to(torch.float64)
        self._loss = loss if self._loss is None else self._loss + loss
        if self._probed_model is not None:  # the gradients this micro-batch leaves for the next
            self.between.append(live_gradient_bytes(self._probed_model, self._shards))
        self._tokens += tokens * self.world

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _catch_up(self) -> None:
        if not self._pending:
            return
        losses, times = reduce_steps([p[0] for p in self._pending], [p[1] for p in self._pending],
                                     self.device)
        for (_, _, timed), loss, t in zip(self._pending, losses, times):
            self.losses.append(loss)
            if timed:
                self.times.append(t)
        self._elapsed = times[-1]  # a step ends with its slowest rank
        self._pending.clear()
        self._bar.set_postfix(loss=f"{self.losses[-1]:.3f}", lr=f"{self.lrs[-1]:.2e}")

    # -- what rank 0 prints ------------------------------------------------------------------------
    def write(self, text: str) -> None:
        if self.rank == 0:
            self._bar.write(text)

    def progress(self, step: int, grad_norm: torch.Tensor | None) -> None:
        """Loss (mean over ranks), learning rate, gradient norm, tokens/s, MFU and peak memory."""
        self._catch_up()
        tps = self._tokens / self._elapsed
        mfu = f", MFU {tps * self.flops_per_token / (self.peak * self.world):.1%}" if self.peak else ""
        mem = (torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda"
               else self.memory.get("total"))
        norm = f", grad norm {float(grad_norm):.2f}" if grad_norm is not None else ""
        self.write(f"step {step:5d} | loss {self.losses[-1]:.4f} | lr {self.lrs[-1]:.2e}{norm} | "
                   f"{tps:,.0f} tokens/s{mfu} | peak memory/rank {fmt_bytes(mem)}")

    def eval(self, step: int, loss: float) -> None:
        self.evals.append([step, loss])
        self.write(f"step {step:5d} | eval loss {loss:.4f} (held-out)")

    def checkpoint(self, step: int, path: Path) -> None:
        self.checkpoints.append(step)
        self.write(f"step {step:5d} | checkpoint {path}")

    def close(self, message: str) -> None:
        """End the bar and say why (a crash on purpose, before os._exit)."""
        self._bar.close()
        D.print0(message)

    # -- results.json --------------------------------------------------------------------------------
    def takeaway(self, resumed_from: Path | None) -> str:
        """The run in one line: the train loss from first to last step, the last held-out loss,
        the checkpoints saved (printed last, and results.json's ``takeaway``)."""
        held_out = f", held-out loss {self.evals[-1][1]:.3f}" if self.evals else ""
        return (f"{self.cfg.api}: train loss {self.losses[0]:.3f} -> {self.losses[-1]:.3f}{held_out}, "
                f"{len(self.checkpoints)} checkpoints"
                + (f", resumed from {resumed_from}" if resumed_from else ""))

    def accumulation(self) -> dict[str, Any]:
        """What one optimizer step cost in gradient memory and communication (the probed step):
        the reduce-scatters this rank issued and their input bytes, and the gradients alive
        between micro-batches (after each but the last), sharded and unsharded, at their largest.
        None where the step has one micro-batch (nothing is between)."""
        between = self.between[:-1]
        return {"accum_sync": self.cfg.accum_sync if self.cfg.grad_accum > 1 else None,
                "reduce_scatters_per_step": self.reduce_scatters.get("calls"),
                "reduce_scatter_per_step_bytes": self.reduce_scatters.get("bytes"),
                "grads_between_sharded_bytes": max((b["sharded"] for b in between), default=None),
                "grads_between_unsharded_bytes": max((b["unsharded"] for b in between),
                                                        default=None)}

    def finish(self, resumed_from: Path | None) -> None:
        """Write results.json (one variant, named by --api) and print the table on rank 0."""
        self._catch_up()
        cfg, spec = self.cfg, self.spec
        step_time = statistics.median(self.times) if self.times else None
        tokens_per_s = self.tokens_per_step / step_time if step_time else None
        mfu = (tokens_per_s * self.flops_per_token / (self.peak * self.world)
               if self.peak and tokens_per_s else None)
        stats = TrainStats(losses=self.losses, step_times_s=self.times, mfu=mfu,
                           tokens_per_step=self.tokens_per_step, peak_memory_bytes=self.memory)
        settings = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("out", "ckpt_dir")}
        results = Results("10", TITLE, self.device, self.world, spec.name, spec.num_parameters,
                          dict(settings, backend=self.info.backend))
        results.add(cfg.api, stats, start_step=self.start_step, first_loss_step=self.start_step + 1,
                    lrs=self.lrs, eval_losses=self.evals, checkpoints=self.checkpoints,
                    resumed_from=str(resumed_from) if resumed_from else None,
                    precision=cfg.precision, activation_checkpointing=ac_label(cfg),
                    **self.accumulation())
        results.columns("precision", "activation_checkpointing", "start_step", "resumed_from")
        if self.device.type == "cpu":
            results.note("CPU run: memory from torch.distributed._tools trackers (one step); step times "
                         "on a shared CPU are only indicative; MFU needs a GPU with a known peak.")
        if self.rank == 0:
            results.takeaway(self.takeaway(resumed_from))
            path = results.write(self.out)
            last_eval = f", eval loss {self.evals[-1][1]:.4f}" if self.evals else ""
            print("\n" + table(results.data), flush=True)
            print(f"\ntrain loss {self.losses[0]:.4f} -> {self.losses[-1]:.4f}{last_eval}; median step "
                  f"{step_time or 0:.4f}s, {tokens_per_s or 0:,.0f} tokens/s; results written to {path}",
                  flush=True)
            print(f"\ntakeaway: {results.data['takeaway']}", flush=True)
