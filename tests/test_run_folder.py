"""The tokenizer travels with the run: a run folder keeps its own copy, checkpoints record its
sha256, and a moved run folder still chats and resumes from any working directory; a tokenizer
file that was changed is refused with one line."""

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from proc import run_here
from test_sft_train import base, run_a, sft_file, tiny_cfg, train_losses  # noqa: F401 (fixtures)

from sprout.chat import TEMPLATE_VERSION
from sprout.checkpoint import bundle_tokenizer, checkpoint_tokenizer, read_meta, save_rotating
from sprout.errors import SproutError
from sprout.model.chat_session import ChatSession, load_chat_model
from sprout.model.transformer import ModelConfig, Transformer
from sprout.stages.sft import run_sft

ROOT = Path(__file__).resolve().parents[1]


def moved_copy(run: Path, tmp_path: Path) -> Path:
    """A copy of `run` moved to another folder (the original is a module fixture, kept intact)."""
    shutil.copytree(run, tmp_path / "staging")
    return Path(shutil.move(tmp_path / "staging", tmp_path / "elsewhere" / "renamed"))


def test_sft_run_keeps_its_tokenizer_and_records_its_hash(run_a, sp):
    out, _ = run_a
    meta = read_meta(out / "checkpoints")
    copy = out / "tokenizer" / Path(sp.spec.partition(":")[2]).name
    assert meta["tokenizer_file"] == f"tokenizer/{copy.name}" and copy.is_file()
    assert copy.read_bytes() == Path(sp.spec.partition(":")[2]).read_bytes()
    assert copy.with_suffix(".vocab").is_file()
    assert meta["tokenizer"] == sp.spec  # the original spec is kept for provenance


def test_moved_run_folder_still_chats_from_another_directory(run_a, tmp_path, monkeypatch):
    out, _ = run_a
    moved = moved_copy(out, tmp_path)
    monkeypatch.chdir(tmp_path / "elsewhere")
    replies = []
    for folder in (out, moved):
        model, tok, meta = load_chat_model(folder)
        assert tok.spec == f"sentencepiece:{folder / meta['tokenizer_file']}"  # the run's own copy
        replies.append(ChatSession(model, tok, temperature=0, max_new_tokens=8).send("Say apple then river.").tokens)
    assert replies[0] == replies[1]


def test_moved_run_folder_resumes_bit_for_bit(run_a, sft_file, base, tmp_path):
    out_a, _ = run_a
    moved = moved_copy(out_a, tmp_path)
    shutil.rmtree(moved / "checkpoints" / "step_00000016")
    (moved / "checkpoints" / "latest").write_text("step_00000008\n")
    run_sft(tiny_cfg(sft_file, base, moved), resume="latest")
    a, b = train_losses(out_a), train_losses(moved)
    assert [b[s] for s in range(9, 17)] == [a[s] for s in range(9, 17)]  # exact float equality
    assert read_meta(moved / "checkpoints")["tokenizer_file"] == read_meta(out_a / "checkpoints")["tokenizer_file"]


def test_changed_tokenizer_file_is_refused_with_one_line(run_a, tmp_path):
    out, _ = run_a
    moved = moved_copy(out, tmp_path)
    meta = read_meta(moved / "checkpoints")
    f = moved / meta["tokenizer_file"]
    f.write_bytes(f.read_bytes() + b"\0")
    with pytest.raises(SproutError, match=r"tokenizer/.*\.model: sha256 does not match tokenizer_sha256 in "
                                          r".*step_00000016/meta.json; not the tokenizer"):
        load_chat_model(moved)
    cmd = [sys.executable, str(ROOT / "scripts" / "chat.py"), str(moved), "--prompt", "hi", "--temperature", "0"]
    proc = run_here(cmd, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"error: {f}: sha256 does not match") and proc.stderr.count("\n") == 1
    f.unlink()
    with pytest.raises(SproutError, match=r"\.model: tokenizer file missing \(named by .*meta.json\)"):
        load_chat_model(moved)


def test_relative_spec_bundled_then_used_after_a_move(sp, tmp_path, monkeypatch):
    """The old meta form breaks once the working directory changes; the bundled copy does not."""
    src = Path(sp.spec.partition(":")[2])
    (tmp_path / "work" / "tok").mkdir(parents=True)
    shutil.copy(src, tmp_path / "work" / "tok" / "sp.model")
    monkeypatch.chdir(tmp_path / "work")
    spec = "sentencepiece:tok/sp.model"  # relative to the directory the run started in
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=512, d_model=32, n_layers=1, n_heads=2, max_seq_len=32))
    meta = {"model_config": model.config, "tokenizer": spec, "tokenizer_fingerprint": sp.fingerprint(),
            "template_version": TEMPLATE_VERSION, **bundle_tokenizer(spec, tmp_path / "run")}
    save_rotating(tmp_path / "run" / "checkpoints", 1, model, meta=meta)
    shutil.move(tmp_path / "run", tmp_path / "moved")
    monkeypatch.chdir(tmp_path)
    meta = read_meta(tmp_path / "moved")
    assert checkpoint_tokenizer(meta).fingerprint() == sp.fingerprint()
    _, tok, _ = load_chat_model(tmp_path / "moved")
    assert tok.spec == f"sentencepiece:{tmp_path / 'moved' / 'tokenizer' / 'sp.model'}"
    legacy = {k: v for k, v in meta.items() if not k.startswith("tokenizer_") or k == "tokenizer_fingerprint"}
    with pytest.raises(SproutError, match="SentencePiece model not found"):
        checkpoint_tokenizer(legacy)  # the old form alone: the relative spec no longer resolves


def test_bundle_tokenizer_skips_names_and_refuses_a_different_file_in_the_run(sp, tmp_path):
    assert bundle_tokenizer("tiktoken:r50k_base", tmp_path / "run") == {}
    assert bundle_tokenizer(None, tmp_path / "run") == {}
    assert not (tmp_path / "run").exists()
    fields = bundle_tokenizer(sp.spec, tmp_path / "run")
    assert bundle_tokenizer(sp.spec, tmp_path / "run") == fields  # a resume: the same file, kept
    other = tmp_path / "other" / Path(sp.spec.partition(":")[2]).name
    other.parent.mkdir()
    other.write_bytes(b"not the same model")
    with pytest.raises(SproutError, match=r"run/tokenizer/.*\.model: this run folder already holds a different "
                                          r"tokenizer than .*other/"):
        bundle_tokenizer(f"sentencepiece:{other}", tmp_path / "run")
    assert json.dumps(fields)  # plain JSON for meta.json
    gone = f"sentencepiece:{tmp_path / 'gone' / other.name}"  # a relative spec seen from elsewhere
    assert bundle_tokenizer(gone, tmp_path / "run") == fields  # the run's own copy stands in
    with pytest.raises(SproutError, match=r"gone/.*\.model: SentencePiece model not found"):
        bundle_tokenizer(gone, tmp_path / "fresh_run")
