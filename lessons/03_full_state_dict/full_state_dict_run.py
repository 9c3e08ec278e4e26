"""Lesson 03's driver: each variant's round trip (train, save, load into a fresh model, compare
the outputs and the next step, export for transformers), measured and made a row.

The gathers, the save and the load are the lesson script's functions (``full_state_dict.py``,
handed in as ``code``); here: the models they run on, the timings and the comparisons.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from utilities.course.lesson import Lesson
from utilities.distributed import fail_together, reduce_scalar
from utilities.measure import fmt_bytes
from utilities.models import META_INIT_THRESHOLD
from utilities.safe_files import lock_checkpoints
from utilities.state_dict import export_hf
from utilities.training import sync
from utilities.wrapping import shard_model

# cuBLAS reads this once, when its first handle is made (the first matmul on a GPU, long after
# these imports): see deterministic_kernels() below.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def round_trips(lesson: Lesson, args: argparse.Namespace, code: SimpleNamespace) -> None:
    """Every variant's round trip, on one fixed probe batch, into one locked checkpoint folder."""
    lesson.results.setting(deterministic_kernels=deterministic_kernels(lesson.device))
    lesson.results.columns("checkpoint_bytes", "save_s", "load_s", "outputs_identical",
                           "next_step_identical", "hf_identical")
    ckpt_dir = Path(args.checkpoint_dir or lesson.out / "checkpoints")
    with fail_together(f"locking {ckpt_dir}"):  # a second run saving there: one line, exit 2
        lock = lock_checkpoints(ckpt_dir) if dist.get_rank() == 0 else None  # noqa: F841 - held
    probe = next(lesson.data(seed_offset=1000))  # a fixed batch, never trained on, for comparisons
    for name in args.variants:
        with lesson.variant(name):  # everything the variant made is freed before the next one
            round_trip(lesson, code, name, probe, ckpt_dir, export=not args.no_export)


def deterministic_kernels(device: torch.device) -> bool:
    """Make GPU kernels bitwise reproducible, so "identical" can mean identical.

    On a CPU the same computation gives the same bits every time. On a GPU some kernels do not:
    an embedding's backward adds rows with atomics in whatever order the threads finish, and cuBLAS
    may split a reduction differently; float addition is not associative, so two runs of the same
    step can differ in the last bits. Deterministic mode picks order-fixed kernels (slower), and
    cuBLAS needs a fixed workspace (``CUBLAS_WORKSPACE_CONFIG``, set at import, above).
    """
    if device.type != "cuda":
        return False
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    return True


@torch.no_grad()
def logits(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).logits.float().cpu()


