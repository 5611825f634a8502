"""LoRA runs to and from PEFT (src/sprout/model/peft_adapter.py, scripts/export_hf.py --adapter,
scripts/import_model.py --adapter): a LoRA run exports merged within 1e-4 of sprout; with
--adapter its base/ and adapter/ load with peft's PeftModel (and AutoPeftModelForCausalLM) to the
same logits, for a plain LM, a Qwen2-shaped model with rsLoRA on some layers, a PPO policy, a
LoRA run on a LoRA run and a trained SFT LoRA run; an adapter made by peft's get_peft_model
imports merged to PeftModel's logits; an export with its adapter imports back to the run's
model; every refusal is one line, before anything is written."""

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from preference_train_fixtures import write_lm
from proc import one_error, run_here
from safetensors.torch import load_file, save_file
from test_lora_stages import sft_lora  # noqa: F401 (a fixture: an SFT run with LoRA)
from test_sft_train import base, sft_file  # noqa: F401 (sft_lora's fixtures)

from hf_fixtures import hf_model, write_tokenizer
from sprout.checkpoint import architecture_of, checkpoint_tokenizer, frozen_model_record, read_meta, save_rotating
from sprout.engine.configs import LoraConfig
from sprout.errors import SproutError
from sprout.model.export import export_hf, verify_export
from sprout.model.hf_import import read_source, write_run
from sprout.model.load import init_from_lm, load_model
from sprout.model.lora import add_adapters, lora_record
from sprout.model.peft_adapter import export_lora_adapter, verify_adapter

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[export]')")
peft = pytest.importorskip("peft", reason="peft is not installed (pip install -e '.[lora]')")

ROOT = Path(__file__).resolve().parents[1]
ATOL = 1e-4


def write_lora(run: Path, base_ckpt: Path, architecture: str = "lm", seed: int = 1, **lora) -> Path:
    """A LoRA run folder on the checkpoint `base_ckpt` as a stage leaves it: its trainable tensors
    (adapters with a random B, so they matter, and a scalar head), `lora` and frozen_models' `base`."""
    base_meta = read_meta(base_ckpt)
    model, _ = init_from_lm(base_ckpt, architecture, seed=seed)
    cfg = LoraConfig(**{"r": 4, "alpha": 8.0, **lora})
    targets = add_adapters(model, cfg, seed=seed)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.1)
    trained = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    meta = {**{k: base_meta[k] for k in ("model_config", "tokenizer", "tokenizer_fingerprint", "template_version")},
            "architecture": architecture_of(model), "stage": "sft", "step": 1,
            "lora": lora_record(cfg, targets), "frozen_models": {"base": frozen_model_record(base_meta)}}
    save_rotating(run / "checkpoints", 1, trained, meta=meta)
    return run


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids)
    return getattr(out, "logits", out)


IDS = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(3))

# ---------------------------------------------------------------- export

CASES = {  # (base model fields, architecture, lora fields)
    "llama": ({}, "lm", {}),
    "qwen2_tied_rslora_some_layers": ({"attention_bias": True, "n_kv_heads": 2, "tie_embeddings": True}, "lm",
                                      {"r": 8, "alpha": 4.0, "use_rslora": True,
                                       "target_modules": ["q_proj", "v_proj", "down_proj"]}),
    "ppo_policy": ({}, "lm+value", {}),
}


@pytest.fixture(scope="module")
def runs(sp, tmp_path_factory):
    """{case: LoRA run folder}, each on its own base."""
    out = {}
    for case, (model, arch, lora) in CASES.items():
        root = tmp_path_factory.mktemp(case)
        write_lm(root / "base", sp, **model)
        out[case] = write_lora(root / "run", root / "base", arch, **lora)
    return out


