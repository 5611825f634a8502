"""A Hugging Face config.json read as transformers reads it: the sprout `ModelConfig` it gives.

    cfg = model_config(json.loads(text), "hf/config.json", max_seq_len=None)

Every field that changes the maths is read as `AutoModelForCausalLM.from_pretrained`
(transformers 5.24) reads it, or refused in one line naming the field:
  - the architecture is `model_type`'s (what AutoModel builds); `architectures` must agree;
  - a missing field takes the default of that architecture's transformers config (`DEFAULTS`);
  - rope: a non-empty `rope_scaling` replaces `rope_parameters` whole (either spelling of the
    type, `rope_type` or `type`); its `rope_theta`, else the top-level one, else 10000. "default"
    and "llama3" are computed; "dynamic" only rescales past max_position_embeddings, which is
    beyond sprout's context, so it is plain rope here; yarn, linear, longrope and the rest are
    refused. A top-level `original_max_position_embeddings` overrides llama3's own;
  - biases as each architecture's modeling file builds them (Qwen2: q/k/v always; Llama's
    attention_bias and mlp_bias refused; Mistral none), `head_dim` as each reads it, a sliding
    window only where that architecture's layers use one.
The context is max_position_embeddings or --max-seq-len, from 1 to `MAX_CONTEXT` tokens.
"""

from __future__ import annotations

import json

from sprout.errors import SproutError
from sprout.ranges import is_finite_number
from sprout.model.config import LLAMA3_ROPE, ModelConfig
from sprout.model.export import REWARD_SCORE_KEY
from sprout.formats.checkpoint_meta import logprob_rule

MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
ARCHITECTURES = tuple(MODEL_TYPES.values())
MOE_FIELDS = ("num_local_experts", "num_experts", "num_experts_per_tok", "n_routed_experts", "moe_intermediate_size",
              "shared_expert_intermediate_size")
_SHAPE = dict(vocab_size=32000, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, rms_norm_eps=1e-6,
              tie_word_embeddings=False, hidden_act="silu")
# transformers 5.24's defaults for a field config.json leaves out (LlamaConfig, Qwen2Config, MistralConfig);
# tests/test_import_fields.py compares them with the classes' own
DEFAULTS = {
    "LlamaForCausalLM": dict(_SHAPE, intermediate_size=11008, num_key_value_heads=None, max_position_embeddings=2048,
                             head_dim=None, attention_bias=False, mlp_bias=False),
    "Qwen2ForCausalLM": dict(_SHAPE, vocab_size=151936, intermediate_size=22016, num_key_value_heads=32,
                             max_position_embeddings=32768, use_sliding_window=False, sliding_window=4096,
                             max_window_layers=28),
    "MistralForCausalLM": dict(_SHAPE, intermediate_size=14336, num_key_value_heads=8, head_dim=None,
                               max_position_embeddings=131072, sliding_window=4096),
}
SILU = ("silu", "swish")  # transformers' ACT2FN: both are torch's SiLU
ROPE_THETA = 10000.0  # transformers' default_theta
ROPE_KINDS = ("default", "llama3", "dynamic")  # what sprout computes (see the module doc)
MAX_CONTEXT = 1 << 20  # the longest context imported; its rotary tables: 2 x context x head size float32s


def _bad(where: str, name: str, value, want: str) -> SproutError:
    return SproutError(f"{where}: {name} {json.dumps(value)} {want}")


def whole_number_field(config: dict, name: str, default, where: str, *, minimum: int = 1, none_ok: bool = False):
    """config[name] (`default` when absent) as a whole number of at least `minimum` (None when
    `none_ok`), else one line naming the field."""
    value = config.get(name, default)
    if value is None and none_ok:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _bad(where, name, value, f"is not a whole number of at least {minimum}")
    return value


def positive_field(value, name: str, where: str) -> float:
    """`value` as a finite number above 0, else one line naming the field `name`."""
    if not is_finite_number(value) or value <= 0:
        raise _bad(where, name, value, "is not a finite number above 0")
    return float(value)


def architecture(config: dict, where: str) -> str:
    """The transformers class AutoModelForCausalLM builds: `model_type`'s, `architectures`'s without one."""
    archs = config.get("architectures") or []
    if archs and (not isinstance(archs, list) or len(archs) != 1 or archs[0] not in ARCHITECTURES):
        raise SproutError(f"{where}: architectures {archs} is not supported (supported: {', '.join(ARCHITECTURES)})")
    kind = config.get("model_type")
    if kind is None:
        if not archs:
            raise SproutError(f"{where}: neither model_type nor architectures says which model this is")
        return archs[0]
    if kind not in MODEL_TYPES:
        raise SproutError(f"{where}: model_type {kind!r} is not supported (supported: "
                          f"{', '.join(MODEL_TYPES)})")
    if archs and archs[0] != MODEL_TYPES[kind]:
        raise SproutError(f"{where}: model_type {kind!r} and architectures {archs} disagree (transformers builds "
                          f"the model_type's {MODEL_TYPES[kind]})")
    return MODEL_TYPES[kind]


