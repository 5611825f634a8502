"""Pretraining-data prep throughput against raw tiktoken, and peak memory against input size.

Input: the mirror's pretraining samples, cleaned once so every document survives the filters,
repeated into a JSONL file of at least --mb MB (each copy marked so exact dedup keeps it). `raw`
is tiktoken r50k_base `encode_ordinary_batch` on the documents in memory (num_threads=N against
N prep workers); `prep` is `sprout.prep.pretrain.prepare` end to end (eot tokens not counted).
The two alternate for --rounds rounds; the median is reported. Peak RSS is measured in fresh
child processes on the 1x and 10x inputs (main process and largest worker). Hashing
(`--hash-only`, no mirror needed): `sprout.atomic.sha256_file` on one core over a cached
--hash-mb file, against plain reading and `hashlib.file_digest`, the median of --rounds passes.

    .venv/bin/python benchmarks/prep_throughput.py [--mb 50] [--rounds 3]   # mirror: sprout.mirror.mirror_dir()
    .venv/bin/python benchmarks/prep_throughput.py --hash-only [--hash-mb 256]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sprout.atomic import HASH_BLOCK, sha256_file
from sprout.mirror import mirror_dir
from sprout.prep.clean import CleanConfig, Cleaner
from sprout.prep.keys import text_key
from sprout.prep.pretrain import PrepConfig, prepare
from sprout.prep.sources import SourceSpec, iter_documents
from sprout.tokenizer import load_tokenizer

SAMPLES = [
    ("pretrain/tinystories/tinystories_sample.txt", {}),
    ("pretrain/fineweb/fineweb_subset.json", {}),
    ("pretrain/web/*.json*.gz", {}),
    ("pretrain/web/arxiv.jsonl", {}),
    ("pretrain/tinyshakespeare/input.txt", {"separator": ""}),
]


def base_documents(mirror: Path) -> list[str]:
    cleaner = Cleaner(CleanConfig())
    docs, seen = [], set()
    for rel, extra in SAMPLES:
        for text in iter_documents(SourceSpec(path=str(mirror / rel), **extra)):
            if (text := cleaner(text)) is not None and (key := text_key(text)) not in seen:
                seen.add(key)
                docs.append(text)
    return docs


def write_input(path: Path, docs: list[str], min_bytes: int, keep: bool = True) -> list[str]:
    """Write copies of `docs` until the file holds min_bytes; return the texts written (if `keep`)."""
    written, size, k = [], 0, 0
    with open(path, "w") as f:
        while size < min_bytes:
            for doc in docs:
                text = f"{doc}\n\n(copy {k})"
                line = json.dumps({"text": text}) + "\n"
                f.write(line)
                size += len(line.encode())
                if keep:
                    written.append(text)
            k += 1
    return written


def prep_config(src: Path, out: Path, workers: int) -> PrepConfig:
    return PrepConfig(name="bench", sources=[str(src)], tokenizer="tiktoken:r50k_base", out=str(out),
                      workers=workers, val_frac=0.005, shard_tokens=50_000_000, format="bin")


def time_prep(src: Path, workdir: Path, workers: int) -> tuple[float, int]:
    out = workdir / f"out-{workers}"
    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    m = prepare(prep_config(src, out, workers), progress=False, log=lambda s: None)
    elapsed = time.perf_counter() - start
    tokens = m["splits"]["train"]["tokens"] + m["splits"]["val"]["tokens"]
    docs = m["splits"]["train"]["documents"] + m["splits"]["val"]["documents"]
    shutil.rmtree(out, ignore_errors=True)
    return elapsed, tokens - docs  # eot tokens are not text tokens


def time_raw(enc, texts: list[str], threads: int) -> tuple[float, int]:
    start = time.perf_counter()
    ids = enc.encode_ordinary_batch(texts, num_threads=threads)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(x) for x in ids)


def child_rss(src: Path, workdir: Path, workers: int) -> dict:
    """Run prep in a fresh process; peak RSS in MiB of its main process (VmHWM, exact) and of
    its largest worker (sampled every 20 ms). ru_maxrss would not do: Linux keeps it across
    fork+exec, so the child would inherit this process's peak."""
    import psutil

    code = ("import sys; sys.path.insert(0, sys.argv[1]);"
            "from prep_throughput import prep_config; from sprout.prep.pretrain import prepare; from pathlib import Path;"
            "prepare(prep_config(Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])), progress=False, log=lambda s: None);"
            "print([l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1])")
    out = workdir / "out-rss"
    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", code, str(Path(__file__).parent), str(src), str(out), str(workers)],
                            stdout=subprocess.PIPE, text=True)
    parent, worker_peak = psutil.Process(proc.pid), 0
    while proc.poll() is None:
        try:
            for child in parent.children(recursive=True):
                worker_peak = max(worker_peak, child.memory_info().rss)
        except psutil.Error:
            pass
        time.sleep(0.02)
    stdout = proc.stdout.read()
    if proc.returncode != 0:
        raise RuntimeError(f"prep child failed with exit code {proc.returncode}")
    shutil.rmtree(out, ignore_errors=True)
    return {"main": int(stdout.split()[-1]) / 1024, "worker": worker_peak / 2**20, "seconds": time.perf_counter() - start}


def read_only(path: Path) -> None:
    """Read the file the way sha256_file does, without hashing."""
    buf = bytearray(HASH_BLOCK)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass


