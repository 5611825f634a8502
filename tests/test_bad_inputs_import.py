"""Bad inputs to an import, each through scripts/import_model.py: one `error:` line (exit 2) naming
the file or field, the --out folder as it was. NaN or infinite weights (naming the tensor and its
shard, or the PEFT adapter whose merge made them), a max_position_embeddings of 10**12 (sprout
would allocate rotary tables of terabytes: refused unless --max-seq-len caps it), a context of 0,
errors about the tokenizer files (they name the source's files, never the import's staging
copies), an `hf:` tokenizer folder whose Jinja chat template sprout would ignore (refused by the
SFT prep), a symbolic link in --out where the run is written, and an import killed by SIGKILL at
three points: the next import into the same folder removes what it left and succeeds, and an
--overwrite killed before its new run is in place leaves the old one."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
from pathlib import Path

import pytest
import torch

from proc import one_error, run_group, run_here, tree

pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[import]')")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "import_model.py"


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A tiny Llama folder (tests/hf_fixtures.py), its weights in two safetensors shards."""
    from hf_fixtures import hf_model, write_tokenizer

    folder = tmp_path_factory.mktemp("source") / "hf"
    hf_model("llama").save_pretrained(folder, max_shard_size="100KB")
    write_tokenizer(folder)
    assert (folder / "model.safetensors.index.json").is_file()
    return folder


def copy(source: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(source, tmp_path / "hf"))


def import_model(*args):
    return run_here([sys.executable, str(SCRIPT), *map(str, args)], cwd=ROOT)


def set_config(folder: Path, **fields) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **fields}))


def refused(tmp_path: Path, *args, needles=(), out: Path | None = None) -> str:
    """Run the import into `out` (default tmp_path/run, which holds a file of the user's): one line
    naming every needle, and every file under tmp_path as it was."""
    out = out or tmp_path / "run"
    out.mkdir(exist_ok=True)
    (out / "notes.txt").write_text("the user's\n")
    before = tree(tmp_path)
    line = one_error(import_model(*args, "--out", out), *needles)
    assert tree(tmp_path) == before
    assert ".tmp-import-" not in line
    return line


# ---- weights -------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused_naming_the_tensor_and_its_shard(value, source, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = copy(source, tmp_path)
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.layers.1.mlp.down_proj.weight"
    shard = folder / index[name]
    tensors = load_file(shard)
    tensors[name][3, 5] = value
    save_file(tensors, shard, metadata={"format": "pt"})
    refused(tmp_path, folder, needles=[str(shard), f"tensor {name}", "1 NaN or infinite value(s)", "[3, 5]"])


def test_an_adapter_that_makes_a_weight_non_finite_is_refused_naming_its_file(source, tmp_path):
    import transformers
    from safetensors.torch import load_file, save_file

    peft = pytest.importorskip("peft", reason="peft (extra sprout[lora]) writes the adapter")
    hf = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    peft.get_peft_model(hf, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"])).save_pretrained(
        tmp_path / "adapter")
    f = tmp_path / "adapter" / "adapter_model.safetensors"
    tensors = load_file(f)
    name = next(k for k in tensors if "layers.1." in k and "lora_B" in k)
    tensors[name][0, 0] = float("inf")
    save_file(tensors, f, metadata={"format": "pt"})
    refused(tmp_path, source, "--adapter", tmp_path / "adapter",
            needles=[str(f.resolve()), "tensor layers.1.self_attn.q_proj.weight", "NaN or infinite"])


# ---- the context ---------------------------------------------------------------------------------
def test_a_huge_max_position_embeddings_is_refused_unless_max_seq_len_caps_it(source, tmp_path):
    folder = copy(source, tmp_path)
    set_config(folder, max_position_embeddings=10**12)
    line = refused(tmp_path, folder, needles=[str(folder / "config.json"), "max_position_embeddings 1,000,000,000,000",
                                              "1,048,576 tokens", "pass --max-seq-len 1048576 or less"])
    assert "GB" in line  # what its rotary tables would take
    refused(tmp_path, folder, "--max-seq-len", 2_000_000, needles=["--max-seq-len 2,000,000 is longer"])
    done = import_model(folder, "--out", tmp_path / "capped", "--max-seq-len", 64)
    assert done.returncode == 0, done.stderr
    assert "context 64" in done.stdout


