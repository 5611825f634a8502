"""What a trainer's `--data` takes: the folder a prep wrote, or any file of it.

Every trainer finds its train file, and the held-out file beside it, from one path: the folder
the prep wrote (its `--out`; for SFT, the folder holding the `.h5` pair), its `manifest.json`,
the train file, or a held-out file (read as the train file beside it); pretraining also takes
any `.bin` shard or either HDF5 file of a `<dataset>_train.h5` / `<dataset>_val.h5` pair.

A stage evaluates on `X<held_out>.ext` beside the train file `X.ext` (`prompts_dev.jsonl`,
`preferences_dev.jsonl`, `sft_val.h5`) unless `data.val_path` names another; the sealed test
file `X<sealed>.ext` (`prompts_test.jsonl`) is never a train file, and `data.val_path` naming
it is refused, as is a `data.val_path` that is the train file itself. Another prep's folder (or a
file of it) is refused naming the stage it is for (`written_by`: the `format` its `manifest.json`
or its HDF5 files record). Any other path is refused with one line naming it and what to pass
instead. `PrepFiles` describes what one prep writes; `resolve_data` maps a path to (train,
held-out); `token_data_path` is the pretraining form, which keeps a shard folder a folder.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from sprout.errors import SproutError
from sprout.formats import h5tokens, manifest, packed_sft, preference_pairs, prompts
from sprout.formats.manifest import MANIFEST


@dataclass(frozen=True)
class PrepFiles:
    """The files of one prep's folder, as a trainer's `--data` finds them."""

    what: str           # what the files hold, for messages: "preference pairs"
    script: str         # the prep that writes them
    suffix: str         # the train file's: ".jsonl", ".h5"
    held_out: str       # what the held-out file adds to the train file's stem: "_dev", "_val"
    train: str = ""     # the train file's usual name, preferred when a folder holds several
    sealed: str = ""    # what the test file (not read by the stages) adds to the stem: "_test"
    stage: str = ""     # the stages that train on them, for messages: "reward model and DPO"

    def held_out_of(self, train: Path) -> Path:
        """The held-out file beside `train`: `X.ext` -> `X<held_out>.ext`."""
        return train.with_name(f"{train.stem}{self.held_out}{train.suffix}")

    def sealed_of(self, train: Path) -> Path | None:
        """The sealed test file beside `train` (`X<sealed>.ext`), or None for a prep without one."""
        return train.with_name(f"{train.stem}{self.sealed}{train.suffix}") if self.sealed else None

    def is_held_out(self, path: Path) -> bool:
        return any(s and path.stem.endswith(s) for s in (self.held_out, self.sealed))

    def hint(self) -> str:
        return f"pass the folder {self.script} wrote, or its train file"


PREFERENCE_FILES = PrepFiles("preference pairs", "scripts/prepare_preference_data.py", ".jsonl", "_dev",
                             preference_pairs.TRAIN_FILE, "_test", "reward model and DPO")
PROMPT_FILES = PrepFiles("RL prompts", "scripts/prepare_rl_prompts.py", ".jsonl", "_dev", prompts.TRAIN_FILE, "_test",
                         "GRPO and PPO")
SFT_FILES = PrepFiles("packed SFT rows", "scripts/prepare_sft_data.py", ".h5", "_val", "sft.h5", stage="SFT")
PRETRAIN_SCRIPT = "scripts/prepare_pretrain_data.py"
# pretraining's files, for `written_by` and its messages (`token_data_path` finds them)
PRETRAIN_FILES = PrepFiles("tokenised documents", PRETRAIN_SCRIPT, ".bin", "_val", stage="pretraining")
BY_FORMAT = {manifest.FORMAT: PRETRAIN_FILES, h5tokens.FORMAT: PRETRAIN_FILES, packed_sft.FORMAT: SFT_FILES,
             preference_pairs.FORMAT: PREFERENCE_FILES, prompts.FORMAT: PROMPT_FILES}  # recorded format -> prep


def written_by(path: Path) -> PrepFiles | None:
    """The prep that wrote `path`, by the format it records; None when nothing says. A folder:
    the `format` of its `manifest.json`, else the `format` attribute of its `.h5` files (SFT
    writes no manifest); an HDF5 file: its own `format` attribute; a `manifest.json`: its
    `format`; any other file: the `format` of the `manifest.json` beside it when that lists it."""
    if path.is_dir():
        return _manifest_prep(path / MANIFEST) or next(filter(None, map(_h5_prep, sorted(path.glob("*.h5")))), None)
    if path.name == MANIFEST:
        return _manifest_prep(path)
    if path.suffix in (".h5", ".hdf5"):
        return _h5_prep(path)
    return _manifest_prep(path.parent / MANIFEST, listing=path.name)


def _manifest_prep(path: Path, listing: str | None = None) -> PrepFiles | None:
    """The prep of manifest `path` by its `format` (with `listing`: only when its `files` list
    that name); None for no manifest, or one its own reader is left to refuse."""
    try:
        data = json.loads(path.read_text())
        listed = listing is None or any(e.get("path") == listing for e in data.get("files", {}).values())
        return BY_FORMAT.get(data.get("format")) if listed else None
    except (OSError, ValueError, AttributeError, TypeError):
        return None


def _h5_prep(path: Path) -> PrepFiles | None:
    import h5py

    try:
        with h5py.File(path, "r") as f:
            value = f.attrs.get("format")
    except (OSError, ValueError):  # not HDF5: its reader says so
        return None
    return BY_FORMAT.get(value.decode() if isinstance(value, bytes) else value if isinstance(value, str) else None)


def check_prep(path: Path, files: PrepFiles, what: str = "") -> None:
    """Refuse `path` when another prep wrote it (`written_by`), naming the stage it is for; `what`
    prefixes the message (e.g. "data.val_path "). A folder holding this stage's own train file
    (`files.train`) is left to `resolve_data`, whatever else it holds."""
    if not path.exists() or (path.is_dir() and files.train and (path / files.train).is_file()):
        return
    other = written_by(path)
    if other is not None and other is not files:
        raise SproutError(f"{what}{path}: {other.stage} data ({other.what} that {other.script} wrote), not "
                          f"{files.what}; {files.hint()}")


def resolve_data(path: str | os.PathLike, files: PrepFiles, val_path: str | os.PathLike | None = None,
                 ) -> tuple[Path, Path]:
    """(train file, held-out file) of a trainer's `--data` (module doc); the held-out file is
    `val_path` when given. Both must exist; otherwise one line names the path and what to pass."""
    check_prep(Path(path), files)
    train = _train_file(Path(path), files)
    held_out = Path(val_path) if val_path else files.held_out_of(train)
    if val_path and files.sealed and (held_out.name == files.sealed_of(train).name or _is_sealed(held_out, files)):
        raise SproutError(f"data.val_path {held_out}: the sealed test file, which no stage evaluates on; "
                          f"leave data.val_path unset for {files.held_out_of(train).name}")
    if not held_out.is_file():
        how = "data.val_path" if val_path else f"beside {train.name}; {files.script} writes it, or set data.val_path"
        raise SproutError(f"{held_out}: held-out {files.what} file not found ({how})")
    if train.is_file() and os.path.samefile(train, held_out):
        raise SproutError(f"{'data.val_path ' if val_path else ''}{held_out}: the train file {train} itself; "
                          f"held-out figures over what the model trains on measure nothing: name a held-out file")
    if val_path:
        check_prep(held_out, files, "data.val_path ")
    return train, held_out


def _is_sealed(path: Path, files: PrepFiles) -> bool:
    """A prep's test file: `X<sealed>.ext` with its train file `X.ext` beside it."""
    stem = path.stem
    return stem.endswith(files.sealed) and path.with_name(stem[: -len(files.sealed)] + path.suffix).is_file()


