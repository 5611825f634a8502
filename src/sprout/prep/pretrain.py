"""The pretraining data pipeline: sources -> clean -> tokenize -> dedup -> split -> mixture -> shards.

    manifest = prepare(PrepConfig(sources=[...], tokenizer="tiktoken:r50k_base", out="runs/data"))

A process pool cleans, keys and tokenizes the documents (end-of-text appended); results come back
in input order and are spilled to temporary files (`sprout.prep.store`), so memory stays flat.
Dedup, split and mixture are decided on per-document arrays (`sprout.prep.mixture`), so the
output bytes never depend on the number of workers. `.bin` shards and/or one HDF5 file per split,
a sidecar of each split's keys and, last, `manifest.json` are written atomically, the previous
manifest removed first: an interrupted run never leaves a folder that looks valid.

Failures end in one line (`SproutError`): a dead worker names the source it was tokenizing, a
full disk the file being written. The spill folder `<out>/.tmp-<name>_prep.<random>` holds a
lock while in use; a later run of the same dataset removes such folders whose run is gone and
the temporaries of its own outputs, and refuses to start while another run of it is writing.
`name` must be a plain file name.
"""

from __future__ import annotations

import collections
import contextlib
import glob
import multiprocessing as mp
import os
import shutil
import tempfile
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator, Literal

import numpy as np

from sprout.formats import manifest as mf
from sprout.atomic import check_writable, make_dir, safe_name, sha256_file, write_error
from sprout.locks import try_lock
from sprout.config import from_dict
from sprout.ranges import SEED_RANGE, in_range
from sprout.errors import SproutError
from sprout.formats.shards import dtype_for_vocab
from sprout.mirror import expand_path, mirror_dir
from sprout.prep.clean import CleanConfig, Cleaner
from sprout.prep.keys import SplitRule, text_key
from sprout.prep.mixture import first_occurrences, plan_split, token_targets
from sprout.prep.sources import ReadStats, SourceSpec, iter_documents, parse_source_arg, print_warning, source_name
from sprout.prep.store import SourceStore, SplitWriter, write_key_sidecar
from sprout.tokenizer import Tokenizer, load_tokenizer

CHUNK_DOCS = 256
CHUNK_CHARS = 1 << 20


@dataclass
class PrepConfig:
    name: str = "pretrain"             # dataset name: <name>_train_000000.bin
    sources: list = field(default_factory=list)  # "PATH[:WEIGHT]" strings or SourceSpec mappings
    text_field: str = "text"           # JSON field holding the document text
    tokenizer: str = "tiktoken:r50k_base"  # tiktoken:NAME, sentencepiece:PATH.model or hf:PATH
    out: str = "runs/data"             # output folder: shards, manifest.json
    mirror: str | None = None          # fills ${SPROUT_MIRROR} in paths (default: sprout.mirror.mirror_dir)
    val_frac: float = in_range(0.01, "[0, 1)")  # share of documents (by hash) in the val split
    val_docs: int | None = in_range(None, "[0, inf)")  # per source; overrides val_frac
    shard_tokens: int = in_range(100_000_000, "[1, inf)")  # tokens per .bin shard
    run_tokens: int = in_range(1_000_000, "[1, inf)")  # documents are shuffled in runs of about this many tokens
    # output train size when weights are given (default: natural total)
    train_tokens: int | None = in_range(None, "[1, inf)")
    token_dtype: Literal["auto", "uint16", "uint32"] = "auto"  # auto: uint16 when the vocab fits
    format: Literal["bin", "hdf5", "both"] = "bin"  # output format: .bin shards, one HDF5 file, or both
    workers: int = in_range(0, "[0, inf)")  # 0 = one per core
    seed: int = in_range(0, SEED_RANGE)  # order and resampling of the documents
    strict: bool = False               # fail on an invalid JSON line instead of skipping it
    clean: CleanConfig = field(default_factory=CleanConfig)  # text cleaning (sprout.prep.clean)


# ---------------------------------------------------------------- worker side

