"""Held-out problems: the dev and test sets of the evaluation tasks, which no training data may hold.

- `arithmetic_dev`, `arithmetic_test`: a question of the arithmetic generator's form ("What is 12 + 5?")
  whose `sprout.prep.arithmetic.question_split` is dev or test, whatever source it came from;
- `gsm8k_dev`: a question of GSM8K's train split (a `gsm8k` source) with
  `is_val(text_key("dev:" + question.strip()), GSM8K_DEV_FRACTION)`: a fixed slice of train.jsonl;
- `gsm8k_test`: every question of GSM8K's test split (a `gsm8k` source with split test; its
  questions are known by their source, not compared with test.jsonl, and SFT reads train only).
The preps exclude held-out problems from train files (counted as `dropped_held_out`) and record
what they excluded (`HeldOut.record()`: sets, rule, counts, the count and sha256 of the GSM8K dev
slice questions read, `slice_digest`) in the manifest or HDF5 attrs; the
trainers refuse a file that lacks the record or holds a held-out problem (`check_train_jsonl`,
`check_record`; a packed SFT file: `check_sft_examples` on its conversations' user turns, decoded).
GSM8K's dev slice is held out in every source by the SFT and RL prompt preps and by the SFT, PPO and
GRPO trainers, which read it from the prep's own GSM8K train files where they can be read here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections import Counter
from pathlib import Path
from typing import Iterable, Iterator, NamedTuple

from sprout.errors import SproutError
from sprout.prep.arithmetic import DEV_FRACTION, TEST_FRACTION, question_split
from sprout.prep.keys import is_val, text_key

SETS = ("arithmetic_dev", "arithmetic_test", "gsm8k_dev", "gsm8k_test")
GSM8K_DEV_FRACTION = 0.05  # share of GSM8K's train questions held out as its dev slice
RULE = {
    "arithmetic": f'a generator question: test when is_val(text_key(q), {TEST_FRACTION}), else dev when '
                  f'is_val(text_key("dev:" + q), {DEV_FRACTION})',
    "gsm8k_dev": f'a question of GSM8K\'s train split with is_val(text_key("dev:" + q.strip()), {GSM8K_DEV_FRACTION})',
    "gsm8k_test": "every question of GSM8K's test split (a gsm8k source with split test)",
}
_ARITHMETIC_QUESTION = re.compile(r"What is \d+ [-+*] \d+(?: [-+*] \d+)?\?")


def question_of(content: str) -> str:
    """The question of a user turn: its text before the first blank line (an appended
    instruction follows one), stripped."""
    return content.strip().split("\n\n", 1)[0].strip()


def arithmetic_set(question: str) -> str | None:
    """`arithmetic_dev` / `arithmetic_test` for a held-out generator question, else None."""
    if not _ARITHMETIC_QUESTION.fullmatch(question):
        return None
    split = question_split(question)
    return None if split == "train" else f"arithmetic_{split}"


def gsm8k_split(question: str, file_split: str = "train") -> str:
    """"test" for a question of GSM8K's test split; else "dev" or "train" by the dev slice's rule."""
    if file_split == "test":
        return "test"
    return "dev" if is_val(text_key("dev:" + question.strip()), GSM8K_DEV_FRACTION) else "train"


def held_out_set(question: str, gsm8k_file_split: str | None = None) -> str | None:
    """The held-out set a question belongs to, or None. `gsm8k_file_split`: the GSM8K split
    the question was read from, for a question of a `gsm8k` source (None otherwise)."""
    found = arithmetic_set(question_of(question))
    if found is None and gsm8k_file_split is not None:
        split = gsm8k_split(question, gsm8k_file_split)
        found = None if split == "train" else f"gsm8k_{split}"
    return found


def first_user_question(messages) -> str:
    return next((m["content"] for m in messages if m.get("role") == "user"), "")


def gsm8k_question(messages, instruction: str | None = None) -> str:
    """The GSM8K question of a conversation or prompt: its first user turn, stripped, less an
    appended `instruction`."""
    question = first_user_question(messages).strip()
    suffix = f"\n\n{instruction.strip()}" if instruction and instruction.strip() else None
    return question[: -len(suffix)] if suffix and question.endswith(suffix) else question


def messages_held_out_set(messages, gsm8k_file_split: str | None = None, instruction: str | None = None) -> str | None:
    """The held-out set of a conversation or prompt, or None: any user turn against the arithmetic
    rule; its `gsm8k_question` against GSM8K's rules for a record read from GSM8K's
    `gsm8k_file_split` (None: not a GSM8K record)."""
    found = next((s for m in messages if m.get("role") == "user"
                  for s in [arithmetic_set(question_of(m["content"]))] if s), None)
    if found is None and gsm8k_file_split is not None:
        found = held_out_set(gsm8k_question(messages, instruction), gsm8k_file_split)
    return found


def conversation_held_out_set(messages, dev_slice: set[str] | None, gsm8k_file_split: str | None = None,
                              instruction: str | None = None) -> str | None:
    """`messages_held_out_set`, else `gsm8k_dev` when the first user turn (less `instruction`) is
    a question of GSM8K's dev slice `dev_slice` (`gsm8k_dev_questions`),
    whichever source the conversation came from."""
    found = messages_held_out_set(messages, gsm8k_file_split, instruction)
    if found is None and dev_slice and gsm8k_question(messages, instruction) in dev_slice:
        found = "gsm8k_dev"
    return found


def slice_digest(questions: Iterable[str]) -> dict:
    """What identifies a set of GSM8K dev slice questions: their count and the sha256 of their
    stripped texts, deduplicated and sorted, as a UTF-8 JSON list; a changed slice changes it."""
    texts = sorted({q.strip() for q in questions})
    return {"questions": len(texts),
            "sha256": hashlib.sha256(json.dumps(texts, ensure_ascii=False).encode("utf-8")).hexdigest()}


class HeldOut:
    """Counts the held-out problems a prep left out of its train data; `record()` is what the
    prep writes (`held_out` in a manifest or in HDF5 attrs)."""

    def __init__(self, dev_slice: set[str] | None = None) -> None:
        self.dropped: Counter = Counter()
        self.gsm8k_dev: set[str] = set()  # the GSM8K dev slice questions read
        self.dev_slice = dev_slice  # the slice known up front (`gsm8k_dev_questions`): held out in any source

    def note(self, found: str | None, messages, instruction: str | None = None) -> None:
        """Keep the question of a record in GSM8K's dev slice (`found` its held-out set)."""
        if found == "gsm8k_dev":
            self.gsm8k_dev.add(gsm8k_question(messages, instruction))

    def misplaced(self, messages, split: str, gsm8k_file_split: str | None = None,
                  instruction: str | None = None) -> str | None:
        """The held-out set of a record assigned to `split` when it belongs to another split's set
        (`conversation_held_out_set`; counted as dropped), else None; a GSM8K dev question is
        noted either way."""
        found = conversation_held_out_set(messages, self.dev_slice, gsm8k_file_split, instruction)
        self.note(found, messages, instruction)
        if found is None or found.endswith(f"_{split}"):
            return None
        self.dropped[found] += 1
        return found

    def excluded(self, messages, gsm8k_file_split: str | None = None) -> bool:
        """True (and counted) when the conversation is a held-out problem (`messages_held_out_set`),
        or its first user turn a question of `dev_slice`."""
        found = conversation_held_out_set(messages, self.dev_slice, gsm8k_file_split)
        self.note(found, messages)
        if found is not None:
            self.dropped[found] += 1
        return found is not None

    def record(self) -> dict:
        """`gsm8k_dev_slice`: the `slice_digest` of the dev slice questions read (None: no GSM8K
        train split read, or none of its questions in the slice)."""
        return {"sets": list(SETS), "rule": RULE, "dropped": {s: self.dropped[s] for s in SETS},
                "gsm8k_dev_slice": slice_digest(self.gsm8k_dev) if self.gsm8k_dev else None}


