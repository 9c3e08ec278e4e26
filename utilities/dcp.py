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
* a crash-safe publish: everything is written to ``.NAME.tmp``; once every rank finished, the old
  ``NAME`` (if any) is renamed to ``.NAME.old``, ``.NAME.tmp`` to ``NAME``, then ``.NAME.old`` is
  deleted. A kill between any two of these steps leaves at least one complete checkpoint, and
  ``resolve_checkpoint`` finds the newest complete one deterministically (see there);
* a check before loading (``check_checkpoint``): the metadata is there and every file it names is
  there, else one ``UsageError`` line naming the missing file;
* no code runs from a checkpoint. DCP's ``.metadata`` is a pickle that PyTorch reads with a plain
  ``pickle.load``, and DCP reads non-tensor entries (optimizer hyper-parameters, step counters) with
  ``torch.load(weights_only=False)``: either can run any function a crafted file names. We read the
  metadata first with an unpickler that admits only DCP's own metadata classes, check every
  non-tensor entry with ``weights_only=True``, and only then let DCP at the directory. This goes
  beyond what PyTorch itself does;
* conversion to and from one ``torch.save`` file with PyTorch's own ``format_utils``.
"""

from __future__ import annotations

import io
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from utilities.dcp_metadata import METADATA, check_bytes_entries, read_metadata, safe_planner, safe_reader
from utilities.distributed import fail_together, world_size
from utilities.errors import UsageError
from utilities.owned_paths import folder_state
from utilities.restricted_unpickler import enum_member
from utilities.safe_files import (
    atomic_torch_save,
    previous_path,
    remove_path,
    staging_path,
    swap_in,
)
from utilities.torch_zip import safe_torch_load


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


# -- save: write to .NAME.tmp, publish by renames that never lose a complete checkpoint -----------
def prepare_save(path: Path) -> Path:
    """Every rank calls it before writing ``path``: rank 0 recovers what a killed earlier save of
    ``path`` left, then makes an empty ``.NAME.tmp``; returns it (write there, then ``publish_save``)."""
    tmp = staging_path(path)
    with fail_together(f"preparing {tmp}"):  # also the barrier: rank 0 failing stops every rank
        if _rank() == 0:
            recover_checkpoint(path)  # first finish or undo what a killed earlier save left
            _check_replaceable(path)
            remove_path(tmp)  # an unfinished save's leftovers, or a file planted in its place
            tmp.mkdir(parents=True)
    return tmp


def _check_replaceable(path: Path) -> None:
    """Refuse, in one line, to save over anything at ``path`` but a DCP checkpoint or an empty
    folder (``owned_paths.folder_state``): the save replaces what is there whole."""
    state = folder_state(path, METADATA)
    if state not in ("missing", "empty", "marked"):
        kind = {"link": "a symbolic link", "file": "a file"}.get(state, "a folder of other files")
        raise UsageError(f"checkpoint {str(path)!r} is {kind}, not a DCP checkpoint: not replaced; "
                         "allowed: a new or empty folder, or a checkpoint the course saved")


def publish_save(tmp: Path, path: Path) -> None:
    """Every rank has finished writing into ``tmp``: rank 0 swaps it in (``swap_in``)."""
    _barrier()
    with fail_together(f"publishing {path}"):  # also the barrier after the swap
        if _rank() == 0:
            swap_in(tmp, path)


def save_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer=None, step: int = 0,
                    batches_consumed: int = 0) -> float:
    """Save model, optimizer, step and data position with DCP into ``path``; returns seconds.

    Every rank calls it with its own shards; every rank writes its own file, in parallel.
    """
    path = Path(path)
    t0 = time.perf_counter()
    state = training_state(model, optimizer, step, batches_consumed)
    tmp = prepare_save(path)
    dcp_save(state, tmp)
    publish_save(tmp, path)
    return time.perf_counter() - t0


def dcp_save(state: dict[str, Any], tmp: Path) -> None:
    """``dcp.save(state, checkpoint_id=tmp)`` (``tmp`` from ``prepare_save``), where a failure (a
    full disk, a folder gone) is one ``UsageError`` line on every rank, not DCP's exception with
    every rank's traceback (DCP raises it on every rank). Rank 0 then removes the unfinished
    ``tmp``; the published checkpoint was never touched."""
    try:
        dcp.save(state, checkpoint_id=str(tmp))
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        _save_failed(e, tmp)


def _save_failed(exc: BaseException, tmp: Path) -> None:
    """Raise ``exc`` of a save into ``tmp`` as one line (rank 0 removes ``tmp``); a
    ``KeyboardInterrupt`` or ``SystemExit`` passes through as it is."""
    from utilities.distributed import one_line_error

    inner = _inner_failure(exc)
    if not isinstance(inner, Exception):
        raise exc
    if _rank() == 0:
        remove_path(tmp, ignore_errors=True)
    name = tmp.name[1:-len(".tmp")] if tmp.name.endswith(".tmp") else tmp.name
    raise UsageError(one_line_error(f"saving checkpoint {tmp.parent / name}", inner)
                     .replace("; the other ranks stopped too", "")
                     + "; the previous checkpoint, if any, is kept") from None


def _inner_failure(exc: BaseException) -> BaseException:
    """The error inside DCP's ``CheckpointException`` (a ``UsageError`` of ours first, else the
    first rank's), or ``exc`` itself."""
    from torch.distributed.checkpoint.api import CheckpointException

    if not isinstance(exc, CheckpointException):
        return exc
    failures = [f[0] if isinstance(f, tuple) else f for f in exc.failures.values()]
    return next((f for f in failures if isinstance(f, UsageError)), failures[0] if failures else exc)


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
            try:
                fut.result()
            except BaseException as e:  # noqa: BLE001 - as dcp_save: one line
                _save_failed(e, self._tmp)
            publish_save(self._tmp, self.path)
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
    tmp = prepare_save(path)
    future = dcp.async_save(state, checkpoint_id=str(tmp))
    return PendingSave(future, tmp, path, t0, time.perf_counter() - t0)


