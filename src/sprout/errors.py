"""User-facing errors: one line that names the file and what is wrong.

Anything a user can cause (a bad path, a corrupted shard, a mismatched vocab) raises
`SproutError`. Entry-point scripts wrap their `main` in `run_main`, which prints
`error: <message>` on one line and exits with status 2 instead of a traceback; output cut
short by its reader (`| head`) ends quietly with SIGPIPE's status, 141.
"""

from __future__ import annotations

import os
import sys
from typing import Callable


class SproutError(Exception):
    """An error caused by the user's input, reported as a single line."""


def run_main(main: Callable[[], int | None]) -> None:
    """Run a script's `main`, turning `SproutError` into a one-line message and exit 2."""
    try:
        code = main()
    except SproutError as exc:
        msg = " ".join(str(exc).split())  # force one line
        print(f"error: {msg}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except BrokenPipeError:
        if not _stdout_reader_gone():  # another pipe broke: a real error
            raise
        # SIGPIPE's status, as Unix tools; stdout to /dev/null so the last flush cannot fail too
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(128 + 13)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # A launched worker (torchrun / accelerate launch) that finished cleanly: every file is
        # written and closed, so skip interpreter teardown, where torch's distributed C++
        # threads occasionally abort the process ("terminate called without an active
        # exception") and turn a finished run into a failed launch.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(int(code or 0))
    sys.exit(int(code or 0))


def _stdout_reader_gone() -> bool:
    """True when stdout is a pipe whose reader has closed it (poll reports an error on it)."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll here, or stdout is no file
        return False
