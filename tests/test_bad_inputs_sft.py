"""An SFT pair edited after prep with every recorded hash rewritten to match, met through
scripts/train_sft.py: a prep_run_id left as it was, an all-ones loss_mask, rows whose mask
trains nothing and ids past the vocabulary are each refused in one line naming the file (and
the rows), nothing written, so a rerun with good data needs no --overwrite."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import h5py
import pytest
from test_bad_inputs_train import one_error, sft, sft_runs, tok, tree  # noqa: F401 (fixtures)

from sprout.formats.packed_sft import DATASETS, SFTFile, run_id_of


def forge(folder: Path, edit, run_id: bool) -> Path:
    """Apply `edit(h5py file)` to folder/sft.h5, rewrite its recorded sha256s and, with `run_id`,
    the prep_run_id of both files to match (a thorough forgery); returns the train file."""
    train, val = folder / "sft.h5", folder / "sft_val.h5"
    with h5py.File(train, "r+") as f:
        edit(f)
    with SFTFile(train) as f:
        digests = {}
        for name in DATASETS:  # the recorded sha256s recomputed after the edit
            digests[name] = hashlib.sha256(f.read()[name].tobytes()).hexdigest()
    with h5py.File(train, "r+") as f:
        f.attrs["sha256"] = json.dumps(digests)
    if run_id:
        with SFTFile(train) as a, SFTFile(val) as b:
            new_id = run_id_of([(a.attrs, a.attrs["sha256"]), (b.attrs, b.attrs["sha256"])])
        for p in (train, val):
            with h5py.File(p, "r+") as f:
                f.attrs["prep_run_id"] = new_id
    return train


def all_ones(f):
    f["loss_mask"][...] = 1


def rows_1_and_3_train_nothing(f):
    mask = f["loss_mask"][...]
    mask[[1, 3], :] = 0
    f["loss_mask"][...] = mask


def id_past_vocab(f):
    tokens = f["tokens"][...]
    tokens[0, 3] = 447  # inside the model's 448, past the data's vocabulary
    f["tokens"][...] = tokens


@pytest.mark.parametrize("edit, run_id, verify, needles", [
    (all_ones, False, "full", ("prep_run_id", "does not match")),
    (all_ones, True, "full", ("row 0 position 0", "loss_mask[0] is 1")),
    (id_past_vocab, True, "full", ("row 0 position 3", "token id outside the vocabulary")),
    (id_past_vocab, True, "sizes", ("token id 447 is >= vocab size",)),
    (rows_1_and_3_train_nothing, True, "full", ("2 of", "rows have no trained target", "rows 1, 3")),
    (rows_1_and_3_train_nothing, True, "sizes", ("2 of", "rows have no trained target", "rows 1, 3")),
])
def test_an_sft_pair_edited_after_prep_is_refused(edit, run_id, verify, needles, sft_runs, tmp_path):
    root, base = sft_runs
    d = tmp_path / "d"
    shutil.copytree(root / "a", d)
    train = forge(d, edit, run_id)
    before = tree(tmp_path)
    one_error(sft(train, base, tmp_path / "run", "--data-verify", verify), str(train), *needles)
    assert tree(tmp_path) == before
