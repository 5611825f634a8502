"""A tampered checkpoint met through the scripts: a meta.json whose step was edited or that has
no meta_sha256, and a `latest` that leads out of its run are refused with one line naming the file, nothing written."""

from __future__ import annotations

import json
import shutil

import pytest
from test_bad_inputs_train import built, data, one_error, pretrain, run, tok, tree  # noqa: F401 (fixtures)


@pytest.fixture()
def done(data, tmp_path):
    """A complete 2-step pretraining run (`pretrain` of test_bad_inputs_train)."""
    ok = pretrain(data, tmp_path / "run")
    assert ok.returncode == 0, ok.stderr
    return tmp_path / "run"


def test_an_edited_step_and_a_latest_leading_out_are_refused(done, tmp_path):
    ckpt = next((done / "checkpoints").glob("step_*"))
    original = (ckpt / "meta.json").read_text()
    meta = json.loads(original)
    (ckpt / "meta.json").write_text(json.dumps({**meta, "step": 99}, indent=2))  # formerly: "nothing to do", exit 0
    before = tree(tmp_path)
    one_error(run("pretrain.py", "--out", done, "--resume"), str(ckpt / "meta.json"), "meta_sha256")
    assert tree(tmp_path) == before

    (ckpt / "meta.json").write_text(json.dumps({k: v for k, v in meta.items() if k != "meta_sha256"}))
    before = tree(tmp_path)
    one_error(run("pretrain.py", "--out", done, "--resume"), str(ckpt / "meta.json"), "earlier version of sprout")
    assert tree(tmp_path) == before

    (ckpt / "meta.json").write_text(original)
    other = tmp_path / "other"
    shutil.copytree(done, other)
    (done / "checkpoints" / "latest").write_text(f"../../other/checkpoints/{ckpt.name}\n")
    before = tree(tmp_path)
    one_error(run("export_hf.py", done, tmp_path / "hf", "--no-check"), str(done / "checkpoints" / "latest"),
              "not a plain file name")
    assert tree(tmp_path) == before