def _train_file(path: Path, files: PrepFiles) -> Path:
    if path.name == MANIFEST and path.is_file():
        path = path.parent
    if path.is_dir():
        return _train_file_in(path, files)
    if not path.exists():
        raise SproutError(f"{path}: not found; {files.hint()}")
    if path.suffix != files.suffix:
        raise SproutError(f"{path}: not a file of {files.what} (a {files.suffix} file); {files.hint()}")
    if files.is_held_out(path):  # a held-out file: its train file is beside it
        suffix = files.held_out if path.stem.endswith(files.held_out) else files.sealed
        train = path.with_name(path.stem[: -len(suffix)] + path.suffix)
        if train.is_file():
            return train
    return path


def _train_file_in(folder: Path, files: PrepFiles) -> Path:
    """The one train file of a prep's folder: the usual name, else the one `X.ext` that is not
    a held-out file."""
    if files.train and (folder / files.train).is_file():
        return folder / files.train
    found = sorted(p for p in folder.glob(f"*{files.suffix}") if p.is_file() and not files.is_held_out(p))
    if len(found) == 1:
        return found[0]
    if not found:
        raise SproutError(f"{folder}: a folder without {files.what} (no {files.train or '*' + files.suffix} train "
                          f"file); {files.hint()}")
    raise SproutError(f"{folder}: a folder with several train files ({', '.join(p.name for p in found)}); "
                      f"pass the one to train on")


def token_data_path(path: str | os.PathLike) -> Path:
    """The pretraining input of a `--data` path: the shard folder (given as the folder, its
    manifest.json or any `.bin` shard), or the `<dataset>_train.h5` of an HDF5 pair (given as
    either file, or as a folder holding one pair and no shards)."""
    path = Path(path)
    check_prep(path, PRETRAIN_FILES)
    if path.is_file() and (path.name == MANIFEST or path.suffix == ".bin"):
        path = path.parent
    if path.is_dir():
        if any(path.glob("*.bin")):
            return path
        pairs = sorted(path.glob("*_train.h5")) + sorted(path.glob("*_train.hdf5"))
        if len(pairs) == 1:
            return pairs[0]
        if len(pairs) > 1:
            raise SproutError(f"{path}: a folder with several HDF5 train files ({', '.join(p.name for p in pairs)}); "
                              f"pass the one to train on")
        if (path / MANIFEST).is_file():
            return path  # the shard check names what is missing
        raise SproutError(f"{path}: a folder without pretraining data (no .bin shards, no manifest.json, no "
                          f"*_train.h5); pass the folder {PRETRAIN_SCRIPT} wrote, or a file of it")
    if not path.exists():
        raise SproutError(f"{path}: not found; pass the folder {PRETRAIN_SCRIPT} wrote, or a file of it")
    if path.suffix in (".h5", ".hdf5") and path.stem.endswith("_val"):
        train = path.with_name(path.stem[: -len("_val")] + "_train" + path.suffix)
        if train.is_file():
            return train
    return path
