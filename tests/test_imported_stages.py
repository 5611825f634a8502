"""Every post-training stage on an imported model: the mirror's SmolLM2-135M-Instruct (GGUF,
imported once per test session by the `smollm2` fixture), its own byte-level BPE tokenizer and
ChatML format.

Each trainer (SFT, reward model, DPO, PPO, GRPO) runs 2 steps of tiny batches through its
script with the imported run folder as --init and no other flag about the model (PPO's reward
model is the reward case's run; SFT answers one sample prompt, in its report); the loss is finite, the run resumed from its step-1
checkpoint repeats step 2 exactly, and the result exports to a transformers folder that
`verify_export` checks (logits or scores within 1e-4,
tokenizer and chat-template ids, greedy chat answers). Data prepared with another tokenizer
is refused in one line. Evaluate, chat and sample run on the imported folder itself. All slow:
a 135M-parameter model on a CPU."""

import json
import math
import os
import shutil
import sys
from pathlib import Path

import pytest

from grpo_fixtures import write_prompt_files
from preference_train_fixtures import write_pairs
from proc import run_here
from sft_fixtures import write_sources
from sprout.checkpoint import checkpoint_tokenizer, read_meta
from sprout.engine.metrics import read_metrics
from sprout.model.export import export_hf, verify_export

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
CONFIGS = ROOT / "configs" / "demo"
ALPACA = "sft/alpaca/alpaca_5000.json"
COMMON = ["--train.max_steps", "2", "--train.ckpt_every", "1", "--train.eval_every", "0", "--train.log_every", "1",
          "--train.progress", "false", "--train.keep_checkpoints", "2", "--train.peak_tflops", "-1", "--optim.warmup_steps", "0"]
PAIRS = ["--batch.global_pairs", "2", "--batch.micro_pairs", "1", "--optim.lr", "1e-5"]
ROLLOUTS = ["--data.eval_prompts", "2", "--data.eval_batch", "2", "--batch.global_prompts", "1",
            "--batch.num_generations", "2", "--batch.micro_completions", "1", "--rollout.max_completion_length",
            "8", "--optim.lr", "1e-6"]
STAGES = {  # script, demo config, flags (DATA, REWARD: filled in by `chain`)
    "sft": ("train_sft.py", "sft.yaml", ["--data.path", "SFT", "--batch.global_tokens", "256",
                                         "--batch.micro_tokens", "128", "--optim.lr", "1e-5",
                                         "--sample_prompts", '["What is 12 plus 7?"]']),
    "reward": ("train_reward.py", "reward.yaml", ["--data", "PAIRS", *PAIRS]),
    "dpo": ("train_dpo.py", "dpo.yaml", ["--data", "PAIRS", *PAIRS]),
    "ppo": ("train_ppo.py", "ppo.yaml", ["--data.path", "PROMPTS", "--reward_model", "REWARD", *ROLLOUTS,
                                         "--batch.num_mini_batches", "1", "--ppo.num_ppo_epochs", "1"]),
    "grpo": ("train_grpo.py", "grpo.yaml", ["--data.path", "PROMPTS", *ROLLOUTS, "--data.sources", "null",
                                            "--data.eval_num_generations", "2", "--grpo.num_iterations", "1"]),
}


def script(name: str, *args, timeout: float = 900):
    """The script run in this process (tests/proc.py `run_here`): each run here would otherwise
    spend seconds importing torch and the tokenizer again."""
    return run_here([sys.executable, str(SCRIPTS / name), *map(str, args)], cwd=ROOT, timeout=timeout)


def losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r}


@pytest.fixture(scope="module")
def data(smollm2, mirror, tmp_path_factory) -> dict:
    """SFT rows of the mirror's Alpaca tokenized with the imported tokenizer, preference pairs
    and RL prompts (text)."""
    _, run = smollm2
    root = tmp_path_factory.mktemp("imported-data")
    spec = read_meta(run)["tokenizer"]
    got = script("prepare_sft_data.py", "--config", CONFIGS / "sft_data.yaml", "--tokenizer", spec,
                 "--out", root / "sft" / "sft.h5", "--seq-len", 128, "--val-fraction", 0.25, "--max-examples", 24,
                 "--format", "alpaca", "--source", mirror / ALPACA)
    assert got.returncode == 0, got.stderr
    return {"SFT": root / "sft" / "sft.h5", "PAIRS": write_pairs(root / "prefs", n_train=4, n_test=2),
            "PROMPTS": write_prompt_files(root / "prompts", n_train=4, n_test=2), "root": root}


def train(stage: str, init: Path, data: dict, out: Path, reward: Path | None = None):
    """Run `stage` for 2 steps from `init` into `out` (a checkpoint at each step, both kept)."""
    file, config, flags = STAGES[stage]
    fill = {**data, "REWARD": reward}
    flags = [str(fill.get(f, f)) for f in flags]
    got = script(file, "--config", CONFIGS / config, "--init", init, *flags, *COMMON, "--out", out)
    assert got.returncode == 0, f"{stage}: {got.stderr[-3000:]}"
    return out


