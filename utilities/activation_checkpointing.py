"""Activation checkpointing for FSDP models: keep a block's input, recompute its inside in backward.

Without checkpointing, autograd keeps every intermediate tensor of every block (attention scores,
MLP hidden states, norms...) from the forward until the backward uses it. A checkpointed block keeps
only its *input*; in backward it runs its forward once more to rebuild the intermediates, then
frees them again. Activation memory goes from "all blocks' insides" to "all blocks' inputs plus one
block's insides", at the price of one extra forward per checkpointed block.

The two FSDP APIs want it applied at different moments:

* FSDP2 (``fully_shard``): wrap the blocks with ``checkpoint_wrapper`` *before* sharding, then
  ``fully_shard`` the outermost module of each block (the wrapper where there is one), see
  ``block_units``.
* FSDP1 (``FullyShardedDataParallel``): wrap with FSDP first, *then* call
  ``apply_activation_checkpointing`` on the FSDP model; it swaps each selected block (inside its
  FSDP unit) for a ``CheckpointWrapper``.

We always use ``CheckpointImpl.NO_REENTRANT`` (``torch.utils.checkpoint(use_reentrant=False)``):
the reentrant form needs inputs that require grad, breaks with keyword arguments and is deprecated.
Old tutorials also passed ``offload_to_cpu=False`` to ``checkpoint_wrapper``; that argument no
longer exists: it is now forwarded to the wrapped module, and the first forward fails with
``TypeError: ...forward() got an unexpected keyword argument 'offload_to_cpu'`` (offloading is a
separate ``offload_wrapper``).
"""

from __future__ import annotations

import functools

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    CheckpointWrapper,
    checkpoint_wrapper,
)
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    apply_activation_checkpointing as _torch_apply_ac,
)

from utilities.errors import bad_value

__all__ = ["apply_activation_checkpointing", "apply_op_selective_checkpointing", "block_units",
           "checkpointed_blocks", "checkpointing_of", "select_blocks", "torchtitan_op_policy",
           "CheckpointWrapper"]


def _blocks(model: nn.Module, block_class: type[nn.Module]) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, block_class)]


def select_blocks(model: nn.Module, block_class: type[nn.Module], every: int = 1) -> list[nn.Module]:
    """The blocks to checkpoint: every ``every``-th instance of ``block_class`` in module order
    (the 1st, the (1+every)-th, ...). ``every=1`` is all of them; ``every=2`` is half ("selective")."""
    if every < 1:
        raise bad_value("--every", every, "integers >= 1")
    return _blocks(model, block_class)[::every]


def apply_activation_checkpointing(model: nn.Module, block_class: type[nn.Module], every: int = 1,
                                   api: str = "fsdp2") -> int:
    """Checkpoint every ``every``-th ``block_class`` of ``model`` in place; return how many.

    ``api="fsdp2"``: call on the plain model *before* ``fully_shard`` (then shard ``block_units``).
    ``api="fsdp1"``: call on the model *after* wrapping it in ``FullyShardedDataParallel``.
    """
    chosen = {id(m) for m in select_blocks(model, block_class, every)}
    wrapper = functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    if api == "fsdp1":
        _torch_apply_ac(model, checkpoint_wrapper_fn=wrapper, check_fn=lambda m: id(m) in chosen)
    elif api == "fsdp2":
        _replace_children(model, chosen, wrapper)
    else:
        raise bad_value("--api", api, ("fsdp2", "fsdp1"))
    return checkpointed_blocks(model)


