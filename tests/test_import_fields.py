"""scripts/import_model.py takes a Hugging Face folder as transformers 5.24 takes it: every
config.json field that changes the maths (rope type and scaling under each spelling, rope_scaling
beside rope_parameters, tie_word_embeddings against a stored lm_head.weight, head_dim, biases,
sliding windows, max_position_embeddings, model_type) either imports with logits equal to
`AutoModelForCausalLM.from_pretrained`'s (float32, 1e-4) or is refused in one `error:` line
naming the field, the --out folder left as it was. Each folder is written by transformers itself
(its config class + save_pretrained) and then edited as the case needs; the missing-field
defaults sprout uses are transformers' own (`hf_config.DEFAULTS`)."""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from proc import one_error, run_here
from test_bad_inputs_train import tree

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[import]')")

ROOT = Path(__file__).resolve().parents[1]
SHAPE = dict(vocab_size=384, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5)
LLAMA3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32, "rope_theta": 10000.0}
CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
           "mistral": ("MistralConfig", "MistralForCausalLM")}
BASES = {  # name: (model type, config fields beside SHAPE)
    "llama": ("llama", dict(head_dim=24, rope_parameters=LLAMA3)),
    "llama16": ("llama", dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),  # head_dim 64 / 4
    "llama_biases": ("llama", dict(attention_bias=True, mlp_bias=True)),
    "qwen2": ("qwen2", dict(head_dim=24, rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "mistral": ("mistral", dict(sliding_window=None, head_dim=16)),
}


def save_base(root: Path, name: str) -> Path:
    """A random tiny model of BASES[name] saved by transformers (every weight random, norms about 1)."""
    kind, fields = BASES[name]
    config_cls, model_cls = (getattr(transformers, c) for c in CLASSES[kind])
    torch.manual_seed(0)
    model = model_cls(config_cls(**SHAPE, **json.loads(json.dumps(fields)), tie_word_embeddings=False)).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.normal_(1.0 if n.endswith("norm.weight") else 0.0, 0.2 if p.dim() == 1 else 0.1)
    model.save_pretrained(root / name)
    return root / name


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, Path]:
    from hf_fixtures import write_tokenizer

    root = tmp_path_factory.mktemp("bases")
    tok = write_tokenizer(root / "tokenizer", template=None)
    out = {}
    for name in BASES:
        out[name] = save_base(root, name)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tok / f, out[name] / f)
    return out


def edited(bases, tmp_path, base: str, config=None, weights=None) -> Path:
    """A copy of a base folder with config.json changed by `config(dict)` and the weights by `weights(dict)`."""
    from safetensors.torch import load_file, save_file

    folder = Path(shutil.copytree(bases[base], tmp_path / "hf"))
    if config is not None:
        data = json.loads((folder / "config.json").read_text())
        config(data)
        (folder / "config.json").write_text(json.dumps(data))
    if weights is not None:
        tensors = load_file(folder / "model.safetensors")
        weights(tensors)
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def import_script(folder: Path, out: Path, *args):
    return run_here([sys.executable, str(ROOT / "scripts" / "import_model.py"), str(folder), "--out", str(out),
                     *map(str, args)], cwd=ROOT)


def assert_same_logits(folder: Path, out: Path, tokens: int = 40):
    """The imported run's logits against transformers' on the source folder (float32, 1e-4)."""
    from sprout.model.load import load_model

    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model, _ = load_model(out)
    ids = torch.randint(0, SHAPE["vocab_size"], (2, min(tokens, model.config.max_seq_len)),
                        generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, rtol=0, atol=1e-4)
    return model


def drop(*names):
    return lambda c: [c.pop(n) for n in names]


def put(**fields):
    return lambda c: c.update(json.loads(json.dumps(fields)))


def old_spelling(c):  # transformers 4's config.json: rope_theta beside rope_scaling {"type": ...}
    rope = c.pop("rope_parameters")
    c["rope_theta"] = rope.pop("rope_theta")
    rope["type"] = rope.pop("rope_type")
    c["rope_scaling"] = rope


def theta_outside(c):  # a rope_scaling without rope_theta: the top-level one counts
    rope = c.pop("rope_parameters")
    rope.pop("rope_theta")
    c.update(rope_scaling=rope, rope_theta=50000.0)


def scaling_beside_parameters(c):  # rope_scaling wins whole: rope_parameters' rope_theta is not read
    rope = c.pop("rope_parameters")
    rope.pop("rope_theta")
    c.update(rope_scaling=rope, rope_parameters={"rope_type": "default", "rope_theta": 500000.0})


def no_biases(part):  # the weights without the biases of `part` ("mlp" or "self_attn")
    return lambda w: [w.pop(k) for k in list(w) if part in k and k.endswith("bias")]


