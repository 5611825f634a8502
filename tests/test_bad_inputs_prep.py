"""Every bad input to a prep script ends in one line naming the field, file or path, and prep
is safe under kill -9 and a full disk.

Each case runs the real script in a subprocess and checks: the exit code, exactly one
`error: ...` line on stderr naming what is wrong, no traceback, and, for refusals, the output
folder byte for byte as it was. A full disk is a file size limit (RLIMIT_FSIZE, with SIGXFSZ
ignored so the write fails with EFBIG), so no real disk is filled.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from data_fixtures import make_docs, train_tiny_sp
from proc import one_error

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
DOCS = make_docs(900, seed=7)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return train_tiny_sp(tmp_path_factory.mktemp("sp"))


def run(script: str, *args, limit: int | None = None, timeout: float = 120, env: dict | None = None):
    """Run scripts/<script> with `args`; `limit` caps the size of any file it writes."""

    def cap():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return subprocess.run([sys.executable, str(SCRIPTS / script), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, preexec_fn=cap if limit else None, cwd=ROOT,
                          env={**os.environ, "SPROUT_MIRROR": "", **(env or {})})


def tree(folder: Path) -> dict:
    """Every path under `folder` with the sha256 of its bytes (None for folders)."""
    if not folder.exists():
        return {}
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None
            for p in sorted(folder.rglob("*"))}


def write_jsonl(path: Path, rows, opener=open) -> Path:
    with opener(path, "wt") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def write_sources(d: Path) -> list[Path]:
    """Three pretraining sources of 300 documents each (about 40 KB of tokens each)."""
    paths = []
    for i in range(3):
        paths.append(write_jsonl(d / f"src{i}.jsonl", [{"text": t} for t in DOCS[i * 300 : (i + 1) * 300]]))
    return paths


def pretrain(tok, out: Path, *sources, extra=(), **kw):
    args = [a for s in sources for a in ("--source", s)]
    return run("prepare_pretrain_data.py", *args, "--tokenizer", tok.spec, "--out", out, "--name", "t",
               "--workers", "1", "--no-progress", "--shard-tokens", "1000000", *extra, **kw)


def sft_rows(n: int, seed: int = 0) -> list[dict]:
    docs = make_docs(n, seed=seed, min_words=10, max_words=30)
    return [{"messages": [{"role": "user", "content": f"Question {i}: tell me a story."},
                          {"role": "assistant", "content": d}]} for i, d in enumerate(docs)]


def sft(tok, out: Path, *sources, fmt="chat", limit=None, extra=()):
    args = [a for s in sources for a in ("--source", s)]
    return run("prepare_sft_data.py", "--format", fmt, *args, "--tokenizer", tok.spec, "--out", out,
               "--seq-len", "128", *extra, limit=limit)


# ---------------------------------------------------------------- a. a worker killed with kill -9


def children(pid: int) -> list[int]:
    """Every descendant of `pid`, from /proc (no psutil)."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids = [int(x) for x in (task / "children").read_text().split()]
        except OSError:
            continue
        for kid in kids:
            out += [kid] + children(kid)
    return out


def is_pool_worker(pid: int) -> bool:
    try:
        return b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def worst_moment(workers: list[int], wait: float = 15.0) -> int:
    """With the prep's main process stopped, wait until every worker sleeps (its task done and
    its result sent, or blocked sending it), then pick one blocked writing into a pipe if any:
    a worker killed there leaves half a result message in the pool's result pipe, the kill a
    pool is least likely to survive. Results that fit one atomic pipe write never block there,
    and then the first worker, asleep, is the one killed."""
    def sleeping(pid: int) -> bool:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return True  # gone
        return stat[stat.rindex(")") + 2] == "S"

    def writing_a_pipe(pid: int) -> bool:
        try:
            return "pipe_write" in Path(f"/proc/{pid}/wchan").read_text()
        except OSError:
            return False

    deadline, calm = time.monotonic() + wait, 0
    while time.monotonic() < deadline and calm < 5:
        calm = calm + 1 if all(map(sleeping, workers)) else 0
        time.sleep(0.05)
    return ([pid for pid in workers if writing_a_pipe(pid)] or workers)[0]