def test_a_lora_run_exports_merged_within_1e_4_of_sprout(runs, tmp_path):
    result, model, tok = export_hf(runs["llama"], tmp_path / "hf")
    assert result.hf_class == "LlamaForCausalLM" and not (tmp_path / "hf" / "adapter").exists()
    check = verify_export(tmp_path / "hf", model, tok)
    assert check["max_abs_diff"] <= ATOL and check["answers"] > 0
    base_model, _ = load_model(read_meta(runs["llama"])["frozen_models"]["base"]["path"])
    assert (logits(model, IDS) - logits(base_model, IDS)).abs().max() > 1e-2  # the adapters matter


@pytest.mark.parametrize("case", list(CASES))
def test_base_and_adapter_load_with_peft_to_the_merged_logits(case, runs, tmp_path):
    out = tmp_path / "hf"
    result, model, base_model, tok = export_lora_adapter(runs[case], out)
    lora = read_meta(runs[case])["lora"]
    assert sorted(p.name for p in out.iterdir()) == sorted(result.merged.files + ["adapter", "base"])
    assert sorted(p.name for p in (out / "adapter").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert {k: config[k] for k in ("peft_type", "task_type", "r", "lora_alpha", "lora_dropout", "use_rslora", "bias",
                                   "base_model_name_or_path")} == \
        {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora["r"], "lora_alpha": lora["alpha"],
         "lora_dropout": 0.0, "use_rslora": lora["use_rslora"], "bias": "none",
         "base_model_name_or_path": str(out.resolve() / "base")}
    assert sorted(config["target_modules"]) == sorted(lora["target_modules"])
    tensors = load_file(out / "adapter" / "adapter_model.safetensors")
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in tensors
    assert len(tensors) == 2 * 2 * len(lora["target_modules"])  # A and B, 2 blocks
    assert result.merged.dropped == (["value_head.weight"] if case == "ppo_policy" else [])
    assert not result.base.dropped

    want = logits(model, IDS)
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(out / "base", dtype=torch.float32)
    torch.testing.assert_close(logits(hf_base, IDS), logits(base_model, IDS), atol=ATOL, rtol=0)
    adapted = peft.PeftModel.from_pretrained(hf_base, out / "adapter").eval()
    torch.testing.assert_close(logits(adapted, IDS), want, atol=ATOL, rtol=0)
    merged = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    torch.testing.assert_close(logits(merged, IDS), want, atol=ATOL, rtol=0)
    assert (want - logits(base_model, IDS)).abs().max() > 1e-2  # the adapters matter
    auto = peft.AutoPeftModelForCausalLM.from_pretrained(out / "adapter", dtype=torch.float32).eval()
    torch.testing.assert_close(logits(auto, IDS), want, atol=ATOL, rtol=0)  # base/ found by its recorded path
    assert verify_adapter(out, model, tok)["max_abs_diff"] <= ATOL


def test_a_trained_sft_lora_run_exports_with_its_adapter(sft_lora, tmp_path):
    out, _ = sft_lora
    result, model, base_model, tok = export_lora_adapter(out, tmp_path / "hf")
    assert verify_export(tmp_path / "hf", model, tok)["max_abs_diff"] <= ATOL
    assert verify_export(tmp_path / "hf" / "base", base_model, tok)["max_abs_diff"] <= ATOL
    assert verify_adapter(tmp_path / "hf", model, tok)["max_abs_diff"] <= ATOL
    assert (logits(model, IDS) - logits(base_model, IDS)).abs().max() > 1e-2  # it learned


def test_a_lora_run_on_a_lora_run_exports_the_merged_first_run_as_its_base(runs, tmp_path):
    first = runs["llama"]
    second = write_lora(tmp_path / "second", first, seed=2, r=2, target_modules=["o_proj", "up_proj"])
    out = tmp_path / "hf"
    result, model, base_model, _ = export_lora_adapter(second, out)
    first_model, _ = load_model(first)
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(out / "base", dtype=torch.float32)
    torch.testing.assert_close(logits(hf_base, IDS), logits(first_model, IDS), atol=ATOL, rtol=0)
    adapted = peft.PeftModel.from_pretrained(hf_base, out / "adapter").eval()
    torch.testing.assert_close(logits(adapted, IDS), logits(load_model(second)[0], IDS), atol=ATOL, rtol=0)


def test_what_adapter_cannot_export_is_refused_in_one_line_before_writing(runs, sp, tmp_path):
    base_path = read_meta(runs["llama"])["frozen_models"]["base"]["path"]
    with pytest.raises(SproutError, match=r"/meta.json: not a LoRA run \(no lora record\); --adapter exports a "
                                          r"LoRA run's base and adapter, export this checkpoint without it$"):
        export_lora_adapter(base_path, tmp_path / "plain")
    reward = write_lora(tmp_path / "rm", base_path, "reward")
    with pytest.raises(SproutError, match=r"/meta.json: a reward model trained with LoRA; --adapter does not "
                                          r"export its score head \(PEFT's modules_to_save\), export the merged "
                                          r"model without --adapter$"):
        export_lora_adapter(reward, tmp_path / "rm_hf")
    assert not (tmp_path / "rm_hf").exists()
    assert export_hf(reward, tmp_path / "rm_hf")[0].hf_class == "LlamaForSequenceClassification"  # merged: fine
    assert not (tmp_path / "plain").exists()
    out = tmp_path / "hf"
    export_lora_adapter(runs["llama"], out)
    with pytest.raises(SproutError, match=r"hf: already exists and is not empty \(pass --overwrite"):
        export_lora_adapter(runs["llama"], out)
    export_hf(runs["llama"], out, overwrite=True)  # an earlier export with its adapter is an export
    assert not (out / "base").exists()
    export_lora_adapter(runs["llama"], out, overwrite=True)
    (out / "notes.txt").write_text("mine")
    with pytest.raises(SproutError, match=r"holds 'notes.txt', which an export does not write"):
        export_lora_adapter(runs["llama"], out, overwrite=True)


def test_the_script_exports_and_checks_the_adapter(runs, tmp_path):
    out = tmp_path / "hf"
    proc = run_here([sys.executable, str(ROOT / "scripts" / "export_hf.py"), str(runs["ppo_policy"]), str(out),
                     "--adapter"])
    assert proc.returncode == 0, proc.stderr
    assert f"{out}/base: LlamaForCausalLM, the LoRA run's base; {out}/adapter: a PEFT LoRA adapter (r 4, " \
           f"lora_alpha 8 on down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj)" in proc.stdout
    assert "dropped value_head.weight" in proc.stdout and "checked with peft: adapter/ on base/" in proc.stdout
    base_path = read_meta(runs["llama"])["frozen_models"]["base"]["path"]
    proc = run_here([sys.executable, str(ROOT / "scripts" / "export_hf.py"), base_path, str(tmp_path / "no"),
                     "--adapter"])
    one_error(proc, "not a LoRA run", alone=True)
    assert not (tmp_path / "no").exists()


# ---------------------------------------------------------------- import

def peft_adapter(kind: str, root: Path, **lora) -> tuple[object, Path, Path]:
    """(PeftModel, source folder, adapter folder): a tiny transformers model of `kind` saved with
    its tokenizer, and a LoRA adapter made on it with peft's get_peft_model, B random."""
    hf = hf_model(kind)
    hf.save_pretrained(root / "hf")
    write_tokenizer(root / "hf")
    config = peft.LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj",
                                                                          "gate_proj", "up_proj", "down_proj"],
                                **lora})
    adapted = peft.get_peft_model(hf, config).eval()
    torch.manual_seed(5)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    adapted.save_pretrained(root / "adapter")
    return adapted, root / "hf", root / "adapter"


