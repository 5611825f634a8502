"""The stage protocol of the shared loop: metrics over their own denominators, targets, tokens
and FLOPs told by the stage, time outside the optimizer step, frozen models, parameter
groups, the uncompiled generation handle, resume-free config fields; a frozen reference
under 2 DDP and 2 FSDP2 processes against 1 process (slow; tests/protocol_worker.py)."""

import json
import math
import os
import re
import sys
from pathlib import Path

import pytest
import torch
from proc import free_port, run_group
from protocol_worker import BETA, MODEL, ROWS, KLToReference, global_rows
from safetensors.torch import load_file

from sprout.checkpoint import load_train_state
from sprout.config import resume_config, resume_free_paths
from sprout.model.transformer import Transformer
from sprout.engine.training_loop import fit
from sprout.engine.trainer import TrainConfig, Trainer, config_hash, make_accelerator
from sprout.engine.metrics import read_metrics
from sprout.engine.optim import OptimConfig, build_optimizer, decay_groups, lr_schedule
from sprout.stages.pretrain import PretrainConfig
from sprout.engine.schedule import lr_at
from sprout.stages.sft import SFTConfig
from sprout.engine.stage import TokenStage

ROOT = Path(__file__).resolve().parents[1]


def toy_trainer(model, stage=None, optim=OptimConfig(lr=1e-2, warmup_steps=0, schedule="constant"), **train):
    out_dir = train.pop("out_dir", None)
    cfg = TrainConfig(**{"max_steps": 4, "log_every": 1, "eval_every": 0, "ckpt_every": 0, "progress": False,
                         "peak_tflops": -1, **train})
    groups = stage.param_groups(model) if hasattr(stage, "param_groups") else None
    return Trainer(make_accelerator(cfg), model, build_optimizer(model, optim, groups),
                   lr_schedule(optim, cfg.max_steps), cfg, grad_clip=optim.grad_clip, out_dir=out_dir)


# ---- metrics over their own denominators ----------------------------------------------------------
def test_each_metric_is_its_sum_over_its_own_count_and_the_reference_stays_frozen():
    """Per token (kl), per sequence (length, reward): hand-computed over the 6 rows of the
    step from the initial weights, not over the loss's denominator, not averaged per micro-batch."""
    torch.manual_seed(0)
    model = Transformer(MODEL)
    stage = KLToReference(None)
    trainer = toy_trainer(model, stage)
    stage.acc = trainer.accelerator
    stage.setup(trainer)
    rows = global_rows(0)
    mask = rows["loss_mask"]
    with torch.no_grad():  # by hand, from the weights before the step
        logp = torch.log_softmax(model(rows["input_ids"]), -1)
        ref_logp = torch.log_softmax(stage.ref(rows["input_ids"]), -1)
        kl = (logp.exp() * (logp - ref_logp)).sum(-1)
        tok = logp.gather(-1, rows["targets"][..., None])[..., 0]
    n = int(mask.sum())
    ref_before = [p.clone() for p in stage.ref.parameters()]
    m = trainer.step(stage.next_micro_batches(0), stage)
    assert m["targets"] == n and m["tokens"] == ROWS * 8
    assert m["length"] == pytest.approx(n / ROWS, rel=1e-12)
    assert m["reward"] == pytest.approx(tok[mask].sum().item() / ROWS, rel=1e-5)
    assert m["kl"] == pytest.approx(kl[mask].sum().item() / n, rel=1e-4)
    assert m["kl"] > 0  # the reference differs from the policy, so the KL term is not trivially 0
    assert m["loss"] == pytest.approx(((-tok + BETA * kl)[mask].sum() / n).item(), rel=1e-5)
    # the frozen reference: no gradients, eval mode, not in the optimizer, not changed by the step
    assert all(not p.requires_grad and p.grad is None for p in stage.ref.parameters()) and not stage.ref.training
    in_optimizer = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    assert not any(id(p) in in_optimizer for p in stage.ref.parameters())
    assert all(torch.equal(a, b) for a, b in zip(stage.ref.parameters(), ref_before))
    assert not all(torch.equal(a, b) for a, b in zip(model.parameters(), stage.ref.parameters()))


def test_a_metric_must_come_with_its_count():
    class Bare(TokenStage):
        def loss(self, model, batch):
            return model(batch["input_ids"]).sum(), torch.tensor(2), {"kl": torch.tensor(1.0)}

    model = torch.nn.Embedding(5, 5)
    batch = {"input_ids": torch.zeros(1, 2, dtype=torch.long), "targets": torch.zeros(1, 2, dtype=torch.long)}
    with pytest.raises(TypeError, match="metric 'kl' must be a \\(sum, count\\) pair"):
        toy_trainer(model).step([batch], Bare())


