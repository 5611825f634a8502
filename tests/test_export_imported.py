"""Exporting imported models back to transformers (src/sprout/model/export.py and export_tokenizer.py):
tiny random Llama (llama3 rope scaling, head_dim), Qwen2 (q/k/v biases) and Mistral models imported
through `read_source`/`write_run` export with equal logits, the source's tokenizer files byte for
byte, its own chat template and equal greedy chat answers; reward and value-head models built from
an import as the reward and PPO stages build them; the round trip back through the importer; the
script; and the mirror's SmolLM2 GGUF (slow)."""

import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from proc import run_group
from sprout.chat import render
from sprout.chat_formats import read_chat_template
from sprout.tokenizer import CHAT_TEMPLATE_FILE
from sprout.checkpoint import read_meta
from sprout.errors import SproutError
from sprout.model.export import export_hf, export_model, verify_export
from sprout.formats.checkpoint_meta import reward_score_of
from sprout.model.hf_import import read_source, summary, write_run
from sprout.model.load import init_from_lm
from sprout.stages.ppo import load_reward_model
from sprout.tokenizer import HF_FILE, HF_SIDE_FILES
from test_export import CHATS
from hf_fixtures import CHATML, MODELS, hf_model, write_tokenizer

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[export]')")

ROOT = Path(__file__).resolve().parents[1]
SOURCE_FILES = (HF_FILE, *HF_SIDE_FILES, CHAT_TEMPLATE_FILE)
HF_CLASS = {"llama": "LlamaForCausalLM", "llama tied": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "mistral": "LlamaForCausalLM"}


