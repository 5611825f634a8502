"""Worker for test_protocol's multi-process tests: a toy stage with a frozen reference model.

    python tests/protocol_worker.py OUT                                   # 1 process
    accelerate launch --config_file configs/accelerate/cpu_ddp.yaml tests/protocol_worker.py OUT
    accelerate launch --config_file configs/accelerate/cpu_fsdp.yaml tests/protocol_worker.py OUT

Each step trains on the same 6 rows of the global batch (`global_rows`), whatever the number
of processes: 1 process takes them as 2 micro-batches of 4 and 2 rows; with 2 processes
rank 0 takes the 4 rows and rank 1 the 2, so the per-sequence and per-token counts differ
between ranks. The loss is the masked next-token NLL plus 0.5 × the KL from the policy to a
frozen reference (`Trainer.prepare_frozen`), per trained token; the metrics are the KL per
trained token, `length` (trained tokens per row) and `reward` (summed target log-prob per
row). The lm_head learns at twice the lr (`param_groups`). At the end every rank checks
that its part of the frozen model is unchanged, without gradients, in eval mode and in no
optimizer group, and prints the outcome as one JSON line.
"""

import json
import sys
from dataclasses import dataclass, field

import torch

from sprout.model.transformer import ModelConfig, Transformer
from sprout.engine.trainer import TrainConfig, all_reduce_sums, make_accelerator
from sprout.engine.optim import OptimConfig, decay_groups
from sprout.engine.stage import TokenStage
from sprout.engine.run_stage import train_stage
from sprout.errors import run_main

V, T, ROWS, BETA = 32, 8, 6, 0.5
MODEL = ModelConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=2, max_seq_len=T)


def global_rows(step: int) -> dict[str, torch.Tensor]:
    """The 6 rows of step `step`: random tokens, each row with 2..T trained targets."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, V, (ROWS, T + 1), generator=g)
    lengths = torch.randint(2, T + 1, (ROWS,), generator=g)
    mask = torch.arange(T)[None] < lengths[:, None]
    return {"input_ids": x[:, :-1], "targets": x[:, 1:], "loss_mask": mask}


def local_part(rows: dict, rank: int, world: int) -> list[dict]:
    """Rows 0-3 and 4-5: two micro-batches on 1 process, one per rank on 2."""
    parts = [{k: v[:4] for k, v in rows.items()}, {k: v[4:] for k, v in rows.items()}]
    return parts if world == 1 else [parts[rank]]


@dataclass
class RowBatch:
    rows: int = ROWS


@dataclass
class ToyConfig:
    model: ModelConfig = field(default_factory=lambda: MODEL)
    batch: RowBatch = field(default_factory=RowBatch)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-2, warmup_steps=0, schedule="constant"))
    train: TrainConfig = field(default_factory=lambda: TrainConfig(max_steps=6, log_every=1, eval_every=3,
                                                                   ckpt_every=3, progress=False, peak_tflops=-1))
    out: str = ""


class KLToReference(TokenStage):
    name = "kl_toy"

    def __init__(self, acc):
        self.acc, self.ref = acc, None

    def setup(self, trainer):
        torch.manual_seed(1)  # every rank builds the same reference
        self.ref = trainer.prepare_frozen(Transformer(MODEL))
        self.trainer = trainer
        self.ref_before = {n: local(p).clone() for n, p in self.ref.named_parameters()}

    def param_groups(self, model):
        head = [model.lm_head.weight]
        body = [p for p in model.parameters() if all(p is not h for h in head)]
        return decay_groups(body, 0.1) + [{"params": head, "lr_scale": 2.0, "name": "head"}]

    def count_targets(self, batch):
        return batch["loss_mask"].sum()

    def next_micro_batches(self, step):
        self.generated_tokens = ROWS * T
        return local_part(global_rows(step), self.acc.process_index, self.acc.num_processes)

    def loss(self, model, batch):
        mask = batch["loss_mask"]
        logp = torch.log_softmax(model(batch["input_ids"]).float(), -1)
        with torch.no_grad():
            ref_logp = torch.log_softmax(self.ref(batch["input_ids"]).float(), -1)
        kl = (logp.exp() * (logp - ref_logp)).sum(-1)  # per token, KL(policy || reference)
        tok = logp.gather(-1, batch["targets"][..., None])[..., 0]
        n = mask.sum()
        loss_sum = (-tok + BETA * kl)[mask].sum()
        rows = mask.shape[0]
        return loss_sum, n, {"kl": (kl[mask].sum().detach(), n),
                             "length": (n, rows),
                             "reward": (tok.detach()[mask].sum(), rows)}

    @torch.no_grad()
    def evaluate(self, model):
        rows = global_rows(10_000)
        part = local_part(rows, self.acc.process_index, self.acc.num_processes)
        sums = {"nll": 0.0, "n": 0.0}
        for b in part:  # as many forwards on every rank (each is a collective under FSDP)
            logp = torch.log_softmax(model(b["input_ids"]).float(), -1)
            tok = logp.gather(-1, b["targets"][..., None])[..., 0]
            sums["nll"] += -tok[b["loss_mask"]].sum()
            sums["n"] += b["loss_mask"].sum()
        tot = all_reduce_sums(self.acc, sums)
        return {"val_loss": tot["nll"] / tot["n"]}

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def main(out: str) -> None:
    cfg = ToyConfig(out=out)
    acc = make_accelerator(cfg.train, out)
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    stage = KLToReference(acc)
    train_stage(acc, model, stage, cfg)  # ends the process group
    ref, opt = stage.ref, stage.trainer.optimizer
    in_optimizer = {id(p) for g in opt.param_groups for p in g["params"]}
    check = {"rank": acc.process_index,
             "frozen_unchanged": all(torch.equal(local(p), stage.ref_before[n]) for n, p in ref.named_parameters()),
             "frozen_sharded": any(hasattr(p, "to_local") for p in ref.parameters()),
             "no_grad": not any(p.requires_grad for p in ref.parameters()),
             "eval_mode": not ref.training,
             "not_in_optimizer": not any(id(p) in in_optimizer for p in ref.parameters()),
             "group_lrs": [g["lr"] for g in opt.param_groups]}
    print("CHECK " + json.dumps(check), flush=True)


if __name__ == "__main__":
    run_main(lambda: main(sys.argv[1]))  # ends as the scripts do: no teardown of torch's threads
