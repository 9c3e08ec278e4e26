"""Tensor parallelism (TP) for the course's models, and the pieces ``fsdp-course plan --tp`` needs.

TP splits each big matrix of a block over the ``tp`` ranks of a group instead of gathering it whole
(FSDP). A linear layer split column-wise (its output features) needs the whole input and gives a
slice of the output; split row-wise (its input features) it takes that slice and gives a partial
sum. q/k/v and gate/up column-wise, then o and down row-wise: each rank holds 1/tp of those
weights and computes 1/tp of the heads and of the MLP width.

With *sequence parallelism* (SP) the activations between those pairs (the norms, the residual
stream) are split along the sequence too: an all-gather of the sequence before q/k/v and before
gate/up, a reduce-scatter after o and after down, instead of one all-reduce after each pair.

Everything here is torch's own ``torch.distributed.tensor.parallel.parallelize_module`` with a plan
per model family (lesson 12 writes the same plans out itself; its tests hold the two alike). 2-D
parallelism (TP inside a group, FSDP across the groups, the mesh dims named "dp" and "tp") is
``utilities.parallelize.parallelize_model`` on a ("dp", "tp") mesh.

For the planner (memory) and the time model:

* ``apply_tensor_parallel`` splits a model (real or meta), what ``utilities.parallelize.apply_tp``
  calls first in the sequence the planner's fake step (``fake_step.prepare`` with ``tp``) traces;
* ``fake_step_peak``: one training step of any ``nn.Module`` under the memory tracker (on a fake
  process group, ``fake_step.fake_world``, for Lightning's table).

The collectives TP adds to a step are the ones the fake step records (the time model times them);
``tests/test_tensor_parallel_plan.py`` checks them against Megatron's mechanism, block by block.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from utilities.errors import bad_value

# The LM head's whole logits are ``to_local()`` of a replicated DTensor, a view: FSDP2 warns that an
# in-place op on the root's output would skip its pre-backward hook. The step does none.
HEAD_VIEW_WARNING = r"FSDP2-wrapped module \(FSDP\w+ForCausalLM\) returned a view tensor"
TP_FAMILIES = ("llama",)  # the model families with a plan here
# set on a model whose LM head keeps its logits split over the vocabulary (loss parallel)
LOSS_PARALLEL_ATTRIBUTE = "tp_loss_parallel"
T5_REFUSAL = ("llama (T5 has no TP plan here: its encoder-decoder blocks share a relative-position "
              "bias computed once per stack, and its cross-attention needs a plan of its own)")


class FeedForward(nn.Module):
    """A SwiGLU MLP ``w2(silu(w1(x)) * w3(x))`` without biases: the model of Lightning's TP
    example (``FeedForward(8192, 8192)``), which lesson 12 and ``benchmarks/tp_check.py`` split."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


# -- the plans -----------------------------------------------------------------------------------

def mlp_plan() -> dict[str, ParallelStyle]:
    """A SwiGLU MLP ``w2(silu(w1(x)) * w3(x))`` (Lightning's ``FeedForward``): w1 and w3
    column-wise, w2 row-wise, so one all-reduce per forward, at w2's output."""
    return {"w1": ColwiseParallel(), "w3": ColwiseParallel(), "w2": RowwiseParallel()}


