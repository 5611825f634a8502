"""A tokenizer file replaced after data prep, or in a run folder after training, met through the
scripts: pretraining and SFT refuse data whose tokenizer file is not the one its prep recorded,
and evaluate, chat and sample refuse a checkpoint whose tokenizer changed, each in one line
naming the tokenizer file and the data or checkpoint, nothing written.

One case per tokenizer kind: `sentencepiece:` (another model copied over the .model), `hf:`
(a tokenizer.json with two merges swapped; also a changed tokenizer_config.json beside it) and
`tiktoken:` (two ranks swapped in the mirror's `tokenizers/gpt2.tiktoken`, a copy of the
mirror's own in a mirror of the test's: that ranks file is tiktoken's tokenizer file). A resume
after the file was replaced is refused too. Data written before preps recorded an hf:
tokenizer's side files is still read, its tokenizer file checked alone; a checkpoint's own copy
is checked file by file (one added beside it too), also as SFT's base; a run trained on a raw
hf: folder with a chat template keeps the chat format it was trained with; and
`--data-verify sizes` names once the checks it skips, in every trainer.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import h5py
import pytest
import torch
from data_fixtures import make_docs, train_tiny_sp
from preference_train_fixtures import base, cli_flags, write_lm, write_pairs  # noqa: F401 (base: a fixture)
from proc import one_error, run_here
from test_bad_inputs_rl import TINY as RL_TINY
from test_bad_inputs_rl import prepared  # noqa: F401 (a fixture)

from sprout.atomic import sha256_file
from sprout.checkpoint import bundle_tokenizer, checkpoint_tokenizer, read_meta, save_checkpoint
from sprout.chat_formats import CHATML, SPROUT, format_for, write_chat_format
from sprout.errors import SproutError
from sprout.model.transformer import ModelConfig, Transformer
from sprout.prep.pretrain import PrepConfig, prepare
from sprout.prep.sft_data import SFTDataConfig
from sprout.prep.sft_data import prepare as prepare_sft
from sprout.prep.tokenizer_train import train_sentencepiece
from sprout.formats.manifest import read_manifest, tokenizer_record
from sprout.tokenizer import R50K_MIRROR_FILE, load_tokenizer
from sprout.tokenizer_files import Record, load_recorded, side_files_sha256

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("sentencepiece", "hf", "tiktoken")
SEQ = 32


def tree(folder: Path) -> dict:
    """Every path under `folder` with the sha256 of its bytes (None for folders)."""
    return {str(p.relative_to(folder)): sha256_file(p) if p.is_file() else None for p in sorted(folder.rglob("*"))}


def run(script: str, *args, mirror: Path):
    """scripts/<script> with `args` in the test's process, the tokenizer mirror `mirror`."""
    env = {**os.environ, "SPROUT_MIRROR": str(mirror)}
    return run_here([sys.executable, str(ROOT / "scripts" / script), *map(str, args)], cwd=ROOT, env=env)


# ---- one tokenizer of each kind, with the edit that replaces its file ----------------------------

def swap_merges(folder: Path) -> None:
    """An hf: tokenizer.json whose first two merges trade places: still valid, other ids."""
    data = json.loads((folder / "tokenizer.json").read_text())
    merges = data["model"]["merges"]
    merges[0], merges[1] = merges[1], merges[0]
    (folder / "tokenizer.json").write_text(json.dumps(data))


def swap_ranks(ranks: Path) -> None:
    """tiktoken ranks whose first two tokens trade ranks: still valid, other ids."""
    lines = ranks.read_bytes().splitlines(keepends=True)
    (a, ra), (b, rb) = (lines[i].split() for i in (0, 1))
    lines[0], lines[1] = b"%s %s\n" % (a, rb), b"%s %s\n" % (b, ra)
    ranks.write_bytes(b"".join(lines))


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """The files of a SentencePiece model, another one, and an hf: folder (ChatML, with its
    chat_format.json), built once; each test copies what it uses."""
    from hf_fixtures import write_tokenizer

    root = tmp_path_factory.mktemp("tokenizers")
    train_tiny_sp(root / "sentencepiece")
    train_sentencepiece(iter(make_docs(1500, seed=7, prefix="Other ")), root / "other" / "tiny", 400)
    write_chat_format(write_tokenizer(root / "hf"), CHATML)
    return root


