from dataclasses import dataclass, field
from typing import Literal

import pytest

from sprout.config import FieldError, config_to_dict, load_config, missing_fields, parse_overrides, require
from sprout.config_help import config_help
from sprout.errors import SproutError


@dataclass
class Inner:
    lr: float = 1e-3
    steps: int | None = None

    def __post_init__(self):
        if self.lr <= 0:
            raise ValueError(f"lr must be positive, got {self.lr}")


@dataclass
class Outer:
    train: Inner = field(default_factory=Inner)
    name: str = "run"


def test_dotted_overrides_parse_yaml_scalars():
    assert parse_overrides(["--train.lr", "3e-4", "--train.steps=50", "--train.tags", "[a, b]"]) == {
        "train": {"lr": "3e-4", "steps": 50, "tags": ["a", "b"]}}
    with pytest.raises(SproutError, match="command line: unrecognised argument 'name'"):
        parse_overrides(["name", "x"])


@dataclass
class Switches:
    precision: Literal["auto", "bf16", "no"] = "auto"
    compile: bool = False
    name: str = "run"


def test_on_the_command_line_only_true_and_false_are_booleans(tmp_path):
    """A shell removes the quotes of `--train.mixed_precision "no"`: the word must stay a word.
    In a file YAML 1.1 reads a bare no as false, and the error says to quote it."""
    assert parse_overrides(["--a", "no", "--b", "yes", "--c", "off", "--d", "true", "--e", "False", "--f", '"no"']) == {
        "a": "no", "b": "yes", "c": "off", "d": True, "e": False, "f": "no"}
    cfg = load_config(Switches, None, ["--precision", "no", "--compile", "true", "--name", "on"])
    assert cfg == Switches(precision="no", compile=True, name="on")
    with pytest.raises(SproutError, match=r"command line: --compile: got 'yes'; expected true or false$"):
        load_config(Switches, None, ["--compile", "yes"])
    with pytest.raises(SproutError, match=r"command line: --name: got True; expected a string "
                                          r"\(for the word, quote it inside the shell's quotes: '\"true\"'\)$"):
        load_config(Switches, None, ["--name", "true"])
    assert load_config(Switches, None, ["--name", '"true"']).name == "true"
    path = tmp_path / "c.yaml"
    path.write_text("precision: no\n")
    with pytest.raises(SproutError, match=r"c\.yaml: precision: got False; expected one of auto, bf16, no "
                                          r"\(YAML reads a bare yes, no, on, off, true or false as a boolean: "
                                          r"quote the word\)$"):
        load_config(Switches, path)


