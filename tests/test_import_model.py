"""Importing published Llama-family models (src/sprout/model/hf_import.py, scripts/import_model.py):
logits and greedy tokens equal transformers' for tiny random Llama (llama3 rope scaling, GQA, an
explicit head_dim, tied and untied), Qwen2 (q/k/v biases) and Mistral (a long sliding window)
models; the run folder opens like any other (meta, tokenizer copy, chat format); the mirror's
SmolLM2 GGUF imports with equal logits and greedy chat answers (slow); every bad input is one line
and exit status 2."""

import json
import sys
from pathlib import Path

import pytest
import torch

from hf_fixtures import CHATML, LLAMA3_ROPE, MODELS, SHAPE, hf_model, write_tokenizer
from proc import run_group, run_here
from sprout.chat import render
from sprout.chat_formats import SMOLLM2_SYSTEM, format_for
from sprout.checkpoint import checkpoint_tokenizer, read_meta
from sprout.errors import SproutError
from sprout.model.generate import default_stop_ids, generate
from sprout.model.hf_import import model_config, read_source, write_run
from sprout.model.load import load_model

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[import]')")

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[5, 9, 2, 7, 1, 3, 8], [44, 8], [11, 12, 13, 14, 200, 300]]


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """{kind: (transformers model, run folder)}, each imported once from a save_pretrained folder."""
    out = {}
    for kind in MODELS:
        root = tmp_path_factory.mktemp(kind.replace(" ", "_"))
        model = hf_model(kind)
        model.save_pretrained(root / "hf")
        write_tokenizer(root / "hf")
        write_run(read_source(str(root / "hf"), root / "work"), root / "run")
        out[kind] = (model, root / "run")
    return out


# ---------------------------------------------------------------- tiny models against transformers


