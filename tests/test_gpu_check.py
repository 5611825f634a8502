"""benchmarks/gpu_check.py is the one short check to run when a GPU is at hand: its CPU dry
run (--tiny, its one-process runs in the test's own process) must keep working, so a GPU run
never fails on the script itself, its GPU-size command lines must be ones the trainers take
(read dry, without a GPU), and a stage that fails or logs a non-finite loss must fail the
check by name."""

import dataclasses
import json
import math
import os
import re
import shlex
import sys
import time
import types
from pathlib import Path

import pytest
import torch
import yaml
from dry_run import check_batches, dry_run
from proc import run_group, run_here
from sprout.model.transformer import Transformer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check  # noqa: E402

TRAINERS = ("base", "sft", "reward", "dpo", "dpo_precomputed", "ppo", "grpo",
            "smollm2_base", "smollm2_sft", "smollm2_reward", "smollm2_dpo", "smollm2_ppo", "smollm2_grpo")


def in_this_process(check: gpu_check.Check, cmd: list[str], log: Path, deadline: float) -> int:
    """`Check.execute` for the dry run here: a one-process run in the test's own process
    (tests/proc.py `run_here`: no interpreter to start and no torch to import for each of the
    check's runs), an `accelerate launch` in processes of its own, as the check runs it; each
    until `deadline` (time.monotonic()) at the latest. The log holds the run's stdout, then its
    stderr."""
    timeout = deadline - time.monotonic()
    if timeout <= 0:
        pytest.fail(f"the dry run's deadline passed before {shlex.join(cmd)}")
    if "accelerate.commands.launch" in cmd:
        got = run_group(cmd, timeout=timeout, cwd=ROOT, env=check.env)
    else:
        got = run_here(cmd, cwd=ROOT, env=check.env, timeout=timeout)
    log.write_text(got.stdout + got.stderr)
    return got.returncode


@pytest.mark.slow
def test_gpu_check_dry_run_on_cpu(tmp_path, monkeypatch, capsys):
    """The whole check with --tiny, as `python benchmarks/gpu_check.py --tiny` runs it, but for
    where its one-process runs run (`in_this_process`)."""
    deadline = time.monotonic() + 900  # the whole check, as one process of it was given
    monkeypatch.setattr(gpu_check.Check, "execute", lambda check, cmd, log: in_this_process(check, cmd, log, deadline))
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--tiny", "--steps", "2", "--trainer-steps", "2",
                                      "--out", str(tmp_path)])
    try:
        gpu_check.main()
    except SystemExit as exc:
        pytest.fail(f"{exc}\n{capsys.readouterr().out[-6000:]}")
    finally:
        torch._dynamo.reset()  # the compiled stage's graphs: a new interpreter would start without them
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["failed"] == {}
    assert set(gpu_check.STAGES) <= set(result)
    for name in ("eager", "compiled", "fsdp") + TRAINERS:
        assert result[name]["tokens_per_s"] > 0 and math.isfinite(result[name]["loss"]), name
    assert result["fsdp"]["sharded"] and result["fsdp"]["resume_max_abs_diff"] == 0.0
    for name in ("ppo", "grpo", "smollm2_ppo", "smollm2_grpo"):
        assert result[name]["generation_tokens_per_s"] > 0, name
    # the cached reference log-probs are the live reference's: the same DPO losses
    assert result["dpo_precomputed"]["loss"] == pytest.approx(result["dpo"]["loss"], abs=1e-4)
    assert "precomputed" in (tmp_path / "dpo_precomputed.log").read_text()
    assert result["evaluate"]["prompts"] == gpu_check.TINY.eval_prompts
    # every post-training run starts from the tokenizer the base run recorded
    base_meta = json.loads(next((tmp_path / "base" / "checkpoints").glob("step_*/meta.json")).read_text())
    assert base_meta["tokenizer"].startswith("sentencepiece:") and base_meta["model_config"]["vocab_size"] == 512
    # the smollm2-gpu chain is trained on a model with SmolLM2's grouped-query attention and tied embeddings
    for name in ("smollm2_base", "smollm2_grpo"):
        meta = json.loads(next((tmp_path / name / "checkpoints").glob("step_*/meta.json")).read_text())
        assert meta["model_config"]["n_kv_heads"] == 2 and meta["model_config"]["tie_embeddings"], name
        assert meta["tokenizer_fingerprint"] == base_meta["tokenizer_fingerprint"]  # the same tokenizer
    # each post-training run is its preset's config: the loss section and peak lr it has (never set here)
    for chain in gpu_check.CHAINS:
        for trainer in ("sft", "reward", "dpo", "ppo", "grpo"):
            preset = yaml.safe_load((ROOT / "configs" / chain.preset / f"{trainer}.yaml").read_text())
            run = yaml.safe_load((tmp_path / (chain.prefix + trainer) / "config.yaml").read_text())
            assert run["optim"]["lr"] == preset["optim"]["lr"], (chain.preset, trainer)
            if trainer == "grpo":
                assert run["grpo"]["max_generation_rounds"] == 2, chain.preset
            set_here = ("mask_truncated_completions", "num_ppo_epochs", "max_generation_rounds")
            assert all(run[trainer][k] == v for k, v in preset.get(trainer, {}).items()
                       if k not in set_here), (chain.preset, trainer)


