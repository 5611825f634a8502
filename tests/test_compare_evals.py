"""Two evaluations compared (sprout.evaluation.compare, scripts/compare_evals.py): the paired
change of every figure both files hold, on made-up evaluate.py JSONs of problems and of
preference pairs written here.

Checked: the change is the mean of the per-problem (per-pair) differences, by kind for pairs;
files of other problems, another generation length or another preference file do not pair and
say why; what is not an evaluate.py JSON is refused in one line; the script prints and writes
the rows."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sprout.errors import SproutError
from sprout.evaluation.compare import change, compare_rows, read_evaluation

ROOT = Path(__file__).resolve().parents[1]


def task_file(correct: list[int], greedy: list[int], *, n=4, max_new_tokens=64, ids=None) -> dict:
    ids = ids or [f"p{i}" for i in range(len(correct))]
    problems = [{"id": i, "n": n, "correct": c, "formatted": n, "greedy_correct": g}
                for i, c, g in zip(ids, correct, greedy)]
    return {"task": "arith", "split": "dev", "settings": {"n": n, "temperature": 1.0, "max_new_tokens": max_new_tokens},
            "metrics": {"prompts": len(problems), "pass@1": sum(correct) / (n * len(correct)),
                        "greedy/accuracy": sum(greedy) / len(greedy), "completions/mean_length": 20.0},
            "problems": problems}


def pref_file(correct: list[bool], kinds: list[str], sha="aa") -> dict:
    pairs = [{"id": f"q{i}", "kind": k, "correct": c, "margin": 1.0} for i, (c, k) in enumerate(zip(correct, kinds))]
    by = {}
    for k in sorted(set(kinds)):
        group = [p for p in pairs if p["kind"] == k]
        by[f"by_kind/{k}/accuracy"] = sum(p["correct"] for p in group) / len(group)
        by[f"by_kind/{k}/pairs"] = len(group)
    return {"task": "preferences", "preferences_sha256": sha, "pairs": pairs,
            "metrics": {"accuracy": sum(correct) / len(correct), "pairs": len(pairs), "margin": 1.0, **by}}


def test_the_change_is_the_mean_of_the_paired_differences():
    a = task_file([0, 1, 2, 4, 3, 0], [0, 0, 1, 1, 1, 0])
    b = task_file([2, 1, 4, 4, 3, 1], [1, 0, 1, 1, 1, 1])
    rows = {r["figure"]: r for r in compare_rows(a, b)}
    assert list(rows) == ["pass@1", "greedy/accuracy"]  # counts and lengths are no per-problem means
    assert rows["pass@1"]["change"]["diff"] == pytest.approx((2 + 0 + 2 + 0 + 0 + 1) / 4 / 6)
    assert rows["greedy/accuracy"]["change"]["diff"] == pytest.approx(2 / 6)
    lo, hi = rows["pass@1"]["change"]["ci"]
    assert lo <= rows["pass@1"]["change"]["diff"] <= hi and rows["pass@1"]["change"]["problems"] == 6
    assert change(a, a, "pass@1")["diff"] == 0 and not change(a, a, "pass@1")["real"]


def test_files_that_do_not_pair_say_why():
    a = task_file([1, 2], [1, 0])
    assert change(a, task_file([1, 2], [1, 0], ids=["p0", "x"]), "pass@1")["not_paired"] == \
        "different problems (2 vs 2, 1 shared)"
    assert change(a, task_file([1, 2], [1, 0], max_new_tokens=32), "greedy/accuracy")["not_paired"] == \
        "different max_new_tokens (64 vs 32)"
    p = pref_file([True, False], ["near_miss", "near_miss"])
    assert change(p, pref_file([True, True], ["near_miss", "near_miss"], sha="bb"), "accuracy")["not_paired"] == \
        "different preference files"
    assert change(a, p, "accuracy")["not_paired"] == "a preference ranking against a task's evaluation"


def test_preference_rankings_pair_on_their_pairs_overall_and_by_kind():
    kinds = ["near_miss"] * 4 + ["broken_format"] * 2
    a = pref_file([True, True, False, True, True, True], kinds)
    b = pref_file([True, False, False, False, True, True], kinds)
    rows = {r["figure"]: r["change"] for r in compare_rows(a, b)}
    assert set(rows) == {"accuracy", "by_kind/near_miss/accuracy", "by_kind/broken_format/accuracy"}
    assert rows["accuracy"]["diff"] == pytest.approx(-2 / 6) and rows["accuracy"]["problems"] == 6
    assert rows["by_kind/near_miss/accuracy"]["diff"] == pytest.approx(-2 / 4)
    assert rows["by_kind/broken_format/accuracy"]["diff"] == 0


@pytest.mark.parametrize("content, message", [
    ("[1, 2]", "not a scripts/evaluate.py JSON"),
    ("{", "not a readable JSON file"),
    (json.dumps({"task": "arith", "metrics": {}}), "problems: missing, so nothing can be paired"),
    (json.dumps({"task": "preferences", "metrics": {}}), "pairs: missing"),
])
def test_what_is_not_an_evaluation_is_refused_naming_the_file(tmp_path, content, message):
    path = tmp_path / "x.json"
    path.write_text(content)
    with pytest.raises(SproutError, match=f"{path}: {message}"):
        read_evaluation(path)


def test_the_script_prints_each_change_and_writes_the_rows(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(task_file([0, 0, 0, 0, 0, 0, 0, 0], [0] * 8)))
    b.write_text(json.dumps(task_file([4] * 8, [1] * 8)))
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "compare_evals.py"), str(a), str(b), "--json",
                           str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "pass@1" in proc.stdout and "+100.0 [+100.0, +100.0] ✓  (8 paired)" in proc.stdout
    written = json.loads(out.read_text())
    assert [r["figure"] for r in written["rows"]] == ["pass@1", "greedy/accuracy"] and written["after"] == [str(b)]
    prefs = tmp_path / "prefs.json"
    prefs.write_text(json.dumps(pref_file([True], ["near_miss"])))
    none = subprocess.run([sys.executable, str(ROOT / "scripts" / "compare_evals.py"), str(a), str(prefs)],
                          capture_output=True, text=True, timeout=120)
    assert none.returncode == 1 and "hold no figure in common" in none.stdout
    bad = subprocess.run([sys.executable, str(ROOT / "scripts" / "compare_evals.py"), str(a), str(tmp_path / "no.json")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and bad.stderr.count("\n") == 1 and "no.json: not a readable JSON file" in bad.stderr


def test_output_cut_short_by_its_reader_ends_quietly(tmp_path):
    """`run_main`: a stdout whose reader is gone (`compare_evals.py ... | head`) ends the script
    with SIGPIPE's status, 141, and no traceback; another broken pipe is still an error."""
    import os

    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(task_file([0] * 8, [0] * 8)))
    b.write_text(json.dumps(task_file([4] * 8, [1] * 8)))
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader has gone before the first line
    try:
        proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "compare_evals.py"), str(a), str(b)],
                              stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)
    assert proc.returncode == 141 and proc.stderr == "", proc.stderr
    other = ("import os\nfrom sprout.errors import run_main\ndef main():\n    r, w = os.pipe()\n    os.close(r)\n"
             "    os.write(w, b'x')\nrun_main(main)")  # another pipe broken, stdout fine: a real error
    proc = subprocess.run([sys.executable, "-c", other], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "BrokenPipeError" in proc.stderr, proc.stderr


def test_several_after_files_are_one_settings_seeds_compared_by_their_mean(tmp_path):
    """The mean over seeds and its change: the seeds' mean of the per-problem differences, with
    the two-level interval (`seeds_paired_difference_interval`); one seed is the paired change."""
    from sprout.evaluation.compare import compare_seed_rows, seeds_change
    from sprout.evaluation.statistics import seeds_paired_difference_interval

    before = task_file([0, 1, 2, 0, 1, 0], [0, 0, 1, 0, 1, 0])
    seeds = [task_file([4, 1, 2, 3, 1, 0], [1, 0, 1, 1, 1, 0]), task_file([2, 2, 2, 1, 1, 1], [1, 1, 1, 0, 1, 0]),
             task_file([0, 1, 2, 0, 1, 0], [0, 0, 1, 0, 1, 0])]
    rows = {r["figure"]: r for r in compare_seed_rows(before, seeds)}
    assert list(rows) == ["pass@1", "greedy/accuracy"]
    assert rows["pass@1"]["seeds"] == [s["metrics"]["pass@1"] for s in seeds]
    assert rows["pass@1"]["after"] == pytest.approx(sum(rows["pass@1"]["seeds"]) / 3)
    ch = rows["pass@1"]["change"]
    assert ch["diff"] == pytest.approx(((4 + 0 + 0 + 3 + 0 + 0) + (2 + 1 + 0 + 1 + 0 + 1) + 0) / 4 / 6 / 3)
    expected = seeds_paired_difference_interval(
        {f"p{i}": c / 4 for i, c in enumerate([0, 1, 2, 0, 1, 0])},
        [{p["id"]: p["correct"] / 4 for p in s["problems"]} for s in seeds])
    assert [ch["diff"], *ch["ci"]] == pytest.approx(list(expected)) and (ch["seeds"], ch["problems"]) == (3, 6)
    one = seeds_change(before, seeds[:1], "greedy/accuracy")
    assert [one["diff"], *one["ci"]] == pytest.approx([change(before, seeds[0], "greedy/accuracy")["diff"],
                                                       *change(before, seeds[0], "greedy/accuracy")["ci"]])
    other = task_file([1, 2, 0, 0, 0, 0], [0] * 6, ids=[f"x{i}" for i in range(6)])
    assert seeds_change(before, [seeds[0], other], "pass@1")["not_paired"].startswith("different problems")
    files = []
    for i, data in enumerate([before, *seeds]):
        files.append(tmp_path / f"{i}.json")
        files[-1].write_text(json.dumps(data))
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "compare_evals.py"), *map(str, files), "--json",
                           str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "the mean of 3 seeds" in proc.stdout and f"{100 * ch['diff']:+.1f} [{100 * ch['ci'][0]:+.1f}" in proc.stdout
    written = json.loads(out.read_text())
    assert written["after"] == list(map(str, files[1:])) and written["rows"][0]["seeds"] == rows["pass@1"]["seeds"]
    twice = subprocess.run([sys.executable, str(ROOT / "scripts" / "compare_evals.py"), str(files[0]), str(files[1]),
                            str(files[1])], capture_output=True, text=True, timeout=120)
    assert twice.returncode != 0 and twice.stderr.count("\n") == 1 and "given twice as AFTER" in twice.stderr