def output_files(out: Path) -> dict:
    """The data files of a prep folder by name with their sha256, and the manifest without the
    fields that name the folder and the command line."""
    files = {name: digest for name, digest in tree(out).items() if not name.startswith("manifest")}
    manifest = json.loads((out / "manifest.json").read_text())
    for key in ("config", "command"):
        manifest.pop(key)
    return {**files, "manifest": manifest}


@pytest.mark.slow
def test_kill_9_of_a_worker_stops_the_prep_and_a_rerun_gives_the_same_bytes(tok, tmp_path):
    base = make_docs(2000, seed=11)
    big = write_jsonl(tmp_path / "big.jsonl", ({"text": f"{d}\n(copy {k})"} for k in range(25) for d in base))
    args = ["--source", big, "--tokenizer", tok.spec, "--name", "t", "--workers", "2", "--no-progress",
            "--format", "both", "--shard-tokens", "500000"]
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, str(SCRIPTS / "prepare_pretrain_data.py"), *map(str, args), "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "SPROUT_MIRROR": ""})
    try:
        deadline = time.monotonic() + 60
        workers: list[int] = []
        while len(workers) < 2 and proc.poll() is None and time.monotonic() < deadline:
            workers = [p for p in children(proc.pid) if is_pool_worker(p)]
            time.sleep(0.05)
        assert len(workers) == 2, "the prep never started two workers"
        time.sleep(1.0)  # let them tokenize a while
        assert proc.poll() is None, "the fixture is too small: the prep finished before the kill"
        os.kill(proc.pid, signal.SIGSTOP)
        victim = worst_moment(workers)
        killed = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        os.kill(proc.pid, signal.SIGCONT)
        _, stderr = proc.communicate(timeout=30)
        assert time.monotonic() - killed < 30
    finally:
        if proc.poll() is None:
            for pid in children(proc.pid):
                os.kill(pid, signal.SIGKILL)
            proc.kill()
            proc.communicate()
    result = subprocess.CompletedProcess(proc.args, proc.returncode, "", stderr)
    one_error(result, str(big), "worker process died")
    assert not (out / "manifest.json").exists()
    assert not [n for n in tree(out) if n.endswith((".bin", ".h5", ".npz")) or ".tmp-" in n], tree(out)

    rerun = run("prepare_pretrain_data.py", *args, "--out", out)
    assert rerun.returncode == 0, rerun.stderr
    clean = run("prepare_pretrain_data.py", *args, "--out", tmp_path / "clean")
    assert clean.returncode == 0, clean.stderr
    assert output_files(out) == output_files(tmp_path / "clean")


# ---------------------------------------------------------------- b. names stay inside their folder


def test_a_dataset_name_with_a_folder_part_is_refused(tok, tmp_path):
    (tmp_path / "in").mkdir()
    srcs = write_sources(tmp_path / "in")
    out = tmp_path / "work" / "out"
    out.mkdir(parents=True)
    before = tree(tmp_path)
    for name in ("../../escaped", "a/b", "..", ".hidden"):
        proc = run("prepare_pretrain_data.py", "--source", srcs[0], "--tokenizer", tok.spec, "--out", out,
                   "--name", name, "--workers", "1", "--no-progress")
        one_error(proc, "name", repr(name))
        assert tree(tmp_path) == before


def test_a_tokenizer_output_prefix_naming_a_folder_is_refused(tok, tmp_path):
    src = write_sources(tmp_path)[0]
    before = tree(tmp_path)
    proc = run("train_tokenizer.py", "--source", src, "--vocab-size", "400", "--out", f"{tmp_path}/sub/..")
    one_error(proc, "output name")
    assert tree(tmp_path) == before


