"""Tensor parallelism (TP) and 2-D parallelism (FSDP across, TP inside) for the course's models.

A linear layer ``y = x @ W.T`` can be split two ways across the ``tp`` ranks of a mesh:

* **column-wise** (``ColwiseParallel``): each rank holds a slice of W's *output* features and
  computes a slice of ``y`` from the full ``x``. No communication in forward.
* **row-wise** (``RowwiseParallel``): each rank holds a slice of W's *input* features, multiplies
  its slice of ``x`` and gets a partial sum of ``y``; one all-reduce adds the partial sums.

Put a column-wise layer first and a row-wise one second, and the first one's sliced output *is*
the second one's sliced input: an MLP (or an attention block, whose heads are the columns of q, k,
v and the rows of o) costs one all-reduce in forward and one in backward, whatever its size.

``llama_tp_plan`` / ``apply_tp`` split the attention heads and the MLP of every Llama block;
``FeedForward`` is the standalone MLP of Lightning's TP example, for the published memory figure.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from utilities.errors import UsageError


class FeedForward(nn.Module):
    """A SwiGLU MLP: ``w2(silu(w1(x)) * w3(x))`` (the shape of Lightning's TP example)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def mlp_tp_plan() -> dict[str, Any]:
    """w1 and w3 column-wise, w2 row-wise: one all-reduce per forward (at w2's output)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"w1": ColwiseParallel(), "w3": ColwiseParallel(), "w2": RowwiseParallel()}


def apply_mlp_tp(mlp: FeedForward, tp_mesh) -> FeedForward:
    """Split a ``FeedForward`` in place over ``tp_mesh`` (a 1-D mesh); returns it."""
    from torch.distributed.tensor.parallel import parallelize_module

    hidden = mlp.w1.out_features
    if hidden % tp_mesh.size():
        raise UsageError(f"MLP hidden size {hidden} does not divide by tp={tp_mesh.size()}")
    return parallelize_module(mlp, tp_mesh, mlp_tp_plan())


def llama_tp_plan(sequence_parallel: bool = False) -> dict[str, Any]:
    """The plan for one ``LlamaDecoderLayer``: attention heads and MLP columns split.

    ``use_local_output=True`` (the default) hands plain local tensors to the module's own code, so
    ``LlamaAttention`` sees only its local heads. In transformers 5.x it reshapes with
    ``view(*input_shape, -1, head_dim)``, so the number of heads is inferred from the local tensor,
    and ``num_key_value_groups`` (query heads per kv head) is the same ratio locally as globally:
    no attribute needs changing. (Older versions reshaped with ``self.num_heads``; there you would
    divide ``num_heads`` and ``num_key_value_heads`` by tp yourself.)

    Without ``sequence_parallel`` the norms and the residual stream are replicated: every TP rank
    holds the whole ``(batch, seq, hidden)`` activations between the split layers. With it
    (``SequenceParallel``), they are sharded along the sequence: the norms run on each rank's
    slice of the tokens, an all-gather brings the whole sequence back before q/k/v and gate/up, and
    o and down end in a reduce-scatter instead of an all-reduce (the same bytes moved, less memory
    held). Use it with ``llama_model_sp_plan`` on the model's embeddings, final norm and head.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    if not sequence_parallel:
        return {
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(),
        }
    # The residual stream stays a DTensor sharded on the sequence (dim 1) from block to block.
    to_seq = RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
    return {
        "input_layernorm": SequenceParallel(),
        "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                        desired_input_kwarg_layouts={"hidden_states": Replicate()}),
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": to_seq,
        "post_attention_layernorm": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": to_seq,
    }


def llama_model_sp_plan() -> dict[str, Any]:
    """Sequence parallelism outside the blocks: the embedding (split over the vocabulary) hands
    out sequence shards, the final norm works on them, the head gathers them back and returns the
    whole logits on every rank. The output stays a DTensor (not a local slice) so that the model's
    own code (positions, rotary embeddings, masks) still sees the whole sequence length."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    return {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1),
                                              use_local_output=False),
        "model.norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }


def check_llama_tp(config, tp: int) -> None:
    """Refuse a tp size that does not divide the heads, kv heads and MLP width."""
    for what, n in (("attention heads", config.num_attention_heads),
                    ("key/value heads", config.num_key_value_heads),
                    ("intermediate size", config.intermediate_size)):
        if n % tp:
            raise UsageError(f"tp={tp} does not divide the model's {what} ({n}); allowed: a tp "
                             f"size that divides {n}")


def apply_tp(model: nn.Module, tp_mesh, sequence_parallel: bool = False) -> nn.Module:
    """Tensor-parallelize every decoder block of a Hugging Face Llama over ``tp_mesh``, in place.

    Without ``sequence_parallel``, embeddings, norms and the LM head stay replicated (every rank
    holds them whole, and the activations between blocks too). With it, the norms and the
    activations between the split layers are sharded along the sequence, the embedding over the
    vocabulary and the head over its outputs (see ``llama_tp_plan``).
    """
    from torch.distributed.tensor.parallel import parallelize_module

    check_llama_tp(model.config, tp_mesh.size())
    if sequence_parallel:
        vocab = model.config.vocab_size
        if vocab % tp_mesh.size():
            raise UsageError(f"tp={tp_mesh.size()} does not divide the vocabulary ({vocab}); "
                             "sequence parallelism splits the embedding and the head over it")
        parallelize_module(model, tp_mesh, llama_model_sp_plan())
    for block in model.model.layers:
        parallelize_module(block, tp_mesh, llama_tp_plan(sequence_parallel))
    return model


def split_parameter_names(model: nn.Module) -> set[str]:
    """Names of the parameters that TP split (they are DTensors sharded on some mesh dim)."""
    from torch.distributed.tensor import DTensor, Shard

    names = set()
    for name, p in model.named_parameters():
        if isinstance(p, DTensor) and any(isinstance(pl, Shard) for pl in p.placements):
            names.add(name)
    return names


def local_bytes(t: torch.Tensor) -> int:
    """Bytes this rank holds for ``t`` (a DTensor holds only its local shard)."""
    local = getattr(t, "_local_tensor", t)
    return local.numel() * local.element_size()


def weight_bytes(model: nn.Module, names: set[str] | None = None) -> dict[str, int]:
    """Per-rank parameter bytes: all of them, the ``names`` subset (the split ones) and the rest."""
    total = split = 0
    for name, p in model.named_parameters():
        n = local_bytes(p)
        total += n
        if names is not None and _strip(name) in names:
            split += n
    return {"weight_bytes_per_rank": total, "split_weight_bytes_per_rank": split,
            "replicated_weight_bytes_per_rank": total - split}


def _strip(name: str) -> str:
    # FSDP1 / checkpoint wrappers prefix names; FSDP2 does not, but be lenient.
    return name.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", "")


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank (gathers a DTensor; a plain tensor is returned as is)."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def max_abs_diffs(ref: nn.Module, par: nn.Module) -> dict[str, float]:
    """Largest |difference| of parameters and of gradients between a model and its split copy
    (same parameter names), after both ran the same forward and backward."""
    import logging

    ref_params = dict(ref.named_parameters())
    dp = dg = 0.0
    # Gathering a 2-D (FSDP x TP) DTensor logs that it takes two all-gathers: true, and harmless here.
    log = logging.getLogger("torch.distributed.tensor._redistribute")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        for name, p in par.named_parameters():
            r = ref_params[_strip(name)]
            dp = max(dp, (full(p.detach()) - r.detach()).abs().max().item())
            if r.grad is not None or p.grad is not None:
                dg = max(dg, (full(p.grad) - r.grad).abs().max().item())
    finally:
        log.setLevel(level)
    return {"params": dp, "grads": dg}


def data_parallel_loader(dataset, batch_size: int, dp_rank: int, dp_size: int, seed: int = 0):
    """A loader that shards the data over the *data-parallel* ranks only.

    Every rank of one TP group computes slices of the same matmuls, so it must see the same batch:
    the sampler's rank is the dp rank (``mesh["dp"].get_local_rank()``) and its number of replicas
    the dp size, never the global rank and world size.
    """
    from utilities.data import make_loader

    return make_loader(dataset, batch_size, dp_rank, dp_size, seed=seed)
