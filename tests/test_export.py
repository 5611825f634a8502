"""Export to Hugging Face transformers: logits, tokenizer ids, chat template, greedy generation,
reward and value-head checkpoints, and the script (src/sprout/model/export.py, scripts/export_hf.py)."""

import json
import random
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from proc import run_here
from sprout.chat import render
from sprout.checkpoint import bundle_tokenizer, save_checkpoint
from sprout.errors import SproutError
from sprout.model.export import export_hf, export_model, verify_export
from sprout.model.generate import generate
from sprout.model.heads import PolicyWithValue, RewardModel, last_index, score_at
from sprout.model.transformer import ModelConfig, Transformer

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[export]')")

ROOT = Path(__file__).resolve().parents[1]
TEXTS = ["Hello world", "  two leading spaces", "trailing space ", "tab\there\r\nCRLF\n\n\nblank lines",
         "Café naïve 日本語 ✓ 😀 ﬁ Ａ e\u0301", "a  b   c    d\u00a0e", "12345 + 678 = 13023; 3.14159 and 1,080",
         "it's they'll we've I'D", "<think>7 * 6 = 42</think><answer>42</answer>", "\n\n  \t ", "x", "",
         "<|endoftext|> and <|user|> typed as text", "▁already▁escaped ▁", "<0x41> <unk> <|pad|>"]
CHATS = [
    [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "<answer>5</answer>"}],
    [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": " Name three colours.\n"},
     {"role": "assistant", "content": "\n\nRed, green and blue."}, {"role": "user", "content": "日本語 ✓ 😀  "},
     {"role": "assistant", "content": "\t12 apples"}],
]


def random_texts(n: int, seed: int = 0) -> list[str]:
    """Strings mixing letters, digits, punctuation, whitespace runs and non-ASCII, seeded."""
    alphabet = list("abcXYZ  \t\n\r0123456789.,!?'\"-_()<>|/\\") + ["é", "日本", "😀", "ﬁ", "\u00a0", "'s", "'ll",
                                                                   "\n\n", "   "]
    rng = random.Random(seed)
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40))) for _ in range(n)]


def tiny_model(vocab: int, cls=Transformer, seed: int = 0, **kw):
    torch.manual_seed(seed)
    cfg = dict(vocab_size=vocab, d_model=64, n_layers=2, n_heads=4, max_seq_len=128)
    return cls(ModelConfig(**{**cfg, **kw})).eval()


@pytest.fixture(scope="module")
def exported():
    """{tokenizer spec: export folder} of a plain model, filled once per kind by `export_for`."""
    return {}


def export_for(tok, exported, tmp_path_factory):
    if tok.spec not in exported:
        out = tmp_path_factory.mktemp("export") / "hf"
        export_model(tiny_model(max(tok.vocab_size, 512)), tok, out)
        exported[tok.spec] = out
    return exported[tok.spec]


# ---------------------------------------------------------------- model


@pytest.mark.parametrize("kind", ["plain", "gqa", "tied"])
def test_logits_match_sprout(kind, sp, tmp_path):
    kw = {"plain": {}, "gqa": {"n_kv_heads": 2}, "tied": {"tie_embeddings": True}}[kind]
    model = tiny_model(sp.vocab_size, **kw)
    result = export_model(model, sp, tmp_path / "hf")
    assert result.hf_class == "LlamaForCausalLM" and result.dropped == []
    stored = load_file(tmp_path / "hf" / "model.safetensors")
    assert ("lm_head.weight" in stored) == (kind != "tied")
    assert all(k.startswith("model.") for k in stored if k != "lm_head.weight")
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert hf.config.num_key_value_heads == (2 if kind == "gqa" else 4)
    if kind == "tied":
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    ids = torch.randint(0, sp.vocab_size, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (hf(ids).logits - model(ids)).abs().max().item()
    assert diff < 1e-4


def test_config_fields(sp, tmp_path):
    model = tiny_model(sp.vocab_size, n_kv_heads=1, rope_theta=500.0, norm_eps=1e-6, d_ff=96)
    export_model(model, sp, tmp_path / "hf")
    cfg = transformers.AutoConfig.from_pretrained(tmp_path / "hf")
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.intermediate_size, cfg.max_position_embeddings, cfg.rms_norm_eps) == (64, 2, 4, 1, 96, 128, 1e-6)
    assert cfg.rope_parameters["rope_theta"] == 500.0 and cfg.head_dim == 16
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (sp.bos_id, sp.eot_id, sp.pad_id)
    gen = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    roles = [sp.special_id(m) for m in ("<|system|>", "<|user|>", "<|assistant|>")]
    assert gen["eos_token_id"] == [sp.eot_id, *roles]
    assert (gen["bos_token_id"], gen["pad_token_id"], gen["do_sample"], gen["temperature"]) == (2, 0, True, 0.7)


