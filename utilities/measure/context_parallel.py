"""Context parallelism (CP) in the planner's fake step: what ``fsdp-course plan --cp N`` traces.

A CP group of N ranks processes the same sequences, each rank 1/N of every sequence's tokens
(with the causal load balancing, chunks r and 2N-1-r of 2N). Everything token-wise (embeddings,
norms, MLP, logits and loss) runs on seq/N tokens; attention needs every key. torch's
``context_parallel`` (``torch.distributed.tensor.experimental``; lesson 17) by default gathers
K and V (its "allgather" rotate method, torchtitan's default too): per layer, in forward, one
all-gather of the concatenated local K and V (the whole sequence's), attention of the local queries over
it chunk by chunk, the partial results merged by their log-sum-exp; autograd keeps only the local
q, k, v, output and log-sum-exp. In backward the K/V are gathered again, each chunk's backward
runs on the local queries, and the dK/dV accumulators travel once around the ring (N sends of
the local dK/dV) to the ranks that own them.

``cp_attention(group)`` replays that under ``FakeTensorMode``, so the memory tracker sees the
gathered K/V while they exist and the op recorder counts each kernel: while the step runs,
``F.scaled_dot_product_attention`` is ``CPAttention`` (torch's ``context_parallel`` replaces
the same function). K and V are gathered by one all-gather each, sequence-major, so the whole
sequence's K and V are views of the gathered buffers. The forward runs one attention op of the
local queries over all keys: in fake mode only shapes exist, and the work the recorder counts,
causal, half of seq/N x seq, is exactly each rank's share under the load balancing (1/N of the
unsplit causal work); and selective checkpointing keeps that one output, as it keeps torch's one
ring-attention op. The backward runs N chunk backward ops (each seq/N x seq/N, causal-halved: the
same total), so no whole-sequence dK/dV is ever held, as torch holds none. The collectives go
through torch's functional collectives on the CP group; the recorder names them ``cp:<op>``
(``CP_PREFIX``) so the time model times them over the CP group.

Where it differs from torch: under selective checkpointing the recomputation gathers K and V
again (torch's cached ring-attention op does not), a transient and an all-gather per layer more.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from utilities.errors import bad_value

CP_PREFIX = "cp:"  # the op recorder's name prefix for a collective over the CP group


def check_cp(spec, cp, gpus: int, strategy: str, seq: int | None, tp: int = 1, options=None,
             gpus_per_node: int | None = None, parallelize=None) -> None:
    """Refuse in one line a CP configuration the fake step does not model: a degree that does
    not divide the GPUs (with TP: GPUs / tp) or a node, a sequence not split in 2 x cp chunks (the
    load balancing), an encoder-decoder, HSDP or DDP, your own sharding function, and the plan
    options the CP step does not model (as with --tp: accumulation and --param-dtype only)."""
    if not isinstance(cp, int) or cp < 1 or gpus % (cp * tp):
        raise bad_value("--cp", cp, f"a divisor of --gpus ({gpus})"
                        + (f" / --tp ({tp})" if tp > 1 else ""))
    if cp == 1:
        return
    if gpus_per_node is not None and gpus_per_node % (cp * tp):
        raise bad_value("--cp", cp, f"a divisor of --gpus-per-node ({gpus_per_node})"
                        + (f" / --tp ({tp})" if tp > 1 else "")
                        + ": the CP group's K/V exchange is modelled inside a node, over NVLink")
    if getattr(spec, "is_seq2seq", False):
        raise bad_value("--cp", cp, "1 for an encoder-decoder (T5): CP is modelled for a "
                        "decoder's causal self-attention")
    from utilities.measure.plan_options import check_beside_fsdp2

    check_beside_fsdp2("--cp", cp, strategy, options, "CP step",
                       "over every GPU, data x context, as torchtitan's dp_shard_cp")
    if parallelize is not None or getattr(spec, "parallelize", None) is not None:
        raise bad_value("--cp", cp, "1 with --parallelize (the CP step shards with the course's "
                        "sequence; your function gets no CP group)")
    if seq is not None and seq % (2 * cp):
        raise bad_value("--seq", seq, f"a multiple of 2 x --cp ({2 * cp}): the causal load "
                        "balancing splits every sequence into 2 x cp chunks")


def cp_ranks(world: int, cp: int, tp: int = 1) -> list[int]:
    """The CP group of rank 0 on a (dp, cp, tp) layout: cp ranks, tp apart."""
    return [i * tp for i in range(cp)]


def _sdpa_ops(device_type: str):
    """The forward and backward attention ops and how to call them, for ``device_type``."""
    aten = torch.ops.aten
    if device_type == "cpu":
        def forward(q, k, v, scale):
            out, lse = aten._scaled_dot_product_flash_attention_for_cpu.default(
                q, k, v, 0.0, True, scale=scale)
            return out, lse, ()

        def backward(dout, q, k, v, out, lse, rest, scale):
            return aten._scaled_dot_product_flash_attention_for_cpu_backward.default(
                dout, q, k, v, out, lse, 0.0, True, scale=scale)
        return forward, backward

    def forward(q, k, v, scale):
        out, lse, cq, ck, mq, mk, seed, offset, _ = aten._scaled_dot_product_flash_attention.default(
            q, k, v, 0.0, True, False, scale=scale)
        return out, lse, (cq, ck, mq, mk, seed, offset)

    def backward(dout, q, k, v, out, lse, rest, scale):
        cq, ck, mq, mk, seed, offset = rest
        return aten._scaled_dot_product_flash_attention_backward.default(
            dout, q, k, v, out, lse, cq, ck, q.shape[2], k.shape[2], 0.0, True, seed, offset,
            scale=scale)[:3]
    return forward, backward


def _gathered(x: torch.Tensor, group) -> torch.Tensor:
    """The whole sequence's K (or V): the local ``x`` (batch, heads, seq/N, head dim) all-gathered
    over the CP ``group`` sequence-major, so the result is a view of the gathered buffer (which
    lives while it does)."""
    import torch.distributed._functional_collectives as funcol

    local = x.permute(2, 0, 1, 3).contiguous()  # (seq/N, batch, heads, head dim)
    gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor  # 2.6..2.9
    return funcol.wait_tensor(gather(local, 0, group)).permute(1, 2, 0, 3)


class CPAttention(torch.autograd.Function):
    """Causal attention of the local queries over the whole sequence's keys, K/V gathered over the
    CP ``group`` in forward and again in backward (the module's docstring). K and V are gathered
    as the model hands them to attention, as torch's ring gathers what SDPA gets: a transformers
    decoder on the planner's unpadded batch hands SDPA its K/V heads only (``enable_gqa``; the
    attention ops take fewer K/V heads than query heads), a model that repeats them (torchtitan's
    Llama) every head."""

    @staticmethod
    def forward(ctx, q, k, v, group, scale):
        fwd, _ = _sdpa_ops(q.device.type)
        out, lse, rest = fwd(q, _gathered(k, group), _gathered(v, group), scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.rest, ctx.group, ctx.scale = rest, group, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        import torch.distributed._functional_collectives as funcol

        q, k, v, out, lse = ctx.saved_tensors
        _, bwd = _sdpa_ops(q.device.type)
        group = ctx.group
        n = torch.distributed.get_world_size(group)
        whole_k, whole_v = _gathered(k, group), _gathered(v, group)
        dq = torch.zeros_like(q, dtype=torch.float32)
        dkv = torch.zeros(2 * k.numel(), dtype=torch.float32, device=k.device)
        nxt = [(i + 1) % n for i in range(n)]
        for kc, vc in zip(whole_k.chunk(n, dim=2), whole_v.chunk(n, dim=2)):
            gq, gk, gv = bwd(dout, q, kc, vc, out, lse, ctx.rest, ctx.scale)
            dq += gq
            dkv += torch.cat([gk.reshape(-1), gv.reshape(-1)])
            dkv = funcol.wait_tensor(funcol.permute_tensor(dkv, nxt, group))  # to the next rank
        del whole_k, whole_v
        dk, dv = dkv.to(k.dtype).split(k.numel())
        return dq.to(q.dtype), dk.view_as(k), dv.view_as(v), None, None


@contextlib.contextmanager
def cp_attention(group):
    """Inside it, ``F.scaled_dot_product_attention`` runs as ``CPAttention`` over ``group``: the
    attention of a model whose every other op sees seq/N tokens, causal whatever mask it is
    given (torch's context_parallel takes ``is_causal`` only; the mask a course model builds for
    its local tokens is the causal one). The function is replaced on ``torch.nn.functional``
    while the step runs (a torch-function mode would be off in the backward's recomputation)."""
    sdpa = F.scaled_dot_product_attention
    calls = [0]  # how many attention calls went through CPAttention (``check_cp_ran``)

    def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                  **kwargs):
        if dropout_p:
            raise bad_value("attention dropout under --cp", dropout_p, "0.0")
        calls[0] += 1
        return CPAttention.apply(query, key, value, group, scale)

    F.scaled_dot_product_attention = attention
    try:
        yield calls
    finally:
        F.scaled_dot_product_attention = sdpa


def check_cp_ran(calls: list[int], model_name: str) -> None:
    """Refuse in one line a model whose attention never went through
    ``F.scaled_dot_product_attention`` under ``cp_attention`` (``calls``: what it yielded): its
    attention would have seen only the local tokens."""
    if not calls[0]:
        raise bad_value("--cp with model", model_name, "a model whose attention calls "
                        "torch.nn.functional.scaled_dot_product_attention (what CP replaces, as "
                        "torch's context_parallel does)")
