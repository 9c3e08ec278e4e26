"""Lesson 12: tensor parallelism and 2-D parallelism (FSDP across, TP inside).

FSDP shards every weight but gathers it whole before computing with it. Tensor parallelism (TP)
never gathers: each rank of a TP group keeps a slice of every big matrix and computes with the
slice. A linear layer split column-wise (output features) needs the full input and gives a slice of
the output; split row-wise (input features) it takes a slice of the input and gives a partial sum.
Column-wise then row-wise, as in an MLP or an attention block (heads = columns of q/k/v, rows of
o), costs one all-reduce per pair, and each rank holds 1/tp of the pair's weights.

Run: fsdp-course run 12 [--quick]   or   torchrun --nproc-per-node 2 tensor_parallel.py --device cpu

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
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without install

from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from tp_helpers import ratios_vs_tp1, run_llama, run_mlp

from utilities import distributed as D
from utilities.course.lesson import Lesson, lesson_parser
from utilities.errors import UsageError, positive_int
from utilities.measure.tensor_parallel import (
    FeedForward,
    apply_mlp_tensor_parallel,
    apply_tensor_parallel,
    check_tensor_parallel,
    llama_block_plan,
    llama_root_plan,
    mlp_plan,
)
from utilities.models import get_model_spec

# -- the code this lesson teaches ---------------------------------------------------------------
# The plans have one home, utilities.measure.tensor_parallel (the planner splits the same way):
# mlp_plan()                      w1 and w3 column-wise, w2 row-wise: one all-reduce per forward
# llama_block_plan(sp)            q/k/v and gate/up column-wise, o and down row-wise, per block;
#                                 with sp the norms and the residual stream split on the sequence
# llama_root_plan()               with sp: embedding and LM head split over the vocabulary
mlp_tp_plan, llama_tp_plan, llama_model_sp_plan = mlp_plan, llama_block_plan, llama_root_plan


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool = False) -> nn.Module:
    """Tensor-parallelize every decoder block of a Hugging Face Llama over ``tp_mesh``, in place.
    Without ``sequence_parallel`` embeddings, norms and the LM head stay whole on every rank."""
    return apply_tensor_parallel(model, type(model.model.layers[0]), tp_mesh, sequence_parallel)


def apply_mlp_tp(mlp: FeedForward, tp_mesh: DeviceMesh) -> FeedForward:
    """Split a ``FeedForward`` in place over ``tp_mesh`` (a 1-D mesh); returns it."""
    return apply_mlp_tensor_parallel(mlp, tp_mesh)


def mesh_2d(device_type: str, dp: int, tp: int) -> DeviceMesh:
    """dp groups of tp ranks: TP inside a group (neighbouring ranks: one node), FSDP across."""
    return init_device_mesh(device_type, (dp, tp), mesh_dim_names=("dp", "tp"))


def apply_2d(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """TP first on mesh["tp"], then FSDP2 on mesh["dp"]: fully_shard shards the TP shards (2-D
    DTensors). The other way round, TP would try to split FSDP's shards."""
    apply_tp(model, mesh["tp"])
    for block in model.model.layers:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


# -- the lesson's variants -----------------------------------------------------------------------
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
NOTES = (
    f"max_abs_diff_vs_unsplit: largest |difference| of outputs and gradients from the unsplit model "
    f"on the same batch (fp32; expected below {TOLERANCE:g}).",
    "split weights: q/k/v/o and gate/up/down of every block (MLP: w1/w2/w3); embeddings, norms and "
    "the LM head are replicated on every TP rank, except with -sp, where the embedding and the head "
    "are split too (norms stay whole: they are tiny; their activations are what SP shards).",
    "published (Lightning TP docs, FeedForward(8192, 8192), peak per GPU): 4.04 / 2.03 / 1.02 / "
    "0.60 GB on 1 / 2 / 4 / 8 GPUs.",
)
CPU_NOTE = "CPU run: memory from torch.distributed._tools trackers; step times on gloo are only indicative."


