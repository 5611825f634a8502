"""Batched sampling with the KV cache: the RL stages' rollouts, chat and evaluation.

    rollout = generate_tokens(model, input_ids, attention_mask, max_new_tokens=256,
                              num_generations=8, tokenizer=tok, generator=g)

`generate_tokens` takes prompts [B, P] with a mask (padding on either side) and returns a
`Rollout`: completions [B*G, L] right-padded with their mask, each token's log-prob, `eos`,
`truncated` and lengths; prompt i's G samples are rows i*G .. i*G+G-1. A padded row computes
exactly what it would alone. Each log-prob is under the distribution its token was drawn from
(temperature, top-k, top-p, in transformers' order): at temperature 1 without top-k/top-p the
policy's own, as the RL losses need; greedy gives 0. A row stops at its first stop id (kept);
steps are cut to fit the context, with a one-line warning. Under torch.distributed every rank
runs forwards until all are done (an FSDP forward is a collective) and computes what one
process computes on its prompts, to float rounding. `generate` is the list form for chat.
"""

from __future__ import annotations

import numbers
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from sprout.chat import template_for
from sprout.errors import SproutError
from sprout.model.decode import DecodeWeightsCache, fusable, make_decoder
from sprout.model.heads import padding_inputs
from sprout.model.static_decode import StaticDecoder
from sprout.ranges import is_finite_number

AUTO_COMPILE_TOKENS = 8192  # compile="auto": compile when rows × steps reaches this
STOP_CHECK_EVERY = {"cpu": 1}  # device type -> decode steps between reads of "every row stopped"
STOP_CHECK_DEFAULT = 8  # devices not listed above
SAMPLING_NAMES = ("generate: temperature", "generate: top_k", "generate: top_p")  # `check_sampling`'s default names


@dataclass
class Rollout:
    """What `generate_tokens` sampled; N = B × num_generations rows, prompt i's samples adjacent."""

    prompt_ids: torch.Tensor  # [N, P] long, left-padded (each prompt repeated G times)
    prompt_mask: torch.Tensor  # [N, P] long, 1 = real token
    completion_ids: torch.Tensor  # [N, L] long, right-padded with pad_id; the stop token included
    completion_mask: torch.Tensor  # [N, L] long, 1 = sampled token
    logprobs: torch.Tensor  # [N, L] float32, log-prob of each token under its sampling distribution; 0 on padding
    eos: torch.Tensor  # [N] bool, the row ended with a stop id
    truncated: torch.Tensor  # [N] bool, the row hit max_new_tokens or the context without a stop id
    lengths: torch.Tensor  # [N] long, completion tokens (completion_mask.sum(1))


@dataclass
class Generation:
    tokens: list[list[int]]  # new tokens per row, the stop token included
    logprobs: list[list[float]]  # log-prob of each under the distribution it was sampled from
    finished: list[bool]  # True where the row ended with a stop token


def default_stop_ids(tok) -> set[int]:
    """The stop ids of a model trained with `tok`: the chat template's end-of-turn id (sprout's is
    also the document separator of pretraining), plus the first id of each role header when the
    headers start with special tokens (SentencePiece's role ids, chatml's `<|im_start|>`), in
    case a model opens a new turn without closing its own."""
    tpl = template_for(tok)
    return {tpl.eot_id} | ({h[0] for h in tpl.headers.values()} if tpl.kind == "special" else set())


def check_sampling(temperature: float, top_k: int | None = None, top_p: float | None = None,
                   names: tuple[str, str, str] = SAMPLING_NAMES) -> None:
    """SproutError, in one line naming the setting (`names`: how the caller calls temperature,
    top_k and top_p, e.g. a script's options), unless the three define a distribution:
    temperature a finite number >= 0 (0: greedy), top_k None or an integer >= 1, top_p None or
    a number in (0, 1]. Each bound is written as what must hold, so NaN, which fails every
    comparison, is refused as well (sampling from NaN logits would index past the vocabulary)."""
    t_name, k_name, p_name = names
    if not (is_finite_number(temperature) and temperature >= 0):
        raise SproutError(f"{t_name}: got {temperature!r}; expected a finite number >= 0 (0: greedy)")
    if top_k is not None and not (isinstance(top_k, numbers.Integral) and not isinstance(top_k, bool) and top_k >= 1):
        raise SproutError(f"{k_name}: got {top_k!r}; expected an integer >= 1 (or none: all tokens)")
    if top_p is not None and not (is_finite_number(top_p) and 0 < top_p <= 1):
        raise SproutError(f"{p_name}: got {top_p!r}; expected a number in (0, 1] (or none: all tokens)")


