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

import enum
import io
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from utilities.distributed import fail_together, world_size
from utilities.errors import UsageError
from utilities.owned_paths import folder_state
from utilities.pickle_scan import DamagedPickle, RefusedChange, RefusedGlobal, printable, scan_pickle
from utilities.restricted_unpickler import RestrictedUnpickler, enum_member, guarded_container
from utilities.safe_files import (
    atomic_torch_save,
    open_regular,
    previous_path,
    read_at_most,
    regular_file_size,
    remove_path,
    staging_path,
    swap_in,
)
from utilities.torch_internals import require_dcp_reader_hooks
from utilities.torch_zip import check_torch_slice, safe_torch_load

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


# -- save: write to .NAME.tmp, publish by renames that never lose a complete checkpoint -----------
def prepare_save(path: Path) -> Path:
    """Every rank calls it before writing ``path``: rank 0 recovers what a killed earlier save of
    ``path`` left, then makes an empty ``.NAME.tmp``; returns it (write there, then ``publish_save``)."""
    tmp = staging_path(path)
    with fail_together(f"preparing {tmp}"):  # also the barrier: rank 0 failing stops every rank
        if _rank() == 0:
            recover_checkpoint(path)  # first finish or undo what a killed earlier save left
            remove_path(tmp)  # an unfinished save's leftovers, or a file planted in its place
            tmp.mkdir(parents=True)
    return tmp


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


# -- reading a checkpoint without running code from it ----------------------------------------------
def _metadata_classes() -> set[type]:
    """DCP's metadata dataclasses: the only objects a ``.metadata`` pickle may create and give
    state to (``RestrictedUnpickler``'s ``buildable``)."""
    from torch.distributed.checkpoint import filesystem as fs_module
    from torch.distributed.checkpoint import metadata as md_module

    names = ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
             "TensorProperties", "MetadataIndex", "StorageMeta")
    return {getattr(md_module, n) for n in names if hasattr(md_module, n)} | {fs_module._StorageInfo}


def _metadata_globals() -> dict[tuple[str, str], Any]:
    """What a DCP ``.metadata`` pickle may name: DCP's metadata classes and enum, torch dtypes, and
    in place of every other global it needs (``torch.Size``, ``_get_layout``, the path classes
    DCP records as ``checkpoint_id``, the containers) a function of ours that builds a new object
    from plain arguments: the pickle never holds a class or a cache the process shares."""
    import collections
    import pathlib

    from torch.distributed.checkpoint import metadata as md_module

    allowed: dict[tuple[str, str], Any] = {}
    for cls in _metadata_classes():
        allowed[(cls.__module__, cls.__name__)] = cls
    if hasattr(md_module, "_MEM_FORMAT_ENCODING"):
        allowed[(md_module.__name__, "_MEM_FORMAT_ENCODING")] = md_module._MEM_FORMAT_ENCODING
    allowed[("torch", "Size")] = _size
    for name, value in vars(torch).items():  # a dict lookup: no module __getattr__ runs
        if isinstance(value, torch.dtype):
            allowed[("torch", name)] = value
    allowed[("torch.serialization", "_get_layout")] = _layout
    for cls in (pathlib.PosixPath, pathlib.WindowsPath, pathlib.PurePosixPath,
                pathlib.PureWindowsPath):
        allowed[("pathlib", cls.__name__)] = allowed[(cls.__module__, cls.__name__)] = _path_maker(cls)
    for cls in (set, frozenset, tuple, list, dict):
        allowed[("builtins", cls.__name__)] = guarded_container(cls)
    allowed[("collections", "OrderedDict")] = guarded_container(collections.OrderedDict)
    enums = {cls for cls in allowed.values() if isinstance(cls, type) and issubclass(cls, enum.Enum)}
    allowed[("builtins", "getattr")] = lambda cls, name: enum_member(enums, cls, name)
    return allowed


