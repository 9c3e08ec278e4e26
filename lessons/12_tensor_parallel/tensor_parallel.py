"""Lesson 12: tensor parallelism and 2-D parallelism (FSDP across, TP inside).

FSDP shards every weight but gathers it whole before computing with it. Tensor parallelism (TP)
never gathers: each rank of a TP group keeps a slice of every big matrix and computes with the
slice. A linear layer split column-wise (output features) needs the full input and gives a slice of
the output; split row-wise (input features) it takes a slice of the input and gives a partial sum.
Column-wise then row-wise, as in an MLP or an attention block (heads = columns of q/k/v, rows of
o), costs one all-reduce per pair, and each rank holds 1/tp of the pair's weights.

This script measures, per variant: the weight bytes each rank holds (all, split, replicated), the
peak memory of a training step, the largest difference from the unsplit model's outputs and
gradients on the same batch (it must be ~0: TP changes where the numbers are computed, not what
they are), and the loss curve.

    tpN-mlp      a standalone SwiGLU MLP (Lightning's TP example) split over N ranks
    tp1-llama    the unsplit Llama, trained alone on each rank (the 1-GPU baseline)
    tp2-llama    q/k/v and gate/up column-wise, o and down row-wise, in every block
    tp2-llama-sp the same plus sequence parallelism: norms and the activations between the split
                 layers sharded along the sequence, embedding and LM head split too
    dpAxtpB-2d   TP over B ranks inside, FSDP2 (fully_shard on mesh["dp"]) over A groups

A variant needing another number of ranks than the run has is skipped, with a note: tpN-mlp needs
a multiple of N ranks, tpN-llama[-sp] (N > 1) exactly N, dpAxtpB-2d exactly A*B.

Run: fsdp-course run 12 [--quick]   or   torchrun --nproc-per-node 2 tensor_parallel.py --device cpu
"""

from __future__ import annotations

import copy
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without install

import torch

from utilities import distributed as D
from utilities.course.lesson import Lesson, lesson_parser, positive_int
from utilities.data import ReverseTask, batches
from utilities.errors import UsageError
from utilities.measure import MemoryProbe, fmt_bytes
from utilities.models import get_model_spec
from utilities.tensor_parallel import (
    FeedForward,
    apply_mlp_tp,
    apply_tp,
    check_llama_tp,
    data_parallel_loader,
    max_abs_diffs,
    split_parameter_names,
    weight_bytes,
)
from utilities.training import TrainStats, sync, train
from utilities.wrapping import shard_model

# name: (kind, dp size or None for "whatever is left", tp size)
VARIANTS = {
    "tp1-mlp": ("mlp", None, 1),
    "tp2-mlp": ("mlp", None, 2),
    "tp4-mlp": ("mlp", None, 4),
    "tp1-llama": ("llama", 1, 1),
    "tp2-llama": ("llama", 1, 2),
    "tp2-llama-sp": ("llama-sp", 1, 2),
    "dp1xtp2-2d": ("2d", 1, 2),
    "dp2xtp2-2d": ("2d", 2, 2),
}
TOLERANCE = 1e-5  # fp32: splitting a matmul only reorders its sums
PUBLISHED_GB = {1: 4.04, 2: 2.03, 4: 1.02, 8: 0.60}  # Lightning TP docs, FeedForward(8192, 8192)


def parse_args(argv=None):
    p = lesson_parser(__doc__)
    p.add_variants(VARIANTS)
    p.add_argument("--mlp-dim", type=positive_int, default=None,
                   help="FeedForward model width (default 8192 on GPU as published, 1024 on CPU, "
                        "512 with --quick)")
    p.add_argument("--mlp-hidden", type=positive_int, default=None,
                   help="FeedForward hidden width (default: equal to --mlp-dim, as published)")
    args = p.parse(argv)
    if args.model is not None and get_model_spec(args.model).family != "llama":
        p.exit(2, f"error: --model {args.model!r} is not allowed: this lesson splits Llama attention "
                  "heads; allowed: llama-tiny, llama-1b, llama-8b\n")
    if args.model is None and (args.quick or D.resolve_device(args.device) == "cpu"):
        args.model = "llama-tiny"  # the CPU model of this lesson is a Llama (TP splits its heads)
    return args


