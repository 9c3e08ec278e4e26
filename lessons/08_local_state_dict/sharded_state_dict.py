"""Lesson 08: local / sharded state dict and distributed checkpoint (DCP).

A full state dict (lesson 03) gathers every weight on rank 0 and writes one file: simple, but rank
0 must hold the whole model and the other ranks wait. A *sharded* checkpoint lets every rank write
its own shard, in parallel, plus metadata describing where each slice of each tensor lies, so any
number of ranks can load it later. ``torch.distributed.checkpoint`` (DCP) is PyTorch's way to do
it, for FSDP2 and FSDP1 alike. FSDP1's older ``LOCAL_STATE_DICT`` saves each rank's flat shard as
is: fast, but only the same wrapping on the same world size can ever read it.

This script (default mode):

* trains the model k steps with FSDP2, saves model + optimizer + step + data position with DCP,
  reports the files and bytes per rank, the save time, the load time and the ``async_save`` time
  (how long training is blocked vs. until the files are on disk);
* converts the checkpoint to one ``torch.save`` file and back (``format_utils``);
* trains the same model with FSDP1 and saves its ``LOCAL_STATE_DICT`` (one flat shard per rank),
  its ``SHARDED_STATE_DICT`` with DCP, and DCP through ``get_state_dict``, for comparison;
* checks resumption: train k, save, load into a fresh model, train k more == 2k uninterrupted.

``--load-from DIR`` instead loads a checkpoint written by any world size, reports its outputs on a
fixed batch (``outputs_loaded.pt``) and re-saves it from this world size (``checkpoint``).

Run: fsdp-course run 08 [--quick] [--nproc N] [-- --load-from runs/08_local_state_dict/checkpoint]
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without install

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from state_dict_run import run_parts, takeaway
from torch import nn
from torch.distributed.checkpoint.state_dict import set_state_dict
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from utilities.course.lesson import Lesson, lesson_parser
from utilities.dcp import (
    check_checkpoint,
    dcp_load,
    dcp_save,
    fsdp1_state_dict,
    prepare_save,
    publish_save,
    trainer_position,
    training_state,
)
from utilities.errors import UsageError
from utilities.safe_files import atomic_torch_save


# -- the code this lesson teaches -----------------------------------------------------------------
def save_sharded(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer,
                 step: int, batches_consumed: int) -> None:
    """Every rank writes its own shards (``__R_0.distcp``), in parallel; ``.metadata`` comes last.

    Written into ``.NAME.tmp`` and renamed to ``NAME`` once every rank is done (``utilities.dcp``'s
    publish keeps the previous checkpoint until then), so a crash never leaves a half-written one.
    """
    tmp = prepare_save(Path(path))
    # utilities.dcp.training_state: get_state_dict's shards of model and optimizer, plus the step and
    # the data position as tensors (dcp.load fills the given dict in place)
    # dcp.save(state, checkpoint_id=tmp), with a failure (a full disk) in one line, tmp removed
    dcp_save(training_state(model, optimizer, step, batches_consumed), tmp)
    publish_save(tmp, Path(path))


def async_save_sharded(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer,
                       step: int, batches_consumed: int) -> Callable[[], None]:
    """``dcp.async_save``: training waits only while the state is copied to CPU memory, then a
    background thread writes the files. Call the returned ``finish()`` before the next save and
    before exiting: it waits for the files, then publishes the directory."""
    tmp = prepare_save(Path(path))
    future = dcp.async_save(training_state(model, optimizer, step, batches_consumed),
                            checkpoint_id=str(tmp))

    def finish() -> None:
        future.result()
        publish_save(tmp, Path(path))

    return finish


def load_sharded(path: str | os.PathLike, model: nn.Module,
                 optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """Load into an already sharded model and optimizer, on any number of ranks; returns (step,
    batches consumed).

    The target is built from *this* run's shards; ``dcp.load`` reads exactly the slices they cover,
    from whichever files hold them, and ``set_state_dict`` puts them in place. ``dcp_load`` is
    ``dcp.load`` with the checks of ``utilities.dcp``: PyTorch's own reader unpickles ``.metadata``
    and the non-tensor entries with plain ``pickle``, so a file planted in the folder could run code.
    """
    state = training_state(model, optimizer)
    dcp_load(state, path)  # dcp.load(state, checkpoint_id=str(path)), read safely
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return trainer_position(state, path)  # the two counters, checked: integers in range


def save_fsdp1_local(directory: str | os.PathLike, model: FSDP) -> tuple[Path, int]:
    """``LOCAL_STATE_DICT`` + ``torch.save``: every rank writes its flat shards to its own file,
    named by its rank and the world size it is bound to; returns the file and its flat shards."""
    path = Path(directory) / f"rank{dist.get_rank()}_of_{dist.get_world_size()}.pt"
    local = fsdp1_state_dict(model, "local")  # FSDP.state_dict_type(model, LOCAL_STATE_DICT)
    atomic_torch_save(local, path)  # torch.save through a synced temporary file and a rename
    return path, sum(1 for key in local if key.endswith("flat_param"))


def save_fsdp1_sharded(path: str | os.PathLike, model: FSDP) -> None:
    """``SHARDED_STATE_DICT`` + ``dcp.save`` (model only): reshardable, like ``save_sharded``'s, and
    published like it: written into ``.NAME.tmp``, renamed over ``NAME`` once complete, so a rerun
    killed mid-save still leaves the previous folder (deleting it first would not)."""
    tmp = prepare_save(Path(path))
    dcp_save({"model": fsdp1_state_dict(model, "sharded")}, tmp)  # SHARDED_STATE_DICT
    publish_save(tmp, Path(path))


# -- the lesson run -------------------------------------------------------------------------------
def main(args: argparse.Namespace) -> None:
    with Lesson("08", args, takeaway=takeaway) as lesson:
        run_parts(lesson, args, SimpleNamespace(**globals()))  # the saves and loads above, measured


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = lesson_parser(__doc__)
    parser.add_argument("--load-from", default=None, metavar="DIR",
                        help="load this DCP checkpoint (written by any world size) instead of training")
    parser.add_argument("--skip-resume-check", action="store_true",
                        help="default mode: skip the train k / save / resume k == 2k check")
    args = parser.parse(argv)
    if args.load_from is not None:
        try:
            check_checkpoint(args.load_from)  # before torchrun starts: a bad directory, one line
        except UsageError as e:
            parser.exit(2, f"error: {e}\n")
    return args


if __name__ == "__main__":
    main(parse_args())
