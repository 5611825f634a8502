"""Where an import works: a staging folder inside its run folder, and what a killed import leaves.

    clean_killed_imports(out)             # first: a killed import's leftovers go
    with ImportStaging(out) as staging:   # out/.tmp-import-<pid>-XXXX, locked while it lives
        ...                               # read the source under staging.path / "source"
        staging.publish(last="checkpoints")   # what was built under staging.run, moved into out

The source is read and the run is built under the staging folder; `publish` then renames each
finished entry into the run folder, after writing their names to `MOVING`. An --overwrite's old
run (what `claim` returns) is moved aside into the staging folder just before, put back if the
new run cannot move in, and deleted with the staging folder once it has. The staging folder
holds an exclusive `flock` for as long as its process lives, so `clean_killed_imports` tells a
killed import's folder (lock free, its pid gone or the folder older than a minute) from a live
one, and removes it, with what it had moved in when it was killed mid-way through `publish` (a
run folder then holds only part of a run; the old run it had moved aside goes back). A failed
import removes its staging folder, and the run folder when it created it and nothing else is
there: a refused import leaves the run folder as it was.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

from sprout.atomic import atomic_write, first_missing, remove_created, remove_path
from sprout.locks import try_lock
from sprout.errors import SproutError

PREFIX = ".tmp-import-"
MOVING = "moving.json"  # what `publish` moves: {"moving": new entries, "replaced": old ones}, written first
REPLACED = "replaced"  # the staging folder's folder for the old run's entries `publish` moves aside
STALE_S = 60  # a staging folder whose lock is free and that is this old is a killed import's, whatever its pid


def _lock(folder: Path) -> int | None:
    """An exclusive flock on `folder` itself (its open descriptor), or None when another holds it."""
    return try_lock(os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_killed_imports(out: str | os.PathLike) -> list[Path]:
    """Remove the staging folders that killed imports left in `out` (module doc), and what one
    killed mid-way through `publish` had moved into `out` (the old run it moved aside goes
    back); returns the folders removed."""
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
                    record = json.loads(moving.read_text(encoding="utf-8"))
                except (OSError, ValueError):
                    record = {}
                names = record.get("moving") if isinstance(record, dict) else record  # a list: an earlier version's
                names = [n for n in names if isinstance(n, str) and "/" not in n] if isinstance(names, list) else []
                moved = [n for n in names if not (folder / "run" / n).exists()]
                if len(moved) < len(names):  # part of a run: what went in goes again, the old run comes back
                    for name in moved:
                        remove_path(Path(out) / name)
                    aside = folder / REPLACED
                    for old in sorted(aside.iterdir()) if aside.is_dir() else []:
                        if not os.path.lexists(Path(out) / old.name):
                            os.rename(old, Path(out) / old.name)
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
        finally:
            os.close(fd)
    return removed


class ImportStaging:
    """The staging folder of one import in the run folder `out` (module doc). `claim`, when
    given, is called by `publish` before anything moves: it returns the entries of `out` the new
    run replaces (--overwrite's old run), or refuses."""

    def __init__(self, out: str | os.PathLike, claim: Callable[[], list[Path]] | None = None):
        self.out, self.claim = Path(out), claim
        self.created: Path | None = None  # the first folder of `out`'s path this import created
        self.path: Path | None = None
        self.replaced: list[str] = []  # the old entries `publish` replaced
        self._fd: int | None = None

    def __enter__(self) -> "ImportStaging":
        self.created = first_missing(self.out)
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
        """Rename every entry built under `run` into `out`, the one named `last` last, after
        moving aside what `claim` returns (no other of them may be there yet); returns their
        names. `MOVING` records both first, for `clean_killed_imports`."""
        names = sorted((p.name for p in self.run.iterdir()), key=lambda n: (n == last, n))
        old = [Path(p).name for p in self.claim()] if self.claim is not None else []
        for name in names:
            if os.path.lexists(self.out / name) and name not in old:
                raise SproutError(f"{self.out / name}: appeared while the import was writing; nothing of this "
                                  f"import was moved into {self.out}")
        with atomic_write(self.path / MOVING, "w") as f:
            f.write(json.dumps({"moving": names, "replaced": old}))
        aside, put_aside, moved = self.path / REPLACED, [], []
        aside.mkdir()
        try:
            for name in old:
                target = self.out / name
                os.rename(target, aside / name)
                put_aside.append(name)
            for name in names:
                target = self.out / name
                os.rename(self.run / name, target)
                moved.append(name)
        except OSError as exc:
            for name in moved:  # a run folder never keeps part of an import, nor loses the old run
                remove_path(self.out / name)
            for name in put_aside:
                os.rename(aside / name, self.out / name)
            raise SproutError(f"{target}: cannot move the imported run into place ({exc.strerror or exc})") from None
        self.replaced = old
        return names

    def _remove_created(self) -> None:
        """Remove the folders `__enter__` created for `out`, as long as nothing else is in them."""
        remove_created(self.out, self.created)

    def __exit__(self, kind, exc, tb) -> None:
        if self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)
        if self._fd is not None:
            os.close(self._fd)
        if exc is not None:
            self._remove_created()