MAX_TRAINER_COUNT = 2 ** 40  # steps or batches: far beyond any run, far below int64


def trainer_position(state: dict[str, Any], path: str | os.PathLike) -> tuple[int, int]:
    """``(step, batches consumed)`` that ``dcp_load`` put into ``state["trainer"]``, checked:
    integers in [0, ``MAX_TRAINER_COUNT``], else one line (a step of -10**12 would train for
    ever)."""
    trainer = state["trainer"]
    position = []
    for key in ("step", "batches_consumed"):
        value = trainer[key]
        value = value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value
        if type(value) is not int or not 0 <= value <= MAX_TRAINER_COUNT:
            raise UsageError(f"checkpoint {str(path)!r} is damaged or hostile: trainer.{key} is "
                             f"{value!r}; allowed: integers in [0, {MAX_TRAINER_COUNT}]; refused")
        position.append(value)
    return position[0], position[1]


# -- which directory holds the checkpoint, after a kill at any instant ------------------------------
def checkpoint_files(path: str | os.PathLike) -> list[str]:
    """The data files the metadata says the checkpoint is made of (relative names, sorted)."""
    metadata = read_metadata(path)
    files = {info.relative_path for info in (metadata.storage_data or {}).values()}
    return sorted(files)


def _check_dir(p: Path, entries: bool = True) -> None:
    """Refuse, in one line, a directory that is not a complete, safe DCP checkpoint; else the
    metadata it was checked with."""
    if not p.is_dir():
        if staging_path(p).is_dir():
            raise UsageError(f"checkpoint {str(p)!r} was never completed (only {staging_path(p).name} "
                             "exists: the save did not finish)")
        raise UsageError(f"checkpoint {str(p)!r} does not exist or is not a directory")
    if not (p / METADATA).is_file():
        raise UsageError(f"checkpoint {str(p)!r} has no {METADATA} file: not a complete DCP "
                         "checkpoint")
    metadata = read_metadata(p)  # also: every file it names is there, long enough, inside p
    if entries:
        check_bytes_entries(p, metadata)
    return metadata


