"""Worker for test_generate.test_generation_under_fsdp_keeps_every_rank_stepping (2 processes,
configs/accelerate/cpu_fsdp.yaml).

Each rank samples from the same FSDP2-sharded tiny model with prompts of its own: rank 0's rows
all stop within 4 steps, rank 1's rows run up to 20 steps and stop at different ones. Every
forward is a collective, so rank 0 must keep stepping until rank 1 is done. Each rank writes its
tokens, log-probs and the number of forwards it ran to <out>/rank<r>.json.
"""

import json
import sys
from pathlib import Path

import torch

from sprout.model.generate import generate
from sprout.model.transformer import ModelConfig, Transformer
from sprout.engine.trainer import TrainConfig, Trainer, make_accelerator
from sprout.engine.optim import OptimConfig, build_optimizer, lr_schedule
from sprout.engine.run_stage import end_processes
from sprout.errors import run_main

CONFIG = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=48)
STOPS = (3, 17, 29, 41, 52, 60)
# rank -> (prompts, max_new_tokens, generator seed)
PLAN = {0: ([[5, 9, 12], [7, 1, 30, 44, 2]], 4, 0),
        1: ([[8, 2], [40, 41, 42, 43], [11, 12, 13, 14, 15, 16]], 20, 1)}


def model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(**CONFIG))


def run(m, rank: int):
    prompts, max_new, seed = PLAN[rank]
    return generate(m, prompts, max_new, temperature=1.0, stop_ids=STOPS,
                    generator=torch.Generator().manual_seed(seed))


def main(out: str) -> None:
    cfg, optim = TrainConfig(max_steps=1, progress=False), OptimConfig()
    acc = make_accelerator(cfg)
    m = model()
    trainer = Trainer(acc, m, build_optimizer(m, optim), lr_schedule(optim, 1), cfg)
    assert trainer.sharded, "expected an FSDP launch"
    policy = trainer.generation_model
    policy.eval()
    forwards = [0]
    policy.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    gen = run(policy, acc.process_index)
    record = {"tokens": gen.tokens, "logprobs": gen.logprobs, "finished": gen.finished, "forwards": forwards[0]}
    (Path(out) / f"rank{acc.process_index}.json").write_text(json.dumps(record))
    end_processes(acc)


if __name__ == "__main__":
    run_main(lambda: main(sys.argv[1]))  # ends as the scripts do: no teardown of torch's threads
