import hashlib

import h5py
import numpy as np
import pytest

from sprout.errors import SproutError
from sprout.formats.h5tokens import H5TokenWriter, open_tokens, open_tokens_h5
from sprout.formats.shards import (HEADER_BYTES, MAGIC_U16, MAGIC_U32, ShardError, dtype_for_vocab, list_shards, open_shard,
                           read_header, shard_name, write_shard)

ATTRS = {"dataset": "t", "split": "train", "num_documents": 2, "vocab_size": 70_000, "eot_id": 3, "bos_id": -1,
         "tokenizer_spec": "x", "tokenizer_name": "x", "tokenizer_fingerprint": "f" * 64, "sources": [{"name": "a"}]}


@pytest.mark.parametrize("dtype,magic,version,top", [(np.uint16, MAGIC_U16, 1, 65_535), (np.uint32, MAGIC_U32, 7, 100_000)])
def test_bin_round_trip(tmp_path, dtype, magic, version, top):
    tokens = np.array([0, 1, 2, top, 3], dtype=np.int64)
    path = tmp_path / shard_name("t", "train", 0)
    sha = write_shard(path, tokens, dtype)
    assert sha == hashlib.sha256(path.read_bytes()).hexdigest()
    hdr = read_header(path)
    assert (hdr.magic, hdr.version, hdr.num_tokens) == (magic, version, 5)
    assert path.stat().st_size == HEADER_BYTES + 5 * np.dtype(dtype).itemsize
    assert open_shard(path).tolist() == tokens.tolist()
    assert list_shards(tmp_path, "train") == [path] and list_shards(tmp_path, "val") == []


def test_dtype_for_vocab():
    assert dtype_for_vocab(65_536) == np.dtype("<u2") and dtype_for_vocab(65_537) == np.dtype("<u4")
    with pytest.raises(SproutError, match="100,277 does not fit uint16"):
        dtype_for_vocab(100_277, "uint16")
    with pytest.raises(ShardError, match="out of range"):
        write_shard("/tmp/never.bin", np.array([70_000]), np.uint16)


def test_reader_rejects_bad_magic_version_truncation_and_size(tmp_path):
    good = tmp_path / "t_train_000000.bin"
    write_shard(good, np.arange(100), np.uint16)
    raw = good.read_bytes()
    cases = {
        "magic.bin": (np.int32(12345).tobytes() + raw[4:], "bad header magic/version 12345/v1"),
        "version.bin": (raw[:4] + np.int32(2).tobytes() + raw[8:], f"bad header magic/version {MAGIC_U16}/v2"),
        "u32magic.bin": (np.int32(MAGIC_U32).tobytes() + raw[4:], "magic/version 20240801/v1"),
        "truncated.bin": (raw[:-2], "size mismatch: file is 1,222 bytes but header says 100 tokens"),
        "padded.bin": (raw + b"\0\0", "size mismatch"),
        "short.bin": (raw[:100], "shorter than the 1024-byte header"),
    }
    for name, (data, message) in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ShardError, match=f"{name}: .*{message}"):
            open_shard(tmp_path / name)
    with pytest.raises(ShardError, match="no such shard"):
        read_header(tmp_path / "missing.bin")


def write_h5(path, tokens, dtype=np.uint32, attrs=ATTRS):
    w = H5TokenWriter(path, dtype)
    for block in np.array_split(tokens, 3):
        w.append(block)
    return w.close(attrs)


def test_hdf5_round_trip_and_atomicity(tmp_path):
    tokens = np.arange(200_000) % 70_000
    path = tmp_path / "t_train.h5"
    sha = write_h5(path, tokens)
    h5 = open_tokens_h5(path)
    assert np.array_equal(h5.tokens[:], tokens) and h5.tokens.chunks is not None and h5.tokens.dtype == np.uint32
    assert (h5.vocab_size, h5.eot_id, len(h5), h5.attrs["num_tokens"]) == (70_000, 3, 200_000, 200_000)
    assert h5.attrs["sources"] == [{"name": "a"}] and h5.attrs["tokens_sha256"] == sha
    assert sha == hashlib.sha256(tokens.astype("<u4").tobytes()).hexdigest()
    h5.close()
    assert len(open_tokens(path)) == 200_000
    # an aborted writer leaves nothing behind
    w = H5TokenWriter(tmp_path / "t_val.h5", np.uint16)
    w.append(np.arange(10))
    w.abort()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t_train.h5"]
    # same tokens -> same bytes (no timestamps)
    write_h5(tmp_path / "again.h5", tokens)
    assert (tmp_path / "again.h5").read_bytes() == path.read_bytes()


def test_hdf5_reader_refuses_other_files(tmp_path):
    path = tmp_path / "sft.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("tokens", data=np.zeros((4, 8), np.uint16), chunks=True)
        f.create_dataset("loss_mask", data=np.zeros((4, 8), np.uint8))
    with pytest.raises(SproutError, match="sft.h5: 'tokens' is 2-D"):
        open_tokens_h5(path)
    with h5py.File(path, "w") as f:
        f.create_dataset("tokens", data=np.zeros(8, np.int64), chunks=True)
    with pytest.raises(SproutError, match="sft.h5: 'tokens' has dtype int64"):
        open_tokens_h5(path)
    with h5py.File(path, "w") as f:
        f.create_dataset("tokens", data=np.zeros(8, np.uint16), chunks=True)
    with pytest.raises(SproutError, match="sft.h5: 'tokens' lacks attribute"):
        open_tokens_h5(path)
    good = tmp_path / "good.h5"
    write_h5(good, np.arange(1000), np.uint32)
    (tmp_path / "cut.h5").write_bytes(good.read_bytes()[:2000])
    with pytest.raises(SproutError, match="cut.h5: not a readable HDF5 file"):
        open_tokens_h5(tmp_path / "cut.h5")
    (tmp_path / "text.h5").write_text("hello")
    with pytest.raises(SproutError, match="text.h5: not a readable HDF5 file"):
        open_tokens_h5(tmp_path / "text.h5")
    with pytest.raises(SproutError, match="vocab 70,000 cannot be stored as uint16"):
        write_h5(tmp_path / "u16.h5", np.arange(10), np.uint16)
        open_tokens_h5(tmp_path / "u16.h5")
