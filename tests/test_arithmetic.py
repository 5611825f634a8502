"""The arithmetic problem generator: determinism, levels, gold answers, the train/test
split, wrong answers, and its use as an SFT source."""

import random
import re

import pytest

from sprout.answers import is_reasoning_format, parse_answer
from sprout.errors import SproutError
from sprout.prep import arithmetic
from sprout.prep.arithmetic import Problem, broken_format, draw_problem, generate, near_miss, wrong_answer
from sprout.prep.keys import is_val, text_key

_EXPR = re.compile(r"What is ([0-9 +*-]+)\?")


def _value(question: str) -> int:
    """The question's value by Python's own precedence (the test's independent check)."""
    expr = _EXPR.fullmatch(question).group(1)
    return eval(expr, {"__builtins__": {}})  # digits, spaces, + - * only (matched above)


def test_deterministic_for_a_seed():
    a = [p.question for p in generate(200, seed=3)]
    b = [p.question for p in generate(200, seed=3)]
    c = [p.question for p in generate(200, seed=4)]
    assert a == b
    assert a != c
    assert len(set(a)) == len(a) == 200


def test_levels_have_their_shapes():
    by_level = {lvl: list(generate(60, [lvl], seed=0, split="all")) for lvl in arithmetic.LEVELS}
    for p in by_level[1]:
        a, b = map(int, _EXPR.fullmatch(p.question).group(1).split(" + "))
        assert 0 <= a <= 9 and 0 <= b <= 9
    ops = set()
    for p in by_level[2]:
        a, op, b = _EXPR.fullmatch(p.question).group(1).split()
        ops.add(op)
        assert 10 <= int(a) <= 99 and 10 <= int(b) <= 99 and int(p.gold) >= 0
    assert ops == {"+", "-"}
    for p in by_level[3]:
        a, b = map(int, _EXPR.fullmatch(p.question).group(1).split(" * "))
        assert 0 <= a <= 9 and 0 <= b <= 9
    for p in by_level[4]:
        assert len(p.steps) == 2 and len(_EXPR.fullmatch(p.question).group(1).split()) == 5
        assert int(p.gold) >= 0
    assert {p.level for ps in by_level.values() for p in ps} == set(arithmetic.LEVELS)
    mixed = [p.level for p in generate(8, [1, 3], seed=0)]
    assert mixed == [1, 3] * 4  # levels taken in turn


def test_gold_and_worked_answers_are_right():
    for p in generate(400, seed=1, split="all"):
        assert p.gold == str(_value(p.question))
        assert is_reasoning_format(p.worked)
        assert parse_answer(p.worked, strict=True) == p.gold
        a, op, b, r = p.steps[-1]
        assert r == int(p.gold)


def test_hand_computed_worked_answer():
    p = Problem("What is 12 + 5 - 9?", "8", 4, ((12, "+", 5, 17), (17, "-", 9, 8)))
    assert p.worked == "<think>12 + 5 = 17. 17 - 9 = 8.</think><answer>8</answer>"


def test_train_and_test_are_disjoint_by_question_hash():
    train = {p.question for seed in (0, 1) for p in generate(3000, seed=seed, split="train")}
    test = {p.question for seed in (0, 1) for p in generate(300, seed=seed, split="test")}
    assert train and test and not train & test
    assert all(is_val(text_key(q), arithmetic.TEST_FRACTION) for q in test)
    assert not any(is_val(text_key(q), arithmetic.TEST_FRACTION) for q in train)


def test_small_levels_run_out_instead_of_repeating():
    everything = {f"What is {a} + {b}?" for a in range(10) for b in range(10)}
    train_space = {q for q in everything if arithmetic.question_split(q) == "train"}
    got = [p.question for p in generate(1000, [1], seed=0, split="train")]
    assert len(got) == len(set(got)) and set(got) == train_space


def test_near_miss_is_never_gold_and_keeps_the_format():
    rng = random.Random(0)
    for p in generate(300, seed=2, split="all"):
        text = near_miss(p, rng)
        assert is_reasoning_format(text)
        assert 1 <= abs(int(parse_answer(text)) - int(p.gold)) <= 3


def test_broken_format_has_no_parsable_answer():
    rng = random.Random(0)
    seen = set()
    for p in generate(100, seed=2):
        text = broken_format(p, rng)
        seen.add((text.startswith("<think>"), "<answer>" in text))
        assert parse_answer(text) is None and not is_reasoning_format(text)
        assert p.gold in text
    assert len(seen) == 3  # all three broken forms occur


def test_wrong_answer_mix():
    rng = random.Random(0)
    kinds = [wrong_answer(p, rng, 0.25)[1] for p in generate(400, seed=0)]
    assert 0.18 < kinds.count("broken_format") / len(kinds) < 0.32
    assert {k for k in kinds} == {"near_miss", "broken_format"}
    assert {wrong_answer(p, rng, 0.0)[1] for p in generate(50)} == {"near_miss"}


@pytest.mark.parametrize("levels", [[], [5], [1, "2"], 0])
def test_bad_levels_are_one_line(levels):
    with pytest.raises(SproutError, match="levels"):
        list(generate(3, levels))


def test_bad_split_and_count():
    with pytest.raises(SproutError, match="split"):
        list(generate(3, split="val"))
    with pytest.raises(SproutError, match="count"):
        list(generate(-1))
    with pytest.raises(SproutError, match="level 7"):
        draw_problem(7, random.Random(0))


def test_sft_source():
    from sprout.chat import validate
    from sprout.prep.chat_sources import from_dict_source, read_source

    spec = from_dict_source({"name": "arith", "format": "arithmetic", "count": 20, "levels": [1, 4], "seed": 3}, 0)
    examples = list(read_source(spec))
    assert len(examples) == 20 and examples[0].where == "arith[0] (level 1)"
    problems = list(generate(20, [1, 4], seed=3))
    for ex, p in zip(examples, problems):
        validate(ex.messages)
        assert ex.messages == [{"role": "user", "content": p.question}, {"role": "assistant", "content": p.worked}]
    assert len(list(read_source(spec, max_examples=5))) == 5
    with pytest.raises(SproutError, match="source arith: count must be > 0"):
        list(read_source(from_dict_source({"name": "arith", "format": "arithmetic"}, 0)))
    with pytest.raises(SproutError, match="source arith: levels"):
        list(read_source(from_dict_source({"name": "arith", "format": "arithmetic", "count": 2, "levels": [0]}, 0)))
