"""Check every row of a packed SFT file's loss mask, print totals, show rows highlighted.

    python scripts/check_loss_mask.py runs/demo/sft/sft.h5 --show 3 --html mask.html
    python scripts/check_loss_mask.py runs/demo/sft/sft.h5 --rows 5,17,2328   # or --random 4 --seed 1
    python scripts/check_loss_mask.py prefs/preferences.jsonl --tokenizer SPEC --seq-len 256 [--truncation keep_end]
    python scripts/check_loss_mask.py rl_prompts/prompts.jsonl --tokenizer SPEC [--seq-len 256]

The rules: SFT rows `sprout.formats.maskcheck_sft`; preference pairs `maskcheck_pairs`, as the
pair loader renders them; RL prompts (records with a `gold`) `maskcheck_prompts`, as the policy
sees them; each in the tokenizer's chat format (an SFT file made with another format than its
tokenizer's is refused). Exit status: 0 when every rule holds, 1 on any violation (each printed
with its row or line and position), 2 when the file is missing, corrupted (checksum mismatch),
not of its format, or holds no rows.
"""

from __future__ import annotations

import argparse
import sys

from sprout.atomic import atomic_write
from sprout.chat import template_for
from sprout.errors import SproutError, run_main
from sprout.formats.maskcheck_sft import (check_arrays, format_row, parse_rows, prep_warnings, random_rows, rows_html,
                                      telling_rows)
from sprout.formats.maskcheck_pairs import check_preferences, format_pair, pairs_html
from sprout.formats.preference_tokens import TRUNCATIONS
from sprout.formats.maskcheck_prompts import check_prompts, format_prompt, holds_prompts, prompts_html
from sprout.formats.packed_sft import SFTFile
from sprout.tokenizer import load_tokenizer


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file", help="packed SFT file (.h5), preference file or RL prompt file (.jsonl)")
    parser.add_argument("--show", type=int, default=2, help="rows to print with trained tokens highlighted")
    parser.add_argument("--rows", help="SFT files: show these rows, e.g. 5,17,2328")
    parser.add_argument("--random", type=int, metavar="N", help="SFT files: show N rows drawn at random with --seed")
    parser.add_argument("--seed", type=int, default=0, help="seed of --random (default 0)")
    parser.add_argument("--html", help="also write the shown rows to this HTML page")
    parser.add_argument("--mirror", help="data mirror for tiktoken ranks (default: $SPROUT_MIRROR, else ../shared/data; see sprout.mirror)")
    parser.add_argument("--tokenizer", help="tokenizer spec, if the stored one has moved")
    parser.add_argument("--no-color", action="store_true", help="mark trained tokens as [[...]] instead of ANSI")
    parser.add_argument("--seq-len", type=int, help="preference and prompt files: the context length the loader or policy uses")
    parser.add_argument("--truncation", choices=TRUNCATIONS, default="drop",
                        help="preference files: what the loader does with pairs longer than --seq-len")
    args = parser.parse_args()
    if args.file.endswith(".jsonl") and holds_prompts(args.file):
        return check_prompt_file(args)
    if args.file.endswith(".jsonl"):
        return check_pairs(args)

    with SFTFile(args.file) as f:
        arrays = f.verify()
        attrs = f.attrs
    n_rows = len(arrays["tokens"])
    if n_rows == 0:
        raise SproutError(f"{args.file}: the file holds no rows; an empty SFT file fails the check")
    tok = load_tokenizer(args.tokenizer or attrs["tokenizer_spec"], mirror=args.mirror)
    if tok.fingerprint() != attrs["tokenizer_fingerprint"]:
        raise SproutError(f"{args.file}: written with tokenizer {attrs['tokenizer_spec']} "
                          f"(fingerprint {attrs['tokenizer_fingerprint'][:12]}…), but {tok.spec} has {tok.fingerprint()[:12]}…")
    tpl = template_for(tok)
    if tpl.to_json() != attrs["template"]:
        raise SproutError(f"{args.file}: chat template {attrs['template_version']} differs from this sprout's "
                          f"{tpl.to_json()['version']} for {tok.spec}")
    truncated = attrs["counts"]["split"]["truncated_open"]
    report = check_arrays(arrays, tpl, attrs["pad_id"], attrs["vocab_size"], truncated)
    totals = report.totals()

    color = not args.no_color and sys.stdout.isatty()
    if args.rows:
        shown = parse_rows(args.rows, n_rows, args.file)
    elif args.random:
        shown = random_rows(n_rows, args.random, args.seed)
    else:
        shown = telling_rows(arrays, tpl, args.show)
    for r in shown:
        print(format_row(arrays, r, tpl, tok, color=color))
    warnings = prep_warnings(attrs["counts"])
    if args.html:
        with atomic_write(args.html, "w") as out:
            out.write(rows_html(arrays, shown, tpl, tok, f"loss mask: {args.file}", totals, warnings))
    print(f"{args.file}: {attrs['split']} split, tokenizer {attrs['tokenizer_spec']}, template {attrs['template_version']}")
    print(f"  rows shown: {', '.join(map(str, shown))}")
    print_totals(totals)
    for line in warnings:
        print(line, file=sys.stderr)
    return verdict(args.file, report, "row")