def test_an_sft_train_file_not_named_h5_is_refused(tok, tmp_path):
    """`--out runs/x/sft` (a folder, as the other preps take) would write HDF5 files named `sft`
    and `sft_val` that no trainer finds: refused before anything is written."""
    chat = write_jsonl(tmp_path / "chat.jsonl", sft_rows(5))
    before = tree(tmp_path)
    one_error(sft(tok, tmp_path / "sft", chat), "must end in .h5", str(tmp_path / "sft" / "sft.h5"))
    assert tree(tmp_path) == before


# ---------------------------------------------------------------- c. lone surrogates


def test_lone_surrogates_are_counted_and_skipped_in_pretraining_prep(tok, tmp_path):
    src = tmp_path / "s.jsonl"
    lines = [json.dumps({"text": t}) for t in DOCS[:50]]
    lines[3] = '{"text": "' + DOCS[3].replace("\n", "\\n") + ' \\ud800 broken"}'
    src.write_text("\n".join(lines) + "\n")
    arr = tmp_path / "a.json"
    arr.write_text('[{"text": "' + DOCS[60].replace("\n", "\\n") + ' \\udfff"}, ' + json.dumps({"text": DOCS[61]}) + "]")
    proc = pretrain(tok, tmp_path / "out", src, arr, extra=["--val-frac", "0"])
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert f"{src}:4: text holds a lone surrogate" in proc.stderr
    assert f"{arr}: array element 0: text holds a lone surrogate" in proc.stderr
    reports = json.loads((tmp_path / "out" / "manifest.json").read_text())["sources"]
    assert [(r["invalid_unicode"], r["documents_read"]) for r in reports] == [(1, 49), (1, 1)]


def test_lone_surrogates_are_counted_and_skipped_in_sft_prep(tok, tmp_path):
    rows = sft_rows(40)
    rows[5]["messages"][1]["content"] = "broken \ud83d here"
    src = tmp_path / "chat.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))  # json.dumps writes the \\ud83d escape
    proc = sft(tok, tmp_path / "out" / "sft.h5", src)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert f"{src}:6: text holds a lone surrogate" in proc.stderr
    counts = json.loads(proc.stdout[proc.stdout.index("{\n"):])["sources"]["chat"]
    assert counts["dropped_invalid_unicode"] == 1 and counts["read"] == 39


# ---------------------------------------------------------------- d. an output folder that cannot be written


@pytest.mark.parametrize("script", ["prepare_pretrain_data.py", "prepare_sft_data.py", "train_tokenizer.py"])
def test_an_output_path_under_a_file_is_refused_naming_it(tok, tmp_path, script):
    src = write_sources(tmp_path)[0]
    chat = write_jsonl(tmp_path / "chat.jsonl", sft_rows(20))
    blocker = tmp_path / "blocker"
    blocker.write_text("a file, not a folder")
    before = tree(tmp_path)
    if script == "prepare_pretrain_data.py":
        proc = pretrain(tok, blocker / "out", src)
    elif script == "prepare_sft_data.py":
        proc = sft(tok, blocker / "out" / "sft.h5", chat)
    else:
        proc = run(script, "--source", src, "--vocab-size", "400", "--out", blocker / "tok" / "sp")
    one_error(proc, str(blocker), "not a folder")
    assert tree(tmp_path) == before


# ---------------------------------------------------------------- e. a full disk