@pytest.mark.parametrize("kind, lora", [("llama", {}), ("qwen2", {"use_rslora": True, "r": 2,
                                                                   "target_modules": ["q_proj", "up_proj"]})],
                         ids=["llama", "qwen2_rslora"])
def test_a_peft_adapter_imports_merged_to_peft_logits(kind, lora, tmp_path):
    adapted, source, adapter = peft_adapter(kind, tmp_path, **lora)
    write_run(read_source(str(source), tmp_path / "work", adapter=str(adapter)), tmp_path / "run")
    model, meta = load_model(tmp_path / "run")
    ids = torch.randint(0, 384, (2, 30), generator=torch.Generator().manual_seed(1))
    want = logits(adapted, ids)
    torch.testing.assert_close(logits(model, ids), want, atol=ATOL, rtol=0)
    with adapted.disable_adapter():
        assert (want - logits(adapted, ids)).abs().max() > 1e-2  # the adapter matters
    record = meta["adapter"]
    assert record.pop("sha256") == __import__("hashlib").sha256(
        (adapter / "adapter_model.safetensors").read_bytes()).hexdigest()
    assert record.pop("base_model_name_or_path") == (json.loads((adapter / "adapter_config.json").read_text()).get(
        "base_model_name_or_path") or None)
    assert record == {"path": str(adapter.resolve()), "r": lora.get("r", 4), "lora_alpha": 8,
                      "use_rslora": lora.get("use_rslora", False),
                      "target_modules": sorted(lora.get("target_modules", ["q_proj", "k_proj", "v_proj", "o_proj",
                                                                            "gate_proj", "up_proj", "down_proj"]))}


