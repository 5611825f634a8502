"""Folder locks: one process at a time writes a run folder, a prep output or an import.

`hold_lock` / `locked` hold a folder for one process: an exclusive `flock` on a lock file into
which the holder writes its pid; a second process is refused in one line naming the folder and
the holder's pid; `check_unlocked` refuses as `hold_lock` would, creating and writing nothing;
`try_lock` takes a lock without waiting and without a refusal. The kernel drops a lock when its
holder exits, however it ends, so a killed process never leaves a folder locked. A lock file is
never opened through a symbolic link (`sprout.atomic.open_nofollow`).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
from pathlib import Path
from typing import IO, Iterator

from sprout.atomic import make_dir, open_nofollow
from sprout.errors import SproutError


def try_lock(fd: int) -> int | None:
    """`fd` holding an exclusive flock, taken without waiting, or None (and `fd` closed) when
    another process holds it. The lock goes when the descriptor closes or the process ends."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def hold_lock(folder: str | os.PathLike, name: str, what: str) -> IO:
    """Take an exclusive lock on `folder` (created if needed): `flock` on its file `name`, into
    which this process's pid is written; returns the open file, which holds the lock until it is
    closed or the process ends. When another process holds it, SproutError naming the folder,
    the holder's pid and `what` holds it (e.g. "trainer"). The lock file is never written
    through a symbolic link nor when it has other hard links (refused naming it), and a lock
    taken on a file that was removed or replaced meanwhile is taken again on the one in place,
    so a holder may delete its lock file."""
    folder = make_dir(folder)
    path = folder / name
    while True:
        fd = open_nofollow(path, os.O_RDWR | os.O_CREAT, what)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
            os.close(fd)
            kind = "not a regular file" if not stat.S_ISREG(st.st_mode) else f"has {st.st_nlink - 1} other hard link(s)"
            raise SproutError(f"{path}: {kind}; the {what} writes its pid into this lock file: remove it")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise _in_use(folder, path, holder, what) from None
        try:
            now = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            now = None
        if now is not None and (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
            break
        os.close(fd)  # its holder deleted it between our open and our lock: lock the file now there
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode("ascii"), 0)
    return os.fdopen(fd, "r+")


def _holder(fd: int) -> str:
    """The pid a lock file's holder wrote into it."""
    return os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"


def _in_use(folder: Path, path: Path, holder: str, what: str) -> SproutError:
    return SproutError(f"{folder}: in use by another {what} (pid {holder}, holding {path})")


def check_unlocked(folder: str | os.PathLike, name: str, what: str) -> None:
    """The refusal of `hold_lock` when another process holds the lock now, without taking it:
    nothing is created or written (no lock file: nobody holds it)."""
    path = Path(folder) / name
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return  # no lock file, or one `hold_lock` refuses itself (a link)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released when fd closes
    except BlockingIOError:
        raise _in_use(Path(folder), path, _holder(fd), what) from None
    finally:
        os.close(fd)


@contextlib.contextmanager
def locked(folder: str | os.PathLike, name: str, what: str) -> Iterator[None]:
    """`hold_lock` for the block's lifetime."""
    f = hold_lock(folder, name, what)
    try:
        yield
    finally:
        f.close()
