"""The RL prompt JSONL contract (TRL's prompt-only conversational format plus a verifiable gold
answer, for PPO and GRPO): reader, verifier, writer.

One JSON object per line: a prompt (the conversation so far, ending with a user turn), its gold
answer as a normalised number and a curriculum level; the fields are in `check_prompt`'s
docstring. Every content is a non-empty string without the chat template's reserved markers, so
`sprout.chat.render(prompt, tok, add_generation_prompt=True)` accepts the prompt. A prepared folder
holds `prompts.jsonl` (train), `prompts_dev.jsonl` (dev, what the RL stages evaluate on),
`prompts_test.jsonl` (test; a prompt is in one file only) and `manifest.json`
(`sprout.prep.rl_prompts`). `read_prompts` refuses a bad record in one line naming file and line;
`verify_prompts` returns counts and the first errors instead; `write_prompts` checks and writes
atomically.
"""

from __future__ import annotations

import os
from typing import Iterable, Iterator

from sprout.answers import normalise_number, not_a_number_reason
from sprout.chat import ChatError, validate
from sprout.errors import SproutError
from sprout.formats.jsonl import check_prompt_record, read_records, verify_records, write_records

FORMAT = "sprout-prompts"
FORMAT_VERSION = 1
TRAIN_FILE = "prompts.jsonl"
DEV_FILE = "prompts_dev.jsonl"
TEST_FILE = "prompts_test.jsonl"
KEYS = ("id", "source", "prompt", "gold", "level")


def check_prompt(record) -> dict:
    """Return `record` when it is a valid RL prompt; raise `SproutError` (without the
    location: callers add it) saying what is wrong otherwise. A record has no other keys than:

        id      str, non-empty, unique within the file
        source  str, non-empty: the prep source it came from
        prompt  [{"role": "system"|"user"|"assistant", "content": str}, ...]: the conversation so
                far, [system?] user, assistant, user, ..., ending with a user turn; the policy
                writes the next assistant turn
        gold    str: the answer as a normalised number, exactly what
                `sprout.answers.normalise_number` writes for it (`1080`, `-3`, `2.5`, `1/3`;
                never `1,080`, `$5` or `0.50`)
        level   int >= 0 | null: the curriculum level (e.g. the arithmetic generator's 1-4), null
                when the source has none"""
    prompt = check_prompt_record(record, KEYS)
    try:
        validate(prompt, add_generation_prompt=True)
    except ChatError as exc:
        raise SproutError(f"prompt: {exc}") from None
    gold = record["gold"]
    if not isinstance(gold, str):
        raise SproutError(f"'gold' must be a string, got {type(gold).__name__}")
    normal = normalise_number(gold)
    if normal is None:
        raise SproutError(f"'gold' {not_a_number_reason(gold)}")
    if normal != gold:
        raise SproutError(f"'gold' {gold!r} is not normalised (write {normal!r})")
    level = record["level"]
    if level is not None and (isinstance(level, bool) or not isinstance(level, int) or level < 0):
        raise SproutError(f"'level' must be an integer >= 0 or null, got {level!r}")
    return record


def read_prompts(path: str | os.PathLike) -> Iterator[dict]:
    """Yield the checked records of a prompt file; the first bad line (or a repeated id)
    raises `SproutError` naming the file and line."""
    return read_records(path, check_prompt, "prompt file")


def _tally(result: dict, record: dict) -> None:
    key = "null" if record["level"] is None else str(record["level"])
    result["levels"][key] = result["levels"].get(key, 0) + 1


def verify_prompts(path: str | os.PathLike, max_errors: int = 5) -> dict:
    """Check every line of a prompt file. Returns `{"path", "records", "valid", "sources",
    "levels", "errors"}` (`levels`: count per level, `"null"` for none): `errors` holds up
    to `max_errors` lines `file:line: what is wrong` (empty when the file keeps the
    contract); a missing file is its only error."""
    return verify_records(path, check_prompt, "prompt file", max_errors, _tally, levels={})


def write_prompts(path: str | os.PathLike, records: Iterable[dict]) -> int:
    """Check and write records, one JSON line each, atomically; returns the count."""
    return write_records(path, records, check_prompt)
