"""Checkpoints: round trip, rotation, atomicity, and refusal of corrupted or unsafe files."""

import json

import pytest
import torch

from sprout.checkpoint import (
    STATE,
    WEIGHTS,
    load_train_state,
    meta_digest,
    read_meta,
    save_checkpoint,
    save_rotating,
    sha256_file,
)
from sprout.errors import SproutError
from sprout.formats.checkpoint_meta import resolve_checkpoint
from sprout.model.load import load_model
from sprout.model.transformer import ModelConfig, Transformer


def tiny(tie=False):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=16, tie_embeddings=tie)
    return Transformer(cfg)


def trained_optimizer(model):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randint(0, 64, (2, 8))).sum().backward()
    opt.step()
    return opt


@pytest.mark.parametrize("tie", [False, True])
def test_round_trip_weights_meta_and_optimizer(tmp_path, tie):
    model = tiny(tie)
    opt = trained_optimizer(model)
    path = save_checkpoint(tmp_path / "ck", model, meta={"model_config": model.config, "step": 7, "stage": "pretrain"},
                           optimizer=opt, extra_state={"note": torch.arange(3)})
    loaded, meta = load_model(path)
    x = torch.randint(0, 64, (2, 10))
    assert torch.equal(loaded(x), model.eval()(x))
    assert meta["step"] == 7 and meta["model_config"]["tie_embeddings"] is tie
    assert set(meta["files"]) == {WEIGHTS, STATE}
    state = load_train_state(path)
    fresh = torch.optim.AdamW(loaded.parameters(), lr=1e-2)
    fresh.load_state_dict(state["optimizer"])
    assert torch.equal(fresh.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    assert torch.equal(state["extra"]["note"], torch.arange(3))
    assert len(state["rng"]) == 1 and isinstance(state["rng"][0]["torch"], torch.Tensor)


def test_rotation_keeps_last_k_and_latest_points_at_newest(tmp_path):
    model = tiny()
    root = tmp_path / "run" / "checkpoints"
    for step in (10, 20, 30, 40):
        save_rotating(root, step, model, keep=2, meta={"model_config": model.config, "step": step})
    names = sorted(p.name for p in root.iterdir())
    assert names == ["latest", "step_00000030", "step_00000040"]
    for where in (tmp_path / "run", root, root / "step_00000040"):
        assert resolve_checkpoint(where).name == "step_00000040"
    with pytest.raises(SproutError, match="no such checkpoint"):
        resolve_checkpoint(tmp_path / "missing")


def test_failed_save_leaves_nothing_behind(tmp_path):
    class Broken:
        def state_dict(self):
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        save_checkpoint(tmp_path / "ck", tiny(), meta={}, optimizer=Broken())
    assert list(tmp_path.iterdir()) == []


def test_corrupted_files_are_refused_naming_the_file(tmp_path):
    model = tiny()
    path = save_checkpoint(tmp_path / "ck", model, meta={"model_config": model.config})
    weights = path / WEIGHTS
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(SproutError, match=f"{weights}.*sha256"):
        load_model(path)
    (path / "meta.json").write_text("{not json")
    with pytest.raises(SproutError, match="meta.json"):
        read_meta(path)


def test_pickled_code_in_train_state_is_refused(tmp_path):
    model = tiny()
    path = save_checkpoint(tmp_path / "ck", model, meta={"model_config": model.config})
    torch.save({"optimizer": None, "rng": [], "payload": Exploit()}, path / STATE)  # hand-made, hash updated
    meta = json.loads((path / "meta.json").read_text())
    meta["files"][STATE] = sha256_file(path / STATE)
    meta["meta_sha256"] = meta_digest(meta)
    (path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(SproutError, match=f"{path / STATE}"):
        load_train_state(path)


class Exploit:
    def __reduce__(self):
        return (print, ("unpickled!",))


def test_an_edited_meta_and_a_latest_leading_out_are_refused(tmp_path):
    model = tiny()
    root = tmp_path / "run" / "checkpoints"
    path = save_rotating(root, 4, model, meta={"model_config": model.config, "step": 4})
    meta = json.loads((path / "meta.json").read_text())
    assert meta["meta_sha256"] == meta_digest(meta) and read_meta(root)["step"] == 4
    (path / "meta.json").write_text(json.dumps({**meta, "step": 99}, indent=2))
    for verify in (True, False):
        with pytest.raises(SproutError, match=f"{path / 'meta.json'}: its contents do not match its meta_sha256"):
            read_meta(root, verify=verify)
    del meta["meta_sha256"]  # a meta.json of an earlier version of sprout
    (path / "meta.json").write_text(json.dumps(meta, indent=2))
    for verify in (True, False):
        with pytest.raises(SproutError) as err:
            read_meta(root, verify=verify)
        assert str(err.value) == (f"{path / 'meta.json'}: no meta_sha256 (written by an earlier version of "
                                  f"sprout); train or import the run again")
    del meta["architecture"]  # hashed, but without the field load_model builds its module from
    (path / "meta.json").write_text(json.dumps({**meta, "meta_sha256": meta_digest(meta)}, indent=2))
    for read in (read_meta, load_model):
        with pytest.raises(SproutError) as err:
            read(root)
        assert str(err.value) == (f"{path / 'meta.json'}: no architecture (written by an earlier version of "
                                  f"sprout); train or import the run again")
    other = save_rotating(tmp_path / "other" / "checkpoints", 8, model, meta={"model_config": model.config})
    (root / "latest").write_text(f"../../other/checkpoints/{other.name}\n")
    with pytest.raises(SproutError, match="is not a plain file name"):
        resolve_checkpoint(root)
    (root / "step_00000009").symlink_to(other)
    (root / "latest").write_text("step_00000009\n")
    with pytest.raises(SproutError, match=f"{root / 'latest'}: points at step_00000009, which leads out of"):
        resolve_checkpoint(tmp_path / "run")
