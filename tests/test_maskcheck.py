"""The loss-mask checker catches each kind of misaligned mask, and corrupted files fail loudly."""

import re
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from sft_fixtures import source_list, write_sources

from sprout.chat import segment, template_for
from sprout.errors import SproutError
from sprout.formats.maskcheck_sft import (CUT_LABEL, check_arrays, format_row, parse_rows, prep_warnings, random_rows,
                                      rows_html, telling_rows)
from sprout.formats.packed_sft import SFTFile, write_sft
from sprout.prep.sft_data import SFTDataConfig, prepare

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def clean(tok, tmp_path):
    """A packed file (several documents per row) and its arrays and attrs."""
    sources = source_list(write_sources(tmp_path / "src"))
    out = tmp_path / "clean.h5"
    prepare(SFTDataConfig(tokenizer=tok.spec, out=str(out), seq_len=160, sources=sources, val_fraction=0.0),
            tok, log=lambda *_: None)
    with SFTFile(out) as f:
        return out, f.verify(), f.attrs


def check(arrays, attrs, tok):
    return check_arrays(arrays, template_for(tok), attrs["pad_id"], attrs["vocab_size"],
                        attrs["counts"]["split"]["truncated_open"])


def first_doc_with_user_turn(arrays, tok, row_min_docs=2):
    """(row, doc start, turns) of a document in a row holding at least two documents."""
    for r in range(len(arrays["tokens"])):
        seg = arrays["segment_ids"][r]
        if seg.max() >= row_min_docs:
            cols = np.flatnonzero(seg == 1)
            return r, int(cols[0]), int(cols[-1]) + 1, segment(arrays["tokens"][r, cols], template_for(tok))
    raise AssertionError("fixture has no row with two documents")


def test_clean_file_passes(clean, tok):
    _, arrays, attrs = clean
    report = check(arrays, attrs, tok)
    assert report.violations == []
    t = report.totals()
    assert t["rows"] == len(arrays["tokens"]) and t["documents"] == 6 and t["rows_without_trained_token"] == 0
    assert 0 < t["trained_fraction"] < 1 and t["trained_tokens"] == int(arrays["loss_mask"].sum())
    text = format_row(arrays, 0, template_for(tok), tok, color=True)
    assert "\x1b[30;42m" in text and "<|assistant|>" in text
    assert "[[" in format_row(arrays, 0, template_for(tok), tok, color=False)


def test_catches_shifted_mask(clean, tok):
    _, arrays, attrs = clean
    cols = np.flatnonzero(arrays["segment_ids"][0] == 1)
    first_answer = next(t for t in segment(arrays["tokens"][0, cols], template_for(tok)) if t.role == "assistant")
    arrays["loss_mask"] = np.roll(arrays["loss_mask"], 1, axis=1)
    arrays["loss_mask"][:, 0] = 0
    report = check(arrays, attrs, tok)
    shifted = [v for v in report.violations if "shifted one position right" in v.message]
    assert shifted[0].row == 0 and shifted[0].position == cols[0] + first_answer.content_start
    assert report.violations[0] == shifted[0]  # reported in row order


def test_catches_masked_user_token(clean, tok):
    _, arrays, attrs = clean
    r, start, _, turns = first_doc_with_user_turn(arrays, tok)
    user = next(t for t in turns if t.role == "user")
    pos = start + user.content_start + 1
    arrays["loss_mask"][r, pos] = 1
    report = check(arrays, attrs, tok)
    assert [(v.row, v.position) for v in report.violations] == [(r, pos)]
    assert "loss_mask 1 on user content" in report.violations[0].message


def test_catches_unsupervised_eot(clean, tok):
    _, arrays, attrs = clean
    r, start, _, turns = first_doc_with_user_turn(arrays, tok)
    eot = start + turns[-1].end
    assert arrays["tokens"][r, eot] == tok.eot_id
    arrays["loss_mask"][r, eot] = 0
    report = check(arrays, attrs, tok)
    assert [(v.row, v.position) for v in report.violations] == [(r, eot)]
    assert "end-of-turn token not supervised" in report.violations[0].message


