"""Sharded checkpoints with torch.distributed.checkpoint (DCP): save, resume, check, convert.

A DCP checkpoint is a directory: one ``__R_0.distcp`` file per writing rank holding that rank's
shards, and a ``.metadata`` file that says which slice of which tensor lies at which offset of which
file. Nothing is gathered to one rank, so saving costs each rank only its own shard, and the
metadata lets a *different* number of ranks load it (resharding N -> M): each loading rank reads
exactly the slices its own shards need.

What this module adds around ``dcp.save`` / ``dcp.load``:

* the training state, not just the weights: model + optimizer through
  ``torch.distributed.checkpoint.state_dict.get_state_dict`` / ``set_state_dict`` (one API for
  FSDP2, FSDP1 and plain modules), the step and the data position (batches consumed), so a resumed
  run continues on the very batches it would have seen;
* an atomic directory: everything is written to ``.NAME.tmp`` and renamed to ``NAME`` only after
  every rank finished, so a crash never leaves a complete-looking checkpoint;
* a check before loading (``check_checkpoint``): the metadata is there and every file it names is
  there, else one ``UsageError`` line naming the missing file;
* conversion to and from one ``torch.save`` file with PyTorch's own ``format_utils``.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from .distributed import world_size
from .errors import UsageError

METADATA = ".metadata"


# -- the training state --------------------------------------------------------------------------
def training_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, step: int = 0,
                   batches_consumed: int = 0) -> dict[str, Any]:
    """The state dict DCP saves: sharded model and optimizer, plus step and data position.

    ``get_state_dict`` returns DTensors (FSDP2) or ShardedTensors (FSDP1) keyed by the parameter
    names of the *unwrapped* model, so checkpoints do not depend on which FSDP wrote them.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        state: dict[str, Any] = {"model": get_model_state_dict(model)}
    else:
        msd, osd = get_state_dict(model, optimizer)
        state = {"model": msd, "optim": osd}
    # tensors, not Python ints: DCP loads tensors in place, so the values come back in this dict
    state["trainer"] = {"step": torch.tensor(step), "batches_consumed": torch.tensor(batches_consumed)}
    return state


@dataclass
class Resumed:
    """What ``load_checkpoint`` restored besides the weights."""

    step: int
    batches_consumed: int
    seconds: float


# -- save ----------------------------------------------------------------------------------------
def _tmp_dir(path: Path) -> Path:
    return path.parent / f".{path.name}.tmp"


def _prepare(path: Path) -> Path:
    tmp = _tmp_dir(path)
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a crashed save
        tmp.mkdir(parents=True)
    _barrier()
    return tmp


def _publish(tmp: Path, path: Path) -> None:
    """Every rank has finished writing into ``tmp``: rank 0 renames it to the final name."""
    _barrier()
    if _rank() == 0:
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    _barrier()


def save_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer=None, step: int = 0,
                    batches_consumed: int = 0) -> float:
    """Save model, optimizer, step and data position with DCP into ``path``; returns seconds.

    Every rank calls it with its own shards; every rank writes its own file, in parallel.
    """
    path = Path(path)
    t0 = time.perf_counter()
    state = training_state(model, optimizer, step, batches_consumed)
    tmp = _prepare(path)
    dcp.save(state, checkpoint_id=str(tmp))
    _publish(tmp, path)
    return time.perf_counter() - t0


class PendingSave:
    """An ``async_save`` in flight: ``wait()`` finishes it and publishes the directory."""

    def __init__(self, future, tmp: Path, path: Path, started: float, blocked_s: float):
        self._future, self._tmp, self.path = future, tmp, path
        self._started, self.blocked_s = started, blocked_s
        self.total_s: float | None = None

    def wait(self) -> float:
        """Block until the files are written and renamed into place; returns total seconds."""
        if self.total_s is None:
            fut = self._future
            fut = getattr(fut, "upload_completion", fut)  # AsyncSaveResponse or plain Future
            fut.result()
            _publish(self._tmp, self.path)
            self.total_s = time.perf_counter() - self._started
        return self.total_s


def async_save_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer=None,
                          step: int = 0, batches_consumed: int = 0) -> PendingSave:
    """Like ``save_checkpoint`` but training may go on while the files are written.

    ``dcp.async_save`` first copies the state to CPU memory (the only part training waits for,
    ``blocked_s``), then writes from a background thread. Call ``wait()`` before the next save and
    before exiting; the directory only appears under its final name then.
    """
    path = Path(path)
    t0 = time.perf_counter()
    state = training_state(model, optimizer, step, batches_consumed)
    tmp = _prepare(path)
    future = dcp.async_save(state, checkpoint_id=str(tmp))
    return PendingSave(future, tmp, path, t0, time.perf_counter() - t0)


