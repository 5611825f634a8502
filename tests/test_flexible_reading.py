"""The two readings of an answer: strict (the last complete <answer> block) and flexible (that
block, else the text's last number, as lm-evaluation-harness's GSM8K flexible-extract), and
evaluate_prompts reporting both."""

import re

import pytest

import sprout.evaluation.evaluate as evaluation
import test_evaluate
from sprout.answers import answers_match, parse_answer, parse_number
from sprout.evaluation.evaluate import evaluate_prompts, problem_scores
from sprout.evaluation.statistics import wilson_interval
from sprout.rl.verifiers import correctness_reward
from test_evaluate import PROMPTS, StubPolicy, fake_generate


def flexible(text: str) -> str | None:
    return parse_answer(text, fallback_last_number=True)


@pytest.mark.parametrize("text, answer, value", [
    ("The answer is 1,234.", "1,234", "1234"),  # thousands separators kept, the trailing period not
    ("It dropped to -7 degrees, so -7", "-7", "-7"),
    ("Each costs $3.50.", "$3.50", "3.5"),
    ("half of 5 is 2.5", "2.5", "2.5"),
    ("x = -$1,000.25 in all", "-$1,000.25", "-1000.25"),
    ("We get 12, then 18 and finally 42.", "42", "42"),
    ("two, 3", "3", "3"),
    ("<answer>42", "42", "42"),  # an unclosed block is no block: its number is the last one
])
def test_the_flexible_reading_takes_the_last_number(text, answer, value):
    assert parse_answer(text) is None  # no complete block: the strict reading finds nothing
    assert flexible(text) == answer and answers_match(flexible(text), value)


@pytest.mark.parametrize("text, token", [
    ("so 1,2345", "1,2345"),  # the harness's whole token, never its tail 5
    ("so 12345,678", "12345,678"),  # never 678
    ("so 2,3", "2,3"),
    ("version 1.2.3", "1.2.3"),
])
def test_digits_joined_by_commas_or_periods_are_one_token_and_an_odd_one_is_no_number(text, token):
    assert flexible(text) == token and parse_number(token) is None
    assert correctness_reward([text], ["12345"], fallback_last_number=True) == [0.0]
    assert correctness_reward([text], [re.split("[.,]", token)[-1]], fallback_last_number=True) == [0.0]  # its tail
    assert flexible("1, 2, 3,") == "3" and flexible("12,345,678 in all") == "12,345,678"


def test_no_number_and_the_tag_wins():
    assert flexible("I do not know.") is None and flexible("") is None
    text = "<think>5 + 5</think><answer>11</answer> Actually it is 10."
    assert parse_answer(text) == flexible(text) == "11"  # a block wins over a number in prose
    assert correctness_reward([text], ["10"], fallback_last_number=True) == [0.0]
    assert flexible("<answer>ten</answer> so 10") == "ten"  # even a block holding no number
    prose = "The answer is 1,234."
    assert correctness_reward([prose], ["1234"]) == [0.0]
    assert correctness_reward([prose], ["1234"], fallback_last_number=True) == [1.0]


# a policy that answers in prose, never in the tags (PROMPTS' golds: 4, 10, 7)
PROSE_SAMPLED = [
    [("2 + 2 makes 4.", True), ("The answer is 4", True), ("I think 5", True), ("no idea", True)],  # 2 of 4
    [("5 + 5 = 10.", True), ("<answer>11</answer> or 10", True), ("It is 9", True), ("10", True)],  # 2 of 4
    [("3 + 4 = 7", True), ("so 8", True), ("7.", True), ("3 + 4 = 7.0", True)],  # 3 of 4
]
PROSE_GREEDY = [("The answer is 4.", True), ("It is 9", True), ("7", True)]  # 2 of 3


def test_a_policy_answering_in_prose_scores_only_under_the_flexible_reading(sp, monkeypatch):
    monkeypatch.setattr(test_evaluate, "SAMPLED", PROSE_SAMPLED)
    monkeypatch.setattr(test_evaluate, "GREEDY", PROSE_GREEDY)
    monkeypatch.setattr(evaluation, "generate_tokens", fake_generate(sp, []))
    ev = evaluate_prompts(StubPolicy(), sp, PROMPTS, n=4, ks=(1, 4), greedy=True, max_new_tokens=16,
                          num_samples=1)
    m = ev.metrics
    assert m["pass@1"] == m["pass@4"] == m["greedy/accuracy"] == m["format/rate"] == 0.0
    assert m["flexible/pass@1"] == pytest.approx((2 / 4 + 2 / 4 + 3 / 4) / 3)
    assert m["flexible/pass@4"] == 1.0 and m["flexible/greedy/accuracy"] == pytest.approx(2 / 3)
    assert "flexible/format/rate" not in m and "flexible/greedy/format_rate" not in m  # the format is one figure
    assert ev.by_level["1"]["flexible/pass@1"] == pytest.approx(0.5) and ev.by_level["1"]["pass@1"] == 0.0
    assert ev.by_level["2"]["flexible/greedy/accuracy"] == 1.0
    assert ev.flat()["level_2/flexible/pass@1"] == 0.75

    problems = ev.problems()
    assert [(p["correct"], p["flexible_correct"], p["greedy_correct"], p["flexible_greedy_correct"])
            for p in problems] == [(0, 2, 0, 1), (0, 2, 0, 0), (0, 3, 0, 1)]
    for figure in ("flexible/pass@1", "flexible/pass@4", "flexible/greedy/accuracy"):
        assert sum(problem_scores(problems, figure)) / 3 == pytest.approx(m[figure])
    assert problem_scores(problems, "flexible/format/rate") is None
    total, by_level = ev.intervals()
    assert total["flexible/greedy/accuracy_ci"] == list(wilson_interval(2, 3))
    assert total["greedy/accuracy_ci"] == list(wilson_interval(0, 3))
    assert by_level["1"]["flexible/greedy/accuracy_ci"] == list(wilson_interval(1, 2))
    lo, hi = total["flexible/pass@1_ci"]
    assert 0.0 < lo <= m["flexible/pass@1"] <= hi <= 1.0

    shown = ev.samples[0]
    assert (shown["answer"], shown["correct"], shown["flexible_answer"], shown["flexible_correct_of_n"]) == \
        (None, False, "4", "2/4")
    assert (shown["greedy_answer"], shown["flexible_greedy_answer"], shown["flexible_greedy_correct"]) == \
        (None, "4", True)