def llama_block_plan(sequence_parallel: bool = True) -> dict[str, ParallelStyle]:
    """The plan of one Hugging Face ``LlamaDecoderLayer``: heads and MLP columns split.

    The attention and the MLP each get their input as one replicated DTensor
    (``PrepareModuleInput``): q/k/v (gate/up) share it, so the backward sums their three (two)
    partial input gradients first and reduces them once, as Megatron's ``f`` does. q/k/v hand plain
    local tensors to the block's own code, so ``LlamaAttention`` sees only its local heads
    (transformers infers the head count from the tensor). With ``sequence_parallel`` the norms
    and the residual stream stay sharded along the sequence (dim 1): the input is all-gathered
    into the attention and the MLP, and o and down reduce-scatter their partial sums back into
    sequence shards; without it the residual stream is whole on every rank and o and down
    all-reduce.
    """
    stream = Shard(1) if sequence_parallel else Replicate()
    whole_input = dict(input_layouts=(stream,), desired_input_layouts=(Replicate(),),
                       use_local_output=False)
    back_to_stream = RowwiseParallel(output_layouts=stream, use_local_output=not sequence_parallel)
    plan: dict[str, ParallelStyle] = {
        "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": stream},
                                        desired_input_kwarg_layouts={"hidden_states": Replicate()},
                                        use_local_output=False),
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": back_to_stream,
        "mlp": PrepareModuleInput(**whole_input),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": back_to_stream,
    }
    if sequence_parallel:
        plan["input_layernorm"] = SequenceParallel()
        plan["post_attention_layernorm"] = SequenceParallel()
    return plan


def llama_root_plan(loss_parallel: bool = False) -> dict[str, ParallelStyle]:
    """Sequence parallelism outside the blocks (as torchtitan's Llama does it): the embedding is
    split over the vocabulary and hands out sequence shards, the final norm works on them, the LM
    head gathers the sequence, is split over the vocabulary and gathers whole logits. The
    embedding's output stays a DTensor so the model's own code (positions, rotary embeddings,
    masks) still sees the whole sequence length. Without SP these stay whole on every rank.

    ``loss_parallel`` (torchtitan's default with TP): the head's logits stay split over the
    vocabulary (a DTensor sharded on its last dim) and the loss is computed on the shards under
    ``loss_parallel_context``: no rank ever holds batch x seq x the whole vocabulary."""
    return {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1),
                                              use_local_output=False),
        "model.norm": SequenceParallel(),
        "lm_head": lm_head_style(Shard(1), loss_parallel),
    }


def lm_head_style(input_layout, loss_parallel: bool) -> ParallelStyle:
    """The LM head split over the vocabulary (column-wise): whole logits gathered on every rank,
    or with ``loss_parallel`` left split for the loss."""
    if loss_parallel:
        return ColwiseParallel(input_layouts=input_layout, output_layouts=Shard(-1),
                               use_local_output=False)
    return ColwiseParallel(input_layouts=input_layout, output_layouts=Replicate())


def loss_parallel_context(model: nn.Module):
    """torch's ``loss_parallel()`` for a model whose LM head hands out vocabulary shards
    (``apply_tensor_parallel(..., loss_parallel=True)``), else nothing: the forward that computes
    the loss and its backward both run under it."""
    if not getattr(model, LOSS_PARALLEL_ATTRIBUTE, False):
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    from utilities.torch_internals import dtensor_meta_from_cache

    stack = contextlib.ExitStack()
    stack.enter_context(loss_parallel())
    stack.enter_context(dtensor_meta_from_cache())
    return stack


# -- checking and applying ---------------------------------------------------------------------

def model_family(model: nn.Module) -> str:
    """The transformers ``model_type`` of ``model`` ("" for a module without a config)."""
    return getattr(getattr(model, "config", None), "model_type", "") or ""


def check_tensor_parallel(config, tp: int, sequence_parallel: bool = True) -> None:
    """Refuse in one line a model TP cannot split: a family without a plan (T5 said by name), or
    a ``tp`` that does not divide the heads, the key/value heads, the MLP width (and, with SP,
    the vocabulary, which then splits the embedding and the head)."""
    family = getattr(config, "model_type", "")
    if family not in TP_FAMILIES:
        raise bad_value("tensor-parallel model family", family,
                        T5_REFUSAL if family == "t5" else ", ".join(TP_FAMILIES))
    sizes = {"attention heads": config.num_attention_heads,
             "key/value heads": config.num_key_value_heads,
             "intermediate size": config.intermediate_size}
    if sequence_parallel:
        sizes["vocabulary"] = config.vocab_size
    if tp < 1 or any(n % tp for n in sizes.values()):
        common = math.gcd(*sizes.values())
        divisors = [d for d in range(1, common + 1) if common % d == 0]
        what = ", ".join(f"{k} ({v})" for k, v in sizes.items())
        raise bad_value("tp", tp, f"a divisor of the model's {what}: "
                                  + ", ".join(map(str, divisors)))