@pytest.mark.parametrize("fmt,suffix", [("bin", ".bin"), ("hdf5", ".h5"), ("both", "")])
def test_a_full_disk_stops_pretraining_prep_naming_the_file(tok, tmp_path, fmt, suffix):
    srcs = write_sources(tmp_path)
    ok = pretrain(tok, tmp_path / "ok", *srcs, extra=["--format", fmt])
    assert ok.returncode == 0, ok.stderr
    sources = json.loads((tmp_path / "ok" / "manifest.json").read_text())["sources"]
    spilled = max(s["tokens"]["train_natural"] + s["tokens"]["val"] for s in sources) * 2  # uint16 ids
    limit = spilled + 4096  # room for each source's spilled tokens, not for the train output
    assert max(p.stat().st_size for p in (tmp_path / "ok").iterdir()) > limit
    out = tmp_path / "out"
    proc = pretrain(tok, out, *srcs, extra=["--format", fmt], limit=limit)
    line = one_error(proc, str(out), "File too large")
    assert line.split(": cannot write")[0].endswith(suffix or (".bin", ".h5")), line
    assert not (out / "manifest.json").exists()
    assert not [n for n in tree(out) if ".tmp-" in n or n.endswith(".h5")], tree(out)


def test_a_full_disk_in_a_worker_stops_the_prep_naming_its_file(tok, tmp_path):
    """With 2 workers each chunk's tokens go through a file the worker writes: a write refused
    there is one line naming that file, raised again in the main process."""
    srcs = write_sources(tmp_path)
    out = tmp_path / "out"
    proc = run("prepare_pretrain_data.py", "--source", srcs[0], "--tokenizer", tok.spec, "--out", out, "--name", "t",
               "--workers", "2", "--no-progress", limit=4096)  # room for the lock file, not a chunk's tokens
    line = one_error(proc, str(out), "File too large")
    assert "/spool/source0-chunk" in line, line
    assert not [n for n in tree(out) if ".tmp-" in n or n.endswith((".bin", ".json"))], tree(out)


def test_a_full_disk_stops_sft_prep_and_leaves_the_old_pair(tok, tmp_path):
    src = write_jsonl(tmp_path / "chat.jsonl", sft_rows(400))
    out = tmp_path / "out" / "sft.h5"
    assert sft(tok, out, src).returncode == 0
    before = tree(tmp_path / "out")
    assert out.stat().st_size > 60_000
    proc = sft(tok, out, src, extra=["--seed", "1"], limit=60_000)
    one_error(proc, str(tmp_path / "out"), "File too large")
    assert tree(tmp_path / "out") == before  # the earlier train/val pair, untouched, and no temporaries


def test_a_full_disk_stops_tokenizer_training_with_neither_file(tmp_path):
    src = write_sources(tmp_path)[0]
    ok = run("train_tokenizer.py", "--source", src, "--vocab-size", "400", "--out", tmp_path / "ok" / "sp")
    assert ok.returncode == 0, ok.stderr
    model, vocab = (tmp_path / "ok" / "sp.model").stat().st_size, (tmp_path / "ok" / "sp.vocab").stat().st_size
    for limit in (min(model, vocab) - 1, max(model, vocab) - 1):  # the first file fails, then the second
        out = tmp_path / f"out{limit}"
        proc = run("train_tokenizer.py", "--source", src, "--vocab-size", "400", "--out", out / "sp", limit=limit)
        one_error(proc, str(out / "sp."), "File too large")
        assert tree(out) == {}


# ---------------------------------------------------------------- f. truncated and mislabelled archives