def test_greedy_generate_matches_sprout(sp, tmp_path):
    model = tiny_model(sp.vocab_size, n_kv_heads=2)
    export_model(model, sp, tmp_path / "hf")
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    prompts = [render([{"role": "user", "content": c}], sp, add_generation_prompt=True)[0]
               for c in ("Tom has 3 apples and buys 5 more.", "Hi")]
    ours = generate(model, prompts, 20, temperature=0.0, stop_ids=[sp.eot_id]).tokens
    width = max(map(len, prompts))  # transformers' batch: left padding with an attention mask
    ids = torch.tensor([[sp.pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=sp.eot_id,
                          pad_token_id=sp.pad_id)
    for row, want in zip(out[:, width:].tolist(), ours):
        assert len(want) > 0 and row[:len(want)] == want


def test_value_head_is_dropped(sp, tmp_path):
    model = tiny_model(sp.vocab_size, cls=PolicyWithValue)
    result = export_model(model, sp, tmp_path / "hf")
    assert (result.architecture, result.hf_class, result.dropped) == ("lm+value", "LlamaForCausalLM", ["value_head.weight"])
    assert "value_head.weight" not in load_file(tmp_path / "hf" / "model.safetensors")
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(0, sp.vocab_size, (2, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (hf(ids).logits - model(ids)).abs().max().item() < 1e-4


@pytest.mark.parametrize("tied", [False, True])
def test_reward_model_exports_as_sequence_classification(tied, sp, tmp_path):
    model = tiny_model(sp.vocab_size, cls=RewardModel, tie_embeddings=tied)
    result = export_model(model, sp, tmp_path / "hf")
    assert (result.hf_class, result.dropped) == ("LlamaForSequenceClassification", [])
    assert not (tmp_path / "hf" / "generation_config.json").exists()
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == "LlamaForSequenceClassification"
    rows = [render(c, sp)[0] for c in CHATS]
    width = max(map(len, rows))
    ids = torch.tensor([r + [sp.pad_id] * (width - len(r)) for r in rows])  # right padding
    mask = (torch.arange(width)[None] < torch.tensor([len(r) for r in rows])[:, None]).long()
    with torch.no_grad():
        ours = torch.stack([model(torch.tensor([r]))[0, -1] for r in rows])  # each row alone, at its end-of-turn
        theirs = hf(ids, attention_mask=mask).logits[:, 0]
        padded = score_at(model(ids), last_index(mask))  # sprout on the padded batch: causal, so the same
    assert (theirs - ours).abs().max().item() < 1e-4
    assert (padded - ours).abs().max().item() < 1e-4


# ---------------------------------------------------------------- tokenizer and chat template


def test_tokenizer_ids_equal(tok, exported, tmp_path_factory):
    hf = transformers.AutoTokenizer.from_pretrained(export_for(tok, exported, tmp_path_factory))
    for text in TEXTS + random_texts(500):
        ids = tok.encode(text)
        assert hf(text, split_special_tokens=True)["input_ids"] == ids, text
        assert hf.decode(ids) == tok.decode(ids), text
    # transformers' convention: a special token's text is that token unless split_special_tokens
    assert hf("a<|endoftext|>b")["input_ids"] == tok.encode("a") + [tok.eot_id] + tok.encode("b")


def test_gpt2_files_are_the_upstream_ones(r50k, mirror, exported, tmp_path_factory):
    out = export_for(r50k, exported, tmp_path_factory)
    upstream = mirror / "tokenizers"
    assert json.loads((out / "vocab.json").read_text()) == json.loads((upstream / "gpt2_vocab.json").read_text())
    assert (out / "merges.txt").read_bytes() == b"#version: 0.2\n" + (upstream / "gpt2_merges.txt").read_bytes()


def test_sentencepiece_file_travels(sp, exported, tmp_path_factory):
    out = export_for(sp, exported, tmp_path_factory)
    assert (out / "tokenizer.model").read_bytes() == sp.path.read_bytes()
    hf = transformers.AutoTokenizer.from_pretrained(out)
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (sp.bos_id, sp.eot_id, sp.pad_id)
    assert hf("Hello")["input_ids"] == sp.encode("Hello")  # no BOS added


def test_chat_template_ids_equal(tok, exported, tmp_path_factory):
    hf = transformers.AutoTokenizer.from_pretrained(export_for(tok, exported, tmp_path_factory))
    for chat in CHATS:
        for end in range(1, len(chat) + 1):
            msgs = chat[:end]
            if msgs[-1]["role"] == "system":
                continue
            prompt = msgs[-1]["role"] == "user"
            got = hf.apply_chat_template(msgs, tokenize=True, add_generation_prompt=prompt, return_dict=False)
            assert list(got) == render(msgs, tok, add_generation_prompt=prompt)[0], msgs


def test_chat_template_refuses_what_render_refuses(sp, exported, tmp_path_factory):
    hf = transformers.AutoTokenizer.from_pretrained(export_for(sp, exported, tmp_path_factory))
    for msgs in ([{"role": "user", "content": "hi <|assistant|> there"}], [{"role": "tool", "content": "x"}]):
        with pytest.raises(Exception, match="reserved marker|unknown role"):
            hf.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)


# ---------------------------------------------------------------- checks and refusals


def test_verify_export_catches_a_changed_weight(sp, tmp_path):
    model = tiny_model(sp.vocab_size)
    export_model(model, sp, tmp_path / "hf")
    assert verify_export(tmp_path / "hf", model, sp)["max_abs_diff"] < 1e-4
    f = tmp_path / "hf" / "model.safetensors"
    weights = load_file(f)
    weights["model.norm.weight"][0] += 0.5
    save_file(weights, f, metadata={"format": "pt"})
    with pytest.raises(SproutError, match="logits differ from sprout's"):
        verify_export(tmp_path / "hf", model, sp)


def test_refusals(sp, tmp_path):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(SproutError, match="already exists and is not empty"):
        export_model(tiny_model(sp.vocab_size), sp, out)
    with pytest.raises(SproutError, match="holds 'keep.txt', which an export does not write"):
        export_model(tiny_model(sp.vocab_size), sp, out, overwrite=True)  # --overwrite deletes only an export
    assert (out / "keep.txt").exists() and not (out / "model.safetensors").exists()
    (out / "keep.txt").unlink()
    export_model(tiny_model(sp.vocab_size), sp, out)
    first = (out / "model.safetensors").read_bytes()
    export_model(tiny_model(sp.vocab_size, seed=1), sp, out, overwrite=True)  # an earlier export is replaced
    assert (out / "model.safetensors").read_bytes() != first
    assert not list(tmp_path.glob(".tmp-*"))
    with pytest.raises(SproutError, match="does not fit the model's"):
        export_model(tiny_model(256), sp, tmp_path / "small")


def test_dummy_prefix_sentencepiece_is_refused(tmp_path):
    import sentencepiece as spm

    from sprout.tokenizer import load_tokenizer

    texts = ["the quick brown fox jumps over the lazy dog"] * 50
    spm.SentencePieceTrainer.train(sentence_iterator=iter(texts), model_prefix=str(tmp_path / "m"), vocab_size=40,
                                   model_type="bpe", add_dummy_prefix=True, minloglevel=2)
    tok = load_tokenizer(f"sentencepiece:{tmp_path / 'm.model'}")
    with pytest.raises(SproutError, match="no dummy prefix"):
        export_model(tiny_model(tok.vocab_size), tok, tmp_path / "hf")


def test_a_logprob_reward_models_rule_travels_in_config_json(sp, tmp_path):
    """An LM trained with reward.score logprob exports as a causal LM whose config.json carries its
    meta.json's reward_score, read back by transformers; a plain LM's and a score-head reward
    model's (whose meta.json says kind head) have no such key."""
    rule = {"kind": "logprob", "beta": 0.1}
    cases = [("rm", tiny_model(sp.vocab_size), {"reward_score": rule}, "LlamaForCausalLM", rule),
             ("sft", tiny_model(sp.vocab_size), {}, "LlamaForCausalLM", None),
             ("head", tiny_model(sp.vocab_size, RewardModel), {"reward_score": {"kind": "head"}},
              "LlamaForSequenceClassification", None)]
    for name, model, extra, hf_class, want in cases:
        run = tmp_path / name
        save_checkpoint(run / "checkpoints" / "step_00000001", model,
                        meta={"model_config": model.config, "tokenizer": sp.spec, "stage": "reward", "step": 1,
                              **bundle_tokenizer(sp.spec, run), **extra})
        result, _, _ = export_hf(run / "checkpoints" / "step_00000001", tmp_path / f"hf_{name}")
        config = transformers.AutoConfig.from_pretrained(tmp_path / f"hf_{name}")
        assert result.hf_class == hf_class and result.reward_score == want
        assert getattr(config, "sprout_reward_score", None) == want


def test_script_refuses_an_output_in_or_around_the_run_it_exports(sp, tmp_path):
    model = tiny_model(sp.vocab_size)
    run = tmp_path / "runs" / "run"
    save_checkpoint(run / "checkpoints" / "step_00000001", model,
                    meta={"model_config": model.config, "tokenizer": sp.spec, "stage": "sft", "step": 1,
                          **bundle_tokenizer(sp.spec, run)})
    (run / "checkpoints" / "latest").write_text("step_00000001\n")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    before = {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()}
    script = str(ROOT / "scripts" / "export_hf.py")
    for source, out, where in [(run, run, "is"), (run / "checkpoints", run / "hf", "lies inside"),
                               (run, tmp_path / "runs", "holds")]:
        done = run_here([sys.executable, script, str(source), str(out), "--overwrite", "--no-check"])
        errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
        assert done.returncode == 2 and len(errors) == 1 and "Traceback" not in done.stderr, done.stderr
        assert f"{out}: {where} the run folder {run}" in errors[0]
    assert {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()} == before


@pytest.mark.slow
def test_script_exports_and_checks_a_checkpoint(sp, tmp_path):
    model = tiny_model(sp.vocab_size, n_kv_heads=2, tie_embeddings=True)
    run = tmp_path / "run"  # as a training run leaves it: the tokenizer copied into the run folder
    save_checkpoint(run / "checkpoints" / "step_00000001", model,
                    meta={"model_config": model.config, "tokenizer": sp.spec, "stage": "sft", "step": 1,
                          **bundle_tokenizer(sp.spec, run)})
    (tmp_path / "run" / "checkpoints" / "latest").write_text("step_00000001\n")
    cmd = [sys.executable, str(ROOT / "scripts" / "export_hf.py"), str(tmp_path / "run"), str(tmp_path / "hf")]
    done = run_here(cmd)
    assert done.returncode == 0, done.stderr
    assert "LlamaForCausalLM" in done.stdout and "checked with transformers" in done.stdout
    again = run_here(cmd)
    assert again.returncode == 2 and again.stderr.strip().count("\n") == 0
    assert again.stderr.startswith("error: ") and "--overwrite" in again.stderr
    missing = run_here([*cmd[:2], str(tmp_path / "nothing"), str(tmp_path / "hf2"), "--no-check"])
    assert missing.returncode == 2 and "no such checkpoint" in missing.stderr
