"""The `manifest.json` contract: what a folder of pretraining tokens holds and how it was made.

Written last and atomically by `sprout.prep.pretrain` (the old one removed first), so a folder
without one is unfinished. It lists every `.bin` shard and `.h5` file with its token count,
sha256 and largest id, the tokenizer with its fingerprint (and an hf: tokenizer's side files'
sha256), the split rule, the per-source counts and the command; its fields are in
`read_manifest`'s docstring, which refuses anything else naming the file and field.
`check_output_dir` refuses to write into a folder holding another dataset's outputs.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path

from sprout.atomic import sha256_file, write_json_atomic
from sprout.errors import SproutError
from sprout.tokenizer_files import Record, side_files_sha256

FORMAT = "sprout-pretrain-v1"
MANIFEST = "manifest.json"
SIDECAR = "doc_hashes.npz"
REQUIRED = {"format": str, "dataset": str, "tokenizer": dict, "token_dtype": str, "shards": dict,
            "hdf5": dict, "splits": dict, "sources": list, "split_rule": dict, "doc_hashes": dict,
            "command": list}
TOKENIZER_REQUIRED = {"spec": str, "name": str, "vocab_size": int, "eot_id": int, "fingerprint": str}
OUTPUT_FILE = re.compile(r"^(?P<dataset>.+)_(?P<split>train|val)(_\d{6}\.bin|\.h5)$")
TEMPORARY = re.compile(r"^\.tmp-(?P<name>.+)\.[^.]+$")  # sprout.atomic's `.tmp-<final name>.<random>`



def tokenizer_info(tok) -> dict:
    """The manifest's `tokenizer` record of `tok` (`read_manifest`)."""
    sides = side_files_sha256(tok)
    return {"spec": tok.spec, "name": tok.name, "vocab_size": int(tok.vocab_size), "eot_id": int(tok.eot_id),
            "bos_id": tok.bos_id, "pad_id": tok.pad_id, "fingerprint": tok.fingerprint(),
            **({"side_sha256": sides} if sides is not None else {})}


def tokenizer_record(man: dict, path: Path) -> Record | None:
    """What the manifest `path` (read with `read_manifest` as `man`) records of the tokenizer its
    data was prepared with (`sprout.tokenizer_files.load_recorded` checks it); None when it names
    none (spec "", data made outside prep)."""
    tok = man["tokenizer"]
    if not tok["spec"]:
        return None
    return Record(tok["fingerprint"], tok.get("side_sha256"), str(path),
                  ("tokenizer.fingerprint", "tokenizer.side_sha256"))


def write_manifest(directory: str | os.PathLike, manifest: dict) -> Path:
    path = Path(directory) / MANIFEST
    write_json_atomic(path, dict(manifest, format=FORMAT))
    return path


def write_shard_manifest(directory: str | os.PathLike, dataset: str, vocab_size: int, eot_id: int = 0) -> Path:
    """A manifest for `.bin` shards made outside prep (synthetic test or benchmark data): each
    `<dataset>_<split>_NNNNNN.bin` in the folder with its token count, sha256 and largest id;
    the tokenizer is unnamed (spec "", no fingerprint), sources and split rule empty."""
    from sprout.formats.shards import SHARD_RE, open_shard, read_header

    directory = Path(directory)
    shards: dict = {"train": [], "val": []}
    dtype = None
    for p in sorted(directory.glob("*.bin")):
        m = SHARD_RE.match(p.name)
        if m and m.group("dataset") == dataset:
            header, tokens = read_header(p), open_shard(p)
            dtype = header.dtype.name
            shards[m.group("split")].append({"file": p.name, "num_tokens": header.num_tokens, "sha256": sha256_file(p),
                                             "max_token_id": int(tokens.max()) if len(tokens) else -1})
    splits = {k: {"documents": 0, "tokens": sum(e["num_tokens"] for e in v)} for k, v in shards.items()}
    return write_manifest(directory, {
        "dataset": dataset, "token_dtype": dtype or "uint16", "shards": shards, "hdf5": {}, "splits": splits,
        "tokenizer": {"spec": "", "name": "none", "vocab_size": int(vocab_size), "eot_id": int(eot_id),
                      "bos_id": None, "pad_id": None, "fingerprint": ""},
        "sources": [], "split_rule": {}, "doc_hashes": {}, "command": []})