def matmul_saving_policy(adapter_ranks: frozenset[int] = frozenset()):
    """A fresh op-level policy for one block's forward: keep the outputs of the expensive ops
    (matrix multiplications and attention) and recompute the cheap ones (norms, activations,
    elementwise) in backward, but recompute every second matmul, so the saved activations are
    about half the matmul outputs. This is what torchtitan's "selective" (op) checkpointing does;
    the course's lesson 02 "selective" is block-level (every second block whole).

    ``adapter_ranks``: the ranks of LoRA adapters in the block. A LoRA Linear runs three matmuls
    (the frozen weight's, then ``x A^T`` and ``(x A^T) B^T``): the adapter's two are not counted
    as matmuls of their own (else a Linear's two full-width outputs would both be kept, more than
    full fine-tuning keeps): ``x A^T`` (rank wide) is kept, ``(x A^T) B^T`` recomputed from it."""
    import torch
    from torch.utils.checkpoint import CheckpointPolicy

    aten = torch.ops.aten
    matmuls = {aten.mm.default, aten.addmm.default, aten.bmm.default}
    attention = {getattr(aten, name).default for name in (
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
        if hasattr(aten, name)}
    seen = {"forward": 0, "recompute": 0}

    def policy(ctx, op, *args, **kwargs):
        if op in attention:
            return CheckpointPolicy.MUST_SAVE
        if op in matmuls and adapter_ranks:
            a, b = args[-2], args[-1]  # addmm's bias comes first
            if b.shape[-1] in adapter_ranks:
                return CheckpointPolicy.MUST_SAVE  # x A^T: the adapter's narrow output
            if a.shape[-1] in adapter_ranks:
                return CheckpointPolicy.PREFER_RECOMPUTE  # (x A^T) B^T, cheap from x A^T
        if op in matmuls:
            phase = "recompute" if ctx.is_recompute else "forward"
            seen[phase] += 1
            return (CheckpointPolicy.MUST_SAVE if seen[phase] % 2 else CheckpointPolicy.PREFER_RECOMPUTE)
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def torchtitan_op_policy():
    """A fresh policy for one block's forward, torchtitan's op-level selective checkpointing as
    its published Llama 3 runs (``llama3_h100_202412``) applied it: ``_save_list`` and
    ``_custom_policy`` in torchtitan/parallelisms/parallelize_llama.py (December 2024). The
    outputs of the ops in its save list are kept, every other op is recomputed in backward:
    ``aten.mm`` (but not every second one of the block, counted again in the recomputation),
    flash and memory-efficient attention, the functional reduce-scatter (sequence parallelism's,
    under TP) and ``abs`` and ``max`` (Float8's scales). ``addmm``, ``bmm`` and cuDNN attention
    are not in it: recomputed. On a machine without a GPU the fake step's attention is CPU
    flash attention, CUDA flash attention's stand-in, and is kept as it."""
    import torch
    from torch.utils.checkpoint import CheckpointPolicy

    ops = torch.ops
    save = {ops.aten.mm.default, ops.aten.abs.default, ops.aten.max.default,
            ops._c10d_functional.reduce_scatter_tensor.default}
    save |= {getattr(ops.aten, name).default for name in (
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu") if hasattr(ops.aten, name)}
    mm_count = {"forward": 0, "recompute": 0}

    def policy(ctx, op, *args, **kwargs):
        phase = "recompute" if ctx.is_recompute else "forward"
        if op == ops.aten.mm.default:
            mm_count[phase] += 1
        keep = op in save and not (op == ops.aten.mm.default and mm_count[phase] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def apply_op_selective_checkpointing(model: nn.Module, block_class: type[nn.Module],
                                     policy: str = "course") -> int:
    """Op-level selective checkpointing of every ``block_class`` (FSDP2: before ``fully_shard``):
    each block saves what its policy keeps and recomputes the rest. ``policy``: "course"
    (``matmul_saving_policy``, which knows LoRA adapters) or "torchtitan"
    (``torchtitan_op_policy``, its save list as it is)."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    if policy not in ("course", "torchtitan"):
        raise bad_value("policy", policy, ("course", "torchtitan"))
    ranks = frozenset(m.lora_a.shape[0] for m in model.modules()
                      if isinstance(getattr(m, "lora_a", None), nn.Parameter))

    def contexts():
        chosen = torchtitan_op_policy() if policy == "torchtitan" else matmul_saving_policy(ranks)
        return create_selective_checkpoint_contexts(chosen)

    chosen = {id(m) for m in _blocks(model, block_class)}
    wrapper = functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                                context_fn=contexts)
    _replace_children(model, chosen, wrapper)
    return checkpointed_blocks(model)


def _replace_children(module: nn.Module, chosen: set[int], wrapper) -> None:
    for name, child in module.named_children():
        if id(child) in chosen:
            setattr(module, name, wrapper(child))
        else:
            _replace_children(child, chosen, wrapper)


def checkpointed_blocks(model: nn.Module) -> int:
    """How many modules of ``model`` run under a ``CheckpointWrapper``."""
    return sum(isinstance(m, CheckpointWrapper) for m in model.modules())


def checkpointing_of(model: nn.Module, block_class: type[nn.Module]) -> str:
    """How ``model``'s ``block_class`` blocks are checkpointed, read from their wrappers, as
    ``parallelize.AC_MODES`` names it: "none", "selective" (op-level: every block's wrapper runs a
    selective context, the course's policy or torchtitan's), "full" (every block whole),
    "every-2nd-block" (the 1st, 3rd, ...); any other pattern as "N of M blocks"."""
    wrappers = {id(m._checkpoint_wrapped_module): m for m in model.modules()
                if isinstance(m, CheckpointWrapper)}
    blocks = _blocks(model, block_class)
    wrapped = [i for i, b in enumerate(blocks) if id(b) in wrappers]
    op_level = [i for i in wrapped if "context_fn" in getattr(
        wrappers[id(blocks[i])].checkpoint_fn, "keywords", {})]
    if not wrapped:
        return "none"
    if len(op_level) == len(wrapped) == len(blocks):
        return "selective"
    if not op_level and len(wrapped) == len(blocks):
        return "full"
    if not op_level and wrapped == list(range(0, len(blocks), 2)):
        return "every-2nd-block"
    return f"{len(wrapped)} of {len(blocks)} blocks" + (" (op-level)" if op_level else "")


def block_units(model: nn.Module, block_class: type[nn.Module]) -> list[nn.Module]:
    """The module to ``fully_shard`` for each block: its ``CheckpointWrapper`` if it has one, else
    the block itself (so a wrapped block is sharded from the outside, as one unit)."""
    inside = {id(m._checkpoint_wrapped_module) for m in model.modules()
              if isinstance(m, CheckpointWrapper)}
    units = []
    for m in model.modules():
        if isinstance(m, CheckpointWrapper) and isinstance(m._checkpoint_wrapped_module, block_class):
            units.append(m)
        elif isinstance(m, block_class) and id(m) not in inside:
            units.append(m)
    return units
