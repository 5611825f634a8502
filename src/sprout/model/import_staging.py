"""Where an import works: a staging folder inside its run folder, and what a killed import leaves.

    clean_killed_imports(out)             # first: a killed import's leftovers go
    with ImportStaging(out) as staging:   # out/.tmp-import-<pid>-XXXX, locked while it lives
        ...                               # read the source under staging.path / "source"
        staging.publish(last="checkpoints")   # what was built under staging.run, moved into out

The source is read and the run is built under the staging folder; `publish` then renames each
finished entry into the run folder, after writing their names to `MOVING`. The staging folder
holds an exclusive `flock` for as long as its process lives, so `clean_killed_imports` tells a
killed import's folder (lock free, its pid gone or the folder older than a minute) from a live
one, and removes it, with what it had moved in when it was killed mid-way through `publish` (a
run folder then holds only part of a run). A failed import removes its staging folder, and the
run folder when it created it and nothing else is there: a refused import leaves the run folder
as it was.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from sprout.atomic import atomic_write
from sprout.errors import SproutError

PREFIX = ".tmp-import-"
MOVING = "moving.json"  # the entries `publish` renames into the run folder, written before the first
STALE_S = 60  # a staging folder whose lock is free and that is this old is a killed import's, whatever its pid


def _lock(folder: Path) -> int | None:
    """An exclusive flock on `folder` itself (its open descriptor), or None when another holds it."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def clean_killed_imports(out: str | os.PathLike) -> list[Path]:
    """Remove the staging folders that killed imports left in `out` (module doc), and what one
    killed mid-way through `publish` had moved into `out`; returns the folders removed."""
    removed = []
    for folder in sorted(Path(out).glob(PREFIX + "*")):
        if not folder.is_dir() or folder.is_symlink():
            continue
        fd = _lock(folder)
        if fd is None:
            continue  # a live import
        try:
            pid = folder.name[len(PREFIX):].split("-", 1)[0]
            young = time.time() - folder.stat().st_mtime < STALE_S
            if pid.isdigit() and _running(int(pid)) and young:
                continue  # its process may not have taken the lock yet
            moving = folder / MOVING
            if moving.is_file():
                try:
                    names = json.loads(moving.read_text(encoding="utf-8"))
                except (OSError, ValueError):
                    names = []
                moved = [n for n in names if isinstance(n, str) and "/" not in n and not (folder / "run" / n).exists()]
                if len(moved) < len(names):  # part of a run: what went in goes again
                    for name in moved:
                        _remove(Path(out) / name)
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
        finally:
            os.close(fd)
    return removed


class ImportStaging:
    """The staging folder of one import in the run folder `out` (module doc)."""

    def __init__(self, out: str | os.PathLike):
        self.out = Path(out)
        self.created: Path | None = None  # the first folder of `out`'s path this import created
        self.path: Path | None = None
        self._fd: int | None = None

    def __enter__(self) -> "ImportStaging":
        for folder in (self.out, *self.out.parents):
            if os.path.lexists(folder):
                break
            self.created = folder
        try:
            self.out.mkdir(parents=True, exist_ok=True)
            self.path = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=self.out))
        except OSError as exc:
            self._remove_created()
            raise SproutError(f"{self.out}: cannot write the run folder here ({exc.strerror or exc})") from None
        self._fd = _lock(self.path)
        (self.path / "run").mkdir()
        return self

    @property
    def run(self) -> Path:
        """Where the run is built before `publish` moves it into `out`."""
        return self.path / "run"

    def publish(self, last: str | None = None) -> list[str]:
        """Rename every entry built under `run` into `out` (none of them may be there yet), the
        one named `last` last; returns their names. `MOVING` records them first, for
        `clean_killed_imports`."""
        names = sorted((p.name for p in self.run.iterdir()), key=lambda n: (n == last, n))
        for name in names:
            if os.path.lexists(self.out / name):
                raise SproutError(f"{self.out / name}: appeared while the import was writing; nothing of this "
                                  f"import was moved into {self.out}")
        with atomic_write(self.path / MOVING, "w") as f:
            f.write(json.dumps(names))
        moved = []
        try:
            for name in names:
                os.rename(self.run / name, self.out / name)
                moved.append(name)
        except OSError as exc:
            for name in moved:  # a run folder never keeps part of an import
                _remove(self.out / name)
            raise SproutError(f"{self.out / name}: cannot move the imported run into place "
                              f"({exc.strerror or exc})") from None
        return names

    def _remove_created(self) -> None:
        """Remove the folders `__enter__` created for `out`, as long as nothing else is in them."""
        if self.created is None:
            return
        for folder in (self.out, *self.out.parents):
            try:
                folder.rmdir()
            except OSError:
                return
            if folder == self.created:
                return

    def __exit__(self, kind, exc, tb) -> None:
        if self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)
        if self._fd is not None:
            os.close(self._fd)
        if exc is not None:
            self._remove_created()
