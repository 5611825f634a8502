"""Export a checkpoint to a folder that Hugging Face transformers loads as `LlamaForCausalLM`.

    export_hf("runs/demo/sft_model", "exports/sft")   # a checkpoint dir, a run dir or its checkpoints/

What the folder holds:

    config.json              LlamaConfig (the table below), bos/eos/pad ids of the tokenizer
    model.safetensors        the weights under transformers' names: `model.` before every name
                             but `lm_head.weight` (`hf_weight_name`; `sprout.model.hf_import`
                             reads them back with `sprout_weight_name`); tied embeddings stored
                             once, as `model.embed_tokens.weight` (transformers ties lm_head to it)
    generation_config.json   eos = the end-of-turn id (SentencePiece: also the three role ids, the
                             stop tokens of `sprout.model.chat_session`), bos/pad where the tokenizer
                             has them; do_sample true, temperature 0.7 (scripts/chat.py's default),
                             top_p 1.0, top_k 0 (off)
    tokenizer.json           a `tokenizers` pipeline that gives sprout's ids (below)
    tokenizer_config.json    PreTrainedTokenizerFast, its special tokens, no BOS or EOS added, and
                             `chat_template`, a Jinja template rendering `sprout.chat.render`'s layout
    vocab.json, merges.txt   tiktoken r50k_base: GPT-2's files, rebuilt from the ranks
    tokenizer.model          SentencePiece: the run's .model file, unchanged

    sprout ModelConfig   LlamaConfig                 sprout ModelConfig   LlamaConfig
    vocab_size           vocab_size                  max_seq_len          max_position_embeddings
    d_model              hidden_size                 rope_theta           rope_theta
    n_layers             num_hidden_layers           norm_eps             rms_norm_eps
    n_heads              num_attention_heads         tie_embeddings       tie_word_embeddings
    kv_heads             num_key_value_heads         init_std             initializer_range
    ff_dim               intermediate_size           head_dim             head_dim
                                                     rope_scaling         rope_scaling (None, or Llama 3's)
    (silu, no biases: hidden_act "silu", attention_bias and mlp_bias false; a model with q/k/v
    biases, an imported Qwen2, is refused)

Rotary embeddings need no weight permutation: sprout rotates in transformers' own
`rotate_half` convention with the same inverse frequencies (`sprout.model.transformer`).

Architectures (`sprout.model.heads`): "lm" exports as LlamaForCausalLM; "lm+value" exports its
policy LM as LlamaForCausalLM and drops the value head (reported in `ExportResult.dropped`);
"reward" exports as LlamaForSequenceClassification with one label, `score.weight` = the score
head. transformers reads that score at the last token that is not `pad_token_id`, which is
sprout's `last_index` for a row that ends with its end-of-turn token; a tokenizer without a
pad id (tiktoken) then scores one unpadded row per call (transformers refuses a batch).

Tokenizers. tiktoken r50k_base becomes GPT-2's byte-level BPE: `vocab.json` maps each token's
bytes through GPT-2's `bytes_to_unicode`; `merges.txt` is recovered by re-running BPE on each
token's bytes with only the lower ranks (the last merge is the token's own), which rebuilds
GPT-2's original 50,000 merges. The SentencePiece models sprout trains (BPE, byte fallback,
identity normalisation, no dummy prefix, see `sprout.prep.tokenizer_train`) become a BPE with
byte fallback whose merges are ranked by piece score, spaces written "▁", and words split
as SentencePiece splits them (a word is a run of "▁" and the text up to the next "▁").
Control pieces (`<|pad|>`, `<|bos|>`, `<|endoftext|>`, the role markers) and `<unk>` are
special tokens; nothing is added at the start or end of a text, as in sprout.

One difference from sprout's `encode` is transformers' convention: a special token's text
inside a string becomes that token (that is how the chat template's markers get their ids).
`tokenizer(text, split_special_tokens=True)` encodes such text as plain text, as sprout does.
With tiktoken the role markers are plain text, and the pipeline cuts the text after each
`<|role|>\\n` header before byte-level splitting, as `render` encodes a header apart from
the content after it; plain text where a marker and newline are followed by more whitespace
therefore splits there, where sprout's `encode` would not (the chat template refuses marker
text inside messages anyway).

`verify_export` loads the folder with transformers and checks it against the sprout model and
tokenizer: logits (or scores) on a batch of random ids, ids on sample texts, and chat-template
ids on sample conversations; `scripts/export_hf.py` runs it after every export.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from sprout.atomic import check_writable, replace_dir
from sprout.chat import MARKERS, RESERVED, render, template_for
from sprout.checkpoint import architecture_of, checkpoint_tokenizer, tied_aliases
from sprout.errors import SproutError
from sprout.model.load import load_model
from sprout.tokenizer import EOT, SentencePieceTokenizer, TiktokenTokenizer, bytes_to_unicode

TEMPERATURE, TOP_P = 0.7, 1.0  # generation_config.json's sampling defaults (scripts/chat.py's)
HEADER_CUT = r"<\|(?:system|user|assistant)\|>\n"  # tiktoken: text is cut after each role header
SP_WORD = r"▁*[^▁]+|▁+"  # SentencePiece's words: a run of "▁", then the text up to the next "▁"
INSTALL_HINT = "pip install -e '.[export]'"


@dataclass
class ExportResult:
    out: Path
    architecture: str  # sprout's: "lm", "lm+value" or "reward"
    hf_class: str  # LlamaForCausalLM or LlamaForSequenceClassification
    files: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)  # sprout weights with no place in hf_class


# ---- config and weights --------------------------------------------------------------------------
def llama_config(model, tok) -> dict:
    """config.json for `model` (a Transformer, PolicyWithValue or RewardModel) and its tokenizer."""
    c = model.config
    arch = architecture_of(model)
    cfg = {
        "architectures": ["LlamaForSequenceClassification" if arch == "reward" else "LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": c.vocab_size,
        "hidden_size": c.d_model,
        "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.kv_heads,
        "head_dim": c.head_dim,
        "intermediate_size": c.ff_dim,
        "hidden_act": "silu",
        "max_position_embeddings": c.max_seq_len,
        "rope_theta": float(c.rope_theta),
        "rope_scaling": c.rope_scaling,
        "rms_norm_eps": c.norm_eps,
        "tie_word_embeddings": bool(c.tie_embeddings) and arch != "reward",  # a reward model has no lm_head
        "initializer_range": c.init_std,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "use_cache": True,
        "bos_token_id": tok.bos_id,
        "eos_token_id": tok.eot_id,
        "pad_token_id": tok.pad_id,
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
    }
    if arch == "reward":
        cfg.update(num_labels=1, id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    return cfg


LM_HEAD = "lm_head.weight"  # the one LM weight that keeps its name in transformers; every other gets `model.`


def hf_weight_name(name: str) -> str:
    """transformers' name of a sprout LM weight (`model.` before all but `LM_HEAD`; the module doc's table)."""
    return name if name == LM_HEAD else f"model.{name}"


def sprout_weight_name(hf_name: str) -> str | None:
    """The sprout name of a transformers LM weight: `hf_weight_name` undone (None for a name it never gives)."""
    if hf_name == LM_HEAD:
        return hf_name
    return hf_name.removeprefix("model.") if hf_name.startswith("model.") else None


def hf_state_dict(model) -> tuple[dict[str, torch.Tensor], list[str]]:
    """({transformers name: tensor}, [dropped sprout names]) for `model`'s weights.

    Every backbone name gets `model.`; `lm_head.weight` stays (omitted when tied: transformers
    ties it to `model.embed_tokens.weight`); a reward model's `score_head.weight` becomes
    `score.weight`; a value head is dropped.
    """
    aliases = tied_aliases(model)
    out, dropped = {}, []
    for name, t in model.state_dict().items():
        if name in aliases:
            continue
        if name == "score_head.weight":
            hf = "score.weight"
        elif name == "value_head.weight":
            dropped.append(name)
            continue
        else:
            hf = hf_weight_name(name)
        out[hf] = t.detach().to("cpu").contiguous()
    return out, dropped


# ---- tokenizers ----------------------------------------------------------------------------------
def _tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise SproutError(f"export needs the tokenizers package (part of transformers): {INSTALL_HINT}") from None
    return tokenizers


def _bpe_parts(ranks: dict[bytes, int], token: bytes, max_rank: int) -> list[bytes]:
    """tiktoken's BPE on `token` using only merges ranked below `max_rank`."""
    parts = [bytes([b]) for b in token]
    while len(parts) > 1:
        best, where = None, -1
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < max_rank and (best is None or r < best):
                best, where = r, i
        if best is None:
            break
        parts[where:where + 2] = [parts[where] + parts[where + 1]]
    return parts


