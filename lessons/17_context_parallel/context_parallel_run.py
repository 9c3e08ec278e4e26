"""Lesson 17's driver: each variant run on its mesh and made a row: the attention checks
(one ring or torch-cp call against SDPA on the whole sequence) and fsdp-cpN (a tiny Llama trained
with FSDP2 and the ring, beside the same model unsplit).

The ring, the layouts and the wrapping are the lesson script's functions (``context_parallel.py``,
handed in as ``code``); here: what is run and measured around them.
"""

from __future__ import annotations

import argparse
import copy
from types import SimpleNamespace

from cp_helpers import (
    TinyLlama,
    attention_inputs,
    endless,
    largest_difference,
    local_slice,
    per_rank,
    reference_attention,
    reverse_batches,
    token_loss_sum,
    train_unsplit,
)
from torch.distributed.device_mesh import DeviceMesh

from utilities.course.lesson import Lesson
from utilities.distributed import world_mesh
from utilities.measure import fmt_bytes
from utilities.training import TrainStats, train

VARIANTS = ("ring-contiguous", "ring-balanced", "torch-cp", "fsdp-cp1", "fsdp-cp2", "fsdp-cp4")
TOLERANCE = 1e-5  # fp32: the ring only reorders the softmax's sums
LOSS_TOLERANCE = 1e-4  # fp32, a few AdamW steps: the same sums in another order, carried on
HEADS, HEAD_DIM = 4, 32
NOTES = (
    f"max_abs_diff: largest |difference| over every rank of the output and the gradients "
    f"dq, dk, dv (ring and torch-cp) from causal SDPA on the whole sequence (fp32; expected below "
    f"{TOLERANCE:g}); fsdp-cpN: largest |difference| of the losses from the unsplit model trained "
    f"on the same batches (expected below {LOSS_TOLERANCE:g}).",
    "score blocks: (query chunk, key chunk) products computed, per rank, one attention call; a key "
    "chunk wholly after the query chunk is masked and skipped. sent: bytes each rank sends per "
    "attention layer (one call; fsdp-cpN: averaged over its layers and steps).",
    "fsdp-cpN: FSDP2 over all the ranks (dp x cp flattened), the ring over N of them; the batch per "
    "data-parallel group is fixed, so a rank holds 1/N of its tokens' activations.",
)
CPU_NOTE = ("CPU run: memory from torch.distributed._tools trackers; gloo's point-to-point sends "
            "and the ring's Python loop make step times only indicative.")


def cp_of(name: str, world: int) -> int:
    """The CP size of a variant: fsdp-cpN's N, the whole world for the attention checks."""
    return int(name.removeprefix("fsdp-cp")) if name.startswith("fsdp-cp") else world


def run_attention(lesson: Lesson, name: str, mesh: DeviceMesh, code: SimpleNamespace) -> dict:
    """One attention call split over every rank against SDPA on the whole sequence: the output and
    the gradients of q, k, v on this rank's tokens, the work per rank, the bytes sent."""
    world, rank, device = lesson.dist.world_size, lesson.dist.rank, lesson.device
    q, k, v, dout = attention_inputs(lesson.batch_size, HEADS, lesson.seq_len, HEAD_DIM, lesson.args.seed,
                                     device)
    reference = reference_attention(q, k, v, dout)
    balanced = name != "ring-contiguous"
    pos = code.positions(lesson.seq_len, rank, world, balanced).to(device)
    if name == "torch-cp":
        got = code.torch_context_parallel(q.clone(), k.clone(), v.clone(), dout.clone(), mesh["cp"])
        counts = None
    else:
        counts = code.new_counts()
        ql, kl, vl = (t[:, :, pos].clone().requires_grad_() for t in (q, k, v))
        out = code.ring_attention(ql, kl, vl, mesh["cp"].get_group(), balanced, counts)
        out.backward(dout[:, :, pos])
        got = [out, ql.grad, kl.grad, vl.grad]
    row = {"cp": world, "dp": 1, "layout": "head-tail" if balanced else "contiguous",
           "max_abs_diff": largest_difference(got, [t[:, :, pos] for t in reference], device)}
    if counts is not None:
        blocks = [int(b) for b in per_rank(counts["score_blocks"], device)]
        row.update(score_blocks_per_rank=blocks, score_blocks=" / ".join(map(str, blocks)),
                   forward_sent_bytes=counts["forward_sent_bytes"],
                   backward_sent_bytes=counts["backward_sent_bytes"])
    lesson.print(f"  {name}: max |diff| vs unsplit {row['max_abs_diff']:.1e}"
                 + (f", score blocks per rank {row['score_blocks']}" if counts is not None else ""))
    return row


