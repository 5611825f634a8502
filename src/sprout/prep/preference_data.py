"""Preference-pair prep (`scripts/prepare_preference_data.py`): HH-RLHF, UltraFeedback, local JSONL
and arithmetic -> the preference JSONL contract of `sprout.formats.preference_pairs`.

Each record becomes a prompt (messages ending with a user turn) and two stripped answers. Pairs
that cannot train anything are dropped and counted by reason (`malformed_transcript`,
`mismatched_turns`, `empty_side`, `identical_sides` and the chat template's reasons). Dedup is
exact across sources on `conversation_key(prompt + [chosen, rejected])`, first wins; the split is
by a hash of the PROMPT alone, so every pair of one prompt lands in the same file, and a pair
whose prompt is a held-out problem of another split (`sprout.prep.held_out`) is dropped
(`prepare`). Formats (`format:`): `hh_rlhf`, `ultrafeedback`, `jsonl` (the contract or TRL's
forms) and `arithmetic` (chosen the worked answer, rejected a `near_miss` or a `broken_format`);
a `path` may use `${SPROUT_MIRROR}`, else the hub id is read through `datasets`. A record that is
not what its format says stops the run naming the file and line.
"""

from __future__ import annotations

import math
import random
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from sprout.atomic import write_json_atomic
from sprout.chat import ChatError, validate
from sprout.chat_formats import ROLES
from sprout.errors import SproutError
from sprout.ranges import SEED_RANGE, in_range
from sprout.formats.preference_pairs import (DEV_FILE, FORMAT, FORMAT_VERSION, TEST_FILE, TRAIN_FILE,
                                             check_rejected_kind, kind_group, write_preferences)
from sprout.prep import arithmetic
from sprout.prep.chat_sources import file_or_hub_rows, string_field
from sprout.prep.held_out import HeldOut
from sprout.prep.keys import SplitRule, conversation_key, three_way_split
from sprout.prep.records import (Drop, check_sources, dropped_totals, kept_records, log_first_drops, record_id,
                                 write_split_files)

FORMATS = ("hh_rlhf", "ultrafeedback", "jsonl", "arithmetic")


@dataclass
class PreferenceSourceConfig:
    name: str  # the source's name in the records' `source` and the manifest
    format: str  # one of FORMATS
    path: str | None = None  # file; `${SPROUT_MIRROR}/...` for a file of the data mirror
    hub: str | None = None  # dataset id for `datasets.load_dataset`
    hub_config: str | None = None  # the hub dataset's configuration (subset)
    split: str = "train"  # hub split; for arithmetic the generator's split (train | dev | test | all)
    margin: bool = False  # ultrafeedback / jsonl: score_chosen - score_rejected becomes `margin`
    count: int = in_range(0, "[0, inf)")  # arithmetic: pairs to generate
    levels: list = field(default_factory=lambda: [1, 2, 3, 4])  # arithmetic
    seed: int | None = in_range(None, SEED_RANGE)  # arithmetic; None: the prep seed
    broken_format_fraction: float = in_range(0.25, "[0, 1]")  # arithmetic: share of rejected answers with broken tags


@dataclass
class PreferenceDataConfig:
    out: str = "runs/demo/prefs"  # output folder: preferences.jsonl, preferences_dev.jsonl, preferences_test.jsonl
    mirror: str | None = None  # fills ${SPROUT_MIRROR} in paths (default: sprout.mirror.mirror_dir)
    max_examples: int | None = in_range(None, "[0, inf)")  # records read per source, for quick runs
    seed: int = in_range(0, SEED_RANGE)  # generated sources and the order of each split
    test_fraction: float = in_range(0.05, "[0, 1)")  # share of pairs (by prompt hash) in the test file
    dev_fraction: float = in_range(0.05, "[0, 1)")  # share of the other pairs (by prompt hash) in the dev file
    dedup: bool = True  # drop exact duplicates
    sources: list = field(default_factory=list)  # PreferenceSourceConfig fields, one mapping each


# ---- one record -> (prompt, chosen, rejected, optional fields) -------------------------

def _msg(role: str, content: str) -> dict:
    return {"role": role, "content": content.strip()}


_HH_TURN = re.compile(r"(?:^|\n\n)(Human|Assistant):[ \t]?")


def parse_hh(text: str) -> list:
    """An HH-RLHF transcript as messages; `Drop("malformed_transcript")` unless it is
    Human, Assistant, Human, ... turns ending with an Assistant turn."""
    parts = _HH_TURN.split(text)
    if parts[0].strip() or len(parts) < 5:
        raise Drop("malformed_transcript", "text before the first Human turn or fewer than two turns"
                   if parts[0].strip() else "fewer than two turns")
    speakers, contents = parts[1::2], parts[2::2]
    for i, who in enumerate(speakers):
        if who != ("Human" if i % 2 == 0 else "Assistant"):
            raise Drop("malformed_transcript", f"turn {i} is {who}, turns must alternate Human/Assistant")
    if speakers[-1] != "Assistant":
        raise Drop("malformed_transcript", "the last turn is not the Assistant's")
    return [_msg("user" if who == "Human" else "assistant", c) for who, c in zip(speakers, contents)]


