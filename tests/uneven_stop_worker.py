"""Worker for test_train.test_a_rank_running_out_of_data_stops_every_rank (run under torchrun).

A toy stage whose rank 1 runs out of data after 3 steps while rank 0 still has batches:
`sprout.engine.training_loop.fit` must stop both at the same step (the stop decision is all-reduced), evaluate,
checkpoint and return, instead of leaving rank 0 waiting in a collective for ever.
"""

import sys

import torch

from sprout.losses.tokens import token_nll_sum
from sprout.model.transformer import ModelConfig, Transformer
from sprout.engine.training_loop import fit
from sprout.engine.trainer import TrainConfig, Trainer, all_reduce_sums, make_accelerator
from sprout.engine.optim import OptimConfig, build_optimizer
from sprout.engine.run_stage import end_processes
from sprout.engine.stage import TokenStage
from sprout.errors import run_main

V, T = 64, 16


class UnevenStage(TokenStage):
    name = "toy"

    def __init__(self, acc, stop_at: int):
        self.acc, self.stop_at = acc, stop_at

    def next_micro_batches(self, step: int):
        if self.acc.process_index == 1 and step >= self.stop_at:
            return None
        g = torch.Generator().manual_seed(step * 10 + self.acc.process_index)
        x = torch.randint(0, V, (4, T + 1), generator=g)
        return [{"input_ids": x[:, :-1], "targets": x[:, 1:]}]

    def loss(self, model, batch):
        nll, n = token_nll_sum(model(batch["input_ids"]), batch["targets"])
        return nll, n, {}

    @torch.no_grad()
    def evaluate(self, model):
        x = torch.arange(T + 1)[None] % V
        nll, n = token_nll_sum(model(x[:, :-1]), x[:, 1:])
        tot = all_reduce_sums(self.acc, {"nll": nll, "n": n})
        return {"val_loss": tot["nll"] / tot["n"]}

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def main(out: str) -> None:
    cfg = TrainConfig(max_steps=10, log_every=1, eval_every=0, ckpt_every=0, progress=False)
    acc = make_accelerator(cfg, out)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=V, d_model=32, n_layers=1, n_heads=2, max_seq_len=T))
    trainer = Trainer(acc, model, build_optimizer(model, OptimConfig(lr=1e-3)), lambda step, peak: peak, cfg,
                      out_dir=out)
    result = fit(trainer, UnevenStage(acc, stop_at=3))
    print(f"rank {acc.process_index} stopped after {result['steps']} steps", flush=True)
    end_processes(acc)


if __name__ == "__main__":
    run_main(lambda: main(sys.argv[1]))  # ends as the scripts do: no teardown of torch's threads
