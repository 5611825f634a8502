"""The transformer with a scalar head: a reward model (score head) and a policy with a value head.

Both subclass `sprout.model.transformer.Transformer`, so the backbone's parameter names stay and
an LM checkpoint loads into the backbone as it is; the head, `Linear(d_model, 1, bias=False)`
initialised N(0, init_std), reads the final normed hidden state, as lm_head does.

    architecture  module            parameters beyond the backbone            forward returns
    "lm"          Transformer       lm_head.weight                            logits [B, T, V]
    "lm+value"    PolicyWithValue   lm_head.weight, value_head.weight [1, d]  logits; with return_values,
                                                                              (logits, values [B, T])
    "reward"      RewardModel       score_head.weight [1, d] (no lm_head)     scores [B, T]

Scores and values are float32. Everything goes through `forward` (under FSDP2 only a forward
gathers sharded parameters). A reward is read at the response's last token: `last_index`
finds it under left or right padding, `score_at` picks it; `padding_inputs` gives the segment
and position ids that make a padded row compute what it computes alone.
"""

from __future__ import annotations

import torch
from torch import nn

from sprout.model.config import ModelConfig
from sprout.model.transformer import KVCache, Transformer


def _scalar_head(config: ModelConfig) -> nn.Linear:
    head = nn.Linear(config.d_model, 1, bias=False)
    if not head.weight.is_meta:  # no values to draw on the meta device (`sprout.model.transformer.uninitialised`)
        nn.init.normal_(head.weight, 0.0, config.init_std)
    return head


class PolicyWithValue(Transformer):
    """LM logits plus a value per position, from one backbone (PPO's policy and critic)."""

    architecture = "lm+value"

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.value_head = _scalar_head(config)

    def forward(self, input_ids, *, segment_ids=None, position_ids=None, cache: KVCache | None = None,
                return_values: bool = False, detach_values: bool = False, logits_to_keep: int = 0):
        """Logits [B, T, vocab] float32; with return_values, (logits, values [B, T] float32);
        with detach_values the value head reads the hidden states detached, so a loss on the
        values trains the head alone. `logits_to_keep` as in `Transformer.forward` (the values
        stay [B, T])."""
        logits, h = super().forward(input_ids, segment_ids=segment_ids, position_ids=position_ids, cache=cache,
                                    return_hidden=True, logits_to_keep=logits_to_keep)
        if not return_values:
            return logits
        return logits, self.value_head(h.detach() if detach_values else h).squeeze(-1).float()


class RewardModel(Transformer):
    """A scalar score per position from the backbone's final hidden state (no LM head)."""

    architecture = "reward"

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        del self.lm_head  # a reward model never predicts tokens
        self.score_head = _scalar_head(config)

    def forward(self, input_ids, *, segment_ids=None, position_ids=None):
        """Scores [B, T] float32: the score of the sequence ending at each position."""
        h = self.hidden_states(input_ids, segment_ids=segment_ids, position_ids=position_ids)
        return self.score_head(h).squeeze(-1).float()

    def new_cache(self, batch_size: int, max_len: int, dtype: torch.dtype | None = None) -> KVCache:
        raise TypeError("a reward model scores whole sequences; it has no KV-cache decoding")


ARCHITECTURES = {"lm": Transformer, "lm+value": PolicyWithValue, "reward": RewardModel}
HEAD_WEIGHTS = {"lm+value": "value_head.weight", "reward": "score_head.weight"}  # what tells them apart


def last_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Index [B] of each row's last real token (mask [B, T], 1 = real), left or right padded."""
    T = attention_mask.shape[1]
    return T - 1 - attention_mask.bool().flip(1).int().argmax(dim=1)


def score_at(scores: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """scores[b, index[b]] for each row b: [B, T], [B] -> [B]."""
    return scores.gather(1, index[:, None].to(scores.device))[:, 0]


def padding_inputs(attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(segment_ids, position_ids) [B, T] for a padded batch: padding segment 0, real tokens
    segment 1 at positions 0, 1, ... counted over real tokens only (padding clamps to 0 before
    them and repeats the last position after them; it only ever sees other padding)."""
    segments = attention_mask.long()
    positions = (segments.cumsum(dim=1) - 1).clamp(min=0)
    return segments, positions