@pytest.fixture()
def setup(request, tokenizers, tmp_path, monkeypatch):
    """(tokenizer, its file, replace(), the mirror the scripts get) of the kind `request.param`,
    its files in tmp_path; this process reads the same mirror."""
    kind, mirror = request.param, tmp_path / "mirror"
    if kind == "tiktoken":
        ranks = mirror / R50K_MIRROR_FILE
        ranks.parent.mkdir(parents=True)
        shutil.copy(request.getfixturevalue("mirror") / R50K_MIRROR_FILE, ranks)
        monkeypatch.setenv("SPROUT_MIRROR", str(mirror))
        return load_tokenizer("tiktoken:r50k_base"), ranks, lambda: swap_ranks(ranks), mirror
    mirror.mkdir()
    monkeypatch.setenv("SPROUT_MIRROR", str(mirror))
    if kind == "hf":
        folder = shutil.copytree(tokenizers / "hf", tmp_path / "hf")
        return load_tokenizer(f"hf:{folder}"), folder / "tokenizer.json", lambda: swap_merges(folder), mirror
    path = tmp_path / "sp" / "tiny.model"
    shutil.copytree(tokenizers / "sentencepiece", path.parent)
    return (load_tokenizer(f"sentencepiece:{path}"), path,
            lambda: shutil.copy(tokenizers / "other" / "tiny.model", path), mirror)


def sp_tokenizer(tokenizers: Path, tmp_path: Path):
    path = tmp_path / "sp" / "tiny.model"
    shutil.copytree(tokenizers / "sentencepiece", path.parent)
    return load_tokenizer(f"sentencepiece:{path}")


def prep_pretrain(tok, out: Path) -> Path:
    src = out.parent / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in make_docs(120)))
    cfg = PrepConfig(name="t", sources=[str(src)], tokenizer=tok.spec, out=str(out), workers=1, val_frac=0.1,
                     shard_tokens=8000)
    prepare(cfg, tokenizer=tok, progress=False, log=lambda s: None)
    return out


def prep_sft(tok, out: Path, short: bool = False) -> Path:
    """An SFT prep's sft.h5 (and sft_val.h5) in `out`; `short`: two-word turns, for a format whose
    headers are plain text."""
    rows = [{"messages": [{"role": "user", "content": f"Hi {i}" if short else f"Question {i}: tell me a story."},
                          {"role": "assistant", "content": "ok" if short else d}]}
            for i, d in enumerate(make_docs(60, min_words=3, max_words=8))]
    src = out.parent / "chat.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = SFTDataConfig(tokenizer=tok.spec, out=str(out / "sft.h5"), seq_len=SEQ, val_fraction=0.2,
                        sources=[{"name": "chat", "format": "chat", "path": str(src)}])
    prepare_sft(cfg, tok, log=lambda *a: None)
    return out / "sft.h5"