def check_record(record, where: str) -> None:
    """Refuse data whose prep did not record that it excluded every held-out set."""
    if not isinstance(record, dict) or set(SETS) - set(record.get("sets") or ()):
        raise SproutError(f"{where}: no held_out record (that the prep excluded the held-out problems "
                          f"{', '.join(SETS)}); written by an earlier version of sprout: prepare the data again")


def check_train_records(records: Iterable[tuple[str, str, list]], path, gsm8k_sources: dict[str, str] | None = None,
                        instruction: str | None = None, dev_slice: set[str] | None = None) -> None:
    """Refuse a train file holding a held-out problem, naming the file and the first such record.
    `records`: (id, source, prompt messages), checked by `conversation_held_out_set` (`dev_slice`:
    GSM8K's dev slice, held out in any source); `gsm8k_sources`: GSM8K source name -> the GSM8K
    split its records were read from ("train" or "test")."""
    gsm8k_sources = gsm8k_sources or {}
    for record_id, source, messages in records:
        found = conversation_held_out_set(messages, dev_slice, gsm8k_sources.get(source), instruction)
        if found is not None:
            raise SproutError(f"{path}: record {record_id!r} is a held-out problem ({found}); a train file must "
                              f"not hold dev or test problems: prepare the data again")


def check_train_jsonl(path, records: Iterable[dict]) -> str:
    """Refuse a JSONL train file (RL prompts, preference pairs: `id`, `source`, `prompt`) whose
    prep's manifest.json beside it has no `held_out` record, or that holds a held-out problem
    (`check_train_records`; GSM8K records are those of the manifest's `gsm8k` sources, read from
    GSM8K's test split when the source's `split` is test, else from its train split; GSM8K's dev
    slice, held out in any source, is read from the GSM8K train files the prep's config names,
    `prep_dev_slice`, where they can be read here). A file without a manifest beside it
    (made by hand) is scanned by the arithmetic rule alone. Returns what was checked, in words."""
    manifest_path = Path(path).parent / "manifest.json"
    gsm8k, instruction, dev_slice, slice_note = {}, None, None, "no manifest: the arithmetic rule only"
    if manifest_path.is_file():
        manifest = json.loads(manifest_path.read_text())
        check_record(manifest.get("held_out"), str(manifest_path))
        gsm8k = {name: "test" if s.get("split") == "test" else "train"
                 for name, s in manifest.get("sources", {}).items() if s.get("format") == "gsm8k"}
        instruction = manifest.get("instruction")
        dev_slice, slice_note, _ = prep_dev_slice(manifest.get("config") or {})
    check_train_records(((r["id"], r["source"], r["prompt"]) for r in records), path, gsm8k, instruction, dev_slice)
    return f"held-out problems: none in {path} (arithmetic dev and test; GSM8K dev: {slice_note})"


