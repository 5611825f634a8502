"""Export a checkpoint to a folder that Hugging Face transformers loads: `LlamaForCausalLM`, or
`Qwen2ForCausalLM` for a model with q/k/v biases; a reward model as *ForSequenceClassification
(one label, `score.weight`), a value-head policy as its LM (`ExportResult.dropped`: the head).

    export_hf("runs/demo/sft_model", "exports/sft")   # a checkpoint dir, a run dir or its checkpoints/

The folder: config.json (`hf_config`; eos = the chat format's end-of-turn id; a log-probability
reward model's rule as `sprout_reward_score`), model.safetensors (`hf_weight_name`: `model.`
before every name but `lm_head.weight`; tied embeddings stored once), generation_config.json
(`generation_config`) and the tokenizer files (`sprout.model.export_tokenizer`). It is written
whole or not at all (built beside it, renamed into place); an `out` that is not empty is
refused, and with `overwrite` replaced only when it holds nothing but `EXPORT_FILES` (and the
`EXPORT_FOLDERS` of a LoRA run's export with its adapter, `sprout.model.peft_adapter`); an `out`
that is, holds or lies inside the source's run folder is refused. `verify_export` loads the
folder with transformers and compares logits, token ids, chat-template ids and greedy answers.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from sprout.atomic import check_writable, replace_dir
from sprout.chat import render, template_for
from sprout.chat_formats import SPROUT
from sprout.checkpoint import architecture_of, checkpoint_tokenizer, run_folder, tied_aliases
from sprout.errors import SproutError
from sprout.formats.checkpoint_meta import resolve_checkpoint, reward_score_of
from sprout.model.export_tokenizer import INSTALL_HINT, TOKENIZER_FILES, write_json, write_tokenizer
from sprout.model.generate import generate
from sprout.model.load import load_model
from sprout.tokenizer import HFTokenizer

TEMPERATURE, TOP_P = 0.7, 1.0  # generation_config.json's sampling defaults (scripts/chat.py's)
REWARD_SCORE_KEY = "sprout_reward_score"  # config.json: a log-probability reward model's rule (hf_import reads it)


@dataclass
class ExportResult:
    out: Path
    architecture: str  # sprout's: "lm", "lm+value" or "reward"
    hf_class: str  # LlamaForCausalLM, Qwen2ForCausalLM or their *ForSequenceClassification
    files: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)  # sprout weights with no place in hf_class
    reward_score: dict | None = None  # a log-probability reward model's rule, in config.json too


# ---- config and weights --------------------------------------------------------------------------
def hf_class_name(model) -> str:
    """The transformers class `model` exports as: Qwen2 with q/k/v biases, else Llama; a reward
    model *ForSequenceClassification, others *ForCausalLM."""
    family = "Qwen2" if model.config.attention_bias else "Llama"
    return family + ("ForSequenceClassification" if architecture_of(model) == "reward" else "ForCausalLM")


def special_ids(tok) -> dict:
    """config.json's special ids for `tok`: its bos and pad ids, and its chat format's end-of-turn id as eos."""
    return {"bos_token_id": tok.bos_id, "eos_token_id": template_for(tok).eot_id, "pad_token_id": tok.pad_id}


def hf_config(model, ids: dict | None = None, reward_score: dict | None = None) -> dict:
    """config.json for `model` (a Transformer, PolicyWithValue or RewardModel) with the special
    `ids` of its tokenizer (`special_ids`; None: no special ids) and, for a log-probability reward
    model, its rule (`reward_score_of`'s {"kind": "logprob", "beta": β}) as `sprout_reward_score`."""
    c = model.config
    arch = architecture_of(model)
    hf_class = hf_class_name(model)
    ids = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None, **(ids or {})}
    if arch == "reward" and ids["pad_token_id"] == ids["eos_token_id"]:
        ids["pad_token_id"] = None  # transformers would score the token before the end-of-turn one
    qwen2 = hf_class.startswith("Qwen2")  # q/k/v biases are Qwen2's own
    cfg = {
        "architectures": [hf_class],
        "model_type": "qwen2" if qwen2 else "llama",
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
        **({} if qwen2 else {"attention_bias": False}),  # Llama's would put a bias on o_proj too
        "attention_dropout": 0.0,
        **({"use_sliding_window": False, "sliding_window": None, "max_window_layers": c.n_layers} if qwen2
           else {"mlp_bias": False, "pretraining_tp": 1}),
        "use_cache": True,
        **ids,
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
    }
    if arch == "reward":
        cfg.update(num_labels=1, id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    if reward_score:
        cfg[REWARD_SCORE_KEY] = reward_score
    return cfg


LM_HEAD = "lm_head.weight"  # the one LM weight that keeps its name in transformers; every other gets `model.`


def hf_weight_name(name: str) -> str:
    """transformers' name of a sprout LM weight: `model.` before all but `LM_HEAD`."""
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

def generation_config(tok) -> dict:
    """generation_config.json: stop at the end-of-turn id (and sprout's SentencePiece role ids), sampling defaults."""
    tpl = template_for(tok)
    roles = [h[0] for h in tpl.headers.values()] if tpl.format == SPROUT and tpl.kind == "special" else []
    stops = [tpl.eot_id, *roles]
    cfg = {"eos_token_id": stops if len(stops) > 1 else stops[0],
           "do_sample": True, "temperature": TEMPERATURE, "top_p": TOP_P, "top_k": 0}
    if tok.bos_id is not None:
        cfg["bos_token_id"] = tok.bos_id
    if tok.pad_id is not None:
        cfg["pad_token_id"] = tok.pad_id
    return cfg


# ---- the folder ----------------------------------------------------------------------------------
EXPORT_FILES = ("config.json", "model.safetensors", "generation_config.json", *TOKENIZER_FILES)
EXPORT_FOLDERS = ("base", "adapter")  # a LoRA run's export with --adapter (`sprout.model.peft_adapter`)


def check_export_out(out: Path, overwrite: bool) -> None:
    """Refuse an `out` that exists and is not empty, unless `overwrite` and it holds only what
    an export writes (`EXPORT_FILES`, and `EXPORT_FOLDERS`)."""
    if not out.exists():
        return
    if not out.is_dir():
        raise SproutError(f"{out}: exists and is not a folder; choose another output folder")
    held = sorted(p.name for p in out.iterdir())
    if held and not overwrite:
        raise SproutError(f"{out}: already exists and is not empty (pass --overwrite to replace an earlier export)")
    others = [name for name in held if name not in EXPORT_FILES
              and not (name in EXPORT_FOLDERS and (out / name).is_dir())]
    if others:
        raise SproutError(f"{out}: holds {others[0]!r}{f' and {len(others) - 1} more' if len(others) > 1 else ''}, "
                          f"which an export does not write; --overwrite replaces only an earlier export: "
                          f"choose another output folder")


def check_outside_run(out: Path, source: Path) -> None:
    """Refuse an `out` that is the run folder `source`, holds it, or lies inside it."""
    o, r = Path(os.path.abspath(out)).resolve(), Path(os.path.abspath(source)).resolve()
    if o == r or r.is_relative_to(o) or o.is_relative_to(r):
        where = "is" if o == r else ("holds" if r.is_relative_to(o) else "lies inside")
        raise SproutError(f"{out}: {where} the run folder {source} being exported; choose an output folder "
                          f"outside it")


def check_vocab(model, tok) -> None:
    """Refuse a tokenizer with more ids than the model's vocabulary."""
    if tok.vocab_size > model.config.vocab_size:
        raise SproutError(f"{tok.spec}: vocab {tok.vocab_size} does not fit the model's {model.config.vocab_size}")


def write_export(model, tok, folder: Path, reward_score: dict | None = None) -> ExportResult:
    """Write the export of `model` and `tok` into the existing folder `folder`, file by file (not
    atomic by itself: `build_export` runs it in a temporary folder)."""
    arch = architecture_of(model)
    weights, dropped = hf_state_dict(model)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    write_json(folder / "config.json", hf_config(model, special_ids(tok), reward_score))
    files = ["config.json", "model.safetensors"]
    if arch != "reward":
        write_json(folder / "generation_config.json", generation_config(tok))
        files.append("generation_config.json")
    files += write_tokenizer(tok, folder, model.config.max_seq_len)
    return ExportResult(folder, arch, hf_class_name(model), files, dropped, reward_score)


def build_export(out: Path, overwrite: bool, fill) -> None:
    """Make the folder `out` atomically: `fill(tmp)` writes into a temporary sibling and returns
    the paths it wrote (relative to it), which is then renamed into place, so `out` is either
    absent, the old folder or the complete new one. An `out` that exists and is not empty is
    refused unless `overwrite` and it holds only an earlier export (`check_export_out`)."""
    check_export_out(out, overwrite)
    check_writable(out)
    tmp = None
    try:  # a full disk (ENOSPC) may strike at any write, from the first folder on
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{out.name}.", dir=out.parent))
        replace_dir(tmp, out, fill(tmp))
    except (OSError, SafetensorError) as exc:  # safetensors reports its own write errors as SafetensorError
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise SproutError(f"{out}: cannot write the export: {getattr(exc, 'strerror', None) or exc}") from None
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def export_model(model, tok, out: str | os.PathLike, *, overwrite: bool = False,
                 reward_score: dict | None = None) -> ExportResult:
    """Write `model` and `tok` as a transformers folder at `out`, atomically (`build_export`; see
    the module doc); `reward_score`: a log-probability reward model's rule (`reward_score_of`'s),
    kept in config.json."""
    out = Path(out)
    check_vocab(model, tok)
    written = []
    build_export(out, overwrite, lambda tmp: written.append(write_export(model, tok, tmp, reward_score))
                 or written[0].files)
    return dataclasses.replace(written[0], out=out)


def export_hf(checkpoint: str | os.PathLike, out: str | os.PathLike, *, tokenizer: str | None = None,
              overwrite: bool = False) -> tuple[ExportResult, object, object]:
    """Export a checkpoint (dir, run dir or checkpoints/ folder) with the tokenizer it was trained
    with (`tokenizer`, a spec, overrides); returns (result, sprout model, sprout tokenizer).
    An `out` that is, holds or lies inside the checkpoint's run folder is refused first."""
    out = Path(out)
    check_outside_run(out, run_folder(resolve_checkpoint(checkpoint)))
    check_export_out(out, overwrite)
    model, meta = load_model(checkpoint)
    tok = checkpoint_tokenizer(meta, tokenizer)
    return export_model(model, tok, out, overwrite=overwrite, reward_score=logprob_rule_of(meta)), model, tok


def logprob_rule_of(meta: dict) -> dict | None:
    """The rule config.json carries for the checkpoint of `meta`: a log-probability reward
    model's (`reward_score_of`), else None (a score head is in the exported class itself)."""
    rule = reward_score_of(meta)
    return rule if rule and rule["kind"] == "logprob" else None




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
ANSWER_TOKENS = 16  # new tokens of each greedy chat answer compared
FP32_ROUNDING_LIMIT = 10  # how far float32 rounding may take the difference when float64 agrees within atol


def _ids(encoded) -> list[int]:
    """Token ids out of whatever `apply_chat_template(tokenize=True)` returns in this version."""
    if hasattr(encoded, "keys") and "input_ids" in encoded:
        encoded = encoded["input_ids"]
    return list(encoded)


def sample_texts(tok) -> list[str]:
    """`SAMPLE_TEXTS`; for an imported tokenizer also its chat format's special pieces typed inside
    text, which both sides encode as its tokenizer_config.json's `split_special_tokens` says."""
    if not isinstance(tok, HFTokenizer):
        return SAMPLE_TEXTS
    return SAMPLE_TEXTS + [f"typed {piece} as text" for piece in template_for(tok).format.reserved]


def sample_chats(tok) -> list:
    """`SAMPLE_CHATS`; for an imported tokenizer with each content stripped of surrounding
    whitespace, since a published template may trim contents (Llama 3's does) and `render` never does."""
    if not isinstance(tok, HFTokenizer):
        return SAMPLE_CHATS
    return [[{**m, "content": m["content"].strip()} for m in chat] for chat in SAMPLE_CHATS]


def _max_difference(model, hf, ids: torch.Tensor, arch: str, dtype: torch.dtype) -> float:
    """The largest |logit| (or score) difference between sprout's `model` and transformers' `hf` on
    `ids`, both run in `dtype` (copies when they are in another)."""
    ours = model if next(model.parameters()).dtype == dtype else copy.deepcopy(model).to(dtype)
    theirs = hf if next(hf.parameters()).dtype == dtype else copy.deepcopy(hf).to(dtype)
    with torch.no_grad():
        if arch == "reward":
            ref, got = ours(ids)[:, -1], theirs(ids).logits[:, 0]
        else:
            ref, got = ours(ids), theirs(ids).logits
    return float((ref.double() - got.double()).abs().max())


def check_ids(model, tok, seed: int = 0) -> torch.Tensor:
    """The random ids the checks run: [1 (a reward model) or 2, up to 24], never the pad id
    (transformers would read a reward model's score before it)."""
    g = torch.Generator().manual_seed(seed)
    rows = 1 if architecture_of(model) == "reward" else 2
    ids = torch.randint(0, tok.vocab_size, (rows, min(model.config.max_seq_len, 24)), generator=g)
    if tok.pad_id is not None:
        ids[ids == tok.pad_id] = (tok.pad_id + 1) % tok.vocab_size
    return ids


def compare_logits(out: Path, model, hf, ids: torch.Tensor, atol: float, who: str) -> tuple[float, float | None]:
    """(float32, float64 or None) largest |logit| (or score) difference of `hf` (a transformers
    model, `who` it is in the error) from sprout's `model` on `ids`: within `atol` in float32 or,
    when float32 rounding exceeds it, within `atol` in float64 and `FP32_ROUNDING_LIMIT` × `atol`
    in float32 (`verify_export`); else SproutError naming `out`."""
    arch = architecture_of(model)
    diff = _max_difference(model, hf, ids, arch, torch.float32)
    diff64 = None
    if not diff <= atol:  # fp32 rounding alone, over a deep model? float64 tells it from a wrong mapping
        diff64 = _max_difference(model, hf, ids, arch, torch.float64)
    if not (diff <= atol or (diff64 <= atol and diff <= FP32_ROUNDING_LIMIT * atol)):
        what = "scores" if arch == "reward" else "logits"
        also = "" if diff64 is None else f"; in float64 by {diff64:.3g}"
        raise SproutError(f"{out}: {who} {what} differ from sprout's by {diff:.3g} in float32{also} "
                          f"(allowed {atol:g})")
    return diff, diff64


def verify_export(out: str | os.PathLike, model, tok, *, atol: float = 1e-4, seed: int = 0,
                  answer_tokens: int = ANSWER_TOKENS) -> dict:
    """Load `out` with transformers and compare it with the sprout `model` and `tok`.

    Checks: the largest logit (or score) difference on random ids, at most `atol` in float32 or,
    when float32 rounding over a deep model exceeds it (SmolLM2-135M's 30 layers: about 1e-4 on
    logits up to 40), at most `atol` with both models in float64 and at most
    `FP32_ROUNDING_LIMIT` × `atol` in float32 (a wrong weight or config is off by far more; in
    float64 about 2e-5 is left on SmolLM2, not traced to one op); the
    ids of `sample_texts` (sprout's tokenizers: split_special_tokens=True, see
    `sprout.model.export_tokenizer`; an imported one: as its tokenizer_config.json says, as
    `HFTokenizer` encodes) and of `sample_chats` through the chat template, with and without a
    generation prompt; for an LM, the greedy answers to those chats (`greedy_answers`).
    Returns {"max_abs_diff" (float32), "max_abs_diff_fp64" (None unless computed), "texts", "chats", "answers" (0 for a reward model), "answer_tokens"};
    raises SproutError on a mismatch.
    """
    try:
        import transformers
    except ImportError:
        raise SproutError(f"checking the export needs transformers: {INSTALL_HINT}") from None
    out = Path(out)
    arch = architecture_of(model)
    hf_class = json.loads((out / "config.json").read_text(encoding="utf-8"))["architectures"][0]
    hf = getattr(transformers, hf_class).from_pretrained(out, dtype=torch.float32).eval()
    ids = check_ids(model, tok, seed)
    diff, diff64 = compare_logits(out, model, hf, ids, atol, who="transformers'")
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    how = {"add_special_tokens": False} if isinstance(tok, HFTokenizer) else \
        {"add_special_tokens": True, "split_special_tokens": True}
    texts = sample_texts(tok)
    for text in texts:
        if hf_tok(text, **how)["input_ids"] != tok.encode(text):
            raise SproutError(f"{out}: tokenizer ids differ from sprout's on {text!r}")
    chats = sample_chats(tok)
    for chat in chats:
        for prompt in (False, True):
            msgs = chat[:-1] if prompt and chat[-1]["role"] == "assistant" else chat
            if not prompt and msgs[-1]["role"] != "assistant":
                continue
            got_ids = _ids(hf_tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=prompt))
            if got_ids != render(msgs, tok, add_generation_prompt=prompt)[0]:
                raise SproutError(f"{out}: chat template ids differ from sprout.chat.render on {msgs!r}")
    fp32_model = model if next(model.parameters()).dtype == torch.float32 else copy.deepcopy(model).float()
    answers = [] if arch == "reward" else greedy_answers(out, hf, fp32_model, tok, chats, answer_tokens)
    return {"max_abs_diff": diff, "max_abs_diff_fp64": diff64, "texts": len(texts), "chats": len(chats),
            "answers": len(answers), "answer_tokens": sum(map(len, answers))}


