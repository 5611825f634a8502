"""Decoding's fused weight copies (`DecodeWeights`) built once per optimizer step, not once per
generate call: inside `SproutEngine.generating()` the calls share one set (`DecodeWeightsCache`),
emptied by `update_weights` and dropped at the block's end. GRPO with dynamic sampling builds one
set per step over its rounds and trains exactly as when every call builds its own (the same
tokens, losses and weights), with LoRA adapters too; the set is freed before the training
micro-steps; after an optimizer step the next generate samples from the new weights; an
evaluation's batches share one set and score as when each builds its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref

import pytest
import torch
from grpo_fixtures import addition_prompts, tiny_cfg
from grpo_fixtures import data  # noqa: F401 (a fixture)
from preference_train_fixtures import base  # noqa: F401 (a fixture)
from safetensors.torch import load_file
from test_grpo import make_stage

import sprout.evaluation.evaluate as evaluate_module
from sprout.checkpoint import read_meta
from sprout.engine.configs import LoraConfig
from sprout.engine.metrics import read_metrics
from sprout.evaluation.evaluate import evaluate_prompts
from sprout.model.decode import DecodeWeights, DecodeWeightsCache
from sprout.model.generate import generate_tokens
from sprout.model.load import load_model
from sprout.model.lora import add_adapters
from sprout.model.transformer import ModelConfig, Transformer
from sprout.stages.grpo import GRPOStage, run_grpo
from sprout.stages.rollout_engine import SproutEngine

LORA = {"r": 4, "alpha": 8.0}
# dynamic sampling over several rounds: half the prompts' groups (even gold) teach nothing
DYNAMIC = dict(reward_funcs=["grpo_fixtures:parity"], dynamic_sampling=True, max_generation_rounds=4)


@pytest.fixture
def builds(monkeypatch) -> list[weakref.ref]:
    """A weak reference to every set `DecodeWeights.of` builds, in order."""
    made = []
    build = DecodeWeights.of.__func__

    def counted(cls, *args, **kw):
        weights = build(cls, *args, **kw)
        made.append(weakref.ref(weights))
        return weights

    monkeypatch.setattr(DecodeWeights, "of", classmethod(counted))
    return made


def every_call_builds(monkeypatch) -> None:
    """The path before the reuse: no `generating()` block keeps anything."""
    monkeypatch.setattr(SproutEngine, "generating", lambda self: contextlib.nullcontext())


def records(out) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(out / "metrics.jsonl") if "loss" in r}


def final_weights(out) -> dict[str, torch.Tensor]:
    return load_file(str(read_meta(out / "checkpoints")["path"] + "/model.safetensors"))


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_grpo_builds_once_per_step_and_trains_as_every_call_building(lora, builds, monkeypatch, base, data, tmp_path):
    steps = 3
    cfg = dict(max_steps=steps, ckpt_every=steps, eval_every=0, **DYNAMIC)
    per_buffer = []  # the sets each fill_buffer built (the evaluations before and after training build theirs)
    fill_buffer = GRPOStage.fill_buffer

    def counted(self):
        start = len(builds)
        out = fill_buffer(self)
        per_buffer.append(len(builds) - start)
        return out

    monkeypatch.setattr(GRPOStage, "fill_buffer", counted)

    def run(out):
        per_buffer.clear()
        config = tiny_cfg(data, base, out, **cfg)
        run_grpo(dataclasses.replace(config, lora=LoraConfig(**LORA)) if lora else config)
        return records(out), list(per_buffer)

    reused, built_reused = run(tmp_path / "reused")
    every_call_builds(monkeypatch)
    rebuilt, built_rebuilt = run(tmp_path / "rebuilt")
    rounds = [reused[s]["dynamic_sampling/rounds"] for s in sorted(reused)]
    assert max(rounds) > 1  # some step generated in several rounds
    assert built_reused == [1] * steps and built_rebuilt == rounds
    assert sorted(reused) == sorted(rebuilt) == list(range(1, steps + 1))
    for s in reused:
        for k in ("loss", "grad_norm", "reward", "completions/mean_length", "dynamic_sampling/rounds"):
            assert reused[s][k] == rebuilt[s][k], (s, k)
    a, b = final_weights(tmp_path / "reused"), final_weights(tmp_path / "rebuilt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_copies_are_freed_before_the_training_micro_steps(builds, sp, base, data):
    stage, _ = make_stage(sp, base, data, rewards=("grpo_fixtures:parity",), dynamic_sampling=True,
                          max_generation_rounds=8)
    stage.next_micro_batches(0)
    logged = {k: s / c for k, (s, c) in zip(stage.buffer["stat_names"], stage.buffer["stats"].tolist())}
    assert logged["dynamic_sampling/rounds"] >= 2 and len(builds) == 1
    assert stage.engine.weight_cache is None and builds[0]() is None


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_after_an_optimizer_step_the_next_generate_sees_the_new_weights(lora, builds):
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=96, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32))
    if lora:
        add_adapters(model, LoraConfig(**LORA), seed=0)  # B = 0: the first step moves it off 0
    engine = SproutEngine(model, 96, autocast=contextlib.nullcontext)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    optimizer.register_step_post_hook(lambda *_: engine.update_weights(model))  # as RLStage.setup hooks it
    ids = torch.randint(1, 96, (2, 5), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    options = dict(num_generations=3, max_new_tokens=6, temperature=1.0, top_k=None, top_p=None, stop_ids=set())

    def sample(**kw):
        return engine.generate(ids, mask, generator=torch.Generator().manual_seed(2), **options, **kw)

    def fresh():  # every copy built for this call alone
        return generate_tokens(model, ids, mask, vocab_size=96, generator=torch.Generator().manual_seed(2),
                               cuda_graph=engine.cuda_graph, **options)

    with engine.generating():
        before, again = sample(), sample()
        assert len(builds) == 1
        assert torch.equal(before.completion_ids, again.completion_ids) and torch.equal(before.logprobs, again.logprobs)
        model(ids).float().pow(2).mean().backward()
        optimizer.step()
        after = sample()
        assert len(builds) == 2
    assert engine.weight_cache is None and all(ref() is None for ref in builds)
    expected = fresh()
    assert torch.equal(after.completion_ids, expected.completion_ids) and torch.equal(after.logprobs, expected.logprobs)
    assert not torch.equal(before.logprobs, expected.logprobs)  # stale copies would have failed the line above


def test_an_evaluations_batches_share_one_set_and_score_as_when_each_builds(builds, monkeypatch, sp, base):
    model, _ = load_model(base)
    prompts = addition_prompts(5, 3)

    def evaluate():
        return evaluate_prompts(model, sp, prompts, n=2, ks=(1, 2), greedy=True, max_new_tokens=6, seed=1,
                                batch_size=2)

    shared = evaluate()
    assert len(builds) == 1  # 3 batches × (sampled, greedy), dense copies: any rows

    class BuildEveryCall(DecodeWeightsCache):
        def get(self, *args):
            self.clear()
            return super().get(*args)

    monkeypatch.setattr(evaluate_module, "DecodeWeightsCache", BuildEveryCall)
    alone = evaluate()
    assert len(builds) == 1 + 6
    assert shared.metrics == alone.metrics and shared.samples == alone.samples