def test_each_seed_against_its_own_baseline(tmp_path):
    """--baseline once per seed: the change is the seeds' mean of after[s][i] − before[s][i],
    with the two-level interval over those differences; it differs from the change against one
    shared baseline, and miscounted baselines are refused in one line."""
    from sprout.evaluation.compare import compare_seed_rows, seeds_change
    from sprout.evaluation.statistics import seeds_bootstrap_means, percentile_interval

    bases = [task_file([0, 1, 2, 0, 1, 0], [0, 0, 1, 0, 1, 0]), task_file([2, 2, 0, 1, 1, 0], [1, 1, 0, 0, 1, 0])]
    seeds = [task_file([4, 1, 2, 3, 1, 0], [1, 0, 1, 1, 1, 0]), task_file([2, 3, 2, 1, 1, 1], [1, 1, 1, 0, 1, 0])]
    d = [[(a["correct"] - b["correct"]) / 4 for a, b in zip(s["problems"], base["problems"])]
         for s, base in zip(seeds, bases)]
    ch = seeds_change(bases, seeds, "pass@1")
    assert ch["diff"] == pytest.approx(sum(map(sum, d)) / 12)
    assert ch["ci"] == pytest.approx(list(percentile_interval(seeds_bootstrap_means(d))))
    assert ch["diff"] != pytest.approx(seeds_change(bases[0], seeds, "pass@1")["diff"])
    assert seeds_change(bases[:1], seeds, "pass@1") == {"not_paired": "1 baselines for 2 seeds"}
    longer = [task_file([0, 1, 2, 0, 1, 0], [0] * 6, max_new_tokens=128), task_file([1] * 6, [1] * 6, max_new_tokens=128)]
    assert seeds_change([bases[0], longer[0]], [seeds[0], longer[1]], "pass@1") == \
        {"not_paired": "the seeds do not pair: different max_new_tokens (64 vs 128)"}  # each pairs with its own
    rows = {r["figure"]: r for r in compare_seed_rows(bases, seeds)}
    assert rows["pass@1"]["before_seeds"] == [b["metrics"]["pass@1"] for b in bases]
    assert rows["pass@1"]["before"] == pytest.approx(sum(rows["pass@1"]["before_seeds"]) / 2)
    files = {}
    for name, data in [("b0", bases[0]), ("b1", bases[1]), ("a0", seeds[0]), ("a1", seeds[1])]:
        files[name] = tmp_path / f"{name}.json"
        files[name].write_text(json.dumps(data))
    script = [sys.executable, str(ROOT / "scripts" / "compare_evals.py")]
    out = tmp_path / "rows.json"
    proc = subprocess.run([*script, "--baseline", str(files["b0"]), "--baseline", str(files["b1"]), str(files["a0"]),
                           str(files["a1"]), "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "each seed's own baseline" in proc.stdout
    assert f"{100 * ch['diff']:+.1f} [{100 * ch['ci'][0]:+.1f}, {100 * ch['ci'][1]:+.1f}]" in proc.stdout
    assert json.loads(out.read_text())["before"] == [str(files["b0"]), str(files["b1"])]
    one = subprocess.run([*script, "--baseline", str(files["b0"]), str(files["a0"])], capture_output=True, text=True,
                         timeout=120)  # one seed against its own baseline: the paired change
    assert one.returncode == 0 and change_text_of(change(bases[0], seeds[0], "pass@1")) in one.stdout, one.stderr
    for argv, says in [(["--baseline", str(files["b0"]), str(files["a0"]), str(files["a1"])], "given 1 time(s) for 2"),
                       (["--baseline", str(files["b0"]), "--baseline", str(files["b1"]), str(files["a0"]),
                         str(tmp_path / "." / "a0.json")], "given twice as AFTER"),
                       (["--baseline", str(files["a1"]), "--baseline", str(files["b1"]), str(files["a0"]),
                         str(files["a1"])], "given as a baseline and as an AFTER file")]:
        bad = subprocess.run([*script, *argv], capture_output=True, text=True, timeout=120)
        assert bad.returncode != 0 and bad.stderr.count("\n") == 1 and says in bad.stderr, (argv, bad.stderr)
    plain = subprocess.run([*script, str(files["b0"]), str(files["a0"]), "--json", str(out)], capture_output=True,
                           text=True, timeout=120)
    assert plain.returncode == 0 and json.loads(out.read_text())["before"] == str(files["b0"]), plain.stderr


def change_text_of(ch: dict) -> str:
    return f"{100 * ch['diff']:+.1f} [{100 * ch['ci'][0]:+.1f}, {100 * ch['ci'][1]:+.1f}]"
