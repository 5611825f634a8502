"""The rollout engine interface (`rollout.engine`): a stand-in engine plugged in where vLLM's goes
(`ENGINES["vllm"]`, with a placeholder `vllm` module so that the start-up check passes) wraps
`generate_tokens` but returns log-probs shifted by SHIFT. GRPO's and PPO's losses recompute
every log-prob, so a run with it trains exactly as the sprout engine's run does (same tokens,
same losses, same weights) while `sampling/logp_diff_*` reports the shift; `update_weights` runs
once after every optimizer step. `rollout.engine: vllm` without vLLM is refused at start in one
line with its install line, the run folder left as it was. What needs no GPU of the vLLM engine
itself: the policy's weights under transformers' names load into LlamaForCausalLM and compute the
same logits, and vLLM's outputs read back as `generate_tokens`'s `Rollout`.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from grpo_fixtures import config_dict as grpo_dict
from grpo_fixtures import data  # noqa: F401 (data: a fixture)
from ppo_fixtures import config_dict as ppo_dict
from preference_train_fixtures import base  # noqa: F401 (base: a fixture)
from proc import one_error, run_here, tree
from safetensors.torch import load_file

from sprout.checkpoint import read_meta
from sprout.config import from_dict
from sprout.engine.configs import LoraConfig
from sprout.engine.metrics import read_metrics
from sprout.errors import SproutError
from sprout.model.export import hf_config
from sprout.model.generate import default_stop_ids, generate_tokens
from sprout.model.heads import PolicyWithValue
from sprout.model.lora import add_adapters
from sprout.model.transformer import ModelConfig
from sprout.stages import rollout_engine
from sprout.stages.configs import GRPOConfig, PPOConfig
from sprout.stages.grpo import run_grpo
from sprout.stages.ppo import run_ppo
from sprout.stages.rollout_engine import SproutEngine, check_engine
from sprout.stages.vllm_engine import policy_weights, rollout_of

ROOT = Path(__file__).resolve().parents[1]
SHIFT = 0.25  # added to every sampled token's log-prob by the stand-in engine


class ShiftedEngine(SproutEngine):
    """sprout's engine under vLLM's name, its log-probs off by SHIFT; records the policy's lm_head
    at every `update_weights`."""

    name = "vllm"

    def __init__(self, *args, updates: list, **kw):
        super().__init__(*args, **kw)
        self.updates = updates

    def generate(self, *args, **kw):
        out = super().generate(*args, **kw)
        out.logprobs = out.logprobs + SHIFT * out.completion_mask
        return out

    def update_weights(self, model) -> None:
        self.updates.append(model.lm_head.weight.detach().clone())


@pytest.fixture
def stand_in(monkeypatch):
    """`rollout.engine: vllm` runs `ShiftedEngine`; returns the lm_head of each `update_weights`."""
    updates = []

    def factory(rollout, model, tokenizer, accelerator, rows):
        return ShiftedEngine(model, tokenizer.vocab_size, autocast=accelerator.autocast, compile=rollout.compile,
                             updates=updates)

    monkeypatch.setitem(rollout_engine.ENGINES, "vllm", factory)
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))  # check_engine imports it
    return updates


def grpo(data: Path, init: Path, out: Path, engine: str = "sprout", **values) -> dict:
    cfg = grpo_dict(data, init, out, **values)
    cfg["rollout"]["engine"] = engine
    return run_grpo(from_dict(GRPOConfig, cfg))


def ppo(data: Path, init: Path, out: Path, engine: str = "sprout", **values) -> dict:
    cfg = ppo_dict(data, init, out, **values)
    cfg["rollout"]["engine"] = engine
    return run_ppo(from_dict(PPOConfig, cfg))


def records(out: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(out / "metrics.jsonl") if "loss" in r}


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(read_meta(out / "checkpoints")["path"] + "/model.safetensors"))


# ---- the interface --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mu", [1, 2], ids=["old_logps_from_the_loss", "old_logps_forward"])
def test_grpo_recomputes_the_engines_logps_and_reports_the_gap(mu, stand_in, base, data, tmp_path):
    """μ 1: the loss's own log-probs are the old ones; μ 2: one no-grad forward takes them. Either
    way the stand-in's shifted log-probs change no loss and no weight, only logp_diff (by SHIFT)."""
    steps = 3
    cfg = dict(max_steps=steps, num_iterations=mu, ckpt_every=steps)
    grpo(data, base, tmp_path / "sprout", **cfg)
    assert stand_in == []  # the sprout engine is not the stand-in
    grpo(data, base, tmp_path / "vllm", "vllm", **cfg)
    a, b = records(tmp_path / "sprout"), records(tmp_path / "vllm")
    assert sorted(a) == sorted(b) == list(range(1, steps + 1))
    for s in a:
        assert b[s]["completions/mean_length"] == a[s]["completions/mean_length"]  # the same tokens
        assert b[s]["loss"] == a[s]["loss"] and b[s]["grad_norm"] == a[s]["grad_norm"]
        assert a[s]["sampling/logp_diff_max"] < 1e-4  # the KV-cached decode against the full forward
        assert b[s]["sampling/logp_diff_max"] == pytest.approx(SHIFT, abs=1e-4)
        assert b[s]["sampling/logp_diff_mean"] == pytest.approx(SHIFT, abs=1e-4)
    wa, wb = final_weights(tmp_path / "sprout"), final_weights(tmp_path / "vllm")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    # once after every optimizer step, seeing that step's weights: the last one the final weights
    assert len(stand_in) == steps
    assert all(not torch.equal(x, y) for x, y in zip(stand_in, stand_in[1:]))
    assert torch.equal(stand_in[-1], wb["lm_head.weight"])


