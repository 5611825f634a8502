import gzip
import json
import tracemalloc

import pytest
import zstandard

from sprout.prep import sources
from sprout.errors import SproutError
from sprout.mirror import expand_path
from sprout.prep.sources import ReadStats, SourceSpec, iter_documents, parse_source_arg, source_name

DOCS = [f"Document number {i}: café “quoted” text\nwith a second line." for i in range(40)]


def read(path, **kw):
    stats = ReadStats()
    docs = list(iter_documents(SourceSpec(path=str(path), **kw), stats=stats))
    return docs, stats


def write_jsonl(path, rows, opener=open):
    with opener(path, "wt", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


# ---------------------------------------------------------------- formats


def test_txt_separator_drops_unterminated_fragment(tmp_path):
    p = tmp_path / "stories.txt"
    p.write_text("<|endoftext|>\n".join(DOCS[:3]) + "<|endoftext|>\nA story cut off in the mid")
    docs, stats = read(p)
    assert docs == DOCS[:3] and stats.unterminated == 1 and stats.documents == 3
    docs, _ = read(p, keep_unterminated=True)
    assert docs[-1] == "A story cut off in the mid"
    p.write_text("<|endoftext|>\n".join(DOCS[:3]) + "\n<|endoftext|>\n")  # terminated: nothing dropped
    assert read(p)[0] == DOCS[:3]


def test_txt_blank_lines_bom_and_chunk_boundaries(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "CHUNK", 7)  # separators and UTF-8 characters split across reads
    p = tmp_path / "paras.txt"
    p.write_bytes(b"\xef\xbb\xbf" + "\n\n  \n".join(DOCS[:5]).encode())
    assert read(p)[0] == DOCS[:5]
    p.write_text("<|endoftext|>".join(DOCS[:5]) + "<|endoftext|>")
    assert read(p)[0] == DOCS[:5]
    p.write_text("###".join(DOCS[:5]))
    assert read(p, separator="###", keep_unterminated=True)[0] == DOCS[:5]


def test_jsonl_plain_gz_zst_and_json_gz_holding_jsonl(tmp_path):
    rows = [{"text": d, "id": i} for i, d in enumerate(DOCS)]
    write_jsonl(tmp_path / "a.jsonl", rows)
    write_jsonl(tmp_path / "c4.json.gz", rows, gzip.open)  # C4's .json.gz files are JSON Lines
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    cctx = zstandard.ZstdCompressor()
    (tmp_path / "b.jsonl.zst").write_bytes(cctx.compress(data[:500]) + cctx.compress(data[500:]))  # two frames
    for name in ("a.jsonl", "c4.json.gz", "b.jsonl.zst"):
        assert read(tmp_path / name)[0] == DOCS, name


def test_json_array_streamed_with_custom_field(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "CHUNK", 5)  # every element arrives in pieces
    p = tmp_path / "subset.json"
    p.write_text(json.dumps([{"id": i, "body": d, "n": 1.5e3, "ok": True, "x": None} for i, d in enumerate(DOCS)], indent=2))
    assert read(p, text_field="body")[0] == DOCS
    (tmp_path / "empty.json").write_text(" [ ] ")
    with pytest.raises(SproutError, match="empty.json: empty input"):
        read(tmp_path / "empty.json")


def test_parquet_by_row_groups(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = tmp_path / "d.parquet"
    pq.write_table(pa.table({"content": DOCS, "n": list(range(len(DOCS)))}), p, row_group_size=7)
    assert pq.ParquetFile(p).num_row_groups == 6
    assert read(p, text_field="content")[0] == DOCS
    with pytest.raises(SproutError, match="d.parquet: missing text field 'text'"):
        read(p)


def test_hf_datasets_saved_folder_and_local_path(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    import datasets

    datasets.Dataset.from_dict({"text": DOCS[:10]}).save_to_disk(str(tmp_path / "saved"))
    assert read(tmp_path / "saved")[0] == DOCS[:10]
    local = tmp_path / "hub_like"
    local.mkdir()
    write_jsonl(local / "train.jsonl", [{"text": d} for d in DOCS[:10]])
    assert read(local, format="hf")[0] == DOCS[:10]  # the `datasets` route for a hub id, offline


def test_glob_folder_max_docs_and_names(tmp_path):
    for i in range(3):
        write_jsonl(tmp_path / f"part-{i}.jsonl", [{"text": f"{i}-{j}"} for j in range(2)])
    assert read(tmp_path / "part-*.jsonl")[0] == ["0-0", "0-1", "1-0", "1-1", "2-0", "2-1"]
    assert read(tmp_path)[0][:2] == ["0-0", "0-1"]
    assert read(tmp_path, max_docs=3)[0] == ["0-0", "0-1", "1-0"]
    assert source_name(SourceSpec(path="x/c4-sample.01.json.gz")) == "c4-sample.01"
    assert parse_source_arg("data/a.jsonl:0.25") == SourceSpec(path="data/a.jsonl", weight=0.25)
    assert parse_source_arg("HuggingFaceFW/fineweb").weight is None
    assert expand_path("${SPROUT_MIRROR}/x.txt", "/m") == "/m/x.txt"


def test_memory_stays_flat_on_a_large_json_array(tmp_path):
    p = tmp_path / "big.json"
    doc = "word " * 400  # 2 kB per element, 25 MB in all
    with open(p, "w") as f:
        f.write("[" + ",\n".join(json.dumps({"text": doc, "i": i}) for i in range(12_000)) + "]")
    tracemalloc.start()
    n = sum(1 for _ in iter_documents(SourceSpec(path=str(p))))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert n == 12_000
    assert peak < 12 * 2**20, f"peak {peak / 2**20:.1f} MiB for a 25 MB file"


# ---------------------------------------------------------------- bad input


def test_truncated_gz_names_file_and_offset(tmp_path):
    data = gzip.compress("".join(json.dumps({"text": d}) + "\n" for d in DOCS * 20).encode())
    p = tmp_path / "cut.jsonl.gz"
    p.write_bytes(data[: len(data) // 2])
    with pytest.raises(SproutError, match=r"cut.jsonl.gz: truncated gzip stream .*byte"):
        read(p)


def test_truncated_and_fake_zst(tmp_path):
    raw = "".join(json.dumps({"text": d}) + "\n" for d in DOCS * 20).encode()
    p = tmp_path / "cut.jsonl.zst"
    p.write_bytes(zstandard.ZstdCompressor().compress(raw)[:-10])
    with pytest.raises(SproutError, match=r"cut.jsonl.zst: truncated zstd stream .*byte"):
        read(p)
    fake = tmp_path / "plain.jsonl.zst"  # like Dolma's test file: plain JSONL named .zst
    fake.write_bytes(raw)
    with pytest.raises(SproutError, match="plain.jsonl.zst: not zstd-compressed"):
        read(fake)


def test_invalid_json_line_skipped_with_warning_or_strict(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"text": "one"}\n{"text": broken\n\n{"text": "three"}\n')
    warnings = []
    stats = ReadStats()
    docs = list(iter_documents(SourceSpec(path=str(p)), stats=stats, warn=warnings.append))
    assert docs == ["one", "three"] and stats.invalid_json == 1
    assert len(warnings) == 1 and "bad.jsonl:2: invalid JSON line" in warnings[0]
    with pytest.raises(SproutError, match="bad.jsonl:2: invalid JSON line"):
        list(iter_documents(SourceSpec(path=str(p)), strict=True))


def test_missing_or_non_string_text_field(tmp_path):
    p = tmp_path / "f.jsonl"
    write_jsonl(p, [{"text": "ok"}, {"content": "no text here"}])
    with pytest.raises(SproutError, match=r"f.jsonl:2: missing text field 'text' \(keys: content\)"):
        read(p)
    write_jsonl(p, [{"text": None}])
    with pytest.raises(SproutError, match="f.jsonl:1: text field 'text' is NoneType"):
        read(p)
    arr = tmp_path / "arr.json"
    arr.write_text(json.dumps([{"text": "a"}, {"body": "b"}]))
    with pytest.raises(SproutError, match="arr.json: array element 1: missing text field"):
        read(arr)


def test_empty_inputs_and_bad_paths(tmp_path):
    for name, content in (("e.txt", ""), ("e.jsonl", "\n\n"), ("w.txt", " \n \n")):
        (tmp_path / name).write_text(content)
        with pytest.raises(SproutError, match=f"{name}: empty input"):
            read(tmp_path / name)
    (tmp_path / "allbad.jsonl").write_text("nope\n")
    with pytest.raises(SproutError, match=r"allbad.jsonl: empty input.*1 invalid"):
        read(tmp_path / "allbad.jsonl")
    with pytest.raises(SproutError, match="nowhere.jsonl: no such file"):
        read(tmp_path / "nowhere.jsonl")
    with pytest.raises(SproutError, match="data/typo.jsonl: no such file"):  # a relative path, not a hub id
        read("data/typo.jsonl")
    with pytest.raises(SproutError, match="no files match"):
        read(tmp_path / "nothing-*.jsonl")
    (tmp_path / "u.txt").write_bytes(b"fine text\n\xff\xfe broken")
    with pytest.raises(SproutError, match="u.txt: invalid UTF-8 at byte 10"):
        read(tmp_path / "u.txt")
    (tmp_path / "j.json").write_text('[{"text": "a"} {"text": "b"}]')
    with pytest.raises(SproutError, match="j.json: expected ',' or ']' after array element 0"):
        read(tmp_path / "j.json")


def test_mirror_variable_must_be_set(monkeypatch):
    monkeypatch.setenv("SPROUT_MIRROR", "")  # no mirror, not even the default beside the repository
    with pytest.raises(SproutError, match=r"x.txt: uses \$\{SPROUT_MIRROR\} but no mirror is set"):
        expand_path("${SPROUT_MIRROR}/x.txt", None)
