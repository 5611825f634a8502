"""scripts/sample.py continues raw text with a base model; scripts/chat.py says when a checkpoint
is not chat-tuned and refuses --max-new-tokens 0 with one line."""

import subprocess
import sys
from pathlib import Path

from proc import run_here
from test_sft_train import base  # noqa: F401 (fixture: a tiny base checkpoint with the sp tokenizer)

ROOT = Path(__file__).resolve().parents[1]


def script(name: str, *args) -> subprocess.CompletedProcess:
    return run_here([sys.executable, str(ROOT / "scripts" / name), *map(str, args)], cwd=ROOT)


def test_sample_prints_the_prompt_and_its_continuation(base, sp):
    greedy = script("sample.py", base, "--prompt", "apple river", "--max-new-tokens", 6, "--temperature", 0)
    assert greedy.returncode == 0, greedy.stderr
    text = greedy.stdout.rstrip("\n")
    assert text.startswith("apple river") and len(sp.encode(text)) > len(sp.encode("apple river"))
    seeded = [script("sample.py", base, "--prompt", "apple", "--max-new-tokens", 8, "--temperature", 1.0,
                     "--top-k", 50, "--top-p", 0.9, "--seed", 3).stdout for _ in range(2)]
    assert seeded[0] == seeded[1] and seeded[0].startswith("apple")


def test_sample_refuses_bad_arguments_with_one_line(base):
    r = script("sample.py", base, "--prompt", "apple", "--max-new-tokens", 0)
    assert r.returncode == 2 and r.stderr.strip() == "error: --max-new-tokens must be at least 1, not 0"


def test_chat_on_a_base_model_says_it_is_not_chat_tuned(base):
    r = script("chat.py", base, "--prompt", "Say apple then river.", "--max-new-tokens", 3, "--temperature", 0)
    assert r.returncode == 0, r.stderr
    assert "is a base model (pretraining), not chat-tuned" in r.stderr and "scripts/sample.py" in r.stderr


def test_chat_refuses_zero_new_tokens_with_one_line(base):
    r = script("chat.py", base, "--prompt", "hi", "--max-new-tokens", 0)
    assert r.returncode == 2 and r.stderr.strip() == "error: --max-new-tokens must be at least 1, not 0"
