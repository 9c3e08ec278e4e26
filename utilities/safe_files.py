"""Reading and writing checkpoint files that someone else may have written or may be changing.

Everything the course does to a file it does not trust, and every write that must never leave a
half-written file, lives here, below ``utilities.dcp`` and ``utilities.state_dict``:

* ``open_regular``: open a file without following a link (inside a checkpoint folder) and refuse
  anything but a regular file, so a FIFO cannot hang a load and a planted link cannot redirect it;
  ``check_output_file`` / ``open_output`` / ``atomic_write_text``: the same for a file the user
  names to be written (``plan --trace``, ``record --out``), never blocking on a FIFO or device;
* writes that never leave half a file or half a folder: ``atomic_torch_save`` (a unique temporary,
  fsync, rename), ``swap_in`` (replace a folder so that a kill at any instant leaves a complete
  one), ``fsync_files`` / ``fsync_dir``, ``remove_path``;
* folders the course writes among a user's files (an HF export): ``OWNED_MARKER`` lists what the
  course wrote there, and ``discard_owned`` deletes only that;
* ``lock_checkpoints``: one run at a time saves into a checkpoint folder (its lock opened relative
  to a folder descriptor opened name by name without following a link: ``open_folder_nofollow``);
* ``safe_torch_load``: ``torch.load(weights_only=True)`` after the file was checked as a zip archive
  (no compressed record, none larger than the file, no two sharing bytes) and its pickle was read
  opcode by opcode (``scan_pickle``: nesting depth, objects of more parts than the file can honestly
  build counting each re-use of a memoized one, and no container whose keys all hash alike);
* ``RestrictedUnpickler``: an unpickler that resolves globals only from an allowlist, sets the
  state only of instances of the classes it is given, and never hashes more than a few distinct
  keys alike into one container, so that a refused file leaves the process as it was and any file
  is read or refused in time proportional to its size.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import shutil
import stat
import struct
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import torch

from utilities.errors import UsageError

# -- opening a file without following a link or blocking on a FIFO ---------------------------------


def open_regular(path: str | os.PathLike, what: str, follow_links: bool = False) -> BinaryIO:
    """``open(path, "rb")`` of a regular file only: a symbolic link (unless ``follow_links``), a
    FIFO, a device or a directory is refused in one ``UsageError`` line naming ``what``. Opened
    non-blocking, so a FIFO cannot hang the check; the file object reads normally."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    if not follow_links:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if not follow_links and os.path.islink(path):
            raise UsageError(f"{what} {str(path)!r} is a symbolic link: refused (the course never "
                             "writes links into a checkpoint; allowed: a regular file)") from None
        raise UsageError(f"{what} {str(path)!r} cannot be opened ({e.strerror})") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise UsageError(f"{what} {str(path)!r} is a {_file_kind(mode)}, not a regular file: "
                             "refused; allowed: a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _file_kind(mode: int) -> str:
    for test, kind in ((stat.S_ISFIFO, "FIFO"), (stat.S_ISDIR, "directory"), (stat.S_ISCHR, "device"),
                       (stat.S_ISBLK, "device"), (stat.S_ISSOCK, "socket"), (stat.S_ISLNK, "link")):
        if test(mode):
            return kind
    return "special file"


def read_at_most(file: BinaryIO, limit: int) -> bytes:
    """Up to ``limit + 1`` bytes of ``file``, read a MiB at a time (one ``read(limit + 1)`` takes
    a buffer of that size first, however short the file): more than ``limit`` says it is too long."""
    pieces, held = [], 0
    while held <= limit:
        piece = file.read(min(1 << 20, limit + 1 - held))
        if not piece:
            break
        pieces.append(piece)
        held += len(piece)
    return b"".join(pieces)


def regular_file_size(path: str | os.PathLike) -> int | None:
    """The size of ``path`` if it is a regular file itself (a link is not followed), else None."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) else None


def check_output_file(path: str | os.PathLike, what: str) -> None:
    """Refuse, in one ``UsageError`` line and without opening it, an output path that names
    something other than a regular file (a FIFO would block the write, a device would take it, a
    folder cannot be replaced by a file); a missing one is fine."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as e:
        raise UsageError(f"{what} {str(path)!r} is not allowed: {e.strerror}; allowed: a writable "
                         "file path") from None
    if not stat.S_ISREG(mode):
        raise UsageError(f"{what} {str(path)!r} is a {_file_kind(mode)}, not a regular file: refused; "
                         "allowed: a new or regular file")


def open_output(path: str | os.PathLike, what: str) -> Any:
    """``open(path, "w")`` that never blocks and writes only a regular file: opened without
    following a link and non-blocking, a FIFO, device, link or folder is refused in one
    ``UsageError`` line before a byte is written (and before it is emptied)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        if os.path.islink(path):
            raise UsageError(f"{what} {str(path)!r} is a symbolic link: refused; allowed: a new or "
                             "regular file") from None
        check_output_file(path, what)
        raise UsageError(f"{what} {str(path)!r} is not allowed: {e.strerror}; allowed: a writable "
                         "file path") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise UsageError(f"{what} {str(path)!r} is a {_file_kind(mode)}, not a regular file: "
                             "refused; allowed: a new or regular file")
        os.ftruncate(fd, 0)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "w")
    except BaseException:
        os.close(fd)
        raise


def atomic_write_text(path: str | os.PathLike, text: str, what: str) -> Path:
    """Write ``text`` to ``path`` whole or not at all: to a unique temporary beside it, fsync, then
    ``os.replace`` (a reader, or a run stopped midway, sees the old file or the new one). ``path``
    itself is never opened (``check_output_file``: a FIFO or device there is refused in one line,
    without blocking); it keeps the old file's permissions (a new one gets the umask's); an
    ``OSError`` of the write propagates."""
    import tempfile

    path = Path(path)
    check_output_file(path, what)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode = os.stat(path).st_mode & 0o777
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return path
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# -- writes that never leave half a file or half a folder ------------------------------------------


def remove_path(path: Path, ignore_errors: bool = False) -> None:
    """Delete ``path``: a folder, or a file or symlink found in its place (``rmtree`` refuses a
    symlink, and ``mkdir`` a name that a file holds); never what a link points to."""
    try:
        if path.is_symlink() or (path.exists() and not path.is_dir()):
            path.unlink()
        elif path.is_dir():
            shutil.rmtree(path)
    except OSError:
        if not ignore_errors:
            raise


def staging_path(path: Path) -> Path:
    """Where a folder is written before ``swap_in`` publishes it as ``path``: ``.NAME.tmp``."""
    return path.parent / f".{path.name}.tmp"


def previous_path(path: Path) -> Path:
    """Where ``swap_in`` keeps the folder it replaces until the new one is in place: ``.NAME.old``."""
    return path.parent / f".{path.name}.old"


def atomic_torch_save(obj: Any, path: Path) -> int:
    """``torch.save`` to a unique temporary file beside ``path``, fsync, then ``os.replace``;
    returns the size written. Two saves at once never share a temporary: each publishes a
    complete file (the last rename wins; keep two runs out of one folder with
    ``lock_checkpoints``)."""
    import tempfile

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path.stat().st_size


def swap_in(tmp: Path, path: Path, discard: Callable[[Path], None] = remove_path) -> None:
    """Replace ``path`` by the complete folder ``tmp`` so that a kill at any instant leaves one.

    0. sync ``tmp`` (writers sync their files, not the names in it);
    1. ``path`` -> ``.NAME.old`` (after deleting an ``.old`` left by an earlier kill: ``path`` is
       complete then); 2. ``tmp`` -> ``path``; 3. delete ``.NAME.old``. Between 1 and 2 only
    ``.old`` and the complete ``tmp`` exist (``utilities.dcp.resolve_checkpoint`` picks ``tmp``,
    the newer one). Never ``rmtree(path)`` before the rename: a kill in between would leave no
    published copy. ``discard`` deletes the folders replaced (``discard_owned`` where the folder
    may hold files that are not the course's).
    """
    old = previous_path(path)
    fsync_dir(tmp)
    if path.exists():
        discard(old)
        os.replace(path, old)
    os.replace(tmp, path)
    fsync_dir(path.parent)
    try:
        discard(old)
    except OSError:
        pass


def exchange_in(tmp: Path, path: Path, discard: Callable[[Path], None] = remove_path) -> bool:
    """Publish the complete folder ``tmp`` as ``path`` with one rename: where ``path`` exists, the
    two are exchanged atomically (Linux ``renameat2(RENAME_EXCHANGE)``) and the old one, now at
    ``tmp``, is deleted; else ``tmp`` is renamed to ``path``. A kill at any instant leaves ``path``
    complete, old or new. Returns False, having done nothing, where the system or filesystem has no
    atomic exchange (the caller falls back to ``swap_in``); ``discard`` deletes the old one."""
    fsync_dir(tmp)
    if not os.path.lexists(path):
        os.replace(tmp, path)
    elif not _rename_exchange(tmp, path):
        return False
    fsync_dir(path.parent)
    try:
        discard(tmp)
    except OSError:
        pass
    return True


def _rename_exchange(a: Path, b: Path) -> bool:
    """``renameat2(a, b, RENAME_EXCHANGE)``; False where libc or the filesystem lacks it."""
    import ctypes
    import errno
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def fsync_files(directory: Path) -> None:
    """Sync every regular file directly in ``directory`` (for writers that do not, e.g.
    ``save_pretrained``); links are not followed."""
    for f in directory.iterdir():
        if regular_file_size(f) is not None:
            fd = os.open(f, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def fsync_dir(directory: Path) -> None:
    """Make the renames in ``directory`` durable (a power cut, not only a kill); a no-op where not
    supported."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


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
    if not isinstance(files, list) or not all(_plain_name(n) for n in files):
        raise UsageError(f"{what}: its marker {str(marker)!r} is not one the course writes (a JSON "
                         "object listing plain file names); refused, nothing was replaced or deleted")
    return frozenset(files)


def _plain_name(name: Any) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..", OWNED_MARKER) and "/" not in name \
        and "\0" not in name


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


# -- one run at a time per checkpoint folder ---------------------------------------------------------


def lock_checkpoints(directory: str | os.PathLike) -> Any:
    """Take ``directory``'s lock for as long as this process lives (keep the returned file open):
    one run at a time saves into a checkpoint folder. A second run into the same folder would
    recover, prune and overwrite under the first one's feet; it is refused in one ``UsageError``
    line naming the holder.

    The lock is the file ``.NAME.lock`` beside the folder *as resolved* (two names for one folder
    through a symlink take one lock), held with ``flock``: the kernel releases it when the process
    ends, however it ends, so a killed run never leaves it taken. It is opened without following a
    link and must be a regular file with no other name (a planted link or hard link would have the
    lock overwrite the file it names). On a network filesystem whose ``flock`` is local to each
    host, runs on two hosts are not kept apart."""
    import fcntl
    import socket

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    real = Path(os.path.realpath(d))
    lock_path = real.parent / f".{real.name}.lock"
    parent = open_folder_nofollow(real.parent, f"checkpoint folder {str(d)!r}")
    flags = os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(lock_path.name, flags, 0o644, dir_fd=parent)
    except OSError as e:
        kind = "a symbolic link" if os.path.islink(lock_path) else f"not usable ({e.strerror})"
        raise UsageError(f"lock file {str(lock_path)!r} of checkpoint folder {str(d)!r} is {kind}: "
                         "refused; allowed: a regular file (delete it and run again)") from None
    finally:
        os.close(parent)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        os.close(fd)
        kind = (f"a {_file_kind(st.st_mode)}" if not stat.S_ISREG(st.st_mode)
                else f"a file with {st.st_nlink} names (a hard link)")
        raise UsageError(f"lock file {str(lock_path)!r} of checkpoint folder {str(d)!r} is {kind}: "
                         "refused; allowed: a regular file of its own (delete it and run again)")
    os.set_blocking(fd, True)
    lock = os.fdopen(fd, "r+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read(200).strip() or "another process"
        lock.close()
        raise UsageError(f"checkpoint folder {str(d)!r} is in use by {holder}: one run at a time "
                         "may save there; wait for it to end, or give another --out / --ckpt-dir"
                         ) from None
    lock.seek(0)
    lock.truncate()
    lock.write(f"pid {os.getpid()} on {socket.gethostname()} since "
               f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    lock.flush()
    return lock


def open_folder_nofollow(folder: Path, what: str) -> int:
    """A descriptor of the folder ``folder`` (an absolute path without links, as ``realpath``
    gives it), opened one name at a time from ``/`` with ``O_NOFOLLOW``: a name on the way swapped
    for a link after ``folder`` was resolved is refused in one ``UsageError`` line instead of
    followed. Work relative to it (``dir_fd=``), then close it."""
    import errno

    # O_PATH (Linux) needs no read permission: a parent of mode 0711 (a home folder) still opens
    access = getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(folder.anchor or "/", access)
    try:
        for name in folder.parts[1:]:
            try:
                inner = os.open(name, access | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as e:
                if e.errno not in (errno.ELOOP, errno.ENOTDIR, errno.ENOENT):
                    raise UsageError(f"{what}: {str(folder)!r} cannot be opened ({e.strerror} at "
                                     f"{name!r})") from None
                raise UsageError(f"{what}: {name!r} in {str(folder)!r} changed while it was opened "
                                 f"({e.strerror}: a folder swapped for a link?); refused; allowed: "
                                 "folders that stay as they are") from None
            os.close(fd)
            fd = inner
    except BaseException:
        os.close(fd)
        raise
    return fd


# -- reading a pickle's opcodes without running them --------------------------------------------------


class RefusedGlobal(pickle.UnpicklingError):
    """A pickle names a global (or asks for something) that is not admitted: written to run code."""


class RefusedChange(pickle.UnpicklingError):
    """A pickle asks to change an object it did not create (a class, a function, a shared cache)."""


class DamagedPickle(pickle.UnpicklingError):
    """A pickle that is truncated, malformed, or built to exhaust the reader."""


DISTINCT_KEYS_PER_HASH = 8  # distinct keys of one hash in one container: real data has 1 or 2
OPAQUE_KEYS = 1024  # keys of one container whose hash scan_pickle cannot know (objects)
_UNKNOWN = object()


class _KeyHashes:
    """The keys one container received so far, by hash: refuses the container once more than
    ``DISTINCT_KEYS_PER_HASH`` distinct keys share a hash (each new one would be compared with all
    of them: a dict of n such keys costs n * n / 2 comparisons to build)."""

    __slots__ = ("by_hash",)

    def __init__(self):
        self.by_hash: dict[int, list[Any]] = {}

    def add(self, key: Any) -> None:
        try:
            h = hash(key)
        except TypeError:
            raise DamagedPickle(f"uses an unhashable {type(key).__name__} as a key") from None
        seen = self.by_hash.setdefault(h, [])
        if any(k is key or (type(k) is type(key) and k == key) for k in seen):
            return
        if len(seen) >= DISTINCT_KEYS_PER_HASH:
            raise DamagedPickle(f"holds more than {DISTINCT_KEYS_PER_HASH} distinct keys that hash "
                                f"alike (such as {_short(key)}): built to make reading it slow")
        seen.append(key)


def printable(text: str, limit: int = 200) -> str:
    """``text`` as one line for a message: what is not printable escaped (a name read from a file
    may hold a newline), at most ``limit`` characters."""
    shown = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[:limit])
    return shown + ("..." if len(text) > limit else "")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


class _Node:
    """What ``scan_pickle`` knows of one object the pickle builds: how deeply it nests, whether it
    already sits inside another object (then it may no longer grow), its value where it is a plain
    hashable one (a number, a string, a tuple of them), the global it names, its items (tuples and
    lists) and the keys it received (containers)."""

    __slots__ = ("depth", "parts", "inside", "value", "name", "items", "keys", "opaque_keys")

    def __init__(self, depth: int = 0, value: Any = _UNKNOWN, name: str | None = None):
        self.depth, self.inside, self.value, self.name = depth, False, value, name
        self.parts = 1  # objects in it, each re-use of a memoized one counted again
        self.items: list[_Node] | None = None
        self.keys: _KeyHashes | None = None
        self.opaque_keys = 0

    def add_keys(self, keys: Sequence[_Node]) -> None:
        if self.keys is None:
            self.keys = _KeyHashes()
        for key in keys:
            if key.value is _UNKNOWN:
                self.opaque_keys += 1
                if self.opaque_keys > OPAQUE_KEYS:
                    raise DamagedPickle(f"uses more than {OPAQUE_KEYS} objects as keys of one "
                                        "container")
            else:
                self.keys.add(key.value)


def pickle_parts_budget(size: int) -> int:
    """How many objects a pickle of ``size`` bytes may build, counting each re-use of a memoized one
    again: a walk of the result (hashing a key, comparing two, reading the loaded state) visits
    that many. One opcode builds at most one object, so a pickle without shared parts stays
    under its size; sharing a tensor's storage or a name a few times stays far under this."""
    return 16 * size + (1 << 20)


_MARK = object()
_GROWS = {"APPEND", "APPENDS", "SETITEM", "SETITEMS", "ADDITEMS", "BUILD"}  # change the object below
_CONSTANTS = {"NONE": None, "NEWTRUE": True, "NEWFALSE": False}
_TUPLES = {"EMPTY_TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "TUPLE"}
_CONTAINER_CALLS = {"builtins.set", "builtins.frozenset", "builtins.dict", "collections.OrderedDict",
                    "collections.Counter"}
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*\Z")


def scan_pickle(data: bytes, max_depth: int, admitted: Callable[[str, str], bool],
                guard_keys: bool = True) -> None:
    """Read every opcode of ``data`` (nothing is built or called) and follow the unpickler's stack,
    to refuse a pickle that is truncated, malformed, or builds objects nested deeper than
    ``max_depth`` (``DamagedPickle``), or that names a global ``admitted(module, name)`` refuses
    (``RefusedGlobal``, even when the pickle is also malformed further on: it was written to run
    code, not damaged by chance: random bytes almost never spell two dotted identifiers).

    Deep nesting must be refused before unpickling: hashing a dict key or set item recurses in C
    once per level, and a few hundred thousand levels crash the interpreter.

    With ``guard_keys``, every key a dict, set or frozenset receives is followed too: more than
    ``DISTINCT_KEYS_PER_HASH`` distinct plain keys (numbers, strings, tuples of them,
    ``torch.Size``) with one hash, or more than ``OPAQUE_KEYS`` keys that are objects, in one
    container are refused, as is a container built by calling ``set`` / ``dict`` /
    ``OrderedDict`` / ``Counter`` on anything but a dict or a list whose keys were followed. Such
    keys make building the container quadratic (``2**61 - 1`` times anything hashes like 0).

    An object that is already inside another may not grow (``APPEND`` to a list that is an item of
    a tuple): it would deepen its container after the container's depth was counted. Pickles of
    cyclic objects need that; checkpoints have none.

    Work, not only size, is bounded: every object counts the objects in it, each re-use of a
    memoized one (``BINGET``) counted again, and more than ``pickle_parts_budget(len(data))`` in
    one is refused (``DamagedPickle``), whatever ``guard_keys`` says. A 40-deep tuple whose two
    items are one memoized tuple is 208 bytes and 2**40 parts: hashing it as a dict key never
    ends, and nothing that walks what a pickle builds can take longer than its parts.
    """
    import pickletools

    stack: list[Any] = []
    memo: dict[Any, _Node] = {}
    budget = pickle_parts_budget(len(data))

    def counted(node: _Node, children: list[_Node]) -> _Node:
        node.parts = min(node.parts + sum(c.parts for c in children), budget + 1)
        if node.parts > budget:
            raise DamagedPickle(f"builds an object of more than {budget} parts, counting each re-use of "
                                "a memoized one (shared through the memo to make reading it slow)")
        return node

    def pop() -> Any:
        if not stack:
            raise DamagedPickle("pops an empty stack")
        return stack.pop()

    def pop_node() -> _Node:
        node = pop()
        if node is _MARK:
            raise DamagedPickle("finds a mark where an object belongs")
        return node

    def pop_to_mark() -> list[_Node]:
        items = []
        while True:
            item = pop()
            if item is _MARK:
                return items[::-1]
            items.append(item)

    def nested(children: list[_Node]) -> int:
        for child in children:
            child.inside = True
        depth = 1 + max((c.depth for c in children), default=-1)
        if depth > max_depth:
            raise DamagedPickle(f"nests objects more than {max_depth} levels deep")
        return depth

    refused: list[str] = []

    def named(module: Any, name: Any) -> str | None:
        if isinstance(module, str) and isinstance(name, str) and _IDENTIFIER.match(module) \
                and _IDENTIFIER.match(name):
            if not admitted(module, name):
                refused.append(f"{module}.{name}")
            return f"{module}.{name}"
        return None

    def built(op_name: str, children: list[_Node], operands: list[_Node]) -> _Node:
        node = counted(_Node(nested(children)), children) if children else _Node()
        if op_name in ("EMPTY_DICT", "EMPTY_SET"):
            node.keys = _KeyHashes()
        elif op_name in _TUPLES:
            node.items = children
            if all(c.value is not _UNKNOWN for c in children):
                node.value = tuple(c.value for c in children)
        elif op_name in ("EMPTY_LIST", "LIST"):
            node.items = list(children)
        elif guard_keys and op_name == "DICT":
            node.add_keys(children[0::2])
        elif guard_keys and op_name == "FROZENSET":
            node.add_keys(children)
        elif op_name == "REDUCE" and guard_keys:
            func, args = operands
            call_args = args.items if args.items is not None else None
            if func.name == "torch.Size" and call_args and len(call_args) == 1 \
                    and isinstance(call_args[0].value, tuple):
                node.value = call_args[0].value  # a Size hashes and compares as its tuple
            elif func.name == "builtins.complex" and call_args is not None \
                    and all(isinstance(a.value, (int, float)) for a in call_args):
                node.value = complex(*(a.value for a in call_args[:2]))
            elif func.name in _CONTAINER_CALLS:
                if call_args is None or len(call_args) > 1:
                    raise DamagedPickle(f"calls {func.name} with arguments torch.save never writes")
                if call_args:
                    source = call_args[0]
                    if source.keys is not None:  # a dict: its keys were followed
                        node.add_keys([])
                    elif source.items is not None and func.name in ("builtins.set",
                                                                     "builtins.frozenset"):
                        node.add_keys(source.items)
                    else:
                        raise DamagedPickle(f"builds a {func.name} from something other than a "
                                            "dict or a list")
        return node

    stopped = False
    try:
        for op, arg, _pos in pickletools.genops(data):
            name = op.name
            if name == "STOP":
                pop_node()
                stopped = True
            elif name in ("PROTO", "FRAME"):
                continue
            elif name == "MARK":
                stack.append(_MARK)
            elif name == "POP":
                pop()
            elif name == "POP_MARK":
                pop_to_mark()
            elif name == "DUP":
                node = pop_node()
                stack += [node, node]
            elif name in ("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"):
                if not stack or stack[-1] is _MARK:
                    raise DamagedPickle("memoizes nothing")
                memo[len(memo) if name == "MEMOIZE" else arg] = stack[-1]
            elif name == "GLOBAL" or name == "INST":
                full = named(*(arg.split(" ", 1) if " " in arg else (arg, None)))
                if name == "GLOBAL":
                    stack.append(_Node(name=full))
                else:
                    children = pop_to_mark()
                    stack.append(counted(_Node(nested(children)), children))
            elif name == "STACK_GLOBAL":
                module_node, name_node = [pop_node() for _ in range(2)][::-1]
                stack.append(_Node(name=named(module_node.value, name_node.value)))
            elif name in ("GET", "BINGET", "LONG_BINGET"):
                if arg not in memo:
                    raise DamagedPickle(f"refers to memo entry {arg!r} that was never stored")
                stack.append(memo[arg])
            elif name in _CONSTANTS:
                stack.append(_Node(value=_CONSTANTS[name]))
            elif not op.stack_before and len(op.stack_after) == 1 and arg is not None:
                plain = isinstance(arg, (str, bytes, int, float)) and not isinstance(arg, bytearray)
                stack.append(_Node(value=arg if plain else _UNKNOWN))
            else:
                before = op.stack_before
                if pickletools.stackslice in before:  # the objects down to the last mark
                    fixed = before.index(pickletools.markobject)
                    sliced = pop_to_mark()
                else:
                    sliced, fixed = [], len(before)
                operands = [pop_node() for _ in range(fixed)][::-1]
                if name in _GROWS:
                    target, children = operands[0], operands[1:] + sliced
                    if target.inside:
                        raise DamagedPickle("changes an object after placing it in another")
                    target.depth = max(target.depth, nested(children))
                    counted(target, children)
                    if guard_keys and name in ("SETITEM", "SETITEMS"):
                        target.add_keys(children[0::2])
                    elif guard_keys and name == "ADDITEMS":
                        target.add_keys(children)
                    elif name in ("APPEND", "APPENDS") and target.items is not None:
                        target.items.extend(children)
                    stack.append(target)
                else:
                    children = operands + sliced
                    for _ in op.stack_after:
                        stack.append(built(name, children, operands))
    except Exception as e:  # noqa: BLE001 - pickletools on a truncated or foreign stream
        if refused:
            raise RefusedGlobal(refused[0]) from None
        if isinstance(e, DamagedPickle):
            raise
        reason = " ".join(str(e).split())[:120]
        raise DamagedPickle(reason or type(e).__name__) from None
    if refused:
        raise RefusedGlobal(refused[0])
    if not stopped:
        raise DamagedPickle("ends before its STOP opcode")


# -- an unpickler that changes nothing but the objects it builds ---------------------------------------


def enum_member(enums: set[type], cls: Any, name: Any) -> Any:
    """What ``builtins.getattr`` may do in a checkpoint's pickle: name a member of one of ``enums``
    (some Python versions, 3.11.2 among them, pickle an enum member as ``getattr(cls, "NAME")``);
    any other attribute of anything is refused."""
    if cls in enums and isinstance(name, str) and name in cls.__members__:
        return cls[name]
    raise RefusedGlobal(f"builtins.getattr({getattr(cls, '__name__', type(cls).__name__)}, {name!r})")


class RestrictedUnpickler(pickle._Unpickler):
    """Python's own unpickler (the pure-Python one, so that each opcode can be checked) reading
    ``data``, that

    * resolves a global only from ``allowed`` (``(module, name) -> object``): a pickle naming
      ``posix.system`` is refused before anything is called;
    * sets state (``BUILD``) and creates instances (``NEWOBJ``) only of the classes in
      ``buildable``, which it creates itself: never of a class, a function or any object the
      process shares (a ``BUILD`` on ``PosixPath`` would set ``PosixPath.__truediv__`` for every
      later ``a / b``); a class without its own ``__setstate__`` takes only its dataclass fields;
    * adds items only to the lists, dicts and sets it created, and refuses a container once more
      than ``DISTINCT_KEYS_PER_HASH`` distinct keys share a hash, so no file makes reading it
      quadratic;
    * knows no ``INST`` / ``OBJ`` (protocol 0 and 1 instances) and no persistent ids.

    What it builds before it refuses a file is only its own new objects: a refused file leaves the
    process as it was.
    """

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, data: bytes, allowed: dict[tuple[str, str], Any], buildable: set[type]):
        super().__init__(io.BytesIO(data))
        self._allowed, self._buildable = allowed, buildable
        self._fields = {cls: _field_names(cls) for cls in buildable}
        self._key_hashes: dict[int, tuple[Any, _KeyHashes]] = {}

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._allowed[(module, name)]
        except KeyError:
            raise RefusedGlobal(printable(f"{module}.{name}")) from None

    def persistent_load(self, pid: Any) -> Any:
        raise RefusedGlobal("a persistent id")

    def _keys_of(self, container: Any) -> _KeyHashes:
        entry = self._key_hashes.get(id(container))
        if entry is None or entry[0] is not container:
            entry = (container, _KeyHashes())  # holding it keeps its id unique while we read
            self._key_hashes[id(container)] = entry
        return entry[1]

    def _into(self, container: Any, kinds: tuple[type, ...], op: str) -> None:
        if type(container) not in kinds:
            raise DamagedPickle(f"applies {op} to a {type(container).__name__}")

    def load_build(self) -> None:
        state = self.stack.pop()
        inst = self.stack[-1]
        cls = type(inst)
        if cls not in self._buildable:
            raise RefusedChange(f"sets the state of {_describe(inst)}, which is not an object it "
                                "built of a class it may build")
        if "__setstate__" in vars(cls):
            inst.__setstate__(state)
            return
        if type(state) is not dict or not all(type(k) is str and k in self._fields[cls]
                                              for k in state):
            raise DamagedPickle(f"gives a {cls.__name__} state that is not its fields")
        inst.__dict__.update(state)

    def load_newobj(self) -> None:
        args = self.stack.pop()
        cls = self.stack.pop()
        if not isinstance(cls, type) or cls not in self._buildable:
            raise RefusedGlobal(f"{_describe(cls)} (to create an object)")
        self.append(cls.__new__(cls, *args))

    def load_newobj_ex(self) -> None:
        if self.stack.pop():
            raise DamagedPickle("passes keyword arguments to a constructor")
        self.load_newobj()

    def load_refused(self) -> None:
        raise RefusedGlobal("a protocol 0/1 instance (INST/OBJ)")

    def load_setitem(self) -> None:
        value = self.stack.pop()
        key = self.stack.pop()
        target = self.stack[-1]
        self._into(target, (dict, OrderedDict), "SETITEM")
        self._keys_of(target).add(key)
        target[key] = value

    def load_setitems(self) -> None:
        items = self.pop_mark()
        target = self.stack[-1]
        self._into(target, (dict, OrderedDict), "SETITEMS")
        keys = self._keys_of(target)
        for i in range(0, len(items) - 1, 2):
            keys.add(items[i])
            target[items[i]] = items[i + 1]

    def load_dict(self) -> None:
        items = self.pop_mark()
        target: dict[Any, Any] = {}
        keys = self._keys_of(target)
        for i in range(0, len(items) - 1, 2):
            keys.add(items[i])
            target[items[i]] = items[i + 1]
        self.append(target)

    def load_additems(self) -> None:
        items = self.pop_mark()
        target = self.stack[-1]
        self._into(target, (set,), "ADDITEMS")
        keys = self._keys_of(target)
        for item in items:
            keys.add(item)
            target.add(item)

    def load_frozenset(self) -> None:
        items = self.pop_mark()
        keys = _KeyHashes()
        for item in items:
            keys.add(item)
        self.append(frozenset(items))

    def load_append(self) -> None:
        value = self.stack.pop()
        self._into(self.stack[-1], (list,), "APPEND")
        self.stack[-1].append(value)

    def load_appends(self) -> None:
        items = self.pop_mark()
        self._into(self.stack[-1], (list,), "APPENDS")
        self.stack[-1].extend(items)

    for _op, _method in ((pickle.BUILD, load_build), (pickle.NEWOBJ, load_newobj),
                         (pickle.NEWOBJ_EX, load_newobj_ex), (pickle.INST, load_refused),
                         (pickle.OBJ, load_refused), (pickle.SETITEM, load_setitem),
                         (pickle.SETITEMS, load_setitems), (pickle.DICT, load_dict),
                         (pickle.ADDITEMS, load_additems), (pickle.FROZENSET, load_frozenset),
                         (pickle.APPEND, load_append), (pickle.APPENDS, load_appends)):
        dispatch[_op[0]] = _method
    del _op, _method


def guarded_container(kind: type) -> Callable[..., Any]:
    """What a ``RestrictedUnpickler`` admits for ``builtins.set`` / ``dict`` / ``frozenset`` /
    ``collections.OrderedDict``: builds one of ``kind`` from at most one iterable, through the
    same key check (a pickle may call ``set([...])`` with keys that all hash alike)."""

    def build(*args: Any) -> Any:
        if len(args) > 1:
            raise DamagedPickle(f"calls {kind.__name__} with {len(args)} arguments")
        source = args[0] if args else ()
        if type(source) not in (list, tuple, dict, set, frozenset, OrderedDict):
            raise DamagedPickle(f"builds a {kind.__name__} from a {type(source).__name__}")
        keys = _KeyHashes()
        pairs = kind in (dict, OrderedDict)
        if pairs and type(source) in (list, tuple):
            items = list(source)
            if not all(type(p) is tuple and len(p) == 2 for p in items):
                raise DamagedPickle(f"builds a {kind.__name__} from items that are not pairs")
            for k, _ in items:
                keys.add(k)
            return kind(items)
        for k in source:
            keys.add(k)
        return kind(source)

    return build


def _field_names(cls: type) -> frozenset[str]:
    import dataclasses

    return frozenset(f.name for f in dataclasses.fields(cls)) if dataclasses.is_dataclass(cls) \
        else frozenset()


def _describe(obj: Any) -> str:
    if isinstance(obj, type):
        return f"the class {obj.__module__}.{obj.__qualname__}"
    name = getattr(obj, "__qualname__", None)
    if name is not None:
        return f"{getattr(obj, '__module__', '?')}.{name}"
    return f"a {type(obj).__name__}"


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
        pickles = [n for n in names if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pickles) != 1:
            raise UsageError(f"{what} is not readable (truncated or not a torch.save file): it holds "
                             f"{len(pickles)} data.pkl records")
        try:
            data = archive.read(pickles[0])
        except Exception as e:  # noqa: BLE001 - a damaged record: BadZipFile, a bad CRC, ...
            raise UsageError(unreadable(what, e)) from None
        try:
            scan_pickle(data, TORCH_PICKLE_DEPTH, lambda module, name: True)
        except RefusedGlobal:  # pragma: no cover - every global is admitted here
            raise
        except DamagedPickle as e:
            raise UsageError(f"{what} is damaged or hostile: its pickle {e}; refused, nothing was "
                             "loaded") from None
    finally:
        source.seek(start)


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