# -- check and load ------------------------------------------------------------------------------
def checkpoint_files(path: str | os.PathLike) -> list[str]:
    """The data files the metadata says the checkpoint is made of (relative names, sorted)."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(path)).read_metadata()
    files = {info.relative_path for info in (metadata.storage_data or {}).values()}
    return sorted(files)


def check_checkpoint(path: str | os.PathLike) -> Path:
    """Refuse, in one line, a directory that is not a complete DCP checkpoint."""
    p = Path(path)
    if not p.is_dir():
        if _tmp_dir(p).is_dir():
            raise UsageError(f"checkpoint {str(p)!r} was never completed (only {_tmp_dir(p).name} "
                             "exists: the save did not finish)")
        raise UsageError(f"checkpoint {str(p)!r} does not exist or is not a directory")
    if not (p / METADATA).is_file():
        raise UsageError(f"checkpoint {str(p)!r} has no {METADATA} file: not a complete DCP "
                         "checkpoint")
    try:
        files = checkpoint_files(p)
    except Exception as e:  # noqa: BLE001 - a damaged metadata file, in one line
        raise UsageError(f"checkpoint {str(p)!r}: cannot read {METADATA} "
                         f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    missing = [f for f in files if not (p / f).is_file()]
    if missing:
        raise UsageError(f"checkpoint {str(p)!r} is missing {missing[0]} (listed in {METADATA}; "
                         f"{len(missing)} of {len(files)} data files missing)")
    return p


def load_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer=None) -> Resumed:
    """Load a DCP checkpoint into an already sharded model (and optimizer), any world size.

    The target state dict is built from *this* run's shards; DCP reads, from whichever files hold
    them, exactly the slices those shards cover, then ``set_state_dict`` puts them in place.
    """
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    p = check_checkpoint(path)
    t0 = time.perf_counter()
    state = training_state(model, optimizer)
    if optimizer is None:
        state.pop("optim", None)
    dcp.load(state, checkpoint_id=str(p))
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
    trainer = state["trainer"]
    return Resumed(int(trainer["step"]), int(trainer["batches_consumed"]), time.perf_counter() - t0)


# -- layout and conversion -----------------------------------------------------------------------
def layout(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Every file of a checkpoint directory with its size in bytes (metadata included)."""
    p = Path(path)
    return [{"file": f.name, "bytes": f.stat().st_size}
            for f in sorted(p.iterdir()) if f.is_file()]


def to_torch_save(dcp_dir: str | os.PathLike, file: str | os.PathLike) -> Path:
    """One ``torch.save`` file holding the full (unsharded) tensors; no process group needed."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    check_checkpoint(dcp_dir)
    Path(file).parent.mkdir(parents=True, exist_ok=True)
    dcp_to_torch_save(str(dcp_dir), str(file))
    return Path(file)


def from_torch_save(file: str | os.PathLike, dcp_dir: str | os.PathLike) -> Path:
    """A DCP directory (one file, one writer) from a ``torch.save`` file; any world size loads it."""
    from torch.distributed.checkpoint.format_utils import torch_save_to_dcp

    if not Path(file).is_file():
        raise UsageError(f"torch.save file {str(file)!r} does not exist")
    torch_save_to_dcp(str(file), str(dcp_dir))
    return Path(dcp_dir)


# -- FSDP1's own state dict types, for comparison --------------------------------------------------
def fsdp1_state_dict(model: nn.Module, kind: str = "local") -> dict[str, Any]:
    """FSDP1's ``LOCAL_STATE_DICT`` or ``SHARDED_STATE_DICT`` through ``FSDP.state_dict_type``.

    ``local``: each rank's *flat* shard (``flat_param`` as a ShardedTensor): padded, flattened, and
    only meaningful to a model wrapped the same way on the same number of ranks. ``sharded``:
    per-parameter ShardedTensors that DCP can reshard. The context manager is deprecated in favour
    of ``torch.distributed.checkpoint.state_dict`` (what ``training_state`` uses).
    """
    import warnings

    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    kinds = {"local": StateDictType.LOCAL_STATE_DICT, "sharded": StateDictType.SHARDED_STATE_DICT}
    if kind not in kinds:
        raise UsageError(f"state dict kind {kind!r} is not allowed; allowed: {', '.join(kinds)}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the deprecation notice, once per call
        with FSDP.state_dict_type(model, kinds[kind]):
            return model.state_dict()


def load_fsdp1_local(model: nn.Module, path: str | os.PathLike) -> None:
    """Load a ``LOCAL_STATE_DICT`` file (``fsdp1_state_dict(model, "local")`` + ``torch.save``)
    into an FSDP1 model. It only works for the same wrapping on the same number of ranks: anything
    else is a one-line UsageError saying what did not match (the flat shards cannot be resharded).

    ``weights_only=False``: a local state dict holds ShardedTensors, which the safe unpickler
    refuses; load only files you wrote yourself.
    """
    import warnings

    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
                model.load_state_dict(state)
    except (RuntimeError, ValueError, KeyError) as e:
        reason = " ".join(str(e).split())[:200]
        raise UsageError(f"local state dict {path} does not fit this model and world size "
                         f"({world_size()} rank(s)): {reason}") from None


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