def _size(dims: Any) -> torch.Size:
    """``torch.Size`` of a tuple or list of integers, as DCP's metadata pickles one."""
    if type(dims) not in (tuple, list) or not all(type(d) is int for d in dims):
        raise DamagedPickle("gives torch.Size something other than integers")
    return torch.Size(dims)


def _layout(name: Any) -> torch.layout:
    """``torch.serialization._get_layout``'s answer, from a table of our own (its cache is shared
    by every later ``torch.load`` of the process)."""
    layouts = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}
    if name not in layouts:
        raise DamagedPickle(f"names the layout {name!r}, which torch does not have")
    return layouts[name]


_layout.__module__, _layout.__qualname__ = "torch.serialization", "_get_layout"  # as it is named


def _path_maker(cls: type) -> Any:
    def make(*parts: Any) -> Any:
        if not all(type(part) is str for part in parts):
            raise DamagedPickle(f"gives {cls.__name__} something other than strings")
        return cls(*parts)

    make.__module__, make.__qualname__ = cls.__module__, cls.__qualname__  # as the pickle names it
    return make


_MAX_METADATA_BYTES = 1 << 30  # DCP's metadata of a model with thousands of tensors is megabytes
_MAX_DEPTH = 48  # DCP's metadata nests about a dozen levels; a crafted pickle may nest millions


def _damaged(p: Path, reason: str) -> UsageError:
    return UsageError(f"checkpoint {str(p)!r} is damaged or hostile: {printable(reason, 400)}; "
                      "refused, nothing was loaded")


def read_metadata(path: str | os.PathLike) -> Any:
    """The ``Metadata`` of a DCP checkpoint directory, read without running code from it and
    checked completely before anything uses it (``_check_metadata``).

    The file is read once, into memory; the bytes are checked and unpickled from memory, and the
    object returned is what DCP is handed (``_safe_reader``), so a file swapped after the check
    is never read. One ``UsageError`` line for a missing, damaged, hostile or code-carrying file.
    """
    p = Path(path)
    file = p / METADATA
    with open_regular(file, f"checkpoint {str(p)!r}: its") as f:  # no link, no FIFO
        try:
            data = read_at_most(f, _MAX_METADATA_BYTES)
        except OSError as e:
            raise UsageError(f"checkpoint {str(p)!r}: cannot read {METADATA} ({e.strerror})") from None
    if len(data) > _MAX_METADATA_BYTES:
        raise _damaged(p, f"{METADATA} is larger than {_MAX_METADATA_BYTES >> 20} MiB")
    metadata = _unpickle_metadata(p, data)
    try:
        _check_metadata(p, metadata)
    except (AttributeError, TypeError, ValueError, OverflowError, RecursionError) as e:
        # an object the metadata built lacks a field, or holds one no check foresaw
        raise _damaged(p, f"{METADATA} is malformed ({type(e).__name__}: {e})") from None
    return metadata


def _unpickle_metadata(p: Path, data: bytes) -> Any:
    """Unpickle ``data`` with a ``RestrictedUnpickler`` after ``scan_pickle`` read every opcode."""
    allowed = _metadata_globals()
    try:
        scan_pickle(data, _MAX_DEPTH, lambda module, name: (module, name) in allowed,
                    guard_keys=False)  # the unpickler follows the keys itself, on the real objects
        return RestrictedUnpickler(data, allowed, _metadata_classes()).load()
    except RefusedChange as e:
        raise UsageError(f"checkpoint {str(p)!r}: {METADATA} asks to change the running process: "
                         f"it {e}; refused, nothing was loaded and nothing was changed") from None
    except RefusedGlobal as e:
        raise UsageError(f"checkpoint {str(p)!r}: {METADATA} asks to run code when loaded: it names "
                         f"{e}, which is not one of DCP's metadata classes; refused, nothing was "
                         "loaded") from None
    except DamagedPickle as e:
        raise _damaged(p, f"{METADATA} is not a readable pickle ({e})") from None
    except Exception as e:  # noqa: BLE001 - an admitted class refusing its arguments, in one line
        reason = " ".join(str(e).split())[:160]
        raise _damaged(p, f"{METADATA} does not unpickle ({type(e).__name__}: {reason})") from None


