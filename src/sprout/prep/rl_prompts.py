"""RL prompt prep (`scripts/prepare_rl_prompts.py`): GSM8K, the arithmetic generator and local
JSONL -> the prompt JSONL contract of `sprout.formats.prompts` (prompt, gold answer, level).

A GSM8K or arithmetic prompt is one user message holding the question as the SFT data shows it
(plus `instruction` after a blank line, when set); local JSONL prompts are kept as written. The
gold is normalised by `sprout.answers.normalise_number`; records that cannot be rewarded are
dropped and counted (`no_final_answer`, `unparsable_gold`, the chat template's reasons), never
guessed. Dedup is exact across sources on `conversation_key(prompt)`, first wins. A source with
`own_split: true` keeps its `split`; every other record goes to test or dev by a hash of its
prompt, and a held-out problem (`sprout.prep.held_out`; GSM8K's dev slice in any source) of
another split is dropped (`prepare`).
`prompts.jsonl`, `prompts_dev.jsonl`, `prompts_test.jsonl` and, last, `manifest.json` are
written. A record that is not what its format (`gsm8k`, `arithmetic`, `jsonl`) says stops the
run naming the file and line.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from sprout.answers import normalise_number, not_a_number_reason
from sprout.atomic import write_json_atomic
from sprout.chat import ChatError, validate
from sprout.chat_formats import ROLES
from sprout.errors import SproutError
from sprout.ranges import SEED_RANGE, in_range
from sprout.formats.prompts import DEV_FILE, FORMAT, FORMAT_VERSION, TEST_FILE, TRAIN_FILE, write_prompts
from sprout.prep import arithmetic
from sprout.prep.chat_sources import file_or_hub_rows, gsm8k_gold, string_field
from sprout.prep.held_out import HeldOut, gsm8k_dev_questions, gsm8k_read_split, held_out_set, is_gsm8k_dev
from sprout.prep.keys import SplitRule, conversation_key, three_way_split
from sprout.prep.records import (Drop, check_sources, dropped_totals, kept_records, log_first_drops, record_id,
                                 write_split_files)
from sprout.prep.sources import print_warning

FORMATS = ("gsm8k", "arithmetic", "jsonl")
SPLITS = ("train", "dev", "test")
ANSWER_FORMAT = ("Think step by step inside <think></think>, then give only the final number "
                 "inside <answer></answer>.")


@dataclass
class PromptSourceConfig:
    name: str  # the source's name in the records' `source` and the manifest
    format: str  # one of FORMATS
    path: str | None = None  # file; `${SPROUT_MIRROR}/...` for a file of the data mirror
    hub: str | None = None  # dataset id for `datasets.load_dataset`
    hub_config: str | None = None  # the hub dataset's configuration (subset)
    split: str = "train"  # the file's / hub split (gsm8k dev: train's dev slice); arithmetic: train | dev | test | all
    own_split: bool = False  # keep `split` (train | dev | test) instead of the hash split
    count: int = in_range(0, "[0, inf)")  # arithmetic: problems to generate
    levels: list = field(default_factory=lambda: [1, 2, 3, 4])  # arithmetic
    seed: int | None = in_range(None, SEED_RANGE)  # arithmetic; None: the prep seed


@dataclass
class PromptDataConfig:
    out: str = "runs/demo/rl_prompts"  # output folder of the prompt files
    mirror: str | None = None  # fills ${SPROUT_MIRROR} in paths (default: sprout.mirror.mirror_dir)
    max_examples: int | None = in_range(None, "[0, inf)")  # records read per source, for quick runs
    seed: int = in_range(0, SEED_RANGE)  # generated sources and the order of each split
    test_fraction: float = in_range(0.05, "[0, 1)")  # for sources without own_split
    dev_fraction: float = in_range(0.05, "[0, 1)")  # for sources without own_split (of those not in test)
    dedup: bool = True  # drop exact duplicates
    instruction: str | None = None  # appended to GSM8K / arithmetic questions; None: the SFT shape
    sources: list = field(default_factory=list)  # PromptSourceConfig fields, one mapping each


@dataclass
class Item:
    """One prompt before dedup and split."""

    prompt: list
    gold: str
    level: int | None
    gsm8k_split: str | None = None  # the GSM8K split it was read from, for a gsm8k record (held-out rules)


# ---- one record -> Item ----------------------------------------------------------------

def question_prompt(question: str, instruction: str | None = None) -> list:
    """The prompt of a question: one user message, the question stripped (as SFT data
    has it), then the instruction after a blank line when there is one."""
    text = question.strip()
    if instruction and instruction.strip():
        text = f"{text}\n\n{instruction.strip()}"
    return [{"role": "user", "content": text}]


def gsm8k_item(row, where: str, instruction: str | None, split: str = "train") -> Item:
    """A GSM8K row of GSM8K's `split`: the question, and the gold after the answer's last `####`."""
    question, answer = string_field(row, "question", where), string_field(row, "answer", where)
    if "####" not in answer:
        raise Drop("no_final_answer", "the answer has no '#### N' final answer")
    try:
        gold = gsm8k_gold(answer, where)
    except SproutError as exc:
        raise Drop("unparsable_gold", str(exc)) from None
    return Item(question_prompt(question, instruction), gold, None, "test" if split == "test" else "train")


def _gold(value, where: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise SproutError(f"{where}: 'gold' must be a string or an integer, got {type(value).__name__}")
    gold = normalise_number(str(value))
    if gold is None:
        raise Drop("unparsable_gold", f"gold {not_a_number_reason(str(value))}")
    return gold


def jsonl_item(row, where: str, instruction: str | None, split: str = "train") -> Item:
    """A local row in the contract, relaxed: `prompt` may be a string (one user message), `gold` an
    integer or any text `normalise_number` takes; an `id` and `source` in the row are replaced."""
    if not isinstance(row, dict):
        raise SproutError(f"{where}: expected a JSON object, got {type(row).__name__}")
    for key in ("prompt", "gold"):
        if key not in row:
            raise SproutError(f"{where}: missing field {key!r} (has {', '.join(sorted(row)) or 'nothing'})")
    unknown = sorted(set(row) - {"id", "source", "prompt", "gold", "level"})
    if unknown:
        raise SproutError(f"{where}: unknown field(s) {', '.join(unknown)}")
    prompt = row["prompt"]
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    if not isinstance(prompt, list) or not prompt:
        raise SproutError(f"{where}: 'prompt' must be a string or a non-empty list of messages")
    messages = []
    for i, m in enumerate(prompt):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or m.get("role") not in ROLES:
            raise SproutError(f"{where}: prompt[{i}] must be {{'role': one of {', '.join(ROLES)}, 'content': string}}")
        messages.append({"role": m["role"], "content": m["content"].strip()})
    if messages[-1]["role"] != "user":
        raise SproutError(f"{where}: the prompt must end with a user turn, ends with {messages[-1]['role']}")
    level = row.get("level")
    if level is not None and (isinstance(level, bool) or not isinstance(level, int) or level < 0):
        raise SproutError(f"{where}: 'level' must be an integer >= 0 or null, got {level!r}")
    return Item(messages, _gold(row["gold"], where), level)


CONVERTERS = {"gsm8k": gsm8k_item, "jsonl": jsonl_item}


# ---- sources ---------------------------------------------------------------------------

def read_items(spec: PromptSourceConfig, cfg: PromptDataConfig):
    """`(where, Item)`, or `(where, Drop)` for a record dropped while it is converted, for
    each record read."""
    if spec.format == "arithmetic":
        seed = cfg.seed if spec.seed is None else spec.seed
        count = spec.count if cfg.max_examples is None else min(spec.count, cfg.max_examples)
        for i, p in enumerate(arithmetic.generate(count, spec.levels, seed, spec.split)):
            prompt = question_prompt(p.question, cfg.instruction)
            yield f"{spec.name}[{i}] (level {p.level})", Item(prompt, p.gold, p.level)
        return
    convert = CONVERTERS[spec.format]
    dev_slice = is_gsm8k_dev(spec)  # GSM8K's train file, its dev slice only
    n = 0
    for where, row in file_or_hub_rows(gsm8k_read_split(spec), cfg.mirror):
        if cfg.max_examples is not None and n >= cfg.max_examples:
            break
        if dev_slice and held_out_set(string_field(row, "question", where), "train") != "gsm8k_dev":
            continue
        n += 1
        try:
            yield where, convert(row, where, cfg.instruction, spec.split)
        except Drop as drop:
            yield where, drop


def check_content(item: Item) -> None:
    """Raise `Drop` with the chat template's reason when it refuses the prompt."""
    try:
        validate(item.prompt, add_generation_prompt=True)
    except ChatError as exc:
        raise Drop(exc.reason, str(exc)) from None