def test_an_adapter_naming_another_base_is_noted_and_a_matching_name_is_not(llama_adapter, tmp_path):
    from sprout.model.hf_import import names_source

    _, source, adapter = llama_adapter
    copy = shutil.copytree(adapter, tmp_path / "adapter")
    edit_config(copy, base_model_name_or_path="SomeOrg/Another-Model-7B")
    notes = read_source(str(source), tmp_path / "work", adapter=str(copy)).notes
    assert [n for n in notes if n.startswith("adapter: ")] == [
        f"adapter: {copy.resolve()} names SomeOrg/Another-Model-7B as its base (adapter_config.json "
        f"base_model_name_or_path), not {source}; its shapes match, check it is the same model"]
    edit_config(copy, base_model_name_or_path=str(source))
    assert not [n for n in read_source(str(source), tmp_path / "work2", adapter=str(copy)).notes
                if n.startswith("adapter: ")]
    assert names_source("HuggingFaceTB/SmolLM2-135M-Instruct", "/m/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert names_source("/home/me/models/smollm2-135m-instruct.Q4_1.gguf", "HuggingFaceTB/SmolLM2-135M-Instruct")
    assert not names_source("meta-llama/Llama-3.2-1B", "HuggingFaceTB/SmolLM2-135M-Instruct")


@pytest.fixture(scope="module")
def llama_adapter(tmp_path_factory):
    return peft_adapter("llama", tmp_path_factory.mktemp("peft"))


def edit_config(folder: Path, **fields) -> None:
    f = folder / "adapter_config.json"
    config = json.loads(f.read_text())
    config.update(fields)
    f.write_text(json.dumps({k: v for k, v in config.items() if v != "DROP"}))


def rename_tensor(folder: Path, old: str, new: str | None, reshape=None) -> None:
    """Tensor `old` of the adapter file as `new` (None: dropped), `reshape`d."""
    f = folder / "adapter_model.safetensors"
    tensors = load_file(f)
    t = tensors.pop(old)
    if new is not None:
        tensors[new] = t if reshape is None else reshape(t)
    save_file(tensors, f)


Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
Q_B = Q_A.replace("lora_A", "lora_B")
BAD_ADAPTERS = {  # id: (change to the adapter folder, the error's pattern after the folder's path)
    "no_config": (lambda d: (d / "adapter_config.json").unlink(), r"adapter: no adapter_config.json \(not a PEFT"),
    "not_lora": (lambda d: edit_config(d, peft_type="IA3"), r'adapter_config.json: peft_type "IA3" is not supported'),
    "dora": (lambda d: edit_config(d, use_dora=True), r"adapter_config.json: use_dora true \(DoRA\) is not supported"),
    "no_alpha": (lambda d: edit_config(d, lora_alpha="DROP"), r"adapter_config.json: lora_alpha is missing; expected"),
    "no_r": (lambda d: edit_config(d, r="DROP"), r"adapter_config.json: r is missing; expected an integer above 0$"),
    "rank_pattern": (lambda d: edit_config(d, rank_pattern={"q_proj": 8}),
                     r'adapter_config.json: rank_pattern {"q_proj": 8} is not supported; sprout merges plain LoRA'),
    "modules_to_save": (lambda d: edit_config(d, modules_to_save=["lm_head"]),
                        r'adapter_config.json: modules_to_save \["lm_head"\] is not supported'),
    "pissa": (lambda d: edit_config(d, init_lora_weights="pissa"),
              r'adapter_config.json: init_lora_weights "pissa" is not supported \(it rewrites the base'),
    "lone_A": (lambda d: rename_tensor(d, Q_B, None),
               r"adapter_model.safetensors: adapter tensors of layers.0.self_attn.q_proj have lora_A or lora_B but not both$"),
    "no_such_layer": (lambda d: [rename_tensor(d, t, t.replace("layers.0", "layers.7")) for t in (Q_A, Q_B)],
                      r"adapter_model.safetensors on the model of .*hf/config.json: adapter for "
                      r"layers.7.self_attn.q_proj.weight, which the base model has no weight for; adapters saved "
                      r"for another base"),
    "other_shape": (lambda d: rename_tensor(d, Q_A, Q_A, lambda t: torch.cat([t, t], dim=1)),
                    r"adapter_model.safetensors on the model of .*hf/config.json: adapter of "
                    r"layers.0.self_attn.q_proj.weight is \(96, 4\) x \(4, 128\), the base's weight \(96, 64\); "
                    r"adapters saved for another base"),
    "lm_head": (lambda d: rename_tensor(d, Q_A, "base_model.model.lm_head.lora_A.weight"),
                r"adapter_model.safetensors on the model of .*hf/config.json: tensor base_model.model.lm_head."
                r"lora_A.weight is not a LoRA A or B of a transformer layer"),
}


@pytest.mark.parametrize("bad", list(BAD_ADAPTERS))
def test_a_bad_adapter_is_refused_in_one_line_naming_file_and_field(bad, llama_adapter, tmp_path):
    _, source, adapter = llama_adapter
    copy = shutil.copytree(adapter, tmp_path / "adapter")
    change, pattern = BAD_ADAPTERS[bad]
    change(copy)
    with pytest.raises(SproutError, match=pattern) as info:
        read_source(str(source), tmp_path / "work", adapter=str(copy))
    assert "\n" not in str(info.value) and str(copy) in str(info.value)


def test_the_import_script_merges_an_adapter_and_refuses_a_bad_one(llama_adapter, tmp_path):
    adapted, source, adapter = llama_adapter
    script = str(ROOT / "scripts" / "import_model.py")
    proc = run_here([sys.executable, script, str(source), "--adapter", str(adapter), "--out", str(tmp_path / "run")])
    assert proc.returncode == 0, proc.stderr
    assert f"merged the PEFT LoRA adapter {adapter.resolve()} (r 4, lora_alpha 8 on down_proj, gate_proj" in proc.stdout
    torch.testing.assert_close(logits(load_model(tmp_path / "run")[0], IDS), logits(adapted, IDS), atol=ATOL, rtol=0)
    proc = run_here([sys.executable, script, str(source), "--adapter", str(tmp_path), "--out", str(tmp_path / "no")])
    one_error(proc, "no adapter_config.json", alone=True)
    assert not (tmp_path / "no").exists()


def test_an_export_with_its_adapter_imports_back_to_the_runs_model(runs, tmp_path):
    out = tmp_path / "hf"
    export_lora_adapter(runs["llama"], out)
    write_run(read_source(str(out / "base"), tmp_path / "work", adapter=str(out / "adapter")), tmp_path / "run")
    model, meta = load_model(tmp_path / "run")
    torch.testing.assert_close(logits(model, IDS), logits(load_model(runs["llama"])[0], IDS), atol=1e-5, rtol=0)
    assert checkpoint_tokenizer(meta).vocab_size == checkpoint_tokenizer(read_meta(runs["llama"])).vocab_size
