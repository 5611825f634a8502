"""Check every row of a packed SFT file's loss mask, print totals, show rows highlighted.

    python scripts/check_loss_mask.py runs/demo/sft/sft.h5 --show 3 --html mask.html

Exit status: 0 when every invariant of `sprout.formats.maskcheck` holds, 1 on any violation
(each printed with its row and position), 2 when the file is missing, corrupted
(checksum mismatch) or not an SFT file.
"""

from __future__ import annotations

import argparse
import sys

from sprout.atomic import atomic_write
from sprout.chat import template_for
from sprout.errors import SproutError, run_main
from sprout.formats.maskcheck import check_arrays, format_row, rows_html
from sprout.formats.sft import SFTFile
from sprout.tokenizer import load_tokenizer


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file", help="packed SFT file (.h5)")
    parser.add_argument("--show", type=int, default=2, help="rows to print with trained tokens highlighted")
    parser.add_argument("--html", help="also write the shown rows to this HTML page")
    parser.add_argument("--mirror", help="data mirror for tiktoken ranks (default: $SPROUT_MIRROR, else ../shared/data; see sprout.mirror)")
    parser.add_argument("--tokenizer", help="tokenizer spec, if the stored one has moved")
    parser.add_argument("--no-color", action="store_true", help="mark trained tokens as [[...]] instead of ANSI")
    args = parser.parse_args()

    with SFTFile(args.file) as f:
        arrays = f.verify()
        attrs = f.attrs
    tok = load_tokenizer(args.tokenizer or attrs["tokenizer_spec"], mirror=args.mirror)
    if tok.fingerprint() != attrs["tokenizer_fingerprint"]:
        raise SproutError(f"{args.file}: written with tokenizer {attrs['tokenizer_spec']} "
                          f"(fingerprint {attrs['tokenizer_fingerprint'][:12]}…), but {tok.spec} has {tok.fingerprint()[:12]}…")
    tpl = template_for(tok)
    if tpl.to_json() != attrs["template"]:
        raise SproutError(f"{args.file}: chat template {attrs['template_version']} differs from this sprout's "
                          f"{tpl.to_json()['version']} for {tok.spec}")
    truncated = attrs["counts"].get("split", {}).get("truncated_open")
    report = check_arrays(arrays, tpl, attrs["pad_id"], attrs["vocab_size"], truncated)
    totals = report.totals()

    color = not args.no_color and sys.stdout.isatty()
    shown = list(range(min(args.show, report.rows)))
    for r in shown:
        print(format_row(arrays, r, tpl, tok, color=color))
    if args.html:
        with atomic_write(args.html, "w") as out:
            out.write(rows_html(arrays, shown, tpl, tok, f"loss mask: {args.file}", totals))
    print(f"{args.file}: {attrs['split']} split, tokenizer {attrs['tokenizer_spec']}, template {attrs['template_version']}")
    for key, value in totals.items():
        print(f"  {key:28s} {value:.4f}" if isinstance(value, float) else f"  {key:28s} {value:,}")
    if report.violations:
        for v in report.violations:
            print(f"FAIL {args.file}: {v}", file=sys.stderr)
        if report.more_violations:
            print(f"FAIL ... and {report.more_violations} more", file=sys.stderr)
        return 1
    print("OK: every row passes")
    return 0


if __name__ == "__main__":
    run_main(main)
