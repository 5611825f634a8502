"""SentencePiece BPE training: the tokenizers `sprout.tokenizer.load_tokenizer` later loads.

    train_from_sources(TokenizerTrainConfig(sources=[...], vocab_size=4096, out="runs/tok/sp4096"))

`train_sentencepiece` trains with byte fallback, identity normalisation and no dummy prefix,
so `decode(encode(text)) == text` and separately encoded pieces concatenate exactly; digits are
split one per token (`split_digits`, on by default); the special pieces later stages need sit
at fixed ids 0..6 (`SPECIAL_PIECES`: pad, unk, bos, `<|endoftext|>` as eos, then the chat role
markers as control symbols). `train_from_sources` reads and cleans the same sources as
pretraining prep (`sprout.prep.sources`, `sprout.prep.clean`), interleaved document by document;
`exclude_val_frac` skips the documents prep's hash split (`sprout.prep.keys`) sends to
validation, so validation bits per byte are measured on unseen text. Only SentencePiece models
are trained here; an `hf:` tokenizer comes with the model it was imported with.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

from sprout.atomic import atomic_write, check_writable, remove_stale_temps, safe_name
from sprout.config import from_dict
from sprout.ranges import in_range
from sprout.errors import SproutError
from sprout.mirror import expand_path, mirror_dir
from sprout.prep.clean import CleanConfig, Cleaner
from sprout.prep.keys import key_low, text_key, val_threshold
from sprout.prep.sources import SourceSpec, iter_documents, parse_source_arg
from sprout.tokenizer import EOT

# Pieces of every SentencePiece model trained here, in id order (0..6).
SPECIAL_PIECES = ("<|pad|>", "<unk>", "<|bos|>", EOT, "<|system|>", "<|user|>", "<|assistant|>")
CONTROL_SYMBOLS = SPECIAL_PIECES[4:]


def _training_pieces(texts: Iterable[str], max_chars: int, max_piece: int) -> Iterator[str]:
    """Documents for the trainer, long ones cut at newlines into pieces of <= max_piece chars."""
    total = 0
    for text in texts:
        while text:
            if len(text) <= max_piece:
                piece, text = text, ""
            else:
                cut = text.rfind("\n", 0, max_piece)
                cut = cut + 1 if cut > 0 else max_piece
                piece, text = text[:cut], text[cut:]
            yield piece
            total += len(piece)
            if max_chars and total >= max_chars:
                return


def train_sentencepiece(
    texts: Iterable[str],
    out_prefix: str | os.PathLike,
    vocab_size: int,
    *,
    max_chars: int = 200_000_000,
    character_coverage: float = 0.9995,
    num_threads: int | None = None,
    split_digits: bool = True,
) -> Path:
    """Train a SentencePiece BPE model on `texts`; writes PREFIX.model and PREFIX.vocab atomically,
    as a pair: both are written to temporaries and renamed only when both are complete, so a
    full disk never leaves a .model without its .vocab. Temporaries a killed earlier run left
    beside them are removed first.

    Byte fallback, identity normalisation, no whitespace clean-up and no dummy prefix, so
    decoding gives back the original bytes. With `split_digits` every digit is its own piece
    (sentencepiece's `split_digits`), so a number is always spelt digit by digit; without it BPE
    may merge frequent numbers ("2019", "100") into single pieces.
    """
    import sentencepiece as spm

    out_prefix = Path(out_prefix)
    safe_name(out_prefix.name, f"{out_prefix}: output name")
    model_path = out_prefix.with_name(out_prefix.name + ".model")
    vocab_path = out_prefix.with_name(out_prefix.name + ".vocab")
    check_writable(model_path)
    if vocab_size < len(SPECIAL_PIECES) + 256 + 1:
        raise SproutError(f"vocab size {vocab_size} is too small: byte fallback alone needs {len(SPECIAL_PIECES) + 256} ids")
    max_piece = 1 << 16
    model = io.BytesIO()
    pieces = _training_pieces(texts, max_chars, max_piece)
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=pieces, model_writer=model, model_type="bpe", vocab_size=vocab_size,
            byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
            add_dummy_prefix=False, split_digits=split_digits, allow_whitespace_only_pieces=True,
            character_coverage=character_coverage, max_sentence_length=max_piece * 4,
            pad_id=0, unk_id=1, bos_id=2, eos_id=3, pad_piece=SPECIAL_PIECES[0], unk_piece=SPECIAL_PIECES[1],
            bos_piece=SPECIAL_PIECES[2], eos_piece=SPECIAL_PIECES[3], control_symbols=list(CONTROL_SYMBOLS),
            num_threads=num_threads or os.cpu_count() or 1, minloglevel=2,
        )
    except RuntimeError as exc:
        raise SproutError(f"{out_prefix}.model: SentencePiece training failed: {exc}") from None
    proto = model.getvalue()
    if not proto:
        raise SproutError(f"{out_prefix}.model: SentencePiece training produced no model (no training text?)")
    sp = spm.SentencePieceProcessor(model_proto=proto)
    for path in (model_path, vocab_path):
        remove_stale_temps(path)
    # the .vocab block closes (and renames) first, the .model after it; a failure in either
    # block removes both temporaries, so the old pair (if any) stays as it was
    with atomic_write(model_path, "wb") as model_file, atomic_write(vocab_path, "w") as vocab_file:
        for i in range(sp.get_piece_size()):
            vocab_file.write(f"{sp.id_to_piece(i)}\t{sp.get_score(i):g}\n")
        model_file.write(proto)
        model_file.flush()  # a failed write must surface before the .vocab is renamed
    return model_path


@dataclass
class TokenizerTrainConfig:
    sources: list = field(default_factory=list)  # "PATH" strings or SourceSpec mappings, as for prep
    text_field: str = "text"                     # JSON field holding the document text
    vocab_size: int = in_range(4096, f"[{len(SPECIAL_PIECES) + 257}, inf)")  # pieces, the special ones included
    out: str = "runs/tokenizer/sp4096"           # writes OUT.model and OUT.vocab
    mirror: str | None = None                    # fills ${SPROUT_MIRROR} in paths
    max_chars: int = in_range(200_000_000, "[0, inf)")  # training text cap (sources interleaved); 0: none
    clean: bool = True                           # apply the pipeline's cleaning (sprout.prep.clean) first
    strict: bool = False                         # fail on an invalid JSON line instead of skipping it
    # skip the documents that prep's hash-fraction split with this val_frac sends to val, so val bpb is honest
    exclude_val_frac: float = in_range(0.0, "[0, 1)")
    split_digits: bool = True                    # every digit its own piece (numbers spelt digit by digit)


def train_from_sources(cfg: TokenizerTrainConfig) -> Path:
    """Train `cfg.out`.model on the sources, interleaved document by document, cleaned like
    the pretraining data (so the tokenizer sees the text it will encode)."""
    if cfg.out.partition(":")[0] in ("tiktoken", "sentencepiece", "hf"):
        raise SproutError(f"out {cfg.out!r}: expected a path prefix (writes OUT.model), not a tokenizer spec; only "
                          f"SentencePiece models are trained here (an hf: tokenizer comes with its imported model)")
    mirror = mirror_dir(cfg.mirror)
    streams = []
    for i, item in enumerate(cfg.sources):
        spec = parse_source_arg(item) if isinstance(item, str) else from_dict(SourceSpec, item, f"sources[{i}]")
        spec.path = expand_path(spec.path, mirror)
        streams.append(iter_documents(spec, cfg.text_field, strict=cfg.strict))
    if not streams:
        raise SproutError("no sources given (--source PATH or sources: in the config)")
    cleaner = Cleaner(CleanConfig()) if cfg.clean else None
    threshold = val_threshold(cfg.exclude_val_frac)  # 0: nothing excluded

    def interleaved() -> Iterator[str]:
        live = list(streams)
        while live:
            for stream in list(live):
                text = next(stream, None)
                if text is None:
                    live.remove(stream)
                elif cleaner is None or (text := cleaner(text)) is not None:
                    if key_low(text_key(text)) >= threshold:
                        yield text

    return train_sentencepiece(interleaved(), cfg.out, cfg.vocab_size, max_chars=cfg.max_chars,
                               split_digits=cfg.split_digits)