def test_catches_missing_eot_token(clean, tok):
    _, arrays, attrs = clean
    r, start, end, turns = first_doc_with_user_turn(arrays, tok)
    arrays["tokens"][r, end - 1] = tok.encode("x")[0]  # the answer's eot replaced by a text token
    report = check(arrays, attrs, tok)
    assert report.violations and report.violations[0].row == r and report.violations[0].position == end - 1
    assert "not closed by the end-of-turn token" in report.violations[0].message
    # an eot lost between a user turn and the answer: the assistant header lands inside the user turn
    _, arrays2, _ = clean
    user = next(t for t in turns if t.role == "user")
    arrays2 = {k: v.copy() for k, v in arrays2.items()}
    arrays2["tokens"][r, start + user.end] = tok.encode("x")[0]
    report = check(arrays2, attrs, tok)
    assert "header inside a user turn" in report.violations[0].message


def test_catches_layout_errors(clean, tok):
    _, arrays, attrs = clean
    a = {k: v.copy() for k, v in arrays.items()}
    pad = np.argwhere(a["segment_ids"] == 0)
    assert len(pad), "fixture needs padding"
    r, c = pad[0]
    a["loss_mask"][r, c] = 1
    assert any("trained token in padding" in v.message and (v.row, v.position) == (r, c) for v in check(a, attrs, tok).violations)
    b = {k: v.copy() for k, v in arrays.items()}
    b["position_ids"][0, 5] += 1
    assert any("position ids" in v.message and (v.row, v.position) == (0, 5) for v in check(b, attrs, tok).violations)
    c2 = {k: v.copy() for k, v in arrays.items()}
    c2["segment_ids"][0, 0] = 2
    assert any("segment ids" in v.message for v in check(c2, attrs, tok).violations)


def _rewrite(path, arrays, attrs):
    write_sft(path, arrays, attrs)
    return path


def test_cli_exit_codes_and_html(clean, tok, mirror, tmp_path):
    path, arrays, attrs = clean
    run = lambda *a: subprocess.run([sys.executable, "scripts/check_loss_mask.py", *map(str, a), "--mirror", str(mirror)],  # noqa: E731
                                    cwd=ROOT, capture_output=True, text=True)
    ok = run(path, "--show", "1", "--html", tmp_path / "v.html")
    assert ok.returncode == 0, ok.stderr
    assert "rows_without_trained_token" in ok.stdout and "trained_fraction" in ok.stdout
    page = (tmp_path / "v.html").read_text()
    assert "class='t trained'" in page and "<h3>row " in page
    bad = {k: v.copy() for k, v in arrays.items()}
    r, start, _, turns = first_doc_with_user_turn(bad, tok)
    bad["loss_mask"][r, start] = 1  # the first header token of the document
    fail = run(_rewrite(tmp_path / "bad.h5", bad, attrs))
    assert fail.returncode == 1
    assert f"row {r} position {start}: loss_mask 1 on the" in fail.stderr and "header" in fail.stderr


