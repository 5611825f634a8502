"""Write docs/reference/config.md, the config fields of every prep script and trainer.

The fields are those each script's --help lists (`sprout.config_help.config_markdown`).
`make docs` runs this; tests/test_docs.py checks the page is what `render()` writes now.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from sprout.config_help import config_markdown
from sprout.errors import run_main
from sprout.prep import chat_sources, preference_data, rl_prompts
from sprout.prep.pretrain import PrepConfig
from sprout.prep.sft_data import SFTDataConfig
from sprout.prep.sources import SourceSpec
from sprout.prep.tokenizer_train import TokenizerTrainConfig
from sprout.stages.configs import DPOConfig, GRPOConfig, PPOConfig, PretrainConfig, RewardConfig, SFTConfig

PAGE = Path(__file__).resolve().parents[1] / "docs" / "reference" / "config.md"
# anchor, script, config, the config of one `sources:` entry (or None), the formats it reads
SECTIONS = [
    ("tokenizer", "train_tokenizer.py", TokenizerTrainConfig, SourceSpec, ()),
    ("pretrain-data", "prepare_pretrain_data.py", PrepConfig, SourceSpec, ()),
    ("sft-data", "prepare_sft_data.py", SFTDataConfig, chat_sources.SourceConfig, chat_sources.FORMATS),
    ("preference-data", "prepare_preference_data.py", preference_data.PreferenceDataConfig,
     preference_data.PreferenceSourceConfig, preference_data.FORMATS),
    ("rl-prompts", "prepare_rl_prompts.py", rl_prompts.PromptDataConfig, rl_prompts.PromptSourceConfig,
     rl_prompts.FORMATS),
    ("pretrain", "pretrain.py", PretrainConfig, None, ()),
    ("sft", "train_sft.py", SFTConfig, None, ()),
    ("reward", "train_reward.py", RewardConfig, None, ()),
    ("dpo", "train_dpo.py", DPOConfig, None, ()),
    ("ppo", "train_ppo.py", PPOConfig, None, ()),
    ("grpo", "train_grpo.py", GRPOConfig, None, ()),
]


def render() -> str:
    out = ["# Config reference", "",
           "Generated from the config dataclasses by `make docs` (`python scripts/config_reference.py`); "
           "do not edit by hand. A script's `--help` lists the same fields.", "",
           "Set a field in the YAML config (`section: {field: value}`) or on the command line as "
           "`--section.field VALUE` or `--field VALUE` (- and _ alike; VALUE read as YAML). "
           "A type's range is the values the config accepts; `(required)` has no default.", "",
           " · ".join(f"[{anchor}](#{anchor})" for anchor, *_ in SECTIONS)]
    for anchor, script, cls, source_cls, formats in SECTIONS:
        out += ["", f'<a id="{anchor}"></a>', "", f"## {anchor}: scripts/{script} ({cls.__name__})", "",
                config_markdown(cls)]
        if source_cls is not None:
            out += ["", f"Each entry of `sources:` ({source_cls.__name__}):", "", config_markdown(source_cls, formats)]
    return "\n".join(out) + "\n"


def main() -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    PAGE.parent.mkdir(parents=True, exist_ok=True)
    PAGE.write_text(render(), encoding="utf-8")
    print(f"wrote {PAGE.relative_to(PAGE.parents[2])}")
    return 0

if __name__ == "__main__":
    run_main(main)
