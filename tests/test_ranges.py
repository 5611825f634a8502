"""Valid ranges of numeric config fields: declared once beside the field (`sprout.ranges.in_range`),
refused at load in one line naming the field, shown in --help; every numeric field of every
script's config has one, and its default lies inside it."""

import dataclasses
import math
import subprocess
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from sprout.config import load_config
from sprout.config_help import config_help
from sprout.errors import SproutError
from sprout.ranges import Interval, field_range, in_range

ROOT = Path(__file__).resolve().parents[1]


def test_intervals_parse_print_and_hold_what_they_say():
    half_open = Interval.parse("[0, 1)")
    assert str(half_open) == "[0, 1)" and 0 in half_open and 0.999 in half_open and 1 not in half_open
    assert -1e-9 not in half_open
    assert str(Interval.parse("(0, inf)")) == "(0, inf)" and 1e300 in Interval.parse("(0, inf)")
    assert 0 not in Interval.parse("(0, inf)") and math.inf not in Interval.parse("(0, inf)")
    assert str(Interval.parse("[0, 0.5]")) == "[0, 0.5]" and 0.5 in Interval.parse("[0, 0.5]")
    assert str(Interval.parse("[-inf, inf]")) == "(-inf, inf)"  # an infinite bound is never included
    for bad in ("0, 1", "[1, 0]", "[0; 1)", "[a, 1]", "[nan, 1]"):
        with pytest.raises(ValueError):
            Interval.parse(bad)


@dataclass
class Section:
    rate: float = in_range(0.5, "[0, 1)")                   # a share
    steps: int | Literal["auto"] | None = in_range(None, "[1, inf)")  # how many
    top_p: float | None = in_range(None, "(0, 1]")          # nucleus
    name: str = "x"


@dataclass
class Top:
    section: Section = field(default_factory=Section)


@pytest.mark.parametrize("args, message", [
    (["--section.rate", "1"], "command line: --section.rate: got 1; expected a number in [0, 1)"),
    (["--section.rate", "-0.1"], "command line: --section.rate: got -0.1; expected a number in [0, 1)"),
    (["--section.steps", "0"], "command line: --section.steps: got 0; expected an integer in [1, inf), auto or null"),
    (["--section.top_p", "0"], "command line: --section.top_p: got 0; expected a number in (0, 1] or null"),
])
def test_a_number_outside_its_range_is_refused_naming_the_field(args, message):
    with pytest.raises(SproutError) as exc:
        load_config(Top, None, args)
    assert str(exc.value) == message


def test_values_inside_the_range_and_the_non_numbers_pass(tmp_path):
    cfg = load_config(Top, None, ["--section.rate", "0", "--section.steps", "auto", "--section.top_p", "null"])
    assert cfg.section == Section(rate=0.0, steps="auto", top_p=None)
    path = tmp_path / "c.yaml"
    path.write_text("section:\n  top_p: 1.5\n")
    with pytest.raises(SproutError, match=rf"^{path}: section\.top_p: got 1\.5; expected a number in \(0, 1\] or null$"):
        load_config(Top, path)


def test_help_shows_each_range_after_its_type():
    text = config_help(Top)
    assert "--section.rate" in text and "float in [0, 1) = 0.5" in text
    assert "int in [1, inf) | {auto} | null = null" in text
    assert "float in (0, 1] | null = null" in text
    assert "--section.name" in text and "str = x" in text


# ---- every numeric field of every script's config -----------------------------------------------
def script_configs() -> list[type]:
    from sprout.prep.chat_sources import SourceConfig
    from sprout.prep.preference_data import PreferenceDataConfig, PreferenceSourceConfig
    from sprout.prep.pretrain import PrepConfig
    from sprout.prep.rl_prompts import PromptDataConfig, PromptSourceConfig
    from sprout.prep.sft_data import SFTDataConfig
    from sprout.prep.sources import SourceSpec
    from sprout.prep.tokenizer_train import TokenizerTrainConfig
    from sprout.stages.configs import DPOConfig, GRPOConfig, PPOConfig, PretrainConfig, RewardConfig, SFTConfig

    return [PretrainConfig, SFTConfig, DPOConfig, RewardConfig, GRPOConfig, PPOConfig, PrepConfig, SourceSpec,
            TokenizerTrainConfig, SFTDataConfig, SourceConfig, PreferenceDataConfig, PreferenceSourceConfig,
            PromptDataConfig, PromptSourceConfig]


def numeric_fields(cls: type, prefix: str = "", default=None):
    """(dotted name, field, default value) of every int / float field of `cls` and its sections."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        members = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, type(int | None)) else (tp,)
        value = getattr(default, f.name) if default is not None else (
            f.default if f.default is not dataclasses.MISSING else
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        section = next((m for m in members if dataclasses.is_dataclass(m)), None)
        if section is not None:
            yield from numeric_fields(section, f"{prefix}{f.name}.", value)
        elif int in members or float in members:
            yield prefix + f.name, f, value


@pytest.mark.parametrize("cls", script_configs(), ids=lambda c: c.__name__)
def test_every_numeric_field_has_a_range_holding_its_default(cls):
    rows = list(numeric_fields(cls))
    assert rows
    missing = [name for name, f, _ in rows if field_range(f) is None]
    assert not missing, f"{cls.__name__}: no range for {missing}"
    outside = [(name, value) for name, f, value in rows
               if isinstance(value, (int, float)) and value not in field_range(f)]
    assert not outside, f"{cls.__name__}: defaults outside their range: {outside}"


# ---- through the scripts ------------------------------------------------------------------------
@pytest.mark.parametrize("script, args, message", [
    ("train_dpo", ["--dpo.label_smoothing", "0.7"],
     "command line: --dpo.label_smoothing: got 0.7; expected a number in [0, 0.5]"),
    ("train_grpo", ["--grpo.epsilon", "1.5"], "command line: --grpo.epsilon: got 1.5; expected a number in (0, 1)"),
    ("prepare_rl_prompts", ["--test-fraction", "1.5"],
     "command line: --test_fraction: got 1.5; expected a number in [0, 1)"),
])
def test_scripts_refuse_an_out_of_range_value_before_writing(tmp_path, script, args, message):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / f"{script}.py"), "--out", str(out), *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 2 and proc.stderr == f"error: {message}\n", proc.stderr
    assert not out.exists()


@pytest.mark.parametrize("stage", ["pretrain", "sft", "reward", "dpo", "ppo", "grpo"])
def test_a_config_built_in_python_is_range_checked_before_its_run_starts(stage, tmp_path):
    """The run_* functions check what `from_dict` would have: a dataclass built in Python skips it."""
    import importlib

    module = importlib.import_module(f"sprout.stages.{stage}")
    cls = next(c for c in script_configs() if getattr(c, "stage_name", None) == stage)
    cfg = cls()
    cfg.optim = dataclasses.replace(cfg.optim, beta2=1.5)  # built directly: no check at construction
    cfg.out = str(tmp_path / "out")
    with pytest.raises(SproutError, match=r"^config: optim\.beta2: got 1\.5; expected a number in \[0, 1\)$"):
        getattr(module, f"run_{stage}")(cfg)
    assert not (tmp_path / "out").exists()
