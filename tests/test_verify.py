import json
import runpy
import shutil
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from data_fixtures import make_docs, train_tiny_sp
from sprout.atomic import write_json_atomic
from sprout.atomic import sha256_file
from sprout.prep.pretrain import PrepConfig, prepare
from sprout.formats.shards import HEADER_BYTES, open_shard, write_shard
from sprout.formats.audit_tokens import verify_dir
from sprout.formats.verify_inputs import verify_token_data
from sprout.errors import SproutError

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A small verified dataset (bin + hdf5) to copy and corrupt."""
    d = tmp_path_factory.mktemp("built")
    tok = train_tiny_sp(d)
    (d / "a.txt").write_text("<|endoftext|>".join(make_docs(200, seed=1)) + "<|endoftext|>")
    (d / "b.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in make_docs(100, seed=2)))
    cfg = PrepConfig(name="v", sources=[str(d / "a.txt"), str(d / "b.jsonl")], tokenizer=tok.spec, out=str(d / "out"),
                     workers=1, shard_tokens=10_000, run_tokens=1_000, val_frac=0.1, format="both")
    prepare(cfg, tokenizer=tok, progress=False, log=lambda s: None)
    return d / "out"


@pytest.fixture()
def data(built, tmp_path):
    out = tmp_path / "data"
    shutil.copytree(built, out)
    return out


def manifest(d):
    return json.loads((d / "manifest.json").read_text())


def rewrite_shard(d, split, index, tokens):
    """Replace a shard with valid bytes and update the manifest to match, as a careless tool would."""
    m = manifest(d)
    entry = m["shards"][split][index]
    old = int(entry["num_tokens"])
    entry["sha256"] = write_shard(d / entry["file"], tokens, np.uint16)
    entry["num_tokens"], entry["max_token_id"] = len(tokens), int(tokens.max())
    m["splits"][split]["tokens"] += len(tokens) - old
    write_json_atomic(d / "manifest.json", m)
    return entry["file"]


def failures(d):
    return verify_dir(d)[0]


def test_clean_output_passes(data):
    fails, notes = verify_dir(data)
    assert fails == []
    assert any(n.startswith("train bin") for n in notes) and any(n.startswith("val hdf5") for n in notes)


def test_flipped_payload_byte(data):
    name = manifest(data)["shards"]["train"][1]["file"]
    raw = bytearray((data / name).read_bytes())
    raw[HEADER_BYTES + 101] ^= 0x01
    (data / name).write_bytes(bytes(raw))
    fails = failures(data)
    assert any(name in f and "sha256" in f and "corrupted" in f for f in fails), fails


def test_bad_magic_version_and_truncation(data):
    m = manifest(data)
    first, second = (data / e["file"] for e in m["shards"]["train"][:2])
    raw = bytearray(first.read_bytes())
    raw[0] ^= 0xFF
    first.write_bytes(bytes(raw))
    second.write_bytes(second.read_bytes()[:-3])
    fails = failures(data)
    assert any(first.name in f and "bad header magic" in f for f in fails), fails
    assert any(second.name in f and "size mismatch" in f for f in fails), fails


def test_id_at_or_above_vocab(data):
    name = manifest(data)["shards"]["train"][0]["file"]
    tokens = np.array(open_shard(data / name))
    tokens[5] = 400  # vocab size is 400
    rewrite_shard(data, "train", 0, tokens)
    fails = failures(data)
    assert any(name in f and "token id 400 at position 5 is >= vocab size 400" in f for f in fails), fails
    assert any("v_train.h5: holds different train tokens than the .bin shards" in f for f in fails), fails
    assert len(fails) == 2


def test_train_val_overlap_in_the_tokens(data):
    m = manifest(data)
    val = np.array(open_shard(data / m["shards"]["val"][0]["file"]))
    doc = val[: int(np.flatnonzero(val == 3)[0]) + 1]  # the first val document and its eot
    last = m["shards"]["train"][-1]
    tokens = np.concatenate([np.array(open_shard(data / last["file"])), doc])
    rewrite_shard(data, "train", len(m["shards"]["train"]) - 1, tokens)
    fails = failures(data)
    assert any("1 train document(s) also occur in the val bin output (train/val overlap)" in f for f in fails), fails


def test_train_val_overlap_in_the_sidecar(data):
    path = data / "doc_hashes.npz"
    with np.load(path) as z:
        train, val = z["train"], z["val"]
    with open(path, "wb") as f:
        np.savez(f, train=np.concatenate([train, val[:2]]), val=val)
    m = manifest(data)
    m["doc_hashes"]["sha256"] = sha256_file(path)
    write_json_atomic(data / "manifest.json", m)
    fails = failures(data)
    assert fails == [f"{path}: 2 document key(s) are in both train and val (train/val overlap)"]


def test_hdf5_corruption_and_foreign_files(data):
    h5 = data / manifest(data)["hdf5"]["val"]["file"]
    with h5py.File(h5, "r+") as f:
        f["tokens"][10] = (int(f["tokens"][10]) + 1) % 400
    (data / "other_train_000000.bin").write_bytes(b"")
    fails = failures(data)
    assert any(h5.name in f and "tokens_sha256" in f for f in fails), fails
    assert any("other_train_000000.bin: not listed" in f for f in fails), fails


def test_missing_manifest_and_missing_eot(data, tmp_path):
    m = manifest(data)
    for split in ("train", "val"):
        for i, e in enumerate(m["shards"][split]):
            tokens = np.array(open_shard(data / e["file"]))
            rewrite_shard(data, split, i, np.where(tokens == 3, 4, tokens))
    fails = failures(data)
    assert any("train bin output has no end-of-text token" in f for f in fails), fails
    (data / "manifest.json").unlink()
    assert failures(data) == [f"{data / 'manifest.json'}: no manifest (unfinished or not a sprout token folder)"]


def run_script(monkeypatch, capsys, d):
    monkeypatch.setattr(sys, "argv", ["verify_shards.py", str(d)])
    with pytest.raises(SystemExit) as exc:
        runpy.run_path(str(ROOT / "scripts" / "verify_shards.py"), run_name="__main__")
    return exc.value.code, capsys.readouterr()


def test_script_exit_codes(data, monkeypatch, capsys):
    code, out = run_script(monkeypatch, capsys, data)
    assert code == 0 and "all checks passed" in out.out
    name = manifest(data)["shards"]["val"][0]["file"]
    raw = bytearray((data / name).read_bytes())
    raw[-1] ^= 0x10
    (data / name).write_bytes(bytes(raw))
    code, out = run_script(monkeypatch, capsys, data)
    fail_lines = [line for line in out.err.splitlines() if line.startswith("FAIL ")]
    assert code == 1 and fail_lines and all(name in line or "h5" in line for line in fail_lines)


def test_a_manifest_without_max_token_id_is_refused_by_the_audit_and_at_start(data):
    m = manifest(data)
    del m["hdf5"]["val"]["max_token_id"]
    write_json_atomic(data / "manifest.json", m)
    line = (f"{data / 'manifest.json'}: hdf5.val has no max_token_id (written by an earlier version of sprout); "
            f"prepare the data again")
    assert failures(data) == [line]
    for given in (data, data / "v_train.h5"):
        with pytest.raises(SproutError) as exc:
            verify_token_data(given, "sizes")
        assert str(exc.value) == line


def test_start_up_check_follows_the_audit_rules(data):
    """The trainers' check (`verify_token_data`) runs the same per-file rules as the audit."""
    assert verify_token_data(data).files == len(manifest(data)["shards"]["train"]) + len(manifest(data)["shards"]["val"])
    assert verify_token_data(data / "v_train.h5", "sizes").files == 2
    shutil.copy(data / "v_val.h5", data / "w_val.h5")  # an .h5 of another prep beside the shards
    for given in (data, data / "v_train.h5"):
        with pytest.raises(SproutError, match=r"w_val.h5: not listed in .*manifest.json"):
            verify_token_data(given)
    (data / "w_val.h5").unlink()
    with h5py.File(data / "v_val.h5", "r+") as f:
        f["tokens"].attrs["eot_id"] = 4
    with pytest.raises(SproutError, match=r"v_val.h5: attribute eot_id=4 but .*manifest.json says 3"):
        verify_token_data(data / "v_train.h5", "sizes")
    assert any("v_val.h5: attribute eot_id=4" in f for f in failures(data))


