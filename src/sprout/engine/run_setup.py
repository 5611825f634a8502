"""A trainer's setup, from taking its run folder to its first step, leaves the folder as it was
when it ends early (`sprout.engine.cli.run_lock` uses this; no torch here).

`RunSetup` records, when the folder is taken, the bytes and times of the run's files and what
its run folders and `.tmp-*` temporaries hold; `roll_back` puts that back: files rewritten or
created since, entries added to those folders, the old run's files --overwrite moved aside
(`put_aside`; deleted for good by `finish`), the lock file's old bytes (or no lock file, and the
folders taking it created). Nothing else in the folder is touched, and only the main process
records and restores. `catch_signals` makes SIGINT and SIGTERM raise `Stopped` while a setup
is active, so a signal stops the setup at once and the folder is put back; a second signal
does what it did before.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import threading
from pathlib import Path
from stat import S_ISREG
from typing import IO, Callable

from sprout.atomic import atomic_write, remove_created, remove_path

OVERWRITTEN = ".tmp-overwritten."  # prefix of the folder --overwrite moves the old run's files into


class Stopped(BaseException):
    """SIGINT or SIGTERM (`signum`) that stops what a trainer is doing at once: its setup
    (`catch_signals`), or its end-of-run samples (`sprout.engine.callbacks.StopSignals`). Not an
    Exception, so no `except Exception` on the way swallows it."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def file_state(path: Path):
    """(bytes, stat) of the regular file `path`, or None when there is none."""
    try:
        st = os.stat(path, follow_symlinks=False)
        return (path.read_bytes(), st) if S_ISREG(st.st_mode) else None
    except OSError:
        return None


class RunSetup:
    """The run folder `out` as a trainer found it (module doc): `names`, its entries a run
    writes (the lock file apart), as they are now; `created`, the first folder of `out`'s path
    that taking the lock created (None when `out` existed); `lock_before`, the lock file's
    `file_state` before it was taken. `main`: whether this process writes the folder."""

    def __init__(self, out: Path, names, created: Path | None, lock_before, *, main: bool = True):
        self.out, self.created, self.lock_before, self.main = out, created, lock_before, main
        self.active, self.aside = True, None
        self.entries, self.temps = {}, set()
        if main:
            self.entries = {name: self._state(out / name) for name in names}
            self.temps = {p.name for p in out.glob(".tmp-*")}

    @staticmethod
    def _state(path: Path):
        if path.is_dir() and not path.is_symlink():
            return {str(p.relative_to(path)) for p in path.rglob("*")}
        return file_state(path)

    def put_aside(self, files: list[Path]) -> None:
        """--overwrite's old run files moved into a temporary folder in the run folder."""
        self.aside = Path(tempfile.mkdtemp(prefix=OVERWRITTEN, dir=self.out))
        for f in files:
            os.replace(f, self.aside / f.name)

    def finish(self) -> None:
        """The first step is next: the setup is over, what it recorded is dropped, and the old
        run's files go for good."""
        self.active = False
        self.entries, self.temps, self.lock_before = {}, set(), None
        if self.aside is not None:
            names = sorted(p.name for p in self.aside.iterdir())
            shutil.rmtree(self.aside, ignore_errors=True)
            print(f"--overwrite: deleted the previous run's {', '.join(names)} in {self.out}", flush=True)

    def roll_back(self, lock: Path, held: IO | None) -> None:
        """Put the folder back (module doc); `lock` is the lock file, `held` its open file while
        this process holds it (its old bytes are written back through it, or it is deleted)."""
        self.active = False
        if not self.main:
            return
        out = self.out
        if self.aside is not None:
            for p in sorted(self.aside.iterdir()):
                remove_path(out / p.name)
                os.replace(p, out / p.name)
            self.aside.rmdir()
        for name, state in self.entries.items():
            with contextlib.suppress(OSError):
                self._put_back(out / name, state)
        for p in out.glob(".tmp-*"):
            if p.name not in self.temps:
                remove_path(p)
        if held is not None:
            if self.lock_before is None:
                lock.unlink(missing_ok=True)  # one taken later is taken on a new file (`hold_lock`)
            else:
                data, st = self.lock_before
                os.ftruncate(held.fileno(), 0)
                os.pwrite(held.fileno(), data, 0)
                os.utime(held.fileno(), ns=(st.st_atime_ns, st.st_mtime_ns))
        remove_created(out, self.created)  # the folders taking the lock created, when nothing else is there

    @staticmethod
    def _put_back(path: Path, state) -> None:
        if state is None:
            if os.path.lexists(path):
                remove_path(path)
        elif isinstance(state, set):
            if path.is_dir():
                for p in sorted(path.rglob("*"), key=lambda p: len(p.parts), reverse=True):
                    if str(p.relative_to(path)) not in state:
                        remove_path(p)
        else:
            data, st = state
            try:
                now = os.stat(path, follow_symlinks=False)
            except FileNotFoundError:
                now = None
            if now is None or (now.st_ino, now.st_size, now.st_mtime_ns) != (st.st_ino, st.st_size, st.st_mtime_ns):
                remove_path(path)
                with atomic_write(path, "wb") as f:
                    f.write(data)
                os.chmod(path, st.st_mode & 0o7777)
                os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def catch_signals(active: Callable[[], bool]) -> Callable[[], None]:
    """Make SIGINT and SIGTERM raise `Stopped` while `active()` (main thread only; not a
    signal the process ignores), and do what they did before otherwise or the second time.
    Returns the function that puts the old handlers back."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    old = {}

    def handle(signum, frame):
        if active():
            for sig, handler in old.items():
                signal.signal(sig, handler)
            raise Stopped(signum)
        pass_on(old.get(signum, signal.SIG_DFL), signum, frame)

    for sig in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(sig) is not signal.SIG_IGN:
            old[sig] = signal.signal(sig, handle)

    def restore():
        for sig, handler in old.items():
            if signal.getsignal(sig) is handle:
                signal.signal(sig, handler)

    return restore


def pass_on(handler, signum: int, frame) -> None:
    """Do what `handler` (as `signal.signal` returned it) does with `signum`."""
    if callable(handler):
        handler(signum, frame)
    elif handler != signal.SIG_IGN:  # SIG_DFL, or one installed outside Python: the default action
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
