"""Sharding a model, in one place: activation checkpointing, tensor parallelism, FSDP2.

torchtitan's layout, one short function per step, each over explicit keyword arguments, called in
this order (``parallelize_model`` calls all three):

* ``apply_tp``: split each block's matrices over a 1-D TP mesh (Megatron-style, with sequence
  parallelism; the plans of ``utilities.measure.tensor_parallel``). First: the TP plan names the
  block's own submodules, which a checkpoint wrapper would rename.
* ``apply_ac``: wrap blocks in ``checkpoint_wrapper`` (block-level: every block, every n-th) or
  in op-level selective checkpointing. Before FSDP: the wrapper becomes the unit.
* ``apply_fsdp``: ``fully_shard`` each unit, then the root (embeddings, final norm, head).

The course's library shards only through these: the planner's fake step, the 2-D TP code,
``utilities.wrapping.shard_model``, lesson 10 and lesson 15's fixes. The teaching lessons keep
their own inline ``fully_shard`` calls (that is what they teach); ``tests/test_one_home.py``
fails if the library writes the loop over the blocks again anywhere else.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn

from utilities.errors import bad_value

# activation checkpointing: "selective" is op-level, as in torchtitan (keep matmul and attention
# outputs, recompute the rest); "op" is torchtitan's own save list, as it is; "every-2nd-block" is
# block-level (lesson 02's "selective")
AC_MODES = ("none", "selective", "op", "every-2nd-block", "full")


def apply_ac(model: nn.Module, *, block_class: type[nn.Module], mode: str = "full",
             every: int | None = None) -> list[nn.Module]:
    """Checkpoint the ``block_class`` blocks of ``model`` in place and return the module to shard
    for each block, in forward order (its ``CheckpointWrapper`` where it has one).

    ``mode``: one of ``AC_MODES`` (none; selective: op-level; op: op-level by torchtitan's save
    list, ``torchtitan_op_policy``; every-2nd-block; full: every block).
    ``every``: block-level instead, every ``every``-th block (0: none); it overrides ``mode``."""
    from utilities.activation_checkpointing import (
        apply_activation_checkpointing,
        apply_op_selective_checkpointing,
        block_units,
    )

    if every is None:
        if mode not in AC_MODES:
            raise bad_value("--ac", mode, AC_MODES)
        every = {"none": 0, "full": 1, "every-2nd-block": 2, "selective": None, "op": None}[mode]
    if every is None:
        apply_op_selective_checkpointing(model, block_class,
                                         policy="torchtitan" if mode == "op" else "course")
    elif every:
        apply_activation_checkpointing(model, block_class, every=every)
    return block_units(model, block_class)


def apply_tp(model: nn.Module, *, tp_mesh, block_class: type[nn.Module] | None = None,
             sequence_parallel: bool = True, loss_parallel: bool = False) -> nn.Module:
    """Tensor parallelism over the 1-D ``tp_mesh``, in place, before ``apply_ac`` and
    ``apply_fsdp``: every ``block_class`` (default: the class of a Hugging Face decoder's
    ``model.layers``) split by its family's plan (heads and MLP columns), and with
    ``sequence_parallel`` the embedding, the final norm and the head too (without it they stay
    whole on every rank). ``loss_parallel`` (torchtitan's default with TP): the head's logits stay
    split over the vocabulary for the loss; run the step under
    ``utilities.measure.tensor_parallel.loss_parallel_context(model)``."""
    from utilities.measure.tensor_parallel import apply_tensor_parallel

    if block_class is None:
        layers = getattr(getattr(model, "model", None), "layers", None)
        if not layers:
            raise bad_value("tensor-parallel model", type(model).__name__,
                            "a Hugging Face decoder (model.model.layers), or name its block_class")
        block_class = type(layers[0])
    return apply_tensor_parallel(model, block_class, tp_mesh, sequence_parallel, loss_parallel)


def apply_fsdp(model: nn.Module, *, mesh, units: Iterable[nn.Module] = (),
               **fully_shard_kwargs: Any) -> nn.Module:
    """FSDP2, in place: ``fully_shard`` each of ``units`` (one unit per block, inner ones first),
    then the root, which takes what no unit holds (embeddings, final norm, head). Every call gets
    ``mesh`` (the data-parallel mesh: 1-D, a 2-D HSDP one, or a 2-D mesh's "dp" dim) and
    ``fully_shard_kwargs`` (``mp_policy``, ``reshard_after_forward``, ``offload_policy``...).
    ``units=()``: one unit for the whole model."""
    from torch.distributed.fsdp import fully_shard

    for unit in units:
        fully_shard(unit, mesh=mesh, **fully_shard_kwargs)
    fully_shard(model, mesh=mesh, **fully_shard_kwargs)
    return model


def parallelize_model(model: nn.Module, *, block_class: type[nn.Module], mesh, ac: str = "none",
                      sequence_parallel: bool = True, loss_parallel: bool = False,
                      **fully_shard_kwargs: Any) -> nn.Module:
    """The course's whole sequence, in place: on a mesh with a "tp" dim (2-D, named ("dp",
    "tp")) ``apply_tp`` on it first; then ``apply_ac`` (``ac``: one of ``AC_MODES``), then
    ``apply_fsdp`` of each block and the root on the data-parallel mesh (the "dp" dim, or
    ``mesh`` itself) with ``fully_shard_kwargs``. What the planner's fake step traces and a real
    run of the same configuration calls."""
    names = getattr(mesh, "mesh_dim_names", None) or ()
    dp_mesh = mesh
    if "tp" in names:
        apply_tp(model, block_class=block_class, tp_mesh=mesh["tp"],
                 sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
        dp_mesh = mesh["dp"]
    units = apply_ac(model, block_class=block_class, mode=ac)
    return apply_fsdp(model, mesh=dp_mesh, units=units, **fully_shard_kwargs)