def _check_metadata(p: Path, md: Any) -> None:
    """Refuse, in one line, metadata whose structure is not what DCP writes, before anything reads
    it: every field of the type DCP gives it, every tensor chunk inside its tensor and stored in a
    byte range of a file that exists inside ``p`` and is long enough, no two ranges overlapping,
    and the tensors together no larger than the files (a crafted size would make a converter
    allocate it)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    def need(ok: bool, reason: str) -> None:
        if not ok:
            raise _damaged(p, reason)

    def is_int(x: Any) -> bool:
        return type(x) is int

    def is_size(x: Any) -> bool:
        return type(x) is torch.Size and len(x) <= 64 and all(is_int(d) and d >= 0 for d in x)

    need(type(md) is Metadata, f"{METADATA} holds a {type(md).__name__}, not DCP metadata")
    sdm = md.state_dict_metadata
    need(type(sdm) is dict, "its entries are not a dict")
    tensor_bytes = 0
    for fqn, entry in sdm.items():
        need(type(fqn) is str, f"an entry is named by a {type(fqn).__name__}")
        if type(entry) is BytesStorageMetadata:
            continue
        need(type(entry) is TensorStorageMetadata, f"entry {fqn} is a {type(entry).__name__}")
        props = entry.properties
        need(type(props) is TensorProperties and isinstance(props.dtype, torch.dtype)
             and isinstance(props.layout, torch.layout) and type(props.requires_grad) is bool
             and isinstance(props.memory_format, torch.memory_format)
             and type(props.pin_memory) is bool, f"entry {fqn} has malformed tensor properties")
        need(is_size(entry.size), f"entry {fqn} has a malformed size")
        need(type(entry.chunks) is list, f"entry {fqn} has malformed chunks")
        itemsize = props.dtype.itemsize
        tensor_bytes += math.prod(entry.size) * itemsize
        for chunk in entry.chunks:
            need(type(chunk) is ChunkStorageMetadata and is_size(chunk.offsets)
                 and is_size(chunk.sizes) and len(chunk.offsets) == len(chunk.sizes) == len(entry.size)
                 and all(o + n <= d for o, n, d in zip(chunk.offsets, chunk.sizes, entry.size)),
                 f"entry {fqn} has a chunk outside its size {list(entry.size)}")
    planner = md.planner_data
    need(planner is None or type(planner) is dict, "its planner data is not a dict")
    limit = 16 * len(sdm) + 1024
    for fqn, keys in (planner or {}).items():
        need(type(fqn) is str and type(keys) in (tuple, list) and 0 < len(keys) <= 64
             and all(type(k) is str or (is_int(k) and 0 <= k < limit) for k in keys),
             f"the planner data of {fqn!r} is malformed")
    meta = md.storage_meta
    need(meta is None or (type(meta) is StorageMeta
                          and isinstance(meta.checkpoint_id, (str, os.PathLike, type(None)))
                          and all(isinstance(x, (str, type(None))) for x in (meta.save_id,
                                                                              meta.load_id))
                          and type(meta.modules) is list
                          and all(type(m) is str for m in meta.modules)),
         "its storage meta is malformed")
    need(isinstance(getattr(md, "version", None), (str, type(None))), "its version is malformed")
    storage = md.storage_data
    need(type(storage) is dict, "its storage data is not a dict")
    for index, info in storage.items():
        need(type(index) is MetadataIndex and type(index.fqn) is str
             and (index.offset is None or is_size(index.offset))
             and (index.index is None or is_int(index.index)), "a storage index is malformed")
        need(type(info) is _StorageInfo and type(info.relative_path) is str
             and is_int(info.offset) and is_int(info.length) and info.offset >= 0
             and info.length >= 0, f"the storage of {index.fqn} is malformed")
        need(not getattr(info, "transform_descriptors", None),
             f"entry {index.fqn} is stored with transforms {info.transform_descriptors!r} that this "
             "course cannot check")
    for fqn, entry in sdm.items():  # every chunk has its bytes, and they are long enough
        if type(entry) is BytesStorageMetadata:
            need(MetadataIndex(fqn) in storage, f"entry {fqn} has no storage")
            continue
        for chunk in entry.chunks:
            info = storage.get(MetadataIndex(fqn, chunk.offsets))
            need(info is not None, f"a chunk of {fqn} has no storage")
            need(info.length >= math.prod(chunk.sizes) * entry.properties.dtype.itemsize,
                 f"a chunk of {fqn} is stored in fewer bytes than it holds")
    files = sorted({info.relative_path for info in storage.values()})
    root = os.path.realpath(p)
    for name in files:
        parts = Path(name).parts
        need(not os.path.islink(p / name), f"data file {name!r} is a link, not a regular file")
        need(bool(name) and "\0" not in name and not os.path.isabs(name) and ".." not in parts
             and os.path.realpath(p / name).startswith(root + os.sep),
             f"data file {name!r} lies outside the checkpoint folder")
    sizes = {name: regular_file_size(p / name) for name in files}  # None: not a regular file
    missing = [f for f in files if sizes[f] is None and not os.path.lexists(p / f)]
    if missing:
        raise UsageError(f"checkpoint {str(p)!r} is missing {missing[0]} (listed in {METADATA}; "
                         f"{len(missing)} of {len(files)} data files missing); nothing was "
                         "loaded")
    special = [f for f in files if sizes[f] is None]
    need(not special, f"data file {special[0] if special else ''!r} is a link, FIFO or device, not a "
                      "regular file")
    need(tensor_bytes <= sum(sizes.values()),
         f"its tensors ({tensor_bytes} bytes) are larger than its data files")
    ranges: dict[str, list[tuple[int, int, str]]] = {}
    for index, info in storage.items():
        need(info.offset + info.length <= sizes[info.relative_path],
             f"{info.relative_path} is {sizes[info.relative_path]} bytes, shorter than "
             f"{METADATA} says (entry {index.fqn} ends at byte {info.offset + info.length}): "
             "truncated")
        ranges.setdefault(info.relative_path, []).append((info.offset, info.length, index.fqn))
    for name, spans in ranges.items():
        spans.sort()
        for (o1, n1, f1), (o2, _n2, f2) in zip(spans, spans[1:]):
            need(o1 + n1 <= o2, f"entries {f1} and {f2} overlap in {name}")


def _check_bytes_entries(p: Path, metadata: Any) -> None:
    """Every non-tensor entry (DCP stores them as ``torch.save`` bytes and loads them with
    ``weights_only=False``) must load with ``weights_only=True``; else one line naming it."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    for index, info in (metadata.storage_data or {}).items():
        if not isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            continue
        with open_regular(p / info.relative_path, f"checkpoint {str(p)!r}: data file") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        safe_torch_load(io.BytesIO(data), f"checkpoint {str(p)!r}: entry {index.fqn}")


