"""The SFT stage and the chat session: metric math, masked and segment-aware loss, learning,
exact resume, refused inputs, single-shot chat that stops at end-of-turn, 1 vs 2 processes (slow)."""

import json
import math
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from proc import free_port, run_group, run_here
from test_train import sections

from data_loader.sft_batches import SFTLoader
from sprout.chat import TEMPLATE_VERSION, ChatError, render
from sprout.model.chat_session import ChatSession, load_chat_model
from sprout.checkpoint import read_meta, save_checkpoint
from sprout.errors import SproutError
from sprout.losses.tokens import masked_correct_sum, masked_entropy_sum
from sprout.model.load import load_model
from sprout.model.transformer import ModelConfig, Transformer
from sprout.prep.sft_data import SFTDataConfig, prepare
from sprout.config import from_dict
from sprout.engine.metrics import read_metrics
from sprout.stages.sft import SFTConfig, run_sft, sft_batch_loss

ROOT = Path(__file__).resolve().parents[1]
WORDS = ["apple", "river", "stone", "cloud", "green", "tiger", "music", "bread", "light", "horse", "paper", "ocean"]
ROW = 64  # row length of the tiny SFT file; the tiny base model has max_seq_len 64


@pytest.fixture(scope="module")
def sft_file(sp, tmp_path_factory):
    """A learnable task in Alpaca's format, prepared by the real prep: 'Say A then B.' -> 'A B'."""
    root = tmp_path_factory.mktemp("sft")
    rows = [{"instruction": f"Say {a} then {b}.", "input": "", "output": f"{a} {b}"}
            for a in WORDS for b in WORDS if a != b]
    (root / "alpaca.json").write_text(json.dumps(rows))
    cfg = SFTDataConfig(tokenizer=sp.spec, out=str(root / "sft.h5"), seq_len=ROW, val_fraction=0.2,
                        sources=[{"name": "say", "format": "alpaca", "path": str(root / "alpaca.json")}])
    prepare(cfg, sp, log=lambda *a: None)
    return root / "sft.h5"


def write_base(path: Path, sp, **meta_and_model) -> Path:
    """A tiny randomly initialised 'base' checkpoint, as pretraining would write it."""
    model_kw = {k: meta_and_model.pop(k) for k in ("vocab_size", "max_seq_len") if k in meta_and_model}
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**{"vocab_size": 512, "d_model": 64, "n_layers": 2, "n_heads": 4,
                                       "max_seq_len": ROW, **model_kw}))
    meta = {"model_config": model.config, "tokenizer": sp.spec, "stage": "pretrain", "step": 100, **meta_and_model}
    return save_checkpoint(path, model, meta=meta)


@pytest.fixture(scope="module")
def base(sp, tmp_path_factory):
    return write_base(tmp_path_factory.mktemp("base") / "ckpt", sp)


def tiny_cfg(data: Path, init: Path, out: Path, **overrides) -> SFTConfig:
    defaults = {"global_tokens": 8 * ROW, "micro_tokens": 4 * ROW, "max_steps": 16, "warmup_steps": 2,
                "lr": 3e-3, "weight_decay": 0.0, "log_every": 1, "eval_every": 8, "ckpt_every": 8, "progress": False}
    return from_dict(SFTConfig, {"init": str(init), "data": {"path": str(data)},
                                 **sections(SFTConfig, defaults, overrides), "out": str(out)})


@pytest.fixture(scope="module")
def run_a(sft_file, base, tmp_path_factory):
    out = tmp_path_factory.mktemp("run_a")
    return out, run_sft(tiny_cfg(sft_file, base, out))


def train_losses(out: Path) -> dict[int, tuple]:
    return {r["step"]: (r["loss"], r["accuracy"], r["entropy"]) for r in read_metrics(out / "metrics.jsonl")
            if "loss" in r}