def file_digest(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def hash_rates(workdir: Path, mb: int, rounds: int) -> dict[str, float]:
    """MB/s of reading alone, sha256_file and hashlib.file_digest over one cached file."""
    path = workdir / "hash-input.bin"
    with open(path, "wb") as f:
        for _ in range(mb):
            f.write(os.urandom(1 << 20))
    read_only(path)  # into the page cache
    sides = {"read, no hash": read_only, "sha256_file": sha256_file}
    if hasattr(hashlib, "file_digest"):  # Python 3.11+
        sides["hashlib.file_digest"] = file_digest
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(rounds):  # alternate, so load from other processes hits every side alike
        for name, fn in sides.items():
            start = time.perf_counter()
            fn(path)
            times[name].append(time.perf_counter() - start)
    path.unlink()
    return {name: (mb << 20) / 1e6 / statistics.median(t) for name, t in times.items()}


def print_hash_rates(workdir: Path, mb: int, rounds: int) -> None:
    rates = hash_rates(workdir, mb, rounds)
    print(f"\nhashing {mb} MiB on one core (page cache warm, median of {rounds}):")
    for name, rate in rates.items():
        print(f"  {name:>20}  {rate:>7,.0f} MB/s")
    print(f"  sha256_file / file_digest {rates['sha256_file'] / rates.get('hashlib.file_digest', float('nan')):.2f}x; "
          f"hashing costs {1 - rates['sha256_file'] / rates['read, no hash']:.0%} of the read-only rate", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=50.0, help="input size for the throughput runs")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="'all workers' count")
    parser.add_argument("--scale", type=int, default=10, help="RSS: compare 1x with this multiple of the input")
    parser.add_argument("--workdir", default=None, help="scratch folder (default: a temp dir)")
    parser.add_argument("--rss-only", action="store_true", help="skip the throughput rounds")
    parser.add_argument("--hash-mb", type=int, default=256, help="file size for the hashing figure")
    parser.add_argument("--hash-only", action="store_true", help="only the hashing figure (no mirror needed)")
    args = parser.parse_args()
    if args.hash_only:
        with tempfile.TemporaryDirectory(prefix="prep-bench-", dir=args.workdir) as tmp:
            print_hash_rates(Path(tmp), args.hash_mb, args.rounds)
        return 0
    mirror = mirror_dir()
    if mirror is None or not (mirror / "MANIFEST.md").is_file():
        print(f"no data mirror at {mirror}; set SPROUT_MIRROR", file=sys.stderr)
        return 2
    os.environ["SPROUT_MIRROR"] = str(mirror)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="prep-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        docs = base_documents(mirror)
        src = workdir / "input.jsonl"
        texts = write_input(src, docs, int(args.mb * 1e6))
        enc = load_tokenizer("tiktoken:r50k_base")._enc
        print(f"input: {src.stat().st_size / 1e6:.1f} MB, {len(texts):,} documents ({len(docs):,} distinct after "
              f"cleaning and dedup, repeated); {os.cpu_count()} CPUs; rounds={args.rounds}", flush=True)
        rows = []
        for workers in [] if args.rss_only else sorted({1, args.workers}):
            raw_s, prep_s = [], []
            for r in range(args.rounds):
                t, raw_tokens = time_raw(enc, texts, workers)
                raw_s.append(t)
                t, prep_tokens = time_prep(src, workdir, workers)
                prep_s.append(t)
                print(f"  workers={workers} round {r}: raw {raw_tokens / raw_s[-1] / 1e6:.2f} M tok/s, "
                      f"prep {prep_tokens / prep_s[-1] / 1e6:.2f} M tok/s", flush=True)
            assert raw_tokens == prep_tokens, (raw_tokens, prep_tokens)
            raw_rate, prep_rate = raw_tokens / statistics.median(raw_s), prep_tokens / statistics.median(prep_s)
            rows.append((workers, raw_rate, prep_rate))
        print(f"\n{'workers':>7}  {'raw M tok/s':>11}  {'prep M tok/s':>12}  {'prep/raw':>8}")
        for workers, raw_rate, prep_rate in rows:
            print(f"{workers:>7}  {raw_rate / 1e6:>11.2f}  {prep_rate / 1e6:>12.2f}  {prep_rate / raw_rate:>8.2f}x")

        big = workdir / "input-big.jsonl"
        write_input(big, docs, int(args.scale * args.mb * 1e6), keep=False)  # each copy still unique
        small_rss = child_rss(src, workdir, args.workers)
        big_rss = child_rss(big, workdir, args.workers)
        print(f"\npeak RSS (MiB), workers={args.workers}: main {small_rss['main']:.0f} at 1x "
              f"({src.stat().st_size / 1e6:.0f} MB, {small_rss['seconds']:.0f}s) vs {big_rss['main']:.0f} at {args.scale}x "
              f"({big.stat().st_size / 1e6:.0f} MB, {big_rss['seconds']:.0f}s) = {big_rss['main'] / small_rss['main']:.2f}x; "
              f"largest worker {small_rss['worker']:.0f} vs {big_rss['worker']:.0f} = "
              f"{big_rss['worker'] / small_rss['worker']:.2f}x")
        print_hash_rates(workdir, args.hash_mb, args.rounds)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