def parse_args(argv=None):
    p = lesson_parser(__doc__)
    p.add_variants(VARIANTS)
    mlp = p.add_argument_group("the standalone MLP (Lightning's TP example)")
    mlp.add_argument("--mlp-dim", type=positive_int, help="FeedForward model width (default 8192 on "
                     "GPU as published, 1024 on CPU, 512 with --quick)")
    mlp.add_argument("--mlp-hidden", type=positive_int,
                     help="FeedForward hidden width (default: equal to --mlp-dim, as published)")
    args = p.parse(argv)
    if args.model is not None and get_model_spec(args.model).family != "llama":
        p.exit(2, f"error: --model {args.model!r} is not allowed: this lesson splits Llama attention "
                  "heads; allowed: llama-tiny, llama-1b, llama-8b\n")
    if args.model is None and (args.quick or D.resolve_device(args.device) == "cpu"):
        args.model = "llama-tiny"  # the CPU model of this lesson is a Llama (TP splits its heads)
    return args


def fits(kind: str, dp: int | None, tp: int, world: int) -> bool:
    """tpN-mlp needs a multiple of N ranks, tp1-llama any number, the others exactly dp x tp."""
    if kind == "mlp":
        return world % tp == 0
    if tp == 1 and kind == "llama":
        return True
    return dp * tp == world


def parallelize(kind: str, tp: int, mesh: DeviceMesh | None):
    """The variant's split as a function of the model (None: the unsplit baseline)."""
    if tp == 1 and kind != "2d":
        return None
    if kind == "mlp":
        return lambda model: apply_mlp_tp(model, mesh["tp"])
    if kind == "2d":
        return lambda model: apply_2d(model, mesh)
    return lambda model: apply_tp(model, mesh["tp"], sequence_parallel=kind == "llama-sp")


def takeaway(results: dict) -> str:
    """The lesson's point, from what the run measured (printed last)."""
    worst = max(v.get("max_abs_diff_vs_unsplit") or 0 for v in results["variants"])
    return f"tensor parallel computes what the unsplit model does (max |diff| {worst:.1e})"


def main(args) -> None:
    with Lesson("12", args, settings={"tolerance": TOLERANCE}, notes=NOTES, cpu_note=CPU_NOTE,
                takeaway=takeaway) as lesson:
        if lesson.spec.family != "llama":
            raise UsageError(f"--model {lesson.spec.name!r} is not allowed: this lesson splits Llama "
                             "attention heads; allowed: llama-tiny, llama-1b, llama-8b")
        world = lesson.dist.world_size
        dim = args.mlp_dim or (8192 if lesson.device.type == "cuda" and not args.quick
                               else 512 if args.quick else 1024)
        hidden = args.mlp_hidden or dim
        lesson.results.setting(mlp_dim=dim, mlp_hidden=hidden)
        lesson.results.columns("tp_size", "dp_size", "max_abs_diff_vs_unsplit", "weight_bytes_per_rank",
                               "peak_ratio_vs_tp1", "split_weight_bytes_per_rank")
        skipped = [n for n in args.variants if not fits(*VARIANTS[n], world)]
        meshes: dict[int, DeviceMesh] = {}  # one (world // tp, tp) mesh per tp size, made once
        for name in (n for n in args.variants if n not in skipped):
            kind, dp, tp = VARIANTS[name]
            dp = dp or world // tp
            if kind != "mlp" and tp > 1:
                check_tensor_parallel(lesson.spec.config(), tp, sequence_parallel=False)
            if (tp > 1 or kind == "2d") and tp not in meshes:
                meshes[tp] = mesh_2d(lesson.device.type, world // tp, tp)
            mesh = meshes.get(tp)
            with lesson.variant(name):  # everything the variant made is freed before the next one
                if kind == "mlp":
                    stats, row = run_mlp(lesson, name, parallelize(kind, tp, mesh), dim, hidden)
                else:
                    dp_rank = mesh["dp"].get_local_rank() if mesh is not None else 0
                    stats, row = run_llama(lesson, name, parallelize(kind, tp, mesh), dp, dp_rank)
                lesson.results.add(name, stats, kind=kind, tp_size=tp, dp_size=dp, **row)
                del stats
        lesson.results.extend_variants(ratios_vs_tp1(lesson.results.data["variants"]))
        if skipped:
            lesson.results.note(f"skipped (need another number of ranks than {world}): {', '.join(skipped)}")


if __name__ == "__main__":
    main(parse_args())
