"""The `.bin` token-shard contract (nanoGPT / llm.c / parameter-golf layout); every reader and
writer of shards goes through this module.

    header   256 little-endian int32 (1024 bytes): [0] magic, [1] version, [2] num_tokens, [3..255] 0
    payload  num_tokens little-endian token ids
    (magic, version), as llm.c defines them: 20240520/1 -> uint16 ids (vocab <= 65,536),
    20240801/7 -> uint32 ids

The file size must equal 1024 + num_tokens * itemsize; anything else is a `ShardError` naming
the file. Shards are named `<dataset>_<split>_<index:06d>.bin` (split: train | val), each listed
with its token count and sha256 in the `manifest.json` beside them (`sprout.formats.manifest`).
A split's shards, in index order, are one stream: its documents back to back, each followed by
the eot id (a document may continue into the next shard). Val documents are chosen by a hash of
each document (`sprout.prep.keys`), never a prefix of the stream.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sprout.atomic import atomic_write
from sprout.errors import SproutError

HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
MAGIC_U16, VERSION_U16 = 20240520, 1
MAGIC_U32, VERSION_U32 = 20240801, 7
UINT16_VOCAB_LIMIT = 1 << 16
FORMATS = {(MAGIC_U16, VERSION_U16): np.dtype("<u2"), (MAGIC_U32, VERSION_U32): np.dtype("<u4")}
SHARD_RE = re.compile(r"^(?P<dataset>.+)_(?P<split>train|val)_(?P<index>\d{6})\.bin$")


class ShardError(SproutError):
    """A shard that does not follow the contract; the message names the file."""


@dataclass(frozen=True)
class ShardHeader:
    magic: int
    version: int
    num_tokens: int

    @property
    def dtype(self) -> np.dtype:
        return FORMATS[(self.magic, self.version)]


def dtype_for_vocab(vocab_size: int, token_dtype: str = "auto") -> np.dtype:
    """The id dtype for a vocabulary: uint16 when every id fits, else uint32.

    `token_dtype` may force "uint16" (refused if the vocab is too large) or "uint32".
    """
    if token_dtype == "uint32":
        return np.dtype("<u4")
    if token_dtype == "uint16" or token_dtype == "auto":
        if vocab_size <= UINT16_VOCAB_LIMIT:
            return np.dtype("<u2")
        if token_dtype == "uint16":
            raise SproutError(
                f"vocab size {vocab_size:,} does not fit uint16 shards (limit {UINT16_VOCAB_LIMIT:,}); "
                "use --token-dtype uint32 or auto"
            )
        return np.dtype("<u4")
    raise SproutError(f"unknown token dtype {token_dtype!r} (expected auto, uint16 or uint32)")


def shard_name(dataset: str, split: str, index: int) -> str:
    """`<dataset>_<split>_<index:06d>.bin`, e.g. `tinystories_train_000000.bin`."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be train or val, got {split!r}")
    return f"{dataset}_{split}_{index:06d}.bin"


def encode_header(num_tokens: int, dtype: np.dtype) -> bytes:
    dtype = np.dtype(dtype)
    magic, version = (MAGIC_U16, VERSION_U16) if dtype.itemsize == 2 else (MAGIC_U32, VERSION_U32)
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[0], header[1], header[2] = magic, version, num_tokens
    return header.tobytes()


def write_shard(path: str | os.PathLike, tokens: np.ndarray, dtype: np.dtype | str) -> str:
    """Write one shard atomically; returns the sha256 hex digest of the file's bytes.

    `tokens` must already be within range of `dtype` (callers check against the vocab).
    """
    import hashlib

    dtype = np.dtype(dtype).newbyteorder("<")
    tokens = np.asarray(tokens)
    if tokens.ndim != 1:
        raise ValueError("shard tokens must be 1-D")
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) > np.iinfo(dtype).max):
        raise ShardError(f"{path}: token ids out of range for {dtype.name}")
    header = encode_header(int(tokens.size), dtype)
    payload = tokens.astype(dtype, copy=False).tobytes()
    digest = hashlib.sha256(header)
    digest.update(payload)
    with atomic_write(path, "wb") as f:
        f.write(header)
        f.write(payload)
    return digest.hexdigest()


def read_header(path: str | os.PathLike) -> ShardHeader:
    """Read and validate a shard's header and size; raise ShardError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise ShardError(f"{path}: no such shard file")
    size = path.stat().st_size
    if size < HEADER_BYTES:
        raise ShardError(f"{path}: file is {size} bytes, shorter than the {HEADER_BYTES}-byte header")
    header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
    magic, version, num_tokens = (int(x) for x in header[:3])
    if (magic, version) not in FORMATS:
        known = ", ".join(f"{m}/v{v}" for m, v in FORMATS)
        raise ShardError(f"{path}: bad header magic/version {magic}/v{version} (expected one of {known})")
    if num_tokens < 0:
        raise ShardError(f"{path}: negative token count {num_tokens} in header")
    itemsize = FORMATS[(magic, version)].itemsize
    expected = HEADER_BYTES + num_tokens * itemsize
    if size != expected:
        raise ShardError(
            f"{path}: size mismatch: file is {size:,} bytes but header says {num_tokens:,} tokens "
            f"({expected:,} bytes); truncated or corrupted"
        )
    return ShardHeader(magic, version, num_tokens)


def open_shard(path: str | os.PathLike) -> np.ndarray:
    """A validated, read-only memmap of a shard's token ids (no copy into memory)."""
    hdr = read_header(path)
    if hdr.num_tokens == 0:
        return np.zeros(0, dtype=hdr.dtype)
    return np.memmap(path, dtype=hdr.dtype, mode="r", offset=HEADER_BYTES, shape=(hdr.num_tokens,))


def list_shards(directory: str | os.PathLike, split: str) -> list[Path]:
    """Shards of one split in a folder, sorted by name; ShardError if the folder is missing."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ShardError(f"{directory}: shard directory does not exist")
    found = []
    for p in directory.iterdir():
        m = SHARD_RE.match(p.name)
        if m and m.group("split") == split:
            found.append(p)
    return sorted(found)