def base_checkpoint(tok, folder: Path, **extra) -> Path:
    """A tiny LM checkpoint of `tok` in the run folder `folder`, its tokenizer bundled as a trainer
    does; `extra`: more meta fields."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=-(-tok.vocab_size // 64) * 64, d_model=16, n_layers=1, n_heads=2,
                                    max_seq_len=SEQ))
    meta = {"model_config": model.config, "tokenizer": tok.spec, "tokenizer_fingerprint": tok.fingerprint(),
            "stage": "pretrain", "step": 1, **bundle_tokenizer(tok.spec, folder, write=False), **extra}
    ckpt = save_checkpoint(folder / "checkpoints" / "step_00000001", model, meta=meta)
    bundle_tokenizer(tok.spec, folder)
    return ckpt


TINY = ["--model.d_model", "16", "--model.n_layers", "1", "--model.n_heads", "2", "--model.max_seq_len", str(SEQ),
        "--data.seq_len_start", str(SEQ), "--data.eval_tokens", "256", "--batch.global_tokens", "256",
        "--batch.micro_tokens", "256", "--train.max_steps", "2", "--train.eval_every", "0",
        "--train.ckpt_every", "0", "--train.progress", "false", "--train.peak_tflops", "-1"]
SFT = ["--batch.global_tokens", "64", "--batch.micro_tokens", "64", "--train.max_steps", "1",
       "--train.progress", "false", "--train.peak_tflops", "-1"]


def kind_of(tok) -> str:
    return tok.spec.partition(":")[0]


def replaced_needles(kind: str, path: Path, where: Path) -> tuple:
    if kind == "tiktoken":  # the loader pins the ranks' sha256: the file cannot even be loaded
        return (str(where), str(path), "is not r50k_base's", "cannot be loaded")
    return (f"{path}: sha256 does not match", f"in {where}; not the tokenizer this data was prepared with",
            "replaced", "prepare the data again")


# ---- data ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("setup", KINDS, indirect=True)
def test_pretraining_refuses_a_tokenizer_file_replaced_after_prep(setup, tmp_path):
    tok, path, replace, mirror = setup
    data = prep_pretrain(tok, tmp_path / "data")
    written = json.loads((data / "manifest.json").read_text())["tokenizer"]
    assert written["fingerprint"] == tok.fingerprint() and "sha256" not in written  # the fingerprint is the file's
    assert written.get("side_sha256") == side_files_sha256(tok)  # an hf: tokenizer's side files, nothing else
    record = tokenizer_record(read_manifest(data), data / "manifest.json")
    assert load_recorded(tok.spec, record).fingerprint() == tok.fingerprint()
    replace()
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    before = tree(tmp_path)
    one_error(run("pretrain.py", "--data", data, "--out", out, *TINY, mirror=mirror),
              *replaced_needles(kind_of(tok), path, data / "manifest.json"))
    assert tree(tmp_path) == before


@pytest.mark.parametrize("setup", KINDS, indirect=True)
def test_sft_refuses_a_tokenizer_file_replaced_after_prep(setup, tmp_path):
    tok, path, replace, mirror = setup
    base = base_checkpoint(tok, tmp_path / "base")
    data = prep_sft(tok, tmp_path / "sft")
    replace()
    before = tree(tmp_path)
    one_error(run("train_sft.py", "--data", data, "--init", base, "--out", tmp_path / "run", *SFT, mirror=mirror),
              *replaced_needles(kind_of(tok), path, data))
    assert tree(tmp_path) == before


@pytest.mark.parametrize("setup", ["hf"], indirect=True)
def test_a_changed_side_file_of_an_hf_tokenizer_is_refused(setup, tmp_path):
    tok, path, _, mirror = setup
    data = prep_pretrain(tok, tmp_path / "data")
    config = path.parent / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "pad_token": "<|endoftext|>"}))
    before = tree(tmp_path)
    one_error(run("pretrain.py", "--data", data, "--out", tmp_path / "run", *TINY, mirror=mirror),
              f"{config}: sha256 does not match tokenizer.side_sha256 in {data / 'manifest.json'}")
    (path.parent / "chat_format.json").unlink()
    one_error(run("pretrain.py", "--data", data, "--out", tmp_path / "run", *TINY, mirror=mirror),
              f"{path.parent / 'chat_format.json'}: missing, but tokenizer.side_sha256 in")
    assert tree(tmp_path) == {k: v for k, v in before.items() if not k.endswith("chat_format.json")}


# ---- a resume after the file was replaced ---------------------------------------------------------

@pytest.mark.parametrize("setup", ["sentencepiece", "hf"], indirect=True)
def test_a_resume_after_the_tokenizer_file_was_replaced_is_refused(setup, tmp_path):
    """A run trained, its data's tokenizer file replaced, then `--resume latest`: pretraining and
    SFT refuse it, their run folders as they were."""
    tok, path, replace, mirror = setup
    data, sft = prep_pretrain(tok, tmp_path / "data"), prep_sft(tok, tmp_path / "sft")
    base = base_checkpoint(tok, tmp_path / "base")
    runs = {"pretrain.py": ["--data", data, *TINY],
            "train_sft.py": ["--data", sft, "--init", base, *SFT]}
    for script, args in runs.items():
        proc = run(script, *args, "--out", tmp_path / script, mirror=mirror)
        assert proc.returncode == 0, proc.stderr
    replace()
    before = tree(tmp_path)
    for script, args in runs.items():
        one_error(run(script, *args, "--out", tmp_path / script, "--resume", "latest", "--train.max_steps", "3",
                      mirror=mirror),
                  *replaced_needles(kind_of(tok), path, data / "manifest.json" if script == "pretrain.py" else sft))
    assert tree(tmp_path) == before


# ---- checkpoints -----------------------------------------------------------------------------------

COMMANDS = {"sample.py": ["--prompt", "Once"], "chat.py": ["--prompt", "Hello"],
            "evaluate.py": ["--task", "arith", "--n", "0", "--greedy"], "export_hf.py": ["{out}"]}


def command(script: str, ckpt: Path, out: Path) -> list:
    return [ckpt, *(str(a).format(out=out) for a in COMMANDS[script])]


@pytest.mark.parametrize("setup", KINDS, indirect=True)
def test_evaluate_chat_sample_and_export_refuse_a_checkpoint_whose_tokenizer_changed(setup, tmp_path):
    tok, path, replace, mirror = setup
    ckpt = base_checkpoint(tok, tmp_path / "base")
    meta = ckpt / "meta.json"
    if kind_of(tok) == "tiktoken":  # no copy in the run: the mirror's ranks file is the tokenizer's
        replace()
        needles = (str(meta), str(path), "cannot be loaded", "is not r50k_base's")
    else:  # the run's own copy, the file the checkpoint's meta records by sha256
        copy = tmp_path / "base" / json.loads(meta.read_text())["tokenizer_file"]
        copy.write_bytes(copy.read_bytes() + b" ")
        needles = (f"{copy}: sha256 does not match tokenizer_sha256 in {meta}; not the tokenizer this model was "
                   f"trained with",)
    before = tree(tmp_path)
    for script in COMMANDS:
        one_error(run(script, *command(script, ckpt, tmp_path / "export"), mirror=mirror), *needles)
    assert tree(tmp_path) == before


@pytest.mark.parametrize("setup", ["hf"], indirect=True)
def test_a_file_added_beside_a_checkpoints_tokenizer_copy_is_refused(setup, tmp_path):
    """The meta records every side file of an hf: copy, so one that appears there is refused too."""
    tok, _, _, mirror = setup
    ckpt = base_checkpoint(tok, tmp_path / "base")
    copy = (tmp_path / "base" / json.loads((ckpt / "meta.json").read_text())["tokenizer_file"]).parent
    (copy / "chat_template.jinja").write_text("{{ messages }}")
    before = tree(tmp_path)
    for script in ("chat.py", "export_hf.py"):
        one_error(run(script, *command(script, ckpt, tmp_path / "export"), mirror=mirror),
                  f"{copy / 'chat_template.jinja'}: new beside tokenizer.json, not in tokenizer_side_sha256 in "
                  f"{ckpt / 'meta.json'}")
    assert tree(tmp_path) == before


def test_a_run_trained_on_a_raw_hf_folder_keeps_its_chat_format(tmp_path, monkeypatch):
    """An hf: folder with a chat template and no chat_format.json, as runs were trained on before
    such a folder was refused: a prep still refuses it, but a checkpoint of it renders the format
    its meta records (`template_version`), one that records none says what to pass instead, and
    SFT on it renders the format of its SFT data."""
    from hf_fixtures import write_tokenizer

    monkeypatch.setenv("SPROUT_MIRROR", str(tmp_path))
    raw = write_tokenizer(tmp_path / "raw")
    tok = load_tokenizer(f"hf:{raw}")
    sft = base_checkpoint(tok, tmp_path / "sft_run", stage="sft", template_version=SPROUT.version)
    assert format_for(checkpoint_tokenizer(read_meta(sft))) is SPROUT
    proc = run("chat.py", sft, "--prompt", "Hello", "--max-new-tokens", "2", mirror=tmp_path)
    assert proc.returncode == 0, proc.stderr
    with pytest.raises(SproutError, match=f"{raw / 'tokenizer_config.json'}: a chat template without the "
                                          f"chat_format.json"):
        prep_sft(tok, tmp_path / "prep")
    pretrained = base_checkpoint(tok, tmp_path / "pretrain_run")
    meta = pretrained / "meta.json"
    before = tree(tmp_path)
    one_error(run("chat.py", pretrained, "--prompt", "Hello", mirror=tmp_path),
              f"in the tokenizer copy of the checkpoint {meta}, which records no chat template version",
              "pass --tokenizer hf:FOLDER")
    assert tree(tmp_path) == before
    chosen = shutil.copytree(raw, tmp_path / "chosen")
    write_chat_format(chosen, CHATML)
    proc = run("chat.py", pretrained, "--prompt", "Hello", "--max-new-tokens", "2", "--tokenizer", f"hf:{chosen}",
               mirror=tmp_path)
    assert proc.returncode == 0, proc.stderr
    plain = shutil.copytree(raw, tmp_path / "plain")  # the same tokenizer, its template removed: sprout's format
    config = json.loads((plain / "tokenizer_config.json").read_text())
    (plain / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "chat_template"}))
    data = prep_sft(load_tokenizer(f"hf:{plain}"), tmp_path / "plain_sft", short=True)
    proc = run("train_sft.py", "--data", data, "--init", pretrained, "--out", tmp_path / "sft_on_it", *SFT,
               mirror=tmp_path)
    assert proc.returncode == 0, proc.stderr


# ---- earlier versions' data, and the record's own rules --------------------------------------------

@pytest.mark.parametrize("setup", ["hf"], indirect=True)
def test_data_of_an_earlier_version_is_read_and_its_tokenizer_file_still_checked(setup, tmp_path):
    """Data written before preps recorded an hf: tokenizer's side files (and so without
    `side_sha256`) trains, with a note that only the tokenizer file is checked; that file replaced
    is still refused."""
    tok, path, replace, mirror = setup
    data = prep_pretrain(tok, tmp_path / "data")
    manifest = json.loads((data / "manifest.json").read_text())
    del manifest["tokenizer"]["side_sha256"]
    (data / "manifest.json").write_text(json.dumps(manifest))
    sft = prep_sft(tok, tmp_path / "sft")
    for f in (sft, sft.with_name("sft_val.h5")):
        with h5py.File(f, "r+") as h5:
            del h5.attrs["tokenizer_side_sha256"]
    base = base_checkpoint(tok, tmp_path / "base")
    runs = {"pretrain.py": (["--data", data, *TINY], data / "manifest.json", "tokenizer.side_sha256"),
            "train_sft.py": (["--data", sft, "--init", base, *SFT], sft, "tokenizer_side_sha256")}
    for script, (args, where, field) in runs.items():
        proc = run(script, *args, "--out", tmp_path / script, mirror=mirror)
        assert proc.returncode == 0, proc.stderr
        said = proc.stdout + proc.stderr
        assert said.count(f"note: {where} records no {field} (written by an earlier version of sprout): only "
                          f"{path} is checked") == 1, said
    replace()
    before = tree(tmp_path)
    for script, (args, where, _) in runs.items():
        one_error(run(script, *args, "--out", tmp_path / f"{script}.again", mirror=mirror),
                  *replaced_needles("hf", path, where))
    assert tree(tmp_path) == before


def test_the_run_folders_copy_stands_in_for_a_file_not_here(tokenizers, tmp_path):
    """A resume from another directory: the spec's relative path no longer resolves, and the run's
    own copy is checked against the record instead; a copy that differs is refused."""
    tok = sp_tokenizer(tokenizers, tmp_path)
    record = Record(tok.fingerprint(), None, "data", ("fingerprint", "side_sha256"))
    copy = tmp_path / "run" / "tokenizer" / "tiny.model"
    copy.parent.mkdir(parents=True)
    shutil.copy(tok.path, copy)
    assert load_recorded("sentencepiece:gone/tiny.model", record, stand_in=copy).fingerprint() == tok.fingerprint()
    with pytest.raises(SproutError, match=r"data: the tokenizer this data was prepared with, sentencepiece:gone/"):
        load_recorded("sentencepiece:gone/tiny.model", record, stand_in=tmp_path / "none.model")
    shutil.copy(tokenizers / "other" / "tiny.model", copy)
    with pytest.raises(SproutError, match=f"{copy}: sha256 does not match fingerprint in data; not the tokenizer"):
        load_recorded("sentencepiece:gone/tiny.model", record, stand_in=copy)


# ---- --data-verify sizes ---------------------------------------------------------------------------

def test_data_verify_sizes_names_once_the_checks_it_skips(tokenizers, tmp_path):
    tok = sp_tokenizer(tokenizers, tmp_path)
    data = prep_pretrain(tok, tmp_path / "data")
    proc = run("pretrain.py", "--data", data, "--out", tmp_path / "run", *TINY, "--model.vocab_size", "448",
               "--data-verify", "sizes", mirror=tmp_path)
    assert proc.returncode == 0, proc.stderr
    said = proc.stdout + proc.stderr
    assert said.count("not checked: token ids against the vocabulary") == 1, said
    sft = prep_sft(tok, tmp_path / "sft")
    proc = run("train_sft.py", "--data", sft, "--init", base_checkpoint(tok, tmp_path / "base"),
               "--out", tmp_path / "sft_run", *SFT, "--data-verify", "sizes", mirror=tmp_path)
    assert proc.returncode == 0, proc.stderr
    said = proc.stdout + proc.stderr
    assert said.count("not checked: the rows' layout") == 1, said
    proc = run("pretrain.py", "--data", data, "--out", tmp_path / "full", *TINY, mirror=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "not checked" not in proc.stdout + proc.stderr


def test_data_verify_sizes_names_once_what_grpo_and_dpo_skip(prepared, base, tmp_path):
    """Through train_grpo.py (prompts and golds, a prep's folder) and train_dpo.py (pairs)."""
    from sprout.formats.verify_inputs import SKIPPED

    pairs = write_pairs(tmp_path / "prefs", n_train=16, n_test=8)
    flags = [f"--{section}.{k}={v}" for section, fields in RL_TINY.items() for k, v in fields.items()]
    runs = {"train_grpo.py": (["--data", prepared / "prompts.jsonl", "--init", base, "--out", tmp_path / "grpo",
                               *flags], "prompt"),
            "train_dpo.py": (cli_flags(pairs, base, tmp_path / "dpo", max_steps=1), "preference")}
    for script, (args, kind) in runs.items():
        proc = run(script, *args, "--data-verify", "sizes", mirror=tmp_path)
        assert proc.returncode == 0, proc.stderr[-2000:]
        said = proc.stdout + proc.stderr
        assert said.count(f"not checked: {SKIPPED[kind][0]}") == 1, said


TRAINERS = {"train_sft.py": "sft", "train_reward.py": "preferences", "train_dpo.py": "preferences",
            "train_grpo.py": "prompts", "train_ppo.py": "prompts"}


def test_post_training_refuses_an_init_whose_tokenizer_changed(tokenizers, tmp_path):
    """The SFT, reward, DPO, GRPO and PPO trainers open their init's tokenizer from its run folder
    (`checkpoint_tokenizer`): a copy that changed there is refused before anything is written."""
    from grpo_fixtures import write_prompt_files

    tok = sp_tokenizer(tokenizers, tmp_path)
    run_dir = tmp_path / "sft_run"
    init = write_lm(run_dir / "checkpoints" / "step_00000080", tok, meta=bundle_tokenizer(tok.spec, run_dir, write=False))
    bundle_tokenizer(tok.spec, run_dir)
    copy = run_dir / "tokenizer" / "tiny.model"
    shutil.copy(tokenizers / "other" / "tiny.model", copy)
    data = {"preferences": write_pairs(tmp_path / "pairs"), "prompts": write_prompt_files(tmp_path / "prompts"),
            "sft": prep_sft(tok, tmp_path / "sft")}
    before = tree(tmp_path)
    for script, kind in TRAINERS.items():
        extra = ["--reward_model", init] if script == "train_ppo.py" else []
        extra += SFT if script == "train_sft.py" else []
        one_error(run(script, "--data", data[kind], "--init", init, "--out", tmp_path / "run", *extra, mirror=tmp_path),
                  f"{copy}: sha256 does not match tokenizer_sha256 in {init / 'meta.json'}")
    assert tree(tmp_path) == before
