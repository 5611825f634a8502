"""The pipeline presets in configs/pipelines/, dry: nothing is prepared or trained.

Every stage's command line is built as the runner builds it (`command_args`) and handed to
its own script's `main` with its work replaced (`dry_run.dry_run`). So each config file is
read by the stage's real parser and config dataclass, with the preset's flags and
`--section.field` overrides on top: an unknown key, a value of the wrong type or out of its
range fails here in the one line the stage itself would print at its start. Then the sizes
must fit the preset's machine (`dry_run.check_batches`): every global batch divides over its
process count (the accelerate config's num_processes) and over one process, SFT rows fill
whole micro-batches, and prompt plus completion fit the model's context; the prep configs'
sources pass the preps' own checks and the RL stages' data.sources are sources the prompt
prep writes. Nothing is run but the scripts' argument parsing and config loading.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from dry_run import check_batches, dry_run
from sprout.errors import SproutError
from sprout.pipeline.preset import Preset, Stage, command_args, load_preset
from sprout.prep.chat_sources import from_dict_source
from sprout.prep.preference_data import check_config as check_pair_sources
from sprout.prep.pretrain import resolve_sources
from sprout.prep.rl_prompts import check_config as check_prompt_sources

ROOT = Path(__file__).resolve().parents[1]
PRESETS = sorted(p.stem for p in (ROOT / "configs" / "pipelines").glob("*.yaml"))
GPU_PRESETS = ("gpt2-small", "smollm2-gpu")


def processes(preset: Preset) -> int:
    """How many processes a train or eval stage runs on: the accelerate config's, else 1."""
    if preset.launcher != "accelerate":
        return 1
    return int(yaml.safe_load(preset.accelerate_config.read_text())["num_processes"])


def context(preset: Preset, configs: dict) -> int:
    """The model's context: the pretraining config's max_seq_len, or the import's --max-seq-len."""
    if "pretrain" in configs:
        return configs["pretrain"].model.max_seq_len
    args = command_args(preset, preset.stage("import"))[0]
    return int(args[args.index("--max-seq-len") + 1])


def upstream(preset: Preset, stage: Stage, script: str) -> str:
    """The name of the input of `stage` that `script` makes."""
    return next(n for n in stage.inputs if preset.stage(n).script.name == script)


def dry_configs(name: str, out: Path, monkeypatch, capsys) -> tuple[Preset, dict]:
    """The preset and {stage name: its config} of every stage that reads one, each stage's
    script and config file checked to exist."""
    preset = load_preset(ROOT / "configs" / "pipelines" / f"{name}.yaml", out=out)
    configs = {}
    for stage in preset.stages:
        assert stage.script.is_file(), f"{name}: stage {stage.name}: no {stage.script}"
        assert stage.config is None or stage.config.is_file(), f"{name}: stage {stage.name}: no {stage.config}"
        if stage.config is not None:
            [args] = command_args(preset, stage)
            configs[stage.name] = dry_run(stage.script, args, monkeypatch, capsys)
    return preset, configs


def check_sizes(preset: Preset, configs: dict) -> None:
    """Each config's sizes on the preset's process count and on one process (module doc); the
    checks that raise SproutError are the stages' own."""
    ctx = context(preset, configs)
    for stage in preset.stages:
        where = f"{preset.path.stem}: stage {stage.name}"
        try:
            check_stage_sizes(preset, stage, configs, ctx, where)
        except (SproutError, AssertionError) as exc:
            pytest.fail(f"{where}: {exc}")


def check_stage_sizes(preset: Preset, stage: Stage, configs: dict, ctx: int, where: str) -> None:
    """The size checks of one stage (`check_sizes`)."""
    cfg, script = configs.get(stage.name), stage.script.name
    if script == "prepare_pretrain_data.py":
        resolve_sources(cfg, None)
    elif script == "prepare_sft_data.py":
        for i, source in enumerate(cfg.sources):
            from_dict_source(source, i)
    elif script == "prepare_preference_data.py":
        check_pair_sources(cfg)
    elif script == "prepare_rl_prompts.py":
        check_prompt_sources(cfg)
    elif script in ("train_ppo.py", "train_grpo.py"):
        made = {s["name"] for s in configs[upstream(preset, stage, "prepare_rl_prompts.py")].sources}
        assert set(cfg.data.sources or made) <= made, f"{where}: data.sources {cfg.data.sources}"
    row_len = configs[upstream(preset, stage, "prepare_sft_data.py")].seq_len if script == "train_sft.py" else None
    for world in sorted({1, processes(preset)}):
        check_batches(script, cfg, world, ctx, row_len)


