"""Answer parsing and number comparison (sprout.answers) and the reward functions of sprout.rl.verifiers."""

import math
import subprocess
import sys
from fractions import Fraction

import pytest

from sprout.errors import SproutError
from sprout.answers import answers_match, format_reasoning, is_reasoning_format, normalise_number, parse_answer, parse_number
from sprout.rl.verifiers import (SoftOverlongPenalty, WeightedReward, combine_rewards, correctness_reward, format_reward,
                                 reward_metrics)


def test_format_reasoning_round_trip():
    text = format_reasoning(" 48/2 = 24\n48+24 = 72 ", " 72 ")
    assert text == "<think>48/2 = 24\n48+24 = 72</think><answer>72</answer>"
    assert parse_answer(text) == "72" and parse_answer(text, strict=True) == "72"
    assert is_reasoning_format(text)


@pytest.mark.parametrize("text, answer", [
    ("blah <answer> 1,080 </answer>", "1,080"),
    ("<answer>1</answer> then <answer>2</answer>", "2"),        # repeated: the last complete block
    ("<answer><answer>5</answer></answer>", "5"),               # nested: the inner (last complete) block
    ("<answer>1</answer> and <answer>7", "1"),                  # an unclosed later block does not count
    ("<answer>5", None),                                        # missing closing tag
    ("5</answer>", None),
    ("<answer></answer>", ""),                                  # empty answer
    ("<answer>  \n </answer>", ""),
    ("no answer, but 42", None),                                # no fallback by default
    ("<ANSWER>3</ANSWER>", None),                               # tags are case-sensitive
])
def test_parse_answer_blocks(text, answer):
    assert parse_answer(text) == answer


def test_last_number_fallback_only_behind_the_flag():
    text = "so 3 apples and then 1,250 more"
    assert parse_answer(text) is None
    assert parse_answer(text, fallback_last_number=True) == "1,250"
    assert parse_answer("x = \u22127.5 finally", fallback_last_number=True) == "\u22127.5"
    assert parse_answer("<answer>9</answer> but 10", fallback_last_number=True) == "9"  # a block wins
    assert parse_answer("nothing numeric", fallback_last_number=True) is None


@pytest.mark.parametrize("text, ok", [
    ("<think>a</think><answer>1</answer>", True),
    ("  <think>a</think>\n<answer>1</answer>\n", True),
    ("<think>a</think> <answer>1</answer> trailing", False),
    ("preamble <think>a</think><answer>1</answer>", False),
    ("<answer>1</answer>", False),
    ("<think>a</think><answer>1</answer><answer>2</answer>", False),
    ("<think>a</think><answer>1</answer>x</answer>", False),    # a stray close tag inside the answer
    ("<think>a<think>b</think><answer>1</answer>", False),       # nested think
    ("<think></think><answer>1</answer>", False),                # empty think
    ("<think>a</think><answer> </answer>", False),               # empty answer
    ("<think>a</think><answer>1", False),                        # missing closing tag
])
def test_reasoning_format(text, ok):
    assert is_reasoning_format(text) is ok
    assert (parse_answer(text, strict=True) is not None) is ok


def test_reasoning_format_of_many_repeated_tags():
    """50,000 repeated `</think><answer>`: refused (too many tags) in one pass over the text, and
    as many near-miss tags inside a valid shape do not stop it from being recognised."""
    repeated = "</think><answer>" * 50_000
    assert not is_reasoning_format(f"<think>a{repeated}1</answer>")
    assert not is_reasoning_format(f"<think>a</think><answer>1{repeated}</answer>")
    assert parse_answer(f"<think>a{repeated}1</answer>", strict=True) is None
    near_misses = "</think ><answer >" * 50_000
    assert is_reasoning_format(f"<think>a{near_misses}</think><answer>1</answer>")
    assert parse_answer(f" <think>a</think> <answer>{near_misses}7</answer>\n", strict=True) == f"{near_misses}7"


@pytest.mark.parametrize("text, value", [
    ("1000", Fraction(1000)), ("1,000", Fraction(1000)), ("12,345,678", Fraction(12345678)),
    ("0.50", Fraction(1, 2)), (".5", Fraction(1, 2)), ("5.", Fraction(5)),
    ("3/4", Fraction(3, 4)), ("6 / 8", Fraction(3, 4)),
    ("\u22125", Fraction(-5)), ("\uff0d5", Fraction(-5)), ("+7", Fraction(7)), (" \t12\n", Fraction(12)),
    ("$5.00", Fraction(5)), ("-$5", Fraction(-5)), ("$-5", Fraction(-5)), ("10%", Fraction(10)),
    ("123456789012345678901234567890123", Fraction(123456789012345678901234567890123)),
    ("1e3", None), ("seven", None), ("5 apples", None), ("1,00", None), ("1,0000", None), ("2/0", None),
    ("--5", None), ("+-5", None), ("", None), (None, None), ("1 2", None), ("\u0665", None),  # Arabic-Indic 5
    ("__import__('os').system('true')", None), ("9" * 1001, None),
])
def test_parse_number(text, value):
    assert parse_number(text) == value