def prompt_key(prompt: list) -> bytes:
    """The dedup and split key: `conversation_key` of the prompt."""
    return conversation_key(prompt)


def source_prompt_id(source: str, key: bytes) -> str:
    """A prompt's id: its source's name and the first 16 hex digits of its `prompt_key`."""
    return f"{source}-{key.hex()[:16]}"


# ---- the whole prep --------------------------------------------------------------------

def check_config(cfg: PromptDataConfig) -> list[PromptSourceConfig]:
    return check_sources(cfg.sources, PromptSourceConfig, FORMATS, _check_spec)


def _check_spec(spec: PromptSourceConfig, where: str) -> None:
    if spec.format == "arithmetic" and spec.split not in arithmetic.SPLITS:
        raise SproutError(f"{where}: split must be one of {', '.join(arithmetic.SPLITS)}, got {spec.split!r}")
    if spec.own_split and spec.split not in SPLITS:
        raise SproutError(f"{where}: own_split needs split train, dev or test, got {spec.split!r}")
    if is_gsm8k_dev(spec) and not spec.own_split:
        raise SproutError(f"{where}: GSM8K's dev slice (split dev) needs own_split: true")


def duplicate_warnings(spec: PromptSourceConfig, counts: Counter) -> list[str]:
    """What dedup did to a source that its user should hear of, with the counts: prompts left
    out although their gold differs from the kept copy's, and prompts of a source with its own
    split left out because the kept copy is in the other split (a test file that repeats
    training prompts is emptied by them)."""
    where = f"source {spec.name} ({spec.path or spec.hub or spec.format})"
    read = counts["read"]
    messages = []
    if counts["duplicates_other_gold"]:
        messages.append(f"{where}: {counts['duplicates_other_gold']:,} of {read:,} prompts repeat a kept prompt with "
                        f"a different gold; the first gold was kept (manifest: duplicates_other_gold)")
    for split in SPLITS:
        if n := counts[f"duplicates_in_{split}"]:
            messages.append(f"{where}: {n:,} of its {read:,} {spec.split} prompts are already in the {split} split "
                            f"and were left out ({counts[spec.split]:,} kept in {spec.split})")
    return messages