def test_a_context_of_zero_is_refused(source, tmp_path):
    folder = copy(source, tmp_path)
    refused(tmp_path, folder, "--max-seq-len", 0, needles=["--max-seq-len 0", "between 1 and"])
    refused(tmp_path, folder, "--max-seq-len", -5, needles=["--max-seq-len -5"])
    set_config(folder, max_position_embeddings=0)
    refused(tmp_path, folder, needles=[str(folder / "config.json"), "max_position_embeddings 0 is not a whole number "
                                                                    "of at least 1"])


# ---- errors name the source's files, not the staging copies --------------------------------------
def test_tokenizer_errors_name_the_source_files(source, tmp_path):
    folder = copy(source, tmp_path)
    good = (folder / "tokenizer.json").read_text()
    (folder / "tokenizer.json").write_text(good[: len(good) // 2])
    refused(tmp_path, folder, needles=[str(folder / "tokenizer.json")])
    (folder / "tokenizer.json").write_text(good)

    config = (folder / "tokenizer_config.json").read_text()
    (folder / "tokenizer_config.json").write_text("{not json")
    refused(tmp_path, folder, needles=[str(folder / "tokenizer_config.json")])
    (folder / "tokenizer_config.json").write_text(
        json.dumps({**json.loads(config), "chat_template": "{{ messages[0]['content'] }}"}))
    refused(tmp_path, folder, needles=[str(folder / "tokenizer_config.json"), "matches none of the chat formats"])
    (folder / "tokenizer_config.json").write_text(config)

    set_config(folder, vocab_size=100)
    refused(tmp_path, folder, needles=[str(folder / "tokenizer.json"), "does not fit the model's vocab_size 100"])


# ---- an hf: folder's Jinja chat template ---------------------------------------------------------
def test_an_hf_folder_whose_chat_template_sprout_would_ignore_is_refused(source, tmp_path):
    """A tokenizer folder as transformers 5 saves it (chat_template.jinja; tokenizer_config.json
    without "chat_template") has no chat_format.json: the SFT prep would render sprout's format,
    not the template's; it refuses, naming the template, and writes nothing."""
    from hf_fixtures import CHATML

    folder = tmp_path / "tok"
    folder.mkdir()
    shutil.copy(source / "tokenizer.json", folder)
    config = json.loads((source / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").write_text(CHATML)
    out = tmp_path / "sft" / "sft.h5"
    args = [sys.executable, str(ROOT / "scripts" / "prepare_sft_data.py"), "--source-format", "arithmetic",
            "--source", "40", "--tokenizer", f"hf:{folder}", "--seq-len", "96", "--out", str(out)]
    before = tree(tmp_path)
    one_error(run_here(args, cwd=ROOT), str(folder / "chat_template.jinja"), "chat_format.json",
              "scripts/import_model.py")
    assert tree(tmp_path) == before

    from sprout.chat_detect import folder_chat_format
    from sprout.chat_formats import write_chat_format
    from sprout.tokenizer import load_tokenizer

    fmt = folder_chat_format(folder, f"hf:{folder}")  # what an import detects and writes beside it
    assert fmt.name == "chatml"
    write_chat_format(folder, fmt)
    done = run_here(args, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    import h5py

    with h5py.File(out) as f:
        assert f.attrs["template_version"] == fmt.version
        row = [int(t) for t in f["tokens"][0]]
    assert load_tokenizer(f"hf:{folder}").special_id("<|im_start|>") in row


# ---- a killed import -----------------------------------------------------------------------------
KILLER = r"""
import os, runpy, shutil, signal, sys

point = sys.argv.pop(1)
die = lambda: os.kill(os.getpid(), signal.SIGKILL)
if point == "tokenizer":  # while the source's tokenizer files are copied into the staging folder
    copy = shutil.copyfile
    shutil.copyfile = lambda a, b, **k: die() if str(b).endswith("tokenizer_config.json") else copy(a, b, **k)
elif point == "checkpoint":  # the run written in the staging folder, nothing moved into --out yet
    import sprout.model.hf_import as hf_import
    save = hf_import.save_rotating
    hf_import.save_rotating = lambda *a, **k: (save(*a, **k), die())
elif point == "publish":  # the tokenizer moved into --out, the checkpoints not yet (an old run's moved aside)
    rename = os.rename
    os.rename = lambda a, b: die() if os.path.basename(b) == "checkpoints" and ".tmp-import-" not in str(b) \
        else rename(a, b)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize("point, left", [("tokenizer", set()), ("checkpoint", set()), ("publish", {"tokenizer"})])
def test_a_killed_import_is_cleaned_up_by_the_next_one(point, left, source, tmp_path):
    out, tmp = tmp_path / "run", tmp_path / "tmp"
    tmp.mkdir()
    killed = run_group([sys.executable, "-c", KILLER, point, str(SCRIPT), str(source), "--out", str(out)],
                       timeout=300, env={**os.environ, "TMPDIR": str(tmp)})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    stale = [p.name for p in out.iterdir()]
    assert {n for n in stale if not n.startswith(".tmp-import-")} == left and len(stale) == len(left) + 1, stale
    assert list(tmp.iterdir()) == []  # nothing in the system's temporary folder
    done = import_model(source, "--out", out)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints", "tokenizer"]
    from sprout.model.load import load_model

    model, meta = load_model(out)
    assert meta["stage"] == "import" and ".tmp-import-" not in json.dumps(meta)
    assert torch.isfinite(model(torch.tensor([[1, 2, 3]]))).all()


@pytest.mark.parametrize("point", ["checkpoint", "publish"])
def test_an_overwrite_killed_before_its_run_is_in_place_leaves_the_old_run(point, source, tmp_path):
    """--overwrite replaces the old run only once the new one is built: killed while writing the
    new checkpoint, the old run is still in --out; killed between the renames that move the new
    run in, the next import puts the old run back as it removes what moved in."""
    from sprout.model.import_staging import clean_killed_imports

    out = tmp_path / "run"
    assert import_model(source, "--out", out, "--tokenizer-name", "old").returncode == 0
    before = tree(out)
    killed = run_group([sys.executable, "-c", KILLER, point, str(SCRIPT), str(source), "--out", str(out),
                        "--overwrite"], timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    clean_killed_imports(out)  # what the next import does first
    assert {k: v for k, v in tree(out).items() if k != "run.lock"} == before  # the lock: its dead holder's pid
    done = import_model(source, "--out", out, "--overwrite")
    assert done.returncode == 0, done.stderr
    assert "--overwrite: deleted the previous run's checkpoints, tokenizer" in done.stdout
    assert sorted(p.name for p in (out / "tokenizer").iterdir()) == ["hf"]


@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("name", ["checkpoints", "tokenizer", "run.lock"])
def test_a_link_in_out_where_the_import_writes_is_refused(name, overwrite, source, tmp_path):
    """A run folder holding a symbolic link where the run goes: one line naming it, before the
    source is read, and nothing written in --out nor where the link points."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.txt").write_text("precious\n")
    out = tmp_path / "run"
    out.mkdir()
    (out / name).symlink_to(outside)
    refused(tmp_path, source, *(["--overwrite"] if overwrite else []), needles=[f"{out / name}: is a symbolic link"])


def test_a_live_imports_staging_folder_is_left_alone(tmp_path):
    """Only a staging folder whose lock is free is a killed import's: a live one (this process's,
    its lock held) stays, and goes when its import ends."""
    from sprout.model.import_staging import ImportStaging, clean_killed_imports

    with ImportStaging(tmp_path / "run") as staging:
        assert clean_killed_imports(tmp_path / "run") == [] and staging.path.is_dir()
    assert list((tmp_path / "run").iterdir()) == []
