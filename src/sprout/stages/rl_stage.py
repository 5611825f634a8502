"""What the RL stages (GRPO, PPO) share: prompts, rollouts, rewards, a rollout buffer, held-out eval.

Per buffer: `PromptLoader` gives this rank its contiguous slice of each global batch of
prompts (a seeded permutation per epoch; ranks never share a prompt); `sample` generates G
completions of each with the stage's own generator (seeded by train.seed and the rank), the
G of a prompt adjacent on its rank, through the rollout engine (`rollout.engine`,
`sprout.stages.rollout_engine`: its one `generate` call is all that differs between engines,
and its `update_weights` runs after every optimizer step); the reward functions score them;
`completion_logps` (the loss's own forward, no gradient) gives the old and the reference's
log-probs, never the sampler's (their difference is logged as `sampling/logp_diff_mean|max`,
`logp_gap_stats`); the subclass turns rewards into advantages; the buffer serves
`num_iterations` optimizer steps. With a temperature other than 1 every log-prob is that of
logits / temperature, as TRL's GRPO. The buffer and the generator are `tensor_state`, so a
resume inside a buffer continues exactly.
Buffer figures are computed once over the gathered global batch and ride on each step's first
micro-batch as (sum, count) on rank 0 ((0, 0) elsewhere), so the loop's reduction is exact.
Micro-batches hold batch.micro_completions rows, or fewer by batch.micro_batch_tokens, and
batch.padding_free packs their forwards (`sprout.stages.packing`).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from data_loader.prompt_batches import PromptLoader, check_held_out

from sprout.chat_formats import check_trained_format, format_for
from sprout.checkpoint import checkpoint_tokenizer, init_record, load_weights, read_meta
from sprout.config import require
from sprout.errors import SproutError
from sprout.formats.data_paths import PROMPT_FILES, resolve_data
from sprout.formats.prompts import read_prompts
from sprout.prep.held_out import check_train_jsonl
from sprout.formats.verify_inputs import verify_jsonl_data
from sprout.losses.policy import token_entropy
from sprout.model.generate import default_stop_ids
from sprout.model.load import check_init_architecture, init_from_lm
from sprout.model.config import ModelConfig
from sprout.model.load import uninitialised
from sprout.model.transformer import Transformer
from sprout.evaluation.evaluate import evaluate_prompts
from sprout.rl.verifiers import WeightedReward, combine_rewards
from sprout.engine.trainer import all_reduce_sums
from sprout.engine.run_stage import start_run, with_epochs
from sprout.engine.cli import print_rank0, resolve_resume
from sprout.engine.stage import LoaderPosition
from sprout.stages.configs import PromptBatchConfig, RolloutConfig
from sprout.stages.packing import CompletionRows, budget_slices, packed_cost
from sprout.stages.rollout_engine import check_engine, make_engine


def rollout_micro_steps(per_rank: int, batch: PromptBatchConfig, mini_batches: int = 1) -> int:
    """Micro-batches of batch.micro_completions per optimizer step on each process, when its
    completions of a generation batch (`per_rank` prompts × num_generations) serve `mini_batches`
    optimizer steps; refused unless they divide exactly."""
    local, m = per_rank * batch.num_generations, batch.micro_completions
    if local % (mini_batches * m):
        split = f"batch.num_mini_batches {mini_batches} × " if mini_batches > 1 else ""
        raise SproutError(f"batch: {per_rank} prompt(s) per process × num_generations {batch.num_generations} = "
                          f"{local} completions is not a multiple of {split}batch.micro_completions {m}")
    return local // (mini_batches * m)


# ---- the forward every RL loss shares -----------------------------------------------------------
def completion_logps(model, batch: dict, temperature: float = 1.0, entropy: bool = False,
                     entropy_grad: bool = False, padding_free: bool = False,
                     rows: CompletionRows | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs [N, L] of the completion tokens given their prompts (left-padded prompt
    then right-padded completion in one row; padding computes nothing, `padding_inputs`; with
    `padding_free` the rows packed, `sprout.stages.packing.CompletionRows`; `rows`: that forward,
    built by the caller), of logits / temperature; with `entropy`, each position's entropy too
    (with a gradient only when `entropy_grad`). Positions off the completion mask hold garbage
    (packed: 0): mask them."""
    rows = rows or CompletionRows(batch, padding_free)
    logits = rows.forward(model)
    if temperature != 1.0:
        logits = logits / temperature
    logps = logits.gather(-1, rows.targets.view(logits.shape[:-1])[..., None]).squeeze(-1) - logits.logsumexp(dim=-1)
    ent = None
    if entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            ent = rows.completion(token_entropy(logits))
    return rows.completion(logps), ent