def test_a_failed_command_names_its_stage(tmp_path):
    check = gpu_check.Check(tmp_path, dict(os.environ), {})
    check.stage("base", lambda: check.train("base", [sys.executable, "-c", "import sys; sys.exit(3)"]))
    assert "base" not in check.results
    assert check.failed["base"].startswith("base: exit status 3")
    check.stage("sft", lambda: {"wall_s": 0.0})  # starts from base: not run
    assert check.failed["sft"] == "sft: not run (base failed)" and "sft" not in check.results
    assert json.loads((tmp_path / "gpu_check.json").read_text())["failed"]["sft"] == "sft: not run (base failed)"
    # the figures so far are on disk after each stage, failures too: a check cut short keeps them
    check.stage("eager", lambda: {"wall_s": 1.5})
    assert json.loads((tmp_path / "gpu_check.json").read_text()) == {
        "failed": {"base": check.failed["base"], "sft": "sft: not run (base failed)"}, "eager": {"wall_s": 1.5}}


def test_a_non_finite_loss_fails_its_stage(tmp_path):
    records = [{"event": "start"}, {"step": 1, "loss": 0.7, "tokens_per_s": 10.0},
               {"step": 2, "loss": 0.6, "tokens_per_s": 12.0, "mfu": 0.3}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert gpu_check.train_figures("dpo", tmp_path) == {"tokens_per_s": 12.0, "mfu": 0.3, "loss": 0.6,
                                                        "generation_tokens_per_s": None}
    for bad in ({"step": 2, "val_loss": float("nan")}, {"step": 3, "loss/value": float("inf"), "tokens_per_s": 1.0}):
        (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records + [bad]))
        with pytest.raises(gpu_check.StageFailed, match=r"^dpo: (val_loss nan|loss/value inf)"):
            gpu_check.train_figures("dpo", tmp_path)
    (tmp_path / "metrics.jsonl").write_text(json.dumps(records[0]) + "\n")
    with pytest.raises(gpu_check.StageFailed, match="dpo: no training record"):
        gpu_check.train_figures("dpo", tmp_path)
    # PPO: a generation batch serves several optimizer steps; generation tokens/s is the last one measured
    ppo = [{"step": 1, "loss": 0.1, "tokens_per_s": 5.0, "generation/tokens_per_s": 700.0},
           {"step": 2, "loss": 0.2, "tokens_per_s": 6.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ppo))
    assert gpu_check.train_figures("ppo", tmp_path)["generation_tokens_per_s"] == 700.0


