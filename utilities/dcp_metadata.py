"""Reading a DCP checkpoint's ``.metadata`` without running code from it, and checking it
completely before anything uses it.

DCP's ``.metadata`` is a pickle that PyTorch reads with a plain ``pickle.load``, and DCP reads
non-tensor entries with ``torch.load(weights_only=False)``: either can run any function a crafted
file names. ``read_metadata`` reads the file once, scans its opcodes (``scan_pickle``), unpickles it
with an unpickler that admits only DCP's own metadata classes, and checks every field, chunk and
byte range (``_check_metadata``); ``safe_reader`` hands DCP that object and opens data files only as
regular files; ``safe_planner`` loads every non-tensor entry with ``weights_only=True`` and checks it
against this run's own value (``check_like``).
"""

from __future__ import annotations

import enum
import io
import math
import os
from pathlib import Path
from typing import Any

import torch

from utilities.errors import UsageError
from utilities.pickle_scan import DamagedPickle, RefusedChange, RefusedGlobal, printable, scan_pickle
from utilities.restricted_unpickler import RestrictedUnpickler, enum_member, guarded_container
from utilities.safe_files import open_regular, read_at_most, regular_file_size
from utilities.torch_internals import require_dcp_reader_hooks
from utilities.torch_zip import check_torch_slice, safe_torch_load

METADATA = ".metadata"


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


def _need(p: Path, ok: bool, reason: str) -> None:
    if not ok:
        raise _damaged(p, reason)


def _is_int(x: Any) -> bool:
    return type(x) is int


def _is_size(x: Any) -> bool:
    return type(x) is torch.Size and len(x) <= 64 and all(_is_int(d) and d >= 0 for d in x)


def _check_metadata(p: Path, md: Any) -> None:
    """Refuse, in one line, metadata whose structure is not what DCP writes, before anything reads
    it: every field of the type DCP gives it, every tensor chunk inside its tensor and stored in a
    byte range of a file that exists inside ``p`` and is long enough, no two ranges overlapping,
    and the tensors together no larger than the files (a crafted size would make a converter
    allocate it)."""
    from torch.distributed.checkpoint.metadata import Metadata

    _need(p, type(md) is Metadata, f"{METADATA} holds a {type(md).__name__}, not DCP metadata")
    tensor_bytes = _check_entries(p, md.state_dict_metadata)
    _check_planner_and_meta(p, md)
    _check_storage(p, md.state_dict_metadata, md.storage_data)
    _check_data_files(p, md.storage_data, tensor_bytes)


def _check_entries(p: Path, sdm: Any) -> int:
    """Every entry's type, tensor properties, size and chunks; the bytes its tensors hold."""
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    _need(p, type(sdm) is dict, "its entries are not a dict")
    tensor_bytes = 0
    for fqn, entry in sdm.items():
        _need(p, type(fqn) is str, f"an entry is named by a {type(fqn).__name__}")
        if type(entry) is BytesStorageMetadata:
            continue
        _need(p, type(entry) is TensorStorageMetadata, f"entry {fqn} is a {type(entry).__name__}")
        props = entry.properties
        _need(p, type(props) is TensorProperties and isinstance(props.dtype, torch.dtype)
              and isinstance(props.layout, torch.layout) and type(props.requires_grad) is bool
              and isinstance(props.memory_format, torch.memory_format)
              and type(props.pin_memory) is bool, f"entry {fqn} has malformed tensor properties")
        _need(p, _is_size(entry.size), f"entry {fqn} has a malformed size")
        _need(p, type(entry.chunks) is list, f"entry {fqn} has malformed chunks")
        tensor_bytes += math.prod(entry.size) * props.dtype.itemsize
        for chunk in entry.chunks:
            _need(p, type(chunk) is ChunkStorageMetadata and _is_size(chunk.offsets)
                  and _is_size(chunk.sizes) and len(chunk.offsets) == len(chunk.sizes) == len(entry.size)
                  and all(o + n <= d for o, n, d in zip(chunk.offsets, chunk.sizes, entry.size)),
                  f"entry {fqn} has a chunk outside its size {list(entry.size)}")
    return tensor_bytes