def read_manifest(directory: str | os.PathLike) -> dict:
    """Load and validate `DIR/manifest.json`: a JSON object (* = required):

        format*       "sprout-pretrain-v1"
        dataset*      the file name prefix: `<dataset>_<split>_<6 digits>.bin`, `<dataset>_<split>.h5`
        tokenizer*    {spec*, name*, vocab_size*, eot_id*, bos_id, pad_id, fingerprint*, side_sha256};
                      fingerprint: `Tokenizer.fingerprint()`, the sha256 of the tokenizer's file;
                      side_sha256: {name: sha256} of an hf: tokenizer's side files
                      (`sprout.tokenizer_files.side_files_sha256`; absent for the other kinds and in
                      hf: data of an earlier version); a trainer compares both with the files now
                      (`tokenizer_record`); spec "": no tokenizer named, nothing compared
        token_dtype*  "uint16" | "uint32"
        shards*       {"train": [{file*, num_tokens*, sha256*, max_token_id*}, ...], "val": [...]}: the
                      `.bin` shards (`sprout.formats.shards`) in stream order, [] for hdf5 only;
                      max_token_id: the largest id (-1 when empty), to check a vocabulary unread
        hdf5*         {"train": {file*, num_tokens*, sha256*, tokens_sha256, max_token_id*}, "val": {...}}:
                      the `.h5` files (`sprout.formats.h5tokens`); {} for bin only
        splits*       {"train": {documents, tokens}, "val": {documents, tokens}}
        sources*      per source: name, path (as given), text_field, weight, files, documents_read,
                      invalid_json, invalid_unicode (a lone surrogate), unterminated, too_short,
                      non_ascii, duplicates, documents_kept, train_documents, val_documents,
                      normalised (per cleaning rule), tokens {train_natural, train, val}, train_share
        split_rule*   {method: "hash-fraction" | "hash-count", val_frac | val_docs_per_source, key}
                      (`sprout.prep.keys.SplitRule.describe`)
        mixture       {seed, run_tokens, train_tokens, weights}
        cleaning      the `sprout.prep.clean.CleanConfig` used; config: the resolved prep config
        doc_hashes*   {file: "doc_hashes.npz", sha256}: `train.npy` and `val.npy`, the (N, 16) uint8
                      keys (`sprout.prep.keys.text_key`) of each split's documents
        command*      the command line, as a list of arguments"""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise SproutError(f"{path}: no manifest (unfinished or not a sprout token folder)")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise SproutError(f"{path}: line {exc.lineno}: invalid JSON ({exc.msg})") from None
    if not isinstance(data, dict):
        raise SproutError(f"{path}: top level must be a JSON object")
    _check_fields(path, data, REQUIRED, "")
    _check_fields(path, data["tokenizer"], TOKENIZER_REQUIRED, "tokenizer.")
    sides = data["tokenizer"].get("side_sha256", {})
    if not isinstance(sides, dict) or not all(isinstance(v, str) for v in sides.values()):
        raise SproutError(f"{path}: field tokenizer.side_sha256 should be an object of sha256 strings")
    if data["format"] != FORMAT:
        raise SproutError(f"{path}: format {data['format']!r}, expected {FORMAT!r}")
    for split, entries in data["shards"].items():
        if split not in ("train", "val") or not isinstance(entries, list):
            raise SproutError(f"{path}: shards.{split} must be a list under train/val")
        for i, entry in enumerate(entries):
            _check_entry(path, entry, f"shards.{split}[{i}]")
    for split, entry in data["hdf5"].items():
        _check_entry(path, entry, f"hdf5.{split}")
    return data


def _check_entry(path: Path, entry, where: str) -> None:
    """One listed file: {file, num_tokens, sha256, max_token_id}."""
    if isinstance(entry, dict) and "max_token_id" not in entry:
        raise SproutError(f"{path}: {where} has no max_token_id (written by an earlier version of sprout); "
                          f"prepare the data again")
    _check_fields(path, entry, {"file": str, "num_tokens": int, "sha256": str, "max_token_id": int}, f"{where}.")


def _check_fields(path: Path, data, fields: dict, prefix: str) -> None:
    if not isinstance(data, dict):
        raise SproutError(f"{path}: {prefix.rstrip('.') or 'entry'} must be an object")
    for key, tp in fields.items():
        if key not in data:
            raise SproutError(f"{path}: missing field {prefix}{key}")
        if not isinstance(data[key], tp) or (tp is int and isinstance(data[key], bool)):
            raise SproutError(f"{path}: field {prefix}{key} should be {tp.__name__}, got {type(data[key]).__name__}")


def check_output_dir(directory: str | os.PathLike, dataset: str, fingerprint: str) -> None:
    """Refuse a folder that holds another dataset: a manifest for a different dataset name or
    tokenizer, or .bin/.h5 outputs under another name. Our own earlier outputs may be replaced."""
    directory = Path(directory)
    if not directory.exists():
        return
    if not directory.is_dir():
        raise SproutError(f"{directory}: output path exists and is not a folder")
    path = directory / MANIFEST
    if path.is_file():
        try:
            old = json.loads(path.read_text())
            name, fp = old.get("dataset"), old.get("tokenizer", {}).get("fingerprint")
        except (json.JSONDecodeError, AttributeError):
            raise SproutError(f"{path}: output folder holds an unreadable manifest; choose another --out") from None
        if name != dataset or fp != fingerprint:
            what = f"dataset {name!r}" if name != dataset else "a different tokenizer"
            raise SproutError(f"{path}: output folder already holds {what}'s shards; choose another --out or remove them")
    for p in sorted(directory.iterdir()):
        if p.suffix in (".bin", ".h5"):
            m = OUTPUT_FILE.match(p.name)
            if not m or m.group("dataset") != dataset:
                raise SproutError(f"{p}: output folder already holds another dataset's shards; choose another --out or remove them")


def remove_stale_temporaries(directory: str | os.PathLike, dataset: str) -> list[str]:
    """Delete the temporary files a killed run of `dataset` left in the folder: those of its
    .bin/.h5 outputs, the manifest and the key sidecar (the folder holds one dataset,
    `check_output_dir`). Nothing else is touched."""
    removed = []
    for p in sorted(Path(directory).iterdir()):
        m = TEMPORARY.match(p.name)
        if not m or not p.is_file():
            continue
        out = OUTPUT_FILE.match(m.group("name"))
        if (out and out.group("dataset") == dataset) or m.group("name") in (MANIFEST, SIDECAR):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
            removed.append(p.name)
    return removed


def remove_stale(directory: str | os.PathLike, dataset: str, keep: set[str]) -> list[str]:
    """Delete our dataset's earlier .bin/.h5 outputs that this run did not rewrite."""
    removed = []
    for p in sorted(Path(directory).iterdir()):
        m = OUTPUT_FILE.match(p.name)
        if m and m.group("dataset") == dataset and p.name not in keep:
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
            removed.append(p.name)
    return removed
