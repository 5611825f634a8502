"""The loss-mask checker for preference pairs (`sprout.formats.maskcheck_pairs` and
`scripts/check_loss_mask.py FILE.jsonl`): good pairs pass, crafted bad ones (prompt tokens that
differ between the sides, a mask on an earlier assistant turn or missing the eot, an answer that
is not the record's, a side past the context) fail naming the line; --html writes a page."""

import dataclasses
import runpy
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sprout.chat import template_for
from sprout.formats import preference_tokens
from sprout.formats.maskcheck_pairs import check_preferences, format_pair, pair_violations
from sprout.formats.preference_tokens import render_pair
from sprout.formats.preference_pairs import write_preferences

ROOT = Path(__file__).resolve().parents[1]


def msg(role, content):
    return {"role": role, "content": content}


def pair(i, prompt=None, chosen=None, rejected=None):
    return {"id": f"p{i}", "source": "test", "prompt": prompt or [msg("user", f"What is {i} times 3?")],
            "chosen": [msg("assistant", chosen or f"It is {3 * i}.")],
            "rejected": [msg("assistant", rejected or f"Perhaps {3 * i + 2}?")]}


MULTI_TURN = pair(9, prompt=[msg("system", "Answer with a number."), msg("user", "What is 1 plus 1?"),
                             msg("assistant", "It is 2."), msg("user", "And 2 plus 2?")],
                  chosen="4", rejected="It is 5.")


def long_history(i):
    filler = " ".join(["lorem ipsum dolor"] * 15)
    return pair(i, prompt=[msg("user", filler), msg("assistant", filler), msg("user", "Last: 3 plus 3?")],
                chosen="6", rejected="It is 7.")


def write(tmp_path, records, name="prefs.jsonl"):
    path = tmp_path / name
    write_preferences(path, records)
    return path


def messages(violations):
    return [str(v) for v in violations]


def test_good_pairs_pass(tmp_path, tok):
    tpl = template_for(tok)
    seq_len = render_pair(long_history(2), tok).longest - 5  # the long history only fits truncated
    path = write(tmp_path, [pair(0), MULTI_TURN, long_history(2), pair(3, rejected="no " * seq_len)])
    report = check_preferences(path, tok, tpl, seq_len, "keep_end", show=2)
    assert messages(report.violations) == []
    totals = report.totals()
    assert totals["pairs_read"] == 4 and totals["pairs_checked"] == 3 and totals["violations"] == 0
    assert [d[:2] for d in report.dropped] == [(4, "p3")]
    assert report.truncated == [(3, "p2", 2)]
    shown = format_pair(report.shown[1], tpl, tok, color=False)
    assert "[chosen] " in shown and "[[4]][[<|endoftext|>]]" in shown and "[[It is 5.]][[<|endoftext|>]]" in shown
    assert "[[It is 2." not in shown  # the earlier assistant turn is not trained
    # with `drop` the long history is listed as dropped, not truncated
    report = check_preferences(path, tok, tpl, seq_len, "drop")
    assert [d[:2] for d in report.dropped] == [(3, "p2"), (4, "p3")] and report.truncated == []


def test_prompt_tokens_that_differ_fail_naming_the_line(sp):
    tpl = template_for(sp)
    good = render_pair(MULTI_TURN, sp, line=7)
    rejected = good.rejected.copy()
    user_token = int(np.flatnonzero(good.rejected_mask == 0)[-3])  # a token of the last user turn
    rejected[user_token] = sp.encode("x")[0]
    crafted = dataclasses.replace(good, rejected=rejected)
    found = messages(pair_violations(crafted, MULTI_TURN, sp, tpl, 256))
    assert len(found) == 1 and found[0].startswith(f"line 7 (p9) position {user_token}: the prompt tokens")


