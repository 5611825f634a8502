"""What an unknown command-line option most likely meant: a config field under another spelling,
or the name TRL (and transformers' TrainingArguments) gives to one of sprout's settings.

`option_hint(key, fields)` is the parenthesis `sprout.config.check_overrides` adds to its
"unknown option" line: "(TRL's learning_rate: did you mean --optim.lr?)", else "(did you mean
--train.max_steps?)", else a pointer to --help. `trl_hint` is the TRL part, which
`sprout.config.from_dict` also gives for a config file's top-level key. `TRL_NAMES` is the one
table of TRL's names.
"""

from __future__ import annotations

import difflib

# TRL's option -> (sprout's fields that may stand for it, the first the config has; a note on
# how sprout sizes that setting, shown after the field, or alone when the config has none)
TRL_NAMES: dict[str, tuple[tuple[str, ...], str]] = {
    "learning_rate": (("optim.lr",), ""),
    "num_train_epochs": (("data.epochs", "train.max_steps"), ""),
    "max_steps": (("train.max_steps",), ""),
    "per_device_train_batch_size": (
        ("batch.micro_tokens", "batch.micro_pairs", "batch.micro_completions"),
        "sprout sizes a forward pass by its micro batch and an optimizer step by batch.global_*, over all processes"),
    "gradient_accumulation_steps": (
        ("batch.global_tokens", "batch.global_pairs", "batch.global_prompts"),
        "the accumulation steps follow from batch.global_* / (batch.micro_* × processes)"),
    "max_length": (("data.seq_len",), "SFT rows have the length prep gave them: prepare_sft_data.py --seq-len"),
    "max_prompt_length": (("data.max_prompt_length",),
                          "preference pairs are cut to data.seq_len as a whole (data.truncation)"),
    "max_completion_length": (("rollout.max_completion_length",), ""),
    "beta": (("dpo.beta", "grpo.beta", "ppo.kl_coef"), ""),
    "max_grad_norm": (("optim.grad_clip",), ""),
    "lr_scheduler_type": (("optim.schedule",), ""),
    "warmup_ratio": (("optim.warmup_steps",), "sprout counts warmup in steps"),
    "logging_steps": (("train.log_every",), ""),
    "eval_steps": (("train.eval_every",), ""),
    "save_steps": (("train.ckpt_every",), ""),
    "save_total_limit": (("train.keep_checkpoints",), ""),
    "bf16": (("train.mixed_precision",), "bf16 is its default on a GPU that has it (auto)"),
    "output_dir": (("out",), "or --out"),
    "report_to": (("train.trackers",), ""),
}


def option_hint(key: str, fields: list[str]) -> str:
    """The parenthesis after "unknown option --KEY" for a config whose fields are `fields`
    (dotted names): TRL's name first (`TRL_NAMES`), else the closest field (`closest_field`)."""
    if key in TRL_NAMES:
        return f" ({trl_hint(key, fields)})"
    close = closest_field(key, fields)
    return f" (did you mean --{close}?)" if close else " (see --help for the fields)"


def trl_hint(key: str, fields: list[str], flag: str = "--") -> str:
    """What TRL's option `key` (in `TRL_NAMES`) is called in a config of `fields`, and how
    sprout sizes it: "TRL's learning_rate: did you mean --optim.lr?". `flag` prefixes the
    field: "--" on the command line, "" for a key of a config file."""
    candidates, note = TRL_NAMES[key]
    field = next((f for f in candidates if f in fields), None)
    said = [f"did you mean {flag}{field}?" if field else "", note]
    return f"TRL's {key}: {'; '.join(s for s in said if s) or 'no such setting in this stage, see --help'}"


def closest_field(key: str, fields: list[str]) -> str | None:
    """The field a mistyped dotted `key` most likely meant: the same name in another section,
    else the closest spelling of the whole path, else of the last name."""
    last = key.rsplit(".", 1)[-1]
    same = [f for f in fields if f.rsplit(".", 1)[-1] == last]
    if same:
        return same[0]
    close = difflib.get_close_matches(key, fields, n=1, cutoff=0.6)
    if close:
        return close[0]
    by_last = {f.rsplit(".", 1)[-1]: f for f in reversed(fields)}
    close = difflib.get_close_matches(last, list(by_last), n=1, cutoff=0.75)
    return by_last[close[0]] if close else None
