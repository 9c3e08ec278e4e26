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

The run ends with a PREDICTION on a cluster (the step-time model, not a measurement): llama-8b on
one node of 8 H100 with FSDP2 alone and 2-D with TP over 2, 4 and 8 GPUs, the same global batch in
each (a TP group of N GPUs takes N times the per-GPU batch), with the planner's peak per GPU
(`fsdp-course plan --tp N` for the same configurations).
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without install

from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from tp_helpers import CPU_NOTE, NOTES, TOLERANCE, VARIANTS, run_variants, takeaway

from utilities import distributed as D
from utilities.activation_checkpointing import apply_op_selective_checkpointing
from utilities.course.lesson import Lesson, lesson_parser
from utilities.errors import UsageError, positive_int
from utilities.measure.gpu_catalogue import get_gpu
from utilities.measure.plan_options import PlanOptions
from utilities.measure.planner import plan
from utilities.measure.predictions import add_prediction_arguments, parse_cluster, predict_from_arguments
from utilities.measure.tensor_parallel import FeedForward, check_tensor_parallel
from utilities.models import get_model_spec


# -- the code this lesson teaches ---------------------------------------------------------------
# The planner (utilities.measure.tensor_parallel) splits models the same way, with plans of its
# own; tests/test_lesson_12.py holds the two to the same styles and layouts.
def mlp_tp_plan() -> dict[str, ParallelStyle]:
    """A SwiGLU MLP ``w2(silu(w1(x)) * w3(x))``: w1 and w3 column-wise, w2 row-wise, so one
    all-reduce per forward, at w2's output."""
    return {"w1": ColwiseParallel(), "w3": ColwiseParallel(), "w2": RowwiseParallel()}


def llama_tp_plan(sequence_parallel: bool = True) -> dict[str, ParallelStyle]:
    """One Llama block: q/k/v and gate/up column-wise (heads, MLP columns), o and down row-wise.
    The attention and the MLP take their input as one replicated DTensor, which their column-wise
    layers share. With ``sequence_parallel`` the norms and the residual stream stay split along
    the sequence (``Shard(1)``): an all-gather into the attention and the MLP, a reduce-scatter out
    of o and down; without it the stream is whole on every rank and o and down all-reduce."""
    stream = Shard(1) if sequence_parallel else Replicate()
    back_to_stream = RowwiseParallel(output_layouts=stream, use_local_output=not sequence_parallel)
    plan = {
        "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": stream},
                                        desired_input_kwarg_layouts={"hidden_states": Replicate()},
                                        use_local_output=False),
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": back_to_stream,
        "mlp": PrepareModuleInput(input_layouts=(stream,), desired_input_layouts=(Replicate(),),
                                  use_local_output=False),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": back_to_stream,
    }
    if sequence_parallel:
        plan["input_layernorm"] = SequenceParallel()
        plan["post_attention_layernorm"] = SequenceParallel()
    return plan


def llama_model_sp_plan() -> dict[str, ParallelStyle]:
    """Sequence parallelism outside the blocks: the embedding split over the vocabulary hands out
    sequence shards (kept a DTensor, so the model's own code sees the whole sequence length), the
    final norm works on them, the LM head gathers the sequence, splits the vocabulary and hands
    out whole logits."""
    return {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1),
                                              use_local_output=False),
        "model.norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }


def apply_mlp_tp(mlp: FeedForward, tp_mesh: DeviceMesh) -> FeedForward:
    """Split a ``FeedForward`` in place over ``tp_mesh`` (a 1-D mesh); returns it."""
    return parallelize_module(mlp, tp_mesh, mlp_tp_plan())


def apply_llama_tp(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool = True) -> nn.Module:
    """Split a Hugging Face Llama in place over ``tp_mesh``: every block, and with
    ``sequence_parallel`` the embedding, the final norm and the head too; returns it."""
    if sequence_parallel:
        parallelize_module(model, tp_mesh, llama_model_sp_plan())
    for block in model.model.layers:
        parallelize_module(block, tp_mesh, llama_tp_plan(sequence_parallel))
    return model


def mesh_2d(device_type: str, dp: int, tp: int) -> DeviceMesh:
    """dp groups of tp ranks: TP inside a group (neighbouring ranks: one node), FSDP across."""
    return init_device_mesh(device_type, (dp, tp), mesh_dim_names=("dp", "tp"))


def apply_2d(model: nn.Module, mesh: DeviceMesh, sequence_parallel: bool = False,
             checkpoint: bool = False, mp_policy: MixedPrecisionPolicy | None = None) -> nn.Module:
    """TP first on mesh["tp"], then FSDP2 on mesh["dp"]: fully_shard shards the TP shards (2-D
    DTensors). The other way round, TP would try to split FSDP's shards. ``checkpoint``: op-level
    selective checkpointing of each block between the two (the TP plan names the block's own
    submodules, which the wrapper would hide; the wrapper becomes the FSDP unit). The lesson's runs
    take the defaults; its cluster prediction, torchtitan's 8B setup: sequence parallel,
    checkpointing, bf16."""
    apply_llama_tp(model, mesh["tp"], sequence_parallel=sequence_parallel)
    if checkpoint:
        apply_op_selective_checkpointing(model, type(model.model.layers[0]))
    policy = {} if mp_policy is None else {"mp_policy": mp_policy}
    for block in model.model.layers:
        fully_shard(block, mesh=mesh["dp"], **policy)
    fully_shard(model, mesh=mesh["dp"], **policy)
    return model


