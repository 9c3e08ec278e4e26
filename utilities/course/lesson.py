"""What every lesson script shares: its flags, its set-up and tear-down, its data and its report.

A lesson script opens with the FSDP code it teaches, in plain functions; its ``main`` is then::

    args = lesson_parser(__doc__).parse(argv)
    with Lesson("01", args, cpu_note="...", takeaway=takeaway) as lesson:
        lesson.run_variants(args.variants, lambda name: wrap[name](lesson.build_model()))

``Lesson`` joins the process group (NCCL on GPUs, gloo on CPU), resolves the model for the hardware
(the catalog's ``Run``: a tiny one on CPU, a real size on GPU), seeds every rank alike, frees each
variant before the next, and on exit writes results.json and prints the comparison on rank 0, then
the lesson's point in one line: the script's ``takeaway(results)``, which reads what the run
measured. A bad flag value ends the run with one line and exit code 2.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import traceback
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from utilities import distributed as D
from utilities.course.catalog import LESSONS
from utilities.course.gc_at_exit import end_rank_now, freeze_what_lives_until_exit
from utilities.course.launch import checking_flags
from utilities.course.release import VariantScope, live_parameters
from utilities.data import ReverseTask, batches, make_loader
from utilities.errors import (
    OneLineParser,
    UsageError,
    bad_value,
    positive_float,
    positive_int,
    seed_value,
)
from utilities.measure.memory import check_batch_fits, is_oom
from utilities.measure.predictions import check_prediction_arguments
from utilities.models import META_INIT_THRESHOLD, ModelSpec, get_model_spec, init_weights
from utilities.results import Results, peak_range, table
from utilities.text import HelpFormatter, wrap_lines
from utilities.training import TrainStats, train

CPU_MODEL = "t5-tiny"


class LessonParser(OneLineParser):
    """argparse that answers a bad value with one line (no usage dump) and checks common values."""

    def add_variants(self, names) -> None:
        """``--variants a,b``: the subset of the lesson's variants to run (default: all of them).
        ``parse`` turns it into a list and refuses unknown names in one line."""
        self._variants = list(names)
        self.add_argument("--variants", default=",".join(self._variants),
                          help=f"comma-separated subset of: {', '.join(self._variants)}")

    def parse(self, argv: list[str] | None = None) -> argparse.Namespace:
        args = self.parse_args(argv)
        allowed = getattr(self, "_variants", None)
        if allowed is not None:
            chosen = [v.strip() for v in args.variants.split(",") if v.strip()]
            bad = [v for v in chosen if v not in allowed] or ([] if chosen else [args.variants])
            if bad:
                self.exit(2, f"error: --variants {bad[0]!r} is not allowed; allowed: "
                             f"{', '.join(allowed)}\n")
            args.variants = chosen
        try:
            if hasattr(args, "predict_on"):
                check_prediction_arguments(args)
            if args.model is not None:
                get_model_spec(args.model)
            if args.device == "cuda" and not checking_flags():
                D.resolve_device("cuda")  # (the launcher checks the device itself, for all ranks)
        except UsageError as e:
            self.exit(2, f"error: {e}\n")
        return args


def lesson_parser(description: str | None) -> LessonParser:
    """The flags every lesson understands; a lesson adds its own to the returned parser."""
    p = LessonParser(description=description, formatter_class=HelpFormatter)
    g = p.add_argument_group("common lesson flags")
    g.add_argument("--model", default=None,
                   help=f"named model (see `fsdp-course list --models`); default: {CPU_MODEL} on "
                        "CPU, the lesson's real size on GPU")
    g.add_argument("--device", default="auto", choices=D.DEVICES,
                   help="where to run: auto picks cuda when a GPU is visible, else cpu")
    g.add_argument("--backend", default="auto", choices=D.BACKENDS,
                   help="process-group backend: auto picks nccl for cuda, gloo for cpu")
    g.add_argument("--quick", action="store_true",
                   help="the small CPU-sized configuration the tests use: tiny model, few steps")
    g.add_argument("--out", default=None,
                   help="directory for results.json and other outputs (default runs/NN_topic)")
    g.add_argument("--steps", type=positive_int, default=None,
                   help="training steps per variant (the first is warm-up, one more is measured "
                        "for memory; the rest are timed)")
    g.add_argument("--batch-size", type=positive_int, default=None,
                   help="per-rank batch size")
    g.add_argument("--seq-len", type=positive_int, default=None,
                   help="sequence length in tokens (default: the model's)")
    g.add_argument("--lr", type=positive_float, default=None, help="AdamW learning rate")
    g.add_argument("--seed", type=seed_value, default=0, help="seed for weights and data (same on all ranks)")
    g.add_argument("--log-all-ranks", action="store_true", help="print from every rank, not only 0")
    return p


class Lesson:
    """Set-up, defaults, data and report for one lesson run (a context manager)."""

    def __init__(self, number: str, args: argparse.Namespace, *,
                 settings: dict[str, Any] | None = None, needs_ranks: str | None = None,
                 notes: tuple[str, ...] = (), cpu_note: str | None = None,
                 takeaway: Callable[[dict[str, Any]], str] | None = None):
        self.number, self.args = number, args
        self.title = LESSONS[number].title
        self._run = LESSONS[number].run  # model, batch and steps by default (the catalog's)
        self._settings = settings or {}
        self._needs_ranks = needs_ranks  # what this lesson cannot show on one rank
        self._notes = list(notes)  # sentences the reader needs beside the numbers
        self._cpu_note = cpu_note  # what a CPU run does not show (added on CPU only)
        self._takeaway = takeaway  # the lesson's point in one line, from its results (printed last)
        self.results: Results | None = None
        self._scope: VariantScope | None = None

    # -- set-up ----------------------------------------------------------------------------
    def __enter__(self) -> Lesson:
        try:
            self._setup()
        except UsageError as e:
            self._fail(e)
        return self

    def _setup(self) -> None:
        a, run = self.args, self._run
        D.quiet_torch_internal_warnings()
        self.dist = D.setup(a.device, a.backend)
        self.device = self.dist.device
        on_gpu = self.device.type == "cuda"
        self.spec: ModelSpec = get_model_spec(a.model or run.model(on_gpu, a.quick))
        self.steps = a.steps or (run.quick_steps if a.quick else run.steps)
        self.batch_size = a.batch_size or run.batch(on_gpu, a.quick)
        self.seq_len = a.seq_len or self.spec.default_seq_len
        self.lr = a.lr or run.lr
        vocab = getattr(self.spec.config(), "vocab_size", None)
        if isinstance(vocab, int):
            local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", self.dist.world_size))
            check_batch_fits(vocab, self.batch_size, self.seq_len, self.device,
                             self.dist.ranks_per_gpu if on_gpu else local_ranks)
        self.out = Path(a.out or Path("runs") / LESSONS[self.number].folder)
        settings = dict(steps=self.steps, batch_size=self.batch_size, seq_len=self.seq_len,
                        lr=self.lr, seed=a.seed, quick=a.quick, backend=self.dist.backend,
                        **self._settings)
        self.results = Results(self.number, self.title, self.device, self.dist.world_size,
                               self.spec.name, self.spec.num_parameters, settings)
        # -- ranks sharing a GPU: say so first, record it.
        if self.dist.shares_gpu:
            self.results.setting(ranks_per_gpu=self.dist.ranks_per_gpu)
            self.results.note(self.dist.shared_gpu_note())
            self.print(self.dist.shared_gpu_note())
        self.print(f"lesson {self.number} ({self.title}): {self.spec.name} "
                   f"({self.spec.num_parameters:,} parameters), {self.dist.world_size} rank(s) on "
                   f"{self.device.type} with {self.dist.backend}, "
                   + (LESSONS[self.number].sizes  # where each variant chooses its own
                      or f"{self.steps} steps, batch {self.batch_size} x seq {self.seq_len}"))
        if self._needs_ranks and self.dist.world_size == 1:
            self._one_rank_caveat()
        freeze_what_lives_until_exit()

    def _one_rank_caveat(self) -> None:
        """On one rank FSDP shards nothing and communicates nothing (FSDP1 switches to NO_SHARD,
        FSDP2's collectives are local copies): say what the run cannot show, before any number."""
        text = (f"one rank: nothing is sharded or communicated, so {self._needs_ranks} cannot show "
                f"here; differences between variants below are not the lesson's effect. Run on 2 or "
                f"more GPUs, or 2 ranks sharing one: fsdp-course run {self.number} --nproc 2")
        self.results.record("single_rank", {"caveat": text, "needs": self._needs_ranks})
        self.results.note(text)
        self.print(f"note: {text}")

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is UsageError:
            self._fail(exc)
        try:
            if exc_type is None and self.results is not None and self.dist.is_main:
                cpu = [self._cpu_note] if self._cpu_note and self.device.type == "cpu" else []
                for text in self._notes + cpu:
                    self.results.note(text)
                self.results.record("live_parameters_at_exit", live_parameters())
                self.results.takeaway(self.takeaway_line(self.results.data))
                path = self.results.write(self.out)
                print("\n" + table(self.results.data), flush=True)
                if "predicted" in self.results.data:
                    from utilities.measure.predictions import format_predicted

                    print("\n" + format_predicted(self.results.data["predicted"]), flush=True)
                self.print(f"\ntakeaway: {self.results.data['takeaway']}")
                print(f"\nresults written to {path}", flush=True)
        finally:
            D.teardown()
        if exc_type is None:
            end_rank_now()
        return False

    def takeaway_line(self, data: dict[str, Any]) -> str:
        """The lesson's takeaway; the range of peaks when a variant it reads did not run."""
        try:
            return self._takeaway(data) if self._takeaway else peak_range(data)
        except (KeyError, TypeError, ValueError, ZeroDivisionError):
            return peak_range(data)

    def _fail(self, e: Exception) -> None:
        D.exit_on_error(e)  # every rank hits the same error: one line, no collective tear-down

    # -- the pieces a lesson uses ------------------------------------------------------------
    def print(self, *a: Any) -> None:
        """Print on rank 0 (every rank with --log-all-ranks), wrapped to the tables' width."""
        D.print0(wrap_lines(" ".join(str(x) for x in a)), all_ranks=self.args.log_all_ranks)

    def seed(self, offset: int = 0) -> None:
        s = self.args.seed + offset
        random.seed(s)
        torch.manual_seed(s)

    @contextlib.contextmanager
    def variant(self, name: str) -> Iterator[VariantScope]:
        """Run one variant and free it completely before the next one starts.

        Every model and optimizer made through this lesson inside the block is tracked weakly; at
        the end (after the lesson's own ``del``) they are freed, FSDP1's reference loops included,
        and what survived is recorded on the block's results (``release``), so one variant's
        memory can never inflate the next one's peak. On GPU it also records
        ``torch.cuda.memory_allocated`` before and after.

        An out-of-memory error ends the variant like a normal exit: the frames of its traceback
        (which hold the model, the optimizer and the activations of the step that failed) are
        cleared before the release, so what is reported is the OOM, re-raised for the caller (a
        batch search records it), and not a leak. Any other error keeps its frames for debugging.
        """
        first = len(self.results.data["variants"])
        self._scope = scope = VariantScope(self.device).start()
        oom = False
        try:
            yield scope
        except BaseException as exc:
            oom = is_oom(exc)
            if oom:
                traceback.clear_frames(exc.__traceback__)
            raise
        finally:
            self._scope = None
            report = scope.release()
            if oom:
                report["ended_by"] = "out of memory"
            self.results.released(name, report, since=first)
            if report["leaked_tensors"] or report["leaked_objects"]:
                self.print(f"    warning: {name} left {report['leaked_objects']} model/optimizer "
                           f"object(s) and {report['leaked_tensors']} tensor(s) alive")

    def run_variants(self, names: Iterable[str], build: Callable[[str], nn.Module], *,
                     describe: Callable[[str, nn.Module, TrainStats], dict[str, Any]] | None = None,
                     **train_kwargs: Any) -> None:
        """The loop of every comparison: for each variant, ``build(name)`` makes its model with
        the lesson's own FSDP code; the harness materializes it, trains a fresh AdamW on the same
        batches (``train``), records step time, memory by category and losses plus the fields
        ``describe(name, model, stats)`` returns, and frees everything before the next variant
        (``variant``), so no variant's memory inflates another's peak."""
        for name in names:
            with self.variant(name):
                model = self.materialize(build(name))
                stats = self.train(model, name, **train_kwargs)
                self.results.add(name, stats, **(describe(name, model, stats) if describe else {}))
                del model, stats

    def track(self, *objs: Any) -> None:
        """Free ``objs`` (models, optimizers) when the variant running now ends, as the ones
        ``build_model`` and ``optimizer`` made are."""
        if self._scope is not None:
            self._scope.track(*objs)

    def build_model(self, spec: ModelSpec | None = None) -> nn.Module:
        """The model with identical random weights on every rank, on this rank's device.

        Models too large for one host are built on the meta device; call ``materialize`` after
        sharding them.
        """
        spec = spec or self.spec
        self.seed()
        model = spec.build(device="meta" if spec.num_parameters > META_INIT_THRESHOLD else self.device)
        self.track(model)
        return model

    def materialize(self, model: nn.Module) -> nn.Module:
        """Allocate a meta-built, already sharded model on this device and initialize it."""
        if any(p.is_meta for p in model.parameters()):
            model.to_empty(device=self.device)
            self.seed()
            init_weights(model)
        self.track(model)
        return model

    def data(self, seed_offset: int = 0, mode: str | None = None, batch_size: int | None = None):
        """An endless iterator of this rank's batches of the reversal task."""
        mode = mode or ("seq2seq" if self.spec.is_seq2seq else "causal")
        bs = batch_size or self.batch_size
        n = max(bs * self.dist.world_size * max(self.steps, 1), 64)
        ds = ReverseTask(n, self.seq_len, mode=mode, seed=self.args.seed + seed_offset)
        loader = make_loader(ds, bs, self.dist.rank, self.dist.world_size, seed=self.args.seed)
        return batches(loader, self.device)

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        optimizer = torch.optim.AdamW(model.parameters(), lr=self.lr,
                                      foreach=self.device.type == "cuda")
        self.track(optimizer)
        return optimizer

    def train(self, model: nn.Module, name: str, optimizer: torch.optim.Optimizer | None = None,
              **kwargs: Any) -> TrainStats:
        """Train a fresh optimizer (unless given) for the lesson's steps on the same data."""
        optimizer = optimizer or self.optimizer(model)
        kwargs.setdefault("flops_per_token", self.spec.flops_per_token(self.seq_len))
        stats = train(model, optimizer, self.data(), self.steps, self.device, progress=name,
                      **kwargs)
        self.track(model, optimizer)  # now with its sharded parameters, gradients and state
        self.print(f"  {name}: loss {stats.losses[0]:.3f} -> {stats.losses[-1]:.3f}, "
                   f"median step {stats.step_time_s or 0:.4f}s")
        return stats

    def check(self, condition: bool, what: str, value: Any, allowed: Any) -> None:
        """Refuse a lesson flag value that cannot work, in one line."""
        if not condition:
            raise bad_value(what, value, allowed)