def sharded(lesson: Lesson, api: str, fresh: bool = False) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The lesson's model sharded per block (wrapping is lesson 01's topic) and its AdamW.
    ``fresh``: built from other random weights, so a load that does nothing cannot pass."""
    if fresh:
        torch.manual_seed(lesson.args.seed + 12345)
        on_meta = lesson.spec.num_parameters > META_INIT_THRESHOLD
        model = lesson.spec.build(device="meta" if on_meta else lesson.device)
    else:
        model = lesson.build_model()
    model = lesson.materialize(shard_model(model, api=api, block_class=lesson.spec.block_class(),
                                           policy="block", device=lesson.device))
    return model, lesson.optimizer(model)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict) -> float:
    optimizer.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    return loss.item()


def timed(device: torch.device, fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    """``fn(*args)`` and the seconds its slowest rank took: a save ends when its last rank ends."""
    sync(device)
    t0 = time.perf_counter()
    out = fn(*args)
    sync(device)
    return out, reduce_scalar(time.perf_counter() - t0, "max", device)


def max_abs_diff(a: torch.Tensor, b: torch.Tensor, device: torch.device) -> float:
    return reduce_scalar((a - b).abs().max().item(), "max", device)  # the worst rank's


def round_trip(lesson: Lesson, code: SimpleNamespace, name: str, probe: dict, ckpt_dir: Path,
               export: bool) -> None:
    """Train, save, load into a fresh model, compare outputs and the next step, export to HF."""
    api, how = code.VARIANTS[name]
    gather, device = code.GATHER[how], lesson.device

    # 1. train, then save a full checkpoint (model + optimizer + step)
    model, optim = sharded(lesson, api)
    stats = lesson.train(model, name, optimizer=optim, measure_memory=False)
    path = ckpt_dir / f"{name}.pt"
    nbytes, save_s = timed(device, code.save_full_checkpoint, path, model, optim, lesson.steps, gather)
    reference = logits(model, probe)

    # 2. a fresh sharded model (other random weights) and a fresh optimizer, then load
    fresh, fresh_optim = sharded(lesson, api, fresh=True)
    before_load = max_abs_diff(logits(fresh, probe), reference, device)
    step, load_s = timed(device, code.load_full_checkpoint, path, fresh, fresh_optim)
    out_diff = max_abs_diff(logits(fresh, probe), reference, device)

    # 3. the next optimizer step must be the same: same loss, same updated weights
    batch = next(lesson.data(seed_offset=2000))
    loss_a, loss_b = train_step(model, optim, batch), train_step(fresh, fresh_optim, batch)
    after_diff = max_abs_diff(logits(model, probe), logits(fresh, probe), device)
    loss_diff = reduce_scalar(abs(loss_a - loss_b), "max", device)

    # 4. export the weights after that step for transformers; from_pretrained must match (rank 0)
    hf = {}
    if export:
        hf = check_export(lesson, gather(fresh)[0], ckpt_dir / f"{name}-hf", probe, logits(fresh, probe))
    ok = out_diff == 0.0 and loss_diff == 0.0 and after_diff == 0.0
    lesson.results.add(name, stats, api=api, saved_with=how, checkpoint_bytes=nbytes,
                       save_s=round(save_s, 4), load_s=round(load_s, 4), loaded_step=step,
                       diff_before_load=before_load, outputs_max_abs_diff=out_diff,
                       outputs_identical=out_diff == 0.0, next_loss_a=loss_a, next_loss_b=loss_b,
                       next_step_loss_diff=loss_diff, after_step_max_abs_diff=after_diff,
                       next_step_identical=loss_diff == 0.0 and after_diff == 0.0,
                       checkpoint=str(path), **hf)
    lesson.print(f"    {name}: saved {fmt_bytes(nbytes)} in {save_s:.3f}s, loaded in {load_s:.3f}s (step "
                 f"{step}); outputs diff {out_diff:g} (fresh model: {before_load:.3g}), next step loss "
                 f"{loss_a:.6f} vs {loss_b:.6f}, weights after diff {after_diff:g}"
                 + (f", HF export diff {hf['hf_max_abs_diff']:g}" if hf else "")
                 + ("" if ok else "  <-- NOT IDENTICAL"))
    del model, optim, fresh, fresh_optim


def check_export(lesson: Lesson, model_sd: dict, directory: Path, probe: dict,
                 expected: torch.Tensor) -> dict[str, Any]:
    """Rank 0 writes a safetensors folder and reloads it with plain ``from_pretrained``."""
    result: dict[str, Any] = {}
    with fail_together(f"exporting to {directory}"):  # rank 0 failing stops every rank
        if lesson.dist.is_main:
            from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

            t0 = time.perf_counter()
            export_hf(model_sd, lesson.spec.config(), directory)
            export_s = time.perf_counter() - t0
            auto = AutoModelForSeq2SeqLM if lesson.spec.is_seq2seq else AutoModelForCausalLM
            reloaded = auto.from_pretrained(directory).to(lesson.device).eval()
            diff = (logits(reloaded, probe) - expected).abs().max().item()
            size = sum(f.stat().st_size for f in directory.iterdir()  # the hidden one: the
                       if f.is_file() and not f.name.startswith("."))  # course's list of its files
            result = dict(hf_export_s=round(export_s, 4), hf_export_bytes=size,
                          hf_max_abs_diff=diff, hf_identical=diff == 0.0, hf_dir=str(directory))
    return result