# -- the lesson run: the variants (tp_helpers.py), and the prediction on a cluster ------------
PREDICT_MODEL, PREDICT_BATCH, PREDICT_SEQ, PREDICT_ON = "llama-8b", 1, 2048, "1x8xh100"
PREDICT_AC = "selective"  # op-level selective checkpointing, as torchtitan's 8B runs
PREDICT_TP = (1, 2, 4, 8)
PREDICT_NOTE = ("The prediction on a cluster is `fsdp-course plan --tp N`'s time model and planner: "
                "TP's collectives timed inside a node on the compute lane (no async TP), sequence "
                "parallel, FSDP2 across the TP groups; the same global batch in every variant.")


def prediction_knobs(model: str, batch: int, gpus_per_node: int) -> dict[str, dict]:
    """The predicted variants as the step-time model takes them: FSDP2 alone (tp 1) and 2-D with
    TP over 2, 4 and 8 GPUs of one node (those that divide it and that ``model`` can split). The
    global batch stays the same: each of the GPUs / N TP groups takes N x ``batch`` sequences
    (``estimate_step_time``'s ``batch`` is a TP group's), so every variant trains the same tokens
    per step and tokens/s per GPU compares like with like."""
    config = get_model_spec(model).config()

    def splits(tp: int) -> bool:
        try:
            check_tensor_parallel(config, tp)
        except UsageError:
            return False
        return gpus_per_node % tp == 0

    whole_logits = PlanOptions(loss_parallel=False)  # as this lesson's TP plan runs its loss
    own = functools.partial(apply_2d, sequence_parallel=True, checkpoint=True)
    return {("fsdp-only" if tp == 1 else f"2d-tp{tp}"): ({"tp": tp, "batch": batch * tp,
                                                         "plan_options": whole_logits,
                                                         "parallelize": own} if tp > 1 else {})
            for tp in PREDICT_TP if tp == 1 or splits(tp)}


def predict(args) -> dict | None:
    """The ``predicted`` block (rank 0, before the group; None elsewhere or with --predict-on
    none), each variant with the planner's peak per GPU for the same configuration (the same
    cached fake step: ``fsdp-course plan --model M --gpus G --tp N --batch B --ac selective``)."""
    if args.predict_on == "none":
        return None
    cluster = parse_cluster(args.predict_on)
    knobs = prediction_knobs(args.predict_model, args.predict_batch, cluster.gpus_per_node)
    block = predict_from_arguments(args, knobs, ac=PREDICT_AC, seq=args.predict_seq)
    if block is None:
        return None
    memory = get_gpu(cluster.gpu).memory_bytes
    for row in block["variants"]:
        k = knobs[row["name"]]
        own = k.get("parallelize")  # its checkpointing is its own: no ac beside it
        p = plan(block["model"], cluster.gpus, memory, ac="none" if own else PREDICT_AC,
                 seq=block["seq"], batch=k.get("batch", block["batch"]), tp=k.get("tp", 1),
                 options=k.get("plan_options"), parallelize=own)
        row.update(peak_bytes=p.peak_bytes["total"], fits=p.fits)
    return block


def parse_args(argv=None):
    p = lesson_parser(__doc__)
    p.add_variants(VARIANTS)
    mlp = p.add_argument_group("the standalone MLP (Lightning's TP example)")
    mlp.add_argument("--mlp-dim", type=positive_int, help="FeedForward model width (default 8192 on "
                     "GPU as published, 1024 on CPU, 512 with --quick)")
    mlp.add_argument("--mlp-hidden", type=positive_int,
                     help="FeedForward hidden width (default: equal to --mlp-dim, as published)")
    predict_flags = add_prediction_arguments(
        p, PREDICT_MODEL, PREDICT_BATCH, PREDICT_ON,
        batch_help="sequences per GPU per step to predict for (the same global batch in every "
                   "variant: a TP group of N GPUs takes N times this)",
        model_help="a Llama: TP splits its heads")
    predict_flags.add_argument("--predict-seq", type=positive_int, default=PREDICT_SEQ,
                               help=f"sequence length to predict for (default {PREDICT_SEQ})")
    args = p.parse(argv)
    if args.predict_on != "none" and get_model_spec(args.predict_model).family != "llama":
        p.exit(2, f"error: --predict-model {args.predict_model!r} is not allowed: the prediction "
                  "splits Llama attention heads; allowed: llama-tiny, llama-1b, llama-8b\n")
    if args.model is not None and get_model_spec(args.model).family != "llama":
        p.exit(2, f"error: --model {args.model!r} is not allowed: this lesson splits Llama attention "
                  "heads; allowed: llama-tiny, llama-1b, llama-8b\n")
    if args.model is None and (args.quick or D.resolve_device(args.device) == "cpu"):
        args.model = "llama-tiny"  # the CPU model of this lesson is a Llama (TP splits its heads)
    return args


def main(args) -> None:
    predicted = predict(args)  # rank 0, before the group: the model traces on a fake group of its own
    with Lesson("12", args, settings={"tolerance": TOLERANCE}, notes=(*NOTES, PREDICT_NOTE),
                cpu_note=CPU_NOTE, takeaway=takeaway) as lesson:
        run_variants(lesson, args, SimpleNamespace(**globals()))  # the functions above, for the driver
        lesson.results.predicted(predicted)


if __name__ == "__main__":
    main(parse_args())
