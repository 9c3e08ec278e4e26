"""``torch.load`` of a file that may be hostile: ``safe_torch_load`` is
``torch.load(weights_only=True)`` after the file was checked as a zip archive (``check_torch_zip``:
no compressed record, none larger than the file, no two sharing bytes) and its pickle was read
opcode by opcode (``utilities.pickle_scan.scan_pickle``).
"""

from __future__ import annotations

import io
import os
import pickle
import re
import struct
from collections.abc import Sequence
from typing import Any, BinaryIO

import torch

from utilities.errors import UsageError
from utilities.pickle_scan import DamagedPickle, RefusedGlobal, scan_pickle
from utilities.safe_files import open_regular

# -- torch.load of a file that may be hostile --------------------------------------------------------

TORCH_PICKLE_DEPTH = 64  # a full state dict nests about ten levels


def check_torch_zip(source: BinaryIO, what: str) -> None:
    """Refuse, in one ``UsageError`` line, a ``torch.save`` file that is not a plain zip archive
    of stored records whose pickle passes ``scan_pickle``. ``torch.save`` never compresses a
    record; a compressed one (a zip bomb: 2 MiB that inflate to 2 GiB), one declaring more bytes
    than the file holds, or two sharing bytes (``check_records_apart``: many names for one record)
    are refused before anything is inflated or allocated; so is torch's legacy (non-zip) format,
    with how to save it again. ``source`` is read
    from its current position to its end; its position is restored."""
    import zipfile

    start = source.tell()
    try:
        size = source.seek(0, os.SEEK_END) - start
        source.seek(start)
        view = _Slice(source, start, size)
        try:
            archive = zipfile.ZipFile(view)
        except Exception as e:  # noqa: BLE001 - zipfile on hostile bytes: BadZipFile, NotImplementedError...
            view.seek(0)
            if is_legacy_torch_save(view.read(64)):
                raise UsageError(f"{what} is in torch's legacy (non-zip) format, which the course does "
                                 "not read: load it once in a session you trust and save it again with "
                                 "torch.save(obj, f) (the default zip format, "
                                 "_use_new_zipfile_serialization=True)") from None
            raise UsageError(unreadable(what, e)) from None
        records = archive.infolist()
        names = [r.filename for r in records]
        if len(set(names)) != len(names):
            raise UsageError(f"{what} is damaged or hostile: its zip archive names a record twice; "
                             "refused, nothing was loaded")
        for record in sorted(records, key=lambda r: -r.file_size):  # the largest claim first
            if record.compress_type != zipfile.ZIP_STORED or record.file_size != record.compress_size \
                    or record.header_offset + record.compress_size > size:
                raise UsageError(
                    f"{what} is damaged or hostile: its record {record.filename!r} declares "
                    f"{record.file_size} bytes ({'compressed' if record.compress_type else 'stored'}"
                    f") in a file of {size} bytes; allowed: stored records within the file, as "
                    "torch.save writes them; refused, nothing was loaded")
        check_records_apart(view, records, getattr(archive, "start_dir", size), size, what)
        pickles = [r for r in records if r.filename.endswith("/data.pkl") and r.filename.count("/") == 1]
        if len(pickles) != 1:
            raise UsageError(f"{what} is not readable (truncated or not a torch.save file): it holds "
                             f"{len(pickles)} data.pkl records")
        _scan_record(archive, pickles[0], what)
    finally:
        source.seek(start)


def _scan_record(archive: Any, record: Any, what: str) -> None:
    """``scan_pickle`` of the zip ``record`` (a ``ZipInfo`` of ``archive``), read as a stream, then
    the rest of it (its CRC is checked at its end): one ``UsageError`` line for a damaged record or
    pickle."""
    try:
        with archive.open(record) as stream:
            scan_pickle(stream, TORCH_PICKLE_DEPTH, lambda module, name: True, size=record.file_size)
            while stream.read(1 << 20):
                pass
    except RefusedGlobal:  # pragma: no cover - every global is admitted here
        raise
    except DamagedPickle as e:
        raise UsageError(f"{what} is damaged or hostile: its pickle {e}; refused, nothing was "
                         "loaded") from None
    except Exception as e:  # noqa: BLE001 - a damaged record: BadZipFile, a bad CRC, ...
        raise UsageError(unreadable(what, e)) from None