def qwen2_style(folder: Path) -> None:
    """Give the tokenizer.json in `folder` Qwen2's normalizer and pre-tokenizer: for model type
    qwen2, transformers builds `Qwen2Tokenizer`, which runs those on the file's vocab and merges
    whatever the file says (a published Qwen2 tokenizer.json has them already)."""
    from tokenizers import Regex, Tokenizer, normalizers, pre_tokenizers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tk = Tokenizer.from_file(str(folder / HF_FILE))
    tk.normalizer = normalizers.NFC()
    tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
                                                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.save(str(folder / HF_FILE))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{kind: (source folder, run folder, export folder, export_hf's result, model, tokenizer)},
    each a tiny random transformers model saved, imported and exported once."""
    out = {}
    for kind in MODELS:
        root = tmp_path_factory.mktemp(kind.replace(" ", "_"))
        hf_model(kind).save_pretrained(root / "hf")
        write_tokenizer(root / "hf")
        if kind == "qwen2":
            qwen2_style(root / "hf")
        write_run(read_source(str(root / "hf"), root / "work"), root / "run")
        result, model, tok = export_hf(root / "run", root / "export")
        out[kind] = (root / "hf", root / "run", root / "export", result, model, tok)
    return out


def end_of_turn_rows(tok) -> list[list[int]]:
    """The sample chats rendered as a preference side is: ending with the end-of-turn token."""
    rows = []
    for chat in CHATS:
        ids, mask = render(chat, tok)
        rows.append(ids[:len(mask) - mask[::-1].index(1)])
    return rows


# ---------------------------------------------------------------- language models


@pytest.mark.parametrize("kind", list(MODELS))
def test_verify_export_passes_with_equal_greedy_answers(kind, runs):
    _, _, out, result, model, tok = runs[kind]
    assert (result.architecture, result.hf_class, result.dropped) == ("lm", HF_CLASS[kind], [])
    check = verify_export(out, model, tok)
    assert check["max_abs_diff"] <= 1e-4
    assert check["answers"] == 2 and check["answer_tokens"] > 2
    assert check["texts"] == 14  # the sample texts and chatml's two special pieces typed as text


@pytest.mark.parametrize("kind", list(MODELS))
def test_auto_class_config_and_weights(kind, runs):
    source, _, out, _, model, _ = runs[kind]
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == HF_CLASS[kind]
    c, src = hf.config, json.loads((source / "config.json").read_text())
    assert (c.head_dim, c.tie_word_embeddings) == (model.config.head_dim, src.get("tie_word_embeddings", False))
    stored = load_file(out / "model.safetensors")
    biases = sorted(n.split(".")[-2] for n in stored if n.endswith(".bias") and ".layers.0." in n)
    assert biases == (["k_proj", "q_proj", "v_proj"] if kind == "qwen2" else [])
    if kind.startswith("llama"):
        assert c.rope_parameters["rope_type"] == "llama3" and c.rope_parameters["factor"] == 4.0
    ids = torch.randint(0, c.vocab_size, (2, 50), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids), rtol=0, atol=1e-4)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_tokenizer_files_and_chat_template_are_the_sources(kind, runs):
    source, run, out, result, _, tok = runs[kind]
    assert result.files[3:] == [HF_FILE, "tokenizer_config.json", CHAT_TEMPLATE_FILE]
    for name in SOURCE_FILES:
        if (source / name).is_file():
            assert (out / name).read_bytes() == (source / name).read_bytes(), name
    assert not (out / "chat_format.json").exists()  # sprout's own record of the format stays in the run
    assert read_chat_template(out)[0] == CHATML
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == CHATML
    assert transformers.AutoTokenizer.from_pretrained(out).chat_template == CHATML
    im_start, im_end = tok.special_id("<|im_start|>"), tok.special_id("<|im_end|>")
    gen = json.loads((out / "generation_config.json").read_text())
    assert (gen["eos_token_id"], gen["bos_token_id"], gen["pad_token_id"]) == (im_end, im_start, im_end)
    config = json.loads((out / "config.json").read_text())
    assert (config["eos_token_id"], config["bos_token_id"], config["pad_token_id"]) == (im_end, im_start, im_end)


def test_verify_export_catches_a_changed_chat_template(runs, tmp_path):
    _, _, out, _, model, tok = runs["qwen2"]
    copy = Path(shutil.copytree(out, tmp_path / "export"))
    (copy / CHAT_TEMPLATE_FILE).write_text(CHATML.replace(" + '\\n'}}{% endfor %}", "}}{% endfor %}"))
    with pytest.raises(SproutError, match="chat template ids differ"):
        verify_export(copy, model, tok)


def test_export_imports_back(runs, tmp_path):
    """The export is itself an importable source: the same model, tokenizer and chat format."""
    _, _, out, _, model, tok = runs["qwen2"]
    again = read_source(str(out), tmp_path / "work")
    assert again.model.config == model.config and again.chat_format.name == "chatml"
    assert again.tokenizer.fingerprint() == tok.fingerprint()
    ids = torch.randint(0, model.config.vocab_size, (1, 30), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(again.model(ids), model(ids))


def test_a_logprob_reward_models_rule_imports_back(runs, tmp_path):
    """A log-probability reward model exported and imported back is again one: meta.json's
    reward_score is config.json's sprout_reward_score, and PPO loads the import as its reward
    model, with the same rule; the summary says so. A bad rule is refused, naming the config.json."""
    _, run, _, _, model, tok = runs["qwen2"]
    rule = {"kind": "logprob", "beta": 0.25}
    export_model(model, tok, tmp_path / "hf", reward_score=rule)
    imported = read_source(str(tmp_path / "hf"), tmp_path / "work")
    result = write_run(imported, tmp_path / "rm")
    meta = read_meta(result.checkpoint)
    assert meta["reward_score"] == rule and reward_score_of(meta) == rule
    assert isinstance(meta["reward_score"]["beta"], float)
    assert "a reward model scoring 0.25 × a response's summed log-probability" in summary(result)
    _, _, kind = load_reward_model(str(tmp_path / "rm"), read_meta(run), 64)
    assert kind == rule
    plain = read_meta(run)  # the plain import has no rule, and PPO refuses it as a reward model
    assert "reward_score" not in plain and reward_score_of(plain) is None
    with pytest.raises(SproutError, match="must be a reward model checkpoint"):
        load_reward_model(str(run), plain, 64)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    for i, bad in enumerate(({"kind": "logprob", "beta": 0}, {"kind": "logprob", "beta": True}, {"kind": "head"},
                             "logprob", None)):
        (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "sprout_reward_score": bad}))
        with pytest.raises(SproutError, match=rf"config\.json: sprout_reward_score {re.escape(json.dumps(bad))} is "
                                              "not a log-probability reward model's rule"):
            read_source(str(tmp_path / "hf"), tmp_path / f"work_bad{i}")


# ---------------------------------------------------------------- reward and value heads on an import


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_reward_model_of_an_import_exports_as_sequence_classification(kind, runs, tmp_path):
    _, run, _, _, _, tok = runs[kind]
    model, _ = init_from_lm(run, "reward", seed=0)  # as the reward stage builds it
    model.eval()
    result = export_model(model, tok, tmp_path / "hf")
    want = HF_CLASS[kind].replace("CausalLM", "SequenceClassification")
    assert (result.architecture, result.hf_class) == ("reward", want)
    assert verify_export(tmp_path / "hf", model, tok)["answers"] == 0
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == want
    assert hf.config.pad_token_id is None  # <|im_end|> pads and ends a turn: one row per call
    with torch.no_grad():
        for row in end_of_turn_rows(tok):
            assert row[-1] == tok.special_id("<|im_end|>")
            ids = torch.tensor([row])
            assert abs(hf(ids).logits[0, 0].item() - model(ids)[0, -1].item()) < 1e-4


def test_value_head_of_an_import_is_dropped(runs, tmp_path):
    _, run, _, _, _, tok = runs["qwen2"]
    model, _ = init_from_lm(run, "lm+value", seed=0)  # as the PPO stage builds its policy
    model.eval()
    result = export_model(model, tok, tmp_path / "hf")
    assert (result.hf_class, result.dropped) == ("Qwen2ForCausalLM", ["value_head.weight"])
    assert verify_export(tmp_path / "hf", model, tok)["answers"] == 2


# ---------------------------------------------------------------- the script and the mirror's SmolLM2


@pytest.mark.slow
def test_script_exports_and_checks_an_imported_run(runs, tmp_path):
    run = runs["qwen2"][1]
    done = run_group([sys.executable, str(ROOT / "scripts" / "export_hf.py"), str(run), str(tmp_path / "hf")],
                     timeout=300)
    assert done.returncode == 0, done.stderr
    assert "Qwen2ForCausalLM from a sprout 'lm' checkpoint" in done.stdout
    assert "checked with transformers" in done.stdout and "greedy chat answers equal on 2 conversations" in done.stdout


@pytest.mark.slow
def test_smollm2_gguf_exports_with_equal_greedy_answers(smollm2, tmp_path):
    _, run = smollm2
    result, model, tok = export_hf(run, tmp_path / "hf")
    assert result.hf_class == "LlamaForCausalLM"
    check = verify_export(result.out, model, tok)
    assert check["max_abs_diff"] <= 1e-4 and check["answers"] == 2 and check["answer_tokens"] > 2
    tok_dir = run / Path(read_meta(run)["tokenizer_file"]).parent
    for name in SOURCE_FILES:
        if (tok_dir / name).is_file():
            assert (result.out / name).read_bytes() == (tok_dir / name).read_bytes(), name
    hf = transformers.AutoModelForCausalLM.from_pretrained(result.out)
    assert type(hf).__name__ == "LlamaForCausalLM" and hf.config.eos_token_id == tok.special_id("<|im_end|>")
