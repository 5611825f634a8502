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
    f = tmp_path / "w.bin"
    f.write_bytes(b"a" * 3000)
    fresh = atomic.sha256_file(f)
    assert fresh == hashlib.sha256(b"a" * 3000).hexdigest()
    assert fresh not in atomic._DIGESTS.values()  # written just now: hashed again on every read
    time.sleep(atomic.SETTLED_NS / 1e9 + 0.1)
    assert atomic.sha256_file(f) == fresh and fresh in atomic._DIGESTS.values()  # settled: remembered

    class Unread:  # a remembered digest does not read the file
        def __init__(self):
            raise AssertionError("hashed again")

    with monkeypatch.context() as m:
        m.setattr(atomic.hashlib, "sha256", Unread)
        assert atomic.sha256_file(f) == fresh
    with open(f, "r+b") as g:  # the same size, other bytes, in place: its ctime moves on
        g.write(b"b")
    assert atomic.sha256_file(f) == hashlib.sha256(b"b" + b"a" * 2999).hexdigest()
    f.unlink()
    f.write_bytes(b"a" * 3000)  # a new file of the old bytes at the old path: a new inode or ctime
    assert atomic.sha256_file(f) == fresh
