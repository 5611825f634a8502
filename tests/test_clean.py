import numpy as np

from sprout.prep.clean import CleanConfig, Cleaner, non_ascii_count
from sprout.prep.keys import key_halves, text_key
from sprout.prep.mixture import first_occurrences

MESSY = ("\u201cCan we go to the park?\u201d asked Lily.\u00a0\u00a0Mom smiled \u2014 \u201cYes\u2026 but first, lunch!\u201d"
         "\r\n\r\n\r\nThey ate quickly and ran outside.")
CLEAN = '"Can we go to the park?" asked Lily. Mom smiled - "Yes... but first, lunch!"\n\nThey ate quickly and ran outside.'


def test_seed_example_all_rules():
    c = Cleaner(CleanConfig())
    assert c(MESSY) == CLEAN
    assert dict(c.counts) == {"fixed_quotes": 1, "fixed_dashes": 1, "fixed_ellipsis": 1, "fixed_nbsp": 1,
                              "fixed_cr": 1, "fixed_whitespace": 1}
    assert c("The end.") is None and c.counts["too_short"] == 1
    assert c("Жили-были дед да баба, и была у них курочка Ряба. Снесла курочка яичко, да не простое.") is None
    assert c.counts["non_ascii"] == 1


def test_each_rule_switches_off_alone():
    text = "\u2018a\u2019 \u2013 b\u2026 c\u00a0d\r\n  e   f\n\n\n\ng"
    expected = {
        "quotes": "\u2018a\u2019 - b... c d\ne f\n\ng",
        "dashes": "'a' \u2013 b... c d\ne f\n\ng",
        "ellipsis": "'a' - b\u2026 c d\ne f\n\ng",
        "cr": "'a' - b... c d\ne f\n\ng",          # whitespace still trims the \r at a line end
        "whitespace": "'a' - b... c d\n  e   f\n\n\n\ng",
    }
    for rule, want in expected.items():
        c = Cleaner(CleanConfig(min_chars=0, max_non_ascii=None, **{rule: False}))
        assert c(text) == want, rule
        assert f"fixed_{rule}" not in c.counts
    # nbsp off: Python's split() still treats U+00A0 as whitespace, so only the count differs
    c = Cleaner(CleanConfig(min_chars=0, max_non_ascii=None, nbsp=False))
    c(text)
    assert "fixed_nbsp" not in c.counts and c.counts["fixed_whitespace"] == 1
    c = Cleaner(CleanConfig(min_chars=0, max_non_ascii=None, quotes=False, dashes=False, ellipsis=False,
                            nbsp=False, cr=False, whitespace=False))
    assert c(text) == text and not c.counts


def test_non_ascii_share_threshold():
    base = "a" * 498
    c = Cleaner(CleanConfig())
    assert c(base + "é.") is not None           # 1 of 500 characters: allowed (0.2%)
    assert c(base + "éé") is None               # 2 of 500: dropped
    assert c.counts["non_ascii"] == 1
    assert non_ascii_count("abc\x7f") == 1 and non_ascii_count("café ✓ 😀") == 3
    assert Cleaner(CleanConfig(max_non_ascii=None))(base + "éé") is not None


def test_min_chars_counts_after_cleaning():
    c = Cleaner(CleanConfig(min_chars=10))
    assert c("   short     ") is None and c.counts["too_short"] == 1
    assert c("long enough text") == "long enough text"
    assert Cleaner(CleanConfig(min_chars=0))("") == ""


def test_dedup_keys_and_counts():
    docs = ["Tom had a red ball. He liked to play with it in the park every day with his dog.",
            "TOM HAD A RED BALL. HE LIKED TO PLAY WITH IT IN THE PARK EVERY DAY WITH HIS DOG.",
            "Tom had a blue ball. He liked to play with it in the park every day with his dog.",
            "Tom had a red ball. He liked to play with it in the park every day with his dog."]
    keys = np.stack([np.frombuffer(text_key(d), np.uint8) for d in docs])
    assert text_key(docs[0]) == text_key(docs[1])      # case-insensitive
    assert text_key(docs[0]) != text_key(docs[2])      # a near-duplicate is a different document
    keep = first_occurrences(key_halves(keys)[0], lambda idx: keys[idx])
    assert keep.tolist() == [True, False, True, False]   # the first occurrence survives
    assert int((~keep).sum()) == 2


def test_dedup_is_exact_when_first_halves_collide():
    rng = np.random.default_rng(0)
    keys = rng.integers(0, 256, size=(1000, 16), dtype=np.uint8)
    keys[10:20, :8] = keys[5, :8]     # same first half, different full keys: all distinct
    keys[500] = keys[7]               # true duplicates, in order 7 < 500 < 900
    keys[900] = keys[7]
    keep = first_occurrences(key_halves(keys)[0], lambda idx: keys[idx])
    assert np.flatnonzero(~keep).tolist() == [500, 900]
    assert first_occurrences(np.zeros(0, np.uint64), lambda idx: keys[idx]).tolist() == []


def test_keys_and_split_rule_by_hand():
    """text_key is MD5 of the lower-cased text; the split compares its last 8 bytes with val_frac * 2^64."""
    import hashlib

    from sprout.prep.keys import SplitRule, is_val, key_low, record_text, val_mask_low, val_threshold

    key = text_key("Hello World")
    assert key == hashlib.md5(b"hello world").digest()
    assert key_low(key) == int.from_bytes(hashlib.md5(b"hello world").digest()[8:], "big")
    assert val_threshold(0.25) == 2**62 and val_threshold(0) == 0
    assert is_val(bytes(8) + (2**62 - 1).to_bytes(8, "big"), 0.25)
    assert not is_val(bytes(8) + (2**62).to_bytes(8, "big"), 0.25)
    assert text_key(record_text("ab", "c")) != text_key(record_text("a", "bc"))
    lo = np.array([5, 2**63, 1, 2**62 - 1, 2**62], dtype=np.uint64)
    assert val_mask_low(lo, 0.25).tolist() == [True, False, True, True, False]
    assert SplitRule(val_docs=2).mask(lo).tolist() == [True, False, True, False, False]  # the 2 smallest
    assert SplitRule(val_frac=0.05).describe()["key"].startswith("md5(lower(cleaned text))")