@pytest.fixture(scope="module")
def reward_run(smollm2, data, tmp_path_factory):
    """The reward stage's run (PPO's reward model, and the reward case itself); removed after the
    module: each 135M-parameter checkpoint with its optimizer state is 1.6 GB."""
    root = tmp_path_factory.mktemp("imported-reward")
    yield train("reward", smollm2[1], data, root / "reward")
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("stage", list(STAGES))
def test_stage_runs_from_the_imported_model_resumes_exactly_and_exports(stage, smollm2, data, reward_run, tmp_path):
    """One stage from the import: 2 steps; a run resumed from its step-1 checkpoint repeats step 2's
    loss exactly; the result exports to transformers and verifies. Disk: what a case writes is
    removed as soon as it is checked (and its tmp_path once it passes), so the module never holds
    more than the reward run and one case (about 9 GB)."""
    out = reward_run if stage == "reward" else train(stage, smollm2[1], data, tmp_path / stage, reward=reward_run)
    first = losses(out)
    assert sorted(first) == [1, 2] and all(math.isfinite(v) for v in first.values())
    meta = read_meta(out / "checkpoints" / "step_00000002")
    assert meta["template_version"] == read_meta(smollm2[1])["template_version"]
    assert checkpoint_tokenizer(meta).spec.startswith("hf:")
    if stage == "sft":  # the answer to its sample prompt, generated in the import's chat format
        samples = [r for r in read_metrics(out / "metrics.jsonl") if r.get("event") == "samples"]
        assert [s["prompt"] for s in samples[-1]["samples"]] == ["What is 12 plus 7?"]
        assert samples[-1]["samples"][0]["answer"].strip()

    again = tmp_path / "again"  # the run as it was at step 1 (the checkpoint hard-linked: no copy on disk)
    (again / "checkpoints").mkdir(parents=True)
    shutil.copytree(out / "checkpoints" / "step_00000001", again / "checkpoints" / "step_00000001",
                    copy_function=os.link)
    (again / "checkpoints" / "latest").write_text("step_00000001\n")
    shutil.copy(out / "config.yaml", again / "config.yaml")
    quiet = ["--sample_prompts", "[]"] if stage == "sft" else []  # the answers: the run's report has them
    got = script(STAGES[stage][0], "--out", again, "--resume", *quiet)
    assert got.returncode == 0, got.stderr[-3000:]
    assert losses(again) == {2: first[2]}  # exact: the resumed step repeats the uninterrupted one
    shutil.rmtree(again)

    result, model, tok = export_hf(out, tmp_path / "export")
    check = verify_export(result.out, model, tok)
    assert check["max_abs_diff"] <= 1e-4 or check["max_abs_diff_fp64"] <= 1e-4
    assert check["answers"] == (0 if stage == "reward" else check["chats"])
    assert result.hf_class == ("LlamaForSequenceClassification" if stage == "reward" else "LlamaForCausalLM")


def test_data_from_another_tokenizer_is_refused_in_one_line(smollm2, data, tmp_path):
    _, run = smollm2
    sources = write_sources(tmp_path / "sources")
    got = script("prepare_sft_data.py", "--config", CONFIGS / "sft_data.yaml", "--tokenizer", "tiktoken:r50k_base",
                 "--out", tmp_path / "r50k" / "sft.h5", "--seq-len", 128, "--val-fraction", 0.3,
                 "--format", "alpaca", "--source", sources["alpaca"])
    assert got.returncode == 0, got.stderr
    got = script("train_sft.py", "--config", CONFIGS / "sft.yaml", "--init", run, "--data.path",
                 tmp_path / "r50k" / "sft.h5", *COMMON, "--out", tmp_path / "out")
    assert got.returncode == 2
    lines = got.stderr.strip().splitlines()
    assert len(lines) == 1 and "sft.h5: SFT data was tokenized with tiktoken:r50k_base" in lines[0], got.stderr
    assert "was trained with hf:" in lines[0], got.stderr  # the base's own tokenizer, named beside the data's
    assert not (tmp_path / "out" / "checkpoints").exists()


def test_evaluate_chat_and_sample_run_on_the_imported_folder(smollm2, data, tmp_path):
    _, run = smollm2
    got = script("chat.py", run, "--prompt", "What is the capital of France?", "--temperature", 0,
                 "--max-new-tokens", 16)
    assert got.returncode == 0 and "Paris" in got.stdout, got.stderr
    got = script("sample.py", run, "--prompt", "The capital of France is", "--temperature", 0,
                 "--max-new-tokens", 8)
    assert got.returncode == 0 and "Paris" in got.stdout, got.stderr
    got = script("evaluate.py", run, "--prompts", data["PROMPTS"].with_name("prompts_test.jsonl"), "--n", 0,
                 "--greedy", "--max-new-tokens", 16, "--out", tmp_path / "eval.json")
    assert got.returncode == 0, got.stderr
    figures = json.loads((tmp_path / "eval.json").read_text())
    assert figures["metrics"]["prompts"] == 2 and figures["checkpoint"]["stage"] == "import"
    assert figures["settings"]["tokenizer"] == checkpoint_tokenizer(read_meta(run)).spec