@pytest.mark.parametrize("raw, norm", [
    ("1,080", "1080"), (" 72 ", "72"), ("$5.00", "5"), ("-0.50", "-0.5"), ("3.", "3"), ("10%", "10"),
    ("3/4", "0.75"), ("2/6", "1/3"), ("1/1024", "0.0009765625"), ("\u221212.125", "-12.125"),
    ("1e3", None), ("seven", None), ("", None), (None, None),
])
def test_normalise_number(raw, norm):
    assert normalise_number(raw) == norm


def test_answers_match():
    assert answers_match("1,000", "1000") and answers_match("0.50", ".5") and answers_match("3/4", "0.75")
    assert answers_match("\u22123", "-3") and answers_match("$1,234.00", "1234")
    big = "98765432109876543210987654321"
    assert answers_match(big, big) and not answers_match(str(int(big) + 1), big)  # exact, no float rounding
    assert float(int(big) + 1) == float(big)  # (a float comparison would have said equal)
    assert not answers_match("1000000.5", "1000000")  # integers compare exactly, never with a tolerance
    assert answers_match("0.3333333", "1/3") and not answers_match("0.33", "1/3")  # tolerance for non-integers
    assert not answers_match("", "5") and not answers_match(None, "5") and not answers_match("5", "five")


def test_correctness_reward_abstains_on_a_bad_gold():
    completions = ["<think>t</think><answer>1,000</answer>", "<answer>7</answer>", "it is 7", "<answer>7</answer>"]
    assert correctness_reward(completions, gold=["1000", "8", "7", "n/a"]) == [1.0, 0.0, 0.0, None]
    assert correctness_reward(completions[2:3], gold=["7"], fallback_last_number=True) == [1.0]


def test_format_reward():
    assert format_reward(["<think>a</think><answer>1</answer>", "<answer>1</answer>"]) == [1.0, 0.0]


def test_soft_overlong_penalty_by_hand():
    overlong = SoftOverlongPenalty(max_completion_length=100, cache_length=20)
    lengths = [0, 80, 81, 90, 100, 101, 500]
    assert overlong([""] * 7, completion_lengths=lengths) == [0.0, 0.0, -0.05, -0.5, -1.0, -1.0, -1.0]
    assert overlong(["", ""], completion_ids=[[1] * 90, [1] * 10]) == [-0.5, 0.0]
    with pytest.raises(ValueError):
        SoftOverlongPenalty(100, 0)


def test_combine_rewards_weights_and_abstentions():
    def maybe(completions, **_):
        return [None, 0.5, None]

    rewards = [WeightedReward("correctness", correctness_reward, 1.0),
               WeightedReward("format", format_reward, 0.25),
               WeightedReward("maybe", maybe, 2.0)]
    completions = ["<think>a</think><answer>3</answer>", "<answer>3</answer>", "<answer>4</answer>"]
    out = combine_rewards(rewards, completions, gold=["3", "3", "bad"])
    assert out.per_function == {"correctness": [1.0, 1.0, None], "format": [1.0, 0.0, 0.0], "maybe": [None, 0.5, None]}
    assert out.totals == [1.25, 2.0, 0.0]  # 1 + .25·1;  1 + .25·0 + 2·.5;  .25·0 (the others abstained)
    m = reward_metrics(out.per_function)
    assert m["rewards/correctness/mean"] == 1.0 and m["rewards/correctness/std"] == 0.0
    assert m["rewards/format/mean"] == pytest.approx(1 / 3)
    assert m["rewards/format/std"] == pytest.approx(math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2))  # Bessel
    assert m["rewards/maybe/mean"] == 0.5 and "rewards/maybe/std" not in m  # one value: no std
    everyone_abstains = combine_rewards([WeightedReward("maybe", lambda c, **_: [None])], ["x"])
    assert everyone_abstains.totals == [0.0] and reward_metrics(everyone_abstains.per_function) == {}


def test_combine_rewards_refuses_wrong_lengths_and_duplicate_names():
    with pytest.raises(SproutError, match="returned 1 values"):
        combine_rewards([WeightedReward("short", lambda c, **_: [1.0])], ["a", "b"])
    with pytest.raises(ValueError, match="two reward functions"):
        combine_rewards([WeightedReward("f", format_reward), WeightedReward("f", format_reward)], ["a"])


def test_answers_and_verifiers_do_not_import_torch():
    code = "import sys, sprout.answers, sprout.rl.verifiers; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
