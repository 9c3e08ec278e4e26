"""Context parallelism (CP) in the planner's fake step: what ``fsdp-course plan --cp N`` traces.

A CP group of N ranks processes the same sequences, each rank 1/N of every sequence's tokens
(with the causal load balancing, chunks r and 2N-1-r of 2N). Everything token-wise (embeddings,
norms, MLP, logits and loss) runs on seq/N tokens; attention needs every key. torch's
``context_parallel`` (``torch.distributed.tensor.experimental``; lesson 17) by default gathers
K and V (its "allgather" rotate method, torchtitan's default too): per layer, in forward, one
all-gather of the concatenated K and V of the whole sequence, attention of the local queries over
it chunk by chunk, the partial results merged by their log-sum-exp; autograd keeps only the local
q, k, v, output and log-sum-exp. In backward the K/V are gathered again, each chunk's backward
runs on the local queries, and the dK/dV accumulators travel once around the ring (N sends of
the local dK/dV) to the ranks that own them.

``cp_attention(group)`` replays that under ``FakeTensorMode``, so the memory tracker sees the
gathered K/V while they exist and the op recorder counts each kernel: a ``TorchFunctionMode``
that sends ``F.scaled_dot_product_attention`` through ``CPAttention``. Its forward runs one
attention op of the local queries over all keys (in fake mode only shapes exist, and the work the
recorder counts, causal, half of seq/N x seq, is exactly each rank's share under the load
balancing: 1/N of the unsplit causal work); its backward runs N chunk backward ops (each seq/N x
seq/N, causal-halved: the same total) so no whole-sequence dK/dV is ever held, as torch does not.
The collectives go through torch's functional collectives on the CP group; the recorder names
them ``cp:<op>`` (``CP_PREFIX``) so the time model times them over the CP group.
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
    if strategy not in ("full_shard", "shard_grad_op"):
        raise bad_value("--strategy", strategy, "full_shard or shard_grad_op with --cp (FSDP2 "
                        "over every GPU, data x context, as torchtitan's dp_shard_cp)")
    if parallelize is not None or getattr(spec, "parallelize", None) is not None:
        raise bad_value("--cp", cp, "1 with --parallelize (the CP step shards with the course's "
                        "sequence; your function gets no CP group)")
    if seq is not None and seq % (2 * cp):
        raise bad_value("--seq", seq, f"a multiple of 2 x --cp ({2 * cp}): the causal load "
                        "balancing splits every sequence into 2 x cp chunks")
    if options is not None and (options.offload or options.frozen
                                or options.reshard_after_forward is not None):
        raise bad_value("--cp", cp, "1 with --offload, --trainable, --lora-rank or "
                        "--reshard-after-forward (the CP step plans accumulation and "
                        "--param-dtype only)")


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


def _gathered_chunks(k: torch.Tensor, v: torch.Tensor, group) -> list[tuple[torch.Tensor, ...]]:
    """All-gather the concatenated local K and V over the CP ``group`` (one collective, as torch's
    all-gather rotater), and each rank's K and V chunk as views of the gathered buffer (which
    lives while any of them does)."""
    import torch.distributed._functional_collectives as funcol

    n = torch.distributed.get_world_size(group)
    both = torch.cat([k.reshape(-1), v.reshape(-1)])
    gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor  # 2.6..2.9
    gathered = funcol.wait_tensor(gather(both, 0, group)).view(n, 2, -1)
    return [(gathered[j, 0].view(k.shape), gathered[j, 1].view(v.shape)) for j in range(n)]


def _repeat_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """K or V with its key/value heads repeated to the query heads (grouped-query attention)."""
    groups = heads // x.shape[1]
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


class CPAttention(torch.autograd.Function):
    """Causal attention of the local queries over the whole sequence's keys, K/V gathered over the
    CP ``group`` in forward and again in backward (the module's docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, group, scale):
        fwd, _ = _sdpa_ops(q.device.type)
        heads = q.shape[1]
        out = lse = rest = None
        for kc, vc in _gathered_chunks(k, v, group):  # chunk by chunk, merged by log-sum-exp
            part, part_lse, rest = fwd(q, _repeat_heads(kc, heads), _repeat_heads(vc, heads), scale)
            part, part_lse = part.float(), part_lse.float()
            if out is None:
                out, lse = part, part_lse
                continue
            merged = torch.logaddexp(lse, part_lse)
            out = (out * torch.exp(lse - merged).unsqueeze(-1)
                   + part * torch.exp(part_lse - merged).unsqueeze(-1))
            lse = merged
        out = out.to(q.dtype)
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
        heads = q.shape[1]
        dq = torch.zeros_like(q, dtype=torch.float32)
        dkv = torch.zeros(2 * k.numel(), dtype=torch.float32, device=k.device)
        nxt = [(i + 1) % n for i in range(n)]
        for kc, vc in _gathered_chunks(k, v, group):
            gq, gk, gv = bwd(dout, q, _repeat_heads(kc, heads), _repeat_heads(vc, heads), out, lse,
                             ctx.rest, ctx.scale)
            dq += gq
            if heads != k.shape[1]:  # the repeated heads' gradients, summed per key/value head
                gk = gk.unflatten(1, (k.shape[1], -1)).sum(2)
                gv = gv.unflatten(1, (k.shape[1], -1)).sum(2)
            dkv += torch.cat([gk.reshape(-1), gv.reshape(-1)])
            dkv = funcol.wait_tensor(funcol.permute_tensor(dkv, nxt, group))  # to the next rank
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

    def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                  **kwargs):
        if dropout_p:
            raise bad_value("attention dropout under --cp", dropout_p, "0.0")
        return CPAttention.apply(query, key, value, group, scale)

    F.scaled_dot_product_attention = attention
    try:
        yield
    finally:
        F.scaled_dot_product_attention = sdpa
