"""benchmarks/trl_compare.py on a tiny random Llama imported as a run folder (tests/hf_fixtures.py's
model and ChatML tokenizer): every row runs both sides, and on the same first batch sprout's loss and
log-probs equal TRL's (GRPO, DPO, SFT) and its logits transformers' (generate). Skipped without trl."""

import sys
from pathlib import Path

import pytest

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
