"""Atomic file writes, write errors as one line, and file hashing (folder locks: `sprout.locks`).

Invariants: every writer writes `.tmp-<final name>.<random>` beside its output, fsyncs and
renames it into place, so a reader sees the old file, the whole new one or nothing; temporaries
are removed on failure, and one a killed process left is removed when the output is written
again (`remove_stale_temps`). `SPROUT_FSYNC=0` (the test suite) skips only the fsyncs. An
unwritable folder, ENOSPC, EDQUOT or EFBIG raise a `SproutError` naming the output. `AtomicH5`
raises a failed write once h5py has closed the file. `sha256_file(remember=True)` reuses a digest
while the file's (device, inode, size, mtime, ctime) is unchanged and it had settled before it
was read. Files and folders follow the umask (0666 / 0777 & ~umask). No write follows a symbolic
link: a rename replaces a link, and a file opened in place is opened with O_NOFOLLOW and a link
there is refused in one line (`symlink_error`).
"""

from __future__ import annotations

import contextlib
import errno
import glob
import hashlib
import io
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import IO, Any, Iterator

from sprout.errors import SproutError

# errno values that mean "this output cannot be written here", whichever call raised them
DISK_ERRNOS = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EROFS}
HASH_BLOCK = 1 << 20
SETTLED_NS = 3_000_000_000  # a file unchanged this long before it is hashed may have its digest remembered
_DIGESTS: dict[tuple[int, ...], str] = {}  # (st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns) -> sha256


def write_error(path: str | os.PathLike, exc: OSError) -> SproutError:
    """The one-line error for a failed write of `path`."""
    what = exc.strerror or str(exc)
    hint = " (disk full or file size limit?)" if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT) else ""
    return SproutError(f"{path}: cannot write: {what}{hint}")


def make_dir(path: str | os.PathLike) -> Path:
    """`mkdir -p path`, or SproutError naming the path when it cannot be created."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise SproutError(f"{path}: exists and is not a folder") from None
    except OSError as exc:
        raise SproutError(f"{path}: cannot create this folder: {exc.strerror or exc}") from None
    return path


def check_writable(path: str | os.PathLike) -> None:
    """Fail early, naming the folder, when `path` could not be written: its nearest existing
    ancestor must be a writable folder. Creates nothing."""
    path = Path(path)
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise SproutError(f"{folder}: is not a folder, so {path} cannot be written")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise SproutError(f"{folder}: folder is not writable, so {path} cannot be written")


def safe_name(name: str, field: str) -> str:
    """`name` if it is a plain file name (no folder part, not `.` or `..`, no leading dot);
    else SproutError naming the field. Names from the command line or a config that become
    file names go through here, so they stay inside their output folder."""
    if not isinstance(name, str) or not name or name in (".", "..") or name.startswith(".") \
            or "/" in name or "\\" in name or "\0" in name or name != name.strip():
        raise SproutError(f"{field}: {name!r} is not a plain file name (letters, digits, '-', '_', '.'; no folder part)")
    return name


def umask() -> int:
    """This process's umask, read without changing it (/proc/self/status; elsewhere set and put
    back at once, which a thread creating a file at that moment could see)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode a plain `open()` gives a new file: 0666 & ~umask (mkstemp and safetensors use 0600)."""
    return 0o666 & ~umask()


def dir_mode() -> int:
    """The mode a plain `mkdir` gives a new folder: 0777 & ~umask (mkdtemp uses 0700)."""
    return 0o777 & ~umask()


def symlink_error(path: str | os.PathLike, what: str = "sprout") -> SproutError:
    """The one-line refusal of a symbolic link where `what` writes."""
    path = Path(path)
    try:
        target = f" (to {os.readlink(path)})"
    except OSError:
        target = ""
    return SproutError(f"{path}: is a symbolic link{target}; {what} writes here and never through a link: "
                       f"remove the link, or choose another folder")


def open_nofollow(path: str | os.PathLike, flags: int, what: str = "sprout") -> int:
    """`os.open(path, flags | O_NOFOLLOW)` with the umask's file mode; a symbolic link at `path`
    is `symlink_error`, any other failure SproutError naming `path`."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise symlink_error(path, what) from None
        if exc.errno in DISK_ERRNOS:
            raise write_error(path, exc) from None
        raise SproutError(f"{path}: cannot open for writing: {exc.strerror or exc}") from None