def greedy_answers(out: Path, hf, model, tok, chats, max_new_tokens: int) -> list[list[int]]:
    """sprout's greedy answers to the last user message of each chat (`sprout.model.generate.generate`
    at temperature 0, stopping at the chat format's end-of-turn id, up to `max_new_tokens` and the
    context), each checked equal to transformers' `generate(do_sample=False)` stopping there too."""
    eot = template_for(tok).eot_id
    answers = []
    for chat in chats:
        msgs = chat[:-1] if chat[-1]["role"] == "assistant" else chat
        prompt = render(msgs, tok, add_generation_prompt=True)[0]
        n = min(max_new_tokens, model.config.max_seq_len - len(prompt))
        if n < 1:
            continue
        ours = generate(model, [prompt], n, temperature=0.0, stop_ids={eot}).tokens[0]
        ids = torch.tensor([prompt])
        with torch.no_grad():
            theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                 eos_token_id=eot, pad_token_id=eot if tok.pad_id is None else tok.pad_id)
        theirs = theirs[0, len(prompt):].tolist()
        if theirs != ours:
            at = next((i for i, (a, b) in enumerate(zip(theirs, ours)) if a != b), min(len(theirs), len(ours)))
            raise SproutError(f"{out}: transformers' greedy answer differs from sprout's at new token {at} "
                              f"on {msgs!r}: {tok.decode(theirs)!r} vs {tok.decode(ours)!r}")
        answers.append(ours)
    return answers
