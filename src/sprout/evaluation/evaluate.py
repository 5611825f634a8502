"""Evaluation of a policy on prompts with gold answers: pass@k, greedy accuracy, format rate.

    ev = evaluate_prompts(model, tok, prompts, n=16, ks=(1, 8), greedy=True, max_new_tokens=256, seed=0)
    ev.metrics["pass@1"], ev.metrics["greedy/accuracy"], ev.by_level["2"]["pass@1"], ev.samples[0]

Each prompt is rendered with the chat template's generation header, sampled n times at
temperature 1 (the policy's own distribution) and, with `greedy`, once greedily; completions
are checked by `sprout.rl.verifiers` (`format_reward`, `correctness_reward`) in two readings:
strict, the last complete `<answer>` block, and flexible, that block or else the text's last
number (`fallback_last_number`); the flexible figures are named `flexible/<figure>` and a
problem record's counts `flexible_correct`, `flexible_greedy_correct`. `summarise` states each
figure's normaliser; each figure in [0, 1] is a mean over problems, each counting once, with a
95 % interval (`figure_intervals`). Batch j samples with a generator seeded from (seed, j):
completions depend on the seed, the prompts and batch_size, never on the number of processes,
and every rank returns what one process would.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch
import torch.distributed as dist

from sprout.answers import parse_answer
from sprout.chat import render
from sprout.errors import SproutError
from sprout.model.decode import DecodeWeightsCache
from sprout.model.generate import check_sampling, generate_tokens, pad_prompts
from sprout.prep.rl_prompts import prompt_key, source_prompt_id
from sprout.evaluation.statistics import mean_interval
from sprout.rl.verifiers import correctness_reward, format_reward

FLEXIBLE = "flexible/"  # the prefix of a figure under the flexible reading


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with `c` correct among `n` samples (Chen et al. 2021):
    1 - C(n - c, k) / C(n, k), computed as 1 - prod_{i = n-c+1}^{n} (1 - k / i)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def mean_pass_at_k(counts: Iterable[tuple[int, int]], k: int) -> float:
    """Mean of `pass_at_k` over problems given as (n, c) pairs; normaliser: the number of problems."""
    values = [pass_at_k(n, c, k) for n, c in counts]
    if not values:
        raise ValueError("mean_pass_at_k needs at least one problem")
    return math.fsum(values) / len(values)


# ---- what one prompt scored ------------------------------------------------------------

@dataclass
class PromptOutcome:
    """The counts of one prompt: its n sampled completions and its greedy one."""

    index: int  # position in the prompt list
    level: int | None
    id: str = ""  # `problem_id` of the prompt record
    source: str | None = None
    correct: int = 0  # sampled completions whose answer matches the gold
    formatted: int = 0  # sampled completions in the reasoning format
    tokens: int = 0  # completion tokens of the sampled completions, stop tokens counted
    truncated: int = 0  # sampled completions without a stop token
    greedy_correct: int = 0
    greedy_formatted: int = 0
    flexible_correct: int = 0  # sampled completions correct under the flexible reading
    flexible_greedy_correct: int = 0


@dataclass
class Evaluation:
    """What `evaluate_prompts` measured: `metrics` (the figures of `summarise`), `by_level` (the
    same over each curriculum level's prompts; a null level is in the totals only), `samples`
    (the first `num_samples` prompts' first sampled and greedy completions, parsed and checked)."""

    metrics: dict[str, float]
    by_level: dict[str, dict[str, float]]
    samples: list[dict]
    outcomes: list[PromptOutcome] = field(repr=False)
    n: int = 0  # sampled completions per prompt
    greedy: bool = False

    def flat(self, prefix: str = "") -> dict[str, float]:
        """The totals and `level_<L>/<name>` per level in one dict, each key prefixed."""
        out = {f"{prefix}{k}": v for k, v in self.metrics.items()}
        for level, figures in self.by_level.items():
            out.update({f"{prefix}level_{level}/{k}": v for k, v in figures.items() if k != "prompts"})
        return out

    def problems(self) -> list[dict]:
        """One record per prompt, in prompt order (`problem_record`)."""
        return [problem_record(o, self.n, self.greedy) for o in self.outcomes]

    def intervals(self) -> tuple[dict[str, list[float]], dict[str, dict[str, list[float]]]]:
        """(`figure_intervals` over all prompts, {level: the same over its prompts})."""
        problems = self.problems()
        by_level = {level: figure_intervals([p for p in problems if str(p["level"]) == level], figures)
                    for level, figures in self.by_level.items()}
        return figure_intervals(problems, self.metrics), by_level


def problem_id(record: dict) -> str:
    """The id a problem is paired by: the record's `id`, else the one the prompt prep would
    give it (`source_prompt_id` of its source, or "prompt", and its `prompt_key`)."""
    return record.get("id") or source_prompt_id(record.get("source") or "prompt", prompt_key(record["prompt"]))


def problem_record(o: PromptOutcome, n: int, greedy: bool) -> dict:
    """What one prompt scored, as kept in evaluate.py's JSON: id, source, level, n, and the
    sampled (when n > 0) and greedy (with greedy) completions correct and formatted, and
    correct under the flexible reading (`flexible_correct`, `flexible_greedy_correct`)."""
    record = {"id": o.id, "source": o.source, "level": o.level, "n": n}
    if n:
        record.update(correct=o.correct, formatted=o.formatted, flexible_correct=o.flexible_correct)
    if greedy:
        record.update(greedy_correct=o.greedy_correct, greedy_formatted=o.greedy_formatted,
                      flexible_greedy_correct=o.flexible_greedy_correct)
    return record


def problem_scores(problems: Sequence[dict], figure: str) -> list[float] | None:
    """Each problem's score in [0, 1] whose mean over `problems` (`problem_record`s) is
    `figure`: pass@k of pass_at_k(n, correct, k), greedy/accuracy of greedy_correct,
    greedy/format_rate of greedy_formatted, format/rate of formatted / n, and the flexible
    pass@k and greedy/accuracy the same of flexible_correct and flexible_greedy_correct; None for a
    figure that is no such mean (completion length) or that the records cannot give (greedy
    figures without greedy answers, pass@k above n)."""
    reading = ""
    if figure.startswith(FLEXIBLE):
        reading, figure = "flexible_", figure[len(FLEXIBLE):]
        if not figure.startswith("pass@") and figure != "greedy/accuracy":
            return None
    if figure.startswith("pass@") and figure[5:].isdigit():
        k, key = int(figure[5:]), reading + "correct"
        if all(key in p and p["n"] >= k for p in problems):
            return [pass_at_k(p["n"], p[key], k) for p in problems]
    elif figure in ("greedy/accuracy", "greedy/format_rate"):
        key = reading + ("greedy_correct" if figure == "greedy/accuracy" else "greedy_formatted")
        if all(key in p for p in problems):
            return [float(p[key]) for p in problems]
    elif figure == "format/rate" and all("formatted" in p and p["n"] for p in problems):
        return [p["formatted"] / p["n"] for p in problems]
    return None


def figure_intervals(problems: Sequence[dict], figures: Iterable[str]) -> dict[str, list[float]]:
    """{`<figure>_ci`: [lo, hi]}, the 95 % interval of each of `figures` that `problem_scores`
    gives per problem (`sprout.evaluation.statistics.mean_interval`: Wilson when every score is
    0 or 1, else a percentile bootstrap over problems, 10,000 resamples, seed 0)."""
    out = {}
    for name in figures:
        scores = problem_scores(problems, name) if problems else None
        if scores is not None:
            out[f"{name}_ci"] = list(mean_interval(scores))
    return out


def summarise(outcomes: Sequence[PromptOutcome], n: int, ks: Sequence[int], greedy: bool) -> dict[str, float]:
    """The figures over `outcomes` (P prompts, n samples each), plus `prompts`:

        pass@k                    mean over the P prompts of pass_at_k(n, c, k)
        greedy/accuracy           greedy completions correct / P
        greedy/format_rate        greedy completions in the format / P
        format/rate               sampled completions in the format / (P × n)
        completions/mean_length   sampled completion tokens (the stop token counted) / (P × n)
        completions/clipped_ratio sampled completions cut by max_new_tokens or the context,
                                  without a stop token / (P × n)
        flexible/pass@k           mean over the P prompts of pass_at_k(n, flexible c, k)
        flexible/greedy/accuracy  greedy completions correct under the flexible reading / P

    The format rates are one figure each: they judge the format, not the answer.
    """
    P = len(outcomes)
    out: dict[str, float] = {"prompts": P}
    if n:
        for k in ks:
            out[f"pass@{k}"] = mean_pass_at_k(((n, o.correct) for o in outcomes), k)
    if greedy:
        out["greedy/accuracy"] = sum(o.greedy_correct for o in outcomes) / P
        out["greedy/format_rate"] = sum(o.greedy_formatted for o in outcomes) / P
    if n:
        out["format/rate"] = sum(o.formatted for o in outcomes) / (P * n)
        out["completions/mean_length"] = sum(o.tokens for o in outcomes) / (P * n)
        out["completions/clipped_ratio"] = sum(o.truncated for o in outcomes) / (P * n)
        for k in ks:
            out[f"{FLEXIBLE}pass@{k}"] = mean_pass_at_k(((n, o.flexible_correct) for o in outcomes), k)
    if greedy:
        out[f"{FLEXIBLE}greedy/accuracy"] = sum(o.flexible_greedy_correct for o in outcomes) / P
    return out


# ---- generation ---------------------------------------------------------------------------

def batch_seed(seed: int, batch: int) -> int:
    """The generator seed of batch `batch` under `seed` (63 bits of a hash of both)."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{batch}".encode()).digest()[:8], "little") >> 1


def completion_texts(rollout, tokenizer) -> list[str]:
    """Each row's completion decoded, its stop token left out."""
    texts = []
    for row, length, eos in zip(rollout.completion_ids.tolist(), rollout.lengths.tolist(), rollout.eos.tolist()):
        texts.append(tokenizer.decode(row[:length - 1] if eos else row[:length]))
    return texts


def _rank_and_world(accelerator) -> tuple[int, int]:
    if accelerator is not None:
        return accelerator.process_index, accelerator.num_processes
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _last_user(prompt: list) -> str:
    return next(m["content"] for m in reversed(prompt) if m["role"] == "user")


@torch.no_grad()
def evaluate_prompts(model, tokenizer, prompts: Sequence[dict], *, n: int = 16, ks: Sequence[int] = (1,),
                     greedy: bool = False, max_new_tokens: int = 256, seed: int = 0, batch_size: int = 8,
                     temperature: float = 1.0, accelerator=None, num_samples: int = 4,
                     cuda_graph: bool | str = "auto") -> Evaluation:
    """Sample and verify completions of `prompts` (records with `prompt`, `gold`, `level`,
    optional `id`). `n` may be 0 when `greedy` is on (greedy only). `batch_size` prompts per
    `generate_tokens` call (batch_size × n rows). Under torch.distributed batch j goes to rank
    j mod world_size and one `all_gather_object` gives every rank all counts, in prompt order.
    Every rank makes the same number of `generate_tokens` calls (a rank without a batch
    generates one token for a repeated prompt, counted nothing): under FSDP each forward is a
    collective. The model is used as given; a DDP wrapper is looked through to its module. Its
    parameters do not change during the call: the calls share one set of fused weight copies where
    their rows and kinds agree (`sprout.model.decode.DecodeWeightsCache`), freed on return.
    `cuda_graph`: `generate_tokens`'s (the decode step as a CUDA graph; "auto": on CUDA, one process)."""
    ks = sorted(set(int(k) for k in ks)) if n else []
    if n < 0 or (n == 0 and not greedy):
        raise SproutError(f"evaluate: n must be >= 1 (or 0 with greedy), got {n}")
    if any(not 1 <= k <= n for k in ks):
        raise SproutError(f"evaluate: every k must be in [1, n={n}], got {ks}")
    if batch_size < 1 or max_new_tokens < 1:
        raise SproutError(f"evaluate: batch_size and max_new_tokens must be >= 1, got {batch_size}, {max_new_tokens}")
    if n:
        check_sampling(temperature, names=("evaluate: temperature", "evaluate: top_k", "evaluate: top_p"))
    if not prompts:
        raise SproutError("evaluate: no prompts")
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model = model.module
    context = model.config.max_seq_len
    rendered = []
    for i, record in enumerate(prompts):
        ids = render(record["prompt"], tokenizer, add_generation_prompt=True)[0]
        if len(ids) >= context:
            raise SproutError(f"prompt {record.get('id', i)}: {len(ids)} tokens leave no room in the model's "
                              f"context of {context}")
        rendered.append(ids)
    device = next(model.parameters()).device
    rank, world = _rank_and_world(accelerator)
    batches = [range(s, min(s + batch_size, len(prompts))) for s in range(0, len(prompts), batch_size)]
    outcomes: list[PromptOutcome] = []
    shown: list[dict] = []
    was_training = model.training
    model.eval()
    weight_cache = DecodeWeightsCache()  # freed on return
    try:
        for r in range(-(-len(batches) // world)):
            j = r * world + rank
            if j >= len(batches):  # keep the other ranks' collectives company, count nothing
                ids, mask = pad_prompts(rendered[:1], device)
                if n:
                    generate_tokens(model, ids, mask, max_new_tokens=1, greedy=True, tokenizer=tokenizer,
                                    cuda_graph=cuda_graph, weight_cache=weight_cache)
                if greedy:
                    generate_tokens(model, ids, mask, max_new_tokens=1, greedy=True, tokenizer=tokenizer,
                                    cuda_graph=cuda_graph, weight_cache=weight_cache)
                continue
            batch = batches[j]
            ids, mask = pad_prompts([rendered[i] for i in batch], device)
            golds = [prompts[i]["gold"] for i in batch]
            here = [PromptOutcome(i, prompts[i].get("level"), id=problem_id(prompts[i]),
                                  source=prompts[i].get("source")) for i in batch]
            texts: list[list[str]] = [[] for _ in batch]
            if n:
                gen = torch.Generator(device=device).manual_seed(batch_seed(seed, j))
                out = generate_tokens(model, ids, mask, max_new_tokens=max_new_tokens, num_generations=n,
                                      temperature=temperature, tokenizer=tokenizer, generator=gen,
                                      cuda_graph=cuda_graph, weight_cache=weight_cache)
                flat = completion_texts(out, tokenizer)
                repeated = [g for g in golds for _ in range(n)]
                correct = correctness_reward(flat, repeated)
                flexible = correctness_reward(flat, repeated, fallback_last_number=True)
                formatted = format_reward(flat)
                lengths, truncated = out.lengths.tolist(), out.truncated.tolist()
                for b, o in enumerate(here):
                    rows = range(b * n, (b + 1) * n)
                    o.correct = sum(correct[i] == 1.0 for i in rows)
                    o.flexible_correct = sum(flexible[i] == 1.0 for i in rows)
                    o.formatted = sum(formatted[i] == 1.0 for i in rows)
                    o.tokens = sum(lengths[i] for i in rows)
                    o.truncated = sum(bool(truncated[i]) for i in rows)
                    texts[b].append(flat[b * n])
            if greedy:
                out = generate_tokens(model, ids, mask, max_new_tokens=max_new_tokens, greedy=True, tokenizer=tokenizer,
                                      cuda_graph=cuda_graph, weight_cache=weight_cache)
                flat = completion_texts(out, tokenizer)
                correct, formatted = correctness_reward(flat, golds), format_reward(flat)
                flexible = correctness_reward(flat, golds, fallback_last_number=True)
                for b, o in enumerate(here):
                    o.greedy_correct, o.greedy_formatted = int(correct[b] == 1.0), int(formatted[b] == 1.0)
                    o.flexible_greedy_correct = int(flexible[b] == 1.0)
                    texts[b].append(flat[b])
            outcomes += here
            for b, i in enumerate(batch):
                if i < num_samples:
                    shown.append(_sample(prompts[i], i, texts[b], here[b], n, greedy))
    finally:
        model.train(was_training)
    if world > 1:
        gathered: list = [None] * world
        dist.all_gather_object(gathered, (outcomes, shown))
        outcomes = [o for part, _ in gathered for o in part]
        shown = [s for _, part in gathered for s in part]
    outcomes.sort(key=lambda o: o.index)
    shown.sort(key=lambda s: s["index"])
    levels = sorted({o.level for o in outcomes if o.level is not None})
    by_level = {str(L): summarise([o for o in outcomes if o.level == L], n, ks, greedy) for L in levels}
    return Evaluation(summarise(outcomes, n, ks, greedy), by_level, shown, outcomes, n=n, greedy=greedy)


def _sample(record: dict, index: int, texts: list[str], o: PromptOutcome, n: int, greedy: bool) -> dict:
    """One shown answer: the prompt's question, gold, first sampled and greedy completions, each
    with its answer in both readings."""
    s = {"index": index, "id": record.get("id"), "level": record.get("level"),
         "prompt": _last_user(record["prompt"]), "gold": record["gold"]}
    if n:
        s.update(completion=texts[0], answer=parse_answer(texts[0]), correct=bool(
            correctness_reward([texts[0]], [record["gold"]])[0] == 1.0), correct_of_n=f"{o.correct}/{n}",
            flexible_answer=parse_answer(texts[0], fallback_last_number=True),
            flexible_correct_of_n=f"{o.flexible_correct}/{n}")
    if greedy:
        s.update(greedy_completion=texts[-1], greedy_answer=parse_answer(texts[-1]), greedy_correct=bool(o.greedy_correct),
                 flexible_greedy_answer=parse_answer(texts[-1], fallback_last_number=True),
                 flexible_greedy_correct=bool(o.flexible_greedy_correct))
    return s
