from dataclasses import dataclass, field

import pytest

from sprout.config import load_config, parse_overrides
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
    with pytest.raises(SproutError, match="unrecognised argument '--name'"):
        parse_overrides(["--name", "x"])


def test_yaml_then_overrides_into_dataclasses(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  lr: 1\n  steps: 10\nname: demo\n")
    cfg = load_config(Outer, path, ["--train.steps", "20", "--train.lr", "3e-4"])
    assert cfg == Outer(train=Inner(lr=3e-4, steps=20), name="demo")
    assert isinstance(cfg.train.lr, float)


def test_unknown_key_names_the_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  lrr: 1\n")
    with pytest.raises(SproutError, match=r"c\.yaml\.train: unknown key\(s\) lrr"):
        load_config(Outer, path)


def test_dataclass_validation_names_the_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  lr: -1\n")
    with pytest.raises(SproutError, match=r"c\.yaml\.train: lr must be positive"):
        load_config(Outer, path)


def test_invalid_yaml_names_file_and_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  lr: [1\n")
    with pytest.raises(SproutError, match=r"c\.yaml: line \d+ invalid YAML"):
        load_config(Outer, path)
