"""Lesson 08: local / sharded state dict and distributed checkpoint (DCP).

A full state dict (lesson 03) gathers every weight on rank 0 and writes one file: simple, but rank
0 must hold the whole model and the other ranks wait. A *sharded* checkpoint lets every rank write
its own shard, in parallel, plus metadata describing where each slice of each tensor lies, so any
number of ranks can load it later. ``torch.distributed.checkpoint`` (DCP) is PyTorch's way to do
it, for FSDP2 and FSDP1 alike. FSDP1's older ``LOCAL_STATE_DICT`` saves each rank's flat shard as
is: fast, but only the same wrapping on the same world size can ever read it.

This script (default mode):

* trains the model k steps with FSDP2, saves model + optimizer + step + data position with DCP,
  reports the files and bytes per rank, the save time, the load time and the ``async_save`` time
  (how long training is blocked vs. until the files are on disk);
* converts the checkpoint to one ``torch.save`` file and back (``format_utils``);
* trains the same model with FSDP1 and saves its ``LOCAL_STATE_DICT`` (one flat shard per rank),
  its ``SHARDED_STATE_DICT`` with DCP, and DCP through ``get_state_dict``, for comparison;
* checks resumption: train k, save, load into a fresh model, train k more == 2k uninterrupted.

``--load-from DIR`` instead loads a checkpoint written by any world size, reports its outputs on a
fixed batch (``outputs_loaded.pt``) and re-saves it from this world size (``checkpoint``).

Run: fsdp-course run 08 [--quick] [--nproc N] [-- --load-from runs/08_local_state_dict/checkpoint]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without install

import torch
import torch.distributed as dist

from utilities.course.lesson import Lesson, lesson_parser
from utilities.course.results import write_json
from utilities.data import ReverseTask
from utilities.dcp import (
    async_save_checkpoint,
    check_checkpoint,
    from_torch_save,
    fsdp1_state_dict,
    layout,
    load_checkpoint,
    load_fsdp1_local,
    save_checkpoint,
    to_torch_save,
)
from utilities.errors import UsageError
from utilities.measure import fmt_bytes
from utilities.training import train
from utilities.wrapping import shard_model


def parse_args(argv=None):
    p = lesson_parser(__doc__)
    p.add_argument("--load-from", default=None, metavar="DIR",
                   help="load this DCP checkpoint (written by any world size) instead of training")
    p.add_argument("--skip-resume-check", action="store_true",
                   help="default mode: skip the train k / save / resume k == 2k check")
    args = p.parse(argv)
    if args.load_from is not None:
        try:
            check_checkpoint(args.load_from)  # before torchrun starts: a bad directory, one line
        except UsageError as e:
            p.exit(2, f"error: {e}\n")
    return args


def eval_batch(L, n: int = 4) -> dict[str, torch.Tensor]:
    """A fixed batch, the same on every rank and every world size, to compare outputs."""
    ds = ReverseTask(n, L.seq_len, mode="seq2seq" if L.spec.is_seq2seq else "causal", seed=12345)
    items = [ds[i] for i in range(n)]
    return {k: torch.stack([it[k] for it in items]).to(L.device) for k in items[0]}


@torch.no_grad()
def outputs(model, L) -> torch.Tensor:
    model.eval()
    logits = model(**eval_batch(L)).logits.float().cpu()
    model.train()
    return logits


def fsdp2_model(L, seed_offset: int = 0):
    """The lesson's model sharded per block with FSDP2; ``seed_offset`` gives different weights."""
    model = L.build_model()
    if seed_offset:
        L.seed(seed_offset)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.1)  # so a load that does nothing cannot pass
    model = shard_model(model, api="fsdp2", block_class=L.spec.block_class(), device=L.device)
    return L.materialize(model)


def skip(data, n: int):
    """Advance a data iterator past the ``n`` batches a checkpoint says were consumed."""
    for _ in range(n):
        next(data)
    return data


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main(args) -> None:
    with Lesson("08", args) as L:
        # each part's models are freed (and checked) before the next part starts
        if args.load_from:
            with L.variant("load"):
                load_mode(L, Path(args.load_from))
        else:
            with L.variant("save-load"):
                default_mode(L, args)
            if not args.skip_resume_check:
                with L.variant("resume"):
                    resume_check(L, L.steps)