def prepare(cfg: PromptDataConfig, command: str = "", log=print, warn=print_warning) -> dict:
    """Run the whole prep; writes the three JSONL files and the manifest, returns the manifest.
    Split: a source with `own_split` keeps its `split` (GSM8K's test questions stay the published
    test set; a `gsm8k` source with split dev reads the train file's dev slice); every other record
    goes to test by `is_val(conversation_key(prompt), test_fraction)`, else to dev by
    `is_dev(..., dev_fraction)`. A held-out problem assigned another split is dropped (`held_out`),
    so train never holds one; the manifest's `held_out` records the sets and counts. What dedup
    changed (`duplicate_warnings`) and an empty split are warned about; with dedup off the manifest
    counts the prompts shared by train and a held-out file (`split.in_both`), which PPO and GRPO
    refuse."""
    specs = check_config(cfg)
    out = Path(cfg.out)
    seen: dict[bytes, tuple[str, str]] = {}  # prompt key -> (gold, split) of the kept prompt
    ids: Counter = Counter()  # prompt id -> times used
    splits: dict[str, list] = {split: [] for split in SPLITS}
    split_keys: dict[str, set] = {split: set() for split in SPLITS}
    per_source: dict[str, Counter] = {}
    first_drop: dict[str, str] = {}
    held_out = HeldOut(gsm8k_dev_questions(specs, cfg.mirror))  # its dev slice, held out in every source
    for spec in specs:
        c = per_source[spec.name] = Counter(dict.fromkeys(("read", *SPLITS, "duplicates"), 0))
        for item in kept_records(read_items(spec, cfg), c, first_drop, spec.name, check_content):
            key = prompt_key(item.prompt)
            if spec.own_split:
                split = spec.split
            else:
                split = three_way_split(key, cfg.test_fraction, cfg.dev_fraction)
            found = held_out.misplaced(item.prompt, split, item.gsm8k_split, cfg.instruction)
            if found is not None:  # a held-out problem of another split
                c["dropped_held_out"] += 1
                first_drop.setdefault(f"{spec.name}/held_out", f"{spec.name}: a {found} problem in {split}")
                continue
            if cfg.dedup and key in seen:
                kept_gold, kept_split = seen[key]
                c["duplicates"] += 1
                if kept_gold != item.gold:
                    c["duplicates_other_gold"] += 1
                if spec.own_split and kept_split != split:
                    c[f"duplicates_in_{kept_split}"] += 1
                continue
            seen.setdefault(key, (item.gold, split))
            c[split] += 1
            split_keys[split].add(key)
            splits[split].append({"id": record_id(ids, source_prompt_id(spec.name, key)), "source": spec.name, "prompt": item.prompt,
                                  "gold": item.gold, "level": item.level})
    log_first_drops(first_drop, log)
    for spec in specs:
        for message in duplicate_warnings(spec, per_source[spec.name]):
            warn(message)

    files = write_split_files(out, splits, {"train": TRAIN_FILE, "dev": DEV_FILE, "test": TEST_FILE}, cfg.seed,
                              write_prompts, "prompts", log, warn)
    in_both = len(split_keys["train"] & (split_keys["dev"] | split_keys["test"]))
    if in_both:  # dedup off: the trainers refuse held-out prompts that are also trained on
        warn(f"{out}: {in_both:,} prompts of {DEV_FILE} or {TEST_FILE} are also in {TRAIN_FILE} (dedup: false); "
             f"PPO and GRPO refuse these files (a held-out prompt must not be trained on)")
    levels = {split: dict(sorted(Counter("null" if r["level"] is None else str(r["level"])
                                         for r in records).items())) for split, records in splits.items()}
    manifest = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "files": files,
        "sources": {s.name: {"format": s.format, "split": s.split, "own_split": s.split if s.own_split else None,
                             **dict(per_source[s.name])} for s in specs},
        "dropped": dropped_totals(per_source), "first_drops": first_drop, "levels": levels,
        "split": {"by": "prompt", "test_fraction": cfg.test_fraction, "dev_fraction": cfg.dev_fraction,
                  **SplitRule(cfg.test_fraction).describe("the prompt's roles and contents"),
                  "dev_key": "not test, and the key's first 8 bytes big-endian < dev_fraction * 2^64 goes to dev",
                  "own_split_sources": {s.name: s.split for s in specs if s.own_split},
                  "in_both": in_both},
        "held_out": held_out.record(),
        "dedup": {"enabled": cfg.dedup, "key": "conversation_key(prompt)"},
        "instruction": cfg.instruction,
        "config": asdict(cfg), "command": command,
    }
    write_json_atomic(out / "manifest.json", manifest)
    return manifest