def _complete(p: Path) -> bool:
    try:
        _check_dir(p, entries=False)
    except UsageError:
        return False
    return True


def resolve_checkpoint(path: str | os.PathLike) -> Path | None:
    """The directory that holds the newest complete checkpoint saved under ``path``, or None.

    A save writes ``.NAME.tmp`` and publishes it with ``swap_in``; a kill can stop it anywhere. The
    rule, which only reads: a complete ``.NAME.tmp`` wins (the save finished writing, only the
    renames were cut short, so it is newer than ``NAME``); else ``NAME``; else a complete
    ``.NAME.old`` (the previous checkpoint, mid-swap). Complete means: ``.metadata`` reads safely
    and every file it names exists (DCP writes ``.metadata`` last, after every rank's data).
    """
    p = Path(path)
    for candidate in (staging_path(p), p, previous_path(p)):
        if candidate != p and candidate.is_symlink():
            continue  # the course never makes .tmp / .old a link: planted, never followed
        if _complete(candidate):
            return candidate
    return None


def recover_checkpoint(path: str | os.PathLike) -> Path | None:
    """Finish or undo what a killed save left, so only ``path`` remains (one process only: rank 0
    before a save). Returns ``path``, or None where no complete checkpoint of that name exists."""
    p = Path(path)
    tmp, old = staging_path(p), previous_path(p)
    best = resolve_checkpoint(p)
    if best == tmp:
        swap_in(tmp, p)  # the save had finished: publish it now
    elif best == old:
        os.replace(old, p)  # only the previous checkpoint survived: put it back
    for leftover in (tmp, old):
        remove_path(leftover, ignore_errors=True)  # incomplete, or superseded by ``path``
    return p if best is not None else None


def step_order(name: str | os.PathLike) -> tuple[int, str]:
    """Sort key of a checkpoint name by the number it ends in (``step_999999`` before
    ``step_1000000``, which a sort by text gets wrong once the number outgrows its zero padding);
    names without a number sort first."""
    import re

    text = Path(name).name
    number = re.search(r"(\d+)$", text)
    return (int(number.group(1)) if number else -1, text)


def latest_checkpoint(directory: str | os.PathLike, pattern: str = "step_*") -> Path | None:
    """The newest complete checkpoint among ``directory/pattern`` (by the step number the names
    end in, ``step_order``), including one a kill left as ``.NAME.tmp`` / ``.NAME.old``; only reads,
    so every rank gets the same."""
    d = Path(directory)
    if not d.is_dir():
        return None
    names = {q.name for q in d.glob(pattern)}
    names |= {q.name[1:-len(".tmp")] for q in d.glob(f".{pattern}.tmp")}
    names |= {q.name[1:-len(".old")] for q in d.glob(f".{pattern}.old")}
    for name in sorted(names, key=step_order, reverse=True):
        found = resolve_checkpoint(d / name)
        if found is not None:
            return found
    return None


def recover_checkpoints(directory: str | os.PathLike, pattern: str = "step_*") -> list[Path]:
    """``recover_checkpoint`` for every name in ``directory`` that a kill left a ``.tmp`` or ``.old``
    of (rank 0 only); returns the checkpoints that exist afterwards under their own names."""
    d = Path(directory)
    if not d.is_dir():
        return []
    names = {q.name[1:-4] for q in [*d.glob(f".{pattern}.tmp"), *d.glob(f".{pattern}.old")]}
    for name in sorted(names):
        recover_checkpoint(d / name)
    return sorted(d.glob(pattern), key=step_order)


