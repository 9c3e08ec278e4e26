"""Lesson 08's driver: each part of the run (FSDP2 with DCP, the conversion, FSDP1's formats, the
resume check, a load from another world size), measured and made rows.

The saves and loads are the lesson script's functions (``sharded_state_dict.py``, handed in as
``code``); here: the models they run on, the timings, file counts and checks around them.
"""

from __future__ import annotations

import argparse
import re
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from utilities.course.lesson import Lesson
from utilities.data import ReverseTask
from utilities.dcp import from_torch_save, layout, load_checkpoint, load_fsdp1_local, to_torch_save
from utilities.distributed import fail_together, reduce_scalar
from utilities.errors import UsageError
from utilities.measure import fmt_bytes
from utilities.results import variant, write_json
from utilities.training import train
from utilities.wrapping import shard_model


def run_parts(lesson: Lesson, args: argparse.Namespace, code: SimpleNamespace) -> None:
    """The lesson's parts, in order; each part's models are freed (and checked) before the next."""
    lesson.results.columns("save_s", "load_s", "checkpoint_bytes", "files", "reload_outputs_equal",
                           "max_abs_loss_diff", "format")
    if args.load_from:
        with lesson.variant("load"):
            load_elsewhere(lesson, code, Path(args.load_from))
        return
    with lesson.variant("save-load"):
        fsdp2_dcp(lesson, code)
        convert(lesson)
        fsdp1_formats(lesson, code)
    if not args.skip_resume_check:
        with lesson.variant("resume"):
            resume_check(lesson, code, lesson.steps)


