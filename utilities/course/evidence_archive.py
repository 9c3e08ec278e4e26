"""``fsdp-course evidence --pack`` / ``--unpack``: an evidence folder into one .tar.gz, and an
archive merged back into its folder. No name in an archive decides a path: its raw tar headers are
walked before ``tarfile`` parses any (``scan_archive``), every member must be the manifest or a
file of a known step, and only what the folder's own manifest lists is replaced.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import tarfile
import tempfile
from collections.abc import Iterable
from pathlib import Path

from utilities.course.catalog import REPO_ROOT
from utilities.course.evidence import (
    EVIDENCE_ROOT,
    LOG_LIMIT_BYTES,
    MAX_NAME_CHARS,
    PACK_LIMIT_BYTES,
    SAFE_NAME,
    SCHEMA,
    Manifest,
    gpu_steps,
    repo_relative,
)
from utilities.errors import UsageError, bad_value
from utilities.owned_paths import folder_state, owned_entry, replaceable, staging_folder

MAX_MEMBERS = 2048  # an archive --pack writes holds a few hundred files
MAX_HEADER_BYTES = 4096  # a pax header or a GNU long name longer than this is not ours


# -- one archive back, merged here ----------------------------------------------------------------
def pack(folder: Path, archive: Path, limit: int = PACK_LIMIT_BYTES) -> int:
    """Write the evidence folder into one .tar.gz (under ``limit``: the largest logs are cut to their
    tails until it fits); its size in bytes."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and not p.is_symlink())
    cut = 0
    while True:
        archive.parent.mkdir(parents=True, exist_ok=True)
        tmp = archive.with_name(archive.name + ".tmp")
        with tarfile.open(tmp, "w:gz") as tar:
            for path in files:
                data = path.read_bytes()
                if cut and path.suffix == ".log" and len(data) > cut:
                    data = b"[... earlier output cut ...]\n" + data[-cut:]
                info = tarfile.TarInfo(path.relative_to(folder).as_posix())
                info.size, info.mtime, info.mode = len(data), int(path.stat().st_mtime), 0o644
                tar.addfile(info, io.BytesIO(data))
        size = tmp.stat().st_size
        if size <= limit or cut == 4096:
            os.replace(tmp, archive)
            return size
        cut = max(4096, (cut or LOG_LIMIT_BYTES) // 4)


def _refuse(archive: Path, why: str) -> UsageError:
    return UsageError(f"--unpack {str(archive)!r} is not allowed: {why}; allowed: a .tar.gz "
                      "`fsdp-course evidence --pack` wrote")


def _tar_number(field: bytes) -> int:
    """A tar header's size field: octal digits, or base-256 when its first byte has the high bit."""
    if field[:1] and field[0] & 0x80:
        return int.from_bytes(field[1:], "big")
    digits = field.split(b"\0", 1)[0].strip() or b"0"
    if not re.fullmatch(rb"[0-7]{1,12}", digits):
        raise ValueError("not a tar header")
    return int(digits, 8)


def scan_archive(archive: Path, limit: int, max_members: int = MAX_MEMBERS) -> None:
    """Walk the archive's raw tar headers before ``tarfile`` parses any: at most ``max_members``
    headers of any kind, plain files and folders only (links, devices and FIFOs are refused), a pax
    header or GNU long name of at most ``MAX_HEADER_BYTES``, at most ``limit`` bytes in all. Its work
    is bounded by ``limit``; a truncated or corrupt archive is refused in one line."""
    import gzip
    import zlib

    allowed_types = {b"0", b"\0", b"5", b"x", b"L"}
    try:
        with gzip.open(archive, "rb") as raw:
            headers = total = 0
            restated = None  # a pax header's size for the member after it, as tarfile will read it
            while True:
                header = raw.read(512)
                if len(header) < 512:
                    raise _refuse(archive, "it ends inside a tar header (truncated)")
                if header == bytes(512):
                    return
                headers += 1
                if headers > max_members:
                    raise _refuse(archive, f"it holds more than {max_members:,} members")
                kind, size = header[156:157], _tar_number(header[124:136])
                if restated is not None and kind not in (b"x", b"L"):
                    size, restated = max(size, restated), None
                if kind not in allowed_types:
                    raise _refuse(archive, f"a member of tar type {kind!r} (only plain files and folders)")
                if kind in (b"x", b"L") and size > MAX_HEADER_BYTES:
                    raise _refuse(archive, f"a {size:,}-byte extended header or long name")
                total += size
                if total > limit:
                    raise _refuse(archive, f"it holds more than {limit // 2**20} MiB")
                remaining = -(-size // 512) * 512
                if kind == b"x":  # read it (at most MAX_HEADER_BYTES) for a restated size
                    block = raw.read(remaining)
                    remaining = 0
                    found = re.search(rb"(?:^|\n)\d+ size=(\d{1,20})\n", block[:size])
                    restated = int(found.group(1)) if found else restated
                while remaining:
                    block = raw.read(min(remaining, 2**20))
                    if not block:
                        raise _refuse(archive, "it ends inside a member (truncated)")
                    remaining -= len(block)
    except UsageError:
        raise
    except (OSError, EOFError, ValueError, zlib.error) as e:
        raise _refuse(archive, f"{type(e).__name__}: {str(e)[:100]}") from None


def _safe_members(tar: tarfile.TarFile, archive: Path, known: set[str], limit: int) -> list[tarfile.TarInfo]:
    """The archive's files, each the manifest, ``STEP.log`` or ``STEP/FILE`` (one folder more at most)
    for a step of the catalog (``known``), named in letters, digits, '.', '_' and '-', at most
    ``MAX_NAME_CHARS`` each, no name twice, no file where another needs a folder, at most ``limit``
    bytes in all."""
    members, names, total = [], set(), 0
    allowed = ("allowed: manifest.json, STEP.log and STEP/FILE for a step `fsdp-course evidence --plan` "
               "lists, named in letters, digits, '.', '_', '-'")
    for member in tar.getmembers():
        parts = member.name.split("/")
        if member.isdir():
            continue
        step = parts[0][:-4] if len(parts) == 1 and parts[0].endswith(".log") else parts[0]
        if (not member.isfile() or len(parts) > 3 or ".." in parts
                or not all(SAFE_NAME.fullmatch(p) and len(p) <= MAX_NAME_CHARS for p in parts)
                or (member.name != "manifest.json" and step not in known)):
            raise UsageError(f"--unpack: {member.name[:120]!r} is not allowed in an evidence archive; "
                             f"{allowed}")
        total += member.size  # as tarfile reads it (a pax header may restate a member's size)
        if total > limit:
            raise UsageError(f"--unpack {str(archive)!r} is not allowed: it holds more than "
                             f"{limit // 2**20} MiB")
        names.add(member.name)
        members.append(member)
    for name in names:
        folders = ["/".join(name.split("/")[:i]) for i in range(1, name.count("/") + 1)]
        if any(folder in names for folder in folders):
            raise UsageError(f"--unpack: {name[:120]!r} is not allowed in an evidence archive: a file "
                             "of that name's folder is in it too")
    if len(names) != len(members):
        raise UsageError(f"--unpack {str(archive)!r} is not allowed: it holds a name twice")
    return members


def _evidence_folder(into: Path) -> Path:
    """``into`` as a folder an unpack may write (``owned_paths.folder_state``): a new or empty
    folder, or an evidence folder (marked by a manifest ``fsdp-course evidence`` wrote); never a
    link."""
    state = folder_state(into, "manifest.json")
    if state in ("link", "file"):
        raise bad_value("--into", str(into), "a folder (not a link or a file)")
    if state == "foreign" or (state == "marked" and Manifest.read(into / "manifest.json") is None):
        raise bad_value("--into", str(into), "a new or empty folder, or an evidence folder (one with "
                        "the manifest.json `fsdp-course evidence` writes)")
    return into


def unpack(archive: Path, into: Path | None = None, root: Path = REPO_ROOT,
           known: Iterable[str] | None = None) -> tuple[Path, list[str]]:
    """Merge an archive into its evidence folder (``into``, else the folder its manifest names, which
    must lie under benchmarks/results/gpu): a step's newer record, log and files replace older ones.
    No name in the archive decides a path: every member must be the manifest or a file of a step of
    the catalog (``known``, default every ``gpu_steps`` name), it is extracted to a private staging
    folder first, and only a step folder or log the folder's own manifest lists is replaced (moved
    into the staging folder, which is then deleted). The folder and the steps taken from the archive."""
    known = set(known) if known is not None else {s.name for s in gpu_steps()}
    limit = 8 * PACK_LIMIT_BYTES
    scan_archive(archive, limit)
    try:
        tar = tarfile.open(archive, "r:gz")
    except (OSError, tarfile.TarError, EOFError) as e:
        raise _refuse(archive, type(e).__name__) from None
    with tar, tempfile.TemporaryDirectory(prefix="fsdp-course-unpack-") as tmp:
        try:
            members = _safe_members(tar, archive, known, limit)
            if "manifest.json" not in {m.name for m in members}:
                raise UsageError(f"--unpack {str(archive)!r} is not allowed: no manifest.json in it")
            staging = Path(tmp)
            for member in members:
                target = staging.joinpath(*member.name.split("/"))
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(tar.extractfile(member).read())
        except (OSError, tarfile.TarError, EOFError) as e:
            raise _refuse(archive, type(e).__name__) from None
        incoming = Manifest.read(staging / "manifest.json")
        if incoming is None:
            raise UsageError(f"--unpack {str(archive)!r} is not allowed: its manifest is not schema {SCHEMA}")
        if into is None:
            relative = Path(incoming.folder)
            if (relative.is_absolute() or relative.parent != EVIDENCE_ROOT
                    or not SAFE_NAME.fullmatch(relative.name)):
                raise UsageError(f"--unpack: the archive's folder {incoming.folder[:120]!r} is not allowed; "
                                 f"allowed: {EVIDENCE_ROOT}/NAME (or give --into)")
            into = root / relative
        into = _evidence_folder(into)
        current = Manifest.read(into / "manifest.json") if into.is_dir() else None
        current = current or Manifest(folder=incoming.folder)
        unknown = sorted(set(incoming.steps) - known)
        if unknown:
            raise UsageError(f"--unpack: step {unknown[0][:120]!r} is not allowed; allowed: a step "
                             "`fsdp-course evidence --plan` lists")
        taken = [name for name, record in incoming.steps.items()
                 if name not in current.steps or current.steps[name].date <= record.date]
        for name in taken:  # what will be replaced must be the folder's own, before anything moves
            for leaf, kind in ((name, "folder"), (f"{name}.log", "file")):
                path = owned_entry(into, leaf, "--unpack")
                if not replaceable(path, name in current.steps, kind):
                    raise UsageError(f"--unpack: {repo_relative(path)!r} is in the way and is not this "
                                     "evidence folder's own; move it away and unpack again")
        replaced = staging_folder(into, "unpack")
        try:
            for name in taken:
                current.steps[name] = incoming.steps[name]
                for leaf in (name, f"{name}.log"):
                    if os.path.lexists(into / leaf):
                        os.replace(into / leaf, replaced / leaf)
                    source = staging / leaf
                    if source.is_dir():
                        shutil.copytree(source, replaced / f"new-{leaf}")
                        os.replace(replaced / f"new-{leaf}", into / leaf)
                    elif source.is_file():
                        shutil.copyfile(source, replaced / f"new-{leaf}")
                        os.replace(replaced / f"new-{leaf}", into / leaf)
            known_chunks = {json.dumps(c, sort_keys=True) for c in current.chunks}
            current.chunks += [c for c in incoming.chunks
                               if json.dumps(c, sort_keys=True) not in known_chunks]
            current.chunks.sort(key=lambda c: c.get("date", ""))
            current.write(into / "manifest.json")
        finally:
            shutil.rmtree(replaced, ignore_errors=True)
    return into, taken
