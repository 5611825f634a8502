"""benchmarks/trl_compare.py on a tiny random Llama imported as a run folder (tests/hf_fixtures.py's
model and ChatML tokenizer): every row runs both sides, and on the same first batch sprout's loss and
log-probs equal TRL's (GRPO, DPO, SFT) and its logits transformers' (generate), in fp32 and, within
bf16's tolerances, under bf16 autocast; --json writes the table, a check beyond its tolerance
exits 1 naming the row, and --device cuda without CUDA is refused in one line. Skipped without trl."""

import json
import re
import sys
from pathlib import Path

import pytest
import torch

from sprout.model.hf_import import read_source, write_run
from hf_fixtures import hf_model, write_tokenizer

pytest.importorskip("trl", reason="trl is not installed (pip install -e '.[bench]')")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import trl_compare  # noqa: E402


@pytest.mark.slow
def test_every_row_runs_and_the_first_batch_agrees(tmp_path):
    hf_model("llama tied").save_pretrained(tmp_path / "hf")
    write_tokenizer(tmp_path / "hf")
    write_run(read_source(str(tmp_path / "hf"), tmp_path / "work"), tmp_path / "run")
    rows = trl_compare.main(["--run", str(tmp_path / "run"), "--steps", "1", "--warmup", "1", "--threads", "1",
                             "--prompts", "2", "--generations", "2", "--micro-completions", "2",
                             "--completion-length", "4", "--pairs", "2", "--rows", "2", "--gen-rows", "2",
                             "--new-tokens", "4"])
    assert [r.name for r in rows] == ["GRPO step", "DPO step", "SFT step", "generate"]
    for r in rows:
        assert r.sprout > 0 and r.other > 0, r.name
        assert r.check and max(r.check.values()) < 1e-4, (r.name, r.check)
    dpo, sft = rows[1], rows[2]
    assert "TRL's = sprout's + '\\n'" in dpo.notes[-1]  # chatml's newline after <|im_end|>: TRL trains it
    assert "trained only by TRL: '\\n'" in sft.notes[-1]


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["cispo", "sapo"])
def test_grpo_row_agrees_for_cispo_and_sapo(tmp_path, monkeypatch, loss_type):
    """The GRPO row with TRL 1.16's newer loss types: the same loss on TRL's first batch. A
    random model never answers right, so both sides are scored by the completion text's length
    parity instead, which gives the check non-zero advantages to weigh."""
    import trl_compare_grpo

    def parity(completions, **_):
        return [float(len(c if isinstance(c, str) else c[-1]["content"]) % 2) for c in completions]

    monkeypatch.setattr(trl_compare_grpo, "correctness", parity)
    hf_model("llama tied").save_pretrained(tmp_path / "hf")
    write_tokenizer(tmp_path / "hf")
    write_run(read_source(str(tmp_path / "hf"), tmp_path / "work"), tmp_path / "run")
    rows = trl_compare.main(["--run", str(tmp_path / "run"), "--only", "grpo", "--steps", "1", "--warmup", "1",
                             "--threads", "1", "--prompts", "2", "--generations", "4", "--micro-completions", "4",
                             "--completion-length", "4", "--loss-type", loss_type])
    (row,) = rows
    assert f"loss_type {loss_type}" in row.notes[0]
    nonzero = re.search(r"\((\d+) of \d+ completions with a non-zero advantage\)", row.notes[2])
    assert nonzero and int(nonzero.group(1)) > 0, row.notes[2]
    assert max(row.check.values()) < 1e-4, row.check


def tiny_run(tmp_path) -> str:
    hf_model("llama tied").save_pretrained(tmp_path / "hf")
    write_tokenizer(tmp_path / "hf")
    write_run(read_source(str(tmp_path / "hf"), tmp_path / "work"), tmp_path / "run")
    return str(tmp_path / "run")


TINY = ["--steps", "1", "--warmup", "1", "--threads", "1", "--prompts", "2", "--generations", "2",
        "--micro-completions", "2", "--completion-length", "4", "--pairs", "2", "--rows", "2"]


@pytest.mark.slow
def test_lora_rows_agree_at_init_and_with_the_same_adapters(tmp_path):
    """The LoRA rows: TRL with peft against sprout's adapters. At the start (B = 0) both give
    the base's loss; with the same non-zero adapters on both the losses and log-probs agree
    again, and differ from the base's (the adapters are on)."""
    rows = trl_compare.main(["--run", tiny_run(tmp_path), "--only", "grpo_lora,dpo_lora,sft_lora", *TINY])
    assert [r.name for r in rows] == ["GRPO LoRA step", "DPO LoRA step", "SFT LoRA step"]
    assert [sorted(r.check) for r in rows] == [["adapted logps", "logps", "loss"],
                                               ["adapted logps", "adapted loss", "logps", "loss"],
                                               ["adapted loss", "loss"]]
    for r in rows:
        assert r.sprout > 0 and r.other > 0 and r.target == 1.3, r.name
        assert max(r.check.values()) < 1e-4, (r.name, r.check)
        assert r.notes[0].startswith("LoRA r 16, alpha 32 (scale 2)"), r.notes[0]
    for r in rows[1:]:
        base = float(re.search(r"first micro-batch's loss: TRL ([\d.]+)", " ".join(r.notes)).group(1))
        adapted = float(re.search(r"non-zero adapters on both sides: loss TRL ([\d.]+)", " ".join(r.notes)).group(1))
        assert abs(adapted - base) > 1e-3, (r.name, base, adapted)