def process_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                   top_p: float | None = None) -> torch.Tensor:
    """Temperature, then top-k, then top-p on logits [B, V]; removed tokens get -inf.

    top-p keeps, per row, the most probable tokens until their total probability reaches
    top_p (the token that crosses the threshold is kept, so at least one always is).
    """
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
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
    """One token per row from logits [B, V] -> (tokens [B], logprobs [B]); temperature 0 = argmax."""
    if temperature == 0:
        tokens = logits.argmax(dim=-1)
        return tokens, torch.zeros(tokens.shape, dtype=torch.float32, device=logits.device)
    logp = process_logits(logits, temperature, top_k, top_p).log_softmax(dim=-1)
    tokens = inverse_cdf_sample(logp, generator)
    return tokens, logp.gather(-1, tokens[:, None])[:, 0]


def inverse_cdf_sample(logp: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One index per row [B] drawn from the distribution exp(logp) [B, V] (the same distribution as
    `torch.multinomial(logp.exp(), 1)`): the first index whose cumulative probability exceeds
    u × total for one uniform u per row. One random number per row instead of multinomial's V
    (its exponential race), the cumulative sum in float64 so rounding favours no token; a
    token of probability 0 is never drawn (its cumulative value equals its predecessor's)."""
    cdf = logp.exp().double().cumsum(dim=-1)
    total = cdf[:, -1:]
    u = torch.rand(total.shape, generator=generator, dtype=torch.float64, device=logp.device) * total
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))  # u < total even after rounding
    return torch.searchsorted(cdf, u, right=True)[:, 0]


def pad_prompts(prompts: list[list[int]], device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) [B, P]: the prompts left-padded with id 0, mask 1 on real tokens."""
    P = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (P - len(p)) + list(p) for p in prompts], dtype=torch.long, device=device)
    mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long, device=device)
    return ids, mask


def left_pad(prompts: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, segment_ids, position_ids) [B, P]: padding segment 0 at position 0, prompts segment 1."""
    ids, mask = pad_prompts(prompts, device)
    segments, positions = padding_inputs(mask)
    return ids, segments, positions


_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=4)  # the caller of generate_tokens (past no_grad)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