def test_masks_out_of_place_fail(sp):
    tpl = template_for(sp)
    good = render_pair(MULTI_TURN, sp, line=3)
    assert pair_violations(good, MULTI_TURN, sp, tpl, 256) == []
    ids = good.chosen.tolist()
    earlier = sp.encode("It is 2.")
    at = next(i for i in range(len(ids)) if ids[i:i + len(earlier)] == earlier)
    on_earlier = good.chosen_mask.copy()
    on_earlier[at:at + len(earlier) + 1] = 1  # SFT's mask: every assistant turn
    found = messages(pair_violations(dataclasses.replace(good, chosen_mask=on_earlier), MULTI_TURN, sp, tpl, 256))
    assert found == [f"line 3 (p9) chosen position {at}: mask 1 on assistant content of turn 2 "
                     "(an earlier assistant turn of the prompt)"]
    no_eot = good.rejected_mask.copy()
    no_eot[-1] = 0
    found = messages(pair_violations(dataclasses.replace(good, rejected_mask=no_eot), MULTI_TURN, sp, tpl, 256))
    assert found == [f"line 3 (p9) rejected position {len(no_eot) - 1}: mask 0 on the end-of-turn token "
                     "closing assistant turn 4 (the response is not fully covered)"]
    on_header = good.chosen_mask.copy()
    on_header[good.prompt_len - 1] = 1
    found = messages(pair_violations(dataclasses.replace(good, chosen_mask=on_header), MULTI_TURN, sp, tpl, 256))
    assert found == [f"line 3 (p9) chosen position {good.prompt_len - 1}: mask 1 on the assistant header of turn 4"]


def test_wrong_answer_and_overlong_side_fail(sp):
    tpl = template_for(sp)
    good = render_pair(MULTI_TURN, sp, line=2)
    other = {**MULTI_TURN, "rejected": [msg("assistant", "It is 6.")]}
    found = messages(pair_violations(good, other, sp, tpl, 256))
    assert len(found) == 1 and found[0].startswith("line 2 (p9) rejected") and "'It is 5.'" in found[0]
    n = len(good.rejected)
    assert len(good.chosen) < n
    found = messages(pair_violations(good, MULTI_TURN, sp, tpl, n - 1))
    assert found == [f"line 2 (p9) rejected position {n - 1}: {n} tokens, longer than seq_len {n - 1} "
                     "(cut by the context)"]


def run_script(*args):
    return subprocess.run([sys.executable, "scripts/check_loss_mask.py", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_script_passes_and_writes_a_page(tmp_path, sp):
    path = write(tmp_path, [pair(0), MULTI_TURN, pair(2, rejected="no " * 300)])
    page = tmp_path / "pairs.html"
    result = run_script(path, "--tokenizer", sp.spec, "--seq-len", 128, "--html", page, "--no-color")
    assert result.returncode == 0, result.stderr
    assert "OK: every pair passes" in result.stdout and "dropped: line 3 (p2)" in result.stdout
    assert "[[It is 0.]][[<|endoftext|>]]" in result.stdout
    text = page.read_text()
    assert text.startswith("<!doctype html>") and "<span class='trained'>It is 0.</span>" in text
    result = run_script(path, "--tokenizer", sp.spec)
    assert result.returncode == 2 and result.stderr.startswith("error: ") and "--seq-len" in result.stderr


def test_script_fails_naming_the_line(tmp_path, sp, monkeypatch, capsys):
    """A renderer whose rejected side of line 2 carries another prompt token fails the check."""
    path = write(tmp_path, [pair(0), pair(1)])
    real = preference_tokens.render_pair

    def crafted(record, tok, *args, **kwargs):
        out = real(record, tok, *args, **kwargs)
        if record["id"] != "p1":
            return out
        rejected = out.rejected.copy()
        rejected[1] = tok.encode("x")[0]
        return dataclasses.replace(out, rejected=rejected)

    monkeypatch.setattr(preference_tokens, "render_pair", crafted)
    monkeypatch.setattr(sys, "argv", ["check_loss_mask.py", str(path), "--tokenizer", sp.spec, "--seq-len", "128"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(ROOT / "scripts" / "check_loss_mask.py"), run_name="__main__")
    assert exit_.value.code == 1
    err = capsys.readouterr().err
    assert f"FAIL {path}: line 2 (p1) position 1: the prompt tokens" in err and "line 1" not in err