# ---- preference pairs ---------------------------------------------------------------------

def check_pairs(args) -> int:
    """Check every pair of a preference JSONL as `data_loader.preference_batches` would render it."""
    if not args.tokenizer or not args.seq_len:
        raise SproutError(f"{args.file}: a preference file needs --tokenizer SPEC and --seq-len N")
    tok = load_tokenizer(args.tokenizer, mirror=args.mirror)
    tpl = template_for(tok)
    report = check_preferences(args.file, tok, tpl, args.seq_len, args.truncation, show=args.show)
    totals = report.totals()
    color = not args.no_color and sys.stdout.isatty()
    for pair in report.shown:
        print(format_pair(pair, tpl, tok, color=color))
    if args.html:
        with atomic_write(args.html, "w") as out:
            out.write(pairs_html(report.shown, tpl, tok, f"loss mask: {args.file}", totals))
    print(f"{args.file}: preference pairs, tokenizer {tok.spec}, template {tpl.version}, seq_len {args.seq_len}, truncation {args.truncation}")
    print_totals(totals)
    for line, pid, longest in report.dropped[:10]:
        print(f"  dropped: line {line} ({pid}): {longest} tokens > seq_len {args.seq_len}")
    for line, pid, removed in report.truncated[:10]:
        print(f"  truncated: line {line} ({pid}): {removed} prompt messages removed")
    if len(report.dropped) > 10 or len(report.truncated) > 10:
        print("  ... (only the first 10 of each listed)")
    return verdict(args.file, report, "pair")


# ---- RL prompts ----------------------------------------------------------------------------

def check_prompt_file(args) -> int:
    """Render every prompt of an RL prompt file with the generation header and check it."""
    if not args.tokenizer:
        raise SproutError(f"{args.file}: a prompt file needs --tokenizer SPEC")
    tok = load_tokenizer(args.tokenizer, mirror=args.mirror)
    tpl = template_for(tok)
    report = check_prompts(args.file, tok, tpl, args.seq_len, show=args.show)
    totals = report.totals()
    color = not args.no_color and sys.stdout.isatty()
    for item in report.shown:
        print(format_prompt(item, tpl, tok, color=color))
    if args.html:
        with atomic_write(args.html, "w") as out:
            out.write(prompts_html(report.shown, tpl, tok, f"prompts: {args.file}", totals))
    print(f"{args.file}: RL prompts, tokenizer {tok.spec}, template {tpl.version}" + (f", seq_len {args.seq_len}" if args.seq_len else ""))
    print_totals(totals)
    for line, pid, n in report.too_long[:10]:
        print(f"  too long: line {line} ({pid}): {n} tokens leave no room to generate within seq_len {args.seq_len}")
    if len(report.too_long) > 10:
        print("  ... (only the first 10 listed)")
    return verdict(args.file, report, "prompt")


def print_totals(totals: dict) -> None:
    for key, value in totals.items():
        print(f"  {key:28s} {value:.4f}" if isinstance(value, float) else f"  {key:28s} {value:,}")


def verdict(path, report, what: str) -> int:
    """Exit status of a check: 1 with each violation on stderr, else 0 with an OK line."""
    if report.violations:
        for v in report.violations:
            print(f"FAIL {path}: {v}", file=sys.stderr)
        if report.more_violations:
            print(f"FAIL ... and {report.more_violations} more", file=sys.stderr)
        return 1
    print(f"OK: every {what} passes")
    return 0


if __name__ == "__main__":
    run_main(main)
