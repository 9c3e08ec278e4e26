"""Lesson 03: full state dict save and load.

A full state dict is the sharded model gathered back into ordinary whole tensors, on rank 0's CPU,
in one file: readable by any world size, by FSDP1 or FSDP2, and (exported) by plain transformers.

For each variant this script trains a few steps, saves model + optimizer + step as one full
checkpoint, loads it into a freshly built and sharded model and a fresh optimizer, and checks:

    outputs      the loaded model's logits equal the trained model's (max abs diff)
    next step    one more training step gives the same loss and the same updated weights, so the
                 optimizer state (AdamW moments and step count) came back too
    HF export    transformers' from_pretrained on the exported folder gives the same logits

    fsdp2          fully_shard + get_model_state_dict / get_optimizer_state_dict (full_state_dict)
    fsdp1          FullyShardedDataParallel + the same calls
    fsdp1-classic  FullyShardedDataParallel + FSDP.state_dict_type(FULL_STATE_DICT, rank0_only)

Run: fsdp-course run 03 [--quick]   or   torchrun --nproc-per-node 2 full_state_dict.py --device cpu
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without install

from full_state_dict_run import round_trips

from utilities.course.lesson import Lesson, lesson_parser
from utilities.distributed import fail_together
from utilities.state_dict import FORMAT, read_on_rank0

StateDicts = tuple[dict[str, Any], dict[str, Any]]  # (model, optimizer)


# -- the code this lesson teaches -----------------------------------------------------------------
def offload_to_cpu(model: nn.Module) -> bool:
    """Offload each gathered tensor to CPU only from a GPU, so GPU memory never holds the whole
    model. On a CPU-resident FSDP1 model "offloading" is a no-op that hands back views into the
    gathered flat parameter, which FSDP frees as soon as the gather ends (torch 2.13: "setStorage
    ... storage of size 0", or a hang in the classic path)."""
    return any(p.device.type == "cuda" for p in model.parameters())


def gather_full_state(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> StateDicts:
    """FSDP2, and FSDP1 through the same API: whole tensors under the original parameter names.

    Every rank must call it: each tensor is all-gathered. With ``cpu_offload`` each one goes to
    rank 0's CPU as it arrives and the other ranks get ``{}``, so the host holds one copy, not N.
    """
    options = StateDictOptions(full_state_dict=True, cpu_offload=offload_to_cpu(model))
    model_sd = get_model_state_dict(model, options=options)
    optim_sd = {} if optimizer is None else get_optimizer_state_dict(model, optimizer, options=options)
    return model_sd, optim_sd


def gather_full_state_fsdp1_classic(model: nn.Module,
                                    optimizer: torch.optim.Optimizer | None = None) -> StateDicts:
    """FSDP1's own way, deprecated in favour of ``gather_full_state`` (it writes the same keys, so
    either file loads the same): inside ``FULL_STATE_DICT``, ``state_dict()`` and ``optim_state_dict``
    gather, and ``rank0_only`` leaves the other ranks nothing."""
    if not isinstance(model, FSDP):
        raise TypeError("the FSDP1 classic full state dict needs a FullyShardedDataParallel model")
    offload = offload_to_cpu(model)
    with warnings.catch_warnings():  # the deprecation notice, once per call, on every rank
        warnings.filterwarnings("ignore", message=r"FSDP\.state_dict_type", category=FutureWarning)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(offload_to_cpu=offload, rank0_only=True),
                                  FullOptimStateDictConfig(offload_to_cpu=offload, rank0_only=True)):
            model_sd = model.state_dict()
            optim_sd = {} if optimizer is None else FSDP.optim_state_dict(model, optimizer)
    return (model_sd, optim_sd) if dist.get_rank() == 0 else ({}, {})


def save_on_rank0(path: str | os.PathLike, model_sd: dict[str, Any], optim_sd: dict[str, Any],
                  step: int) -> int:
    """Rank 0 writes one ``torch.save`` file; returns its size on every rank.

    It writes to a temporary file of its own in the same directory (``mkstemp``: a unique name, so
    two saves never write into one temporary), flushes it to disk, and renames it over ``path``
    (``os.replace`` is atomic), so a crash mid-write leaves the previous checkpoint whole. Two runs
    saving into one folder would still overwrite each other's files: ``main`` locks the folder.

    Only rank 0 writes, so only rank 0 can fail (a full disk, a folder it may not write): the other
    ranks would wait for its answer for ever. ``fail_together`` shares the outcome, and every rank
    raises the same one-line error.
    """
    path, size = Path(path), [0]
    with fail_together(f"saving {path}"):
        if dist.get_rank() == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
            tmp = Path(name)
            try:
                with os.fdopen(fd, "wb") as f:
                    torch.save({"format": FORMAT, "step": step, "model": model_sd,
                                "optimizer": optim_sd}, f)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)
            size = [path.stat().st_size]
    dist.broadcast_object_list(size, src=0)
    return size[0]