# ---- the presets ---------------------------------------------------------------------------------
def test_presets_in_the_repository_load_and_chain_their_stages():
    for name in ("demo", "gpt2-small"):
        preset = load_preset(ROOT / "configs" / "pipelines" / f"{name}.yaml")
        names = [s.name for s in preset.stages]
        assert names.index("pretrain") < names.index("sft") < names.index("dpo") < names.index("ppo") \
            < names.index("grpo")  # the default chain SFT -> DPO -> PPO -> GRPO
        assert preset.stage("reward").inputs[0] == "sft" and preset.stage("dpo").inputs[0] == "sft"
        assert {"dpo", "reward"} <= set(preset.stage("ppo").inputs)
        assert preset.stage("grpo").inputs[0] == "ppo"  # GRPO loads the PPO policy's LM
    for name in ("smollm2", "smollm2-gpu", "smollm2-lora"):
        smol = load_preset(ROOT / "configs" / "pipelines" / f"{name}.yaml")
        names = [s.name for s in smol.stages]
        assert names[:2] == ["import", "eval_import"] and names[-1] == "export"
        assert names.index("sft") < names.index("dpo") < names.index("ppo") < names.index("grpo")
        assert all(smol.stage(n).inputs[0] == "import" for n in ("sft_data", "sft"))
        assert smol.model.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    for name in GPU_PRESETS:  # trainers and evaluations under accelerate launch, every stage its own config
        gpu = load_preset(ROOT / "configs" / "pipelines" / f"{name}.yaml")
        assert gpu.launcher == "accelerate" and gpu.accelerate_config.is_file()
        assert all(s.config.parent.name == name for s in gpu.stages if s.kind == "train")
    lora = load_preset(ROOT / "configs" / "pipelines" / "smollm2-lora.yaml")  # every trainer with adapters
    assert all(s.commands[0][s.commands[0].index("--lora.r") + 1] == "16" for s in lora.stages if s.kind == "train")
    demo, gpt2 = (load_preset(ROOT / "configs" / "pipelines" / f"{n}.yaml") for n in ("demo", "gpt2-small"))
    checks = {s.name for s in demo.stages if s.script.stem in ("verify_shards", "check_loss_mask")}
    assert checks <= {s.name for s in gpt2.stages}  # the demo's audits of the data, every one


def test_the_lora_preset_is_the_smollm2_chain_with_adapters_at_ten_times_its_rates_but_grpos_chosen_on_dev():
    """smollm2-lora differs from smollm2 only in its output root and in each trainer's command
    ending with r 16, alpha 32 adapters and a learning rate 10x the one its config gives, but
    GRPO's, the LoRA sweep's choice on dev (docs/results/2026-12-06-smollm2-grpo-lora-vs-full-dev.md),
    which is only held to be above full fine-tuning's, for the 40 steps it was chosen at."""
    import dataclasses

    full, lora = (load_preset(ROOT / "configs" / "pipelines" / f"{n}.yaml") for n in ("smollm2", "smollm2-lora"))
    assert (full.out.name, lora.out.name) == ("smollm2", "smollm2-lora") and len(full.stages) == len(lora.stages)
    for a, b in zip(full.stages, lora.stages):
        assert dataclasses.replace(a, commands=[]) == dataclasses.replace(b, commands=[])
        if a.kind != "train":
            assert a.commands == b.commands, a.name
            continue
        assert len(a.commands) == len(b.commands) == 1 and b.commands[0][:len(a.commands[0])] == a.commands[0]
        added = b.commands[0][len(a.commands[0]):]
        if a.name == "grpo":  # the step count its rate was chosen at
            assert added[-2:] == ["--train.max_steps", "40"]
            added = added[:-2]
        *added, lr = added
        assert added == ["--lora.r", "16", "--lora.alpha", "32", "--optim.lr"], a.name
        full_lr = yaml.safe_load(a.config.read_text())["optim"]["lr"]
        if a.name == "grpo":
            assert float(lr) > full_lr, a.name
        else:
            assert float(lr) == pytest.approx(10 * full_lr), a.name


