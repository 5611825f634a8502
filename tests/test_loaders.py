"""Token loaders: order, wrapping, rank disjointness, determinism, state, HDF5 source."""

import numpy as np
import pytest
import torch

from data_loader.token_batches import (
    DistributedTokenLoader,
    RandomWindowSampler,
    TokenStream,
    eval_rows,
    open_token_sources,
    read_tokens,
)
from sprout.errors import SproutError
from sprout.formats.h5tokens import H5TokenWriter
from sprout.formats.shards import shard_name, write_shard


@pytest.fixture
def shards(tmp_path):
    """Two train shards holding 0..99 and 100..149 (so every id names its position), one val."""
    write_shard(tmp_path / shard_name("t", "train", 0), np.arange(100), np.uint16)
    write_shard(tmp_path / shard_name("t", "train", 1), np.arange(100, 150), np.uint16)
    write_shard(tmp_path / shard_name("t", "val", 0), np.arange(1000, 1040), np.uint16)
    return tmp_path


def test_stream_reads_in_order_and_wraps(shards):
    s = TokenStream(open_token_sources(shards, "train"))
    assert s.take(95).tolist() == list(range(95))
    assert s.take(10).tolist() == list(range(95, 105))  # crosses into shard 1
    s.skip(40)
    assert s.take(10).tolist() == [145, 146, 147, 148, 149, 0, 1, 2, 3, 4]  # wraps to shard 0
    assert s.state_dict() == {"shard": 0, "offset": 5}


def test_stream_state_restores_position(shards):
    a = TokenStream(open_token_sources(shards, "train"))
    a.take(123)
    b = TokenStream(open_token_sources(shards, "train"))
    b.load_state_dict(a.state_dict())
    assert a.take(60).tolist() == b.take(60).tolist()
    with pytest.raises(SproutError):
        b.load_state_dict({"shard": 5, "offset": 0})


def test_distributed_spans_are_disjoint_and_match_one_process(shards):
    src = open_token_sources(shards, "train")
    ranks = [DistributedTokenLoader(src, r, 2) for r in range(2)]
    single = DistributedTokenLoader(src, 0, 1)
    for _ in range(3):  # each step: 1 process × 2 micro-steps == 2 processes × 1
        (x0, y0), (x1, y1) = (ld.next_batch(2, 8) for ld in ranks)
        sx0, sy0 = single.next_batch(2, 8)
        sx1, sy1 = single.next_batch(2, 8)
        assert torch.equal(x0, sx0) and torch.equal(x1, sx1) and torch.equal(y1, sy1)
        assert not set(x0.flatten().tolist()) & set(x1.flatten().tolist())
        assert torch.equal(y0[:, :-1], x0[:, 1:])  # targets are inputs shifted by one
    assert ranks[0].state_dict() == ranks[1].state_dict() == single.state_dict()
    assert x0.dtype == torch.int64 and x0.shape == (2, 8)


def test_distributed_loader_is_deterministic_and_resumable(shards):
    src = open_token_sources(shards, "train")
    a, b = DistributedTokenLoader(src, 1, 2), DistributedTokenLoader(src, 1, 2)
    for _ in range(4):
        assert torch.equal(a.next_batch(3, 5)[0], b.next_batch(3, 5)[0])
    c = DistributedTokenLoader(src, 1, 2)
    c.load_state_dict(a.state_dict())
    assert torch.equal(a.next_batch(3, 5)[0], c.next_batch(3, 5)[0])


def test_random_windows_seeded_contiguous_and_rank_split(shards):
    src = open_token_sources(shards, "train")
    a, b = RandomWindowSampler(src, seed=7), RandomWindowSampler(src, seed=7)
    xa, ya = a.next_batch(6, 10)
    xb, _ = b.next_batch(6, 10)
    assert torch.equal(xa, xb)
    assert not torch.equal(xa, RandomWindowSampler(src, seed=8).next_batch(6, 10)[0])
    # every window is a contiguous run of one shard (ids equal positions in the fixture)
    full = torch.cat([xa, ya[:, -1:]], dim=1)
    assert torch.all(full[:, 1:] - full[:, :-1] == 1)
    # 2 ranks × 3 rows == 1 process drawing 3 rows twice
    one = RandomWindowSampler(src, seed=3)
    r0, r1 = (RandomWindowSampler(src, seed=3, rank=r, world_size=2) for r in range(2))
    assert torch.equal(one.next_batch(3, 10)[0], r0.next_batch(3, 10)[0])
    assert torch.equal(one.next_batch(3, 10)[0], r1.next_batch(3, 10)[0])


def test_random_sampler_state_round_trip(shards):
    src = open_token_sources(shards, "train")
    a = RandomWindowSampler(src, seed=1)
    a.next_batch(4, 10)
    b = RandomWindowSampler(src, seed=99)
    b.load_state_dict(a.state_dict())
    assert torch.equal(a.next_batch(4, 10)[0], b.next_batch(4, 10)[0])
    with pytest.raises(SproutError, match="sequential"):
        DistributedTokenLoader(src).load_state_dict(a.state_dict())


def _write_h5(path, tokens):
    w = H5TokenWriter(path, np.uint16)
    w.append(tokens)
    w.close({"split": "x", "num_documents": 1, "vocab_size": 2048, "eot_id": 0,
             "tokenizer_spec": "test", "tokenizer_fingerprint": "0"})


def test_hdf5_source_streams_like_shards(shards, tmp_path):
    h5 = tmp_path / "t_train.h5"
    _write_h5(h5, np.arange(150))
    _write_h5(tmp_path / "t_val.h5", np.arange(1000, 1040))
    from_h5 = DistributedTokenLoader(open_token_sources(h5, "train"))
    from_bin = DistributedTokenLoader(open_token_sources(shards, "train"))
    for _ in range(5):
        assert torch.equal(from_h5.next_batch(4, 9)[0], from_bin.next_batch(4, 9)[0])
    assert read_tokens(open_token_sources(h5, "val")).tolist() == list(range(1000, 1040))
    assert RandomWindowSampler(open_token_sources(h5, "train"), seed=2).next_batch(3, 7)[0].shape == (3, 7)


def test_eval_rows_split_ranks_without_overlap(shards):
    tokens = read_tokens(open_token_sources(shards, "val"))  # 40 tokens -> 4 rows of 9
    x, y = eval_rows(tokens, 9)
    assert x.shape == (4, 9) and torch.equal(y[:, -1], x[:, -1] + 1)
    parts = [eval_rows(tokens, 9, r, 3)[0] for r in range(3)]
    assert torch.equal(torch.cat(parts), x)
    assert eval_rows(tokens[:5], 9)[0].shape == (0, 9)


def test_missing_or_empty_data_is_a_clear_error(tmp_path):
    with pytest.raises(SproutError, match="does not exist"):
        open_token_sources(tmp_path / "nope", "train")
    with pytest.raises(SproutError, match="no train shards"):
        open_token_sources(tmp_path, "train")
    with pytest.raises(SproutError, match="no such HDF5"):
        open_token_sources(tmp_path / "x_train.h5", "train")
