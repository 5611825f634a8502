"""What every trainer checks of its inputs before its first step: that the files are the ones
prep wrote. The rules of a token folder's files (`check_listed`, `check_file`,
`check_content`) are also what `sprout.formats.audit_tokens` (`scripts/verify_shards.py`) runs.

- `verify_token_data`: `.bin` shards, or a `*_train.h5` and its `_val` sibling, each listed in
  the `manifest.json` beside them (`sprout.formats.manifest`);
- `verify_sft_pair`: sft.h5 + sft_val.h5 (`sprout.formats.packed_sft`);
- `verify_jsonl_data`: preference pairs and RL prompts (JSONL, with the prep's manifest).

Each raises SproutError naming the file at the first failure and returns a `DataCheck` whose
`line()` says what was checked and how long it took. Mode "full" hashes every byte; "sizes"
checks presence, sizes and counts only and trusts the recorded largest id (`data.verify`); its
line names the checks it skipped (`DataCheck.skipped`). The tokenizer the data records is
checked by the trainers themselves (`sprout.tokenizer_files.load_recorded`), which load it.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from sprout.atomic import sha256_file
from sprout.errors import SproutError
from sprout.formats import manifest as mf
from sprout.formats.h5tokens import open_tokens_h5
from sprout.formats.shards import HEADER_BYTES, open_shard, read_header
from sprout.tokenizer_files import Record

BLOCK = 1 << 22  # tokens read per block when scanning a file's ids

VERIFY_MODES = ("full", "sizes")  # full: sha256 of every byte; sizes: presence, sizes, counts only
LARGE_DATA = 256 << 20            # show a progress bar (rank 0) when hashing more than this
TOKEN_SUFFIXES = (".bin", ".h5")  # the files of a token folder, each listed in its manifest
SKIPPED = {  # what mode "sizes" does not check, by kind of data (`DataCheck.line` names it)
    "tokens": ("token ids against the vocabulary (the manifest's max_token_id is trusted, the ids are not read)",),
    "sft": ("the rows' layout (loss mask, segments, positions: scripts/check_loss_mask.py checks it)",
            "the conversations against the held-out problems (the prep's record is trusted)"),
    "prompt": ("prompts and golds against the manifest (an edit after prep goes unnoticed)",),
    "preference": ("pairs against the manifest (an edit after prep goes unnoticed)",),
}


@dataclass
class DataCheck:
    """What start-up verification found: files and bytes checked, whether they were hashed,
    the data's vocab size and tokenizer spec (None when unknown), the largest token id and
    the file that holds it (-1 and "" when the data has no token ids, e.g. preference JSONL)."""

    files: int = 0
    bytes: int = 0
    seconds: float = 0.0
    hashed: bool = True
    vocab_size: int | None = None
    tokenizer: str | None = None
    tokenizer_fingerprint: str | None = None  # the tokenizer's fingerprint, as prep recorded it
    tokenizer_record: Record | None = None  # the tokenizer's files as prep recorded them
    max_token_id: int = -1
    max_where: str = ""
    notes: list = field(default_factory=list)
    skipped: tuple = ()  # what mode "sizes" left unchecked, said once by `line`

    def saw(self, top: int, where) -> None:
        if top > self.max_token_id:
            self.max_token_id, self.max_where = top, str(where)

    def report(self, what: str = "files") -> str:
        """The notes, then `line`, one per line: what a trainer prints at start."""
        return "\n".join([*(f"note: {n}" for n in self.notes), f"data: {self.line(what)}"])

    def line(self, what: str = "files") -> str:
        """e.g. "verified 12 shards (1.1 GB) in 1.0 s"."""
        size = f"{self.bytes / 1e9:.1f} GB" if self.bytes >= 1e8 else f"{self.bytes / 1e6:.1f} MB"
        if self.hashed:
            return f"verified {self.files} {what} ({size}) in {self.seconds:.1f} s"
        return (f"checked {self.files} {what} ({size}) in {self.seconds:.1f} s: presence and sizes only, "
                f"sha256 skipped (data.verify sizes)" + "".join(f"; not checked: {s}" for s in self.skipped))


def _check_mode(mode: str) -> None:
    if mode not in VERIFY_MODES:
        raise SproutError(f"data.verify must be one of {', '.join(VERIFY_MODES)}, not {mode!r}")


def _bar(total: int, show: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc="verify data", dynamic_ncols=True,
                disable=not (show and total > LARGE_DATA))


# ---- the rules of a token folder's files --------------------------------------------------------

def check_listed(path: Path, man: dict) -> None:
    """A `.bin` or `.h5` file in a token folder must be listed in its manifest."""
    listed = {e["file"] for entries in man["shards"].values() for e in entries} | {e["file"] for e in man["hdf5"].values()}
    if path.name not in listed:
        raise SproutError(f"{path}: not listed in {path.parent / mf.MANIFEST} (a stale file or another prep's); "
                          f"remove it or prepare the data again")


def check_file(path: Path, entry: dict, man: dict) -> None:
    """Presence, contract, dtype and token count of one listed file (and, for HDF5, the
    tokenizer attributes), against the manifest: what mode "sizes" checks."""
    man_path, dtype, tok = path.parent / mf.MANIFEST, np.dtype(man["token_dtype"]).newbyteorder("<"), man["tokenizer"]
    if not path.is_file():
        raise SproutError(f"{path}: file listed in {man_path} is missing")
    if path.suffix == ".bin":
        header = read_header(path)  # magic, version, size against the header's count
        got, count = header.dtype, header.num_tokens
    else:
        h5 = open_tokens_h5(path)  # the contract, naming the file
        got, count = h5.tokens.dtype, len(h5)
        h5.close()
        for attr, want in (("vocab_size", tok["vocab_size"]), ("eot_id", tok["eot_id"]),
                           ("tokenizer_fingerprint", tok["fingerprint"])):
            if h5.attrs.get(attr) != want:
                raise SproutError(f"{path}: attribute {attr}={h5.attrs.get(attr)!r} but {man_path} says {want!r} "
                                  f"(another prep run's file?)")
    if got != dtype:
        raise SproutError(f"{path}: holds {got.name} ids but {man_path} says {dtype.name}")
    if count != entry["num_tokens"]:
        raise SproutError(f"{path}: holds {count:,} tokens but {man_path} says {entry['num_tokens']:,} "
                          f"(from another prep run?)")


def check_content(path: Path, entry: dict, man: dict, mode: str, bar=None) -> int:
    """The bytes and ids of one file that passed `check_file`: with mode "full" its sha256 (and an
    HDF5 file's `tokens_sha256`) and its largest id, read in the same pass, equal to what the
    manifest records; in every mode the largest id below the vocab size. Returns that id."""
    man_path, vocab = path.parent / mf.MANIFEST, man["tokenizer"]["vocab_size"]
    if mode == "full":
        digest, top = _hash_ids(path, bar)
        if digest != entry["sha256"]:
            raise SproutError(f"{path}: sha256 {digest[:16]}… does not match {man_path}'s {entry['sha256'][:16]}… "
                              f"(corrupted, or the manifest is another prep run's)")
        if top != entry["max_token_id"]:
            raise SproutError(f"{path}: largest token id is {top:,} but {man_path} records max_token_id "
                              f"{entry['max_token_id']:,} (the file or the manifest was changed after prep)")
    else:
        top = entry["max_token_id"]
    if top >= vocab:
        raise SproutError(f"{path}: token id {top:,} at position {_first_at_or_above(path, vocab):,} is >= vocab size "
                          f"{vocab:,} of {man['tokenizer']['spec'] or 'the data'}")
    return top


def _hash_ids(path: Path, bar) -> tuple[str, int]:
    """(sha256 of the file's bytes, largest token id, -1 when none). A `.bin` shard in one
    streaming pass of 1 MiB blocks; an HDF5 file's tokens are also checked against its
    `tokens_sha256`."""
    if path.suffix != ".bin":
        h5 = open_tokens_h5(path)
        try:
            sha, top = hashlib.sha256(), -1
            for block in h5.iter_blocks(BLOCK):
                sha.update(block.astype(h5.tokens.dtype.newbyteorder("<"), copy=False).tobytes())
                top = max(top, int(block.max())) if len(block) else top
                if bar is not None:
                    bar.update(block.nbytes)
            if sha.hexdigest() != h5.attrs["tokens_sha256"]:
                raise SproutError(f"{path}: tokens do not match their tokens_sha256 attribute (corrupted)")
        finally:
            h5.close()
        return sha256_file(path), top
    dtype, h, top = read_header(path).dtype, hashlib.sha256(), -1
    buf = bytearray(1 << 20)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        h.update(f.read(HEADER_BYTES))
        while n := f.readinto(buf):
            h.update(view[:n])
            if n >= dtype.itemsize:
                top = max(top, int(np.frombuffer(buf, dtype, count=n // dtype.itemsize).max()))
            if bar is not None:
                bar.update(n)
    return h.hexdigest(), top


def token_blocks(path: Path):
    """The ids of a `.bin` shard or HDF5 token file, `BLOCK` at a time."""
    if path.suffix == ".bin":
        tokens = open_shard(path)
        for start in range(0, len(tokens), BLOCK):
            yield np.asarray(tokens[start : start + BLOCK])
        return
    h5 = open_tokens_h5(path)
    try:
        yield from h5.iter_blocks(BLOCK)
    finally:
        h5.close()


def _first_at_or_above(path: Path, vocab: int) -> int:
    """The position of the first id >= `vocab` in a token file (read again: only on a failure)."""
    start = 0
    for block in token_blocks(path):
        hits = np.flatnonzero(block >= vocab)
        if hits.size:
            return start + int(hits[0])
        start += len(block)
    return -1


# ---- what trainers call -------------------------------------------------------------------------

def verify_token_data(path: str | Path, mode: str = "full", show_progress: bool = False) -> DataCheck:
    """Check a pretraining input before training: a folder of `.bin` shards or a `*_train.h5`
    file and its `_val` sibling. The manifest beside them must be valid, list every `.bin` and
    `.h5` file of the folder (`check_listed`) and the files read; each of those passes
    `check_file` and `check_content`. Raises SproutError naming the file at the first failure."""
    _check_mode(mode)
    t0, path = time.perf_counter(), Path(path)
    check = DataCheck(hashed=mode == "full", skipped=SKIPPED["tokens"] if mode == "sizes" else ())
    hdf5 = path.suffix in (".h5", ".hdf5")
    if hdf5 and not path.name.endswith(f"_train{path.suffix}"):
        raise SproutError(f"{path}: expected an HDF5 training file named <dataset>_train{path.suffix}")
    if not hdf5 and not path.is_dir():
        raise SproutError(f"{path}: shard directory does not exist")
    directory = path.parent if hdf5 else path
    man = mf.read_manifest(directory)
    tok = man["tokenizer"]
    check.vocab_size, check.tokenizer, check.tokenizer_fingerprint = tok["vocab_size"], tok["spec"] or None, tok["fingerprint"] or None
    check.tokenizer_record = mf.tokenizer_record(man, directory / mf.MANIFEST)
    for p in sorted(directory.iterdir()):
        if p.suffix in TOKEN_SUFFIXES:
            check_listed(p, man)
    if hdf5:
        files = [path, path.with_name(path.name[: -len(f"train{path.suffix}")] + "val" + path.suffix)]
        for p in files:
            check_listed(p, man)
        by_file = {e["file"]: e for e in man["hdf5"].values()}
        entries = [by_file[p.name] for p in files]
    elif not man["shards"].get("train"):
        raise SproutError(f"{directory / mf.MANIFEST}: lists no train .bin shards (an HDF5-only dataset: "
                          f"pass its *_train.h5 file)")
    else:
        entries = [e for split in ("train", "val") for e in man["shards"].get(split, [])]
    for e in entries:
        check_file(directory / e["file"], e, man)
    check.files, check.bytes = len(entries), sum((directory / e["file"]).stat().st_size for e in entries)
    with _bar(check.bytes if mode == "full" else 0, show_progress) as bar:
        for e in entries:
            check.saw(check_content(directory / e["file"], e, man, mode, bar), directory / e["file"])
    check.seconds = time.perf_counter() - t0
    return check


def verify_sft_pair(train: str | Path, val: str | Path, mode: str = "full", show_progress: bool = False) -> DataCheck:
    """Check an SFT train file and its val file before training (`sprout.formats.packed_sft`).

    Both must open as the contract, say split "train" and "val", and carry the same
    `prep_run_id`, which must still match the config, command and dataset sha256s the files
    record (`run_id_of`). With mode "full" every dataset is read block by block and must match
    the sha256 its file records, and every row must keep the layout rules of
    `sprout.formats.maskcheck_sft.check_layout`. With mode "sizes" the token ids are still read
    for the largest one, which must be below the vocabulary."""
    from sprout.formats.maskcheck_sft import Report, check_layout
    from sprout.formats.packed_sft import SFTFile, run_id_of

    _check_mode(mode)
    t0, paths = time.perf_counter(), (Path(train), Path(val))
    check = DataCheck(hashed=mode == "full", skipped=SKIPPED["sft"] if mode == "sizes" else ())
    files = [SFTFile(p) for p in paths]
    try:
        for f, split in zip(files, ("train", "val")):
            if f.attrs["split"] != split:
                raise SproutError(f"{f.path}: holds the {f.attrs['split']!r} split, expected {split!r}")
            if "prep_run_id" not in f.attrs:
                raise SproutError(f"{f.path}: no prep_run_id (written by an earlier version of sprout); "
                                  f"prepare the data again")
        ids = [f.attrs["prep_run_id"] for f in files]
        if ids[0] != ids[1]:
            raise SproutError(f"{paths[1]}: prep_run_id {ids[1]!r} differs from the train file {paths[0]}'s "
                              f"{ids[0]!r}: the two files come from different prep runs; prepare the data again")
        if run_id_of([(f.attrs, f.attrs["sha256"]) for f in files]) != ids[0]:
            raise SproutError(f"{paths[0]}: prep_run_id {ids[0]!r} does not match the config, command and dataset "
                              f"sha256s the pair records (changed after prep); prepare the data again")
        check.vocab_size, check.tokenizer = files[0].attrs["vocab_size"], files[0].attrs["tokenizer_spec"]
        check.files, check.bytes = 2, sum(p.stat().st_size for p in paths)
        with _bar(check.bytes if mode == "full" else 0, show_progress) as bar:
            for f in files:
                broken: list[str] = []  # the first layout violation, reported once the hashes match

                def scan(start: int, block: dict, f=f, broken=broken) -> None:
                    if mode == "full" and not broken:
                        report = Report(limit=1)
                        check_layout(block, f.attrs["pad_id"], check.vocab_size, report)
                        if report.violations:
                            v = report.violations[0]
                            broken.append(f"{f.path}: row {start + v.row} position {v.position}: {v.message} "
                                          f"(changed after prep; scripts/check_loss_mask.py shows the rows)")
                    if block["tokens"].size:
                        check.saw(int(block["tokens"].max()), f.path)

                if mode == "full":
                    f.check_hashes(progress=bar.update, each_block=scan)
                    if broken:
                        raise SproutError(broken[0])
                else:
                    for start, block in f.blocks(names=("tokens",)):
                        scan(start, block)
                if check.max_token_id >= check.vocab_size:
                    raise SproutError(f"{check.max_where}: token id {check.max_token_id:,} is >= vocab size "
                                      f"{check.vocab_size:,} of {check.tokenizer or 'the data'}")
    finally:
        for f in files:
            f.close()
    check.seconds = time.perf_counter() - t0
    return check


def verify_jsonl_data(path: str | Path, val_path: str | Path | None = None, mode: str = "full",
                      kind: str = "preference") -> DataCheck:
    """Check the JSONL files of a prep that writes `manifest.json` beside them with
    `files.<split>.{path, sha256}` (preference pairs, `sprout.formats.preference_pairs`; RL prompts,
    `sprout.formats.prompts`; `kind` names which in messages): each given file (the train file
    `path`, and `val_path` when given) must be listed under `files` and, with mode "full", match
    its sha256. Without a manifest nothing is compared (a hand-made file): a note says so.
    Records themselves are checked as they are read (`read_preferences`, `read_prompts`)."""
    _check_mode(mode)
    t0 = time.perf_counter()
    paths = [Path(p) for p in (path, val_path) if p is not None]
    check = DataCheck(hashed=mode == "full", skipped=SKIPPED.get(kind, ()) if mode == "sizes" else ())
    for p in paths:
        if not p.is_file():
            raise SproutError(f"{p}: no such {kind} file")
    check.files, check.bytes = len(paths), sum(p.stat().st_size for p in paths)
    for p in paths:
        man_path = p.parent / "manifest.json"
        if not man_path.is_file():
            check.notes.append(f"{p}: no manifest.json beside it: sha256 not checked")
            continue
        try:
            listed = {e["path"]: e for e in json.loads(man_path.read_text())["files"].values()}
        except (ValueError, KeyError, TypeError, AttributeError):
            raise SproutError(f"{man_path}: not a {kind} manifest (no files.<split>.path/sha256)") from None
        entry = listed.get(p.name)
        if entry is None:
            raise SproutError(f"{p}: not listed in {man_path} (another prep run's file?)")
        if mode == "full" and sha256_file(p) != entry.get("sha256"):
            raise SproutError(f"{p}: sha256 does not match {man_path} (edited, or from another prep run)")
    check.seconds = time.perf_counter() - t0
    return check
