"""Evaluation prompts: the held-out problems of each task and split, built by the RL prompt prep's own code.

    prompts = task_prompts("arith")                        # arithmetic dev split, levels 1-4
    prompts = task_prompts("gsm8k", "test", mirror="../shared/data")  # GSM8K's test.jsonl, offline
    prompts = file_prompts("runs/demo/rl_prompts/prompts_dev.jsonl")

Every record is in the prompt contract of `sprout.formats.prompts`, made by the same steps as
`sprout.prep.rl_prompts.prepare` (reader, prompt shape, template refusals, dedup, ids), so a
problem has the same id and prompt here as in a prepared `prompts_dev.jsonl` / `prompts_test.jsonl`.
`TASKS[task][split]` (`SPLITS`: dev, the default, for tuning; test for the figures reported;
`sprout.prep.held_out` defines both): `arith`, the arithmetic generator's dev or test split
(held out by a hash of the question), levels 1-4 in turn, `ARITH_COUNT` problems drawn with
generator seed 0 whatever the sampling seed; `gsm8k`, dev: the dev slice of GSM8K's train file,
test: its test file (`openai/gsm8k`, config `main`, 1,319 problems), from the data mirror, else
the hub, level null. No torch here.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

from sprout.errors import SproutError
from sprout.formats.prompts import read_prompts
from sprout.prep.held_out import gsm8k_question, slice_digest
from sprout.prep.rl_prompts import (Drop, PromptDataConfig, PromptSourceConfig, check_config, check_content,
                                    prompt_key, read_items, source_prompt_id)

ARITH_COUNT = 200  # arith problems when no max_examples is given
SPLITS = ("dev", "test")
_GSM8K = {"dev": "train.jsonl", "test": "test.jsonl"}  # the dev slice is read from the train file
TASKS = {
    "arith": {split: PromptSourceConfig(name=f"arithmetic_{split}", format="arithmetic", count=ARITH_COUNT,
                                        levels=[1, 2, 3, 4], split=split, seed=0) for split in SPLITS},
    "gsm8k": {split: PromptSourceConfig(name=f"gsm8k_{split}", format="gsm8k",
                                        path=f"${{SPROUT_MIRROR}}/sft/gsm8k/{_GSM8K[split]}", hub="openai/gsm8k",
                                        hub_config="main", split=split, own_split=True) for split in SPLITS},
}


def task_prompts(task: str, split: str = "dev", *, max_examples: int | None = None, mirror: str | None = None,
                 instruction: str | None = None, log=print) -> list[dict]:
    """The prompt records of `task` (one of `TASKS`) and `split` (one of `SPLITS`), at most
    `max_examples` of them (for arith: exactly that many problems drawn, when the split holds
    them). Records the prep would drop (no final answer, a gold that is not a number, a prompt the
    chat template refuses, a repeated prompt) are left out and counted in one `log` line per reason."""
    if task not in TASKS:
        raise SproutError(f"unknown task {task!r} (expected one of {', '.join(TASKS)})")
    if split not in SPLITS:
        raise SproutError(f"unknown split {split!r} (expected one of {', '.join(SPLITS)})")
    if max_examples is not None and max_examples < 1:
        raise SproutError(f"max_examples must be >= 1, got {max_examples}")
    spec = dataclasses.replace(TASKS[task][split])
    if spec.format == "arithmetic" and max_examples is not None:
        spec.count = max_examples
    cfg = PromptDataConfig(mirror=mirror, max_examples=max_examples, instruction=instruction,
                           sources=[dataclasses.asdict(spec)])
    (spec,) = check_config(cfg)
    records, seen, dropped = [], set(), Counter()
    for _, item in read_items(spec, cfg):
        try:
            if isinstance(item, Drop):
                raise item
            check_content(item)
        except Drop as drop:
            dropped[drop.reason] += 1
            continue
        key = prompt_key(item.prompt)
        if key in seen:
            dropped["duplicate"] += 1
            continue
        seen.add(key)
        records.append({"id": source_prompt_id(spec.name, key), "source": spec.name, "prompt": item.prompt,
                        "gold": item.gold, "level": item.level})
    for reason, count in sorted(dropped.items()):
        log(f"{task}: left out {count} record(s): {reason}")
    if not records:
        raise SproutError(f"task {task}: no prompts to evaluate")
    return records


def dev_slice_record(task: str | None, split: str | None, records: list[dict],
                     instruction: str | None = None) -> dict | None:
    """For `gsm8k` dev: the count and sha256 of the slice's questions evaluated
    (`sprout.prep.held_out.slice_digest`, as the preps record `gsm8k_dev_slice`); else None."""
    if task != "gsm8k" or split != "dev":
        return None
    return slice_digest(gsm8k_question(r["prompt"], instruction) for r in records)


def file_prompts(path, max_examples: int | None = None) -> list[dict]:
    """The records of a prompt file (`sprout.formats.prompts`, e.g. a prepared
    `prompts_test.jsonl`), the first `max_examples` of them when given."""
    if max_examples is not None and max_examples < 1:
        raise SproutError(f"max_examples must be >= 1, got {max_examples}")
    records = []
    for record in read_prompts(path):
        if max_examples is not None and len(records) >= max_examples:
            break
        records.append(record)
    if not records:
        raise SproutError(f"{path}: no prompts to evaluate")
    return records