def open_append(path: str | os.PathLike, what: str = "sprout") -> IO:
    """`path` opened for appending text (created if missing), never through a symbolic link."""
    return os.fdopen(open_nofollow(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, what), "a")


def _temp_beside(path: Path) -> tuple[int, str]:
    make_dir(path.parent)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".tmp-{path.name}.", dir=path.parent)
    except OSError as exc:
        raise SproutError(f"{path.parent}: cannot write in this folder: {exc.strerror or exc}") from None
    return fd, tmp


def _sync(f: IO) -> None:
    """fsync the open file `f`, unless `SPROUT_FSYNC=0` (see the module doc)."""
    if os.environ.get("SPROUT_FSYNC") != "0":
        os.fsync(f.fileno())


def _finish(tmp: str, path: Path) -> None:
    """Give `tmp` the umask's file mode (whoever created it), fsync it and rename it over `path`."""
    try:
        with open(tmp, "rb+") as f:
            os.fchmod(f.fileno(), file_mode())
            _sync(f)
        os.replace(tmp, path)
    except OSError as exc:
        raise write_error(path, exc) from None


@contextlib.contextmanager
def _replacing(tmp: str, path: Path) -> Iterator[None]:
    """Around a write of `tmp`: on clean exit fsync it and rename it over `path`; on any
    exception remove it. A write the disk refuses (`DISK_ERRNOS`) becomes SproutError naming `path`."""
    try:
        try:
            yield
        except OSError as exc:
            if exc.errno in DISK_ERRNOS:
                raise write_error(path, exc) from None
            raise
        _finish(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "wb") -> Iterator[IO]:
    """Open a temporary file beside `path`; on clean exit fsync and rename it over `path`.
    A write the disk refuses (`DISK_ERRNOS`) inside the block becomes SproutError naming `path`."""
    path = Path(path)
    fd, tmp = _temp_beside(path)
    with _replacing(tmp, path), os.fdopen(fd, mode) as f:
        yield f
        f.flush()


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `path` for libraries that open files themselves
    (safetensors, matplotlib); rename it over `path` only if the block finishes. For h5py
    use `AtomicH5`."""
    path = Path(path)
    fd, tmp = _temp_beside(path)
    os.close(fd)
    with _replacing(tmp, path):
        yield Path(tmp)


class _GuardedFile(io.RawIOBase):
    """A file for h5py's `fileobj` driver that never reports a failed write to HDF5: the
    first OSError is kept in `error`, later writes are dropped, short reads are zero-filled
    by h5py. The caller checks `error` (AtomicH5.check) and discards the file."""

    def __init__(self, f) -> None:
        self._f, self.error = f, None

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        return self._f.readinto(b)

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._f.seek(offset, whence)

    def tell(self) -> int:
        return self._f.tell()

    def write(self, b) -> int:
        if self.error is None:
            try:
                return self._f.write(b)
            except OSError as exc:
                self.error = exc
        return len(memoryview(b))

    def truncate(self, size: int | None = None) -> int:
        if self.error is None:
            try:
                return self._f.truncate(size)
            except OSError as exc:
                self.error = exc
        return self.tell() if size is None else size

    def flush(self) -> None:
        pass  # unbuffered


class AtomicH5:
    """An h5py file (mode "w") written to a temporary file beside `path` and renamed over
    it by `commit()`; `abort()` removes it. A failed write raises SproutError naming `path`
    from `check()` (call it after each large write) or `commit()`; HDF5 never sees it.
    The file bytes are the same as h5py's default driver writes."""

    def __init__(self, path: str | os.PathLike, **kwargs) -> None:
        import h5py

        self.path = Path(path)
        fd, self._tmp = _temp_beside(self.path)
        self._raw = os.fdopen(fd, "w+b", buffering=0)
        self._guard = _GuardedFile(self._raw)
        try:
            self.file = h5py.File(self._guard, "w", **kwargs)
        except BaseException:
            self._discard()
            raise
        self._check_guard()

    def _check_guard(self) -> None:
        if self._guard.error is not None:
            err = write_error(self.path, self._guard.error)
            self.abort()
            raise err

    def check(self) -> None:
        """SproutError (and the temporary file removed) if a write has failed so far."""
        self._check_guard()

    def commit(self) -> None:
        self.file.close()
        self._raw.close()
        if self._guard.error is not None:
            err = write_error(self.path, self._guard.error)
            self._discard()
            raise err
        try:
            _finish(self._tmp, self.path)
        except BaseException:
            self._discard()
            raise

    def abort(self) -> None:
        with contextlib.suppress(Exception):
            self.file.close()
        self._discard()

    def _discard(self) -> None:
        with contextlib.suppress(Exception):
            self._raw.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._tmp)

    def __enter__(self):
        return self.file

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()
            if self._guard.error is not None and isinstance(exc, Exception):
                raise write_error(self.path, self._guard.error) from None

