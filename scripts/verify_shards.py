"""Verify a folder of pretraining tokens (.bin shards and/or HDF5) against its manifest.

    python scripts/verify_shards.py runs/demo/data

Exit 0 when every check in `sprout.formats.audit_tokens` holds; otherwise exit 1 with one line per
failure, each naming the file.
"""

from __future__ import annotations

import argparse
import sys

from sprout.errors import run_main
from sprout.formats.audit_tokens import verify_dir


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", help="folder holding manifest.json and the shards")
    args = parser.parse_args()
    failures, notes = verify_dir(args.dir)
    for line in failures:
        print(f"FAIL {line}", file=sys.stderr)
    if failures:
        print(f"{args.dir}: {len(failures)} check(s) failed", file=sys.stderr)
        return 1
    for line in notes:
        print(line)
    print(f"{args.dir}: all checks passed")
    return 0


if __name__ == "__main__":
    run_main(main)