@torch.no_grad()
def generate_tokens(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                    max_new_tokens: int, num_generations: int = 1, temperature: float = 1.0,
                    top_k: int | None = None, top_p: float | None = None, greedy: bool = False,
                    stop_ids=None, tokenizer=None, generator: torch.Generator | None = None,
                    vocab_size: int | None = None, pad_id: int = 0, compile: bool | str = False,
                    cuda_graph: bool | str = "auto", weight_cache: DecodeWeightsCache | None = None) -> Rollout:
    """Sample `num_generations` completions of up to `max_new_tokens` per prompt (see the module doc).

    `tokenizer`: the model's tokenizer; gives the defaults `stop_ids = default_stop_ids(tok)` and
    `vocab_size = tok.vocab_size`. `stop_ids` (None = those defaults, or none without a tokenizer).
    `vocab_size`: the ids the tokenizer can decode; a model whose vocab is padded beyond it
    (e.g. 50,257 -> 50,304) never samples the padding ids, and log-probs are over the real ids.
    `compile`: True (the decode step under torch.compile), False, or "auto" (compile when rows ×
    steps reaches `AUTO_COMPILE_TOKENS`); ignored under torch.distributed. Sampling stays eager.
    `cuda_graph`: True (the decode step on buffers of fixed shape, `sprout.model.static_decode`,
    replayed as a CUDA graph on CUDA and run eagerly elsewhere), False, or "auto" (True on CUDA);
    with `compile`, the graph holds the compiled step. Under torch.distributed the step stays the
    module's forward (`ModelDecoder`: an FSDP forward gathers sharded parameters, a collective
    that a graph of one process's kernels cannot hold), as it does for a model that is not `fusable`.
    `weight_cache`: the fused weight copies come from it (`sprout.model.decode.DecodeWeightsCache`,
    reused while they fit this call's rows and kinds) instead of being built for this call alone;
    the caller vouches that the parameters have not changed since it filled them.
    """
    if input_ids.dim() != 2 or input_ids.shape[0] == 0:
        raise SproutError(f"generate: input_ids must be [batch, length] with batch >= 1, got {tuple(input_ids.shape)}")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if attention_mask.shape != input_ids.shape:
        raise SproutError(f"generate: attention_mask {tuple(attention_mask.shape)} does not match "
                          f"input_ids {tuple(input_ids.shape)}")
    check_sampling(temperature, top_k, top_p)
    if num_generations < 1 or max_new_tokens < 0:
        raise SproutError(f"generate: need num_generations >= 1 and max_new_tokens >= 0 "
                          f"(got {num_generations}, {max_new_tokens})")
    for name, value in (("compile", compile), ("cuda_graph", cuda_graph)):
        if not any(value is choice for choice in (True, False)) and value != "auto":
            raise SproutError(f"generate: {name} must be True, False or 'auto', got {value!r}")
    mask = attention_mask.long()
    lengths = mask.sum(dim=1)
    if bool((lengths == 0).any()):
        raise SproutError("generate: every prompt needs at least one token")
    context = model.config.max_seq_len
    longest = int(lengths.max())
    if longest > context:
        raise SproutError(f"generate: a prompt of {longest} tokens is longer than the context ({context})")
    steps = min(max_new_tokens, context - longest)
    if steps < max_new_tokens:
        _warn_once("context", f"generate: prompts of up to {longest} tokens + max_new_tokens {max_new_tokens} exceed "
                              f"the context of {context}; rows stop after {steps} new tokens, marked truncated")

    # Left-align (a stable sort of the mask puts each row's padding first), drop all-padding columns.
    order = torch.sort(mask, dim=1, stable=True).indices[:, -longest:]
    ids, mask = input_ids.gather(1, order), mask.gather(1, order)
    if tokenizer is not None:
        stop_ids = default_stop_ids(tokenizer) if stop_ids is None else stop_ids
        vocab_size = tokenizer.vocab_size if vocab_size is None else vocab_size
    device = next(model.parameters()).device
    ids, mask = ids.to(device), mask.to(device)
    stops = torch.tensor(sorted(set(stop_ids or ())), dtype=torch.long, device=device)
    temperature = 0.0 if greedy else temperature
    rows = ids.shape[0] * num_generations
    use_compile = (compile is True or (compile == "auto" and rows * steps >= AUTO_COMPILE_TOKENS)) \
        and not _distributed()
    static = static_decode_wanted(cuda_graph, device)

    tokens, logp, n = _sample_loop(model, ids, mask, num_generations, steps, stops, vocab_size, use_compile, static,
                                   lambda logits: sample_next(logits, temperature, top_k, top_p, generator),
                                   weight_cache)
    if num_generations > 1:
        ids, mask = ids.repeat_interleave(num_generations, 0), mask.repeat_interleave(num_generations, 0)
    is_stop = torch.isin(tokens, stops)
    eos = is_stop.any(dim=1)
    out_lengths = torch.where(eos, is_stop.int().argmax(dim=1) + 1, n)
    if bool(eos.all()):  # steps run after the last row stopped (see STOP_CHECK_EVERY) are cut
        n = int(out_lengths.max())
        tokens, logp = tokens[:, :n], logp[:, :n]
    completion_mask = (torch.arange(n, device=device)[None, :] < out_lengths[:, None]).long()
    return Rollout(
        prompt_ids=ids.masked_fill(mask == 0, pad_id), prompt_mask=mask,
        completion_ids=tokens.masked_fill(completion_mask == 0, pad_id), completion_mask=completion_mask,
        logprobs=logp.masked_fill(completion_mask == 0, 0.0), eos=eos, truncated=~eos, lengths=out_lengths,
    )


