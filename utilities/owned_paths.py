"""What the course may write, replace or delete: only what it wrote, at names it chose.

Every writer that replaces or deletes among files it does not own (the HF export, the DCP
converter and checkpoint saves, the evidence unpack) follows these rules:

1. A folder the course writes into is new, empty, or marked as the course's by a file it wrote
   there (``folder_state``): an export's ``OWNED_MARKER``, an evidence folder's manifest, a DCP
   checkpoint's ``.metadata``. A link, a file, or a folder of other files is refused.
2. In it, only an entry the marker lists, still of the kind the course wrote (a regular file or a
   folder, never a link), is replaced or deleted (``replaceable``, ``discard_owned``); a user's
   file beside it is never touched.
3. What is written is staged beside its target first (``utilities.safe_files.staging_path``:
   ``.NAME.tmp``; ``staging_folder``: a private ``.PREFIX-*`` folder inside it) and published by
   rename, so a kill leaves the old or the new, never half.
4. A destination is a folder and a plain name the course chose (``owned_entry``): never a path
   read from the input.
"""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from utilities.errors import UsageError
from utilities.safe_files import atomic_write_text, open_regular, read_at_most, regular_file_size

# -- the rules -----------------------------------------------------------------------------------------


def folder_state(folder: Path, marker: str) -> str:
    """What ``folder`` is to a writer, without following a link: ``"missing"``, ``"empty"``,
    ``"marked"`` (it holds ``marker``, the file the course writes into a folder of its own, as a
    regular file), ``"link"``, ``"file"`` (anything but a folder), or ``"foreign"`` (a folder of
    other files: not the course's to write into)."""
    try:
        mode = os.lstat(folder).st_mode
    except FileNotFoundError:
        return "missing"
    if stat.S_ISLNK(mode):
        return "link"
    if not stat.S_ISDIR(mode):
        return "file"
    if regular_file_size(folder / marker) is not None:
        return "marked"
    return "foreign" if os.listdir(folder) else "empty"


def replaceable(path: Path, listed: bool, kind: str) -> bool:
    """Whether a writer may replace or delete ``path``: it is missing, or its folder's marker lists
    it (``listed``) and it is still of the ``kind`` the course wrote there (``"file"``: a regular
    file; ``"folder"``), not a link."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return True
    is_kind = stat.S_ISREG(mode) if kind == "file" else stat.S_ISDIR(mode)
    return listed and is_kind


def plain_name(name: Any) -> bool:
    """Whether ``name`` names an entry directly inside a folder: not empty, ``.``, ``..`` or the
    marker, no ``/``, no NUL."""
    return isinstance(name, str) and name not in ("", ".", "..", OWNED_MARKER) and "/" not in name \
        and "\0" not in name


def owned_entry(folder: Path, name: str, what: str) -> Path:
    """``folder / name`` for a ``name`` the course chose (a step, a file it writes); anything but a
    plain name is refused in one ``UsageError`` line."""
    if not plain_name(name):
        raise UsageError(f"{what}: {str(name)[:120]!r} is not allowed as a name; allowed: a plain "
                         "name inside the folder")
    return folder / name


def staging_folder(folder: Path, prefix: str) -> Path:
    """A new private folder ``.PREFIX-*`` inside ``folder`` (made if missing), where entries are
    staged and from which they are renamed into place (same filesystem); delete it afterwards."""
    folder.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{prefix}-", dir=folder))


# -- folders the course writes among a user's files ---------------------------------------------------

OWNED_MARKER = ".fsdp-course-files.json"  # in a folder the course wrote: the names it wrote there
_MARKER_BYTES = 1 << 20


def owned_names(folder: Path, what: str) -> frozenset[str] | None:
    """The names in ``folder`` that the course wrote, as its ``OWNED_MARKER`` lists them; every
    name in a staging folder (its marker says the whole folder is the course's); None where there
    is no marker. A marker that is not one the course writes is refused in one ``UsageError`` line:
    nothing is deleted on its word."""
    import json

    marker = folder / OWNED_MARKER
    if not os.path.lexists(marker):
        return None
    with open_regular(marker, f"{what}: the marker") as f:
        data = read_at_most(f, _MARKER_BYTES)
    try:
        content = json.loads(data) if len(data) <= _MARKER_BYTES else None
    except (ValueError, RecursionError):
        content = None
    files = content.get("files") if isinstance(content, dict) and content.get("written_by") == \
        "fsdp-course" else None
    if files == "all":
        return frozenset(os.listdir(folder)) - {OWNED_MARKER}
    if not isinstance(files, list) or not all(plain_name(n) for n in files):
        raise UsageError(f"{what}: its marker {str(marker)!r} is not one the course writes (a JSON "
                         "object listing plain file names); refused, nothing was replaced or deleted")
    return frozenset(files)


def mark_owned(folder: Path, names: Sequence[str] | None) -> None:
    """Write ``folder``'s ``OWNED_MARKER``: the course wrote ``names`` there (None: a staging folder,
    all of it the course's)."""
    import json

    atomic_write_text(folder / OWNED_MARKER, json.dumps(
        {"written_by": "fsdp-course", "files": "all" if names is None else sorted(names)}) + "\n",
        "marker")


def same_entry(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` are one file (hard links) or two links to one place; links are not
    followed."""
    try:
        sa, sb = os.lstat(a), os.lstat(b)
    except OSError:
        return False
    if stat.S_ISLNK(sa.st_mode) and stat.S_ISLNK(sb.st_mode):
        return os.readlink(a) == os.readlink(b)
    return stat.S_ISREG(sa.st_mode) and (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def discard_owned(folder: Path, kept_in: Path | None, what: str) -> None:
    """Delete what the course wrote in ``folder``: the files its marker lists and the marker; any
    other entry only where ``kept_in`` holds the same file under its name (a hard link the course
    made to keep a user's file); then ``folder`` if that left it empty. Anything else stays, and so
    does the folder. Links are deleted, never followed; a missing ``folder`` is fine."""
    if not os.path.lexists(folder):
        return
    if os.path.islink(folder) or not folder.is_dir():
        raise UsageError(f"{what}: {str(folder)!r} is not a folder the course wrote; refused, it was "
                         "not deleted")
    names = owned_names(folder, what) or frozenset()
    for entry in os.listdir(folder):
        path = folder / entry
        if entry == OWNED_MARKER:
            continue
        ours = entry in names and (os.path.islink(path) or regular_file_size(path) is not None)
        if ours or (kept_in is not None and same_entry(path, kept_in / entry)):
            path.unlink()
    (folder / OWNED_MARKER).unlink(missing_ok=True)
    try:
        folder.rmdir()
    except OSError:  # something the course did not write is left: it stays
        pass
