"""Find the largest batch that runs *cleanly*: no cudaMalloc retries, no OOM, within a budget.

The classic memory-maximizer insight: the fastest batch size is usually not the largest one that
avoids an out-of-memory error, but the largest one that avoids cudaMalloc retries (the caching
allocator emptying its cache and calling cudaMalloc again on every step). ``find_max_batch`` searches
for it: it doubles the batch until the first trial that is not clean, then bisects between the last
clean batch and that one. An OOM during a trial is caught, memory is freed, and the OOM is recorded
in the evidence like any other failed trial: the search goes on.

    def try_batch(batch: int) -> Trial:
        ...train a few steps at this batch, read Memory_Maximizer's summary...
        return Trial(batch, retries=report["cuda_malloc_retries"], peak_bytes=..., throughput=...)

    result = find_max_batch(try_batch, start=1, limit=64)
    result.best, result.trials  # the recommendation and every trial that led to it

On a CPU there is no caching allocator, so nothing retries: give ``budget_bytes`` and a trial whose
measured peak exceeds it counts as failed ("over budget"), the CPU stand-in for retries and OOMs.

With several ranks, every rank must take the same decision or the next collective hangs: pass
``agree`` (e.g. :func:`all_ranks_agree`) to combine each trial's verdict across ranks. For that,
every rank must reach the agreement from the same collective: ``utilities.training.train`` ends
every step with one all-reduce that every rank makes, failed or not, and it carries who ran out of
memory; the trial then raises an OOM on every rank, and every rank records it and agrees. What no
process can undo: an OOM on one rank alone *inside* FSDP's own collectives (a forward all-gather,
a backward reduce-scatter) leaves the others waiting in the next one, until the process group's
timeout. FSDP ranks hold the same shapes, so an OOM usually strikes all of them at the same
allocation; the one that strikes a rank alone ends the job.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from utilities.measure.memory import is_oom


@dataclass
class Trial:
    """What one batch size did. ``clean`` is False when it retried, hit an OOM or went over budget."""

    batch: int
    throughput: float | None = None  # samples (or tokens) per second, whatever the caller measures
    peak_bytes: int | None = None  # allocated (GPU) or tracked (CPU) peak
    max_reserved_bytes: int | None = None  # the caching allocator's max reserved (GPU only)
    retries: int = 0  # cudaMalloc retries during the trial
    ooms: int = 0  # out-of-memory errors during the trial
    over_budget: bool = False
    error: str | None = None  # the OOM message, when one was caught
    phase: str = ""  # "grow", "bisect" or "predict": set by the search
    extra: dict[str, Any] = field(default_factory=dict)  # anything else the caller keeps

    @property
    def clean(self) -> bool:
        return self.retries == 0 and self.ooms == 0 and not self.over_budget and self.error is None

    @property
    def verdict(self) -> str:
        if self.ooms or self.error:
            return "OOM"
        if self.retries:
            return f"{self.retries} retries"
        if self.over_budget:
            return "over budget"
        return "clean"

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(clean=self.clean, verdict=self.verdict)
        return d


@dataclass
class SearchResult:
    """The recommended batch (None if even ``start`` failed), the reason, and the evidence."""

    best: int | None
    reason: str
    trials: list[Trial]

    def trial(self, batch: int) -> Trial | None:
        return next((t for t in self.trials if t.batch == batch), None)

    @property
    def first_failure(self) -> Trial | None:
        """The smallest batch tried that was not clean (the one just above the recommendation)."""
        bad = [t for t in self.trials if not t.clean]
        return min(bad, key=lambda t: t.batch) if bad else None


def free_memory() -> None:
    """Drop unreachable tensors and hand the allocator's cached blocks back to the device."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def all_ranks_agree(trial: Trial) -> Trial:
    """Make a trial's verdict the same on every rank: max of peaks, retries, OOMs and flags."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return trial
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
        else torch.device("cpu")
    vals = torch.tensor([trial.peak_bytes or 0, trial.max_reserved_bytes or 0, trial.retries,
                         trial.ooms, int(trial.over_budget), int(trial.error is not None)],
                        dtype=torch.float64, device=device)
    dist.all_reduce(vals, op=dist.ReduceOp.MAX)
    peak, reserved, retries, ooms, over, err = (int(v) for v in vals.tolist())
    trial.peak_bytes = peak if trial.peak_bytes is not None else None
    trial.max_reserved_bytes = reserved if trial.max_reserved_bytes is not None else None
    trial.retries, trial.ooms, trial.over_budget = retries, ooms, bool(over)
    if err and trial.error is None:
        trial.error = "out of memory on another rank"
    return trial


def find_max_batch(
    try_batch: Callable[[int], Trial],
    start: int = 1,
    limit: int = 1024,
    grow: int = 2,
    bisect: bool = True,
    budget_bytes: int | None = None,
    predict: bool = False,
    agree: Callable[[Trial], Trial] | None = None,
    on_trial: Callable[[Trial], None] | None = None,
) -> SearchResult:
    """Search the largest clean batch in ``[start, limit]``.

    Grow: try ``start``, ``start * grow``, ... (capped at ``limit``) and stop at the first trial that
    is not clean. Bisect (if ``bisect``): halve the gap between the last clean batch and the first
    failed one until they are neighbours, so the answer is a batch that is clean while the batch one
    above it was tried and failed. ``budget_bytes`` marks a trial whose ``peak_bytes`` exceeds it as
    over budget. ``on_trial`` sees every trial as it completes (for logging).

    ``predict`` (with ``budget_bytes``): peak memory grows linearly with the batch, so once two
    trials have measured peaks, a line through the last two says which batch meets the budget. The
    next trial is that batch (at least one above the last clean one, below the last failed one), in
    place of doubling or halving; the answer is proved the same way, a clean batch whose neighbour
    above was tried and failed. On a budget this takes about half the trials, and smaller ones;
    after four predicted trials the search goes back to doubling and halving.
    """
    if start < 1 or limit < start or grow < 2:
        raise ValueError(f"need 1 <= start <= limit and grow >= 2, got start={start}, "
                         f"limit={limit}, grow={grow}")
    trials: list[Trial] = []

    def run(batch: int, phase: str) -> Trial:
        try:
            trial = try_batch(batch)
        except Exception as exc:  # only OOMs are survivable; anything else is a bug to report
            if not is_oom(exc):
                raise
            trial = Trial(batch, ooms=1, error=str(exc).splitlines()[0][:200])
        free_memory()
        trial.phase = phase
        if budget_bytes is not None and trial.peak_bytes is not None:
            trial.over_budget = trial.over_budget or trial.peak_bytes > budget_bytes
        if agree is not None:
            trial = agree(trial)
        trials.append(trial)
        if on_trial is not None:
            on_trial(trial)
        return trial

    def predicted(low: int, high: int) -> int | None:
        return _predicted_batch(trials, budget_bytes if predict else None, low, high)

    good: int | None = None
    bad: int | None = None
    batch, phase = start, "grow"
    while True:
        if run(batch, phase).clean:
            good = batch
            if batch >= limit:
                break
            guess = predicted(batch + 1, limit)
            batch, phase = (min(batch * grow, limit), "grow") if guess is None else (guess, "predict")
        else:
            bad = batch
            break
    if bisect and good is not None and bad is not None:
        while bad - good > 1:
            guess = predicted(good + 1, bad - 1)
            mid, phase = ((good + bad) // 2, "bisect") if guess is None else (guess, "predict")
            if run(mid, phase).clean:
                good = mid
            else:
                bad = mid
    return SearchResult(good, _reason(good, bad, start, limit, trials), trials)


def _predicted_batch(trials: list[Trial], budget_bytes: int | None, low: int, high: int
                     ) -> int | None:
    """The batch the last two measured peaks say meets the budget, kept within [low, high]; None
    without a budget (no prediction asked), before two measured peaks, or after four predicted
    trials (a curve far from a line: back to doubling and halving)."""
    measured = [t for t in trials if t.peak_bytes is not None]
    guessed = sum(t.phase == "predict" for t in trials)  # a curve far from a line: go back
    if not (budget_bytes is not None and len(measured) >= 2 and guessed < 4):
        return None
    a, b = measured[-2:]  # two different batches: the search never tries one twice
    per_sample = (b.peak_bytes - a.peak_bytes) / (b.batch - a.batch)
    if per_sample <= 0:
        return None
    guess = b.batch + math.floor((budget_bytes - b.peak_bytes) / per_sample)
    return min(max(guess, low), high)


def _reason(good: int | None, bad: int | None, start: int, limit: int, trials: list[Trial]) -> str:
    """Why the search stopped where it did."""
    if good is None:
        return f"even the smallest batch tried ({start}) was not clean: {trials[0].verdict}"
    if bad is None:
        return f"every batch up to the limit ({limit}) was clean; raise the limit to search further"
    failed = next(t for t in trials if t.batch == bad)
    return (f"batch {good} is the largest clean batch; batch {bad} was tried and gave "
            f"{failed.verdict}")


def training_trial(batch: int, build: Callable[[], torch.nn.Module],
                   make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer], data,
                   steps: int, device: torch.device, world: int = 1,
                   **train_kwargs: Any) -> tuple[Trial, Any]:
    """One trial of a batch search: build a fresh model at this batch, train ``steps`` steps under
    ``Memory_Maximizer``, and say what happened (peak, samples/s over all ranks, and on a GPU the
    cudaMalloc retries and OOMs). Returns the trial and the ``TrainStats``. An OOM propagates, for
    ``find_max_batch`` to record; the model is released either way."""
    from utilities.memory_maximizer import Memory_Maximizer
    from utilities.training import train

    model = build()
    optimizer = make_optimizer(model)
    mm = Memory_Maximizer(verbose=False)
    mm.start()
    try:
        stats = train(model, optimizer, data, steps, device, **train_kwargs)
        mm.update()
    finally:
        report = mm.stop()
        del model, optimizer
    peak = stats.peak_memory_bytes.get("total")
    samples_per_s = batch * world / stats.step_time_s if stats.step_time_s else None
    if report.get("gpu"):
        trial = Trial(batch, throughput=samples_per_s, peak_bytes=peak,
                      max_reserved_bytes=int(report["max_reserved_gb"] * 2**30),
                      retries=report["cuda_malloc_retries"], ooms=report["ooms"])
    else:
        trial = Trial(batch, throughput=samples_per_s, peak_bytes=peak)
    return trial, stats
