"""Compressed inputs read as plain byte streams: `.gz` and `.zst` (multi-frame) files opened by
`open_binary`, decompressed as they are read, so memory stays flat however large the file.

A file whose suffix says compressed but whose magic bytes do not, a stream cut short, or
corrupted data raises SproutError naming the file and the byte offset; what precedes a
truncation is still read (one decompression step at a time).
"""

from __future__ import annotations

import gzip
import io
import zlib
from pathlib import Path
from typing import IO

from sprout.errors import SproutError

CHUNK = 1 << 20  # bytes read from a file at a time
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


class _ZstdRaw(io.RawIOBase):
    """Decompress a (multi-frame) zstd file, raising on a frame the file cuts short."""

    def __init__(self, f: IO[bytes], path: Path) -> None:
        import zstandard

        self._f, self._path, self._zstd = f, path, zstandard
        self._dobj = zstandard.ZstdDecompressor().decompressobj()
        self._buf = b""
        self._frame_open = False
        self._done = False

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while not self._buf and not self._done:
            chunk = self._f.read(CHUNK)
            if not chunk:
                if self._frame_open:
                    raise SproutError(f"{self._path}: truncated zstd stream (compressed data ends at byte {self._f.tell():,})")
                self._done = True
                break
            self._feed(chunk)
        n = min(len(b), len(self._buf))
        b[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        return n

    def _feed(self, chunk: bytes) -> None:
        while chunk:
            try:
                self._buf += self._dobj.decompress(chunk)
            except self._zstd.ZstdError as exc:
                raise SproutError(f"{self._path}: corrupted zstd data near byte {self._f.tell():,} ({exc})") from None
            self._frame_open = not self._dobj.eof
            chunk = self._dobj.unused_data if self._dobj.eof else b""
            if self._dobj.eof:
                self._dobj = self._zstd.ZstdDecompressor().decompressobj()


GZIP_MAGIC = b"\x1f\x8b"


class _GzipChecked(io.RawIOBase):
    """gzip.GzipFile whose errors become SproutError naming the file and offset."""

    def __init__(self, f: IO[bytes], path: Path) -> None:
        self._raw, self._path = f, path
        if f.read(2) != GZIP_MAGIC:
            f.close()
            raise SproutError(f"{path}: not gzip-compressed (bad magic bytes) despite the .gz suffix")
        f.seek(0)
        self._gz = gzip.GzipFile(fileobj=f, mode="rb")

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        try:  # one decompression step at a time: what precedes a truncation is still read
            return self._gz.readinto1(b)
        except EOFError:
            raise SproutError(f"{self._path}: truncated gzip stream (compressed data ends at byte {self._raw.tell():,})") from None
        except (gzip.BadGzipFile, zlib.error, OSError) as exc:
            raise SproutError(f"{self._path}: corrupted gzip data near byte {self._raw.tell():,} ({exc})") from None


def open_binary(path: Path) -> IO[bytes]:
    """Open a file for buffered binary reading, decompressing .gz/.zst transparently."""
    f = open(path, "rb")
    name = path.name.lower()
    if name.endswith(".gz"):
        return io.BufferedReader(_GzipChecked(f, path), CHUNK)
    if name.endswith(".zst"):
        if f.read(4) != ZSTD_MAGIC:
            f.close()
            raise SproutError(f"{path}: not zstd-compressed (bad magic bytes) despite the .zst suffix")
        f.seek(0)
        return io.BufferedReader(_ZstdRaw(f, path), CHUNK)
    return f