def load_mode(L, src: Path) -> None:
    model = fsdp2_model(L, seed_offset=7)
    opt = L.optimizer(model)
    resumed = load_checkpoint(src, model, opt)
    logits = outputs(model, L)
    resaved = L.out / "checkpoint"
    save_s = save_checkpoint(resaved, model, opt, resumed.step, resumed.batches_consumed)
    if L.dist.is_main:
        torch.save(logits, L.out / "outputs_loaded.pt")
    L.results.add("dcp-load-resharded", None, loaded_from=str(src), world_size=L.dist.world_size,
                  load_s=round(resumed.seconds, 4), step=resumed.step,
                  batches_consumed=resumed.batches_consumed, resave_s=round(save_s, 4),
                  resaved_to=str(resaved), local_state_dict_error=local_on_this_world(L, src))
    L.print(f"  loaded {src} on {L.dist.world_size} rank(s) in {resumed.seconds:.3f}s: step "
            f"{resumed.step}, {resumed.batches_consumed} batches consumed; re-saved to {resaved}")


def local_on_this_world(L, src: Path) -> str | None:
    """The same run's FSDP1 LOCAL_STATE_DICT files, loaded here: on another number of ranks they
    fail (flat shards know their world size); DCP, above, reshards. Returns the error, if any."""
    files = sorted((src.parent / "fsdp1_local").glob("rank*_of_*.pt"))
    if not files:
        return None
    saved_world = int(files[0].stem.split("_of_")[1])
    model = shard_model(L.build_model(), api="fsdp1", block_class=L.spec.block_class(), device=L.device)
    model = L.materialize(model)
    path = files[0].parent / f"rank{min(L.dist.rank, saved_world - 1)}_of_{saved_world}.pt"
    try:
        load_fsdp1_local(model, path)
    except UsageError as e:
        L.print(f"  LOCAL_STATE_DICT saved on {saved_world} rank(s), loaded on {L.dist.world_size}: {e}")
        return str(e)
    L.print(f"  LOCAL_STATE_DICT saved on {saved_world} rank(s) loaded on {L.dist.world_size}")
    return None


