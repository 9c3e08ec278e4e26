"""Reading and writing files that someone else may have written or may be changing.

Every write that must never leave a half-written file, and every open of a file the course does
not trust, lives here, below ``utilities.dcp`` and ``utilities.state_dict``:

* ``open_regular``: open a file without following a link (inside a checkpoint folder) and refuse
  anything but a regular file, so a FIFO cannot hang a load and a planted link cannot redirect it;
  ``check_output_file`` / ``open_output`` / ``atomic_write_text``: the same for a file the user
  names to be written (``plan --trace``, ``record --out``), never blocking on a FIFO or device;
* writes that never leave half a file or half a folder: ``atomic_torch_save`` (a unique temporary,
  fsync, rename), ``swap_in`` (replace a folder so that a kill at any instant leaves a complete
  one), ``fsync_files`` / ``fsync_dir``, ``remove_path``;
* ``lock_checkpoints``: one run at a time saves into a checkpoint folder (its lock opened relative
  to a folder descriptor opened name by name without following a link: ``open_folder_nofollow``).

What the course may replace or delete among a user's files is ``utilities.owned_paths``; reading a
pickle is ``utilities.pickle_scan`` and ``utilities.restricted_unpickler``; loading a
``torch.save`` file is ``utilities.torch_zip``.
"""

from __future__ import annotations

import os
import shutil
import stat
import time
from collections.abc import Callable
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