# ---- metric math, hand-computed -----------------------------------------------------------------
def test_masked_accuracy_and_entropy_hand_computed():
    # vocab 2: logits (0, ln 3) -> p = (1/4, 3/4), argmax 1; logits (0, 0) -> p = (1/2, 1/2), argmax 0 (tie)
    logits = torch.tensor([[[0.0, math.log(3)], [0.0, 0.0], [0.0, math.log(3)]]])
    targets = torch.tensor([[1, 1, 0]])
    assert masked_correct_sum(logits, targets, torch.tensor([[1, 1, 1]])).item() == 1
    assert masked_correct_sum(logits, targets, torch.tensor([[True, False, False]])).item() == 1
    assert masked_correct_sum(logits, targets, torch.tensor([[0, 1, 1]])).item() == 0
    h_skew = 0.25 * math.log(4) + 0.75 * math.log(4 / 3)  # 0.5623 nats
    assert masked_entropy_sum(logits, torch.tensor([[1, 1, 0]])).item() == pytest.approx(h_skew + math.log(2), rel=1e-6)
    assert masked_entropy_sum(logits, torch.tensor([[0, 0, 1]])).item() == pytest.approx(h_skew, rel=1e-6)
    nan_row = torch.tensor([[[0.0, 0.0], [float("nan"), 1.0]]])  # unmasked garbage cannot leak in
    assert masked_entropy_sum(nan_row, torch.tensor([[1, 0]])).item() == pytest.approx(math.log(2), rel=1e-6)


# ---- the loss of one micro-batch -------------------------------------------------------------------
def first_batch(sft_file, rows=4):
    return SFTLoader(sft_file, rows, shuffle=False).next_batch()


def test_masked_loss_ignores_untrained_targets(sft_file):
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=512, d_model=32, n_layers=1, n_heads=2, max_seq_len=ROW))
    batch = first_batch(sft_file)
    mask = batch["loss_mask"]
    assert 0 < mask.sum() < mask.numel()
    nll, n, m = sft_batch_loss(model, batch)
    assert n.item() == mask.sum().item()
    untrained = {**batch, "targets": torch.where(mask, batch["targets"], (batch["targets"] + 7) % 512)}
    nll2, n2, m2 = sft_batch_loss(model, untrained)
    assert nll2.item() == nll.item() and n2.item() == n.item()
    assert m2["accuracy"][0].item() == m["accuracy"][0].item() and m2["entropy"][0].item() == m["entropy"][0].item()
    assert m["accuracy"][1] is n and m["entropy"][1] is n  # both per trained target
    r, t = mask.nonzero()[0].tolist()  # change one trained target: the loss must move
    trained = {**batch, "targets": batch["targets"].clone()}
    trained["targets"][r, t] = (trained["targets"][r, t] + 7) % 512
    assert sft_batch_loss(model, trained)[0].item() != pytest.approx(nll.item(), rel=1e-6)


def test_packed_row_loss_is_the_sum_of_its_conversations_alone(sft_file):
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=512, d_model=32, n_layers=2, n_heads=2, max_seq_len=ROW))
    batch = first_batch(sft_file, rows=1)
    seg = batch["segment_ids"][0]
    assert seg.max() >= 2, "the fixture should pack several conversations in a row"
    nll, n, _ = sft_batch_loss(model, batch)
    total, count = 0.0, 0
    for s in range(1, int(seg.max()) + 1):
        idx = (seg == s).nonzero()[:, 0]
        alone = {k: v[:, idx] for k, v in batch.items()}
        alone["segment_ids"] = torch.ones_like(alone["segment_ids"])
        part, k, _ = sft_batch_loss(model, alone)
        total, count = total + part.item(), count + k.item()
    assert count == n.item()
    assert total == pytest.approx(nll.item(), rel=1e-5)


# ---- the stage end to end (in-process, tiny) ---------------------------------------------------------
def test_sft_lowers_val_masked_loss_and_records_provenance(run_a, sp, base):
    out, result = run_a
    first, last = result["first_eval"], result["last_eval"]
    assert first["step"] == 0 and last["step"] == 16
    assert last["val_loss"] < first["val_loss"] - 1.0  # from ~ln 512 = 6.2
    assert last["val_accuracy"] > first["val_accuracy"] + 0.2
    records = read_metrics(out / "metrics.jsonl")
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == list(range(1, 17))
    assert {"loss", "accuracy", "entropy", "targets", "lr", "tokens"} <= set(train[0])
    assert 0 < train[0]["targets"] < 8 * (ROW - 1)  # trained tokens only, not every position
    assert train[-1]["entropy"] < train[0]["entropy"]
    assert [r["step"] for r in records if "val_loss" in r] == [0, 8, 16]
    meta = read_meta(out / "checkpoints")
    assert meta["stage"] == "sft" and meta["step"] == 16
    assert meta["template_version"] == TEMPLATE_VERSION
    assert meta["tokenizer"] == sp.spec and meta["tokenizer_fingerprint"] == sp.fingerprint()
    assert meta["init"]["path"] == str(base) and meta["init"]["step"] == 100
    model, _ = load_model(out)
    assert model.config.d_model == 64