def hh_pair(row, where: str, spec: PreferenceSourceConfig):
    chosen_text, rejected_text = string_field(row, "chosen", where), string_field(row, "rejected", where)
    chosen, rejected = parse_hh(chosen_text), parse_hh(rejected_text)
    if chosen[:-1] != rejected[:-1]:
        raise Drop("mismatched_turns", "chosen and rejected differ before their last turn")
    return chosen[:-1], chosen[-1]["content"], rejected[-1]["content"], {}


def _messages(value, name: str, where: str, role: str) -> list:
    """A string (one `role` message) or a list of {role, content} messages."""
    if isinstance(value, str):
        return [_msg(role, value)]
    if not isinstance(value, list) or not value:
        raise SproutError(f"{where}: {name!r} must be a string or a non-empty list of messages, got {type(value).__name__}")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or m.get("role") not in ROLES:
            raise SproutError(f"{where}: {name}[{i}] must be {{'role': one of {', '.join(ROLES)}, 'content': string}}")
        out.append(_msg(m["role"], m["content"]))
    return out


def _answer(side: list, name: str, where: str) -> str:
    if len(side) != 1 or side[0]["role"] != "assistant":
        raise SproutError(f"{where}: {name!r} must be one assistant message after the prompt, got roles "
                          f"{[m['role'] for m in side]}")
    return side[0]["content"]


def _scores(row, where: str) -> float:
    meta = row.get("metadata") if isinstance(row.get("metadata"), dict) else {}
    values = []
    for key in ("score_chosen", "score_rejected"):
        v = row.get(key, meta.get(key))
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise SproutError(f"{where}: margin asked but {key!r} is missing or not a finite number (got {v!r})")
        values.append(float(v))
    return finite_margin(values[0] - values[1], where)


def finite_margin(value, where: str) -> float:
    """`value` as a float when it is a finite number (JSON's NaN and Infinity are not); one
    error naming the input record `where` otherwise, before any file is written."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise SproutError(f"{where}: 'margin' must be a finite number, got {value!r}")
    return float(value)


def conversational_pair(row, where: str, spec: PreferenceSourceConfig):
    """TRL's preference forms (strings, explicit or implicit prompt) and the contract itself."""
    if not isinstance(row, dict):
        raise SproutError(f"{where}: expected a JSON object, got {type(row).__name__}")
    for key in ("chosen", "rejected"):
        if key not in row:
            raise SproutError(f"{where}: missing field {key!r} (has {', '.join(sorted(row)) or 'nothing'})")
    chosen = _messages(row["chosen"], "chosen", where, "assistant")
    rejected = _messages(row["rejected"], "rejected", where, "assistant")
    if row.get("prompt") is None:  # implicit prompt: the turns chosen and rejected share
        if isinstance(row["chosen"], str) or isinstance(row["rejected"], str):
            raise SproutError(f"{where}: no 'prompt', and chosen/rejected are plain strings")
        n = 0
        while n < min(len(chosen), len(rejected)) - 1 and chosen[n] == rejected[n]:
            n += 1
        if len(chosen) - n != 1 or len(rejected) - n != 1:
            raise Drop("mismatched_turns", "chosen and rejected differ before their last turn")
        prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
        if not prompt:
            raise SproutError(f"{where}: no 'prompt', and chosen/rejected share no leading turns")
    else:
        prompt = _messages(row["prompt"], "prompt", where, "user")
        if chosen[:len(prompt)] == prompt and len(chosen) > len(prompt):  # lists that repeat the prompt
            chosen = chosen[len(prompt):]
        if rejected[:len(prompt)] == prompt and len(rejected) > len(prompt):
            rejected = rejected[len(prompt):]
    if prompt[-1]["role"] != "user":
        raise SproutError(f"{where}: the prompt must end with a user turn, ends with {prompt[-1]['role']}")
    optional = {}
    if "margin" in row:
        optional["margin"] = finite_margin(row["margin"], where)
    elif spec.margin:
        optional["margin"] = _scores(row, where)
    if "rejected_kind" in row:
        try:
            optional["rejected_kind"] = check_rejected_kind(row["rejected_kind"])
        except SproutError as exc:
            raise SproutError(f"{where}: {exc}") from None
    return prompt, _answer(chosen, "chosen", where), _answer(rejected, "rejected", where), optional


CONVERTERS = {"hh_rlhf": hh_pair, "ultrafeedback": conversational_pair, "jsonl": conversational_pair}


# ---- sources ---------------------------------------------------------------------------

def arithmetic_pairs(spec: PreferenceSourceConfig, seed: int, counts: Counter):
    """`(where, (prompt, chosen, rejected, {"rejected_kind": kind}))` for `spec.count` generated problems."""
    seed = seed if spec.seed is None else spec.seed
    rng = random.Random(f"{seed}-wrong")
    for i, p in enumerate(arithmetic.generate(spec.count, spec.levels, seed, spec.split)):
        rejected, kind = arithmetic.wrong_answer(p, rng, spec.broken_format_fraction)
        counts[kind_group(kind)] += 1
        yield f"{spec.name}[{i}] (level {p.level})", ([_msg("user", p.question)], p.worked, rejected,
                                                       {"rejected_kind": kind})


