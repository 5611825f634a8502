"""The HDF5 pretraining-token contract (h5py), the alternative to `.bin` shards.

One file per split, `<dataset>_<split>.h5`, listed in the `manifest.json` beside it, holding
one dataset and no other object:
    tokens   1-D little-endian uint16 (vocab <= 65,536) or uint32, chunked by 65,536 tokens,
             uncompressed; the split's documents back to back, each followed by eot
    attrs    on `tokens`: format="sprout-tokens-v1", dataset, split, num_tokens, num_documents,
             token_dtype, vocab_size, eot_id, bos_id (-1 = none), tokenizer_spec, tokenizer_name,
             tokenizer_fingerprint, tokens_sha256 (of the little-endian token bytes), seed; as JSON
             strings `sources` (name, path, weight each), `split_rule` (`sprout.prep.keys.SplitRule`)
             and `cleaning` (`sprout.prep.clean.CleanConfig`)
Required on read (`REQUIRED_ATTRS`): format, split, num_tokens, num_documents, token_dtype,
vocab_size, eot_id, tokenizer_spec, tokenizer_fingerprint, tokens_sha256. Written by blocks and
renamed into place when finished (`sprout.atomic.AtomicH5`), timestamps off: the same tokens and
attributes give the same bytes. `open_tokens_h5` refuses anything else, naming the file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from sprout.atomic import AtomicH5
from sprout.errors import SproutError

FORMAT = "sprout-tokens-v1"
CHUNK_TOKENS = 1 << 16
REQUIRED_ATTRS = ("format", "split", "num_tokens", "num_documents", "token_dtype", "vocab_size", "eot_id",
                  "tokenizer_spec", "tokenizer_fingerprint", "tokens_sha256")


def h5_name(dataset: str, split: str) -> str:
    return f"{dataset}_{split}.h5"


class H5TokenWriter:
    """Append token blocks to `tokens`; `close(attrs)` sets the attributes and renames into place."""

    def __init__(self, path: str | os.PathLike, dtype: np.dtype) -> None:
        self.path = Path(path)
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self._out = AtomicH5(self.path, track_order=False)
        self._ds = self._out.file.create_dataset(
            "tokens", shape=(0,), maxshape=(None,), dtype=self.dtype, chunks=(CHUNK_TOKENS,), track_times=False
        )
        self._n = 0
        self._sha = hashlib.sha256()

    def append(self, tokens: np.ndarray) -> None:
        tokens = np.asarray(tokens).astype(self.dtype, copy=False)
        self._ds.resize((self._n + len(tokens),))
        self._ds[self._n :] = tokens
        self._n += len(tokens)
        self._sha.update(tokens.tobytes())
        self._out.check()  # a full disk stops the run here, naming the file

    def close(self, attrs: dict[str, Any]) -> str:
        """Write attrs (num_tokens, token_dtype, tokens_sha256 are filled in), finish; returns tokens_sha256."""
        full = dict(attrs, format=FORMAT, num_tokens=self._n, token_dtype=self.dtype.name,
                    tokens_sha256=self._sha.hexdigest())
        for key, value in full.items():
            self._ds.attrs[key] = value if isinstance(value, (int, float, str)) else json.dumps(value)
        self._out.commit()
        return full["tokens_sha256"]

    def abort(self) -> None:
        self._out.abort()


@dataclass
class H5Tokens:
    """A validated pretraining HDF5 file; `tokens` is the lazy h5py dataset."""

    path: Path
    file: Any
    tokens: Any
    attrs: dict

    @property
    def vocab_size(self) -> int:
        return int(self.attrs["vocab_size"])

    @property
    def eot_id(self) -> int:
        return int(self.attrs["eot_id"])

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def iter_blocks(self, block: int = 1 << 22) -> Iterator[np.ndarray]:
        for start in range(0, len(self), block):
            yield self.tokens[start : start + block]

    def close(self) -> None:
        self.file.close()


def _attr(value):
    if isinstance(value, bytes):
        value = value.decode()
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, str) and value[:1] in "[{":
        with contextlib.suppress(json.JSONDecodeError):
            return json.loads(value)
    return value


def open_tokens_h5(path: str | os.PathLike) -> H5Tokens:
    """Open and validate a pretraining token file; SproutError naming the file otherwise."""
    import h5py

    path = Path(path)
    if not path.is_file():
        raise SproutError(f"{path}: no such HDF5 file")
    try:
        f = h5py.File(path, "r")
    except OSError as exc:
        raise SproutError(f"{path}: not a readable HDF5 file (truncated or corrupted?): {exc}") from None
    try:
        if "tokens" not in f or not isinstance(f["tokens"], h5py.Dataset):
            raise SproutError(f"{path}: no 'tokens' dataset (not a sprout pretraining token file)")
        ds = f["tokens"]
        if ds.ndim != 1:
            raise SproutError(f"{path}: 'tokens' is {ds.ndim}-D with shape {ds.shape}; pretraining tokens are 1-D (SFT file?)")
        if ds.dtype not in (np.dtype("<u2"), np.dtype("<u4")):
            raise SproutError(f"{path}: 'tokens' has dtype {ds.dtype}; expected uint16 or uint32")
        if ds.chunks is None:
            raise SproutError(f"{path}: 'tokens' is not chunked")
        attrs = {k: _attr(v) for k, v in ds.attrs.items()}
        missing = [k for k in REQUIRED_ATTRS if k not in attrs]
        if missing:
            raise SproutError(f"{path}: 'tokens' lacks attribute(s) {', '.join(missing)}")
        if attrs["format"] != FORMAT:
            raise SproutError(f"{path}: format {attrs['format']!r}, expected {FORMAT!r}")
        if int(attrs["num_tokens"]) != ds.shape[0]:
            raise SproutError(f"{path}: attrs say {attrs['num_tokens']:,} tokens but 'tokens' holds {ds.shape[0]:,}")
        if attrs["token_dtype"] != ds.dtype.name:
            raise SproutError(f"{path}: attrs say {attrs['token_dtype']} but 'tokens' is {ds.dtype.name}")
        if ds.dtype.itemsize == 2 and int(attrs["vocab_size"]) > 1 << 16:
            raise SproutError(f"{path}: vocab {attrs['vocab_size']:,} cannot be stored as uint16")
        return H5Tokens(path, f, ds, attrs)
    except BaseException:
        f.close()
        raise


def open_tokens(path: str | os.PathLike):
    """The validated 1-D `tokens` dataset of a pretraining file (its file stays open)."""
    return open_tokens_h5(path).tokens
