"""fsdp-course utilities: what the lessons share and what users import into their own training.

    from utilities import Memory_Maximizer, bf16_ready, verify_bfloat_support
    from utilities import bfSixteen, fpSixteen, fp32_policy   # the classic FSDP1 policy names
    from utilities import shard_model, apply_activation_checkpointing, fsdp2_policy, fsdp1_policy
    from utilities import save_full, load_full, save_checkpoint, load_checkpoint, find_max_batch

Every name below is imported on first use (PEP 562), not when the package is: ``fsdp-course`` and
``python -m utilities`` start without loading torch.distributed.checkpoint, transformers and the
rest that a given command does not need. ``from utilities import X`` works as it always did.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# name -> the module that defines it
_EXPORTS = {
    "apply_activation_checkpointing": "utilities.activation_checkpointing",
    "bf16_ready": "utilities.bf16",
    "Bf16Report": "utilities.bf16",
    "verify_bfloat_support": "utilities.bf16",
    "ChildTuning": "utilities.child_tuning",
    "ByteTokenizer": "utilities.data",
    "make_loader": "utilities.data",
    "ReverseTask": "utilities.data",
    "TextFileDataset": "utilities.data",
    "async_save_checkpoint": "utilities.dcp",
    "load_checkpoint": "utilities.dcp",
    "save_checkpoint": "utilities.dcp",
    "DistInfo": "utilities.distributed",
    "print0": "utilities.distributed",
    "setup": "utilities.distributed",
    "teardown": "utilities.distributed",
    "UsageError": "utilities.errors",
    "MemoryProbe": "utilities.measure",
    "find_max_batch": "utilities.measure.batch_search",
    "Memory_Maximizer": "utilities.memory_maximizer",
    "get_model_spec": "utilities.models",
    "MODELS": "utilities.models",
    "ModelSpec": "utilities.models",
    "bfSixteen": "utilities.precision",
    "bfSixteen_working": "utilities.precision",
    "default_policy": "utilities.precision",
    "fp32_policy": "utilities.precision",
    "fpSixteen": "utilities.precision",
    "fsdp1_policy": "utilities.precision",
    "fsdp2_policy": "utilities.precision",
    "POLICIES": "utilities.precision",
    "export_hf": "utilities.state_dict",
    "load_full": "utilities.state_dict",
    "save_full": "utilities.state_dict",
    "train": "utilities.training",
    "TrainStats": "utilities.training",
    "fsdp1_block_policy": "utilities.wrapping",
    "fsdp1_size_policy": "utilities.wrapping",
    "fsdp_units": "utilities.wrapping",
    "shard_model": "utilities.wrapping",
}

__all__ = [
    "POLICIES", "Bf16Report", "ByteTokenizer", "ChildTuning", "DistInfo", "MODELS",
    "Memory_Maximizer", "MemoryProbe", "ModelSpec", "ReverseTask", "TextFileDataset", "TrainStats",
    "UsageError", "apply_activation_checkpointing", "async_save_checkpoint", "bf16_ready",
    "bfSixteen", "bfSixteen_working", "fp32_policy", "fpSixteen",
    "default_policy", "export_hf", "find_max_batch", "fsdp1_block_policy", "fsdp1_policy",
    "fsdp1_size_policy", "fsdp2_policy", "fsdp_units", "get_model_spec", "load_checkpoint",
    "load_full", "make_loader", "print0", "save_checkpoint", "save_full", "setup", "shard_model",
    "teardown", "train", "verify_bfloat_support",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'utilities' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:  # what type checkers and IDEs read
    from utilities.activation_checkpointing import apply_activation_checkpointing
    from utilities.bf16 import Bf16Report, bf16_ready, verify_bfloat_support
    from utilities.child_tuning import ChildTuning
    from utilities.data import ByteTokenizer, ReverseTask, TextFileDataset, make_loader
    from utilities.dcp import async_save_checkpoint, load_checkpoint, save_checkpoint
    from utilities.distributed import DistInfo, print0, setup, teardown
    from utilities.errors import UsageError
    from utilities.measure import MemoryProbe
    from utilities.measure.batch_search import find_max_batch
    from utilities.memory_maximizer import Memory_Maximizer
    from utilities.models import MODELS, ModelSpec, get_model_spec
    from utilities.precision import (
        POLICIES,
        bfSixteen,
        bfSixteen_working,
        default_policy,
        fp32_policy,
        fpSixteen,
        fsdp1_policy,
        fsdp2_policy,
    )
    from utilities.state_dict import export_hf, load_full, save_full
    from utilities.training import TrainStats, train
    from utilities.wrapping import fsdp1_block_policy, fsdp1_size_policy, fsdp_units, shard_model