def gpt2_vocab_and_merges(tok) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """(vocab.json, merges in rank order) rebuilt from a tiktoken tokenizer's ranks."""
    ranks = {tok.token_bytes_of(i): i for i in range(tok.vocab_size) if i != tok.eot_id}
    to_char = bytes_to_unicode()

    def show(b: bytes) -> str:
        return "".join(to_char[x] for x in b)

    vocab, merges = {show(b): i for b, i in ranks.items()}, []
    for b, i in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(b) == 1:
            continue
        parts = _bpe_parts(ranks, b, i)
        if len(parts) != 2:
            raise SproutError(f"{tok.spec}: token {i} is not one merge of two lower-ranked tokens")
        merges.append((show(parts[0]), show(parts[1])))
    vocab[EOT] = tok.eot_id
    return vocab, merges


def tiktoken_pipeline(vocab: dict[str, int], merges: list[tuple[str, str]]):
    """GPT-2's byte-level BPE (`tokenizers`), with the text cut after each role header."""
    tk = _tokenizers()
    t = tk.Tokenizer(tk.models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    t.pre_tokenizer = tk.pre_tokenizers.Sequence([
        tk.pre_tokenizers.Split(tk.Regex(HEADER_CUT), behavior="merged_with_previous"),
        tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    t.decoder = tk.decoders.ByteLevel()
    t.add_special_tokens([tk.AddedToken(EOT, special=True, normalized=False)])
    return t


def _processor(tok):
    """The SentencePieceProcessor of a SentencePiece tokenizer's file (pieces, scores, kinds)."""
    import sentencepiece as spm

    return spm.SentencePieceProcessor(model_file=str(tok.path))


def sentencepiece_pipeline(tok):
    """A `tokenizers` BPE that encodes like the SentencePiece model of `tok` (see the module doc)."""
    tk = _tokenizers()
    sp = _processor(tok)
    probe = "  a  b\t\n ﬁＡe\u0301 "
    if tok.dummy_prefix or tok.decode(tok.encode(probe)) != probe:
        raise SproutError(f"{tok.path}: only SentencePiece models with identity normalisation and no dummy "
                          f"prefix (those sprout trains) can be exported")
    n = tok.vocab_size
    vocab = {sp.id_to_piece(i): i for i in range(n)}
    normal = {sp.id_to_piece(i): (sp.get_score(i), i) for i in range(n)
              if not (sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i) or sp.is_byte(i))}
    ranked = []
    for piece, (score, i) in normal.items():
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in normal and right in normal:
                ranked.append((-score, i, k, left, right))
    merges = [(left, right) for *_, left, right in sorted(ranked)]
    unk = sp.id_to_piece(sp.unk_id())
    t = tk.Tokenizer(tk.models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    t.normalizer = tk.normalizers.Replace(" ", "▁")
    t.pre_tokenizer = tk.pre_tokenizers.Split(tk.Regex(SP_WORD), behavior="isolated")
    t.decoder = tk.decoders.Sequence([tk.decoders.Replace("▁", " "), tk.decoders.ByteFallback(), tk.decoders.Fuse()])
    specials = [i for i in range(n) if sp.is_control(i) or sp.is_unknown(i)]
    t.add_special_tokens([tk.AddedToken(sp.id_to_piece(i), special=True, normalized=False) for i in specials])
    return t


def chat_template(tok) -> str:
    """A Jinja chat template that renders `sprout.chat.render`'s layout for `tok`.

    Unknown roles and messages holding a marker string raise (as `render` does); the order of
    roles is not checked here.
    """
    suffix = "\\n" if template_for(tok).kind == "text" else ""  # plain-text headers end in a newline
    markers = ", ".join(f"'{m}'" for m in RESERVED)
    return (
        "{%- for message in messages -%}"
        "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
        "{{- raise_exception('unknown role ' + message['role'] + ' (expected system, user or assistant)') -}}"
        "{%- endif -%}"
        f"{{%- for marker in [{markers}] -%}}"
        "{%- if marker in message['content'] -%}"
        "{{- raise_exception('message content contains the reserved marker ' + marker) -}}"
        "{%- endif -%}{%- endfor -%}"
        f"{{{{- '<|' + message['role'] + '|>{suffix}' + message['content'] + '{EOT}' -}}}}"
        "{%- endfor -%}"
        f"{{%- if add_generation_prompt -%}}{{{{- '{MARKERS['assistant']}{suffix}' -}}}}{{%- endif -%}}"
    )


def tokenizer_config(tok, max_len: int) -> dict:
    """tokenizer_config.json: the fast tokenizer class, special tokens, no added BOS/EOS, the template."""
    sp = _processor(tok) if isinstance(tok, SentencePieceTokenizer) else None

    def piece(i):
        return None if i is None else (EOT if i == tok.eot_id else sp.id_to_piece(i))

    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
        "bos_token": None if tok.bos_id is None else piece(tok.bos_id),
        "eos_token": EOT,
        "pad_token": None if tok.pad_id is None else piece(tok.pad_id),
        "chat_template": chat_template(tok),
    }
    if sp is not None:
        cfg["unk_token"] = sp.id_to_piece(sp.unk_id())
    return cfg


def generation_config(tok) -> dict:
    """generation_config.json: stop at end-of-turn (and SentencePiece role ids), sampling defaults."""
    tpl = template_for(tok)
    stops = [tok.eot_id] + ([h[0] for h in tpl.headers.values()] if tpl.kind == "special" else [])
    cfg = {"eos_token_id": stops if len(stops) > 1 else stops[0],
           "do_sample": True, "temperature": TEMPERATURE, "top_p": TOP_P, "top_k": 0}
    if tok.bos_id is not None:
        cfg["bos_token_id"] = tok.bos_id
    if tok.pad_id is not None:
        cfg["pad_token_id"] = tok.pad_id
    return cfg


# ---- the folder ----------------------------------------------------------------------------------
def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_tokenizer(tok, folder: Path, max_len: int) -> list[str]:
    """Write the tokenizer files of `tok` into `folder`; returns their names."""
    if isinstance(tok, TiktokenTokenizer):
        vocab, merges = gpt2_vocab_and_merges(tok)
        _write_json(folder / "vocab.json", vocab)
        (folder / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges),
                                           encoding="utf-8")
        pipeline, extra = tiktoken_pipeline(vocab, merges), ["vocab.json", "merges.txt"]
    elif isinstance(tok, SentencePieceTokenizer):
        pipeline, extra = sentencepiece_pipeline(tok), ["tokenizer.model"]
        shutil.copyfile(tok.path, folder / "tokenizer.model")
    else:
        raise SproutError(f"{tok.spec}: no export for this tokenizer kind")
    pipeline.save(str(folder / "tokenizer.json"))
    _write_json(folder / "tokenizer_config.json", tokenizer_config(tok, max_len))
    return ["tokenizer.json", "tokenizer_config.json", *extra]


def export_model(model, tok, out: str | os.PathLike, *, overwrite: bool = False) -> ExportResult:
    """Write `model` and `tok` as a transformers folder at `out`, atomically (see the module doc).

    The folder is built under a temporary sibling name and renamed into place, so `out` is
    either absent, the old folder or the complete new one. An `out` that exists and is not
    empty is refused unless `overwrite`.
    """
    out = Path(out)
    arch = architecture_of(model)
    if model.config.attention_bias:
        raise SproutError(f"{out}: a model with q/k/v biases (an imported Qwen2) has no LlamaForCausalLM form "
                          f"(Llama's attention_bias also puts one on o_proj); it cannot be exported yet")
    if tok.vocab_size > model.config.vocab_size:
        raise SproutError(f"{tok.spec}: vocab {tok.vocab_size} does not fit the model's {model.config.vocab_size}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise SproutError(f"{out}: already exists and is not empty (pass --overwrite to replace it)")
    check_writable(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{out.name}.", dir=out.parent))
    try:
        weights, dropped = hf_state_dict(model)
        save_file(weights, tmp / "model.safetensors", metadata={"format": "pt"})
        _write_json(tmp / "config.json", llama_config(model, tok))
        files = ["config.json", "model.safetensors"]
        if arch != "reward":
            _write_json(tmp / "generation_config.json", generation_config(tok))
            files.append("generation_config.json")
        files += write_tokenizer(tok, tmp, model.config.max_seq_len)
        replace_dir(tmp, out, files)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise SproutError(f"{out}: cannot write the export: {exc.strerror or exc}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    hf_class = json.loads((out / "config.json").read_text())["architectures"][0]
    return ExportResult(out, arch, hf_class, files, dropped)


def export_hf(checkpoint: str | os.PathLike, out: str | os.PathLike, *, tokenizer: str | None = None,
              overwrite: bool = False) -> tuple[ExportResult, object, object]:
    """Export a checkpoint (dir, run dir or checkpoints/ folder) with the tokenizer it was trained
    with (`tokenizer`, a spec, overrides); returns (result, sprout model, sprout tokenizer)."""
    model, meta = load_model(checkpoint)
    tok = checkpoint_tokenizer(meta, tokenizer)
    return export_model(model, tok, out, overwrite=overwrite), model, tok


# ---- checking the folder with transformers -------------------------------------------------------
SAMPLE_TEXTS = [
    "Hello world", "  two leading spaces", "trailing space ", "tab\there\r\nCRLF\n\n\nblank lines",
    "Café naïve 日本語 ✓ 😀 ﬁ", "a  b   c    d", "12345 + 678 = 13023; 3.14159", "it's they'll we've I'd",
    "<think>7 * 6 = 42</think><answer>42</answer>", "\n\n  \t ", "x", "",
]
SAMPLE_CHATS = [
    [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "<answer>5</answer>"}],
    [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": " Name three colours.\n"},
     {"role": "assistant", "content": "\n\nRed, green and blue."}, {"role": "user", "content": "日本語 ✓ 😀"}],
]


def _ids(encoded) -> list[int]:
    """Token ids out of whatever `apply_chat_template(tokenize=True)` returns in this version."""
    if hasattr(encoded, "keys") and "input_ids" in encoded:
        encoded = encoded["input_ids"]
    return list(encoded)


def verify_export(out: str | os.PathLike, model, tok, *, atol: float = 1e-4, seed: int = 0) -> dict:
    """Load `out` with transformers and compare it with the sprout `model` and `tok`.

    Checks: the largest logit (or score) difference on random ids (fp32, at most `atol`), the
    ids of `SAMPLE_TEXTS` (split_special_tokens=True, see the module doc) and of
    `SAMPLE_CHATS` through the chat template, with and without a generation prompt.
    Returns {"max_abs_diff": ..., "texts": n, "chats": n}; raises SproutError on a mismatch.
    """
    try:
        import transformers
    except ImportError:
        raise SproutError(f"checking the export needs transformers: {INSTALL_HINT}") from None
    out = Path(out)
    arch = architecture_of(model)
    cls = transformers.LlamaForSequenceClassification if arch == "reward" else transformers.LlamaForCausalLM
    hf = cls.from_pretrained(out, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    T = min(model.config.max_seq_len, 24)
    ids = torch.randint(0, tok.vocab_size, (1 if arch == "reward" else 2, T), generator=g)
    if tok.pad_id is not None:  # transformers would read a reward model's score before a pad id
        ids[ids == tok.pad_id] = (tok.pad_id + 1) % tok.vocab_size
    ref_model = model if next(model.parameters()).dtype == torch.float32 else copy.deepcopy(model).float()
    with torch.no_grad():
        if arch == "reward":
            ref, got = ref_model(ids)[:, -1], hf(ids).logits[:, 0]
        else:
            ref, got = ref_model(ids), hf(ids).logits.float()
    diff = float((ref - got).abs().max())
    if not diff <= atol:
        raise SproutError(f"{out}: transformers' {'scores' if arch == 'reward' else 'logits'} differ from "
                          f"sprout's by {diff:.3g} (allowed {atol:g})")
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    for text in SAMPLE_TEXTS:
        got_ids = hf_tok(text, add_special_tokens=True, split_special_tokens=True)["input_ids"]
        if got_ids != tok.encode(text):
            raise SproutError(f"{out}: tokenizer ids differ from sprout's on {text!r}")
    for chat in SAMPLE_CHATS:
        for prompt in (False, True):
            msgs = chat[:-1] if prompt and chat[-1]["role"] == "assistant" else chat
            if not prompt and msgs[-1]["role"] != "assistant":
                continue
            got_ids = _ids(hf_tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=prompt))
            if got_ids != render(msgs, tok, add_generation_prompt=prompt)[0]:
                raise SproutError(f"{out}: chat template ids differ from sprout.chat.render on {msgs!r}")
    return {"max_abs_diff": diff, "texts": len(SAMPLE_TEXTS), "chats": len(SAMPLE_CHATS)}