def static_decode_wanted(cuda_graph: bool | str, device: torch.device) -> bool:
    """Whether `generate_tokens(cuda_graph=...)` decodes with a `StaticDecoder` on `device`: when True,
    or "auto" on CUDA; never under torch.distributed (see `generate_tokens`)."""
    return (cuda_graph is True or (cuda_graph == "auto" and device.type == "cuda")) and not _distributed()


def _sample_loop(model, ids, mask, G: int, steps: int, stops, vocab_size, use_compile: bool, static: bool, sample,
                 weight_cache: DecodeWeightsCache | None = None):
    """(tokens [N, n], logprobs [N, n], n): the decode loop over N = B × G rows (prompts ids [B, P],
    each prefilled once and its cache shared by its G rows), every row running all n steps (a
    finished row's tokens are dropped afterwards). `static`: a `StaticDecoder` where `fusable`;
    `weight_cache`: where a fused decoder takes its weights."""
    (B, P), device = ids.shape, ids.device
    N = B * G
    out_tokens = torch.zeros(N, steps, dtype=torch.long, device=device)
    out_logp = torch.zeros(N, steps, dtype=torch.float32, device=device)
    if static and fusable(model):
        decoder = StaticDecoder(model, N, P + steps, graph=True, compile=use_compile, weight_cache=weight_cache)
    else:
        decoder = make_decoder(model, N, P + steps, compile=use_compile, fused=not _distributed(),
                               weight_cache=weight_cache)
    logits = decoder.prefill(ids, mask, repeats=G)
    done = torch.zeros(N, dtype=torch.bool, device=device)
    check_every = 1 if _distributed() else STOP_CHECK_EVERY.get(device.type, STOP_CHECK_DEFAULT)
    n, finished = 0, steps == 0
    while True:
        if not finished:
            n += 1
            tok, logp = sample(logits[:, :vocab_size])
            out_tokens[:, n - 1], out_logp[:, n - 1] = tok, logp
            if len(stops):
                done |= torch.isin(tok, stops)
            finished = n == steps or (len(stops) > 0 and n % check_every == 0 and bool(done.all()))
        if _every_rank_finished(finished, device):
            break
        if finished:  # another rank still decodes: keep its forwards' collectives company
            model(ids[:1, :1])
        else:
            logits = decoder.step(tok)
    return out_tokens[:, :n], out_logp[:, :n], n


@torch.no_grad()
def generate(model, prompts: list[list[int]], max_new_tokens: int, *, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None, stop_ids=(),
             generator: torch.Generator | None = None, vocab_size: int | None = None,
             compile: bool | str = False, cuda_graph: bool | str = "auto") -> Generation:
    """`generate_tokens` on lists: one sample per prompt, each row's tokens cut after its stop token."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise SproutError("generate: every prompt needs at least one token")
    device = next(model.parameters()).device
    ids, mask = pad_prompts(prompts, device)
    out = generate_tokens(model, ids, mask, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                          top_p=top_p, stop_ids=stop_ids, generator=generator, vocab_size=vocab_size,
                          compile=compile, cuda_graph=cuda_graph)
    lengths = out.lengths.tolist()
    return Generation(
        tokens=[row[:k] for row, k in zip(out.completion_ids.tolist(), lengths)],
        logprobs=[row[:k] for row, k in zip(out.logprobs.tolist(), lengths)],
        finished=out.eos.tolist(),
    )


def _every_rank_finished(finished: bool, device) -> bool:
    """`finished` of this process, AND-ed over all processes when there are several (a collective)."""
    if not _distributed():
        return finished
    flag = torch.tensor([int(finished)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())
