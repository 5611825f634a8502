"""The local data mirror: a folder holding the files the Hugging Face hub (and tiktoken's
download) would give, so every stage runs without the internet.

`mirror_dir(explicit)` is the one place that decides which folder that is:
1. `explicit` (a `--mirror DIR` flag or a config's `mirror:` field), when given;
2. else `$SPROUT_MIRROR` when set; set to the empty string it means "no mirror" (use the hub)
   and turns the default below off;
3. else `DEFAULT_MIRROR`, `../shared/data` beside the repository, found from this file's
   location, never the current directory; used only when that folder exists (an installed,
   non-editable copy of sprout has none);
4. else None: readers go to the hub (or tiktoken's download).
Config paths name mirror files as `${SPROUT_MIRROR}/...`; `expand_path` fills the variable with
`mirror_dir(...)` and fails naming the path when there is no mirror.
"""

from __future__ import annotations

import os
from pathlib import Path

from sprout.errors import SproutError

ENV = "SPROUT_MIRROR"
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MIRROR = REPO_ROOT.parent / "shared" / "data"


def mirror_dir(explicit: str | os.PathLike | None = None) -> Path | None:
    """The mirror folder by the rule of the module docstring, or None (use the hub)."""
    if explicit is not None and str(explicit) != "":
        return Path(explicit)
    value = os.environ.get(ENV)
    if value is not None:
        return Path(value) if value else None
    return DEFAULT_MIRROR if DEFAULT_MIRROR.is_dir() else None


def expand_path(path: str, mirror: str | os.PathLike | None = None) -> str:
    """Expand `${SPROUT_MIRROR}` (with `mirror_dir(mirror)`), other environment variables and `~`."""
    if ENV in path:
        root = mirror_dir(mirror)
        if root is None:
            raise SproutError(f"{path}: uses ${{{ENV}}} but no mirror is set (--mirror DIR or {ENV})")
        path = path.replace("${" + ENV + "}", str(root)).replace("$" + ENV, str(root))
    return os.path.expanduser(os.path.expandvars(path))