def replace_dir(tmp: str | os.PathLike, path: str | os.PathLike, files) -> None:
    """Put a finished folder `tmp` in place at `path`: give it and everything in it the umask's
    modes (`dir_mode`, `file_mode`: mkdtemp made it 0700, safetensors its files 0600), fsync each
    of its `files`, move an existing `path` aside, rename `tmp` into place, then delete the old
    one. A crash leaves either the old folder or the complete new one (or the old one beside as
    `.tmp-old-*`)."""
    tmp, path = Path(tmp), Path(path)
    fmode, dmode = file_mode(), dir_mode()
    for root, dirs, names in os.walk(tmp):
        os.chmod(root, dmode)
        for name in names:
            if not os.path.islink(os.path.join(root, name)):
                os.chmod(os.path.join(root, name), fmode)
    for name in files:
        with open(tmp / name, "rb+") as f:
            _sync(f)
    old = None
    if path.exists():
        old = path.with_name(f".tmp-old-{path.name}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    os.replace(tmp, path)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def remove_stale_temps(path: str | os.PathLike) -> list[Path]:
    """Delete the temporaries an interrupted write of `path` left beside it
    (`.tmp-<name>.<random>`, files or folders); returns what was removed."""
    path = Path(path)
    removed = []
    if not path.parent.is_dir():
        return removed
    for p in path.parent.glob(f".tmp-{glob.escape(path.name)}.*"):
        remove_path(p)
        removed.append(p)
    return removed


def remove_path(path: str | os.PathLike) -> None:
    """Delete `path`: a folder with everything in it, a file, or a link (never what it points
    to); nothing when it is not there."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def first_missing(path: str | os.PathLike) -> Path | None:
    """The outermost of `path` and its parents that does not exist: the first folder `mkdir -p
    path` would create (None when `path` exists). `remove_created` takes it."""
    missing = None
    for folder in (Path(path), *Path(path).parents):
        if os.path.lexists(folder):
            break
        missing = folder
    return missing


def remove_created(path: str | os.PathLike, created: Path | None) -> None:
    """Remove the folder `path` and its parents up to `created` (`first_missing` before they
    were made; None: nothing was), each only while it is empty."""
    if created is None:
        return
    for folder in (Path(path), *Path(path).parents):
        try:
            folder.rmdir()
        except OSError:
            return
        if folder == created:
            return


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    """Write `obj` as indented JSON, atomically."""
    with atomic_write(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=False)
        f.write("\n")


def _file_key(st: os.stat_result) -> tuple[int, ...]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def sha256_file(path: str | os.PathLike, remember: bool = False) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB blocks into one reused buffer. With
    `remember`, a digest remembered for this file is returned, and one of a file that had settled
    before it was read is remembered (module doc)."""
    with open(path, "rb", buffering=0) as f:
        key = _file_key(os.fstat(f.fileno()))
        if remember and (digest := _DIGESTS.get(key)) is not None:
            return digest
        started = time.time_ns()
        h = hashlib.sha256()
        buf = bytearray(HASH_BLOCK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
        digest = h.hexdigest()
        if remember and started - max(key[3], key[4]) >= SETTLED_NS:  # keyed by the state before the read
            _DIGESTS[key] = digest
    return digest