# ---- GSM8K's dev slice, as a prep read it -------------------------------------------------------
def is_gsm8k_dev(spec) -> bool:
    """Whether `spec` (a prep's source config) is GSM8K's dev slice: a `gsm8k` source with split `dev`."""
    return spec.format == "gsm8k" and spec.split == "dev"


def gsm8k_read_split(spec):
    """`spec` as it is read: GSM8K's dev slice (`is_gsm8k_dev`) reads GSM8K's train split, where it lives."""
    return dataclasses.replace(spec, split="train") if is_gsm8k_dev(spec) else spec


def gsm8k_dev_questions(specs, mirror=None, max_examples: int | None = None) -> set[str]:
    """The questions (stripped) of GSM8K's dev slice in the `gsm8k` sources among `specs` (a prep's
    source configs: `name`, `format`, `path`, `hub`, `hub_config`, `split`), each row's `question`
    field, the first `max_examples` rows of each source (as the SFT prep reads them): a `dev` source
    reads GSM8K's train split, as the prompt prep does; a `test` source is not read."""
    from sprout.prep.chat_sources import file_or_hub_rows, string_field

    questions: set[str] = set()
    for spec in specs:
        if spec.format != "gsm8k" or spec.split == "test":
            continue
        rows = file_or_hub_rows(gsm8k_read_split(spec), mirror)
        for n, (where, row) in enumerate(rows):
            if max_examples is not None and n >= max_examples:
                break
            question = string_field(row, "question", where).strip()
            if gsm8k_split(question) == "dev":
                questions.add(question)
    return questions


@dataclasses.dataclass(frozen=True)
class GSM8KFileSource:
    """What reading a GSM8K source of a prep's config needs (its `sources` entry's fields)."""
    name: str
    format: str = "gsm8k"
    path: str | None = None
    hub: str | None = None
    hub_config: str | None = None
    split: str = "train"


class DevSlice(NamedTuple):
    """GSM8K's dev slice as a trainer read it again from a prep's files (`prep_dev_slice`)."""
    questions: set[str] | None  # None: nothing read
    note: str  # what was read, or why not, in words
    whole: bool  # every GSM8K train-split source of the prep was read from a file (True when it has none)