def trim(batch: dict) -> dict:
    """A micro-batch without the prompt columns that are padding in every row, nor the
    completion columns past its longest completion (both compute nothing)."""
    pm, cm = batch["prompt_mask"], batch["completion_mask"]
    start = int((pm.sum(0) > 0).long().argmax()) if bool(pm.any()) else 0
    end = max(1, int(cm.sum(1).max()))
    out = {}
    for k, v in batch.items():
        if torch.is_tensor(v) and v.dim() == 2 and k.startswith("prompt_"):
            out[k] = v[:, start:]
        elif torch.is_tensor(v) and v.dim() == 2 and v.shape[1] == cm.shape[1]:
            out[k] = v[:, :end]
        else:
            out[k] = v
    return out


def concat_rollouts(parts: list[dict]) -> dict:
    """Rollout dicts of [n, ...] tensors as one: prompt columns left-padded and completion
    columns right-padded (with 0) to the widest part, other tensors concatenated."""
    out = {}
    for k in parts[0]:
        vs = [p[k] for p in parts]
        if vs[0].dim() == 2:
            width = max(v.shape[1] for v in vs)
            left = k.startswith("prompt_")
            vs = [torch.nn.functional.pad(v, (width - v.shape[1], 0) if left else (0, width - v.shape[1])) for v in vs]
        out[k] = torch.cat(vs)
    return out


def pad_columns(t: torch.Tensor, width: int) -> torch.Tensor:
    """`t` [n, w] as float32 on the CPU, right-padded with 0 to `width` columns (a trimmed
    micro-batch's columns back to its rollout's)."""
    return torch.nn.functional.pad(t.float().cpu(), (0, width - t.shape[1]))


def pack_stats(stats: dict[str, tuple[float, float]], main: bool) -> torch.Tensor:
    """Buffer figures as a [K, 2] (sum, count) tensor: as given on rank 0, zeros elsewhere."""
    t = torch.tensor([list(v) for v in stats.values()], dtype=torch.float64).reshape(-1, 2)
    return t if main else torch.zeros_like(t)