def _safe_reader(path: Path, metadata: Any):
    """A ``FileSystemReader`` that never opens ``.metadata``: it hands DCP ``metadata``, the object
    ``read_metadata`` checked. (PyTorch's own reader opens the file again and unpickles it with a
    plain ``pickle.load``: a file swapped after our check would run code there.) It opens each data
    file without following a link and only as a regular file (a link planted after the check
    would load another checkpoint's shard, a FIFO would hang the load), and checks every entry's
    ``torch.save`` bytes (``check_torch_slice``: no zip bomb, no pickle built to be slow) before
    DCP's ``torch.load`` reads them."""
    from contextlib import contextmanager

    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.filesystem import FileSystem
    from torch.distributed.checkpoint.metadata import StorageMeta

    class RegularFilesOnly(FileSystem):
        @contextmanager
        def create_stream(self, file: str | os.PathLike, mode: str):
            if mode != "rb":
                raise UsageError(f"checkpoint {str(path)!r} is opened to be read only")
            with open_regular(file, f"checkpoint {str(path)!r}: data file") as stream:
                yield stream

    class SafeFileSystemReader(FileSystemReader):
        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, **kwargs)
            if hasattr(self, "fs"):  # else refused below (require_dcp_reader_hooks)
                self.fs = RegularFilesOnly()

        def read_metadata(self, *args: Any, **kwargs: Any):
            if kwargs.get("rank") is not None:  # per-rank metadata files: the course writes none
                raise UsageError(f"checkpoint {str(path)!r}: per-rank metadata is not supported")
            if metadata.storage_meta is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

        def _slice_file(self, file, sinfo):
            check_torch_slice(file, sinfo.offset, sinfo.length,
                              f"checkpoint {str(path)!r} is damaged: reading its data failed: the "
                              f"entry at byte {sinfo.offset} of {sinfo.relative_path}")
            return super()._slice_file(file, sinfo)

    reader = SafeFileSystemReader(str(path))
    require_dcp_reader_hooks(reader)
    return reader