_STATE: dict = {}


def _init_worker(spec: str, mirror: str | None, clean: dict, dtype: str) -> None:
    _STATE["tok"] = load_tokenizer(spec, mirror)
    _STATE["cleaner"] = Cleaner(CleanConfig(**clean))
    _STATE["dtype"] = np.dtype(dtype)


def _process_chunk(texts: list[str]):
    """Clean, key and tokenize a chunk: (tokens, lengths, keys N x 16, counts)."""
    cleaner, tok = _STATE["cleaner"], _STATE["tok"]
    cleaner.counts = Counter()
    kept = [t for t in map(cleaner, texts) if t is not None]
    keys = np.frombuffer(b"".join(text_key(t) for t in kept), dtype=np.uint8).reshape(-1, 16)
    tokens, lengths = tok.encode_docs(kept)
    return tokens.astype(_STATE["dtype"], copy=False), lengths, keys, cleaner.counts


def _spool_chunk(job: tuple[str, list[str]]) -> Counter:
    """The pool's task: _process_chunk of (path, texts), with the arrays written to `path`;
    returns only the counts. So each result message is a couple of hundred bytes,
    which the pool's result pipe takes in one atomic write (at most PIPE_BUF bytes: 4,096 on
    Linux, 512 anywhere POSIX). A result of megabytes goes in several writes: a worker killed
    between them leaves half a message in the pipe, and CPython's ProcessPoolExecutor then
    waits for the rest for ever without noticing that the worker died (its reader is inside
    recv, not watching the workers)."""
    path, texts = job
    tokens, lengths, keys, counts = _process_chunk(texts)
    try:
        with open(path, "wb") as f:
            sink = _Sink(f)
            for array in (tokens, lengths, keys):
                np.save(sink, array, allow_pickle=False)
    except OSError as exc:  # disk full: one line, raised again in the main process
        raise write_error(path, exc) from None
    return counts


class _Sink:
    """A file's write() alone: np.save then writes through it, and a refused write raises the
    OSError of the file, with its errno (given a file object numpy writes with fwrite, whose
    short write it reports without one)."""

    def __init__(self, f) -> None:
        self.write = f.write


def _unspool_chunk(path: Path, counts: Counter):
    """Read back what _spool_chunk wrote to `path`, and remove the file: (tokens, lengths, keys,
    counts)."""
    try:
        with open(path, "rb") as f:
            tokens, lengths, keys = (np.load(f, allow_pickle=False) for _ in range(3))
        path.unlink()
    except (OSError, ValueError) as exc:
        raise SproutError(f"{path}: cannot read back a prep worker's tokens: {exc}") from None
    return tokens, lengths, keys, counts


def _chunks(docs: Iterator[str]) -> Iterator[list[str]]:
    chunk, chars = [], 0
    for doc in docs:
        chunk.append(doc)
        chars += len(doc)
        if len(chunk) >= CHUNK_DOCS or chars >= CHUNK_CHARS:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


def _ordered_map(pool, chunks: Iterator[list[str]], in_flight: int, spool: Path | None, source: int):
    """pool.map with back-pressure: at most `in_flight` chunks queued, results in order; the
    workers' arrays come through files in `spool` (see _spool_chunk), named by source and chunk.
    A worker that dies raises BrokenProcessPool here (a ProcessPoolExecutor notices a dead
    worker, as long as its result messages stay small; multiprocessing.Pool would wait for its
    result for ever)."""
    if pool is None:
        for chunk in chunks:
            yield len(chunk), _process_chunk(chunk)
        return
    pending: collections.deque = collections.deque()
    for seq, chunk in enumerate(chunks):
        path = spool / f"source{source}-chunk{seq:010d}.npy"
        pending.append((len(chunk), path, pool.submit(_spool_chunk, (str(path), chunk))))
        if len(pending) >= in_flight:
            n, path, res = pending.popleft()
            yield n, _unspool_chunk(path, res.result())
    while pending:
        n, path, res = pending.popleft()
        yield n, _unspool_chunk(path, res.result())