def prep_dev_slice(prep_config: dict, max_examples: int | None = None) -> DevSlice:
    """GSM8K's dev slice as the prep whose config is `prep_config` read it (`gsm8k_dev_questions`
    on its GSM8K train-split sources, the first `max_examples` rows of each), from their files
    only, `${SPROUT_MIRROR}` filled by the prep's `mirror`, else this machine's; a source the prep
    read from the hub is named, not read again. Where no file can be read here, the prep's record
    is trusted (PPO and GRPO still hold a GSM8K source's own prompts to the slice's rule; SFT's
    packed rows do not name their source)."""
    from sprout.mirror import expand_path

    trusted = "the prep's record trusted"
    if not prep_config:
        return DevSlice(None, f"no prep config recorded, {trusted}", False)
    sources = [s for s in prep_config.get("sources") or [] if isinstance(s, dict) and s.get("format") == "gsm8k"
               and s.get("split", "train") != "test"]
    if not sources:
        return DevSlice(None, "the prep's config names no GSM8K train-split source", True)
    fields = [f.name for f in dataclasses.fields(GSM8KFileSource)]
    specs = [GSM8KFileSource(**{"name": "gsm8k", **{k: s[k] for k in fields if k in s}}) for s in sources]
    on_file, from_hub = [s for s in specs if s.path], [s.name for s in specs if not s.path]
    hub_note = f"; {', '.join(from_hub)} read from the hub, not read again" if from_hub else ""
    if not on_file:
        return DevSlice(None, f"GSM8K read from the hub by the prep, not read again, {trusted}", False)
    mirror = prep_config.get("mirror")
    try:
        questions = gsm8k_dev_questions([dataclasses.replace(s, hub=None) for s in on_file], mirror, max_examples)
    except (SproutError, OSError, ValueError) as exc:
        return DevSlice(None, f"GSM8K's train file not readable here ({str(exc).splitlines()[0]}), {trusted}", False)
    files = ", ".join(sorted({expand_path(s.path, mirror) for s in on_file}))
    return DevSlice(questions, f"{len(questions)} questions of GSM8K's dev slice, from {files}{hub_note}", not from_hub)


# ---- packed SFT files: the conversations themselves -------------------------------------------
def sft_user_turns(path, tok, tpl) -> Iterator[tuple[int, list[dict]]]:
    """(row, its user turns as messages) for each conversation packed in the SFT file `path`:
    `sprout.chat.segment` with the template `tpl` it was rendered with, each user turn's content
    decoded by `tok`. A conversation that does not parse is refused, naming the row."""
    from sprout.chat import ChatError, segment
    from sprout.formats.packed_sft import SFTFile, conversation_spans

    with SFTFile(path) as f:
        for first, block in f.blocks(("tokens", "segment_ids")):
            length = block["tokens"].shape[1]
            for r, (ids, seg) in enumerate(zip(block["tokens"], block["segment_ids"]), start=first):
                for a, b in conversation_spans(seg):
                    try:
                        turns = segment(ids[a:b], tpl, allow_open_end=b == length)
                    except ChatError as exc:
                        raise SproutError(f"{path}: row {r}: a conversation that does not parse ({exc.detail}); "
                                          f"check the file with scripts/check_loss_mask.py") from None
                    yield r, [{"role": "user", "content": tok.decode(ids[a + t.content_start:a + t.end].tolist())}
                              for t in turns if t.role == "user"]


def check_sft_examples(path, examples: Iterable[tuple[int, list[dict]]], gsm8k_dev: set[str] | None) -> int:
    """Refuse a packed SFT train file holding a held-out problem, naming the file, the row and
    the set: `examples` are (row, user turns) (`sft_user_turns`); a user turn whose question is a
    held-out arithmetic one, or a first user turn that is a question of GSM8K's dev slice
    (`gsm8k_dev`, when it could be read: `prep_dev_slice`), as the SFT prep decides. Returns the
    number of conversations checked."""
    n = 0
    for row, messages in examples:
        n += 1
        found = conversation_held_out_set(messages, gsm8k_dev)
        if found is not None:
            question = question_of(first_user_question(messages))
            raise SproutError(f"{path}: row {row} holds a held-out problem ({found}: {question[:60]!r}); a train "
                              f"file must not hold dev or test problems: prepare the data again")
    return n
