"""Builders of hostile checkpoint bytes, shared by the readers' attack tests and their fuzzing:
zips written record by record (with central directories no zip writer makes) and pickles that play
with the memo."""

from __future__ import annotations

import io
import struct
import zipfile

import torch


def memo_op(kind: str, index: int) -> bytes:
    return {"put": b"q" + bytes([index]), "get": b"h" + bytes([index]), "memoize": b"\x94",
            "long_get": b"j" + struct.pack("<I", index)}[kind]


def memo_dag(depth: int, items: int = 2) -> bytes:
    """Opcodes that push a ``depth``-deep tuple whose ``items`` (2 or 3) items are one memoized
    tuple: memo i+1 = (memo i, memo i), 6 bytes a level, ``items**depth`` parts when walked."""
    return b")\x94" + b"".join(b"0" + (b"h" + bytes([i])) * items + (b"\x86" if items == 2 else b"\x87")
                              + b"\x94" for i in range(depth))


def torch_file_with_pickle(data_pkl: bytes) -> bytes:
    """A torch.save zip whose data.pkl is ``data_pkl`` (its other records as torch.save wrote them)."""
    return build_zip([(name, data_pkl if name.endswith("/data.pkl") else body)
                      for name, body in torch_save_records({"format": "fuzz"})])


def local_record(name: str, body: bytes) -> bytes:
    """A stored zip record: its local header, name and bytes."""
    import binascii

    return struct.pack("<4s5H3I2H", b"PK\x03\x04", 20, 0, 0, 0, 0, binascii.crc32(body), len(body),
                       len(body), len(name.encode()), 0) + name.encode() + body


def build_zip(records: list[tuple[str, bytes]], entries: list[tuple[str, int, int, int, int]] | None
              = None) -> bytes:
    """A zip of stored ``records`` (name, bytes) side by side. Its central directory lists
    ``entries``: (name, index of the record it points at, bytes added to that record's offset,
    bytes added to its declared size, compression method); by default one entry per record, as
    written. What no zip writer makes: two names for one record, a record inside another."""
    import binascii

    out, offsets = bytearray(), []
    for name, body in records:
        offsets.append(len(out))
        out += local_record(name, body)
    if entries is None:
        entries = [(name, i, 0, 0, 0) for i, (name, _) in enumerate(records)]
    directory = bytearray()
    for name, index, shift, grow, method in entries:
        body = records[index][1]
        size = max(0, min(len(body) + grow, 2**32 - 1))
        directory += struct.pack("<4s6H3I5H2I", b"PK\x01\x02", 20, 20, 0, method, 0, 0,
                                 binascii.crc32(body), size, size, len(name.encode()), 0, 0, 0, 0, 0,
                                 max(0, min(offsets[index] + shift, 2**32 - 1))) + name.encode()
    end = struct.pack("<4s4H2IH", b"PK\x05\x06", 0, 0, len(entries), len(entries), len(directory),
                      len(out), 0)
    return bytes(out + directory + end)


def torch_save_records(obj) -> list[tuple[str, bytes]]:
    """The records (name, bytes) of ``torch.save(obj)``, in order."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:
        return [(i.filename, z.read(i)) for i in z.infolist()]