def _safe_planner(path: Path):
    """DCP's default load planner, but a non-tensor entry must pass ``weights_only=True`` first and
    have the kind of value this run's own state has there (``check_like``): a string where the
    scheduler keeps its learning rates would fail later, once per rank, with a traceback."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class SafeLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            fqn = read_item.dest_index.fqn
            loaded = safe_torch_load(value, f"checkpoint entry {fqn}")
            if fqn in self.state_dict:
                check_like(path, fqn, self.state_dict[fqn], loaded)
            value.seek(0)
            super().load_bytes(read_item, value)

    return SafeLoadPlanner()


def check_like(path: str | os.PathLike, fqn: str, expected: Any, got: Any) -> None:
    """Refuse, in one line, a checkpoint value ``got`` at ``fqn`` that is not of the kind of this
    run's own value ``expected``: the same type (any number for a float, finite; a bool or None for
    a bool or None: optimizers keep ``foreach`` / ``fused`` as either), lists and tuples of the same
    length, item by item, dicts key by key for the keys both have."""
    allowed = _unlike(expected, got)
    if allowed is not None:
        shown = repr(got) if len(repr(got)) <= 40 else repr(got)[:37] + "..."
        raise _damaged(Path(path), f"entry {fqn} is {shown} (a {type(got).__name__}); allowed: "
                                   f"{allowed}, as this run's own state has there")


def _unlike(expected: Any, got: Any, depth: int = 0) -> str | None:
    """What is allowed where ``got`` is not of ``expected``'s kind, else None."""
    if expected is None or isinstance(expected, bool):
        return None if got is None or isinstance(got, bool) else "a bool or None"
    if isinstance(expected, int):
        return None if type(got) is int else "an integer"
    if isinstance(expected, float):
        ok = type(got) in (int, float) and math.isfinite(got)
        return None if ok else "a finite number"
    if isinstance(expected, str):
        return None if isinstance(got, str) else "a string"
    if isinstance(expected, (list, tuple)):
        if type(got) not in (list, tuple) or len(got) != len(expected):
            return f"a list of {len(expected)} item(s)"
        for e, g in zip(expected, got):
            inner = _unlike(e, g, depth + 1)
            if inner is not None:
                return f"a list of {len(expected)} item(s), each {inner}"
        return None
    if isinstance(expected, dict):
        if not isinstance(got, dict):
            return "a dict"
        for key in expected.keys() & got.keys():
            inner = _unlike(expected[key], got[key], depth + 1)
            if inner is not None:
                return f"{inner} at key {key!r}"
        return None
    if isinstance(expected, torch.Tensor):
        return None if isinstance(got, torch.Tensor) else "a tensor"
    return None if type(got) is type(expected) else f"a {type(expected).__name__}"


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
        _check_bytes_entries(p, metadata)
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
        dcp.load(state, storage_reader=_safe_reader(p, metadata), planner=_safe_planner(p))


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
        _load_state_dict(state, storage_reader=_safe_reader(source, metadata),
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