def test_yaml_then_overrides_into_dataclasses(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  lr: 1\n  steps: 10\nname: demo\n")
    cfg = load_config(Outer, path, ["--train.steps", "20", "--train.lr", "3e-4"])
    assert cfg == Outer(train=Inner(lr=3e-4, steps=20), name="demo")
    assert isinstance(cfg.train.lr, float)


def test_unknown_key_names_the_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  lrr: 1\n")
    with pytest.raises(SproutError, match=r"c\.yaml: unknown key\(s\) train\.lrr \(did you mean train\.lr\? "):
        load_config(Outer, path)


def test_dataclass_validation_names_the_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  lr: -1\n")
    with pytest.raises(SproutError, match=r"c\.yaml: train: lr must be positive"):
        load_config(Outer, path)


def test_invalid_yaml_names_file_and_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  lr: [1\n")
    with pytest.raises(SproutError, match=r"c\.yaml: line \d+ invalid YAML"):
        load_config(Outer, path)


@dataclass
class Section:
    """A section for the tests."""
    steps: int | Literal["auto"] | None = None  # how many; null or auto: decided later
    schedule: Literal["cosine", "constant"] = "cosine"  # the shape
    # the peak
    lr: float = 1e-3
    batch: int = 8                    # rows per step
    tags: list = field(default_factory=list)  # free labels

    def __post_init__(self):
        if self.steps == "auto":
            self.steps = None
        require(self.steps is None or self.steps > 0, "steps", self.steps, "a positive number or null / auto")
        require(self.batch > 0, "batch", self.batch, "a positive number of rows")


@dataclass
class Top:
    train: Section = field(default_factory=Section)
    val_frac: float = 0.1             # share held out


def test_top_level_and_dotted_options_take_dashes_or_underscores():
    for argv in (["--val-frac", "0.2", "--train.max-x", "1"], ["--val_frac=0.2", "--train.max_x=1"]):
        assert parse_overrides(argv) == {"val_frac": 0.2, "train": {"max_x": 1}}
    assert load_config(Top, None, ["--val-frac", "0.5", "--train.steps", "auto"]) == Top(Section(steps=None), 0.5)


def test_unknown_keys_name_their_source(tmp_path):
    with pytest.raises(SproutError, match=r"^command line: unknown option --val_fracc \(did you mean --val_frac\?\)$"):
        load_config(Top, None, ["--val-fracc", "1"])
    with pytest.raises(SproutError, match=r"^command line: unknown option --lr \(did you mean --train\.lr\?\)$"):
        load_config(Top, None, ["--lr", "1"])
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  shedule: wsd\n")
    with pytest.raises(SproutError, match=r"c\.yaml: unknown key\(s\) train\.shedule \(did you mean train\.schedule\?"):
        load_config(Top, path, ["--train.lr", "1"])


@pytest.mark.parametrize("yaml_text, message", [
    ("train:\n  steps: many\n", "c.yaml: train.steps: got 'many'; expected an integer, auto or null"),
    ("train:\n  lr: [1, 2]\n", "c.yaml: train.lr: got [1, 2]; expected a finite number"),
    ("train:\n  lr: .nan\n", "c.yaml: train.lr: got nan; expected a finite number"),
    ("train:\n  lr: .inf\n", "c.yaml: train.lr: got inf; expected a finite number"),
    ("train:\n  batch: 0\n", "c.yaml: train.batch: got 0; expected a positive number of rows"),
    ("train:\n  batch: -4\n", "c.yaml: train.batch: got -4; expected a positive number of rows"),
    ("train:\n  batch: 2.5\n", "c.yaml: train.batch: got 2.5; expected an integer"),
    ("train:\n  batch: true\n", "c.yaml: train.batch: got True; expected an integer"),
    ("train:\n  steps: 0\n", "c.yaml: train.steps: got 0; expected a positive number or null / auto"),
    ("train:\n  schedule: wsd\n", "c.yaml: train.schedule: got 'wsd'; expected one of cosine, constant"),
    ("train:\n  tags: x\n", "c.yaml: train.tags: got 'x'; expected a list"),
    ("train: 3\n", "c.yaml: train: got 3; expected a mapping (a section)"),
])
def test_wrong_values_name_field_value_and_what_was_expected(tmp_path, yaml_text, message):
    path = tmp_path / "c.yaml"
    path.write_text(yaml_text)
    with pytest.raises(SproutError) as exc:
        load_config(Top, path)
    assert str(exc.value) == message.replace("c.yaml", str(path))


def test_a_value_from_the_command_line_is_named_as_such(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  batch: 4\n")
    with pytest.raises(SproutError, match=r"^command line: --train\.batch: got 0; expected a positive number of rows$"):
        load_config(Top, path, ["--train.batch", "0"])
    assert isinstance(FieldError("x", "y"), SproutError)


def test_config_help_lists_types_defaults_choices_and_meanings():
    text = config_help(Top)
    assert "\n  train: A section for the tests.\n" in text
    for name, shown, meaning in [("--train.steps", "int | {auto} | null = null", "how many; null or auto: decided later"),
                                 ("--train.schedule", "{cosine, constant} = cosine", "the shape"),
                                 ("--train.lr", "float = 0.001", "the peak"),
                                 ("--train.tags", "list = []", "free labels"),
                                 ("--val_frac", "float = 0.1", "share held out")]:
        line = next(i for i, t in enumerate(text.splitlines()) if t.split()[:1] == [name])
        assert text.splitlines()[line].split(None, 1)[1].strip() == shown
        assert text.splitlines()[line + 1].strip() == meaning


def test_every_field_of_every_script_config_has_a_meaning():
    from sprout.config_help import config_fields
    from sprout.prep.preference_data import PreferenceDataConfig
    from sprout.prep.pretrain import PrepConfig
    from sprout.prep.rl_prompts import PromptDataConfig
    from sprout.prep.sft_data import SFTDataConfig
    from sprout.prep.tokenizer_train import TokenizerTrainConfig
    from sprout.stages.pretrain import PretrainConfig
    from sprout.stages.configs import DPOConfig, GRPOConfig, PPOConfig, RewardConfig
    from sprout.stages.sft import SFTConfig

    for cls in (PretrainConfig, SFTConfig, RewardConfig, DPOConfig, PPOConfig, GRPOConfig, PrepConfig, SFTDataConfig,
                PreferenceDataConfig, PromptDataConfig, TokenizerTrainConfig):
        missing = [name for name, tp, default, meaning in config_fields(cls) if not meaning]
        assert not missing, f"{cls.__name__}: {missing}"


@pytest.mark.parametrize("key, said", [
    ("learning_rate", "TRL's learning_rate: did you mean optim.lr?; known: "),
    ("per_device_train_batch_size", "TRL's per_device_train_batch_size: did you mean batch.micro_pairs?; sprout "
                                    "sizes a forward pass by its micro batch"),
])
def test_a_trl_option_name_in_a_config_file_is_named_with_sprouts_field(tmp_path, key, said):
    from sprout.stages.configs import DPOConfig
    path = tmp_path / "dpo.yaml"
    path.write_text(f"{key}: 4\n")
    with pytest.raises(SproutError) as err:
        load_config(DPOConfig, path)
    assert str(err.value).startswith(f"{path}: unknown key(s) {key} ({said}"), str(err.value)


@dataclass
class Loss:
    x: int = 1
    corrected: bool = True


@dataclass
class WithLoss:
    loss: Loss = field(default_factory=Loss)
    steps: int = 2


def test_every_field_is_recorded_and_a_saved_config_lacking_one_is_named():
    assert config_to_dict(WithLoss()) == {"loss": {"x": 1, "corrected": True}, "steps": 2}
    assert missing_fields(WithLoss, config_to_dict(WithLoss())) == []
    assert missing_fields(WithLoss, {"loss": {"x": 2}}) == ["loss.corrected", "steps"]
    assert missing_fields(WithLoss, {"loss": None, "steps": 2}) == []  # a value, not a section to search
