"""fsdp-course utilities: what the lessons share and what users import into their own training.

    from utilities import Memory_Maximizer, bf16_ready, verify_bfloat_support
    from utilities import bfSixteen, fpSixteen, fp32_policy   # the classic FSDP1 policy names
    from utilities import shard_model, apply_activation_checkpointing, fsdp2_policy, fsdp1_policy
    from utilities import save_full, load_full, save_checkpoint, load_checkpoint, find_max_batch

Every name below is imported on first use (PEP 562), not when the package is: ``fsdp-course`` and
``python -m utilities`` start without loading torch.distributed.checkpoint, transformers and the
rest that a given command does not need. ``from utilities import X`` works as it always did.
``_MODULES`` is the one list of what is exported, and where each name lives.
"""

from __future__ import annotations

import importlib
from typing import Any

# the module that defines each name: the one list of what `utilities` exports
_MODULES = {
    "utilities.activation_checkpointing": ("apply_activation_checkpointing",),
    "utilities.bf16": ("bf16_ready", "Bf16Report", "verify_bfloat_support",),
    "utilities.child_tuning": ("ChildTuning",),
    "utilities.data": ("ByteTokenizer", "make_loader", "ReverseTask", "TextFileDataset",),
    "utilities.dcp": ("async_save_checkpoint", "load_checkpoint", "save_checkpoint",),
    "utilities.distributed": ("DistInfo", "print0", "setup", "teardown",),
    "utilities.errors": ("UsageError",),
    "utilities.measure": ("MemoryProbe",),
    "utilities.measure.batch_search": ("find_max_batch",),
    "utilities.memory_maximizer": ("Memory_Maximizer",),
    "utilities.models": ("custom_model_spec", "get_model_spec", "MODELS", "ModelSpec",),
    "utilities.precision": (
        "bfSixteen", "bfSixteen_working", "default_policy", "fp32_policy", "fpSixteen", "fsdp1_policy",
        "fsdp2_policy", "POLICIES",
    ),
    "utilities.state_dict": ("export_hf", "load_full", "save_full",),
    "utilities.training": ("train", "TrainStats",),
    "utilities.wrapping": ("fsdp1_block_policy", "fsdp1_meta_init", "fsdp1_size_policy", "fsdp_units",
                           "shard_model",),
}
_EXPORTS = {name: module for module, names in _MODULES.items() for name in names}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'utilities' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