# ---------------------------------------------------------------- main side


def resolve_sources(cfg: PrepConfig, mirror: str | None) -> list[tuple[str, SourceSpec]]:
    """(path as given, SourceSpec with `${SPROUT_MIRROR}` expanded and a name) per source."""
    specs = []
    for i, item in enumerate(cfg.sources):
        if isinstance(item, str):
            spec = parse_source_arg(item)
        elif isinstance(item, dict):
            spec = from_dict(SourceSpec, item, f"sources[{i}]")
        else:
            raise SproutError(f"sources[{i}]: expected PATH[:WEIGHT] or a mapping, got {type(item).__name__}")
        given = spec.path
        spec = replace(spec, path=expand_path(spec.path, mirror))
        spec.name = source_name(spec)
        specs.append((given, spec))
    if not specs:
        raise SproutError("no sources given (--source PATH or sources: in the config)")
    weighted = [spec.weight is not None for _, spec in specs]
    if any(weighted) and not all(weighted):
        unweighted = next(given for given, spec in specs if spec.weight is None)
        raise SproutError(f"--source {unweighted}: give a mixture weight for every source or for none (PATH:WEIGHT)")
    names = [spec.name for _, spec in specs]
    if len(set(names)) != len(names):
        raise SproutError(f"source names must be unique, got {names}; set name: for each source")
    return specs