@pytest.mark.parametrize("kind", list(MODELS))
def test_logits_and_greedy_tokens_equal_transformers(kind, imported):
    hf, run = imported[kind]
    model, meta = load_model(run)
    c = model.config
    assert meta["architecture"] == "lm" and meta["stage"] == "import"
    head_dim = getattr(hf.config, "head_dim", None) or SHAPE["hidden_size"] // SHAPE["num_attention_heads"]
    assert (c.head_dim, c.attention_bias, c.tie_embeddings) == (head_dim, kind == "qwen2",
                                                                hf.config.tie_word_embeddings)
    assert (c.rope_scaling is not None) == kind.startswith("llama")
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, rtol=0, atol=1e-4)
        want = [hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
    got = generate(model, PROMPTS, 12, temperature=0.0).tokens  # one left-padded batch
    assert got == want


def test_run_folder_records_the_source_tokenizer_and_chat_format(imported):
    hf, run = imported["llama"]
    meta = read_meta(run)
    hf_dir = run.parent / "hf"
    assert meta["source"] == {"kind": "folder", "path": str(hf_dir.resolve())}
    assert meta["source_config"] == json.loads((hf_dir / "config.json").read_text())
    assert meta["model_config"]["d_head"] == 24 and meta["model_config"]["rope_scaling"] == LLAMA3_ROPE
    tok_dir = run / "tokenizer" / "hf"
    assert meta["tokenizer_file"] == "tokenizer/hf/tokenizer.json"
    assert set(meta["tokenizer_side_sha256"]) == {"tokenizer_config.json", "chat_format.json", "chat_template.jinja"}
    assert (tok_dir / "chat_template.jinja").read_text() == CHATML
    assert json.loads((tok_dir / "chat_format.json").read_text())["name"] == "chatml"
    tok = checkpoint_tokenizer(meta)
    fmt = format_for(tok)
    assert (fmt.name, fmt.default_system, meta["template_version"]) == ("chatml", SMOLLM2_SYSTEM, fmt.version)
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    ref = transformers.AutoTokenizer.from_pretrained(tok_dir)
    want = ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    assert render(messages, tok, add_generation_prompt=True)[0] == list(want["input_ids"] if hasattr(want, "keys")
                                                                        else want)


def test_no_template_writes_no_chat_format(tmp_path):
    hf_model("llama").save_pretrained(tmp_path / "hf")
    write_tokenizer(tmp_path / "hf", template=None)
    imported = read_source(str(tmp_path / "hf"), tmp_path / "work", max_seq_len=64)
    assert imported.chat_format is None and imported.model.config.max_seq_len == 64
    result = write_run(imported, tmp_path / "run")
    assert not (tmp_path / "run" / "tokenizer" / "hf" / "chat_format.json").exists()
    assert "template_version" not in read_meta(result.checkpoint)
    assert format_for(checkpoint_tokenizer(read_meta(tmp_path / "run"))).name == "sprout"


@pytest.mark.parametrize("change,message", [
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"num_local_experts": 8}, "num_local_experts 8: mixture-of-experts"),
    ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config (quant_method 'gptq')"),
    ({"architectures": ["MistralForCausalLM"], "sliding_window": 64}, "sliding_window 64 is shorter than the context"),
    ({"attention_bias": True}, "attention_bias true is not supported"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling type 'yarn' is not supported"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4}}, "rope_parameters of type dynamic lacks factor"),
])
def test_unsupported_config_fields_are_named(change, message):
    config = {"architectures": ["LlamaForCausalLM"], **SHAPE, **change}
    with pytest.raises(SproutError, match=message.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        model_config(config, "config.json")
    if "sliding_window" in change:
        assert model_config(config, "config.json", max_seq_len=64).max_seq_len == 64  # a window >= the context


# ---------------------------------------------------------------- the script


def run_script(*args, env=None, timeout=300):
    import os

    cmd = [sys.executable, str(ROOT / "scripts" / "import_model.py"), *map(str, args)]
    if env is None:  # else a subprocess: PYTHONPATH and the hub's variables are read at startup and import
        return run_here(cmd)
    return run_group(cmd, timeout=timeout, env={**os.environ, **env})


def test_script_writes_a_run_and_refuses_to_overwrite_it(imported, tmp_path):
    hf_dir = imported["qwen2"][1].parent / "hf"
    done = run_script(hf_dir, "--out", tmp_path / "run")
    assert done.returncode == 0, done.stderr
    assert "imported Qwen2ForCausalLM" in done.stdout and "chat format: chatml" in done.stdout
    assert "checkpoints/step_00000000/{model.safetensors, train_state.pt, meta.json}" in done.stdout
    again = run_script(hf_dir, "--out", tmp_path / "run")
    assert again.returncode == 2 and again.stderr.count("\n") == 1 and "--overwrite" in again.stderr
    assert run_script(hf_dir, "--out", tmp_path / "run", "--overwrite").returncode == 0


def test_script_names_the_tokenizer_folder_and_reads_the_mirror_variable(imported, tmp_path, monkeypatch):
    hf_dir = imported["qwen2"][1].parent / "hf"
    monkeypatch.setenv("SPROUT_MIRROR", str(hf_dir.parent))
    done = run_script("${SPROUT_MIRROR}/hf", "--out", tmp_path / "run", "--tokenizer-name", "base")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "run" / "tokenizer" / "base" / "tokenizer.json").is_file()
    assert read_meta(tmp_path / "run")["tokenizer"] == f"hf:{tmp_path / 'run' / 'tokenizer' / 'base'}"


def one_line_error(done, *needles):
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stderr.startswith("error: ") and done.stderr.count("\n") == 1, done.stderr
    for needle in needles:
        assert needle in done.stderr, done.stderr


def hf_copy(imported, tmp_path) -> Path:
    import shutil

    return Path(shutil.copytree(imported["llama"][1].parent / "hf", tmp_path / "hf"))


def test_bad_folders_are_one_line_errors(imported, tmp_path):
    folder = hf_copy(imported, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["GPTNeoXForCausalLM"]}))
    one_line_error(run_script(folder, "--out", tmp_path / "a"), "config.json", "architectures",
                   "GPTNeoXForCausalLM")
    (folder / "config.json").write_text(json.dumps({**config, "rope_parameters": {"rope_type": "yarn", "factor": 2.0}}))
    one_line_error(run_script(folder, "--out", tmp_path / "b"), "rope_scaling type 'yarn' is not supported")
    (folder / "config.json").write_text(json.dumps(config))
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    one_line_error(run_script(folder, "--out", tmp_path / "c"), str(weights), "truncated")
    weights.write_bytes(data)
    (folder / "tokenizer.json").unlink()
    one_line_error(run_script(folder, "--out", tmp_path / "d"), str(folder), "no tokenizer.json")
    assert not any((tmp_path / name).exists() for name in "abcd")