def read_pairs(spec: PreferenceSourceConfig, mirror, seed: int, max_examples: int | None, counts: Counter):
    """`(where, (prompt, chosen, rejected, optional fields))`, or `(where, Drop)` for a record that
    is dropped while it is converted, for each record read."""
    if spec.format == "arithmetic":
        yield from arithmetic_pairs(spec, seed, counts)
        return
    convert = CONVERTERS[spec.format]
    for n, (where, row) in enumerate(file_or_hub_rows(spec, mirror)):
        if max_examples is not None and n >= max_examples:
            break
        try:
            yield where, convert(row, where, spec)
        except Drop as drop:
            yield where, drop


def check_content(prompt: list, chosen: str, rejected: str) -> None:
    """Raise `Drop` for a pair that cannot train anything (see the module docstring)."""
    if not chosen or not rejected:
        raise Drop("empty_side", "chosen or rejected is empty")
    if chosen == rejected:
        raise Drop("identical_sides", "chosen and rejected are the same text")
    for side in (chosen, rejected):
        try:
            validate([*prompt, _msg("assistant", side)])
        except ChatError as exc:
            raise Drop(exc.reason, str(exc)) from None


def pair_key(prompt: list, chosen: str, rejected: str) -> bytes:
    """The dedup key of a pair."""
    return conversation_key([*prompt, _msg("assistant", chosen), _msg("assistant", rejected)])


def prompt_key(prompt: list) -> bytes:
    """The split key: a hash of the prompt alone."""
    return conversation_key(prompt)


# ---- the whole prep --------------------------------------------------------------------

def check_config(cfg: PreferenceDataConfig) -> list[PreferenceSourceConfig]:
    return check_sources(cfg.sources, PreferenceSourceConfig, FORMATS)


def prepare(cfg: PreferenceDataConfig, command: str = "", log=print) -> dict:
    """Run the whole prep; writes the three JSONL files and the manifest, returns the manifest.
    Split by the prompt: test by `is_val(conversation_key(prompt), test_fraction)`, else dev by
    `is_dev(..., dev_fraction)`; a held-out problem of another split is dropped (`held_out`; the
    manifest's `held_out` records the sets and counts). Each split is shuffled with `seed`, then
    `preferences.jsonl`, `preferences_dev.jsonl` (what the reward and DPO stages evaluate on),
    `preferences_test.jsonl` and, last, `manifest.json` are written."""
    specs = check_config(cfg)
    out = Path(cfg.out)
    seen: set[bytes] = set()
    ids: Counter = Counter()  # pair id -> times used
    splits: dict[str, list] = {"train": [], "dev": [], "test": []}
    per_source: dict[str, Counter] = {}
    first_drop: dict[str, str] = {}
    held_out = HeldOut()
    for spec in specs:
        c = per_source[spec.name] = Counter(dict.fromkeys(("read", *splits, "duplicates"), 0))
        pairs = read_pairs(spec, cfg.mirror, cfg.seed, cfg.max_examples, c)
        for prompt, chosen, rejected, optional in kept_records(pairs, c, first_drop, spec.name,
                                                               lambda pair: check_content(*pair[:3])):
            key = pair_key(prompt, chosen, rejected)
            if cfg.dedup and key in seen:
                c["duplicates"] += 1
                continue
            seen.add(key)
            split_key = prompt_key(prompt)
            split = three_way_split(split_key, cfg.test_fraction, cfg.dev_fraction)
            found = held_out.misplaced(prompt, split)
            if found is not None:  # a held-out problem of another split
                c["dropped_held_out"] += 1
                first_drop.setdefault(f"{spec.name}/held_out", f"{spec.name}: a {found} problem in {split}")
                continue
            c[split] += 1
            record = {"id": record_id(ids, f"{spec.name}-{key.hex()[:16]}"), "source": spec.name, "prompt": prompt,
                      "chosen": [_msg("assistant", chosen)], "rejected": [_msg("assistant", rejected)], **optional}
            splits[split].append(record)
    log_first_drops(first_drop, log)

    files = write_split_files(out, splits, {"train": TRAIN_FILE, "dev": DEV_FILE, "test": TEST_FILE}, cfg.seed,
                              write_preferences, "pairs", log)
    manifest = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "files": files,
        "sources": {name: {"format": s.format, **dict(per_source[name])} for name, s in zip(per_source, specs)},
        "dropped": dropped_totals(per_source), "first_drops": first_drop,
        "split": {"by": "prompt", "test_fraction": cfg.test_fraction, "dev_fraction": cfg.dev_fraction,
                  **SplitRule(cfg.test_fraction).describe("the prompt's roles and contents"),
                  "dev_key": "not test, and the key's first 8 bytes big-endian < dev_fraction * 2^64 goes to dev"},
        "held_out": held_out.record(),
        "dedup": {"enabled": cfg.dedup, "key": "conversation_key(prompt + [chosen, rejected])"},
        "config": asdict(cfg), "command": command,
    }
    write_json_atomic(out / "manifest.json", manifest)
    return manifest
