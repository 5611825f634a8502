"""The tokenizer files of a transformers export (`sprout.model.export`), one way per tokenizer kind.

    names = write_tokenizer(tok, folder, max_len)   # writes the files, returns their names

    tiktoken r50k_base   tokenizer.json, tokenizer_config.json, vocab.json, merges.txt
    SentencePiece        tokenizer.json, tokenizer_config.json, tokenizer.model (the run's, unchanged)
    hf: (an import)      the source's own files, byte for byte: tokenizer.json, tokenizer_config.json,
                         special_tokens_map.json, chat_template.jinja (those its folder holds)

For tiktoken and SentencePiece, tokenizer.json is a `tokenizers` pipeline that gives sprout's
ids, and tokenizer_config.json names PreTrainedTokenizerFast, the special tokens, no BOS or EOS
added, and a Jinja `chat_template` rendering `sprout.chat.render`'s layout. An import keeps the
source's own chat template. `sprout.model.export.verify_export` compares the ids. transformers
turns a special token's text inside a string into that token (`split_special_tokens=True`
encodes it as plain text, as sprout does).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from sprout.chat import MARKERS, RESERVED, template_for
from sprout.errors import SproutError
from sprout.tokenizer import (CHAT_TEMPLATE_FILE, EOT, HF_FILE, HF_SIDE_FILES, HFTokenizer, SentencePieceTokenizer,
                              TiktokenTokenizer, bytes_to_unicode)

HEADER_CUT = r"<\|(?:system|user|assistant)\|>\n"  # tiktoken: text is cut after each role header
SP_WORD = r"▁*[^▁]+|▁+"  # SentencePiece's words: a run of "▁", then the text up to the next "▁"
INSTALL_HINT = "pip install -e '.[export]'"
TOKENIZER_FILES = (HF_FILE, *HF_SIDE_FILES, CHAT_TEMPLATE_FILE, "vocab.json", "merges.txt",
                   "tokenizer.model")  # every name `write_tokenizer` may write, whatever the kind


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_tokenizer(tok, folder: Path, max_len: int) -> list[str]:
    """Write the tokenizer files of `tok` into `folder` (the module doc's table); returns their names."""
    if isinstance(tok, HFTokenizer):
        return copy_hf_tokenizer(tok, folder)
    if isinstance(tok, TiktokenTokenizer):
        vocab, merges = gpt2_vocab_and_merges(tok)
        write_json(folder / "vocab.json", vocab)
        (folder / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges),
                                           encoding="utf-8")
        pipeline, extra = tiktoken_pipeline(vocab, merges), ["vocab.json", "merges.txt"]
    elif isinstance(tok, SentencePieceTokenizer):
        pipeline, extra = sentencepiece_pipeline(tok), ["tokenizer.model"]
        shutil.copyfile(tok.path, folder / "tokenizer.model")
    else:
        raise SproutError(f"{tok.spec}: no export for this tokenizer kind")
    pipeline.save(str(folder / "tokenizer.json"))
    write_json(folder / "tokenizer_config.json", tokenizer_config(tok, max_len))
    return ["tokenizer.json", "tokenizer_config.json", *extra]


def copy_hf_tokenizer(tok: HFTokenizer, folder: Path) -> list[str]:
    """The source's own files of an imported tokenizer, unchanged (its tokenizer.json as `HF_FILE`)."""
    shutil.copyfile(tok.path, folder / HF_FILE)
    names = [HF_FILE]
    for name in (*HF_SIDE_FILES, CHAT_TEMPLATE_FILE):
        if (tok.path.parent / name).is_file():
            shutil.copyfile(tok.path.parent / name, folder / name)
            names.append(name)
    return names


# ---- tiktoken and SentencePiece as `tokenizers` pipelines -----------------------------------------
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
    """A `tokenizers` BPE that encodes like the SentencePiece model of `tok`: byte fallback, merges
    ranked by piece score, spaces written "▁", words split as SentencePiece splits them (`SP_WORD`),
    control pieces and `<unk>` special, nothing added at the start or end of a text."""
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