def fits(kind: str, dp: int | None, tp: int, world: int) -> bool:
    if kind == "mlp":
        return world % tp == 0
    if tp == 1 and kind == "llama":
        return True
    return dp * tp == world  # "llama-sp" and "2d": exactly dp x tp ranks


def run_mlp(L, name: str, tp: int, tp_mesh, dim: int, hidden: int) -> dict:
    """Split the MLP, check it against the unsplit one, then time and measure training steps."""
    L.seed()
    ref = FeedForward(dim, hidden).to(L.device)
    model = copy.deepcopy(ref)
    if tp > 1:
        apply_mlp_tp(model, tp_mesh)
    split = split_parameter_names(model) if tp > 1 else {n for n, _ in model.named_parameters()}
    g = torch.Generator().manual_seed(L.args.seed + 1)
    xs = [torch.randn(L.batch_size, L.seq_len, dim, generator=g).to(L.device) for _ in range(L.steps)]

    out_ref = ref(xs[0])
    out_ref.square().mean().backward()
    out = model(xs[0])
    out.square().mean().backward()
    diff_out = (out - out_ref).abs().max().item()
    diffs = max_abs_diffs(ref, model)
    del ref, out_ref, out
    model.zero_grad(set_to_none=True)

    opt = torch.optim.AdamW(model.parameters(), lr=L.lr, foreach=L.device.type == "cuda")
    stats = TrainStats()
    for step, x in enumerate(xs):  # step 0 warm-up, step 1 measured for memory, the rest timed
        sync(L.device)
        t0 = time.perf_counter()
        if step == 1:
            with MemoryProbe(model, opt, L.device) as probe:
                loss = _mlp_step(model, opt, x)
            stats.peak_memory_bytes = probe.peak
        else:
            loss = _mlp_step(model, opt, x)
        sync(L.device)
        if step > 1:
            stats.step_times_s.append(time.perf_counter() - t0)
            stats.tokens_per_step = x.shape[0] * x.shape[1]
        stats.losses.append(loss)
    wb = weight_bytes(model, split)
    L.print(f"  {name}: weights per rank {fmt_bytes(wb['weight_bytes_per_rank'])}, peak "
            f"{fmt_bytes(stats.peak_memory_bytes.get('total'))}, max |diff| output {diff_out:.2e} "
            f"grads {diffs['grads']:.2e}")
    return dict(stats=stats, **wb, max_abs_diff_output=diff_out, max_abs_diff_grads=diffs["grads"],
                max_abs_diff_vs_unsplit=max(diff_out, diffs["grads"]))


def _mlp_step(model, opt, x) -> float:
    opt.zero_grad(set_to_none=True)
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    return loss.item()


def llama_data(L, dp_rank: int, dp_size: int):
    n = max(L.batch_size * dp_size * max(L.steps, 1), 64)
    ds = ReverseTask(n, L.seq_len, mode="causal", seed=L.args.seed)
    return batches(data_parallel_loader(ds, L.batch_size, dp_rank, dp_size, seed=L.args.seed), L.device)


def run_llama(L, name: str, kind: str, dp: int, tp: int, mesh) -> dict:
    """Split the Llama (and FSDP it for 2-D), check it against the unsplit model, then train it."""
    dp_rank = mesh["dp"].get_local_rank() if mesh is not None else 0
    ref = L.build_model()
    model = copy.deepcopy(ref)
    if tp > 1:
        # TP first: FSDP then shards the TP shards over dp
        apply_tp(model, mesh["tp"], sequence_parallel=kind == "llama-sp")
    split = split_parameter_names(model) if tp > 1 else set()
    if kind == "2d":
        shard_model(model, block_class=L.spec.block_class(), mesh=mesh["dp"], device=L.device)

    # The unsplit reference sees the whole global batch: every dp group's batch, concatenated.
    firsts = [next(llama_data(L, r, dp)) for r in range(dp)]
    glob = {k: torch.cat([b[k] for b in firsts]) for k in firsts[0]}
    out_ref = ref(**glob)
    out_ref.loss.backward()
    out = model(**firsts[dp_rank])
    out.loss.backward()
    rows = slice(dp_rank * L.batch_size, (dp_rank + 1) * L.batch_size)
    diff_out = (out.logits - out_ref.logits[rows]).abs().max().item()
    diffs = max_abs_diffs(ref, model)
    del ref, out_ref, out
    model.zero_grad(set_to_none=True)

    stats = train(model, L.optimizer(model), llama_data(L, dp_rank, dp), L.steps, L.device,
                  progress=name, flops_per_token=L.spec.flops_per_token(L.seq_len))
    stats.tokens_per_step = stats.tokens_per_step * dp // L.dist.world_size  # TP ranks share a batch
    wb = weight_bytes(model, split)
    L.print(f"  {name}: loss {stats.losses[0]:.3f} -> {stats.losses[-1]:.3f}, weights per rank "
            f"{fmt_bytes(wb['weight_bytes_per_rank'])} "
            f"(split {fmt_bytes(wb['split_weight_bytes_per_rank'])}), "
            f"peak {fmt_bytes(stats.peak_memory_bytes.get('total'))}, max |diff| logits {diff_out:.2e} "
            f"grads {diffs['grads']:.2e}")
    return dict(stats=stats, **wb, max_abs_diff_output=diff_out, max_abs_diff_grads=diffs["grads"],
                max_abs_diff_vs_unsplit=max(diff_out, diffs["grads"]))


