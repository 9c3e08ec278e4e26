"""Lesson 17: context parallelism (CP): the sequence split over ranks, attention passed around a ring.

FSDP shards the weights, TP the matrices; what grows with a long sequence is the activations, and
every token's activations live on one rank unless the sequence itself is split. CP gives each of N
ranks 1/N of every sequence. Everything but attention works token by token, so it runs on the
local tokens unchanged; attention needs every earlier key and value. Ring attention passes the K/V
blocks around the ring of CP ranks: at each of N steps a rank attends its queries to the block it
holds, sends that block on and receives the next, and merges the partial results by their
log-sum-exp (softmax over the whole row, computed in pieces). Backward passes the blocks round
again, each with the gradient of its K and V, which arrive home after the last step.

Causal attention makes rank 0's queries (the sequence's start) see almost nothing and the last
rank's see everything: split the sequence into 2N chunks and give rank i chunks i and 2N-1-i, and
every rank computes the same number of score blocks.

    ring-contiguous   the lesson's ring, rank i holding chunks 2i, 2i+1 (CP over every rank)
    ring-balanced     the same ring, rank i holding chunks i and 2N-1-i
    torch-cp          torch's own context_parallel (CUDA SDPA kernels: a GPU only)
    fsdp-cpN          a tiny Llama trained with FSDP2 over the (dp, cp) ranks, CP over N of them,
                      against the unsplit model trained on the same batches

The run ends with a PREDICTION on a cluster (the step-time model, not a measurement): llama-8b at
65,536 tokens on one node of 8 H100 with FSDP2 alone and CP over 2, 4 and 8 GPUs, one sequence per
CP group, with the planner's peak per GPU (`fsdp-course plan --cp N` for the same configurations).

Run: fsdp-course run 17 [--quick]   or   torchrun --nproc-per-node 2 context_parallel.py --device cpu
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without install

from context_parallel_run import CPU_NOTE, LOSS_TOLERANCE, NOTES, TOLERANCE, VARIANTS, run_variants, takeaway
from cp_helpers import TinyLlama

from utilities import distributed as D
from utilities.course.lesson import Lesson, lesson_parser
from utilities.data import ByteTokenizer
from utilities.errors import positive_int
from utilities.measure.gpu_catalogue import get_gpu
from utilities.measure.planner import plan
from utilities.measure.predictions import add_prediction_arguments, parse_cluster, predict_from_arguments
from utilities.models import get_model_spec

VOCAB = ByteTokenizer.vocab_size  # the reversal task's tokens


# -- which tokens a rank holds ----------------------------------------------------------------------
def rank_chunks(rank: int, cp: int, balanced: bool) -> tuple[int, int]:
    """The two of the sequence's 2*cp equal chunks rank ``rank`` holds: i and 2N-1-i when
    ``balanced`` (a causal row's work grows with its position: a head and a tail even it out),
    else 2i and 2i+1 (contiguous)."""
    return (rank, 2 * cp - 1 - rank) if balanced else (2 * rank, 2 * rank + 1)


def positions(seq_len: int, rank: int, cp: int, balanced: bool) -> torch.Tensor:
    """The global positions of the tokens rank ``rank`` holds (its slice of every sequence)."""
    size = seq_len // (2 * cp)
    return torch.cat([torch.arange(c * size, (c + 1) * size) for c in rank_chunks(rank, cp, balanced)])


# -- the ring: send what you hold to the next rank, receive the previous rank's ------------------
def ring_pass(tensors: list[torch.Tensor], group: dist.ProcessGroup, counts: dict,
              key: str) -> list[torch.Tensor]:
    """Point-to-point, no collective: every rank sends ``tensors`` to rank+1 and receives the same
    shapes from rank-1 (of ``group``); the bytes sent are added to ``counts[key]``."""
    me, size = dist.get_rank(group), dist.get_world_size(group)
    to, frm = (dist.get_global_rank(group, (me + d) % size) for d in (1, -1))
    device = tensors[0].device
    via_host = device.type != "cpu" and "nccl" not in str(dist.get_backend(group))  # gloo: CPU only
    tensors = [(t.cpu() if via_host else t).contiguous() for t in tensors]
    received = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, to, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, r, frm, group) for r in received]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    counts[key] += sum(t.numel() * t.element_size() for t in tensors)
    return [r.to(device) for r in received]


# -- attention on one pair of chunks, and the log-sum-exp merge -----------------------------------
def block_scores(q: torch.Tensor, k: torch.Tensor, diagonal: bool, scale: float) -> torch.Tensor:
    """q @ k^T for one (query chunk, key chunk) pair; on the diagonal, causal inside the chunk."""
    s = (q @ k.transpose(-2, -1)) * scale
    if diagonal:
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
    return s


def merge(out, lse, block_out, block_lse):
    """Two softmax-weighted partial results over disjoint keys, as one over all of them: each is
    reweighted by its share of the row's total exp-sum, exp(its lse - the joint lse)."""
    joint = torch.logaddexp(lse, block_lse)
    return out * torch.exp(lse - joint) + block_out * torch.exp(block_lse - joint), joint


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries over every rank's keys and values: q, k, v are
    (batch, heads, local tokens, head dim), the local tokens being chunks ``rank_chunks(rank)``.
    ``counts`` receives the score blocks computed and the bytes sent, forward and backward."""

    @staticmethod
    def forward(ctx, q, k, v, group, balanced: bool, counts: dict):
        me, n = dist.get_rank(group), dist.get_world_size(group)
        scale = q.shape[-1] ** -0.5
        outs = [torch.zeros_like(qa) for qa in q.chunk(2, 2)]
        lses = [torch.full_like(qa[..., :1], float("-inf")) for qa in q.chunk(2, 2)]
        kv = [k, v]
        for step in range(n):  # at step s this rank holds rank (me - s)'s K/V
            ks, vs = kv[0].chunk(2, 2), kv[1].chunk(2, 2)
            for a, b, diagonal in pairs(me, (me - step) % n, n, balanced):
                s = block_scores(q.chunk(2, 2)[a], ks[b], diagonal, scale)
                lse = torch.logsumexp(s, -1, keepdim=True)
                outs[a], lses[a] = merge(outs[a], lses[a], torch.exp(s - lse) @ vs[b], lse)
                counts["score_blocks"] += 1
            if step < n - 1:
                kv = ring_pass(kv, group, counts, "forward_sent_bytes")
        out, lse = torch.cat(outs, 2), torch.cat(lses, 2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.balanced, ctx.counts = group, balanced, counts
        return out

    @staticmethod
    def backward(ctx, dout):
        """The same ring again, each K/V block travelling with its gradient: with P = exp(S - lse),
        dV += P^T dO, dS = P * (dO V^T - rowsum(dO * O)), dQ += dS K, dK += dS^T Q (times the
        scale). After the last step the gradients are one hop from home: one more pass."""
        q, k, v, out, lse = ctx.saved_tensors
        group, counts = ctx.group, ctx.counts
        me, n = dist.get_rank(group), dist.get_world_size(group)
        scale = q.shape[-1] ** -0.5
        dq = torch.zeros_like(q)
        qs, dos, dqs, lses = q.chunk(2, 2), dout.chunk(2, 2), dq.chunk(2, 2), lse.chunk(2, 2)
        deltas = (dout * out).sum(-1, keepdim=True).chunk(2, 2)
        held = [k, v, torch.zeros_like(k), torch.zeros_like(v)]  # K, V, dK, dV of rank (me - s)
        for step in range(n):
            ks, vs, dks, dvs = (t.chunk(2, 2) for t in held)  # views: add_ lands in held's dK, dV
            for a, b, diagonal in pairs(me, (me - step) % n, n, ctx.balanced):
                p = torch.exp(block_scores(qs[a], ks[b], diagonal, scale) - lses[a])
                dvs[b].add_(p.transpose(-2, -1) @ dos[a])
                ds = p * (dos[a] @ vs[b].transpose(-2, -1) - deltas[a])
                dqs[a].add_(ds @ ks[b], alpha=scale)
                dks[b].add_(ds.transpose(-2, -1) @ qs[a], alpha=scale)
            if n > 1:
                held = ring_pass(held if step < n - 1 else held[2:], group, counts, "backward_sent_bytes")
        dk, dv = held[-2:]
        return dq, dk, dv, None, None, None


def pairs(q_rank: int, kv_rank: int, cp: int, balanced: bool):
    """The (query chunk, key chunk, on the diagonal) index pairs with anything to compute: a key
    chunk later in the sequence than the query chunk is masked whole, and skipped."""
    for a, qa in enumerate(rank_chunks(q_rank, cp, balanced)):
        for b, kb in enumerate(rank_chunks(kv_rank, cp, balanced)):
            if kb <= qa:
                yield a, b, kb == qa


def ring_attention(q, k, v, group, balanced: bool = True, counts: dict | None = None) -> torch.Tensor:
    """``RingAttention`` as a function (what a model's attention calls instead of SDPA)."""
    counts = counts if counts is not None else new_counts()
    return RingAttention.apply(q, k, v, group, balanced, counts)


def new_counts() -> dict:
    return {"score_blocks": 0, "forward_sent_bytes": 0, "backward_sent_bytes": 0}


# -- FSDP composed with CP, as torchtitan does it ----------------------------------------------------
def cp_mesh(device_type: str, dp: int, cp: int) -> DeviceMesh:
    """dp groups of cp ranks: the ring inside a group (neighbouring ranks), data across groups."""
    return init_device_mesh(device_type, (dp, cp), mesh_dim_names=("dp", "cp"))


def shard_over_dp_and_cp(model: TinyLlama, fsdp_mesh: DeviceMesh) -> TinyLlama:
    """FSDP2 over every rank of the (dp, cp) mesh, flattened: CP ranks hold different tokens of the
    same sequences, so like data-parallel ranks their gradients are averaged, and they can shard the
    weights too (torchtitan's ``dp_shard_cp``). With no other mesh dimension, dp x cp flattened is
    the world, ``world_mesh()``."""
    for block in model.layers:
        fully_shard(block, mesh=fsdp_mesh)
    return fully_shard(model, mesh=fsdp_mesh)


def use_ring(model: TinyLlama, mesh: DeviceMesh, counts: dict) -> TinyLlama:
    """Every attention of ``model`` becomes the balanced ring over ``mesh["cp"]``; the caller feeds
    each rank its chunks' tokens and their global positions (``positions(..., balanced=True)``)."""
    group = mesh["cp"].get_group()
    model.attend = lambda q, k, v: ring_attention(q, k, v, group, balanced=True, counts=counts)
    return model


# -- torch's own context parallelism (CUDA SDPA kernels) --------------------------------------------
def torch_context_parallel(q, k, v, dout, mesh: DeviceMesh) -> list[torch.Tensor]:
    """torch's ``context_parallel`` as a user calls it: inside the context the listed buffers are
    sharded in place along the sequence (dim 2; causal: head-tail balanced, rank i holding chunks i
    and 2N-1-i), and SDPA runs as ring attention on each rank's shard. Returns this rank's output
    and gradients (dq, dk, dv)."""
    from torch.distributed.tensor.experimental import context_parallel

    with context_parallel(mesh, buffers=[q, k, v, dout], buffer_seq_dims=[2, 2, 2, 2]):
        ql, kl, vl = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out = F.scaled_dot_product_attention(ql, kl, vl, is_causal=True)
        out.backward(dout.clone())
    return [out.detach(), ql.grad, kl.grad, vl.grad]


def torch_cp_missing(device: torch.device, dist_info: D.DistInfo) -> str | None:
    """Why torch's context_parallel cannot run here (None: it can)."""
    try:
        from torch.distributed.tensor.experimental import context_parallel  # noqa: F401
    except ImportError:
        return f"torch {torch.__version__} has no torch.distributed.tensor.experimental.context_parallel"
    if device.type == "cuda" and not dist_info.nccl_on_gpu:
        return ("torch's context_parallel passes its K/V blocks with NCCL: ranks sharing one GPU "
                "talk over gloo; run one rank per GPU")
    if device.type != "cuda":
        return ("torch's context_parallel dispatches the CUDA SDPA kernels (flash, efficient, cuDNN); "
                "on a CPU it fails with 'aten._scaled_dot_product_flash_attention_for_cpu.default "
                "does not have a sharding strategy registered': the lesson's ring shows the same "
                "algorithm here")
    return None


# -- the lesson run: the variants (context_parallel_run.py), and the prediction on a cluster --
PREDICT_MODEL, PREDICT_BATCH, PREDICT_SEQ, PREDICT_ON = "llama-8b", 1, 65536, "1x8xh100"
PREDICT_AC = "selective"  # op-level selective checkpointing, as torchtitan's 8B runs
PREDICT_CP = (1, 2, 4, 8)
PREDICT_NOTE = ("The prediction on a cluster is `fsdp-course plan --cp N`'s time model and planner: "
                "each GPU of a CP group holds 1/N of every sequence's tokens, K/V all-gathered per "
                "layer (torch's default rotation) and timed inside a node on the compute lane, "
                "FSDP2 over every GPU; the batch is a CP group's (1 sequence), so the GPUs train "
                "8/N sequences a step.")


NOT_TRACED = ("shard_over_dp_and_cp and use_ring are written for the lesson's TinyLlama (its "
              "model.layers and model.attend, the ring's point-to-point sends), not the Hugging Face "
              "Llama the prediction plans; the planner's CP attention (utilities.measure."
              "context_parallel) stands in for the ring")


def prediction_knobs(gpus_per_node: int) -> dict[str, dict]:
    """The predicted variants as the step-time model takes them: FSDP2 alone (cp 1) and CP over
    2, 4 and 8 GPUs of one node (those that divide it), FSDP2 over every GPU in each. The batch
    is a CP group's: one long sequence, split over its N GPUs. The course's sequence, each row
    saying why not the lesson's functions (``NOT_TRACED``)."""
    return {("fsdp-only" if cp == 1 else f"fsdp-cp{cp}"): ({"cp": cp} if cp > 1 else {})
            | {"not_traced": NOT_TRACED}
            for cp in PREDICT_CP if gpus_per_node % cp == 0}


def predict(args) -> dict | None:
    """The ``predicted`` block (rank 0, before the group; None elsewhere or with --predict-on
    none), each variant with the planner's peak per GPU for the same configuration (the same
    cached fake step: ``fsdp-course plan --model M --gpus G --cp N --batch B --seq S --ac
    selective``)."""
    if args.predict_on == "none":
        return None
    cluster = parse_cluster(args.predict_on)
    knobs = prediction_knobs(cluster.gpus_per_node)
    block = predict_from_arguments(args, knobs, ac=PREDICT_AC, seq=args.predict_seq)
    if block is None:
        return None
    block["batch_per"] = "CP group (with cp 1: per GPU)"
    memory = get_gpu(cluster.gpu).memory_bytes
    for row in block["variants"]:
        p = plan(block["model"], cluster.gpus, memory, ac=PREDICT_AC, seq=block["seq"],
                 batch=block["batch"], cp=knobs[row["name"]].get("cp", 1))
        row.update(peak_bytes=p.peak_bytes["total"], fits=p.fits)
    return block


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = lesson_parser(__doc__)
    p.add_variants(VARIANTS)
    predict_flags = add_prediction_arguments(
        p, PREDICT_MODEL, PREDICT_BATCH, PREDICT_ON,
        batch_help="sequences per CP group per step to predict for (each split over its N GPUs)",
        model_help="a Llama: CP splits a decoder's sequence")
    predict_flags.add_argument("--predict-seq", type=positive_int, default=PREDICT_SEQ,
                               help=f"sequence length to predict for (default {PREDICT_SEQ:,}; a "
                               "multiple of 16: 2 chunks per rank of the largest CP group)")
    args = p.parse(argv)
    if args.predict_on != "none" and get_model_spec(args.predict_model).family != "llama":
        p.exit(2, f"error: --predict-model {args.predict_model!r} is not allowed: the prediction "
                  "splits a decoder's sequence; allowed: llama-tiny, llama-1b, llama-8b\n")
    if args.predict_on != "none" and args.predict_seq % (2 * max(PREDICT_CP)):
        p.exit(2, f"error: --predict-seq {args.predict_seq} is not allowed: each of up to "
                  f"{max(PREDICT_CP)} CP ranks takes 2 chunks; allowed: a multiple of "
                  f"{2 * max(PREDICT_CP)}\n")
    if args.model not in (None, "llama-tiny"):
        p.exit(2, f"error: --model {args.model!r} is not allowed: this lesson trains its own tiny "
                  "Llama (cp_helpers.TinyLlama); allowed: llama-tiny\n")
    if args.seq_len is None:
        on_gpu = D.resolve_device(args.device) == "cuda"
        args.seq_len = 4096 if on_gpu and not args.quick else 128 if args.quick else 256
    return args


def main(args: argparse.Namespace) -> None:
    predicted = predict(args)  # rank 0, before the group: the model traces on a fake group of its own
    with Lesson("17", args, settings={"tolerance": TOLERANCE, "loss_tolerance": LOSS_TOLERANCE},
                needs_ranks="the sequence split over ranks", notes=(*NOTES, PREDICT_NOTE),
                cpu_note=CPU_NOTE, takeaway=takeaway) as lesson:
        run_variants(lesson, args, SimpleNamespace(**globals()))  # the functions above, for the driver
        lesson.results.predicted(predicted)


if __name__ == "__main__":
    main(parse_args())