def default_mode(L, args) -> None:
    k = L.steps
    rank, world = L.dist.rank, L.dist.world_size

    # 1. FSDP2: train k steps, save with DCP, look at the files
    model = fsdp2_model(L)
    opt = L.optimizer(model)
    stats = L.train(model, "fsdp2-dcp", optimizer=opt, measure_memory=False)
    ckpt = L.out / "checkpoint"
    save_s = save_checkpoint(ckpt, model, opt, step=k, batches_consumed=k)
    files = layout(ckpt)
    per_rank = {f["file"]: f["bytes"] for f in files}
    if L.dist.is_main:
        torch.save(outputs(model, L), L.out / "outputs_saved.pt")
    else:
        outputs(model, L)  # forward is collective under FSDP
    full = _full_model_state(model)
    if L.dist.is_main:
        torch.save(full, L.out / "reference_full_model.pt")

    pending = async_save_checkpoint(L.out / "checkpoint_async", model, opt, step=k,
                                    batches_consumed=k)
    async_total = pending.wait()

    fresh = fsdp2_model(L, seed_offset=3)
    fresh_opt = L.optimizer(fresh)
    resumed = load_checkpoint(ckpt, fresh, fresh_opt)
    same = torch.equal(outputs(fresh, L), outputs(model, L))
    L.results.add("fsdp2-dcp", stats, api="fsdp2", format="DCP (get_state_dict)",
                  save_s=round(save_s, 4), load_s=round(resumed.seconds, 4),
                  async_blocked_s=round(pending.blocked_s, 4), async_total_s=round(async_total, 4),
                  checkpoint_bytes=dir_bytes(ckpt), files=len(files),
                  reload_outputs_equal=same, layout=per_rank)
    L.print(f"  DCP checkpoint {ckpt}: " + ", ".join(f"{n} {fmt_bytes(b)}" for n, b in per_rank.items()))
    L.print(f"  save {save_s:.3f}s, load {resumed.seconds:.3f}s, async_save blocks "
            f"{pending.blocked_s:.3f}s (done after {async_total:.3f}s); reload outputs equal: {same}")
    del fresh, fresh_opt

    # 2. one torch.save file and back, with PyTorch's format_utils (rank 0 only: no process group)
    if L.dist.is_main:
        t0 = time.perf_counter()
        single = to_torch_save(ckpt, L.out / "converted.pt")
        to_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        back = from_torch_save(single, L.out / "converted_dcp")
        from_s = time.perf_counter() - t0
        L.results.add("convert", None, dcp_to_torch_save_s=round(to_s, 4),
                      torch_save_to_dcp_s=round(from_s, 4), torch_save_bytes=single.stat().st_size,
                      back_to_dcp_bytes=dir_bytes(back))
    _barrier()

    # 3. FSDP1: LOCAL_STATE_DICT (flat shards), SHARDED_STATE_DICT + DCP, and get_state_dict + DCP
    m1 = shard_model(L.build_model(), api="fsdp1", block_class=L.spec.block_class(), device=L.device)
    m1 = L.materialize(m1)
    opt1 = L.optimizer(m1)
    stats1 = L.train(m1, "fsdp1", optimizer=opt1, measure_memory=False)
    local_dir = L.out / "fsdp1_local"
    if L.dist.is_main:
        local_dir.mkdir(parents=True, exist_ok=True)
    _barrier()
    t0 = time.perf_counter()
    local = fsdp1_state_dict(m1, "local")
    torch.save(local, local_dir / f"rank{rank}_of_{world}.pt")
    _barrier()
    local_s = time.perf_counter() - t0
    local_keys = [k_ for k_ in local if k_.endswith("flat_param")]
    local_bytes = (local_dir / f"rank{rank}_of_{world}.pt").stat().st_size

    t0 = time.perf_counter()
    sharded = fsdp1_state_dict(m1, "sharded")
    import torch.distributed.checkpoint as dcp

    sharded_dir = L.out / "fsdp1_sharded_dcp"
    dcp.save({"model": sharded}, checkpoint_id=str(sharded_dir))
    sharded_s = time.perf_counter() - t0
    dcp1_s = save_checkpoint(L.out / "fsdp1_checkpoint", m1, opt1, step=k, batches_consumed=k)
    L.results.add("fsdp1-local", stats1, api="fsdp1", format="LOCAL_STATE_DICT + torch.save",
                  save_s=round(local_s, 4), checkpoint_bytes=dir_bytes(local_dir),
                  rank0_file_bytes=local_bytes, flat_params=len(local_keys),
                  files=len(list(local_dir.iterdir())), world_size_bound=world)
    L.results.add("fsdp1-sharded-dcp", None, api="fsdp1",
                  format="SHARDED_STATE_DICT + dcp.save (model only)", save_s=round(sharded_s, 4),
                  checkpoint_bytes=dir_bytes(sharded_dir), files=len(layout(sharded_dir)))
    L.results.add("fsdp1-dcp", None, api="fsdp1", format="DCP (get_state_dict)",
                  save_s=round(dcp1_s, 4), checkpoint_bytes=dir_bytes(L.out / "fsdp1_checkpoint"),
                  files=len(layout(L.out / "fsdp1_checkpoint")))
    L.print(f"  FSDP1 LOCAL_STATE_DICT: {len(local_keys)} flat shard(s) per rank, "
            f"{fmt_bytes(local_bytes)} on rank 0, save {local_s:.3f}s; SHARDED_STATE_DICT + DCP "
            f"{sharded_s:.3f}s; get_state_dict + DCP {dcp1_s:.3f}s")
    del m1, opt1, local, sharded

    L.results.note("checkpoint_bytes: the whole checkpoint directory, all ranks; fsdp1-local "
                   "saves weights only (no optimizer), fsdp*-dcp save model + optimizer + step.")
    L.results.note("LOCAL_STATE_DICT files are flat, padded shards: only FSDP1 with the same "
                   f"wrapping on {world} rank(s) can load them. DCP checkpoints load on any "
                   "world size (try --load-from).")


def resume_check(L, k: int) -> None:
    quiet = dict(measure_memory=False, progress=None)
    model = fsdp2_model(L)
    whole = train(model, L.optimizer(model), L.data(), 2 * k, L.device, **quiet).losses
    del model

    model = fsdp2_model(L)
    opt = L.optimizer(model)
    data = L.data()
    first = train(model, opt, data, k, L.device, **quiet).losses
    ckpt = L.out / "resume_checkpoint"
    save_checkpoint(ckpt, model, opt, step=k, batches_consumed=k)
    del model, opt, data  # as if the job had died here

    model = fsdp2_model(L, seed_offset=5)
    opt = L.optimizer(model)
    resumed = load_checkpoint(ckpt, model, opt)
    data = skip(L.data(), resumed.batches_consumed)
    second = train(model, opt, data, k, L.device, **quiet).losses
    got = first + second
    diff = max(abs(a - b) for a, b in zip(whole, got))
    L.results.add("resume-check", None, uninterrupted_losses=whole, resumed_losses=got,
                  resumed_at_step=resumed.step, max_abs_loss_diff=diff)
    if L.dist.is_main:
        write_json(L.out / "resume_check.json", {"uninterrupted": whole, "resumed": got,
                                                 "resumed_at_step": resumed.step,
                                                 "max_abs_loss_diff": diff})
    L.print(f"  resume check: {2 * k} uninterrupted vs {k} + save/load + {k}: max |loss diff| "
            f"{diff:.2e}")


def _full_model_state(model) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


if __name__ == "__main__":
    main(parse_args())