def test_resume_matches_an_uninterrupted_run_bit_for_bit(run_a, sft_file, base, tmp_path):
    out_a, _ = run_a
    out_b = tmp_path / "run_b"
    shutil.copytree(out_a / "checkpoints" / "step_00000008", out_b / "checkpoints" / "step_00000008")
    (out_b / "checkpoints" / "latest").write_text("step_00000008\n")
    run_sft(tiny_cfg(sft_file, base, out_b), resume="latest")
    a, b = train_losses(out_a), train_losses(out_b)
    assert sorted(b) == list(range(9, 17))
    assert [b[s] for s in b] == [a[s] for s in b]  # exact float equality


# ---- refused inputs: one line naming the files, nothing written -----------------------------------------
@pytest.mark.parametrize("case, pattern", [
    ("fingerprint", r"sft.h5: SFT data was tokenized with sentencepiece:.* but the base checkpoint .*meta.json"),
    ("spec", (r"sft.h5: SFT data was tokenized with .* but the base checkpoint .*meta.json was trained with "
              r"sentencepiece:/nonexistent/other.model")),
    ("vocab", r"sft.h5: data vocab is 512 but the base checkpoint .*meta.json has vocab_size 1024"),
    ("context", r"sft.h5: rows of 64 tokens \(inputs of 63\) exceed max_seq_len 32 .*--seq-len 32"),
])
def test_mismatched_base_is_refused(case, pattern, sp, sft_file, tmp_path):
    kw = {"fingerprint": {"tokenizer_fingerprint": "f" * 64},
          "spec": {"tokenizer": "sentencepiece:/nonexistent/other.model"},
          "vocab": {"vocab_size": 1024}, "context": {"max_seq_len": 32}}[case]
    bad = write_base(tmp_path / "bad", sp, **kw)
    with pytest.raises(SproutError, match=pattern):
        run_sft(tiny_cfg(sft_file, bad, tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_cli_refuses_with_one_line(sp, sft_file, tmp_path):
    bad = write_base(tmp_path / "bad", sp, tokenizer_fingerprint="f" * 64)
    cmd = [sys.executable, str(ROOT / "scripts" / "train_sft.py"), "--init", str(bad), "--data", str(sft_file),
           "--out", str(tmp_path / "out"), "--train.max_steps", "1"]
    proc = run_here(cmd, cwd=ROOT)
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"error: {sft_file}: SFT data was tokenized") and proc.stderr.count("\n") == 1


# ---- chat: a tiny model taught one answer, greedy ----------------------------------------------------------
@pytest.fixture(scope="module")
def taught(sp, tmp_path_factory):
    """A tiny model overfit (with the SFT loss) to answer 'hello there' with 'general kenobi'."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=512, d_model=32, n_layers=1, n_heads=2, max_seq_len=ROW))
    ids, mask = render([{"role": "user", "content": "hello there"},
                        {"role": "assistant", "content": "general kenobi"}], sp)
    x = torch.tensor([ids])
    batch = {"input_ids": x[:, :-1], "targets": x[:, 1:], "loss_mask": torch.tensor([mask])[:, 1:].bool(),
             "segment_ids": torch.ones_like(x[:, :-1]), "position_ids": torch.arange(len(ids) - 1)[None]}
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(60):
        nll, n, _ = sft_batch_loss(model, batch)
        (nll / n).backward()
        opt.step()
        opt.zero_grad()
    path = save_checkpoint(tmp_path_factory.mktemp("chat") / "ckpt", model,
                           meta={"model_config": model.config, "tokenizer": sp.spec, "stage": "sft", "step": 60,
                                 "tokenizer_fingerprint": sp.fingerprint(), "template_version": TEMPLATE_VERSION})
    return path


def test_chat_single_shot_stops_at_end_of_turn(taught, sp):
    model, tok, _ = load_chat_model(taught)
    session = ChatSession(model, tok, temperature=0, max_new_tokens=40)
    reply = session.send("hello there")
    assert reply.text == "general kenobi"
    assert reply.finished and reply.tokens[-1] == sp.eot_id
    assert len(reply.tokens) == len(sp.encode("general kenobi")) + 1  # stopped at its own eot, not at 40
    assert session.messages == [{"role": "user", "content": "hello there"},
                                {"role": "assistant", "content": "general kenobi"}]
    with pytest.raises(ChatError, match="reserved marker <\\|user\\|>"):
        session.send("hi <|user|> there")
    assert len(session.messages) == 2  # a refused message leaves the history as it was


def test_chat_history_drops_oldest_exchanges_to_fit(taught):
    model, tok, _ = load_chat_model(taught)
    session = ChatSession(model, tok, system="Be brief.", temperature=0)
    session.messages += [{"role": "user", "content": f"question {i} about {w}"} if j == 0 else
                         {"role": "assistant", "content": f"answer {i} about {w}"}
                         for i, w in enumerate(WORDS) for j in (0, 1)]
    messages = session.messages + [{"role": "user", "content": "hello there"}]
    prompt = session._prompt(messages)
    assert len(prompt) < model.config.max_seq_len and len(render(messages, tok, True)[0]) >= model.config.max_seq_len
    full = render(messages, tok, True)[0]
    assert prompt[:4] == full[:4] and prompt[-8:] == full[-8:]  # system kept, newest kept, middle dropped
    with pytest.raises(ChatError, match="message too long"):
        session.send("word " * 200)


def test_chat_cli_prompt(taught):
    cmd = [sys.executable, str(ROOT / "scripts" / "chat.py"), str(taught), "--prompt", "hello there",
           "--temperature", "0"]
    proc = run_here(cmd, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout == "general kenobi\n"


# ---- multi-process -------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_two_gloo_processes_match_one(run_a, sft_file, base, tmp_path):
    out_a, _ = run_a  # 1 process × 2 micro-batches of 4 rows
    out = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "configs" / "accelerate" / "cpu_ddp.yaml"), "--main_process_port", str(free_port()),
           str(ROOT / "scripts" / "train_sft.py"), "--init", str(base), "--data", str(sft_file), "--out", str(out),
           "--batch.global_tokens", str(8 * ROW), "--batch.micro_tokens", str(4 * ROW),
           "--train.max_steps", "16", "--optim.warmup_steps", "2", "--optim.lr", "3e-3", "--optim.weight_decay", "0",
           "--train.log_every", "1", "--train.eval_every", "8", "--train.ckpt_every", "8", "--train.progress", "false"]
    proc = run_group(cmd, timeout=300, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 process(es) × 1 micro-steps" in proc.stdout
    a, b = train_losses(out_a), train_losses(out)
    assert sorted(a) == sorted(b)
    diff = max(abs(a[s][0] - b[s][0]) for s in a)
    print(f"1 vs 2 processes: max |loss diff| over {len(a)} steps = {diff:.3g}")
    assert diff < 1e-5
    va = [r["val_loss"] for r in read_metrics(out_a / "metrics.jsonl") if "val_loss" in r]
    vb = [r["val_loss"] for r in read_metrics(out / "metrics.jsonl") if "val_loss" in r]
    assert va == pytest.approx(vb, abs=1e-5)


def test_eval_on_a_rank_without_val_rows_still_runs_its_forward(sft_file):
    """Under FSDP every forward is a collective: a rank whose share of the val rows is empty
    (more ranks than rows) must run as many forwards as the others, counting nothing."""
    import contextlib
    from types import SimpleNamespace

    from sprout.formats.packed_sft import val_path
    from sprout.stages.sft import SFTStage

    n_rows = SFTLoader(val_path(sft_file), 1).num_rows
    empty = SFTLoader(val_path(sft_file), 2, rank=n_rows, world_size=n_rows + 1, shuffle=False)
    acc = SimpleNamespace(device=torch.device("cpu"), autocast=contextlib.nullcontext, num_processes=1)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=512, d_model=64, n_layers=2, n_heads=4, max_seq_len=ROW))
    calls = []
    model.register_forward_hook(lambda *_: calls.append(1))
    with pytest.raises(SproutError, match="no trained tokens"):  # this rank alone counted nothing
        SFTStage(acc, empty, empty, 1).evaluate(model)
    assert len(calls) == 1  # ceil(ceil(n_rows / world) / batch) = 1 forward, as on the other ranks