def tie_equal(w):
    w["lm_head.weight"] = w["model.embed_tokens.weight"].clone()


# (case, base, config edit, weights edit, extra script arguments)
SAME = [
    ("llama3 in rope_parameters (transformers 5)", "llama", None, None, ()),
    ("llama3 as rope_scaling with type and a top-level rope_theta", "llama", old_spelling, None, ()),
    ("a rope_scaling without rope_theta takes the top-level one", "llama", theta_outside, None, ()),
    ("a top-level original_max_position_embeddings overrides llama3's own", "llama",
     put(original_max_position_embeddings=64), None, ()),
    ("rope_scaling replaces rope_parameters whole, rope_theta too", "llama", scaling_beside_parameters, None, ()),
    ("the rope object's rope_theta wins over the top-level one", "llama", put(rope_theta=123.0), None, ()),
    ("a default rope_scaling beside llama3 rope_parameters is plain rope", "llama",
     put(rope_scaling={"rope_type": "default"}), None, ()),
    ("an empty rope_scaling leaves rope_parameters", "llama", put(rope_scaling={}), None, ()),
    ("a null rope_scaling leaves rope_parameters", "llama", put(rope_scaling=None), None, ()),
    ("rope_type wins over type", "llama", put(rope_scaling={"type": "yarn", "rope_type": "default"}), None, ()),
    ("dynamic rope is plain rope up to max_position_embeddings", "llama",
     put(rope_parameters={"rope_type": "dynamic", "factor": 3.0, "rope_theta": 10000.0}), None, ()),
    ("default rope ignores partial_rotary_factor", "llama16",
     put(rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5}), None, ()),
    ("no rope field at all: theta 10000", "llama16", drop("rope_parameters"), None, ()),
    ("tie_word_embeddings with a different stored head: untied", "llama", put(tie_word_embeddings=True), None, ()),
    ("tie_word_embeddings with a head equal to the embedding: tied", "llama", put(tie_word_embeddings=True),
     tie_equal, ()),
    ("tie_word_embeddings with only the head stored: the embedding is the head", "llama",
     put(tie_word_embeddings=True), lambda w: w.pop("model.embed_tokens.weight"), ()),
    ("no tie_word_embeddings: untied", "llama", drop("tie_word_embeddings"), None, ()),
    ("no head_dim: hidden_size / heads", "llama16", drop("head_dim"), None, ()),
    ("a null head_dim: hidden_size / heads", "llama16", put(head_dim=None), None, ()),
    ("Qwen2's head_dim, a field its config class lacks", "qwen2", None, None, ()),
    ("Qwen2's q/k/v biases whatever attention_bias says", "qwen2", put(attention_bias=False), None, ()),
    ("Mistral has no biases whatever attention_bias says", "mistral", put(attention_bias=True, mlp_bias=True),
     None, ()),
    ("Llama ignores sliding-window fields", "llama", put(use_sliding_window=True, sliding_window=4), None, ()),
    ("Qwen2's window only on sliding layers (layer_types all full)", "qwen2",
     put(use_sliding_window=True, sliding_window=8), None, ()),
    ("Qwen2's window within --max-seq-len", "qwen2",
     lambda c: (c.pop("layer_types"), c.update(use_sliding_window=True, sliding_window=16, max_window_layers=1)),
     None, ("--max-seq-len", 16)),
    ("Mistral's window as long as the context", "mistral", put(sliding_window=128), None, ()),
    ("hidden_act swish is silu", "llama", put(hidden_act="swish"), None, ()),
    ("no rms_norm_eps: Llama's 1e-6", "llama", drop("rms_norm_eps"), None, ()),
    ("no max_position_embeddings: Llama's 2048", "llama", drop("max_position_embeddings"), None, ()),
    ("max_position_embeddings of 10**12 capped by --max-seq-len", "llama",
     put(max_position_embeddings=10**12), None, ("--max-seq-len", 64)),
    ("model_type without architectures", "llama", drop("architectures"), None, ()),
]


@pytest.mark.parametrize("case, base, config, weights, args", SAME, ids=[c[0] for c in SAME])
def test_imports_as_transformers_loads(case, base, config, weights, args, bases, tmp_path):
    folder = edited(bases, tmp_path, base, config, weights)
    done = import_script(folder, tmp_path / "run", *args)
    assert done.returncode == 0, done.stderr
    model = assert_same_logits(folder, tmp_path / "run")
    if "tie_word_embeddings" in case:
        assert model.config.tie_embeddings == ("untied" not in case)
        assert ("imported untied, as transformers loads it" in done.stdout) == ("different stored head" in case)
    if "2048" in case:
        assert model.config.max_seq_len == 2048