def chosen_rope(config: dict, where: str) -> tuple[str, dict, str]:
    """(the field transformers reads the rope from, that object, its rope type): a non-empty
    `rope_scaling` replaces `rope_parameters` whole."""
    scaling, params = config.get("rope_scaling"), config.get("rope_parameters")
    field, rope = ("rope_scaling", scaling) if scaling else ("rope_parameters", params)
    if rope is None:
        rope = {}
    if not isinstance(rope, dict):
        raise _bad(where, field, rope, "is not a JSON object")
    if any(isinstance(v, dict) for v in rope.values()):
        raise SproutError(f"{where}: {field} per layer type is not supported")
    return field, rope, rope.get("rope_type", rope.get("type", "default"))


def rope_settings(config: dict, where: str, max_positions: int | None = None) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling for `ModelConfig`) of a config.json, as the module doc says;
    `max_positions`: its max_position_embeddings (llama3's default original length)."""
    field, rope, kind = chosen_rope(config, where)
    own = "rope_theta" in rope
    theta = positive_field(rope["rope_theta"] if own else config.get("rope_theta", ROPE_THETA),
                           f"{field}'s rope_theta" if own else "rope_theta", where)
    if kind not in ROPE_KINDS:
        raise SproutError(f"{where}: rope_scaling type {kind!r} is not supported (supported: {', '.join(ROPE_KINDS)}; "
                          f"transformers reads it from {field})")
    if kind == "default":  # transformers' default rope rotates the whole head whatever partial_rotary_factor says
        return theta, None
    partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    if partial is not None and partial != 1:
        raise _bad(where, "partial_rotary_factor", partial, f"is not supported with {kind} rope (transformers "
                   f"cannot run it either)")
    missing = [k for k in ("factor", *(LLAMA3_ROPE[1:3] if kind == "llama3" else ())) if k not in rope]
    if missing:
        raise SproutError(f"{where}: {field} of type {kind} lacks {', '.join(missing)}")
    factor = positive_field(rope["factor"], f"{field}'s factor", where)
    if kind == "dynamic":
        return theta, None
    values = {k: rope.get(k) for k in LLAMA3_ROPE}
    if "original_max_position_embeddings" in config:  # transformers: the top-level field wins
        values["original_max_position_embeddings"] = config["original_max_position_embeddings"]
    elif values["original_max_position_embeddings"] is None:
        values["original_max_position_embeddings"] = max_positions
    for k in LLAMA3_ROPE[1:]:
        positive_field(values[k], k if k == "original_max_position_embeddings" else f"{field}'s {k}", where)
    return theta, {"rope_type": "llama3", **values, "factor": factor}


def context(positions: int, max_seq_len: int | None, head_dim: int, where: str) -> int:
    """The model's context: `max_seq_len` (at most max_position_embeddings `positions`) or `positions`,
    refused above `MAX_CONTEXT` with what its rotary tables would take."""
    if max_seq_len is not None:
        if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or not 0 < max_seq_len <= positions:
            raise SproutError(f"--max-seq-len {max_seq_len}: the context must be between 1 and the model's "
                              f"max_position_embeddings {positions:,} ({where})")
        tokens, name = max_seq_len, "--max-seq-len"
    else:
        tokens, name = positions, "max_position_embeddings"
    if tokens > MAX_CONTEXT:
        size = 2 * tokens * head_dim * 4
        raise SproutError(f"{where}: {name} {tokens:,} is longer than the longest context sprout imports, "
                          f"{MAX_CONTEXT:,} tokens (its rotary tables alone would take {size / 1e9:,.1f} GB); "
                          f"pass --max-seq-len {min(positions, MAX_CONTEXT)} or less for a shorter context")
    return tokens


def sliding_window(config: dict, arch: str, n_layers: int, where: str) -> int | None:
    """The attention window some layer of `arch` uses (as its transformers modeling file reads
    config.json), or None when every layer attends to the whole context."""
    if arch == "LlamaForCausalLM":
        return None
    window = whole_number_field(config, "sliding_window", DEFAULTS[arch]["sliding_window"], where, none_ok=True)
    if arch == "MistralForCausalLM":
        return window
    if not config.get("use_sliding_window", False):
        window = None
    layer_types = config.get("layer_types")
    if layer_types is None:
        first = whole_number_field(config, "max_window_layers", DEFAULTS[arch]["max_window_layers"], where, minimum=0)
        layer_types = ["sliding_attention" if window is not None and i >= first else "full_attention"
                       for i in range(n_layers)]
    if "sliding_attention" not in layer_types:
        return None
    if window is None:
        raise SproutError(f"{where}: layer_types has sliding_attention layers but use_sliding_window is false "
                          f"(transformers cannot build this model)")
    return window


def model_config(config: dict, where: str, max_seq_len: int | None = None) -> ModelConfig:
    """The sprout `ModelConfig` of a transformers config.json (module doc), refusing what sprout
    does not compute in one line naming the field; `max_seq_len` shortens the context."""
    arch = architecture(config, where)
    defaults = DEFAULTS[arch]
    act = config.get("hidden_act", defaults["hidden_act"])
    if act not in SILU:
        raise SproutError(f"{where}: hidden_act {act!r} is not supported (only silu)")
    for name in MOE_FIELDS:
        if config.get(name):
            raise SproutError(f"{where}: {name} {config[name]!r}: mixture-of-experts models are not supported")
    if config.get("quantization_config"):
        method = (config["quantization_config"] or {}).get("quant_method", "?")
        raise SproutError(f"{where}: quantization_config (quant_method {method!r}): quantized weights are not "
                          f"supported (import the unquantized model, or a GGUF)")
    if arch == "LlamaForCausalLM":
        for name in ("attention_bias", "mlp_bias"):
            if config.get(name, False) is not False:
                raise SproutError(f"{where}: {name} {json.dumps(config[name])} is not supported (sprout's Llama "
                                  f"has no such biases)")
    tie = config.get("tie_word_embeddings", defaults["tie_word_embeddings"])
    if not isinstance(tie, bool):
        raise _bad(where, "tie_word_embeddings", tie, "is not true or false")
    vocab, hidden, layers, heads = (whole_number_field(config, k, defaults[k], where) for k in
                                    ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"))
    kv_heads = (whole_number_field(config, "num_key_value_heads", defaults["num_key_value_heads"], where, none_ok=True)
                or heads)
    d_ff = whole_number_field(config, "intermediate_size", defaults["intermediate_size"], where)
    if arch == "Qwen2ForCausalLM":  # no head_dim field: config.json's is used when there, null included
        head_dim = whole_number_field(config, "head_dim", hidden // heads, where)
    else:
        head_dim = whole_number_field(config, "head_dim", None, where, none_ok=True) or hidden // heads
    if arch == "LlamaForCausalLM" and hidden % heads:
        raise SproutError(f"{where}: hidden_size {hidden} is not a multiple of num_attention_heads {heads} "
                          f"(transformers refuses such a Llama config)")
    positions = whole_number_field(config, "max_position_embeddings", defaults["max_position_embeddings"], where)
    tokens = context(positions, max_seq_len, head_dim, where)
    window = sliding_window(config, arch, layers, where)
    if window is not None and window < tokens:
        raise SproutError(f"{where}: sliding_window {window} is shorter than the context {tokens} (sliding-window "
                          f"attention is not supported; a --max-seq-len of at most {window} avoids it)")
    theta, scaling = rope_settings(config, where, positions)
    eps = positive_field(config.get("rms_norm_eps", defaults["rms_norm_eps"]), "rms_norm_eps", where)
    init = config.get("initializer_range", 0.02)  # initialisation only: no part of the maths
    init = float(init) if isinstance(init, (int, float)) and not isinstance(init, bool) and 0 < init < 1 else 0.02
    try:
        return ModelConfig(vocab_size=vocab, d_model=hidden, n_layers=layers, n_heads=heads, n_kv_heads=kv_heads,
                           d_ff=d_ff, max_seq_len=tokens, rope_theta=theta, norm_eps=eps, tie_embeddings=tie,
                           init_std=init, d_head=None if head_dim * heads == hidden else head_dim,
                           attention_bias=arch == "Qwen2ForCausalLM", rope_scaling=scaling)
    except SproutError as exc:
        raise SproutError(f"{where}: {exc}") from None


def rope_note(config: dict) -> str | None:
    """What the summary says of a rope type imported as another: dynamic rope is plain rope here."""
    if chosen_rope(config, "config.json")[2] == "dynamic":
        return ("rope scaling dynamic changes nothing up to max_position_embeddings, the longest context here: "
                "imported as plain rope")
    return None


def import_reward_score(config: dict, where: str) -> dict | None:
    """config.json's `sprout_reward_score` as meta.json's `reward_score` (`logprob_rule`'s
    {"kind": "logprob", "beta": β}), None without the key; any other value is refused, naming `where`."""
    if REWARD_SCORE_KEY not in config:
        return None
    rule = logprob_rule(config[REWARD_SCORE_KEY])
    if rule is None:
        raise SproutError(f"{where}: sprout_reward_score {json.dumps(config[REWARD_SCORE_KEY])} is not a "
                          'log-probability reward model\'s rule (expected {"kind": "logprob", "beta": a finite '
                          "number above 0})")
    return rule
