"""Batched sampling with the KV cache, for chat, evaluation and the RL stages' rollouts.

Prompts of different lengths are left-padded into one batch: the padding gets segment
id 0 and each prompt segment 1, and rotary positions count only real tokens, so every
row computes exactly what it would alone (see `sprout.model.transformer.KVCache`). One prefill
forward fills the cache; then each step feeds one token per row.

Sampling follows the usual order (as in Hugging Face `generate`): divide the logits by
the temperature, keep the top-k, then keep the smallest set of tokens whose probability
reaches top-p (Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration").
Each sampled token's log-prob is taken under that processed distribution, the one the
token was actually drawn from, which is what the RL stages need. temperature = 0 is
greedy decoding: a point mass on the argmax, so its log-probs are 0.

Each row stops at its first token in `stop_ids` (the stop token is returned); the loop
ends when every row has stopped, at `max_new_tokens`, or when the context is full.

Several processes (torch.distributed initialised, world size > 1): under FSDP every forward
is a collective (each rank gathers the others' parameter shards), so no rank may leave the
loop while another still decodes. Each step all-reduces one "this rank is done" flag, and a
rank whose rows have all stopped keeps running one-token forwards whose output is thrown
away (no cache, no sampling, so its tokens and its generator are exactly those of a run
alone) until every rank is done. Each rank's tokens are those of one process given its
prompts. A single process does no collective.

With `train.compile` on, pass generation the uncompiled module (the Trainer's
`generation_model`): a compiled forward recompiles for each new cache length and decode shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from sprout.errors import SproutError
from sprout.model.heads import padding_inputs


@dataclass
class Generation:
    tokens: list[list[int]]  # new tokens per row, the stop token included
    logprobs: list[list[float]]  # log-prob of each under the distribution it was sampled from
    finished: list[bool]  # True where the row ended with a stop token


def process_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                   top_p: float | None = None) -> torch.Tensor:
    """Temperature, then top-k, then top-p on logits [B, V]; removed tokens get -inf.

    top-p keeps, per row, the most probable tokens until their total probability reaches
    top_p (the token that crosses the threshold is kept, so at least one always is).
    """
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # mass of the strictly more probable tokens
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                top_p: float | None = None, generator: torch.Generator | None = None):
    """One token per row from logits [B, V] -> (tokens [B], logprobs [B])."""
    if temperature == 0:
        tokens = logits.argmax(dim=-1)
        return tokens, torch.zeros(tokens.shape, dtype=torch.float32, device=logits.device)
    logp = process_logits(logits, temperature, top_k, top_p).log_softmax(dim=-1)
    tokens = torch.multinomial(logp.exp(), 1, generator=generator)
    return tokens[:, 0], logp.gather(-1, tokens)[:, 0]


def left_pad(prompts: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, segment_ids, position_ids) [B, P]: padding segment 0 at position 0, prompts segment 1."""
    P = max(len(p) for p in prompts)
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    ids = torch.tensor([[0] * (P - len(p)) + list(p) for p in prompts], dtype=torch.long, device=device)
    segments, positions = padding_inputs(torch.arange(P, device=device)[None, :] >= (P - lengths)[:, None])
    return ids, segments, positions


@torch.no_grad()
def generate(model, prompts: list[list[int]], max_new_tokens: int, *, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None, stop_ids=(),
             generator: torch.Generator | None = None, vocab_size: int | None = None) -> Generation:
    """Sample up to max_new_tokens per prompt, all rows in one batch through the KV cache.

    `vocab_size`: the ids the tokenizer can decode; a model whose vocab is padded beyond it
    (e.g. 50,257 → 50,304) never samples the padding ids, and log-probs are over the real ids.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise SproutError("generate: every prompt needs at least one token")
    if temperature < 0 or (top_k is not None and top_k < 1) or (top_p is not None and not 0 < top_p <= 1):
        raise SproutError(f"generate: need temperature >= 0, top_k >= 1, 0 < top_p <= 1 "
                          f"(got {temperature}, {top_k}, {top_p})")
    context = model.config.max_seq_len
    longest = max(len(p) for p in prompts)
    if longest > context:
        raise SproutError(f"generate: a prompt of {longest} tokens is longer than the context ({context})")
    steps = min(max_new_tokens, context - longest)
    device = next(model.parameters()).device
    ids, segments, positions = left_pad(prompts, device)
    B = len(prompts)
    uniform = all(len(p) == longest for p in prompts)  # no padding: plain causal attention
    cache = model.new_cache(B, longest + steps)
    stops = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=device)
    out_tokens = torch.zeros(B, steps, dtype=torch.long, device=device)
    out_logp = torch.zeros(B, steps, dtype=torch.float32, device=device)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    logits = model(ids, segment_ids=None if uniform else segments, position_ids=None if uniform else positions,
                   cache=cache)[:, -1, :vocab_size]
    n, finished = 0, steps == 0
    while True:
        if not finished:
            n += 1
            tok, logp = sample_next(logits, temperature, top_k, top_p, generator)
            out_tokens[:, n - 1], out_logp[:, n - 1] = tok, logp
            done |= torch.isin(tok, stops)
            finished = n == steps or bool(done.all())
        if _every_rank_finished(finished, device):
            break
        if finished:  # another rank still decodes: keep its forwards' collectives company
            model(ids[:1, :1])
        else:
            logits = model(tok[:, None], cache=cache)[:, -1, :vocab_size]
    return _trim(out_tokens[:, :n].cpu(), out_logp[:, :n].cpu(), stops.cpu())


def _every_rank_finished(finished: bool, device) -> bool:
    """`finished` of this process, AND-ed over all processes when there are several (a collective)."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return finished
    flag = torch.tensor([int(finished)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _trim(tokens: torch.Tensor, logp: torch.Tensor, stops: torch.Tensor) -> Generation:
    """Cut each row after its first stop token."""
    is_stop = torch.isin(tokens, stops)
    finished = is_stop.any(dim=1)
    lengths = torch.where(finished, is_stop.int().argmax(dim=1) + 1, tokens.shape[1]).tolist()
    return Generation(
        tokens=[row[:k] for row, k in zip(tokens.tolist(), lengths)],
        logprobs=[row[:k] for row, k in zip(logp.tolist(), lengths)],
        finished=finished.tolist(),
    )
