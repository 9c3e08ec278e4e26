"""fsdp-course utilities: what the lessons share and what users import into their own training.

    from utilities import Memory_Maximizer, bf16_ready, verify_bfloat_support
    from utilities import shard_model, get_model_spec, ReverseTask, train
"""

from .bf16 import Bf16Report, bf16_ready, verify_bfloat_support
from .data import ByteTokenizer, ReverseTask, TextFileDataset, make_loader
from .distributed import DistInfo, print0, setup, teardown
from .errors import UsageError
from .measure import MemoryProbe
from .memory_maximizer import Memory_Maximizer
from .models import MODELS, ModelSpec, get_model_spec
from .training import TrainStats, train
from .wrapping import fsdp1_block_policy, fsdp1_size_policy, fsdp_units, shard_model

__all__ = [
    "Bf16Report", "ByteTokenizer", "DistInfo", "MODELS", "Memory_Maximizer", "MemoryProbe",
    "ModelSpec", "ReverseTask", "TextFileDataset", "TrainStats", "UsageError", "bf16_ready",
    "fsdp1_block_policy", "fsdp1_size_policy", "fsdp_units", "get_model_spec", "make_loader",
    "print0", "setup", "shard_model", "teardown", "train", "verify_bfloat_support",
]