# ---- the stage ----------------------------------------------------------------------------------
class RLStage(LoaderPosition):
    """The rollout buffer and everything around it. A subclass gives `name`,
    `fill_buffer()` -> (buffer dict of [N, ...] tensors, stats {name: (sum, count)}),
    `loss` and `count_targets`. `mini_batches`: the optimizer steps one pass over the buffer
    is cut into (PPO's; `accum_steps` counts the micro-batches of one of them)."""

    generated_tokens = 0
    loss_label = "policy loss"

    def __init__(self, accelerator, tokenizer, loader: PromptLoader, val: PromptLoader, batch: PromptBatchConfig,
                 rollout: RolloutConfig, rewards: list[WeightedReward], *, num_iterations: int = 1, seed: int = 0,
                 eval_batch: int = 32, eval_generations: int = 0, mini_batches: int = 1):
        self.acc, self.tok, self.loader, self.val = accelerator, tokenizer, loader, val
        self.batch_cfg, self.rollout, self.rewards = batch, rollout, rewards
        self.num_iterations, self.eval_batch, self.eval_generations, self.seed = \
            num_iterations, eval_batch, eval_generations, seed
        self.G = batch.num_generations
        self.accum_steps = rollout_micro_steps(loader.per_rank, batch, mini_batches)
        self.generator = torch.Generator(device=accelerator.device)
        self.generator.manual_seed(seed * 1000 + accelerator.process_index)
        self.buffer: dict | None = None
        self.served = 0                   # iterations of the buffer already served
        self.buffer_all_masked = False    # no completion token of the global batch is in the loss
        self.all_masked_steps = 0         # steps in a row served such a buffer
        self.model = None                 # the policy for generation and old log-probs (setup)
        self.engine = None                # what generates the rollouts (setup)
        self.stop_ids = default_stop_ids(tokenizer)
        self.sharded = False

    def setup(self, trainer) -> None:
        """The policy and its rollout engine; the engine's `update_weights` hooked to the end of
        every optimizer step (the torch optimizer's post-step hook)."""
        self.model, self.sharded = trainer.generation_model, trainer.sharded
        self.engine = make_engine(self.rollout, self.model, self.tok, self.acc, rows=self.loader.per_rank * self.G)
        optimizer = getattr(trainer, "optimizer", None)
        if optimizer is not None:
            optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper: the torch optimizer
            optimizer.register_step_post_hook(lambda *_: self.engine.update_weights(self.model))

    # ---- rollouts ----
    def sample(self, idx: np.ndarray, ids: list[list[int]] | None = None) -> dict:
        """G completions of each prompt `idx` of the train loader: a dict of [N, ...] tensors
        (prompt_ids/mask, completion_ids/mask, sampler_logps, truncated, lengths) and `texts`."""
        prompts = ids if ids is not None else [self.loader.ids[i] for i in idx]
        P = max(len(p) for p in prompts)
        input_ids = torch.tensor([[0] * (P - len(p)) + p for p in prompts], device=self.acc.device)
        mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts], device=self.acc.device)
        r = self.rollout
        out = self.engine.generate(input_ids, mask, num_generations=self.G, max_new_tokens=r.max_completion_length,
                                   temperature=r.temperature, top_k=r.top_k, top_p=r.top_p, stop_ids=self.stop_ids,
                                   generator=self.generator)
        self.generated_tokens += int(out.lengths.sum())
        return {"prompt_ids": out.prompt_ids.cpu(), "prompt_mask": out.prompt_mask.cpu(),
                "completion_ids": out.completion_ids.cpu(), "completion_mask": out.completion_mask.cpu(),
                "sampler_logps": out.logprobs.cpu(), "truncated": out.truncated.cpu(), "lengths": out.lengths.cpu()}

    def texts(self, rollout: dict) -> list[str]:
        """Each completion decoded without its stop token."""
        ids, lengths, truncated = rollout["completion_ids"], rollout["lengths"], rollout["truncated"]
        return [self.tok.decode(row[:int(n) - (0 if t else 1)].tolist())
                for row, n, t in zip(ids, lengths, truncated)]

    def score(self, rollout: dict, idx: np.ndarray):
        """(totals [N] float64, per-function values [N, F] with NaN where a function abstained); a
        reward function's error names the completion, or the batch's prompts (`combine_rewards`)."""
        gold = [self.loader.gold[i] for i in idx for _ in range(self.G)]
        names = [f"completion {k} of prompt {self.loader.records[i]['id']!r} ({self.loader.path})"
                 for i in idx for k in range(self.G)]
        columns = {"gold": gold, "completion_lengths": rollout["lengths"].tolist()}  # REWARD_COLUMNS
        ids = [repr(self.loader.records[i]["id"]) for i in idx]
        more = f" and {len(ids) - 4} more" if len(ids) > 4 else ""
        scoring = f"prompt{'s' if len(ids) > 1 else ''} {', '.join(ids[:4])}{more} ({self.loader.path})"
        combined = combine_rewards(self.rewards, self.texts(rollout), completion_names=names, scoring=scoring,
                                   **columns)
        per_fn = torch.tensor([[math.nan if v is None else v for v in combined.per_function[r.name]]
                               for r in self.rewards], dtype=torch.float64).T
        return torch.tensor(combined.totals, dtype=torch.float64), per_fn

    @torch.no_grad()
    def no_grad_pass(self, fn, rollout: dict) -> list:
        """[fn(micro-batch)] over every row of `rollout` in micro-batches of batch.micro_completions
        (its [N, L] tensors, trimmed, on the device), under autocast, without gradient."""
        rows = {k: v for k, v in rollout.items() if torch.is_tensor(v) and v.dim() == 2}
        out = []
        for s in self.micro_slices(rollout, rollout["completion_ids"].shape[0]):
            part = trim({k: v[s].to(self.acc.device) for k, v in rows.items()})
            with self.acc.autocast():
                out.append(fn(part))
        return out

    def micro_slices(self, rows: dict, n: int) -> list[slice]:
        """The first `n` rows of `rows` as micro-batches: batch.micro_completions each, or with
        batch.micro_batch_tokens consecutive rows while their tokens fit (padded: rows × (longest
        prompt + longest completion); padding_free: prompt + completion tokens), every process
        running as many (`sprout.stages.packing.budget_slices`)."""
        b, cost = self.batch_cfg, None
        if b.micro_batch_tokens:
            p, c = rows["prompt_mask"][:n].sum(1).cpu().numpy(), rows["completion_mask"][:n].sum(1).cpu().numpy()
            if b.padding_free:
                cost = packed_cost(np.stack([p, c], axis=1))
            else:
                cost = lambda i, j: (j - i) * int(p[i:j].max() + c[i:j].max())  # noqa: E731
        return budget_slices(n, b.micro_completions, b.micro_batch_tokens, cost, self.acc, unit="completions")

    def logps_of(self, model, rollout: dict) -> torch.Tensor:
        """`completion_logps` of every row of `rollout` under `model`, in micro-batches, no gradient."""
        L, T, free = rollout["completion_ids"].shape[1], self.rollout.temperature, self.batch_cfg.padding_free
        out = self.no_grad_pass(lambda part: pad_columns(completion_logps(model, part, T, padding_free=free)[0], L),
                                rollout)
        return torch.cat(out) * rollout["completion_mask"]

    def logp_gap_stats(self, rollout: dict) -> dict:
        """sampling/logp_diff_mean|max over the global batch: |the old log-prob the loss's forward
        took - the sampler's| per completion token, as {name: (sum, count)} (every rank calls)."""
        diff = (rollout["old_logps"] - rollout["sampler_logps"]).abs()[rollout["completion_mask"].bool()]
        d = all_reduce_sums(self.acc, {"sum": diff.double().sum(), "n": float(diff.numel())})
        diff_max = float(self.gather(diff.max().reshape(1) if diff.numel() else torch.zeros(1)).max())
        return {"sampling/logp_diff_mean": (d["sum"], d["n"]), "sampling/logp_diff_max": (diff_max, 1)}

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """`t` [n, ...] of every rank, concatenated in rank order (every rank has the same n)."""
        if self.acc.num_processes == 1:
            return t
        return self.acc.gather(t.to(self.acc.device)).cpu()

    # ---- the protocol ----
    def fill_buffer(self) -> tuple[dict, dict]:
        raise NotImplementedError

    def next_micro_batches(self, step: int) -> list[dict]:
        """The next iteration over the buffer; a new buffer (rollouts) when it is used up."""
        b = self.serve_buffer(step)
        rows = {k: v for k, v in b.items() if k not in ("stats", "stat_names")}
        return self.micro_batches(rows, b["completion_ids"].shape[0])

    def serve_buffer(self, step: int) -> dict:
        """The buffer for step `step` (0-based), refilled (`fill_buffer`, its stats packed) once it
        has been served `num_iterations` times; counts this serving in `served` (1 after a refill)
        and checks that the step trains on something (`check_all_masked`)."""
        self.generated_tokens = 0
        if self.buffer is None or self.served >= self.num_iterations:
            self.buffer, stats = self.fill_buffer()
            self.buffer["stats"] = pack_stats(stats, self.acc.is_main_process)
            self.buffer["stat_names"] = list(stats)
            self.served = 0
            in_loss = float(self.loss_mask(self.buffer).sum())
            self.buffer_all_masked = all_reduce_sums(self.acc, {"n": in_loss})["n"] == 0
        self.served += 1
        self.check_all_masked(step)
        return self.buffer

    def loss_mask(self, batch: dict) -> torch.Tensor:
        """The completion tokens the loss trains on [N, L] (a stage may leave some out)."""
        return batch["completion_mask"]

    def check_all_masked(self, step: int) -> None:
        """Count the steps in a row whose buffer has no completion token in the loss (every
        completion truncated and masked: loss 0, no gradient): a warning at the first, and a
        SproutError once there are rollout.max_all_masked_steps of them."""
        if not self.buffer_all_masked:
            self.all_masked_steps = 0
            return
        self.all_masked_steps += 1
        limit, length = self.rollout.max_all_masked_steps, self.rollout.max_completion_length
        what = (f"every completion of the batch is out of the loss (truncated at rollout.max_completion_length "
                f"{length} and masked)")
        if self.all_masked_steps >= limit:
            raise SproutError(f"{self.name}: step {step + 1}: {limit} step(s) in a row where {what}: nothing is "
                              f"learned; raise rollout.max_completion_length or stop masking truncated completions "
                              f"(rollout.max_all_masked_steps sets how many such steps a run allows)")
        if self.all_masked_steps == 1 and self.acc.is_main_process:
            print(f"warning: {self.name}: step {step + 1}: {what}: loss 0, no gradient; the run stops after "
                  f"{limit} such steps in a row (rollout.max_all_masked_steps)", file=sys.stderr, flush=True)

    def micro_batches(self, rows: dict, n: int) -> list[dict]:
        """The first `n` rows of `rows` in micro-batches (`micro_slices`), each trimmed; the first
        carries the buffer's packed stats."""
        out = [trim({k: v[s] for k, v in rows.items()}) for s in self.micro_slices(rows, n)]
        out[0] = {**out[0], "stats": self.buffer["stats"], "stat_names": self.buffer["stat_names"]}
        return out

    @staticmethod
    def stat_metrics(batch: dict) -> dict[str, tuple]:
        if "stats" not in batch:
            return {}
        return {name: (s[0], s[1]) for name, s in zip(batch["stat_names"], batch["stats"])}

    def num_tokens(self, batch: dict) -> int:
        return int(batch["prompt_mask"].sum() + batch["completion_mask"].sum())

    def flops(self, model, batch: dict) -> float:
        """The real tokens' training FLOPs, the lm_head's only at the real completion tokens
        (`CompletionRows` keeps logits at the completion columns; `Transformer.training_flops`)."""
        training_flops = getattr(model, "training_flops", None)
        T = batch["prompt_ids"].shape[1] + batch["completion_ids"].shape[1]
        return training_flops(T, self.num_tokens(batch), int(batch["completion_mask"].sum())) \
            if training_flops else 0.0

    def tensor_state(self) -> dict:
        return {"buffer": self.buffer, "served": self.served, "generator": self.generator.get_state(),
                "all_masked": (self.buffer_all_masked, self.all_masked_steps)}

    def load_tensor_state(self, state: dict) -> None:
        self.buffer, self.served = state["buffer"], int(state["served"])
        self.generator.set_state(state["generator"])
        self.buffer_all_masked, self.all_masked_steps = state["all_masked"]

    # ---- held-out eval ----
    def evaluate(self, model) -> dict:
        """`sprout.evaluation.evaluate.evaluate_prompts` on the held-out prompts (greedy, and
        data.eval_num_generations samples each, seeded by train.seed): every total prefixed
        `val_`, plus `val_accuracy` (greedy accuracy), `val_format` (greedy format rate) and, with
        samples, `val_mean_length` (sampled completion tokens)."""
        n = self.eval_generations
        ev = evaluate_prompts(self.model if self.model is not None else model, self.tok, self.val.records, n=n,
                              ks=sorted({1, n}) if n else (), greedy=True,
                              max_new_tokens=self.rollout.max_completion_length, seed=self.seed,
                              batch_size=self.eval_batch, accelerator=self.acc, cuda_graph=self.rollout.cuda_graph)
        out = {f"val_{k}": v for k, v in ev.metrics.items() if k != "prompts"}
        out["val_accuracy"], out["val_format"] = ev.metrics["greedy/accuracy"], ev.metrics["greedy/format_rate"]
        if n:
            out["val_mean_length"] = ev.metrics["completions/mean_length"]
        return out