def save_full_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer,
                         step: int, gather: Callable[..., StateDicts] = gather_full_state) -> int:
    """Every rank gathers, rank 0 writes: the whole save, model + optimizer + step."""
    return save_on_rank0(path, *gather(model, optimizer), step)


def load_full_checkpoint(path: str | os.PathLike, model: nn.Module,
                         optimizer: torch.optim.Optimizer) -> int:
    """Load a full checkpoint into an already sharded model and optimizer; returns the step.

    Every rank calls it. Rank 0 alone reads the file (``weights_only``, its keys and shapes checked
    against the model: a wrong file is one line on every rank, never a partial load); then
    ``broadcast_from_rank0`` sends each rank its own shard of every tensor.
    """
    step, model_sd, optim_sd = read_on_rank0(path, model, optimizer)  # {} on ranks > 0
    # FSDP1 keeps a tied weight once, so read_on_rank0 dropped the alias keys: not strict there
    fsdp1 = isinstance(model, FSDP)
    options = StateDictOptions(full_state_dict=True, cpu_offload=offload_to_cpu(model),
                               broadcast_from_rank0=True, strict=not fsdp1)
    # Two calls, not set_state_dict: given an empty model dict (ranks > 0), set_state_dict treats
    # the call as optimizer-only and skips the model broadcast, and rank 0 waits forever.
    set_model_state_dict(model, model_sd, options=options)
    set_optimizer_state_dict(model, optimizer, optim_sd, options=options)
    return step


GATHER = {"dcp": gather_full_state, "fsdp1-classic": gather_full_state_fsdp1_classic}
VARIANTS = {"fsdp2": ("fsdp2", "dcp"), "fsdp1": ("fsdp1", "dcp"),  # name: (api, GATHER key)
            "fsdp1-classic": ("fsdp1", "fsdp1-classic")}


# -- the lesson run -------------------------------------------------------------------------------
NOTE = ("checkpoint_bytes: model + AdamW state + step in one torch.save file, written by rank 0 only "
        "(the other ranks hold nothing).")
CPU_NOTE = ("On CPU, nothing is offloaded (offload_to_cpu / cpu_offload=False): for an FSDP1 model "
            "already on CPU, offloading returns views of freed gather buffers in torch 2.13. Save/load "
            "times on CPU with gloo are small and only indicative; on GPUs the gather and the "
            "device-to-host copies dominate.")


def takeaway(results: dict) -> str:
    """The lesson's point, from what the run measured (printed last)."""
    exact = all(v.get("outputs_identical") and v.get("next_step_identical") for v in results["variants"])
    return (f"full state dict: {'every' if exact else 'NOT every'} reload gives identical outputs and "
            f"an identical next step ({', '.join(v['name'] for v in results['variants'])})")


def main(args: argparse.Namespace) -> None:
    with Lesson("03", args, notes=(NOTE,), cpu_note=CPU_NOTE, takeaway=takeaway) as lesson:
        round_trips(lesson, args, SimpleNamespace(**globals()))  # the save and load above, measured


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = lesson_parser(__doc__)
    parser.add_variants(VARIANTS)
    parser.add_argument("--checkpoint-dir", default=None,
                        help="where checkpoints and HF exports go (default: OUT/checkpoints)")
    parser.add_argument("--no-export", action="store_true", help="skip the Hugging Face export check")
    return parser.parse(argv)


if __name__ == "__main__":
    main(parse_args())