def _check_planner_and_meta(p: Path, md: Any) -> None:
    """The planner data, the storage meta and the version."""
    from torch.distributed.checkpoint.metadata import StorageMeta

    planner = md.planner_data
    _need(p, planner is None or type(planner) is dict, "its planner data is not a dict")
    limit = 16 * len(md.state_dict_metadata) + 1024
    for fqn, keys in (planner or {}).items():
        _need(p, type(fqn) is str and type(keys) in (tuple, list) and 0 < len(keys) <= 64
              and all(type(k) is str or (_is_int(k) and 0 <= k < limit) for k in keys),
              f"the planner data of {fqn!r} is malformed")
    meta = md.storage_meta
    _need(p, meta is None or (type(meta) is StorageMeta
                              and isinstance(meta.checkpoint_id, (str, os.PathLike, type(None)))
                              and all(isinstance(x, (str, type(None))) for x in (meta.save_id,
                                                                                  meta.load_id))
                              and type(meta.modules) is list
                              and all(type(m) is str for m in meta.modules)),
          "its storage meta is malformed")
    _need(p, isinstance(getattr(md, "version", None), (str, type(None))), "its version is malformed")


def _check_storage(p: Path, sdm: dict, storage: Any) -> None:
    """Every storage index and record well formed, and every entry's chunks stored in enough bytes."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    _need(p, type(storage) is dict, "its storage data is not a dict")
    for index, info in storage.items():
        _need(p, type(index) is MetadataIndex and type(index.fqn) is str
              and (index.offset is None or _is_size(index.offset))
              and (index.index is None or _is_int(index.index)), "a storage index is malformed")
        _need(p, type(info) is _StorageInfo and type(info.relative_path) is str
              and _is_int(info.offset) and _is_int(info.length) and info.offset >= 0
              and info.length >= 0, f"the storage of {index.fqn} is malformed")
        _need(p, not getattr(info, "transform_descriptors", None),
              f"entry {index.fqn} is stored with transforms {info.transform_descriptors!r} that this "
              "course cannot check")
    for fqn, entry in sdm.items():  # every chunk has its bytes, and they are long enough
        if type(entry) is BytesStorageMetadata:
            _need(p, MetadataIndex(fqn) in storage, f"entry {fqn} has no storage")
            continue
        for chunk in entry.chunks:
            info = storage.get(MetadataIndex(fqn, chunk.offsets))
            _need(p, info is not None, f"a chunk of {fqn} has no storage")
            _need(p, info.length >= math.prod(chunk.sizes) * entry.properties.dtype.itemsize,
                  f"a chunk of {fqn} is stored in fewer bytes than it holds")


def _check_data_files(p: Path, storage: dict, tensor_bytes: int) -> None:
    """Every data file the storage names: inside ``p``, a regular file, long enough for its byte
    ranges, which do not overlap, and all together at least ``tensor_bytes``."""
    files = sorted({info.relative_path for info in storage.values()})
    root = os.path.realpath(p)
    for name in files:
        parts = Path(name).parts
        _need(p, not os.path.islink(p / name), f"data file {name!r} is a link, not a regular file")
        _need(p, bool(name) and "\0" not in name and not os.path.isabs(name) and ".." not in parts
              and os.path.realpath(p / name).startswith(root + os.sep),
              f"data file {name!r} lies outside the checkpoint folder")
    sizes = {name: regular_file_size(p / name) for name in files}  # None: not a regular file
    missing = [f for f in files if sizes[f] is None and not os.path.lexists(p / f)]
    if missing:
        raise UsageError(f"checkpoint {str(p)!r} is missing {missing[0]} (listed in {METADATA}; "
                         f"{len(missing)} of {len(files)} data files missing); nothing was "
                         "loaded")
    special = [f for f in files if sizes[f] is None]
    _need(p, not special, f"data file {special[0] if special else ''!r} is a link, FIFO or device, not "
                          "a regular file")
    _need(p, tensor_bytes <= sum(sizes.values()),
          f"its tensors ({tensor_bytes} bytes) are larger than its data files")
    ranges: dict[str, list[tuple[int, int, str]]] = {}
    for index, info in storage.items():
        _need(p, info.offset + info.length <= sizes[info.relative_path],
              f"{info.relative_path} is {sizes[info.relative_path]} bytes, shorter than "
              f"{METADATA} says (entry {index.fqn} ends at byte {info.offset + info.length}): "
              "truncated")
        ranges.setdefault(info.relative_path, []).append((info.offset, info.length, index.fqn))
    for name, spans in ranges.items():
        spans.sort()
        for (o1, n1, f1), (o2, _n2, f2) in zip(spans, spans[1:]):
            _need(p, o1 + n1 <= o2, f"entries {f1} and {f2} overlap in {name}")


def check_bytes_entries(p: Path, metadata: Any) -> None:
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


def safe_reader(path: Path, metadata: Any):
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


def safe_planner(path: Path):
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