# ---- the run ------------------------------------------------------------------------------------
@dataclass
class RLRun:
    """What `open_rl_run` built for an RL stage's run_* function."""
    cfg: object                         # the config with train.max_steps resolved
    base: dict                          # the init checkpoint's meta
    model_config: ModelConfig
    tokenizer: object
    accelerator: object
    loader: PromptLoader
    val: PromptLoader
    resume: Path | None

    def init_lm(self, load: bool = True) -> Transformer:
        """A plain LM of the init checkpoint's shape, with its weights when `load`: an LM's as
        they are, a PPO policy's (architecture lm+value) without its value head."""
        if load and self.base["architecture"] != "lm":
            return init_from_lm(self.base["path"], "lm")[0]  # the backbone and lm_head, no value head
        model = uninitialised(Transformer, self.model_config)  # its weights loaded here, or by the resume
        if load:
            load_weights(model, self.base["path"], self.base)  # the meta read at start-up, not again
        return model

    def provenance(self) -> dict:
        return {"tokenizer_fingerprint": self.tokenizer.fingerprint(),
                "template_version": format_for(self.tokenizer).version,
                "init": init_record(self.base),
                "prompts": {"train": str(self.loader.path), "val": str(self.val.path),
                            "prompts": self.loader.num_prompts, "val_prompts": self.val.num_prompts}}


