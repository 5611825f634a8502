"""A multi-turn chat with a checkpoint: history -> chat template -> KV-cache sampling -> reply.

`ChatSession` renders the whole history with `sprout.chat.render(..., add_generation_prompt=True)`
(the template the SFT data was made with) for every user message, samples the answer with
`sprout.model.generate.generate` until a stop token (`default_stop_ids`: the end-of-turn id,
plus single-id role headers; with plain-text markers a reply is cut at the first marker text)
and appends it. Invariants: when the history leaves no room for an answer the oldest
exchanges are dropped (the system message stays); a message that does not fit alone, or that
the template refuses, raises `ChatError` and leaves the history as it was; an empty answer is
returned but not kept. `load_chat_model` opens a checkpoint with the tokenizer copy in its run
folder (checked by sha256: `sprout.checkpoint.checkpoint_tokenizer`) and checks that it was
fine-tuned with the chat format that tokenizer renders (`sprout.chat_formats.format_for`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sprout.chat import ChatError, render
from sprout.chat_formats import check_trained_format, format_for
from sprout.checkpoint import checkpoint_tokenizer
from sprout.errors import SproutError
from sprout.model.generate import default_stop_ids, generate
from sprout.model.load import load_model


@dataclass
class Reply:
    text: str          # the answer, without the end-of-turn token
    tokens: list[int]  # the sampled ids, stop token included
    finished: bool     # False when max_new_tokens or the context ran out before end-of-turn


def load_chat_model(path, device="cpu", tokenizer: str | None = None):
    """(model, tokenizer, meta) of a checkpoint; `tokenizer` (a spec) overrides the one in its meta."""
    model, meta = load_model(path, device)
    if meta["architecture"] == "reward":
        raise SproutError(f"{meta['path']}/meta.json: a reward model scores text; it has no LM head to chat with")
    tok = checkpoint_tokenizer(meta, tokenizer)
    check_trained_format(meta.get("template_version"), format_for(tok), f"{meta['path']}/meta.json")
    if tok.vocab_size > model.config.vocab_size:
        raise SproutError(f"{tok.spec}: vocab {tok.vocab_size} does not fit the model's {model.config.vocab_size}")
    return model, tok, meta


class ChatSession:
    """Conversation state plus sampling settings; `send(text)` returns the model's `Reply`."""

    def __init__(self, model, tok, *, system: str | None = None, max_new_tokens: int = 256,
                 temperature: float = 0.7, top_k: int | None = None, top_p: float | None = None,
                 seed: int | None = None):
        self.model, self.tok = model, tok
        self.system = system
        self.max_new_tokens, self.temperature, self.top_k, self.top_p = max_new_tokens, temperature, top_k, top_p
        device = next(model.parameters()).device
        self.generator = torch.Generator(device).manual_seed(seed) if seed is not None else None
        self.stop_ids = default_stop_ids(tok)
        self.messages: list[dict] = []
        if system is not None:
            self.messages.append({"role": "system", "content": system})
            render(self.messages + [{"role": "user", "content": "x"}], tok, add_generation_prompt=True)  # check it now

    def reset(self) -> None:
        self.messages = self.messages[:1] if self.system is not None else []

    def _prompt(self, messages: list[dict]) -> list[int]:
        """Rendered history ending with the assistant header; drops the oldest exchanges to fit."""
        context = self.model.config.max_seq_len
        first = 1 if self.system is not None else 0
        while True:
            ids, _ = render(messages, self.tok, add_generation_prompt=True)
            if len(ids) < context:
                return ids
            if len(messages) - first <= 1:
                raise ChatError(f"message too long: the prompt is {len(ids)} tokens and the context "
                                f"is {context}", "prompt_too_long")
            messages = messages[:first] + messages[first + 2:]

    def send(self, text: str) -> Reply:
        """Add a user message, sample the answer, keep both in the history (unless refused or empty)."""
        messages = self.messages + [{"role": "user", "content": text}]
        prompt = self._prompt(messages)  # raises ChatError, history untouched
        gen = generate(self.model, [prompt], self.max_new_tokens, temperature=self.temperature, top_k=self.top_k,
                       top_p=self.top_p, stop_ids=self.stop_ids, generator=self.generator,
                       vocab_size=self.tok.vocab_size)  # never sample a padded model vocab's extra ids
        tokens, finished = gen.tokens[0], gen.finished[0]
        answer = self.tok.decode(tokens[:-1] if finished else tokens)
        reserved = format_for(self.tok).reserved
        cut = min((i for i in (answer.find(m) for m in reserved) if i >= 0), default=len(answer))
        answer = answer[:cut].strip()
        if answer:
            self.messages = messages + [{"role": "assistant", "content": answer}]
        return Reply(answer, tokens, finished)
