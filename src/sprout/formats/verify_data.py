"""What every trainer verifies before its first step: that the files it is about to read are the
ones prep wrote (`scripts/verify_shards.py`'s full audit is `sprout.formats.verify.verify_dir`).

- `verify_token_data`: pretraining shards (`.bin` + manifest.json) or HDF5 (`*_train.h5` and
  its `_val` sibling);
- `verify_sft_pair`: sft.h5 + sft_val.h5;
- `verify_jsonl_data`: preference pairs and RL prompts (JSONL, with the prep's manifest).

Each raises SproutError naming the file at the first failure and returns a `DataCheck` whose
`line()` says what was checked and how long it took. Mode "full" hashes every byte; "sizes"
checks presence, sizes and counts only (`data.verify` of every trainer).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from sprout.formats import manifest as mf
from sprout.atomic import sha256_file
from sprout.errors import SproutError
from sprout.formats.h5tokens import open_tokens_h5
from sprout.formats.shards import HEADER_BYTES, open_shard, read_header

BLOCK = 1 << 22  # tokens read per block when scanning a file's ids

VERIFY_MODES = ("full", "sizes")  # full: sha256 of every byte; sizes: presence, sizes, counts only
LARGE_DATA = 256 << 20            # show a progress bar (rank 0) when hashing more than this


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
    tokenizer_fingerprint: str | None = None  # the sha256 of the tokenizer's file, as prep recorded it
    max_token_id: int = -1
    max_where: str = ""
    notes: list = field(default_factory=list)

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
                f"sha256 skipped (data.verify sizes)")


def _check_mode(mode: str) -> None:
    if mode not in VERIFY_MODES:
        raise SproutError(f"data.verify must be one of {', '.join(VERIFY_MODES)}, not {mode!r}")


def _bar(total: int, show: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc="verify data", dynamic_ncols=True,
                disable=not (show and total > LARGE_DATA))


def _hash_ids(path: Path, offset: int, dtype: np.dtype | None, bar) -> tuple[str, int]:
    """(sha256 of the file's bytes, largest id in the bytes after `offset`), in one streaming
    pass of 1 MiB blocks; the largest id is -1 when `dtype` is None or there are no ids."""
    h, top = hashlib.sha256(), -1
    buf = bytearray(1 << 20)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        head = f.read(offset)
        h.update(head)
        bar.update(len(head))
        while n := f.readinto(buf):
            h.update(view[:n])
            if dtype is not None and n >= dtype.itemsize:
                top = max(top, int(np.frombuffer(buf, dtype, count=n // dtype.itemsize).max()))
            bar.update(n)
    return h.hexdigest(), top


def _max_id(tokens) -> int:
    """Largest id of a 1-D token array (memmap or h5py dataset), block by block; -1 if empty."""
    top = -1
    for start in range(0, len(tokens), BLOCK):
        block = np.asarray(tokens[start : start + BLOCK])
        if len(block):
            top = max(top, int(block.max()))
    return top


def _check_ids(check: DataCheck, path: Path, top: int, recorded, man_path: Path | None) -> None:
    """The largest id read must be the one the manifest records and below the data's vocab."""
    if recorded is not None and top != recorded:
        raise SproutError(f"{path}: largest token id is {top:,} but {man_path} records max_token_id {recorded:,} "
                          f"(the shard or the manifest was changed after prep)")
    if check.vocab_size is not None and top >= check.vocab_size:
        raise SproutError(f"{path}: token id {top:,} is >= vocab size {check.vocab_size:,} of {check.tokenizer or 'the data'}")
    check.saw(top, path)


def verify_token_data(path: str | Path, mode: str = "full", show_progress: bool = False) -> DataCheck:
    """Check a pretraining input before training: a folder of `.bin` shards or a `*_train.h5` file.

    Folder: `manifest.json` must be there and valid; every `.bin` in the folder must be listed in
    it (no stale or foreign shard is read); each listed shard must exist with a valid header,
    the manifest's token count and dtype (so its size is exact); with mode "full" its sha256
    must match and its ids, read in the same pass, must top out at the manifest's
    `max_token_id` and stay below the tokenizer's vocab size. With "sizes" the hashes are
    skipped and the recorded `max_token_id` is trusted (a manifest without one, from an older
    prep: the ids are scanned instead, about as fast as reading the files).
    HDF5: the train file and its `_val` sibling are opened and validated
    (`sprout.formats.h5tokens`); with a `manifest.json` beside them each must be listed there
    and (full) match its sha256 and token count; without one, (full) the tokens must match
    their own `tokens_sha256` attribute. Raises SproutError naming the file at the first failure.
    """
    _check_mode(mode)
    t0, path = time.perf_counter(), Path(path)
    check = DataCheck(hashed=mode == "full")
    if path.suffix in (".h5", ".hdf5"):
        _verify_h5_pair(path, mode, show_progress, check)
    else:
        _verify_shard_folder(path, mode, show_progress, check)
    check.seconds = time.perf_counter() - t0
    return check


def _verify_shard_folder(directory: Path, mode: str, show: bool, check: DataCheck) -> None:
    if not directory.is_dir():
        raise SproutError(f"{directory}: shard directory does not exist")
    man = mf.read_manifest(directory)
    man_path = directory / mf.MANIFEST
    tok = man["tokenizer"]
    check.vocab_size, check.tokenizer = tok["vocab_size"], tok["spec"] or None
    check.tokenizer_fingerprint = tok.get("fingerprint") or None
    dtype = np.dtype(man["token_dtype"]).newbyteorder("<")
    entries = [e for split in ("train", "val") for e in man["shards"].get(split, [])]
    listed = {e["file"] for e in entries}
    for p in sorted(directory.glob("*.bin")):
        if p.name not in listed:
            raise SproutError(f"{p}: not listed in {man_path} (a stale shard or another prep's); "
                              f"remove it or prepare the data again")
    if not man["shards"].get("train"):
        raise SproutError(f"{man_path}: lists no train .bin shards (an HDF5-only dataset: pass its *_train.h5 file)")
    headers = []
    for e in entries:
        p = directory / e["file"]
        if not p.is_file():
            raise SproutError(f"{p}: shard listed in {man_path} is missing")
        header = read_header(p)  # magic, version, size against the header's count
        if header.dtype != dtype:
            raise SproutError(f"{p}: shard holds {header.dtype.name} ids but {man_path} says {dtype.name}")
        if header.num_tokens != e["num_tokens"]:
            raise SproutError(f"{p}: holds {header.num_tokens:,} tokens but {man_path} says {e['num_tokens']:,} "
                              f"(from another prep run?)")
        headers.append(p.stat().st_size)
    check.files, check.bytes = len(entries), sum(headers)
    with _bar(check.bytes, show) as bar:
        for e in entries:
            p = directory / e["file"]
            if mode == "full":
                digest, top = _hash_ids(p, HEADER_BYTES, dtype, bar)
                if digest != e["sha256"]:
                    raise SproutError(f"{p}: sha256 {digest[:16]}… does not match {man_path}'s {e['sha256'][:16]}… "
                                      f"(corrupted, or the manifest is another prep run's)")
            elif "max_token_id" in e:
                top = int(e["max_token_id"])
            else:
                top = _max_id(open_shard(p))
                bar.update(p.stat().st_size)
            _check_ids(check, p, top, e.get("max_token_id"), man_path)
    if mode == "sizes" and any("max_token_id" not in e for e in entries):
        check.notes.append(f"{man_path} has no max_token_id (older prep): token ids were scanned")


def _verify_h5_pair(path: Path, mode: str, show: bool, check: DataCheck) -> None:
    if not path.name.endswith(f"_train{path.suffix}"):
        raise SproutError(f"{path}: expected an HDF5 training file named <dataset>_train{path.suffix}")
    files = [path, path.with_name(path.name[: -len(f"train{path.suffix}")] + "val" + path.suffix)]
    man_path = path.parent / mf.MANIFEST
    man = mf.read_manifest(path.parent) if man_path.is_file() else None
    if man is not None:
        check.vocab_size, check.tokenizer = man["tokenizer"]["vocab_size"], man["tokenizer"]["spec"] or None
        check.tokenizer_fingerprint = man["tokenizer"].get("fingerprint") or None
        by_file = {e["file"]: e for e in man["hdf5"].values()}
    check.files, check.bytes = len(files), sum(p.stat().st_size for p in files if p.is_file())
    with _bar(check.bytes, show) as bar:
        for p in files:
            h5 = open_tokens_h5(p)  # validates the contract, names the file
            try:
                if check.vocab_size is None:
                    check.vocab_size, check.tokenizer = int(h5.attrs["vocab_size"]), h5.attrs.get("tokenizer_spec")
                    check.tokenizer_fingerprint = h5.attrs.get("tokenizer_fingerprint") or None
                elif int(h5.attrs["vocab_size"]) != check.vocab_size:
                    raise SproutError(f"{p}: vocab_size {h5.attrs['vocab_size']} differs from {files[0]}'s {check.vocab_size}")
                entry = None
                if man is not None:
                    entry = by_file.get(p.name)
                    if entry is None:
                        raise SproutError(f"{p}: not listed in {man_path} (another prep run's file?)")
                    if entry["num_tokens"] != len(h5):
                        raise SproutError(f"{p}: holds {len(h5):,} tokens but {man_path} says {entry['num_tokens']:,}")
                    if h5.attrs["tokenizer_fingerprint"] != man["tokenizer"]["fingerprint"]:
                        raise SproutError(f"{p}: tokenizer_fingerprint differs from {man_path}'s (another prep run's file?)")
                if mode == "full":
                    sha = hashlib.sha256()
                    top = -1
                    for block in h5.iter_blocks(BLOCK):
                        sha.update(block.astype(h5.tokens.dtype.newbyteorder("<"), copy=False).tobytes())
                        top = max(top, int(block.max())) if len(block) else top
                        bar.update(block.nbytes)
                    if sha.hexdigest() != h5.attrs["tokens_sha256"]:
                        raise SproutError(f"{p}: tokens do not match their tokens_sha256 attribute (corrupted)")
                elif entry is not None and "max_token_id" in entry:
                    top = int(entry["max_token_id"])
                else:
                    top = _max_id(h5.tokens)
            finally:
                h5.close()
            if mode == "full" and entry is not None:
                digest = sha256_file(p)
                if digest != entry["sha256"]:
                    raise SproutError(f"{p}: sha256 {digest[:16]}… does not match {man_path}'s {entry['sha256'][:16]}… "
                                      f"(corrupted, or the manifest is another prep run's)")
            _check_ids(check, p, top, entry.get("max_token_id") if entry else None, man_path)
    if man is None:
        check.notes.append(f"{path.parent}: no {mf.MANIFEST} beside the HDF5 files: checked against their own attributes")


def verify_sft_pair(train: str | Path, val: str | Path, mode: str = "full", show_progress: bool = False) -> DataCheck:
    """Check an SFT train file and its val file before training (`sprout.formats.packed_sft`).

    Both must open as the contract, say split "train" and "val", and carry the same
    `prep_run_id` (the id of the prep run that wrote them together): a pair from two runs,
    e.g. after a killed prep, is refused, and so is an id that no longer matches the config,
    command and dataset sha256s the files record (`run_id_of`: a recorded sha256 rewritten
    after an edit). With mode "full" every dataset is read block by block and must match the
    sha256 its file records, and every row must keep the layout rules of
    `sprout.formats.maskcheck_sft.check_layout` (ids inside the vocabulary, loss_mask 0/1, never 1
    on padding nor at position 0: an all-ones mask is refused however its hashes were
    rewritten). With mode "sizes" the token ids are still read for the largest one, which must
    be below the vocabulary. Files from a prep older than `prep_run_id` pass the pair checks
    with a note."""
    from sprout.formats.maskcheck_sft import Report, check_layout
    from sprout.formats.packed_sft import SFTFile, run_id_of

    _check_mode(mode)
    t0, paths = time.perf_counter(), (Path(train), Path(val))
    check = DataCheck(hashed=mode == "full")
    files = [SFTFile(p) for p in paths]
    try:
        for f, split in zip(files, ("train", "val")):
            if f.attrs["split"] != split:
                raise SproutError(f"{f.path}: holds the {f.attrs['split']!r} split, expected {split!r}")
        ids = [f.attrs.get("prep_run_id") for f in files]
        if ids[0] != ids[1]:
            raise SproutError(f"{paths[1]}: prep_run_id {ids[1]!r} differs from the train file {paths[0]}'s "
                              f"{ids[0]!r}: the two files come from different prep runs; prepare the data again")
        if ids[0] is None:
            check.notes.append(f"{paths[0]}: no prep_run_id (older prep): train/val pairing not checked")
        elif run_id_of([(f.attrs, f.attrs["sha256"]) for f in files]) != ids[0]:
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
    check = DataCheck(hashed=mode == "full")
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