def timed(fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    return fn(*args), time.perf_counter() - t0


@torch.no_grad()
def outputs(model: nn.Module, lesson: Lesson) -> torch.Tensor:
    """Logits on a fixed batch, the same on every rank and every world size (forward is collective
    under FSDP: every rank calls it)."""
    ds = ReverseTask(4, lesson.seq_len, mode="seq2seq" if lesson.spec.is_seq2seq else "causal", seed=12345)
    batch = {k: torch.stack([ds[i][k] for i in range(4)]).to(lesson.device) for k in ds[0]}
    model.eval()
    logits = model(**batch).logits.float().cpu()
    model.train()
    return logits


def sharded(lesson: Lesson, api: str = "fsdp2",
            seed_offset: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The lesson's model sharded per block (wrapping is lesson 01's topic) and its AdamW;
    ``seed_offset`` moves the weights, so a load that does nothing cannot pass."""
    model = lesson.build_model()
    if seed_offset:
        lesson.seed(seed_offset)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.1)
    model = lesson.materialize(shard_model(model, api=api, block_class=lesson.spec.block_class(),
                                           device=lesson.device))
    return model, lesson.optimizer(model)


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def takeaway(results: dict) -> str:
    """The lesson's point, from what the run measured (printed last)."""
    saved = [v for v in results["variants"] if v.get("files") and v["name"] != "convert"]
    files = ", ".join(f"{v['name']} {v['files']} files" for v in saved)
    exact = variant(results, "fsdp2-dcp").get("reload_outputs_equal")
    return (f"each rank writes its own shard ({files}); the DCP checkpoint reloads "
            f"{'exactly' if exact else 'NOT exactly'}")


def fsdp2_dcp(lesson: Lesson, code: SimpleNamespace) -> None:
    """FSDP2: train k steps, save with DCP (plain and async), look at the files, reload."""
    k = lesson.steps
    model, opt = sharded(lesson)
    stats = lesson.train(model, "fsdp2-dcp", optimizer=opt, measure_memory=False)
    ckpt = lesson.out / "checkpoint"
    _, save_s = timed(code.save_sharded, ckpt, model, opt, k, k)
    per_rank = {f["file"]: f["bytes"] for f in layout(ckpt)}
    saved_outputs = outputs(model, lesson)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    with fail_together(f"writing to {lesson.out}"):  # rank 0 failing alone would hang the others
        if lesson.dist.is_main:  # for the tests: the outputs, and every tensor whole (lesson 03's way)
            torch.save(saved_outputs, lesson.out / "outputs_saved.pt")
            torch.save(full, lesson.out / "reference_full_model.pt")

    t0 = time.perf_counter()
    finish, blocked_s = timed(code.async_save_sharded, lesson.out / "checkpoint_async", model, opt, k, k)
    finish()  # training would run here, overlapping the write
    async_total_s = time.perf_counter() - t0

    fresh, fresh_opt = sharded(lesson, seed_offset=3)
    _, load_s = timed(code.load_sharded, ckpt, fresh, fresh_opt)
    same = torch.equal(outputs(fresh, lesson), outputs(model, lesson))
    lesson.results.add("fsdp2-dcp", stats, api="fsdp2", format="DCP (get_state_dict)",
                       save_s=round(save_s, 4), load_s=round(load_s, 4),
                       async_blocked_s=round(blocked_s, 4), async_total_s=round(async_total_s, 4),
                       checkpoint_bytes=dir_bytes(ckpt), files=len(per_rank),
                       reload_outputs_equal=same, layout=per_rank)
    lesson.print(f"  DCP checkpoint {ckpt}: " + ", ".join(f"{n} {fmt_bytes(b)}" for n, b in per_rank.items()))
    lesson.print(f"  save {save_s:.3f}s, load {load_s:.3f}s, async_save blocks {blocked_s:.3f}s (done "
                 f"after {async_total_s:.3f}s); reload outputs equal: {same}")
    del model, opt, fresh, fresh_opt


def convert(lesson: Lesson) -> None:
    """One torch.save file and back, with PyTorch's format_utils (rank 0 only: no process group)."""
    with fail_together("converting the checkpoint"):  # also the barrier: a failure stops all
        if lesson.dist.is_main:
            single, to_s = timed(to_torch_save, lesson.out / "checkpoint", lesson.out / "converted.pt")
            back, from_s = timed(from_torch_save, single, lesson.out / "converted_dcp")
            # the table's columns hold the DCP -> torch.save direction; the way back is printed
            lesson.results.add("convert", None, format="DCP -> one torch.save file (format_utils)",
                               save_s=round(to_s, 4), checkpoint_bytes=single.stat().st_size, files=1,
                               dcp_to_torch_save_s=round(to_s, 4), torch_save_to_dcp_s=round(from_s, 4),
                               torch_save_bytes=single.stat().st_size, back_to_dcp_bytes=dir_bytes(back))
            lesson.print(f"  converted: DCP -> {single.name} {fmt_bytes(single.stat().st_size)} in "
                         f"{to_s:.3f}s; back to DCP {fmt_bytes(dir_bytes(back))} in {from_s:.3f}s")


def fsdp1_formats(lesson: Lesson, code: SimpleNamespace) -> None:
    """FSDP1: LOCAL_STATE_DICT (flat shards), SHARDED_STATE_DICT + dcp.save, get_state_dict + DCP."""
    k, world = lesson.steps, lesson.dist.world_size
    model, opt = sharded(lesson, api="fsdp1")
    stats = lesson.train(model, "fsdp1", optimizer=opt, measure_memory=False)
    local_dir, sharded_dir = lesson.out / "fsdp1_local", lesson.out / "fsdp1_sharded_dcp"
    (rank_file, flat_params), local_s = timed(code.save_fsdp1_local, local_dir, model)
    local_s = reduce_scalar(local_s, "max", lesson.device)  # done when the last rank's file is
    _, sharded_s = timed(code.save_fsdp1_sharded, sharded_dir, model)
    _, dcp_s = timed(code.save_sharded, lesson.out / "fsdp1_checkpoint", model, opt, k, k)
    lesson.results.add("fsdp1-local", stats, api="fsdp1", format="LOCAL_STATE_DICT + torch.save",
                       save_s=round(local_s, 4), checkpoint_bytes=dir_bytes(local_dir),
                       rank0_file_bytes=rank_file.stat().st_size, flat_params=flat_params,
                       files=len(list(local_dir.iterdir())), world_size_bound=world)
    lesson.results.add("fsdp1-sharded-dcp", None, api="fsdp1",
                       format="SHARDED_STATE_DICT + dcp.save (model only)", save_s=round(sharded_s, 4),
                       checkpoint_bytes=dir_bytes(sharded_dir), files=len(layout(sharded_dir)))
    lesson.results.add("fsdp1-dcp", None, api="fsdp1", format="DCP (get_state_dict)",
                       save_s=round(dcp_s, 4), checkpoint_bytes=dir_bytes(lesson.out / "fsdp1_checkpoint"),
                       files=len(layout(lesson.out / "fsdp1_checkpoint")))
    lesson.print(f"  FSDP1 LOCAL_STATE_DICT: {flat_params} flat shard(s) per rank, "
                 f"{fmt_bytes(rank_file.stat().st_size)} on rank 0, save {local_s:.3f}s; "
                 f"SHARDED_STATE_DICT + DCP {sharded_s:.3f}s; get_state_dict + DCP {dcp_s:.3f}s")
    lesson.results.note("checkpoint_bytes: the whole checkpoint directory, all ranks; fsdp1-local "
                        "saves weights only (no optimizer), fsdp*-dcp save model + optimizer + step.")
    lesson.results.note("LOCAL_STATE_DICT files are flat, padded shards: only FSDP1 with the same "
                        f"wrapping on {world} rank(s) can load them. DCP checkpoints load on any "
                        "world size (try --load-from).")
    del model, opt


def resume_check(lesson: Lesson, code: SimpleNamespace, k: int) -> None:
    """Train k, save, load into other weights and a fresh optimizer, train k more: the losses must
    be those of 2k uninterrupted steps (the data position skips the batches already seen)."""
    quiet = dict(measure_memory=False, progress=None)
    model, opt = sharded(lesson)
    whole = train(model, opt, lesson.data(), 2 * k, lesson.device, **quiet).losses
    del model, opt

    model, opt = sharded(lesson)
    data = lesson.data()
    first = train(model, opt, data, k, lesson.device, **quiet).losses
    code.save_sharded(lesson.out / "resume_checkpoint", model, opt, k, k)
    del model, opt, data  # as if the job had died here

    model, opt = sharded(lesson, seed_offset=5)
    step, consumed = code.load_sharded(lesson.out / "resume_checkpoint", model, opt)
    data = lesson.data()
    for _ in range(consumed):
        next(data)
    got = first + train(model, opt, data, k, lesson.device, **quiet).losses
    diff = max(abs(a - b) for a, b in zip(whole, got))
    lesson.results.add("resume-check", None, uninterrupted_losses=whole, resumed_losses=got,
                       resumed_at_step=step, max_abs_loss_diff=diff)
    with fail_together(f"writing {lesson.out / 'resume_check.json'}"):
        if lesson.dist.is_main:
            write_json(lesson.out / "resume_check.json", {"uninterrupted": whole, "resumed": got,
                                                          "resumed_at_step": step,
                                                          "max_abs_loss_diff": diff})
    lesson.print(f"  resume check: {2 * k} uninterrupted vs {k} + save/load + {k}: "
                 f"max |loss diff| {diff:.2e}")


def load_elsewhere(lesson: Lesson, code: SimpleNamespace, src: Path) -> None:
    """``--load-from``: a checkpoint from another run, maybe another world size. Loaded with
    ``utilities.dcp.load_checkpoint``, which refuses a damaged or code-carrying directory in one
    line, then re-saved from this world size."""
    model, opt = sharded(lesson, seed_offset=7)
    resumed = load_checkpoint(src, model, opt)
    logits = outputs(model, lesson)
    resaved = lesson.out / "checkpoint"
    _, save_s = timed(code.save_sharded, resaved, model, opt, resumed.step, resumed.batches_consumed)
    with fail_together(f"writing {lesson.out / 'outputs_loaded.pt'}"):
        if lesson.dist.is_main:
            torch.save(logits, lesson.out / "outputs_loaded.pt")
    lesson.results.add("dcp-load-resharded", None, loaded_from=str(src), world_size=lesson.dist.world_size,
                       load_s=round(resumed.seconds, 4), step=resumed.step,
                       batches_consumed=resumed.batches_consumed, resave_s=round(save_s, 4),
                       resaved_to=str(resaved), local_state_dict_error=local_on_this_world(lesson, src))
    lesson.print(f"  loaded {src} on {lesson.dist.world_size} rank(s) in {resumed.seconds:.3f}s: step "
                 f"{resumed.step}, {resumed.batches_consumed} batches consumed; re-saved to {resaved}")


def local_on_this_world(lesson: Lesson, src: Path) -> str | None:
    """The same run's FSDP1 LOCAL_STATE_DICT files, loaded here: on another number of ranks they
    fail (flat shards know their world size); DCP, above, reshards. Returns the error, if any."""
    named = [re.fullmatch(r"rank(\d+)_of_(\d+)\.pt", f.name)
             for f in sorted((src.parent / "fsdp1_local").glob("rank*_of_*.pt"))]
    worlds = sorted({int(m.group(2)) for m in named if m and int(m.group(2)) > 0})
    if not worlds:  # none, or only stray files such as rank0_of_x.pt
        return None
    saved_world = worlds[0]
    model, _ = sharded(lesson, api="fsdp1")
    path = src.parent / "fsdp1_local" / f"rank{min(lesson.dist.rank, saved_world - 1)}_of_{saved_world}.pt"
    if not path.is_file():
        return f"{path} is missing"
    try:
        load_fsdp1_local(model, path)
    except UsageError as e:
        lesson.print(f"  LOCAL_STATE_DICT saved on {saved_world} rank(s), "
                     f"loaded on {lesson.dist.world_size}: {e}")
        return str(e)
    lesson.print(f"  LOCAL_STATE_DICT saved on {saved_world} rank(s) loaded on {lesson.dist.world_size}")
    return None

