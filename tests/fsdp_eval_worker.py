"""Worker for test_evaluate.test_evaluation_of_an_fsdp_model_equals_one_process (2 processes,
configs/accelerate/cpu_fsdp.yaml).

Both ranks evaluate the same FSDP2-sharded tiny model on the same prompts, one prompt per
batch, so rank 1 runs a padding round; rank 0 writes the figures and the shown answers to
<out>/fsdp.json.
"""

import json
import sys
from pathlib import Path

import torch

from sprout.model.transformer import ModelConfig, Transformer
from sprout.evaluation.evaluate import evaluate_prompts
from sprout.tokenizer import load_tokenizer
from sprout.engine.trainer import TrainConfig, Trainer, make_accelerator
from sprout.engine.optim import OptimConfig, build_optimizer, lr_schedule
from sprout.engine.run_stage import end_processes
from sprout.errors import run_main

CONFIG = dict(vocab_size=512, d_model=32, n_layers=2, n_heads=4, max_seq_len=48)
PROMPTS = [{"id": str(i), "prompt": [{"role": "user", "content": f"What is {i} + {i}?"}], "gold": str(2 * i),
            "level": 1 + i % 2} for i in range(3)]
SETTINGS = dict(n=3, ks=(1, 2), greedy=True, max_new_tokens=10, seed=5, batch_size=1, num_samples=3)


def model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(**CONFIG))


def main(tokenizer: str, out: str) -> None:
    cfg, optim = TrainConfig(max_steps=1, progress=False), OptimConfig()
    acc = make_accelerator(cfg)
    m = model()
    trainer = Trainer(acc, m, build_optimizer(m, optim), lr_schedule(optim, 1), cfg)
    assert trainer.sharded, "expected an FSDP launch"
    ev = evaluate_prompts(trainer.model, load_tokenizer(tokenizer), PROMPTS, accelerator=acc, **SETTINGS)
    if acc.is_main_process:
        record = {"metrics": ev.metrics, "by_level": ev.by_level, "samples": ev.samples}
        (Path(out) / "fsdp.json").write_text(json.dumps(record))
    end_processes(acc)


if __name__ == "__main__":
    run_main(lambda: main(sys.argv[1], sys.argv[2]))  # ends as the scripts do: no teardown of torch's threads