def check_checkpoint(path: str | os.PathLike) -> Path:
    """The directory to load for ``path`` (see ``resolve_checkpoint``), checked: complete, every file
    there, nothing in it that would run code. Else one ``UsageError`` line saying what is wrong."""
    return _checked(path)[0]


def _checked(path: str | os.PathLike) -> tuple[Path, Any]:
    """``check_checkpoint``'s directory and the metadata it was checked with."""
    p = Path(path)
    found = resolve_checkpoint(p)
    target = found if found is not None else p
    return target, _check_dir(target)


def load_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer=None) -> Resumed:
    """Load a DCP checkpoint into an already sharded model (and optimizer), any world size.

    The target state dict is built from *this* run's shards; DCP reads, from whichever files hold
    them, exactly the slices those shards cover, then ``set_state_dict`` puts them in place.
    """
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    p, metadata = _checked(path)
    t0 = time.perf_counter()
    state = training_state(model, optimizer)
    if optimizer is None:
        state.pop("optim", None)
    dcp_load(state, p, metadata)
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
    step, batches_consumed = trainer_position(state, p)
    return Resumed(step, batches_consumed, time.perf_counter() - t0)


def dcp_load(state: dict[str, Any], path: str | os.PathLike, metadata: Any = None) -> None:
    """``dcp.load`` through the safe reader and planner (``path`` already passed ``check_checkpoint``).

    DCP is handed ``metadata`` (read and checked here when not given), never the file.
    A failure inside DCP reaches us wrapped in a ``CheckpointException`` (a ``BaseException``, with
    each rank's traceback); we give back one ``UsageError`` line instead."""
    p = Path(path)
    if metadata is None:
        metadata = read_metadata(p)
    with _one_line_failure(p):
        dcp.load(state, storage_reader=safe_reader(p, metadata), planner=safe_planner(p))


class _one_line_failure:
    """Turn a failure of DCP reading checkpoint ``p`` into one ``UsageError`` line: a refusal of
    ours as it is, anything else (a data file changed or cut short since it was checked) as
    damage."""

    def __init__(self, p: Path):
        self.p = p

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, exc, tb) -> bool:
        if exc is None:
            return False
        inner = _inner_failure(exc)
        if not isinstance(inner, Exception):
            return False
        if isinstance(inner, UsageError):
            raise UsageError(str(inner)) from None
        reason = " ".join(str(inner).split())[:160]
        raise UsageError(f"checkpoint {str(self.p)!r} is damaged: reading its data failed "
                         f"({type(inner).__name__}: {reason})") from None