def test_hdf5_files_without_their_manifest_are_refused(data):
    (data / "manifest.json").unlink()
    with pytest.raises(SproutError, match="no manifest"):
        verify_token_data(data / "v_train.h5")


def test_an_sft_pair_without_prep_run_id_is_refused(tmp_path):
    from sprout.formats.packed_sft import write_sft_files
    from sprout.formats.verify_inputs import verify_sft_pair

    row = {"tokens": [5, 6, 0, 0], "loss_mask": [0, 1, 0, 0], "segment_ids": [1, 1, 0, 0], "position_ids": [0, 1, 0, 0]}
    arrays = {k: np.array([v], np.uint8 if k == "loss_mask" else np.uint16) for k, v in row.items()}
    attrs = {"tokenizer_spec": "x", "tokenizer_name": "x", "tokenizer_fingerprint": "", "vocab_size": 10, "eot_id": 6,
             "pad_id": 0, "template_version": "v", "template": {}, "counts": {}}
    train, val = tmp_path / "sft.h5", tmp_path / "sft_val.h5"
    write_sft_files([(train, arrays, {**attrs, "split": "train"}), (val, arrays, {**attrs, "split": "val"})])
    assert verify_sft_pair(train, val).files == 2
    with h5py.File(train, "r+") as f:
        del f.attrs["prep_run_id"]
    with pytest.raises(SproutError) as exc:
        verify_sft_pair(train, val, "sizes")
    assert str(exc.value) == (f"{train}: no prep_run_id (written by an earlier version of sprout); "
                              f"prepare the data again")