_LOCAL_HEADER = struct.Struct("<4s22xHH")  # a zip record's local header: signature ... name, extra lengths


def check_records_apart(source: BinaryIO, records: Sequence[Any], records_end: int, size: int,
                        what: str) -> None:
    """Refuse, in one ``UsageError`` line, zip ``records`` (``ZipInfo``) that do not point at a
    record of their own name, or whose bytes (local header, name, extra field and stored data)
    overlap, or lie past ``records_end`` (where the central directory starts): 500 directory
    entries naming one 4 MiB record would read as 2 GiB. Records side by side hold together no
    more bytes than the file's ``size``."""
    spans = []
    for record in records:
        source.seek(record.header_offset)
        head = source.read(_LOCAL_HEADER.size)
        if len(head) < _LOCAL_HEADER.size or head[:4] != b"PK\x03\x04":
            raise UsageError(f"{what} is damaged or hostile: its record {record.filename!r} points at "
                             f"byte {record.header_offset}, where no record starts; refused, nothing "
                             "was loaded")
        name_length, extra_length = _LOCAL_HEADER.unpack(head)[1:]
        if source.read(name_length) != record.orig_filename.encode("utf-8" if record.flag_bits & 0x800
                                                                  else "cp437", "replace"):
            raise UsageError(f"{what} is damaged or hostile: its record {record.filename!r} points at "
                             f"byte {record.header_offset}, where another record starts; refused, "
                             "nothing was loaded")
        spans.append((record.header_offset, record.header_offset + _LOCAL_HEADER.size + name_length
                      + extra_length + record.compress_size, record.filename))
    spans.sort()
    stored = sum(r.compress_size for r in records)
    for (_, end, name), (start, _, following) in zip(spans, spans[1:]):
        if end > start:
            raise UsageError(f"{what} is damaged or hostile: its zip records {name!r} and "
                             f"{following!r} share bytes (stored records declare {stored} bytes in "
                             f"a file of {size}); allowed: records side by side, as torch.save "
                             "writes them; refused, nothing was loaded")
    if spans and (spans[-1][1] > records_end or stored > size):
        raise UsageError(f"{what} is damaged or hostile: its record {spans[-1][2]!r} runs past the "
                         f"records into the zip directory (byte {spans[-1][1]} of {size}); refused, "
                         "nothing was loaded")


# what torch.save's legacy format pickles first (torch.serialization.MAGIC_NUMBER)
_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C


def is_legacy_torch_save(head: bytes) -> bool:
    """Whether ``head``, a file's first bytes, starts as torch's legacy (non-zip) format does: a
    pickle of its magic number (read opcode by opcode, nothing is unpickled)."""
    import pickletools

    try:
        for op, arg, _pos in pickletools.genops(io.BytesIO(head)):
            if op.name in ("PROTO", "FRAME"):
                continue
            return arg == _LEGACY_MAGIC
    except Exception:  # noqa: BLE001 - cut off or not a pickle at all
        return False
    return False


class _Slice(io.RawIOBase):
    """``length`` bytes of ``file`` from ``offset``, as a seekable file of their own."""

    def __init__(self, file: BinaryIO, offset: int, length: int):
        self._file, self._offset, self._length, self._pos = file, offset, length, 0

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._length}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def read(self, n: int = -1) -> bytes:
        left = max(0, self._length - self._pos)
        n = left if n is None or n < 0 else min(n, left)
        self._file.seek(self._offset + self._pos)
        data = self._file.read(n)
        self._pos += len(data)
        return data

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[:len(data)] = data
        return len(data)