def run_fsdp_cp(lesson: Lesson, name: str, cp: int, mesh: DeviceMesh,
                code: SimpleNamespace) -> tuple[TrainStats, dict]:
    """A tiny Llama trained with FSDP2 over every rank and the ring over ``cp`` of them, beside the
    same model unsplit on this rank alone, on the same global batches."""
    world, device, seq = lesson.dist.world_size, lesson.device, lesson.seq_len
    dp = world // cp
    lesson.seed()
    model = lesson.materialize(TinyLlama(code.VOCAB).to(device))
    reference = lesson.materialize(copy.deepcopy(model))
    batches = reverse_batches(seq, dp * lesson.batch_size, lesson.steps, lesson.args.seed, device)
    reference_losses = train_unsplit(reference, batches, lesson.lr)
    del reference
    counts = code.new_counts()
    code.use_ring(code.shard_over_dp_and_cp(model, world_mesh()), mesh, counts)
    dp_rank = mesh["dp"].get_local_rank()
    rows = slice(dp_rank * lesson.batch_size, (dp_rank + 1) * lesson.batch_size)
    pos = code.positions(seq, mesh["cp"].get_local_rank(), cp, True)
    local = [local_slice(b, rows, pos) for b in batches]

    def step(model, batch):  # FSDP averages gradients over the world: scale the sum to the global mean
        loss = token_loss_sum(model, batch) * world / batch["labelled"]
        loss.backward()
        return loss

    stats = train(model, lesson.optimizer(model), endless(local), lesson.steps, device, step_fn=step,
                  progress=name)
    diff = max(abs(a - b) for a, b in zip(stats.losses, reference_losses))
    calls = len(model.layers) * lesson.steps
    lesson.print(f"  {name}: loss {stats.losses[0]:.3f} -> {stats.losses[-1]:.3f} (unsplit "
                 f"{reference_losses[0]:.3f} -> {reference_losses[-1]:.3f}, max |diff| {diff:.1e}), "
                 f"activations per rank {fmt_bytes(stats.peak_memory_bytes.get('activations'))}")
    return stats, {"cp": cp, "dp": dp, "layout": "head-tail",
                   "tokens_per_rank": seq * lesson.batch_size // cp,
                   "max_abs_diff": diff, "unsplit_losses": reference_losses,
                   "forward_sent_bytes": counts["forward_sent_bytes"] // calls,
                   "backward_sent_bytes": counts["backward_sent_bytes"] // calls}


def fits(name: str, world: int, seq_len: int) -> str | None:
    """Why a variant cannot run on ``world`` ranks (None: it can)."""
    cp = cp_of(name, world)
    if world % cp:
        return f"needs a multiple of {cp} ranks, not {world}"
    if seq_len % (2 * cp):
        return f"needs --seq-len divisible by {2 * cp} (2 chunks per CP rank), not {seq_len}"
    return None


def takeaway(results: dict) -> str:
    """The lesson's point, from what the run measured (printed last)."""
    by = {v["name"]: v for v in results["variants"]}
    worst = max(v["max_abs_diff"] for v in results["variants"] if v["name"].startswith("ring"))
    line = f"ring attention computes what unsplit attention does (max |diff| {worst:.1e})"
    if "ring-balanced" in by and "ring-contiguous" in by:
        line += (f"; score blocks per rank {by['ring-contiguous']['score_blocks']} contiguous, "
                 f"{by['ring-balanced']['score_blocks']} balanced")
    trained = [v for v in results["variants"] if v["name"].startswith("fsdp-cp")]
    if len(trained) > 1:
        act = " -> ".join(fmt_bytes(v["peak_memory_bytes"]["activations"]) for v in trained)
        line += (f"; activations per rank {act} over CP {', '.join(str(v['cp']) for v in trained)}, "
                 f"losses within {max(v['max_abs_diff'] for v in trained):.1e} of unsplit")
    return line


def run_variants(lesson: Lesson, args: argparse.Namespace, code: SimpleNamespace) -> None:
    """The model trained, recorded; every variant that fits this number of ranks and this torch
    run on its mesh (made once per CP size) and made a row, the others skipped with the reason."""
    world = lesson.dist.world_size
    parameters = sum(p.numel() for p in TinyLlama(code.VOCAB).parameters())
    lesson.results.run_model("tiny-llama-cp", parameters)
    lesson.print(f"trained: tiny-llama-cp ({parameters:,} parameters; cp_helpers.TinyLlama: "
                 "llama-tiny's width, depth and heads, K/V for every head, its attention the ring)")
    lesson.results.setting(heads=HEADS, head_dim=HEAD_DIM)
    lesson.results.columns("cp", "dp", "max_abs_diff", "score_blocks",
                           "forward_sent_bytes", "backward_sent_bytes", "tokens_per_rank")
    meshes: dict[int, DeviceMesh] = {}
    for name in args.variants:
        why = fits(name, world, lesson.seq_len) or (code.torch_cp_missing(lesson.device, lesson.dist)
                                                      if name == "torch-cp" else None)
        if why:
            lesson.results.skipped(name, why)
            lesson.print(f"  {name}: skipped, {why}")
            continue
        cp = cp_of(name, world)
        if cp not in meshes:
            meshes[cp] = code.cp_mesh(lesson.device.type, world // cp, cp)
        with lesson.variant(name):
            if name.startswith("fsdp-cp"):
                stats, row = run_fsdp_cp(lesson, name, cp, meshes[cp], code)
                lesson.results.add(name, stats, **row)
                del stats
            else:
                lesson.results.add(name, **run_attention(lesson, name, meshes[cp], code))