def main(args) -> None:
    with Lesson("12", args, settings={"tolerance": TOLERANCE}) as L:
        if L.spec.family != "llama":
            raise UsageError(f"--model {L.spec.name!r} is not allowed: this lesson splits Llama "
                             "attention heads; allowed: llama-tiny, llama-1b, llama-8b")
        on_gpu = L.device.type == "cuda" and not args.quick
        dim = args.mlp_dim or (8192 if on_gpu else 512 if args.quick else 1024)
        hidden = args.mlp_hidden or dim
        world = L.dist.world_size
        L.results.data["settings"].update(mlp_dim=dim, mlp_hidden=hidden)
        meshes: dict[int, object] = {}
        skipped = []
        mlp_base = None
        for name in args.variants:
            with L.variant(name):  # everything the variant made is freed before the next one
                kind, dp, tp = VARIANTS[name]
                if not fits(kind, dp, tp, world):
                    skipped.append(name)
                    continue
                if kind != "mlp" and tp > 1:
                    check_llama_tp(L.spec.config(), tp)
                mesh = None
                if tp > 1 or kind == "2d":
                    if tp not in meshes:
                        meshes[tp] = D.mesh(L.device.type, (world // tp, tp), ("dp", "tp"))
                    mesh = meshes[tp]
                if kind == "mlp":
                    r = run_mlp(L, name, tp, mesh["tp"] if mesh is not None else None, dim, hidden)
                else:
                    r = run_llama(L, name, kind, dp if dp is not None else world // tp, tp, mesh)
                stats = r.pop("stats")
                extra = dict(kind=kind, tp_size=tp, dp_size=dp if dp is not None else world // tp, **r)
                if kind == "mlp":
                    if tp == 1:
                        mlp_base = (r["weight_bytes_per_rank"], stats.peak_memory_bytes.get("total"))
                    elif mlp_base is not None:
                        extra["weight_ratio_vs_tp1"] = round(r["weight_bytes_per_rank"] / mlp_base[0], 4)
                        extra["peak_ratio_vs_tp1"] = round(stats.peak_memory_bytes["total"] / mlp_base[1], 4)
                        if tp in PUBLISHED_GB:
                            extra["published_ratio_vs_tp1"] = round(PUBLISHED_GB[tp] / PUBLISHED_GB[1], 4)
                L.results.add(name, stats, **extra)

        if skipped:
            L.results.note(f"skipped (need another number of ranks than {world}): {', '.join(skipped)}")
        L.results.note(f"max_abs_diff_vs_unsplit: largest |difference| of outputs and gradients from "
                       f"the unsplit model on the same batch (fp32; expected below {TOLERANCE:g}).")
        L.results.note("split weights: q/k/v/o and gate/up/down of every block (MLP: w1/w2/w3); "
                       "embeddings, norms and the LM head are replicated on every TP rank, except "
                       "with -sp, where the embedding and the head are split too (norms stay "
                       "whole: they are tiny; their activations are what SP shards).")
        L.results.note("published (Lightning TP docs, FeedForward(8192, 8192), peak per GPU): "
                       "4.04 / 2.03 / 1.02 / 0.60 GB on 1 / 2 / 4 / 8 GPUs.")
        if L.device.type == "cpu":
            L.results.note("CPU run: memory from torch.distributed._tools trackers; step times on "
                           "gloo are only indicative.")


if __name__ == "__main__":
    main(parse_args())