def test_hub_id_from_the_cache_offline(imported, tmp_path):
    """A hub id read offline from the Hugging Face cache's layout; meta records the id and the commit."""
    import shutil

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hf_home" / "hub" / "models--someone--tiny-qwen"
    shutil.copytree(imported["qwen2"][1].parent / "hf", repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    done = run_script("someone/tiny-qwen", "--out", tmp_path / "run",
                      env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home")})
    assert done.returncode == 0, done.stderr
    assert f"from hub someone/tiny-qwen at revision {commit}" in done.stdout
    meta = read_meta(tmp_path / "run")
    assert meta["source"] == {"kind": "hub", "id": "someone/tiny-qwen", "revision": commit}
    assert meta["tokenizer_file"] == "tokenizer/tiny-qwen/tokenizer.json"


def test_gguf_without_the_gguf_package_and_hub_id_offline(tmp_path):
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "gguf.py").write_text("raise ImportError('no gguf here')\n")
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"GGUF")
    import os

    path = os.pathsep.join([str(shim), os.environ.get("PYTHONPATH", "")])
    one_line_error(run_script(fake, "--out", tmp_path / "a", env={"PYTHONPATH": path}), str(fake),
                   "needs the 'import' extra: pip install 'sprout[import]'")
    (tmp_path / "hf_home").mkdir()
    one_line_error(run_script("someone/tiny-llama", "--out", tmp_path / "b",
                              env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home")}),
                   "someone/tiny-llama", "not in the Hugging Face cache")


# ---------------------------------------------------------------- the mirror's SmolLM2 (GGUF)

SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"  # its MANIFEST entry
TEXTS = ["The capital of France is", "def fibonacci(n):\n    ", "Tom has 3 apples and buys 5 more.",
         "日本語 and emoji 😀: a mixed prompt"]
CHATS = ["What is 12 + 7?", "Tom has 3 apples and buys 5 more. How many apples does he have?",
         "Name three colours."]


@pytest.mark.slow
def test_smollm2_gguf_run_folder(smollm2):
    hf, run = smollm2
    meta = read_meta(run)
    assert meta["source"]["kind"] == "gguf" and meta["source"]["sha256"] == SMOLLM2_SHA256
    assert meta["source_config"]["architectures"] == ["LlamaForCausalLM"]
    fmt = json.loads((run / "tokenizer" / "SmolLM2-135M-Instruct.Q4_1" / "chat_format.json").read_text())
    assert (fmt["name"], fmt["default_system"]) == ("chatml", SMOLLM2_SYSTEM)
    model, _ = load_model(run)
    assert model.num_params() == 134_515_008 == sum(p.numel() for p in hf.parameters())


@pytest.mark.slow
def test_smollm2_gguf_logits_equal_transformers(smollm2):
    hf, run = smollm2
    model, meta = load_model(run)
    tok = checkpoint_tokenizer(meta)
    with torch.no_grad():
        for text in TEXTS:
            ids = torch.tensor([tok.encode(text)])
            torch.testing.assert_close(model(ids), hf(ids).logits, rtol=0, atol=1e-4)


@pytest.mark.slow
def test_smollm2_gguf_greedy_chat_answers_equal_transformers(smollm2):
    hf, run = smollm2
    model, meta = load_model(run)
    tok = checkpoint_tokenizer(meta)
    end = tok.special_id("<|im_end|>")
    prompts = [render([{"role": "user", "content": q}], tok, add_generation_prompt=True)[0] for q in CHATS]
    assert all(p[:3] == [tok.special_id("<|im_start|>"), *tok.encode("system\n")][:3] for p in prompts)
    got = generate(model, prompts, 32, temperature=0.0, stop_ids={end}).tokens
    with torch.no_grad():
        want = [hf.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False, eos_token_id=end,
                            pad_token_id=end)[0, len(p):].tolist() for p in prompts]
    assert got == want
    assert end in default_stop_ids(tok)