def test_stages_bring_the_runs_they_start_from(tmp_path, monkeypatch, capsys):
    assert gpu_check.with_needs(["smollm2_ppo"]) == ["smollm2_base", "smollm2_sft", "smollm2_reward", "smollm2_ppo"]
    assert gpu_check.with_needs(["evaluate", "compiled"]) == ["compiled", "base", "sft", "grpo", "evaluate"]
    with pytest.raises(ValueError, match="unknown stage.* gpro"):
        gpu_check.with_needs(["gpro"])
    with pytest.raises(ValueError, match="no stage named"):
        gpu_check.with_needs([])
    # the two commands the script's doc and help name cover every stage, each run once
    first, second = (gpu_check.with_needs(c.split(",")) for c in gpu_check.TWO_COMMANDS)
    assert sorted(first + second) == sorted(gpu_check.STAGES)
    assert all(c in gpu_check.__doc__.replace("\n", " ") for c in gpu_check.TWO_COMMANDS)
    for bad, said in ((",", "no stage named"), ("eager, gpro", "unknown stage.*gpro")):  # the command line's
        monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--tiny", "--out", str(tmp_path), "--stages", bad])
        with pytest.raises(SystemExit) as exit_:
            gpu_check.main()
        assert exit_.value.code == 2 and re.search(said, capsys.readouterr().err)
    check = gpu_check.Check(tmp_path, dict(os.environ), {}, ["eager"])
    check.stage("compiled", lambda: pytest.fail("not a stage of this check"))
    check.stage("eager", lambda: {"wall_s": 1.0})
    assert check.results == {"failed": {}, "eager": {"wall_s": 1.0}}


@pytest.mark.parametrize("size", ["GPU", "TINY"])
def test_each_command_of_the_check_is_read_by_its_script_and_fits_one_process(size, tmp_path, monkeypatch, capsys):
    """The post-training commands the check runs (its GPU sizes too, where there is no GPU),
    built with the inputs stubbed out and read by each script's own parser and config class."""
    sizes, commands = getattr(gpu_check, size), {}
    tok = types.SimpleNamespace(spec=f"sentencepiece:{tmp_path}/sp512.model", vocab_size=512)
    monkeypatch.setattr(gpu_check.inputs, "train_tokenizer", lambda folder: tok)
    for maker in ("text_shards", "sft_rows", "preference_pairs", "rl_prompts"):
        monkeypatch.setattr(gpu_check.inputs, maker, lambda path, *_args: Path(path))

    def keep(stage: str, cmd: list[str]) -> dict:
        commands[stage] = cmd
        return {"wall_s": 0.0}

    monkeypatch.setattr(gpu_check.Check, "train", lambda _self, stage, cmd: keep(stage, cmd))

    def evaluate(stage: str, cmd: list[str]) -> float:
        keep(stage, cmd)
        raise gpu_check.StageFailed("evaluate: not run")

    monkeypatch.setattr(gpu_check.Check, "run", lambda _self, stage, cmd, _log=None: evaluate(stage, cmd))
    check = gpu_check.Check(tmp_path, {}, {})
    gpu_check.post_training(check, sizes, sizes.trainer_steps, ["--train.progress", "false"])
    assert set(commands) == set(gpu_check.STAGES) - {"eager", "compiled", "fsdp", "decode", "trl_compare"}
    assert check.failed == {"evaluate": "evaluate: not run"}
    for chain in gpu_check.CHAINS:
        runs = [chain.prefix + run for run in ("base", "sft", "reward", "dpo", "dpo_precomputed", "ppo", "grpo")
                if chain.prefix + run in commands]
        read = {name: dry_run(ROOT / commands[name][1], commands[name][2:] + ["--out", str(tmp_path / name)],
                              monkeypatch, capsys) for name in runs}
        base = read[chain.prefix + "base"]
        context = base.model.max_seq_len
        for name, cfg in read.items():
            check_batches(Path(commands[name][1]).name, cfg, 1, context, row_len=sizes.seq)
        rollouts = [read[chain.prefix + rl].rollout.compile for rl in ("ppo", "grpo")]
        assert rollouts == [sizes.compile_rollouts and chain.compile_rollouts] * 2
        if size == "GPU":  # the preset's own batch on one GPU
            preset = yaml.safe_load((ROOT / "configs" / chain.preset / "grpo.yaml").read_text())
            assert read[chain.prefix + "grpo"].batch.global_prompts == preset["batch"]["global_prompts"]
    if size == "GPU":  # the smollm2 chain's base is SmolLM2-135M's shape: its parameter count with its vocabulary
        base = dry_run(ROOT / "scripts" / "pretrain.py", commands["smollm2_base"][2:], monkeypatch, capsys)
        with torch.device("meta"):
            model = Transformer(dataclasses.replace(base.model, vocab_size=49152))
        assert sum(p.numel() for p in model.parameters()) == 134_515_008 and base.model.max_seq_len == 2048
