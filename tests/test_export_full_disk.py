"""scripts/export_hf.py on a full disk: one line naming the output, exit 2, and nothing
half-written (no output folder, no temporary beside it, an earlier export left whole). The
full disk is a write that fails with ENOSPC, in this process."""

import errno
import os
import runpy
import sys
from pathlib import Path

import pytest
from safetensors import SafetensorError
from test_export import tiny_model

import sprout.model.export as export
from sprout.checkpoint import bundle_tokenizer, save_checkpoint

ROOT = Path(__file__).resolve().parents[1]


def full_disk(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def safetensors_full_disk(*args, **kwargs):  # how safetensors reports the same
    raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: '
                          '"No space left on device" })')


@pytest.fixture
def run(sp, tmp_path):
    model = tiny_model(sp.vocab_size)
    run = tmp_path / "run"
    save_checkpoint(run / "checkpoints" / "step_00000001", model,
                    meta={"model_config": model.config, "tokenizer": sp.spec, "stage": "sft", "step": 1,
                          **bundle_tokenizer(sp.spec, run)})
    (run / "checkpoints" / "latest").write_text("step_00000001\n")
    return run


def export_hf(monkeypatch, capsys, *args: str) -> tuple[int, str]:
    monkeypatch.setattr(sys, "argv", [str(ROOT / "scripts" / "export_hf.py"), *args, "--no-check"])
    with pytest.raises(SystemExit) as exc:
        runpy.run_path(str(ROOT / "scripts" / "export_hf.py"), run_name="__main__")
    return exc.value.code, capsys.readouterr().err


@pytest.mark.parametrize("where, failure", [("save_file", full_disk), ("save_file", safetensors_full_disk),
                                            ("write_json", full_disk), ("replace_dir", full_disk)])
def test_a_full_disk_is_one_line_and_leaves_nothing_half_written(run, tmp_path, monkeypatch, capsys, where, failure):
    out = tmp_path / "exports" / "hf"
    monkeypatch.setattr(export, where, failure)
    code, err = export_hf(monkeypatch, capsys, str(run), str(out))
    assert code == 2 and err.startswith(f"error: {out}: cannot write the export: ") and err.count("\n") == 1, err
    assert "No space left on device" in err
    assert not out.exists() and not [p for p in out.parent.iterdir() if p.name.startswith(".tmp-")]


def test_a_full_disk_on_overwrite_keeps_the_earlier_export_whole(run, tmp_path, monkeypatch, capsys):
    out = tmp_path / "hf"
    assert export_hf(monkeypatch, capsys, str(run), str(out))[0] == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    monkeypatch.setattr(export, "save_file", full_disk)
    code, err = export_hf(monkeypatch, capsys, str(run), str(out), "--overwrite")
    assert code == 2 and err.count("\n") == 1 and "No space left on device" in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "run"]