def prepare(
    cfg: PrepConfig,
    *,
    tokenizer: Tokenizer | None = None,
    command: list[str] | None = None,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> dict:
    """Run the whole pipeline; returns the manifest (also written to `cfg.out`)."""
    root = mirror_dir(cfg.mirror)
    mirror = str(root) if root is not None else None
    if cfg.format not in ("bin", "hdf5", "both"):
        raise SproutError(f"--format must be bin, hdf5 or both, got {cfg.format!r}")
    safe_name(cfg.name, "name")
    given, specs = zip(*resolve_sources(cfg, mirror))
    tok = tokenizer or load_tokenizer(expand_path(cfg.tokenizer, mirror), mirror)
    try:
        dtype = dtype_for_vocab(tok.vocab_size, cfg.token_dtype)
    except SproutError as exc:
        raise SproutError(f"{tok.spec}: {exc}") from None
    out = Path(cfg.out)
    check_writable(out / mf.MANIFEST)
    mf.check_output_dir(out, cfg.name, tok.fingerprint())
    mf.tokenizer_info(tok)  # the tokenizer's files hashed now, as they are when it is loaded
    created = not out.exists()
    make_dir(out)
    ok = False
    try:
        with _spill_dir(out, cfg.name) as tmpdir:
            stores, stats = _tokenize_sources(cfg, specs, tok, dtype, mirror, tmpdir, progress)
            result = _write_outputs(cfg, specs, given, tok, dtype, stores, stats, out, command or [])
        ok = True
    finally:
        if not ok and created and out.is_dir() and not any(out.iterdir()):
            out.rmdir()
    log(summary_table(result))
    return result


@contextlib.contextmanager
def _spill_dir(out: Path, name: str) -> Iterator[Path]:
    """A locked temporary folder for this run's spilled documents, removed afterwards; first
    removes what killed runs of this dataset left in `out` (their spill folders, whose lock
    is free, and the temporaries of this dataset's outputs)."""
    prefix = f".tmp-{name}_prep."
    for old in sorted(out.glob(glob.escape(prefix) + "*")):
        if old.is_dir() and not _lock(old / "lock"):
            raise SproutError(f"{old}: another prep of dataset {name!r} is writing into {out}; wait for it or choose another --out")
    for old in sorted(out.glob(glob.escape(prefix) + "*")):
        shutil.rmtree(old, ignore_errors=True)
    mf.remove_stale_temporaries(out, name)
    try:
        tmpdir = Path(tempfile.mkdtemp(prefix=prefix, dir=out))
    except OSError as exc:
        raise SproutError(f"{out}: cannot write in this folder: {exc.strerror or exc}") from None
    lock = _lock(tmpdir / "lock")
    try:
        yield tmpdir
    finally:
        os.close(lock)
        shutil.rmtree(tmpdir, ignore_errors=True)


def _lock(path: Path) -> int | None:
    """An open descriptor holding an exclusive lock on `path` (created if missing), or None
    when another process holds it. The lock goes when the process does, however it ends."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise SproutError(f"{path}: cannot create a lock file: {exc.strerror or exc}") from None
    return try_lock(fd)


def _tokenize_sources(cfg, specs, tok, dtype, mirror, tmpdir, progress):
    from tqdm import tqdm

    workers = cfg.workers or os.cpu_count() or 1
    clean = asdict(cfg.clean)
    path = getattr(tok, "path", None)  # workers load a tokenizer file by absolute path
    spec_str = f"{tok.spec.partition(':')[0]}:{Path(path).resolve()}" if path else tok.spec
    pool = spool = None
    if workers > 1:
        spool = make_dir(tmpdir / "spool")
        pool = ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"), initializer=_init_worker,
                                   initargs=(spec_str, mirror, clean, dtype.str))
    else:  # one worker: this process, with the tokenizer already loaded
        _STATE.update(tok=tok, cleaner=Cleaner(cfg.clean), dtype=dtype)
    stores, stats = [], []
    try:
        for i, spec in enumerate(specs):
            store, st = SourceStore(tmpdir, i, dtype), ReadStats()
            docs = iter_documents(spec, cfg.text_field, strict=cfg.strict, stats=st)
            with tqdm(desc=f"{spec.name:>12}", unit="doc", disable=not progress, dynamic_ncols=True) as bar:
                try:
                    for n, res in _ordered_map(pool, _chunks(docs), 2 * workers + 2, spool, i):
                        store.append(*res)
                        bar.update(n)
                except BrokenProcessPool:
                    raise SproutError(f"{spec.path}: a prep worker process died (killed or out of memory?) while "
                                      f"tokenizing source {spec.name!r} after document {st.documents:,}; "
                                      "nothing was written") from None
            store.finish()
            stores.append(store)
            stats.append(st)
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
    return stores, stats


@dataclass
class _Plan:
    """Which documents survive dedup, which go to val, and how many train tokens each source gets."""

    keep: list[np.ndarray]
    train_ids: list[np.ndarray]
    val_ids: list[np.ndarray]
    natural: list[int]                 # train tokens per source before resampling
    targets: list[float] | None        # None: every train document once
    rule: SplitRule


def _plan(cfg: PrepConfig, specs, stores: list[SourceStore]) -> _Plan:
    """Dedup across all sources (in source order), split by key, and the mixture targets."""
    hi = np.concatenate([s.key_half("hi") for s in stores])
    bounds = np.cumsum([0] + [s.n_docs for s in stores])

    def full_keys(ids: np.ndarray) -> np.ndarray:  # ids ascending, across sources
        src = np.searchsorted(bounds, ids, side="right") - 1
        return np.concatenate([stores[i].key_rows(ids[src == i] - bounds[i]) for i in range(len(stores))])

    keep = np.split(first_occurrences(hi, full_keys), bounds[1:-1])
    del hi
    rule = SplitRule(val_frac=cfg.val_frac, val_docs=cfg.val_docs)
    train_ids, val_ids = [], []
    for s, k in zip(stores, keep):
        ids = np.flatnonzero(k).astype(np.int32 if s.n_docs < 2**31 else np.int64)  # 4 bytes a document
        is_val = rule.mask(s.key_half("lo")[ids])
        train_ids.append(ids[~is_val])
        val_ids.append(ids[is_val])
    if sum(len(t) for t in train_ids) == 0:
        raise SproutError("no training documents left after cleaning, dedup and the validation split")
    natural = [int(s.lengths[ids].sum()) for s, ids in zip(stores, train_ids)]
    weights = [spec.weight for spec in specs]
    targets = None
    if any(w is not None for w in weights) or cfg.train_tokens is not None:
        targets = token_targets(natural, weights, cfg.train_tokens)
        for spec, want, have in zip(specs, targets, natural):
            if want > 0 and have == 0:
                raise SproutError(f"{spec.path}: weight asks for {want:,.0f} train tokens but the source has no training documents left")
    if cfg.val_docs != 0 and (cfg.val_docs or cfg.val_frac > 0):
        for spec, k, val in zip(specs, keep, val_ids):
            if len(val) == 0:
                print_warning(f"{spec.path}: this source gets no validation documents ({int(k.sum()):,} kept, "
                      f"{rule.describe()['method']} split), so validation loss does not measure it")
    return _Plan(keep, train_ids, val_ids, natural, targets, rule)


def _write_split(cfg: PrepConfig, split: str, runs, stores, dtype, out: Path, attrs: dict):
    """Copy the planned runs into the split's outputs: (shards, h5 entry, tokens per source, documents)."""
    per_source, docs = [0] * len(stores), 0
    total = sum(int(stores[src].lengths[ids].sum()) for src, ids in runs)
    writer = SplitWriter(out, cfg.name, split, dtype, cfg.shard_tokens, cfg.format, total)
    try:
        for src, doc_ids in runs:
            tokens = stores[src].gather(doc_ids)
            writer.write(tokens)
            per_source[src] += len(tokens)
            docs += len(doc_ids)
        shards, h5 = writer.close(dict(attrs, num_documents=docs))
    except BaseException:
        writer.abort()
        raise
    return shards, h5, per_source, docs


def _source_reports(cfg, specs, given, stores, stats, plan: _Plan, out_tokens: dict) -> list[dict]:
    reports = []
    total_train = max(1, sum(out_tokens["train"]))
    for i, (spec, s, st, k) in enumerate(zip(specs, stores, stats, plan.keep)):
        counts = dict(sorted(s.counts.items()))
        reports.append({
            "name": spec.name, "path": given[i], "text_field": spec.text_field or cfg.text_field,
            "weight": spec.weight, "files": st.files,
            "documents_read": st.documents, "invalid_json": st.invalid_json,
            "invalid_unicode": st.invalid_unicode, "unterminated": st.unterminated,
            "too_short": counts.pop("too_short", 0), "non_ascii": counts.pop("non_ascii", 0),
            "duplicates": int(len(k) - k.sum()), "documents_kept": int(k.sum()),
            "train_documents": len(plan.train_ids[i]), "val_documents": len(plan.val_ids[i]),
            "normalised": counts,
            "tokens": {"train_natural": plan.natural[i], "train": out_tokens["train"][i], "val": out_tokens["val"][i]},
            "train_share": out_tokens["train"][i] / total_train,
        })
    return reports


def _write_outputs(cfg, specs, given, tok, dtype, stores, stats, out: Path, command) -> dict:
    plan = _plan(cfg, specs, stores)
    attrs = {"dataset": cfg.name, "vocab_size": tok.vocab_size, "eot_id": tok.eot_id,
             "bos_id": -1 if tok.bos_id is None else tok.bos_id, "tokenizer_spec": tok.spec,
             "tokenizer_name": tok.name, "tokenizer_fingerprint": tok.fingerprint(),
             "sources": [{"name": sp.name, "path": g, "weight": sp.weight} for sp, g in zip(specs, given)],
             "split_rule": plan.rule.describe(), "cleaning": asdict(cfg.clean), "seed": cfg.seed}
    with contextlib.suppress(FileNotFoundError):
        (out / mf.MANIFEST).unlink()  # the folder must not look valid while it is being rewritten
    shards, h5, splits = {"train": [], "val": []}, {}, {}
    out_tokens = {"train": [0] * len(stores), "val": [0] * len(stores)}
    lengths = [s.lengths for s in stores]
    for split, ids, targets in (("train", plan.train_ids, plan.targets), ("val", plan.val_ids, None)):
        runs = plan_split(ids, lengths, targets, cfg.run_tokens, cfg.seed, split)
        splits[split] = {"documents": 0, "tokens": 0}
        if not runs:  # an empty val split writes nothing
            continue
        shards[split], h5_entry, out_tokens[split], docs = _write_split(cfg, split, runs, stores, dtype, out, attrs)
        splits[split] = {"documents": docs, "tokens": sum(out_tokens[split])}
        if h5_entry:
            h5[split] = h5_entry

    sidecar = out / mf.SIDECAR
    write_key_sidecar(sidecar, stores, {"train": plan.train_ids, "val": plan.val_ids})
    mf.remove_stale(out, cfg.name, {e["file"] for e in shards["train"] + shards["val"]} | {e["file"] for e in h5.values()})
    manifest = {
        "format": mf.FORMAT, "dataset": cfg.name, "tokenizer": mf.tokenizer_info(tok),
        "token_dtype": dtype.name, "shards": shards, "hdf5": h5, "splits": splits,
        "sources": _source_reports(cfg, specs, given, stores, stats, plan, out_tokens),
        "split_rule": plan.rule.describe(),
        "mixture": {"seed": cfg.seed, "run_tokens": cfg.run_tokens, "train_tokens": cfg.train_tokens,
                    "weights": "share of output train tokens" if plan.targets is not None else "natural (each document once)"},
        "cleaning": asdict(cfg.clean),
        "doc_hashes": {"file": mf.SIDECAR, "sha256": sha256_file(sidecar)},
        "config": asdict(cfg),
        "command": command,
    }
    mf.write_manifest(out, manifest)
    return manifest


def summary_table(m: dict) -> str:
    """The end-of-run table: documents in, drops per reason, duplicates, tokens per source and split."""
    cols = ["source", "docs in", "bad json", "bad utf", "unterm.", "short", "non-ascii", "dups", "kept", "val docs",
            "train tok", "(natural)", "share", "val tok"]
    rows = []
    for s in m["sources"]:
        t = s["tokens"]
        rows.append([s["name"], s["documents_read"], s["invalid_json"], s["invalid_unicode"], s["unterminated"], s["too_short"],
                     s["non_ascii"], s["duplicates"], s["documents_kept"], s["val_documents"],
                     t["train"], t["train_natural"], f"{s['train_share']:.1%}", t["val"]])
    tot = ["total"] + [sum(r[i] for r in rows) for i in range(1, 12)] + ["100.0%", sum(r[13] for r in rows)]
    rows.append(tot)
    cells = [[f"{c:,}" if isinstance(c, int) else str(c) for c in r] for r in [cols] + rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(cols))]
    fmt = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    lines = [fmt(cells[0]), "-" * len(fmt(cells[0]))] + [fmt(r) for r in cells[1:-1]]
    lines += ["-" * len(fmt(cells[0])), fmt(cells[-1]), ""]
    for s in m["sources"]:
        if s["normalised"]:
            fixes = ", ".join(f"{k.removeprefix('fixed_')} {v:,}" for k, v in s["normalised"].items())
            lines.append(f"normalised in {s['name']}: {fixes} documents")
    sp = m["splits"]
    lines.append(f"train: {sp['train']['documents']:,} docs, {sp['train']['tokens']:,} tokens in "
                 f"{len(m['shards'].get('train', []))} .bin shard(s)" + (" + HDF5" if "train" in m["hdf5"] else ""))
    lines.append(f"val:   {sp['val']['documents']:,} docs, {sp['val']['tokens']:,} tokens in "
                 f"{len(m['shards'].get('val', []))} .bin shard(s)" + (" + HDF5" if "val" in m["hdf5"] else ""))
    lines.append(f"tokenizer {m['tokenizer']['spec']} (vocab {m['tokenizer']['vocab_size']:,}, eot {m['tokenizer']['eot_id']}), "
                 f"{m['token_dtype']}; split {m['split_rule']['method']}")
    return "\n".join(lines)
