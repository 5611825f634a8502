"""LoRA adapters (peft) in the post-training stages: the adapted forward equals its merged weights
and decoding's fused copies, adapters off equal the base exactly, a LoRA checkpoint holds the
adapters and heads with its base recorded (a changed or missing base refused), resume is
bit-exact, a later stage starts from a LoRA run merged, the reference is the policy with its
adapters off, bad options are refused in one line, and r 0 leaves the config hash alone."""

import shutil
import sys
from pathlib import Path

import pytest
import torch
import yaml
from grpo_fixtures import config_dict, data  # noqa: F401 (data: a fixture)
from preference_train_fixtures import base, resume_folder, write_lm  # noqa: F401 (base: a fixture)
from proc import one_error, run_here
from safetensors.torch import load_file

from sprout.checkpoint import read_meta
from sprout.config import from_dict, resume_config
from sprout.engine.configs import LoraConfig
from sprout.engine.metrics import read_metrics
from sprout.engine.trainer import Trainer
from sprout.errors import SproutError
from sprout.model.config import ModelConfig
from sprout.model.decode import Decoder
from sprout.model.load import load_model
from sprout.lora_weights import lora_scale, merge_adapters
from sprout.model.lora import AdaptersOff, add_adapters
from sprout.model.transformer import Transformer
from sprout.stages.grpo import GRPOConfig, run_grpo

ROOT = Path(__file__).resolve().parents[1]