@pytest.mark.slow
def test_lora_check_catches_another_scale(tmp_path, monkeypatch):
    """sprout's adapters scaled other than TRL's (alpha 16 against 32): B = 0 hides it at the
    start, the check with the same non-zero adapters does not."""
    import trl_compare_lora

    add = trl_compare_lora.Adapters.add
    monkeypatch.setattr(trl_compare_lora.Adapters, "add",
                        lambda self, model: add(trl_compare_lora.Adapters(self.r, self.alpha / 2), model))
    (row,) = trl_compare.main(["--run", tiny_run(tmp_path), "--only", "sft_lora", *TINY])
    assert row.check["loss"] < 1e-4 and row.check["adapted loss"] > 1e-3, row.check


def test_bf16_autocast_runs_every_row_within_bf16_tolerances(tmp_path):
    """--dtype bf16 on the CPU: both sides under bf16 autocast over fp32 weights; every check
    stays within its bf16 tolerance, and the SFT loss is bf16's, not fp32's (autocast is on)."""
    run = tiny_run(tmp_path)
    args = [*TINY, "--gen-rows", "2", "--new-tokens", "4"]
    rows = trl_compare.main(["--run", run, "--dtype", "bf16", "--json", str(tmp_path / "bf16.json"), *args])
    assert [r.name for r in rows] == ["GRPO step", "DPO step", "SFT step", "generate"]
    table = json.loads((tmp_path / "bf16.json").read_text())
    assert (table["device"], table["dtype"]) == ("CPU", "bf16") and "autocast" in table["precision"]
    for r, saved in zip(rows, table["rows"]):
        assert r.sprout > 0 and r.other > 0, r.name
        assert saved["check_failures"] == [] and saved["check"] == r.check, (r.name, saved)
        assert saved["tolerance"] == {k: trl_compare.Precision("cpu", "bf16").tolerance(r.name, k) for k in r.check}
    (fp32,) = trl_compare.main(["--run", run, "--only", "sft", *args])
    loss = re.compile(r"first micro-batch's loss: TRL ([\d.]+)")
    assert loss.search(fp32.notes[1]).group(1) != loss.search(rows[2].notes[1]).group(1)


def test_json_table_and_a_check_beyond_tolerance_exits_1(tmp_path, monkeypatch, capsys):
    """The CLI writes the --json table whatever the checks, then exits 1 naming each row whose
    check is beyond its tolerance (here a stand-in row, fp32's 1e-4 exceeded)."""
    row = trl_compare.Row("SFT step", "s", 1.0, 2.0, 2.0, 1.1, {"loss": 3e-4}, ["a note"])
    monkeypatch.setitem(trl_compare.ROWS, "sft", lambda bench: row)
    out = tmp_path / "table.json"
    with pytest.raises(SystemExit, match=r"^trl_compare: first-batch check beyond its tolerance: "
                                         r"SFT step: loss 3\.0e-04 > 0\.0001$"):
        trl_compare.cli(["--run", tiny_run(tmp_path), "--only", "sft", "--json", str(out)])
    table = json.loads(out.read_text())
    assert set(table) == {"device", "dtype", "precision", "versions", "rows"} and table["dtype"] == "fp32"
    assert set(table["versions"]) == {"torch", "transformers", "trl", "accelerate"}
    assert table["rows"] == [{"name": "SFT step", "unit": "s", "sprout": 1.0, "other": 2.0, "speedup": 2.0,
                              "target": 1.1, "check": {"loss": 3e-4}, "tolerance": {"loss": 1e-4},
                              "check_failures": ["loss 3.0e-04 > 0.0001"], "notes": ["a note"]}]
    assert "FAILED: loss 3.0e-04 > 0.0001" in capsys.readouterr().out
    row.check["loss"] = 5e-5  # within fp32's tolerance: no exit
    trl_compare.cli(["--run", str(tmp_path / "run"), "--only", "sft", "--json", str(out)])
    assert json.loads(out.read_text())["rows"][0]["check_failures"] == []


def test_device_cuda_without_cuda_is_refused_in_one_line(tmp_path, monkeypatch):
    """--device cuda where torch finds no CUDA: one line, exit status 1, before any file is written."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_:
        trl_compare.main(["--run", str(tmp_path / "no_run"), "--device", "cuda", "--json", str(tmp_path / "t.json")])
    message = str(exit_.value.code)
    assert message.startswith("error: --device cuda: torch finds no CUDA device here") and "\n" not in message
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(SystemExit):
        trl_compare.parse_args(["--device", "tpu"])


def test_bf16_tolerances_keep_the_rounding_free_losses_tight():
    """In bf16 the losses that do not depend on rounding at the first batch (GRPO's, DPO's at
    the initial weights) keep a tight tolerance, DPO's summed log-probs a wider one than a
    single token's; in fp32 every check has 1e-4."""
    bf16, fp32 = trl_compare.Precision("cpu", "bf16"), trl_compare.Precision("cpu", "fp32")
    assert [bf16.tolerance(row, "loss") for row in ("GRPO step", "GRPO LoRA step", "DPO step", "SFT step")] == \
        [2e-3, 2e-3, 2e-3, 0.05]
    assert bf16.tolerance("DPO LoRA step", "adapted loss") == 0.05
    assert [bf16.tolerance(row, "logps") for row in ("GRPO step", "DPO step")] == [1.0, 1.5]
    assert bf16.tolerance("generate", "logits") == 3.0
    assert {fp32.tolerance(row, what) for row, what in (("GRPO step", "loss"), ("DPO step", "logps"),
                                                         ("generate", "logits"))} == {1e-4}
    row = trl_compare.Row("GRPO step", "s", 1.0, 1.0, 1.0, 1.5, {"loss": 5e-3, "logps": 0.5})
    assert bf16.failures(row) == ["loss 5.0e-03 > 0.002"] and len(fp32.failures(row)) == 2