# ---- a batch layout other than token rows: pairs ----------------------------------------------------
class Pairs(TokenStage):
    """Preference-like batches: `chosen` and `rejected` rows, one target per pair; 2 pairs per
    micro-batch, 2 micro-batches per step, 7 tokens generated per step (as a rollout would)."""

    name = "pairs"
    generated_tokens = 7

    def next_micro_batches(self, step):
        g = torch.Generator().manual_seed(step)
        return [{"chosen": torch.randint(0, 5, (2, 3), generator=g), "rejected": torch.randint(0, 5, (2, 3), generator=g)}
                for _ in range(2)]

    def count_targets(self, batch):
        return batch["chosen"].shape[0]

    def num_tokens(self, batch):
        return batch["chosen"].numel() + batch["rejected"].numel()

    def flops(self, model, batch):
        return 1000.0 * self.num_tokens(batch)

    def loss(self, model, batch):
        margin = model(batch["chosen"]).sum((1, 2)) - model(batch["rejected"]).sum((1, 2))
        n = margin.shape[0]
        return -torch.nn.functional.logsigmoid(margin).sum(), n, {"accuracy": ((margin > 0).sum(), n)}

    def evaluate(self, model):
        return {"val_loss": 0.0}

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def test_tokens_flops_and_generation_are_the_stages(tmp_path):
    """No input_ids in the batch: tokens, MFU and generation tokens/s come from the stage."""
    torch.manual_seed(0)
    trainer = toy_trainer(torch.nn.Embedding(5, 5), out_dir=tmp_path, peak_tflops=1e-9)  # a 1000 FLOP/s "peak"
    fit(trainer, Pairs())
    train = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "loss" in r]
    assert [r["tokens"] for r in train] == [24, 48, 72, 96]  # 2 micro-batches × 2 pairs × (3 + 3) tokens
    assert all(r["targets"] == 4 and 0 <= r["accuracy"] <= 1 for r in train)
    for r in train:  # 1000 FLOPs per token: MFU = 1000 × training tokens/s ÷ 1000 FLOP/s
        assert r["mfu"] == pytest.approx(r["tokens_per_s"], rel=1e-9)
        # 7 tokens generated in next_micro_batches, over the time spent there
        assert r["generation/tokens_per_s"] == pytest.approx(7 / r["time/batch_s"], rel=1e-9)
    report = (tmp_path / "report.md").read_text()
    assert "training throughput (optimizer steps only)" in report and "generation median" in report


# ---- parameter groups -----------------------------------------------------------------------------
class Head(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(3, 3)
        self.value = torch.nn.Linear(3, 1)

    def forward(self, x):
        return self.value(self.body(x))


class ValueHead(TokenStage):
    """The value head learns at 10× the body's lr, without weight decay."""

    def param_groups(self, model):
        return decay_groups(model.body.parameters(), 0.1) + [
            {"params": list(model.value.parameters()), "lr_scale": 10.0, "weight_decay": 0.0, "name": "value"}]

    def count_targets(self, batch):
        return batch["x"].shape[0]

    def num_tokens(self, batch):
        return batch["x"].shape[0]

    def flops(self, model, batch):
        return 0.0

    def loss(self, model, batch):
        return model(batch["x"]).pow(2).sum(), batch["x"].shape[0], {}


def test_parameter_groups_scale_the_schedule():
    model, stage = Head(), ValueHead()
    optim = OptimConfig(lr=1e-3, warmup_steps=2, schedule="cosine", min_lr_ratio=0.1)
    trainer = toy_trainer(model, stage, optim, max_steps=6)
    groups = trainer.optimizer.param_groups
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0, 0.0]
    x = torch.ones(2, 3)
    for step in range(6):
        m = trainer.step([{"x": x}], stage)
        want = lr_at(step, peak=1e-3, total_steps=6, warmup_steps=2, kind="cosine", min_ratio=0.1)
        assert [g["lr"] for g in groups] == pytest.approx([want, want, 10 * want], rel=1e-12)
        assert m["lr"] == groups[0]["lr"] and m["lr/value"] == groups[2]["lr"]
    with pytest.raises(ValueError, match="every trainable parameter of the model exactly once"):
        build_optimizer(model, optim, decay_groups(model.body.parameters(), 0.1))
    with pytest.raises(ValueError, match="lr or lr_scale, not both"):
        build_optimizer(model, optim, [{"params": list(model.parameters()), "lr": 1.0, "lr_scale": 2.0}])


def test_default_groups_decay_matrices_only():
    model = Head()
    groups = build_optimizer(model, OptimConfig(lr=2e-3, weight_decay=0.05)).param_groups
    assert [(len(g["params"]), g["weight_decay"], g["lr"]) for g in groups] == [(2, 0.05, 2e-3), (2, 0.0, 2e-3)]


