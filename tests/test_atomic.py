"""sprout.atomic's writes are fsynced before they are renamed into place, unless SPROUT_FSYNC=0
(which the suite sets for itself, tests/conftest.py): then the same files land in place, unsynced.
`sha256_file` remembers only the digests of settled files, and never one of older bytes."""

import hashlib
import os
import time

import pytest

import sprout.atomic as atomic


def write_three(folder) -> None:
    """A file by atomic_write, one by atomic_path, a folder of two by replace_dir."""
    with atomic.atomic_write(folder / "a.txt", "w") as f:
        f.write("a\n")
    with atomic.atomic_path(folder / "b.bin") as tmp:
        tmp.write_bytes(b"b")
    staged = folder / ".tmp-c"
    staged.mkdir()
    (staged / "x").write_text("x")
    (staged / "y").write_text("y")
    atomic.replace_dir(staged, folder / "c", ["x", "y"])


@pytest.mark.parametrize("setting, synced", [(None, 4), ("1", 4), ("0", 0)])
def test_every_atomic_write_is_fsynced_unless_the_environment_says_0(tmp_path, monkeypatch, setting, synced):
    if setting is None:
        monkeypatch.delenv("SPROUT_FSYNC", raising=False)
    else:
        monkeypatch.setenv("SPROUT_FSYNC", setting)
    calls, real_fsync = [], os.fsync

    def counted_fsync(fd):
        calls.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(atomic.os, "fsync", counted_fsync)
    write_three(tmp_path)
    assert len(calls) == synced
    assert (tmp_path / "a.txt").read_text() == "a\n" and (tmp_path / "b.bin").read_bytes() == b"b"
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["x", "y"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.bin", "c"]  # no temporary left


def test_sha256_file_remembers_only_settled_files_and_never_older_bytes(tmp_path, monkeypatch):
    """`remember`: only the digest of a file settled before it was read (monkeypatched SETTLED_NS:
    a day, then 0), never one of older bytes. Changes are made 50 ms apart, later ticks of the
    kernel's timestamps (the suite's temporary folder keeps sub-second times)."""
    old, new = b"a" * 3000, b"b" + b"a" * 2999  # the same size
    old_digest = hashlib.sha256(old).hexdigest()
    f = tmp_path / "w.bin"
    f.write_bytes(old)
    monkeypatch.setattr(atomic, "_DIGESTS", {})
    monkeypatch.setattr(atomic, "SETTLED_NS", 86_400 * 10**9)
    assert atomic.sha256_file(f, remember=True) == old_digest and atomic._DIGESTS == {}  # not settled
    monkeypatch.setattr(atomic, "SETTLED_NS", 0)
    assert atomic.sha256_file(f) == old_digest and atomic._DIGESTS == {}  # not asked to
    assert atomic.sha256_file(f, remember=True) == old_digest
    assert list(atomic._DIGESTS.values()) == [old_digest]

    class NoHashing:  # a remembered digest is returned without reading the file
        def __init__(self):
            raise AssertionError("hashed again")

    with monkeypatch.context() as m:
        m.setattr(atomic.hashlib, "sha256", NoHashing)
        assert atomic.sha256_file(f, remember=True) == old_digest
    before = os.stat(f)
    time.sleep(0.05)
    with open(f, "r+b") as g:  # other bytes in place, the old mtime put back (as cp -p would): ctime moves on
        g.write(new[:1])
    os.utime(f, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert atomic.sha256_file(f, remember=True) == hashlib.sha256(new).hexdigest()
    time.sleep(0.05)
    f.unlink()
    f.write_bytes(old)  # a new file at the old path
    assert atomic.sha256_file(f, remember=True) == old_digest

    g = tmp_path / "changing.bin"  # written while it is read: its digest is kept under its state before
    g.write_bytes(old)
    real = hashlib.sha256

    class WrittenMeanwhile:
        def __init__(self):
            self.h, self.first = real(), True

        def update(self, data):
            if self.first:
                time.sleep(0.05)
                with open(g, "r+b") as w:
                    w.write(new[:1])
                self.first = False
            self.h.update(data)

        def hexdigest(self):
            return self.h.hexdigest()

    with monkeypatch.context() as m:
        m.setattr(atomic.hashlib, "sha256", WrittenMeanwhile)
        atomic.sha256_file(g, remember=True)
    assert atomic.sha256_file(g, remember=True) == hashlib.sha256(new).hexdigest()
