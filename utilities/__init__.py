"""fsdp-course utilities: what the lessons share and what users import into their own training.

    from utilities import Memory_Maximizer, bf16_ready, verify_bfloat_support
    from utilities import bfSixteen, fpSixteen, fp32_policy   # the classic FSDP1 policy names
    from utilities import shard_model, apply_activation_checkpointing, fsdp2_policy, fsdp1_policy
    from utilities import save_full, load_full, save_checkpoint, load_checkpoint, find_max_batch
"""

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