def test_a_truncated_jsonl_gz_names_the_file_and_the_last_good_line(tok, tmp_path):
    raw = "".join(json.dumps({"text": t}) + "\n" for t in DOCS[:300]).encode()
    gz = gzip.compress(raw)
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(gz[: len(gz) // 2])
    with gzip.open(cut, "rb") as f:  # the lines gzip can give back before the cut
        good = 0
        with pytest.raises(EOFError):
            for _ in f:
                good += 1
    before = tree(tmp_path)
    proc = pretrain(tok, tmp_path / "out", cut)
    one_error(proc, str(cut), "truncated gzip", f"after line {good:,}")
    chat = gzip.compress("".join(json.dumps(r) + "\n" for r in sft_rows(300)).encode())
    cut_chat = tmp_path / "chat.jsonl.gz"
    cut_chat.write_bytes(chat[: len(chat) // 2])
    before = tree(tmp_path)
    proc = sft(tok, tmp_path / "sft" / "sft.h5", cut_chat)
    one_error(proc, str(cut_chat), "truncated gzip", "after line")
    assert tree(tmp_path) == before


@pytest.mark.parametrize("script", ["prepare_pretrain_data.py", "prepare_sft_data.py"])
def test_a_gz_that_is_not_gzip_is_refused_with_one_line(tok, tmp_path, script):
    plain = write_jsonl(tmp_path / "plain.jsonl.gz", sft_rows(5) if script == "prepare_sft_data.py" else [{"text": DOCS[0]}])
    before = tree(tmp_path)
    proc = pretrain(tok, tmp_path / "out", plain) if script == "prepare_pretrain_data.py" else sft(tok, tmp_path / "o" / "s.h5", plain)
    one_error(proc, str(plain), "not gzip-compressed")
    assert tree(tmp_path) == before


# ---------------------------------------------------------------- g. an SFT source with no usable rows


def test_an_sft_source_with_no_usable_rows_is_refused(tok, tmp_path):
    good = write_jsonl(tmp_path / "good.jsonl", sft_rows(30))
    empty_turns = write_jsonl(tmp_path / "empty.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                                       {"role": "assistant", "content": "  "}]}] * 3)
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n\n")
    before = tree(tmp_path)
    for bad, detail in ((empty_turns, "no usable rows (3 read; dropped_empty_content 3)"),
                        (blank, "holds no records (it is empty or has blank lines only)")):
        proc = sft(tok, tmp_path / "out" / "sft.h5", good, bad)
        one_error(proc, str(bad), detail)
        assert tree(tmp_path) == before


# ---------------------------------------------------------------- h. temporaries of killed runs


def test_a_rerun_removes_its_own_stale_temporaries_and_only_those(tok, tmp_path):
    srcs = write_sources(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    own = [".tmp-t_train_000000.bin.k3j2h1g0", ".tmp-t_val.h5.a1b2c3d4", ".tmp-manifest.json.zz99yy88",
           ".tmp-doc_hashes.npz.q1w2e3r4"]
    foreign = [".tmp-other_train_000000.bin.k3j2h1g0", ".tmp-notes.txt.abcdefgh", "notes.txt"]
    for name in own + foreign:
        (out / name).write_text("left behind")
    (out / ".tmp-t_prep.deadbeef").mkdir()  # a killed run's spill folder: its lock is free
    (out / ".tmp-t_prep.deadbeef" / "source0.tokens").write_bytes(b"\0" * 100)
    proc = pretrain(tok, out, *srcs, extra=["--format", "both"])
    assert proc.returncode == 0, proc.stderr
    left = set(tree(out))
    assert not left & set(own) and ".tmp-t_prep.deadbeef" not in left
    assert set(foreign) <= left

    sft_out = tmp_path / "sft"
    sft_out.mkdir()
    for name in (".tmp-sft.h5.abcd1234", ".tmp-sft_val.h5.abcd1234", ".tmp-other.h5.abcd1234"):
        (sft_out / name).write_text("left behind")
    assert sft(tok, sft_out / "sft.h5", write_jsonl(tmp_path / "c.jsonl", sft_rows(30))).returncode == 0
    assert {p.name for p in sft_out.iterdir()} == {"sft.h5", "sft_val.h5", ".tmp-other.h5.abcd1234"}

    tok_out = tmp_path / "tok"
    tok_out.mkdir()
    for name in (".tmp-sp.model.abcd1234", ".tmp-sp.vocab.abcd1234", ".tmp-sp2.model.abcd1234"):
        (tok_out / name).write_text("left behind")
    assert run("train_tokenizer.py", "--source", srcs[0], "--vocab-size", "400", "--out", tok_out / "sp").returncode == 0
    assert {p.name for p in tok_out.iterdir()} == {"sp.model", "sp.vocab", ".tmp-sp2.model.abcd1234"}


def test_a_live_prep_of_the_same_dataset_is_not_disturbed(tok, tmp_path):
    import fcntl

    src = write_sources(tmp_path)[0]
    out = tmp_path / "out"
    (out / ".tmp-t_prep.live0000").mkdir(parents=True)
    fd = os.open(out / ".tmp-t_prep.live0000" / "lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another process's lock (flock locks are per open file)
    try:
        before = tree(tmp_path)
        proc = pretrain(tok, out, src)
        one_error(proc, ".tmp-t_prep.live0000", "another prep")
        assert tree(tmp_path) == before
    finally:
        os.close(fd)


# ---------------------------------------------------------------- j. SFT sources from flags


def test_sft_sources_from_flags_need_no_config(tok, tmp_path):
    alpaca = tmp_path / "alpaca.json"
    alpaca.write_text(json.dumps([{"instruction": f"Say {w}.", "input": "", "output": f"{w}!"}
                                  for w in make_docs(40, seed=5, min_words=3, max_words=6)]))
    chat = write_jsonl(tmp_path / "mine.jsonl", sft_rows(40))
    out = tmp_path / "out" / "sft.h5"
    proc = run("prepare_sft_data.py", "--format", "alpaca", "--source", alpaca, "--format", "chat", "--source", f"{chat}:2",
               "--format", "arithmetic", "--source", "30:0.5", "--tokenizer", tok.spec, "--out", out, "--seq-len", "128")
    assert proc.returncode == 0, proc.stderr
    counts = json.loads(proc.stdout[proc.stdout.index("{\n"):])["sources"]
    assert list(counts) == ["alpaca", "mine", "arithmetic"]
    assert counts["mine"]["train_weighted"] == 2 * counts["mine"]["train"]
    assert counts["arithmetic"]["read"] == 30 and counts["alpaca"]["read"] == 40
    one_error(run("prepare_sft_data.py", "--source", chat, "--tokenizer", tok.spec, "--out", out), "--source-format")
    one_error(run("prepare_sft_data.py", "--format", "arithmetic", "--source", "many", "--tokenizer", tok.spec,
                  "--out", out), "--source many", "number of problems")


# ---------------------------------------------------------------- k. the README's flags-only pretraining prep


def test_flags_only_pretraining_prep_runs_and_warns_about_a_source_without_val(tok, tmp_path):
    stories = tmp_path / "stories.txt"
    stories.write_text("\n<|endoftext|>\n".join(DOCS[:600]) + "\n<|endoftext|>\n")
    import zstandard

    web = tmp_path / "web.jsonl.zst"
    web.write_bytes(zstandard.ZstdCompressor().compress(
        "".join(json.dumps({"text": t}) + "\n" for t in DOCS[600:603]).encode()))
    proc = run("prepare_pretrain_data.py", "--source", f"{stories}:0.7", "--source", f"{web}:0.3", "--text-field", "text",
               "--tokenizer", tok.spec, "--out", tmp_path / "mydata", "--val-frac", "0.01",
               "--shard-tokens", "100000000", "--workers", "2", "--format", "both", "--seed", "0")
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if "no validation documents" in line]
    assert len(warnings) == 1 and str(web) in warnings[0], proc.stderr
    assert (tmp_path / "mydata" / "manifest.json").is_file()
    verify = run("verify_shards.py", tmp_path / "mydata")
    assert verify.returncode == 0, verify.stderr
    before = tree(tmp_path)
    partial = run("prepare_pretrain_data.py", "--source", stories, "--source", f"{web}:0.3", "--tokenizer", tok.spec,
                  "--out", tmp_path / "mydata")  # refused before any work
    one_error(partial, "--source", "weight for every source or for none")
    assert tree(tmp_path) == before