# ---- the generation handle ---------------------------------------------------------------------------
def test_generation_model_is_the_raw_module_without_the_compiled_forward():
    torch.manual_seed(0)
    trainer = toy_trainer(Transformer(MODEL), compile=True)
    raw, gen = trainer.raw_model, trainer.generation_model

    def compiled(*args, **kwargs):
        raise AssertionError("the compiled forward ran")

    raw._compiled_call_impl = compiled  # what Module.compile() installed: a call through it fails
    x = torch.randint(0, MODEL.vocab_size, (2, 5))
    with pytest.raises(AssertionError, match="compiled forward ran"):
        raw(x)
    assert torch.equal(gen(x), raw.forward(x))  # eager, same weights
    assert [p for p in gen.parameters()] == [p for p in raw.parameters()] and gen.config is raw.config
    assert toy_trainer(raw).generation_model is raw  # not compiled: the module itself


# ---- resume-free fields ---------------------------------------------------------------------------
def test_resume_free_fields_are_declared_on_the_fields():
    train_free = {f"train.{k}" for k in ("max_steps", "chinchilla_ratio", "compile", "cpu_threads", "log_every",
                                         "eval_every", "ckpt_every", "keep_checkpoints", "progress", "trackers",
                                         "peak_tflops", "gradient_checkpointing")}
    assert resume_free_paths(PretrainConfig) == train_free | {"out", "data.dir", "data.eval_tokens", "data.verify"}
    assert resume_free_paths(SFTConfig) == train_free | {"out", "init", "data.path", "data.val_path", "data.epochs", "data.verify", "sample_prompts"}
    cfg = PretrainConfig()
    kept = resume_config(cfg)
    assert "max_steps" not in kept["train"] and "dir" not in kept["data"] and "out" not in kept
    assert kept["train"]["seed"] == 1337 and kept["optim"]["lr"] == cfg.optim.lr and kept["batch"]["micro_tokens"]
    longer = PretrainConfig()
    longer.train.max_steps, longer.data.dir, longer.out = 99, "elsewhere", "runs/x"
    assert config_hash(resume_config(longer)) == config_hash(kept)
    other_lr = PretrainConfig()
    other_lr.optim.lr = 1e-3
    assert config_hash(resume_config(other_lr)) != config_hash(kept)


# ---- 2 processes: DDP and FSDP2 against 1 ----------------------------------------------------------------
def run_worker(out: Path, accelerate_config: str | None = None):
    launch = ([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(ROOT / "configs" / "accelerate" / accelerate_config), "--main_process_port", str(free_port())]
              if accelerate_config else [sys.executable])
    proc = run_group([*launch, str(ROOT / "tests" / "protocol_worker.py"), str(out)], timeout=300, cwd=ROOT,
                     env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Each rank prints its CHECK line; two ranks' lines can reach the pipe run together, so
    # every JSON object is read from right after its own "CHECK " rather than line by line.
    decoder = json.JSONDecoder()
    checks = [decoder.raw_decode(proc.stdout, m.end())[0] for m in re.finditer(r"CHECK ", proc.stdout)]
    records = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    return checks, records, proc.stdout


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    return run_worker(tmp_path_factory.mktemp("one") / "run")


@pytest.mark.slow
@pytest.mark.parametrize("config, sharded", [("cpu_ddp.yaml", False), ("cpu_fsdp.yaml", True)])
def test_frozen_reference_and_metric_counts_match_one_process(one_process, tmp_path, config, sharded):
    """Rank 0 holds 4 rows, rank 1 holds 2: the loss, the per-token KL and the per-row metrics
    equal the 1-process run's; the frozen reference is never trained, never saved."""
    checks, records, stdout = run_worker(tmp_path / "run", config)
    one_checks, one_records, _ = one_process
    assert ("FSDP: parameters sharded" in stdout) == sharded
    assert sorted(c["rank"] for c in checks) == [0, 1]
    for c in checks + one_checks:
        assert c["frozen_unchanged"] and c["no_grad"] and c["eval_mode"] and c["not_in_optimizer"], c
        assert c["group_lrs"] == [0.01, 0.01, 0.02]  # lm_head at twice the lr (param_groups)
    assert [c["frozen_sharded"] for c in checks] == [sharded] * 2 and not one_checks[0]["frozen_sharded"]
    assert [r["step"] for r in records] == [r["step"] for r in one_records] == [1, 2, 3, 4, 5, 6]
    for r, one in zip(records, one_records):
        n = int(global_rows(r["step"] - 1)["loss_mask"].sum())
        assert r["targets"] == one["targets"] == n and r["length"] == one["length"] == pytest.approx(n / ROWS)
        for key in ("loss", "kl", "reward", "grad_norm"):
            assert r[key] == pytest.approx(one[key], abs=1e-5, rel=1e-5), key
    # the checkpoint holds the policy alone: its weights, its optimizer state
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000006"
    saved = load_file(ckpt / "model.safetensors")
    policy = Transformer(MODEL).state_dict()
    assert sorted(saved) == sorted(policy)
    assert len(load_train_state(ckpt)["optimizer"]["state"]) == len(list(Transformer(MODEL).parameters()))
    torch.manual_seed(1)
    ref = Transformer(MODEL).state_dict()  # the reference the worker built
    assert not any(torch.equal(saved[k], ref[k]) for k in saved if saved[k].ndim == 2)
    assert math.isfinite(records[-1]["loss"])