def check_torch_slice(file: BinaryIO, offset: int, length: int, what: str) -> None:
    """``check_torch_zip`` of the ``torch.save`` bytes at ``offset`` in ``file`` (a DCP shard holds
    one per tensor); the file's position is restored."""
    position = file.tell()
    try:
        check_torch_zip(_Slice(file, offset, length), what)  # type: ignore[arg-type]
    finally:
        file.seek(position)


def safe_torch_load(source: str | os.PathLike | io.BytesIO, what: str,
                    allow: Sequence[Any] = (), keep: tuple[type[Exception], ...] = ()) -> Any:
    """``torch.load(source, weights_only=True)``, with ``allow`` (classes, or ``(object, "module.name")``
    pairs) admitted for this call only, and every failure turned into one line. Errors of a type in
    ``keep`` that are not about the file's format (an admitted class refusing its state, e.g. a
    ShardedTensor saved on another world size) propagate for the caller to word.

    Why not plain ``torch.load``: a pickle may name any importable function (``posix.system``) and
    ``weights_only=False`` calls it while loading. The weights-only unpickler refuses every global
    outside PyTorch's tensor/container allowlist; we say which one it refused, and that nothing was
    loaded, instead of PyTorch's multi-paragraph advice to turn the check off. Before it, the file
    passes ``check_torch_zip`` (no zip bomb, no pickle built to be slow); a path is opened once, as
    a regular file (a FIFO would hang), and that open file is what both read.
    """
    if isinstance(source, (str, os.PathLike)):
        with open_regular(source, what, follow_links=True) as f:
            return safe_torch_load(f, what, allow, keep)  # type: ignore[arg-type]
    check_torch_zip(source, what)
    try:
        if allow:
            with torch.serialization.safe_globals(list(allow)):
                return torch.load(source, map_location="cpu", weights_only=True)
        return torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        opcode = re.search(r"Unsupported operand (\d+)", str(e))
        if opcode:
            raise UsageError(f"{what} is not readable by torch's weights-only loader: its pickle uses "
                             f"opcode {int(opcode[1])}, which that loader does not know (torch.save "
                             "with its default pickle_protocol=2 writes none); nothing was loaded") from None
        if "weights only" in str(e).lower() or "WeightsUnpickler" in str(e):
            refused = refused_globals(source, str(e), allow)
            raise UsageError(f"{what} asks to run code when loaded: the safe loader refused "
                             f"{refused}; nothing was loaded (a checkpoint needs only tensors and "
                             "plain data: this file was written by other code or tampered with)") from None
        raise UsageError(unreadable(what, e)) from None
    except Exception as e:  # zip/pickle errors of a truncated or foreign file
        if isinstance(e, keep) and "PytorchStreamReader" not in str(e) and "zip" not in str(e):
            raise
        raise UsageError(unreadable(what, e)) from None


def unreadable(what: str, e: BaseException) -> str:
    """The one line for a file that is not a readable ``torch.save`` file."""
    reason = " ".join(str(e).split())[:160]
    return f"{what} is not readable (truncated or not a torch.save file): {type(e).__name__}: {reason}"


def refused_globals(source: Any, message: str = "", allow: Sequence[Any] = ()) -> str:
    """The globals a pickle names that the weights-only loader does not admit, as text
    (``posix.system``); found by reading the pickle's opcodes, never by running it."""
    names: list[str] = []
    try:
        if hasattr(source, "seek"):
            source.seek(0)
        if allow:
            with torch.serialization.safe_globals(list(allow)):
                names = list(torch.serialization.get_unsafe_globals_in_checkpoint(source))
        else:
            names = list(torch.serialization.get_unsafe_globals_in_checkpoint(source))
    except Exception:  # noqa: BLE001 - not a zip file, or an older torch: read the error instead
        names = []
    if not names:
        names = re.findall(r"GLOBAL ([\w.]+)", message) or re.findall(r"got <class '([\w.]+)'>", message)
    if not names:
        return "an object it does not admit"
    unique = list(dict.fromkeys(names))
    return ", ".join(unique[:3]) + (", ..." if len(unique) > 3 else "")