@pytest.mark.parametrize("name", PRESETS)
def test_every_stage_of_a_preset_reads_its_config_dry_and_its_sizes_fit(name, tmp_path, monkeypatch, capsys):
    preset, configs = dry_configs(name, tmp_path / "runs", monkeypatch, capsys)
    check_sizes(preset, configs)
    trained = {s.name for s in preset.stages if s.kind == "train"}
    assert trained <= set(configs)  # every trainer reads a config
    for stage in (s for s in preset.stages if s.kind == "train"):  # its inputs come from the flags, not the YAML
        assert Path(configs[stage.name].out) == tmp_path / "runs" / stage.out
    if name in GPU_PRESETS:
        assert processes(preset) == 8
        for stage in trained:
            cfg = configs[stage]
            assert cfg.train.mixed_precision == "auto" and not cfg.train.progress  # bf16 on the GPUs
        assert configs["grpo"].rollout.compile and configs["ppo"].rollout.compile


def test_a_dry_run_fails_on_an_unknown_key_or_a_bad_value(tmp_path, monkeypatch, capsys):
    good = yaml.safe_load((ROOT / "configs" / "gpt2-small" / "reward.yaml").read_text())
    args = ["--init", "runs/sft", "--data", "prefs/preferences.jsonl", "--out", str(tmp_path / "reward")]
    script = ROOT / "scripts" / "train_reward.py"
    for change, message in (({"batch": {**good["batch"], "micro_pair": 8}}, "unknown key(s) batch.micro_pair"),
                            ({"optim": {**good["optim"], "lr": -1.0}}, "optim.lr: got -1.0"),
                            ({"train": {**good["train"], "mixed_precision": "fp16"}}, "train.mixed_precision")):
        path = tmp_path / "reward.yaml"
        path.write_text(yaml.safe_dump({**good, **change}))
        with pytest.raises(AssertionError, match=message.replace("(", r"\(").replace(")", r"\)")):
            dry_run(script, ["--config", str(path), *args], monkeypatch, capsys)
    assert dry_run(script, ["--config", str(ROOT / "configs" / "gpt2-small" / "reward.yaml"), *args],
                   monkeypatch, capsys).batch.global_pairs == 64


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_runs_per_seed_from_grpo_on_with_its_own_seed_stages_or_the_command_lines(name):
    path = ROOT / "configs" / "pipelines" / f"{name}.yaml"
    plain = load_preset(path)  # its own setting: seed_stages [grpo], no seeds -> one run of every stage
    assert all(s.seed is None for s in plain.stages)
    tail, names = set(), []  # grpo and every stage reading it, directly or not, run once per seed
    for stage in plain.stages:
        if stage.name == "grpo" or set(stage.inputs) & tail:
            tail.add(stage.name)
        names += [f"{stage.name}_seed{n}" for n in (1, 2)] if stage.name in tail else [stage.name]
    assert {"grpo", "eval_grpo"} <= tail and ("export" in tail) == (name.startswith("smollm2"))
    for seeded in (load_preset(path, seeds=[1, 2]), load_preset(path, seeds=[1, 2], seed_stages=["grpo"])):
        assert [s.name for s in seeded.stages] == names
        for stage in seeded.stages:
            args = command_args(seeded, stage)  # every placeholder names a stage of the seeded preset
            if stage.seed_of is None:
                assert stage == plain.stage(stage.name)
                continue
            one = plain.stage(stage.seed_of)
            out = Path(one.out)  # eval/grpo -> eval/grpo_seed1, a file's name before its suffix
            assert stage.out == str(out.with_name(f"{out.stem}_seed{stage.seed}{out.suffix}"))
            assert stage.inputs == [f"{n}_seed{stage.seed}" if n in tail else n for n in one.inputs]
            assert (args[0][-4:-2] == ["--train.seed", str(stage.seed)]) == (stage.kind == "train")