# -- layout and conversion -----------------------------------------------------------------------
def layout(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Every file of a checkpoint directory with its size in bytes (metadata included)."""
    p = Path(path)
    return [{"file": f.name, "bytes": f.stat().st_size}
            for f in sorted(p.iterdir()) if f.is_file()]


def to_torch_save(dcp_dir: str | os.PathLike, file: str | os.PathLike) -> Path:
    """One ``torch.save`` file holding the full (unsharded) tensors; no process group needed."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    # Not PyTorch's dcp_to_torch_save: its reader opens .metadata again with a plain pickle.load
    # and its planner reads non-tensor entries with weights_only=False. The same steps here with
    # the metadata checked once and handed over, and every non-tensor entry read weights_only.
    source, metadata = _checked(dcp_dir)

    class SafeEmptyPlanner(_EmptyStateDictLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            safe_torch_load(value, f"checkpoint entry {read_item.dest_index.fqn}")
            value.seek(0)
            super().load_bytes(read_item, value)

    state: dict[str, Any] = {}
    with _one_line_failure(source):
        _load_state_dict(state, storage_reader=safe_reader(source, metadata),
                         planner=SafeEmptyPlanner(), no_dist=True)
    atomic_torch_save(state, Path(file))
    return Path(file)


def from_torch_save(file: str | os.PathLike, dcp_dir: str | os.PathLike) -> Path:
    """A DCP directory (one file, one writer) from a ``torch.save`` file; any world size loads it.

    Not PyTorch's ``torch_save_to_dcp``: it reads the file with ``weights_only=False``. We read it
    with ``weights_only=True`` (one line naming what it refused) and write it with ``dcp.save``,
    into ``.NAME.tmp``, then rename it over ``dcp_dir`` (``swap_in``): an earlier conversion there is
    replaced whole, never mixed with the new files. Anything else there (``owned_paths.folder_state``:
    a folder neither empty nor a DCP checkpoint, a file, a link) is refused, not replaced.
    """
    from torch.distributed.checkpoint import FileSystemWriter

    target = Path(dcp_dir)
    state = folder_state(target, METADATA)
    if state not in ("missing", "empty", "marked"):
        kind = {"link": " (a symbolic link)", "file": " (a file)"}.get(state, "")
        raise UsageError(f"{str(target)!r} exists and is not a DCP checkpoint{kind}: not replaced")
    if not Path(file).is_file():
        raise UsageError(f"torch.save file {str(file)!r} does not exist")
    state = safe_torch_load(Path(file), f"torch.save file {str(file)!r}")
    if not isinstance(state, dict):
        raise UsageError(f"torch.save file {str(file)!r} holds a {type(state).__name__}, not a "
                         "state dict")
    import warnings

    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        tmp = staging_path(target)
        remove_path(tmp)
        tmp.mkdir(parents=True)
        try:
            dcp.save(state, storage_writer=FileSystemWriter(str(tmp)), no_dist=True)
        except BaseException as e:  # noqa: BLE001 - as dcp_save: one line, tmp removed
            _save_failed(e, tmp)
    swap_in(tmp, target)
    return target


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

    ``weights_only=True``: a local state dict holds ShardedTensors, which the safe unpickler refuses
    by default; we admit, for this load only, exactly the classes a ShardedTensor pickles to
    (``_sharded_tensor_globals``), so a crafted file still cannot run code.
    """
    import warnings

    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    try:
        state = safe_torch_load(path, f"local state dict {path}", allow=_sharded_tensor_globals(),
                                keep=(RuntimeError,))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
                model.load_state_dict(state)
    except UsageError:
        raise
    except (RuntimeError, ValueError, KeyError) as e:
        reason = " ".join(str(e).split())[:200]
        raise UsageError(f"local state dict {path} does not fit this model and world size "
                         f"({world_size()} rank(s)): {reason}") from None


def _sharded_tensor_globals() -> list[Any]:
    """The classes an FSDP1 ``LOCAL_STATE_DICT`` (a ``ShardedTensor`` per flat parameter) pickles
    to: its metadata dataclasses and enum. Its pickle also calls ``getattr(ShardedTensor,
    "ProcessGroupState")``, and under some Pythons (3.11.2) ``getattr(MEM_FORMAT_ENCODING, NAME)``
    for the enum's members; in place of ``builtins.getattr`` we admit a function that answers those
    lookups and refuses any other (a free ``getattr`` would reach anything)."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor.api import ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import (
        MEM_FORMAT_ENCODING,
        ShardedTensorMetadata,
        TensorProperties,
    )
    from torch.distributed._shard.sharded_tensor.shard import Shard
    from torch.distributed._shard.sharding_spec.chunk_sharding_spec import ChunkShardingSpec
    from torch.distributed.remote_device import _remote_device

    def only_known_attributes(obj: Any, name: str) -> Any:
        if obj is ShardedTensor and name == "ProcessGroupState":
            return ShardedTensor.ProcessGroupState
        return enum_member({MEM_FORMAT_ENCODING}, obj, name)  # refuses any other getattr

    return [ShardedTensor, ShardedTensor.ProcessGroupState, Shard, ShardMetadata,
            ShardedTensorMetadata, TensorProperties, MEM_FORMAT_ENCODING, ChunkShardingSpec,
            _remote_device, (only_known_attributes, "builtins.getattr")]


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