REFUSED = [  # (case, base, config edit, weights edit, args, what the line names, transformers loads it)
    ("yarn as rope_scaling beside rope_parameters", "llama",
     put(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
         rope_parameters={"rope_type": "default", "rope_theta": 10000.0}), None, (),
     ["rope_scaling type 'yarn'", "from rope_scaling"], True),
    ("yarn spelled type", "llama", put(rope_scaling={"type": "yarn", "factor": 4.0}), None, (),
     ["rope_scaling type 'yarn'"], True),
    ("linear", "llama", put(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}), None, (),
     ["rope_scaling type 'linear'", "from rope_parameters"], True),
    ("longrope", "llama16", put(rope_parameters={"rope_type": "longrope", "short_factor": [1.0] * 8,
                                                 "long_factor": [2.0] * 8, "original_max_position_embeddings": 64,
                                                 "rope_theta": 1e4}), None, (), ["rope_scaling type 'longrope'"],
     True),
    ("llama3 with partial_rotary_factor", "llama", lambda c: c["rope_parameters"].update(partial_rotary_factor=0.5),
     None, (), ["partial_rotary_factor 0.5"], False),
    ("dynamic without factor", "llama", put(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4}), None, (),
     ["rope_parameters of type dynamic lacks factor"], False),
    ("a rope_theta that is a string", "llama", lambda c: c["rope_parameters"].update(rope_theta="1e4"), None, (),
     ["rope_parameters's rope_theta \"1e4\""], False),
    ("a rope_scaling that is a string", "llama", put(rope_scaling="yarn"), None, (),
     ["rope_scaling \"yarn\" is not a JSON object"], False),
    ("Llama attention_bias", "llama_biases", drop("mlp_bias"), no_biases("mlp"), (), ["attention_bias true"], True),
    ("Llama mlp_bias", "llama_biases", put(attention_bias=False), no_biases("self_attn"), (), ["mlp_bias true"], True),
    ("Qwen2's sliding layers shorter than the context", "qwen2",
     lambda c: (c.pop("layer_types"), c.update(use_sliding_window=True, sliding_window=16, max_window_layers=1)),
     None, (), ["sliding_window 16 is shorter than the context 128", "--max-seq-len"], True),
    ("Qwen2's sliding layers without use_sliding_window", "qwen2",
     put(layer_types=["sliding_attention", "full_attention"], sliding_window=16), None, (),
     ["layer_types has sliding_attention layers but use_sliding_window is false"], False),
    ("Mistral's window shorter than the context", "mistral", put(sliding_window=64), None, (),
     ["sliding_window 64 is shorter than the context 128"], True),
    ("model_type and architectures disagree", "llama", put(model_type="mistral"), None, (),
     ["model_type 'mistral' and architectures ['LlamaForCausalLM'] disagree"], True),
    ("a model_type sprout does not compute", "llama", put(model_type="gemma"), None, (), ["model_type 'gemma'"],
     None),
    ("tie_word_embeddings false without a head", "llama", None, lambda w: w.pop("lm_head.weight"), (),
     ["lack lm_head.weight (tie_word_embeddings is false)"], True),
    ("a Llama hidden_size not a multiple of the heads", "llama", put(num_attention_heads=3, num_key_value_heads=3),
     None, (), ["hidden_size 64 is not a multiple of num_attention_heads 3"], False),
    ("a float max_position_embeddings", "llama", put(max_position_embeddings=128.0), None, (),
     ["max_position_embeddings 128.0 is not a whole number"], False),
    ("a head_dim of 0", "llama", put(head_dim=0), None, (), ["head_dim 0 is not a whole number of at least 1"],
     False),
    ("a null head_dim on Qwen2", "qwen2", put(head_dim=None), None, (), ["head_dim null"], False),
]


@pytest.mark.parametrize("case, base, config, weights, args, needles, hf_loads", REFUSED, ids=[c[0] for c in REFUSED])
def test_what_sprout_does_not_compute_is_refused_naming_the_field(case, base, config, weights, args, needles, hf_loads,
                                                                  bases, tmp_path):
    folder = edited(bases, tmp_path, base, config, weights)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "notes.txt").write_text("mine\n")
    before = tree(tmp_path)
    one_error(import_script(folder, tmp_path / "run", *args), str(folder / "config.json"), *needles)
    assert tree(tmp_path) == before
    if hf_loads is None:
        return
    try:  # what transformers does with the same folder (None: not asked): refused here either way
        transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)(torch.tensor([[1, 2, 3]]))
        loads = True
    except Exception:
        loads = False
    assert loads == hf_loads


def test_missing_fields_take_transformers_defaults():
    from sprout.model.hf_config import DEFAULTS

    for arch, defaults in DEFAULTS.items():
        config_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
        fields = {f.name: f.default for f in dataclasses.fields(config_cls)}
        for name, value in defaults.items():
            assert fields[name] == value, (arch, name)