def apply_tensor_parallel(model: nn.Module, block_class: type[nn.Module], tp_mesh: DeviceMesh,
                          sequence_parallel: bool = True, loss_parallel: bool = False) -> nn.Module:
    """Split every ``block_class`` of a Hugging Face Llama over ``tp_mesh`` (1-D), in place; with
    ``sequence_parallel`` also the embedding, the final norm and the head; with
    ``loss_parallel`` the head's logits stay split for the loss (run the step under
    ``loss_parallel_context(model)``). Call it before activation checkpointing and
    ``fully_shard`` (the plan's names are the block's own)."""
    config = getattr(model, "config", None)
    if config is None:
        raise bad_value("tensor-parallel model", type(model).__name__,
                        "a transformers model with a config (a plain MLP: apply_mlp_tensor_parallel)")
    check_tensor_parallel(config, tp_mesh.size(), sequence_parallel or loss_parallel)
    if sequence_parallel:
        parallelize_module(model, tp_mesh, llama_root_plan(loss_parallel))
    elif loss_parallel:
        parallelize_module(model, tp_mesh, {"lm_head": lm_head_style(Replicate(), True)})
    setattr(model, LOSS_PARALLEL_ATTRIBUTE, loss_parallel)
    for block in [m for m in model.modules() if isinstance(m, block_class)]:
        parallelize_module(block, tp_mesh, llama_block_plan(sequence_parallel))
    return model


def apply_mlp_tensor_parallel(mlp: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """Split a SwiGLU ``FeedForward`` (w1, w2, w3) over ``tp_mesh`` (1-D) in place; returns it."""
    check_mlp_tensor_parallel(mlp.w1.out_features, tp_mesh.size())
    return parallelize_module(mlp, tp_mesh, mlp_plan())


def check_mlp_tensor_parallel(hidden: int, tp: int) -> None:
    """Refuse in one line a ``tp`` that does not divide a ``FeedForward``'s hidden size."""
    if hidden % tp:
        raise bad_value("tp", tp, f"a divisor of the MLP's hidden size ({hidden})")


def causal_lm_loss(batch: dict[str, torch.Tensor]) -> Callable[[nn.Module], torch.Tensor]:
    """The loss of a causal LM on ``batch`` (input_ids, attention_mask, labels), as a function of
    the model: what ``fake_step_peak`` and a real step both call."""
    return lambda model: model(**batch).loss


def fake_step_peak(model: nn.Module, loss_of: Callable[[nn.Module], torch.Tensor],
                   device: torch.device, foreach: bool) -> dict:
    """The second of two training steps (forward, backward, AdamW step) under the lessons'
    ``MemoryProbe`` (``FSDPMemTracker`` for an FSDP2 model, ``MemTracker`` otherwise): its peak in
    the course's categories, with AdamW's state in place (the steady state ``train()`` measures).
    ``foreach``: AdamW's path (torch's default: on for CUDA tensors), which a fake step on "cpu"
    must be told. The same function measures a real step on real tensors.

    The first step is untracked and complete, forward and backward included: with TP the
    forward and backward run DTensor ops, and an op DTensor has not seen yet misses its
    sharding-propagation cache, whose propagation then runs the op at its full, unsplit size on
    the fake tensors, which the tracker would book (measured: 0.64 instead of 0.50 GB per rank
    for Lightning's MLP at tp=8, a whole 8192 x 8192 fp32 weight more)."""
    from utilities.measure.memory import MemoryProbe

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3, foreach=foreach)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=HEAD_VIEW_WARNING)
        for tracked in (False, True):
            with MemoryProbe(model, optimizer, device) if tracked else contextlib.nullcontext() as probe:
                optimizer.zero_grad(set_to_none=True)
                with loss_parallel_context(model):
                    loss_of(model).backward()
                optimizer.step()
    return probe.peak