def adapted(seed: int = 0, r: int = 4, **model):
    """(base, adapted copy with random B, so the adapters change the output)."""
    torch.manual_seed(seed)
    base = Transformer(ModelConfig(vocab_size=96, d_model=32, n_layers=2, n_heads=4, max_seq_len=32, **model)).eval()
    model = Transformer(base.config).eval()
    model.load_state_dict(base.state_dict())
    add_adapters(model, LoraConfig(r=r, alpha=8.0), seed=seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return base, model


def merged_copy(base: Transformer, model: Transformer, scale: float) -> Transformer:
    saved = {k: v for k, v in model.state_dict().items() if ".lora_" in k}
    plain = Transformer(base.config).eval()
    plain.load_state_dict(merge_adapters(base.state_dict(), saved, scale))
    return plain


@pytest.mark.parametrize("model_kw", [{}, {"attention_bias": True, "n_kv_heads": 2}], ids=["llama", "qkv_bias_gqa"])
def test_adapted_forward_equals_merged_weights_and_decoding_and_off_equals_base(model_kw):
    base, model = adapted(**model_kw)
    ids = torch.randint(0, 96, (3, 12))
    with torch.no_grad():
        out, want = model(ids), merged_copy(base, model, lora_scale(4, 8.0))(ids)
        assert (out - base(ids)).abs().max() > 1e-3  # the adapters matter
        torch.testing.assert_close(out, want, atol=1e-5, rtol=0)
        assert torch.equal(AdaptersOff(model)(ids), base(ids))  # the reference: exactly the base
        assert torch.equal(model(ids), out)  # adapters back on afterwards
        logits = Decoder(model, rows=3, max_len=16).prefill(ids, torch.ones_like(ids))
        torch.testing.assert_close(logits, out[:, -1], atol=1e-5, rtol=0)
    assert all(p.requires_grad == (".lora_" in n) for n, p in model.named_parameters())


def test_a_scalar_head_trains_in_full_beside_the_adapters():
    from sprout.model.heads import PolicyWithValue, RewardModel

    for cls, head in ((PolicyWithValue, "value_head.weight"), (RewardModel, "score_head.weight")):
        model = cls(ModelConfig(vocab_size=96, d_model=32, n_layers=1, n_heads=4, max_seq_len=32))
        add_adapters(model, LoraConfig(r=2))
        trained = {n for n, p in model.named_parameters() if p.requires_grad}
        assert head in trained and all(".lora_" in n for n in trained - {head})


def test_target_modules_pick_layers_and_a_name_matching_none_is_refused():
    model = Transformer(ModelConfig(vocab_size=96, d_model=32, n_layers=1, n_heads=4, max_seq_len=32))
    add_adapters(model, LoraConfig(r=2, target_modules=["q_proj", "down_proj"]))
    adapted_layers = {n.rsplit(".", 3)[0].rsplit(".", 1)[-1] for n, _ in model.named_parameters() if ".lora_A" in n}
    assert adapted_layers == {"q_proj", "down_proj"}
    block = torch.nn.Module()
    block.q_proj, block.v_proj = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    other = torch.nn.Module()
    other.layers = torch.nn.ModuleList([block])
    with pytest.raises(SproutError, match=r"^lora.target_modules: down_proj matches no linear layer of this model "
                                          r"\(its linear layers: q_proj, v_proj\)$"):
        add_adapters(other, LoraConfig(r=2, target_modules=["q_proj", "down_proj"]))


@pytest.mark.parametrize("values, pattern", [
    ({"r": -1}, r"lora.r: got -1; expected an integer in \[0, inf\)"),
    ({"r": 1.5}, r"lora.r: got 1.5; expected an integer"),
    ({"alpha": 0}, r"lora.alpha: got 0; expected a number in \(0, inf\)"),
    ({"dropout": 1.0}, r"lora.dropout: got 1.0; expected a number in \[0, 1\)"),
    ({"target_modules": ["q_proj", "qkv"]}, r"lora.target_modules: got \['qkv'\]; expected all-linear or names"),
    ({"target_modules": ["all-linear", "q_proj"]}, r"lora.target_modules: .* expected \[all-linear\] alone"),
])
def test_bad_lora_options_are_refused_in_one_line(values, pattern, tmp_path):
    with pytest.raises(SproutError, match=pattern) as info:
        from_dict(GRPOConfig, {"lora": values})
    assert "\n" not in str(info.value)


def test_rank_0_leaves_the_config_hash_as_without_the_section():
    full, lora = from_dict(GRPOConfig, {}), from_dict(GRPOConfig, {"lora": {"r": 8}})
    assert "lora" not in resume_config(full) and resume_config(lora)["lora"]["r"] == 8
    assert resume_config(from_dict(GRPOConfig, {"lora": {"alpha": 3.0}})) == resume_config(full)


# ---- runs ------------------------------------------------------------------------------------------------------
def lora_cfg(data, init, out, lora=None, **values) -> GRPOConfig:
    cfg = config_dict(data, init, out, **values)
    cfg["lora"] = lora or {"r": 4, "alpha": 8.0}
    return from_dict(GRPOConfig, cfg)


def train_records(out: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(out / "metrics.jsonl") if "loss" in r}


@pytest.fixture(scope="module")
def lora_run(base, data, tmp_path_factory):
    """GRPO with LoRA from a copy of `base`: 4 steps, μ = 2, KL in the loss, a checkpoint per step."""
    root = tmp_path_factory.mktemp("lora")
    init = root / "base"
    shutil.copytree(base, init)
    out = root / "run"
    run_grpo(lora_cfg(data, init, out, max_steps=4, num_iterations=2, ckpt_every=1, keep_checkpoints=10, beta=0.1))
    return init, out


def test_a_lora_checkpoint_holds_adapters_and_records_its_base(lora_run):
    init, out = lora_run
    meta = read_meta(out / "checkpoints")
    saved = load_file(Path(meta["path"]) / "model.safetensors")
    assert saved and all(".lora_A.default." in k or ".lora_B.default." in k for k in saved)
    assert len(saved) == 2 * 7 * 2  # A and B of 7 layers in 2 blocks
    base_meta = read_meta(init)
    assert meta["frozen_models"]["base"] == {"path": base_meta["path"],
                                             "weights_sha256": base_meta["files"]["model.safetensors"]}
    assert meta["lora"] == {"r": 4, "alpha": 8.0, "dropout": 0.0, "use_rslora": False, "scale": 2.0,
                            "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                               "down_proj"]}
    model, _ = load_model(out)  # a plain model: the base with the adapters merged
    base_model, _ = load_model(init)
    ids = torch.randint(0, 512, (2, 10))
    want = merged_copy(base_model, _adapted_from(base_model, saved), 2.0)(ids)
    torch.testing.assert_close(model(ids), want, atol=1e-5, rtol=0)
    assert any(r.get("kl", 0) > 0 for r in train_records(out).values())  # the reference differs once trained
    assert "- LoRA: r 4, alpha 8.0 (scale 2) on q_proj, k_proj" in (out / "report.md").read_text()


def _adapted_from(base_model, saved):
    model = Transformer(base_model.config).eval()
    model.load_state_dict(base_model.state_dict())
    add_adapters(model, LoraConfig(r=4, alpha=8.0))
    model.load_state_dict(saved, strict=False)
    return model


def test_the_reference_is_the_policy_with_its_adapters_off(base, data, tmp_path, monkeypatch):
    built, prepared = [], []
    monkeypatch.setattr(Transformer, "__init__", lambda self, c, _i=Transformer.__init__: built.append(1) or _i(self, c))
    original = Trainer.prepare_frozen
    monkeypatch.setattr(Trainer, "prepare_frozen", lambda self, m: prepared.append(m) or original(self, m))
    run_grpo(lora_cfg(data, base, tmp_path / "g", max_steps=1, beta=0.1))
    assert len(prepared) == 1 and isinstance(prepared[0], AdaptersOff) and len(built) == 1  # the policy only


@pytest.mark.parametrize("step", [2, 3], ids=["rollout_boundary", "mid_buffer"])
def test_a_lora_resume_matches_an_uninterrupted_run_bit_for_bit(step, lora_run, data, tmp_path):
    init, run_a = lora_run
    out_b = resume_folder(run_a, step, tmp_path / "b")
    run_grpo(lora_cfg(data, init, out_b, max_steps=4, num_iterations=2, ckpt_every=1, keep_checkpoints=10, beta=0.1),
             resume="latest")
    a, b = train_records(run_a), train_records(out_b)
    keys = ("loss", "reward", "kl", "grad_norm", "completions/mean_length")
    assert sorted(b) == list(range(step + 1, 5))
    assert [[b[s][k] for k in keys] for s in b] == [[a[s][k] for k in keys] for s in b]
    last = "checkpoints/step_00000004/model.safetensors"
    wa, wb = load_file(run_a / last), load_file(out_b / last)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_changed_or_missing_base_is_refused_in_one_line(base, data, sp, tmp_path):
    init = tmp_path / "base"
    shutil.copytree(base, init)
    run_grpo(lora_cfg(data, init, tmp_path / "run", max_steps=1, beta=0.0))
    write_lm(init, sp, seed=9)  # another model where the base was
    with pytest.raises(SproutError, match=r"meta.json: its LoRA base .*/base has changed \(weights sha256 .*\); "
                                          r"the adapters need the model they were trained on") as info:
        load_model(tmp_path / "run")
    assert "\n" not in str(info.value)
    shutil.rmtree(init)
    with pytest.raises(SproutError, match=r"meta.json: its LoRA base .*/base cannot be read \(.*\); the adapters need"):
        load_model(tmp_path / "run")
    # through the scripts: the export, and a later stage started from the run, refused before
    # anything is written
    export = run_here([sys.executable, str(ROOT / "scripts" / "export_hf.py"), str(tmp_path / "run"),
                       str(tmp_path / "export")], cwd=ROOT)
    one_error(export, "its LoRA base", "cannot be read")
    config = tmp_path / "next.yaml"
    config.write_text(yaml.safe_dump(config_dict(data, tmp_path / "run", tmp_path / "next", max_steps=1)))
    later = run_here([sys.executable, str(ROOT / "scripts" / "train_grpo.py"), "--config", str(config)], cwd=ROOT)
    one_error(later, "its LoRA base", "cannot be read")
    assert not (tmp_path / "export").exists() and not (tmp_path / "next").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["next.yaml", "run"]


def test_a_lora_record_without_its_base_is_refused(lora_run, tmp_path):
    import json

    from sprout.formats.checkpoint_meta import meta_digest
    _, out = lora_run
    ck = tmp_path / "ck"
    shutil.copytree(read_meta(out / "checkpoints")["path"], ck)
    meta = json.loads((ck / "meta.json").read_text())
    good = json.loads(json.dumps(meta))
    del meta["frozen_models"]["base"]
    meta["meta_sha256"] = meta_digest(meta)
    (ck / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(SproutError, match=r"ck/meta.json: a LoRA checkpoint without frozen_models.base"):
        read_meta(ck)
    for field, value in (("scale", 3.0), ("r", True), ("alpha", 0)):  # a scale that is not alpha / r, ...
        meta = {**good, "lora": {**good["lora"], field: value}}
        meta["meta_sha256"] = meta_digest(meta)
        (ck / "meta.json").write_text(json.dumps(meta))
        with pytest.raises(SproutError, match=r"ck/meta.json: lora is .*; expected r > 0, alpha > 0"):
            read_meta(ck)


def test_flops_count_a_frozen_matrix_4_times_and_a_trained_one_6():
    for cls_name in ("Transformer", "RewardModel"):
        from sprout.model import heads
        cls = Transformer if cls_name == "Transformer" else heads.RewardModel
        model = cls(ModelConfig(vocab_size=96, d_model=32, n_layers=2, n_heads=4, max_seq_len=32))
        full = model.flops_per_token(16)
        attention = 12 * 2 * 32 * 16
        tied = cls is Transformer and model.config.tie_embeddings  # the tied lm_head's matmul counts too
        matmul = model.num_params(exclude_embeddings=True) + (96 * 32 if tied else 0)
        assert full == 6 * matmul + attention
        add_adapters(model, LoraConfig(r=2))
        adapters = sum(p.numel() for n, p in model.named_parameters() if ".lora_" in n)
        head = 0 if cls is Transformer else 32  # the score head trains
        frozen = matmul - head
        assert model.flops_per_token(16) == 4 * frozen + 6 * (adapters + head) + attention


def test_a_lora_run_from_a_relative_init_reads_its_base_from_anywhere(base, data, tmp_path, monkeypatch):
    shutil.copytree(base, tmp_path / "a" / "base")
    monkeypatch.chdir(tmp_path / "a")
    run_grpo(lora_cfg(data, Path("base"), tmp_path / "a" / "run", max_steps=1, beta=0.0))
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "b")
    assert read_meta(tmp_path / "a" / "run" / "checkpoints")["frozen_models"]["base"]["path"] == str(tmp_path / "a" / "base")
    load_model(tmp_path / "a" / "run")


def test_lora_dropout_is_refused_in_rl_in_one_line(base, data, tmp_path):
    with pytest.raises(SproutError, match=r"^lora.dropout: got 0.1; expected 0 in grpo \(a rollout's log-probs"):
        run_grpo(lora_cfg(data, base, tmp_path / "g", lora={"r": 4, "dropout": 0.1}))
    assert not (tmp_path / "g").exists()