def test_ppo_recomputes_the_engines_logps_and_reports_the_gap(stand_in, base, data, tmp_path):
    steps = 2
    ppo(data, base, tmp_path / "sprout", max_steps=steps, ckpt_every=steps)
    ppo(data, base, tmp_path / "vllm", "vllm", max_steps=steps, ckpt_every=steps)
    a, b = records(tmp_path / "sprout"), records(tmp_path / "vllm")
    for s in range(1, steps + 1):
        assert b[s]["loss"] == a[s]["loss"] and b[s]["objective/kl"] == a[s]["objective/kl"]
        assert a[s]["sampling/logp_diff_max"] < 1e-4
        assert b[s]["sampling/logp_diff_max"] == pytest.approx(SHIFT, abs=1e-4)
    wa, wb = final_weights(tmp_path / "sprout"), final_weights(tmp_path / "vllm")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert len(stand_in) == steps and torch.equal(stand_in[-1], wb["lm_head.weight"])


# ---- refusals -------------------------------------------------------------------------------------------------
@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_vllm_not_installed_is_refused_at_start_leaving_the_run_folder(base, data, tmp_path):
    """Through the script, on a folder holding a finished run (--overwrite) and on a new one."""
    done = tmp_path / "done"
    grpo(data, base, done, max_steps=1, ckpt_every=1)
    before = tree(done)
    args = ["--data", data, "--init", base, "--batch.global_prompts", "2", "--batch.num_generations", "4",
            "--batch.micro_completions", "4", "--data.max_prompt_length", "24", "--rollout.max_completion_length",
            "12", "--train.max_steps", "1", "--train.progress", "false", "--rollout.engine", "vllm"]
    for out, extra in ((done, ["--overwrite"]), (tmp_path / "new", [])):
        proc = run_here([sys.executable, ROOT / "scripts" / "train_grpo.py", *args, "--out", out, *extra], cwd=ROOT)
        line = one_error(proc, "rollout.engine: vllm cannot be imported here", "pip install -e '.[vllm]'",
                         "make venv-vllm", "rollout.engine sprout")
        assert "\n" not in line
    assert tree(done) == before and not (tmp_path / "new").exists()


def test_vllm_in_several_processes_is_refused(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    check_engine("vllm", 1)
    check_engine("sprout", 2)
    with pytest.raises(SproutError, match=r"rollout.engine: vllm runs colocated in one process .* this run has 2"):
        check_engine("vllm", 2)


# ---- the vLLM engine's parts that need no vLLM ----------------------------------------------------------------
def test_policy_weights_load_into_transformers_llama(sp):
    """A PPO policy (value head) with tied embeddings and trained LoRA adapters: its weights under
    transformers' names (adapters merged, value head and tied lm_head left out) are a whole
    LlamaForCausalLM that computes the policy's logits, as vLLM's loader is given them."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    policy = PolicyWithValue(ModelConfig(vocab_size=96, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                         max_seq_len=32, tie_embeddings=True))
    add_adapters(policy, LoraConfig(r=4), seed=0)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.1)  # adapters that change the output
    weights = dict(policy_weights(policy))
    assert not any("lora" in k or "base_layer" in k or "value_head" in k for k in weights)
    assert "lm_head.weight" not in weights and "model.embed_tokens.weight" in weights
    config = hf_config(policy)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
    missing, unexpected = hf.load_state_dict(weights, strict=False)
    assert unexpected == [] and set(missing) <= {"lm_head.weight"}
    hf.tie_weights()
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = policy(ids), hf(ids).logits
    assert (ours - theirs).abs().max() < 1e-4


def test_vllm_outputs_read_back_as_generate_tokens_rollout(sp, base):
    """generate_tokens' rows (some stopped, some truncated), given as vLLM's RequestOutputs (one
    request of n samples per prompt, the samples out of order), read back to the same tensors."""
    from sprout.model.load import load_model

    model, _ = load_model(base)
    prompts = [[5, 6, 7], [9, 10], [11, 12, 13, 14]]
    P = max(map(len, prompts))
    ids = torch.tensor([[0] * (P - len(p)) + p for p in prompts])
    mask = (torch.arange(P)[None, :] >= torch.tensor([P - len(p) for p in prompts])[:, None]).long()
    G, stops = 3, default_stop_ids(sp)
    ref = generate_tokens(model, ids, mask, max_new_tokens=10, num_generations=G, stop_ids=stops,
                          vocab_size=sp.vocab_size, generator=torch.Generator().manual_seed(3))
    assert ref.eos.any() and ref.truncated.any()
    outputs = []
    for i in range(len(prompts)):
        samples = []
        for k in reversed(range(G)):
            r, n = i * G + k, int(ref.lengths[i * G + k])
            toks = ref.completion_ids[r, :n].tolist()
            lps = [{t: SimpleNamespace(logprob=float(lp))} for t, lp in zip(toks, ref.logprobs[r, :n].tolist())]
            samples.append(SimpleNamespace(index=k, token_ids=toks, logprobs=lps))
        outputs.append(SimpleNamespace(outputs=samples))
    got = rollout_of(outputs, prompts, G, stops)
    for field in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "eos", "truncated", "lengths"):
        assert torch.equal(getattr(got, field), getattr(ref, field).cpu()), field
    assert torch.allclose(got.logprobs, ref.logprobs)