def test_corrupted_files_fail_loudly(clean, tmp_path, mirror):
    path, arrays, attrs = clean
    # 1. a flipped byte inside a data chunk: the fletcher32 checksum fails on read
    flipped = tmp_path / "flipped.h5"
    flipped.write_bytes(path.read_bytes())
    with h5py.File(flipped, "r") as f:
        offset = f["loss_mask"].id.get_chunk_info(0).byte_offset
    data = bytearray(flipped.read_bytes())
    data[offset + 3] ^= 0xFF
    flipped.write_bytes(bytes(data))
    with pytest.raises(SproutError, match="flipped.h5: corrupted data"):
        SFTFile(flipped).verify()
    run = subprocess.run([sys.executable, "scripts/check_loss_mask.py", str(flipped), "--mirror", str(mirror)],
                         cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 2 and run.stderr.startswith("error:") and "flipped.h5" in run.stderr
    # 2. an edit through HDF5 (valid chunk checksums) no longer matches the stored sha256
    edited = tmp_path / "edited.h5"
    edited.write_bytes(path.read_bytes())
    with h5py.File(edited, "r+") as f:
        f["loss_mask"][0, 0] = 1
    with pytest.raises(SproutError, match="loss_mask does not match its stored sha256"):
        SFTFile(edited).verify()
    # 3. truncated file, text file, HDF5 without the contract, wrong dtype
    cut = tmp_path / "cut.h5"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(SproutError, match="cut.h5"):
        SFTFile(cut).verify()
    (tmp_path / "text.h5").write_text("hello")
    with pytest.raises(SproutError, match="text.h5: not a readable HDF5 file"):
        SFTFile(tmp_path / "text.h5")
    with h5py.File(tmp_path / "other.h5", "w") as f:
        f["tokens"] = np.zeros(4)
    with pytest.raises(SproutError, match="other.h5: not a sprout SFT file"):
        SFTFile(tmp_path / "other.h5")
    wrong = {**arrays, "loss_mask": arrays["loss_mask"].astype(np.int32)}
    _rewrite(tmp_path / "dtype.h5", wrong, attrs)
    with pytest.raises(SproutError, match="dtype.h5: dataset loss_mask has dtype int32"):
        SFTFile(tmp_path / "dtype.h5")


def test_html_escapes_text(clean, tok):
    _, arrays, attrs = clean
    page = rows_html(arrays, [0], template_for(tok), tok, "t<1>", {"rows": 1})
    assert "t&lt;1&gt;" in page and "&lt;|assistant|&gt;" in page


def test_truncated_answers_pass_only_when_recorded(tok, tmp_path):
    sources = source_list(write_sources(tmp_path / "src"))
    out = tmp_path / "short.h5"
    result = prepare(SFTDataConfig(tokenizer=tok.spec, out=str(out), seq_len=40, sources=sources, val_fraction=0.0),
                     tok, log=lambda *_: None)
    assert result["train"]["truncated_open"] >= 1
    with SFTFile(out) as f:
        arrays, attrs = f.verify(), f.attrs
    report = check(arrays, attrs, tok)
    assert report.violations == [] and report.truncated_open == result["train"]["truncated_open"]
    report = check_arrays(arrays, template_for(tok), attrs["pad_id"], attrs["vocab_size"], truncated_open=0)
    assert [v.row for v in report.violations] == [None]
    assert "end without their end-of-turn token" in report.violations[0].message


# ---- choosing rows, warnings, the page ----------------------------------------------------------
def cli(*args, mirror):
    return subprocess.run([sys.executable, "scripts/check_loss_mask.py", *map(str, args), "--mirror", str(mirror)],
                          cwd=ROOT, capture_output=True, text=True)


def test_default_rows_show_a_boundary_a_trained_eot_and_padding(clean, tok):
    _, arrays, _ = clean
    tpl = template_for(tok)
    tokens, mask, seg = arrays["tokens"], arrays["loss_mask"], arrays["segment_ids"]
    has = {"boundary": seg.max(axis=1) >= 2, "eot": ((tokens == tpl.eot_id) & (mask == 1)).any(axis=1),
           "padding": (seg == 0).any(axis=1)}
    assert all(h.any() for h in has.values()), "fixture needs each kind of row"
    picked = telling_rows(arrays, tpl, 3)
    assert len(picked) == len(set(picked)) and all(has[k][picked].any() for k in has)
    one = telling_rows(arrays, tpl, 1)[0]
    if (has["boundary"] & has["eot"] & has["padding"]).any():  # one row shows all three when one can
        assert all(has[k][one] for k in has)


def test_rows_by_number_and_seeded_random_rows(clean, tok, mirror):
    path, arrays, _ = clean
    n = len(arrays["tokens"])
    assert parse_rows("1, 0", n, "f") == [1, 0]
    for bad, msg in ((f"{n}", f"row {n} is past the end of f ({n:,} rows)"), ("x", "'x' is not a row number")):
        with pytest.raises(SproutError, match=re.escape(msg)):
            parse_rows(bad, n, "f")
    assert random_rows(1000, 5, seed=1) == random_rows(1000, 5, seed=1) != random_rows(1000, 5, seed=2)
    assert len(set(random_rows(1000, 5, seed=1))) == 5 and random_rows(3, 10, seed=0) == [0, 1, 2]
    shown = cli(path, "--rows", "1,0", "--no-color", mirror=mirror)
    assert shown.returncode == 0 and "rows shown: 1, 0" in shown.stdout
    assert shown.stdout.index("── row 1 ") < shown.stdout.index("── row 0 ")
    drawn = [cli(path, "--random", 2, "--seed", 5, mirror=mirror).stdout for _ in range(2)]
    line = next(x for x in drawn[0].splitlines() if "rows shown:" in x)
    assert line in drawn[1] and line.strip() == "rows shown: " + ", ".join(map(str, random_rows(n, 2, 5)))
    past = cli(path, "--rows", n, mirror=mirror)
    assert past.returncode == 2 and past.stderr.count("\n") == 1 and "past the end" in past.stderr


def test_prep_warnings_hand_computed():
    counts = {"split": {"examples_in": 10, "truncated": 2, "truncated_open": 1, "prompt_too_long": 3,
                        "overlong_dropped": 0, "dropped_empty_turn": 1, "rows": 4}}
    assert prep_warnings(counts) == [
        "warning: 2 of 10 examples were truncated to fit seq_len (1 cut inside an answer, without their "
        "end-of-turn token)",
        "warning: 4 of 10 examples were dropped (dropped_empty_turn 1, prompt_too_long 3)"]
    assert prep_warnings({"split": {"examples_in": 10, "truncated": 0}}) == []


def test_truncation_warned_and_marked_on_the_page(tok, tmp_path, mirror):
    sources = source_list(write_sources(tmp_path / "src"))
    out = tmp_path / "short.h5"
    prepare(SFTDataConfig(tokenizer=tok.spec, out=str(out), seq_len=40, sources=sources, val_fraction=0.0),
            tok, log=lambda *_: None)
    with SFTFile(out) as f:
        arrays, counts = f.verify(), f.attrs["counts"]
    open_rows = [r for r in range(len(arrays["tokens"]))
                 if arrays["segment_ids"][r, -1] and arrays["tokens"][r, -1] != template_for(tok).eot_id]
    assert open_rows, "fixture needs a truncated answer"
    result = cli(out, "--rows", open_rows[0], "--html", tmp_path / "p.html", mirror=mirror)
    assert result.returncode == 0, result.stderr
    assert f"warning: {counts['split']['truncated']:,} of" in result.stderr and "truncated to fit" in result.stderr
    page = (tmp_path / "p.html").read_text()
    assert CUT_LABEL in page and "class='warn'" in page
    ids = arrays["tokens"][open_rows[0]]
    assert f"title='id {int(ids[-1])}'" in page  # the last token in its own box, with its id


def test_page_names_the_eot_and_rounds_figures(clean, tok):
    _, arrays, _ = clean
    tpl = template_for(tok)
    row = telling_rows(arrays, tpl, 1)[0]
    page = rows_html(arrays, [row], tpl, tok, "t", {"trained_fraction": 0.123456, "rows": 12345})
    assert "&lt;end-of-turn&gt;</span>" in page and f"id {tpl.eot_id}: end-of-turn" in page
    assert "<td>12.3%</td>" in page and "<td>12,345</td>" in page and "0.123456" not in page
    trained = int(arrays["loss_mask"][row].sum())
    eots = int(((arrays["tokens"][row] == tpl.eot_id) & (arrays["loss_mask"][row] == 1)).sum())
    assert page.count("class='t trained'") == trained - eots  # one box per trained token, the eot named apart


def test_a_file_without_rows_fails_with_one_line(clean, tmp_path, mirror):
    _, arrays, attrs = clean
    empty = {k: v[:0] for k, v in arrays.items()}
    path = _rewrite(tmp_path / "empty.h5", empty, attrs)
    result = cli(path, mirror=mirror)
    assert result.returncode == 2
    assert result.stderr == f"error: {path}: the file holds no rows; an empty SFT file fails the check\n"