def open_rl_run(cfg, stage_name: str, num_iterations: int = 1, resume: str | None = None,
                mini_batches: int = 1) -> RLRun:
    """Checks, accelerator, tokenizer and prompt loaders for an RL stage. `cfg` has init, data
    (RLDataConfig), batch (PromptBatchConfig), rollout, train and out; `num_iterations`: the
    optimizer steps each generation batch serves, `mini_batches` of them per pass over it (PPO).
    Before anything is written, both prompt files are checked against the prep's `manifest.json`
    beside them (`sprout.formats.verify_inputs.verify_jsonl_data`: listed, and their sha256 unless
    data.verify is `sizes`); the train file against the dev file and the sealed test file beside it
    (`data_loader.prompt_batches.check_held_out`: no prompt in both, by id or by prompt key); it
    must hold no dev or test problem of an evaluation task and, when prepared, record that
    (`sprout.prep.held_out.check_train_jsonl`); rollout.engine must run here (`check_engine`:
    vllm importable, one process)."""
    if not cfg.init:
        raise SproutError("no init model: set init in the config or pass --init CHECKPOINT")
    if not cfg.data.path:
        raise SproutError("no prompts: set data.path in the config or pass --data DIR (or prompts.jsonl)")
    require(cfg.lora.off or cfg.lora.dropout == 0, "lora.dropout", cfg.lora.dropout,
            f"0 in {stage_name} (a rollout's log-probs are taken without dropout, the loss's would be with it)")
    data, val = resolve_data(cfg.data.path, PROMPT_FILES, cfg.data.val_path)
    base = read_meta(cfg.init)
    check_init_architecture(base, stage_name, ("lm", "lm+value"))
    model_cfg = ModelConfig(**base["model_config"])
    tok = checkpoint_tokenizer(base)
    check_trained_format(base.get("template_version"), format_for(tok), str(Path(base["path"]) / "meta.json"))
    check = verify_jsonl_data(data, val, cfg.data.verify, kind="prompt")
    for held_out in (val, PROMPT_FILES.sealed_of(data)):
        if held_out.is_file():  # the sealed test file too, which no stage reads but none may train on
            check_held_out(data, held_out, sealed=held_out != val)
    held_out_note = check_train_jsonl(data, read_prompts(data))
    print_rank0(check.report("prompt files"))
    print_rank0(held_out_note)
    longest = cfg.data.max_prompt_length + cfg.rollout.max_completion_length
    if longest > model_cfg.max_seq_len:
        raise SproutError(f"data.max_prompt_length {cfg.data.max_prompt_length} + rollout.max_completion_length "
                          f"{cfg.rollout.max_completion_length} exceeds max_seq_len {model_cfg.max_seq_len} of "
                          f"{base['path']}")
    require(not cfg.batch.micro_batch_tokens or cfg.batch.micro_batch_tokens >= longest, "batch.micro_batch_tokens",
            cfg.batch.micro_batch_tokens, f"0 or at least data.max_prompt_length + rollout.max_completion_length = "
            f"{longest} (the longest prompt and completion must fit a micro-batch)")
    resume_path = resolve_resume(resume, cfg.out)
    acc = start_run(cfg.train, cfg.out)
    check_engine(cfg.rollout.engine, acc.num_processes)
    rank, world = acc.process_index, acc.num_processes
    loader = PromptLoader(data, tok, cfg.data.max_prompt_length, cfg.batch.global_prompts, seed=cfg.train.seed,
                          rank=rank, world_size=world, sources=cfg.data.sources)
    val_loader = PromptLoader(val, tok, cfg.data.max_prompt_length, world, rank=rank, world_size=world,
                              shuffle=False, limit=cfg.data.eval_prompts, sources=cfg.data.sources)
    if val_loader.num_prompts == 0:
        raise SproutError(f"{val}: no held-out prompts to evaluate ({val_loader.read:,} read){val_loader.left_out()}")
    if loader.batches_per_epoch == 0:
        raise SproutError(f"{data}: {loader.num_prompts} prompts (of {loader.read}) cannot fill one global batch "
                          f"of {cfg.batch.global_prompts} (batch.global_prompts){loader.left_out()}")
    rollout_micro_steps(loader.per_rank, cfg.batch, mini_batches)
    cfg = with_epochs(cfg, loader.batches_per_epoch, num_iterations)
    for path, ld in ((data, loader), (val, val_loader)):
        others = f", {ld.other_sources:,} of other sources left out" if cfg.data.sources is not None else ""
        acc.print(f"{stage_name}: {path}: {ld.num_prompts:,} of {ld.read:,} prompts fit {cfg.data.max_prompt_length} "
                  f"tokens ({ld.dropped:,} dropped as too long{others})")
    acc.print(f"{stage_name}: {loader.batches_per_epoch} generation batches per epoch; init {base['path']} "
              f"(step {base.get('step')})")
    return RLRun(cfg, base, model_cfg, tok, acc, loader, val_loader, resume_path)
