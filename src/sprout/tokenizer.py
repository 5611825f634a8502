"""Runtime tokenizers behind one spec string. `EOT` (`<|endoftext|>`) is the end-of-text piece
every module uses: the document separator, the eot id's piece, the chat template's turn end.

    load_tokenizer("tiktoken:r50k_base")        # GPT-2's BPE, 50,257 ids ("tiktoken:gpt2": same ranks)
    load_tokenizer("sentencepiece:PATH.model")  # e.g. one trained by `sprout.prep.tokenizer_train`
    load_tokenizer("hf:FOLDER")                 # an imported model's FOLDER/tokenizer.json ("hf:PATH.json")

tiktoken ranks load offline from the data mirror's `tokenizers/gpt2.tiktoken` (`sprout.mirror`;
byte-identical to r50k_base.tiktoken), else through tiktoken's download. `hf:` encodes as
`AutoTokenizer.from_pretrained(folder)` with `add_special_tokens=False` (an added token typed
in the text IS its single id); bos, eos and pad come from `tokenizer_config.json`.
The fingerprint is the sha256 of the tokenizer's file (the .model, the tokenizer.json, the
ranks), which data and checkpoints record (`sprout.tokenizer_files` checks a tokenizer's files
against such a record).
`byte_luts()` gives `sprout.bpb` three per-id tables: bytes of the piece, a leading "▁", and
boundary (control) ids; a target covers `base[t] + (lead[t] & ~boundary[prev])` bytes. A "▁"
inside a piece counts as one byte; without a dummy prefix (`sprout.prep.tokenizer_train`'s
models) every "▁" is folded into the base bytes; tiktoken ids count their exact bytes; `hf:`
tables exist only for byte-level tokenizers (others are refused rather than counted wrongly).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from pathlib import Path
from typing import Sequence

import numpy as np

from sprout.atomic import sha256_file
from sprout.errors import SproutError
from sprout.mirror import mirror_dir

EOT = "<|endoftext|>"

R50K_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
R50K_MIRROR_FILE = "tokenizers/gpt2.tiktoken"
R50K_PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
TIKTOKEN_NAMES = ("r50k_base", "gpt2")  # gpt2 uses the same ranks as r50k_base
HF_FILE = "tokenizer.json"
HF_SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json")  # read when beside HF_FILE
CHAT_FORMAT_FILE = "chat_format.json"  # the chat format sprout detected (`sprout.chat_formats`)
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # a tokenizer's template as a file of its own (transformers 5 writes it)


class Tokenizer:
    """The surface every tokenizer kind shares (see the module docstring)."""

    spec: str
    name: str
    file: Path | None  # the file it was loaded from; None for tiktoken ranks from tiktoken's cache
    # (meta.json, template_version) of the checkpoint whose record it was loaded from
    # (`sprout.checkpoint.checkpoint_tokenizer`; `sprout.chat_formats.format_for` reads it)
    checkpoint: tuple[str, str | None] | None = None
    vocab_size: int
    eot_id: int
    bos_id: int | None
    pad_id: int | None

    def __init__(self, spec: str, mirror: str | None) -> None:
        self.spec = spec
        self._mirror = mirror
        self._luts: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._fingerprint: str | None = None

    def __reduce__(self):  # workers rebuild from the spec instead of pickling native objects
        return (load_tokenizer, (self.spec, self._mirror), {"checkpoint": self.checkpoint})

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r}, vocab_size={self.vocab_size}, eot_id={self.eot_id})"

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        raise NotImplementedError

    def decode(self, ids) -> str:
        raise NotImplementedError

    def special_id(self, piece: str) -> int | None:
        raise NotImplementedError

    def encode_docs(self, texts: Sequence[str], append_eot: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """Encode documents to one flat uint32 array (eot after each when asked) and the
        per-document token counts (eot included)."""
        lists = self.encode_batch(list(texts))
        lengths = np.fromiter((len(x) + append_eot for x in lists), dtype=np.int64, count=len(lists))
        flat = np.empty(int(lengths.sum()), dtype=np.uint32)
        pos = 0
        for ids, n in zip(lists, lengths):
            flat[pos : pos + len(ids)] = ids
            pos += int(n)
            if append_eot:
                flat[pos - 1] = self.eot_id
        return flat, lengths

    def byte_luts(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if self._luts is None:
            self._luts = self._build_luts()
        return self._luts

    def fingerprint(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = self._compute_fingerprint()
        return self._fingerprint


class TiktokenTokenizer(Tokenizer):
    """GPT-2 BPE through tiktoken; `<|endoftext|>` (50256) is the only special id."""

    def __init__(self, spec: str, name: str, mirror: str | None) -> None:
        super().__init__(spec, mirror)
        import tiktoken

        root = mirror_dir(mirror)
        self.ranks_file: Path | None = None
        if root is not None:
            path = root / R50K_MIRROR_FILE
            if not path.is_file():
                raise SproutError(f"{path}: tiktoken ranks not found in mirror {root}")
            ranks = _load_ranks(path)
            self.ranks_file = path
            self._enc = tiktoken.Encoding(
                name=name, explicit_n_vocab=50257, pat_str=R50K_PAT,
                mergeable_ranks=ranks, special_tokens={EOT: 50256},
            )
        else:
            try:
                self._enc = tiktoken.get_encoding(name)
            except Exception as exc:  # network failure, cache problems
                raise SproutError(
                    f"tiktoken:{name}: cannot load ranks ({type(exc).__name__}: {exc}); "
                    "pass --mirror DIR or set SPROUT_MIRROR to a folder with tokenizers/gpt2.tiktoken"
                ) from None
        self.name = name
        self.file = self.ranks_file
        self.vocab_size = self._enc.n_vocab
        self.eot_id = self._enc.eot_token
        self.bos_id = None
        self.pad_id = None

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def encode_batch(self, texts: list[str], num_threads: int = 8) -> list[list[int]]:
        return self._enc.encode_ordinary_batch(texts, num_threads=num_threads)

    def encode_docs(self, texts: Sequence[str], append_eot: bool = True) -> tuple[np.ndarray, np.ndarray]:
        # encode_to_numpy with no specials allowed or disallowed == encode_ordinary, without lists
        arrays = [self._enc.encode_to_numpy(t, allowed_special=set(), disallowed_special=()) for t in texts]
        if append_eot:
            eot = np.array([self.eot_id], dtype=np.uint32)
            arrays = [a for arr in arrays for a in (arr, eot)]
            lengths = np.fromiter((len(a) for a in arrays[::2]), dtype=np.int64, count=len(texts)) + 1
        else:
            lengths = np.fromiter((len(a) for a in arrays), dtype=np.int64, count=len(texts))
        flat = np.concatenate(arrays).astype(np.uint32, copy=False) if arrays else np.zeros(0, np.uint32)
        return flat, lengths

    def decode(self, ids) -> str:
        return self._enc.decode([int(i) for i in ids])

    def special_id(self, piece: str) -> int | None:
        return self.eot_id if piece == EOT else None

    def token_bytes_of(self, token_id: int) -> bytes:
        return self._enc.decode_single_token_bytes(token_id)

    def _build_luts(self):
        v = self.vocab_size
        base = np.zeros(v, dtype=np.int16)
        boundary = np.zeros(v, dtype=bool)
        for i in range(v):
            if i == self.eot_id:
                boundary[i] = True
            else:
                base[i] = len(self._enc.decode_single_token_bytes(i))
        return base, np.zeros(v, dtype=bool), boundary

    def _compute_fingerprint(self) -> str:
        # sha256 of the ranks file, rebuilt from the ranks when they came from tiktoken's cache,
        # so the same ranks fingerprint the same however they were loaded.
        if self.ranks_file is not None:
            return sha256_file(self.ranks_file)
        h = hashlib.sha256()
        for i in range(self.vocab_size):
            if i != self.eot_id:
                h.update(base64.b64encode(self._enc.decode_single_token_bytes(i)) + b" %d\n" % i)
        return h.hexdigest()


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model; `<|endoftext|>` if present (else the model's eos) is eot."""

    def __init__(self, spec: str, path: Path, mirror: str | None) -> None:
        super().__init__(spec, mirror)
        import sentencepiece as spm

        self.path = self.file = path
        try:
            self._sp = spm.SentencePieceProcessor(model_file=str(path))
        except Exception as exc:
            raise SproutError(f"{path}: not a valid SentencePiece model ({exc})") from None
        sp = self._sp
        self.name = path.stem
        self.vocab_size = int(sp.get_piece_size())
        eot = self.special_id(EOT)
        self.eot_id = eot if eot is not None else int(sp.eos_id())
        if self.eot_id < 0:
            raise SproutError(f"{path}: model has neither an {EOT} piece nor an eos id")
        bos, pad = self.special_id("<|bos|>"), self.special_id("<|pad|>")
        self.bos_id = bos if bos is not None else (int(sp.bos_id()) if sp.bos_id() >= 0 else None)
        self.pad_id = pad if pad is not None else (int(sp.pad_id()) if sp.pad_id() >= 0 else None)
        first = sp.encode("a", out_type=str)
        self.dummy_prefix = bool(first) and first[0].startswith("▁")

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: list[str], num_threads: int = 1) -> list[list[int]]:
        return self._sp.encode(texts, num_threads=num_threads)

    def decode(self, ids) -> str:
        return self._sp.decode([int(i) for i in ids])

    def special_id(self, piece: str) -> int | None:
        i = int(self._sp.piece_to_id(piece))
        if i == self._sp.unk_id() and piece != self._sp.id_to_piece(i):
            return None
        return i

    def _build_luts(self):
        sp, v = self._sp, self.vocab_size
        base = np.zeros(v, dtype=np.int16)
        lead = np.zeros(v, dtype=bool)
        boundary = np.ones(v, dtype=bool)
        for i in range(v):
            if sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i):
                continue
            boundary[i] = False
            if sp.is_byte(i):
                base[i] = 1
                continue
            piece = sp.id_to_piece(i)
            if self.dummy_prefix and piece.startswith("▁"):
                lead[i] = True
                piece = piece[1:]
            base[i] = len(piece.replace("▁", " ").encode("utf-8"))
        return base, lead, boundary

    def _compute_fingerprint(self) -> str:
        return sha256_file(self.path)


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizer.json` through the `tokenizers` library, encoding and decoding as
    `AutoTokenizer.from_pretrained(folder)` with `add_special_tokens=False` (decode writes special
    tokens back as text). `tokenizer_config.json` beside it names bos, eos and pad
    (`special_tokens_map.json` overrides it only when the config has no `added_tokens_decoder`);
    eot is `<|endoftext|>` when that is a special token, else eos; vocab_size is one past the
    largest id, added tokens included; the fingerprint is the sha256 of tokenizer.json."""

    def __init__(self, spec: str, path: Path, mirror: str | None) -> None:
        super().__init__(spec, mirror)
        from tokenizers import Tokenizer as Backend

        self.path = self.file = path
        try:
            self._tk = Backend.from_str(path.read_text(encoding="utf-8"))
        except Exception as exc:  # bad JSON, not UTF-8, a layout tokenizers does not know
            raise SproutError(f"{path}: not a valid tokenizer.json ({str(exc).splitlines()[0]})") from None
        self._tk.no_truncation()  # transformers encodes whole texts unless asked otherwise
        self._tk.no_padding()
        self.name = path.parent.name
        self._added = {t.content: i for i, t in self._tk.get_added_tokens_decoder().items()}
        self._special = {i for i, t in self._tk.get_added_tokens_decoder().items() if t.special}
        self.vocab_size = max(self._tk.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        config = hf_special_tokens(path.parent)
        self._tk.encode_special_tokens = bool(config.get("split_special_tokens"))
        bos, eos, pad = (self._config_id(config, k) for k in ("bos_token", "eos_token", "pad_token"))
        eot = self.special_id(EOT)
        self.eot_id = eot if eot is not None and eot in self._special else eos
        if self.eot_id is None:
            raise SproutError(f"{path}: no special {EOT} token and no eos_token in {HF_SIDE_FILES[0]} beside it; "
                              f"no document separator")
        self.bos_id, self.pad_id = bos, pad

    def _config_id(self, config: dict, key: str) -> int | None:
        token = config.get(key)
        if token is None:
            return None
        i = self._tk.token_to_id(token)
        if i is None:
            raise SproutError(f"{self.path.parent}: {key} {token!r} of {HF_SIDE_FILES[0]} "
                              f"is not a token of {self.path.name}")
        return i

    def encode(self, text: str) -> list[int]:
        return self._tk.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tk.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self._tk.decode([int(i) for i in ids], skip_special_tokens=False)

    def special_id(self, piece: str) -> int | None:
        return self._added.get(piece)

    def _build_luts(self):
        from tokenizers import decoders

        decoder = self._tk.decoder
        if not isinstance(decoder, decoders.ByteLevel):
            raise SproutError(f"{self.path}: bits per byte needs a byte-level tokenizer (decoder ByteLevel), "
                              f"this one decodes with {type(decoder).__name__ if decoder else 'no decoder'}")
        to_byte = {c: b for b, c in bytes_to_unicode().items()}
        v = self.vocab_size
        base = np.zeros(v, dtype=np.int16)
        boundary = np.zeros(v, dtype=bool)
        for i in range(v):
            piece = self._tk.id_to_token(i)
            if piece is None or i in self._special:
                boundary[i] = True
            elif all(c in to_byte for c in piece):  # the ByteLevel decoder's rule, piece by piece
                base[i] = len(piece)
            else:  # a piece outside the byte alphabet is decoded as its own UTF-8
                base[i] = len(piece.encode("utf-8"))
        return base, np.zeros(v, dtype=bool), boundary

    def _compute_fingerprint(self) -> str:
        return sha256_file(self.path)


def load_tokenizer(spec: str, mirror: str | None = None) -> Tokenizer:
    """Build a tokenizer from its spec string; `mirror` as for `sprout.mirror.mirror_dir`."""
    kind, sep, arg = spec.partition(":")
    if not sep or not arg:
        raise SproutError(f"tokenizer spec {spec!r}: expected tiktoken:NAME, sentencepiece:PATH.model or hf:PATH")
    if kind == "tiktoken":
        if arg not in TIKTOKEN_NAMES:
            raise SproutError(f"tokenizer spec {spec!r}: unknown tiktoken encoding (known: {', '.join(TIKTOKEN_NAMES)})")
        return TiktokenTokenizer(spec, arg, mirror)
    if kind not in ("sentencepiece", "hf"):
        raise SproutError(f"tokenizer spec {spec!r}: unknown kind {kind!r} (expected tiktoken, sentencepiece or hf)")
    path = spec_file(spec, mirror)
    if kind == "sentencepiece":
        if not path.is_file():
            raise SproutError(f"{path}: SentencePiece model not found (tokenizer spec {spec!r})")
        return SentencePieceTokenizer(spec, path, mirror)
    if not path.is_file():
        where = "no such folder" if not path.parent.is_dir() else f"no {path.name} there"
        raise SproutError(f"{path}: Hugging Face tokenizer not found ({where}; tokenizer spec {spec!r})")
    return HFTokenizer(spec, path, mirror)


def spec_file(spec: str, mirror: str | None = None) -> Path | None:
    """The file a `sentencepiece:` or `hf:` spec names, as `load_tokenizer` resolves it (environment
    variables expanded; an `hf:` folder's tokenizer.json; a relative path not found here looked up
    in the mirror), present or not; None for any other spec."""
    kind, sep, arg = spec.partition(":")
    if kind not in ("sentencepiece", "hf") or not arg:
        return None
    path = Path(os.path.expandvars(arg))
    if kind == "hf":
        path = hf_json(path)
    root = mirror_dir(mirror)
    if not path.is_file() and root is not None and (root / path).is_file():
        path = root / path
    return path


def hf_json(path: Path) -> Path:
    """The tokenizer.json an `hf:` PATH names: PATH itself when it ends in .json, else PATH/tokenizer.json."""
    return path if path.suffix == ".json" else path / HF_FILE


def hf_special_tokens(folder: Path) -> dict:
    """bos/eos/pad token strings and `split_special_tokens` as transformers reads them from
    `folder`: tokenizer_config.json, overridden by special_tokens_map.json when the config has
    no `added_tokens_decoder`. A token may be written as a string or as {"content": ...}."""
    config, token_map = (read_json_object(folder / name) for name in HF_SIDE_FILES)
    if "added_tokens_decoder" not in config:
        config.update(token_map)
    out = {k: v.get("content") if isinstance(v, dict) else v
           for k in ("bos_token", "eos_token", "pad_token") if (v := config.get(k)) is not None}
    out["split_special_tokens"] = config.get("split_special_tokens", False)
    return out


def read_json_object(path: Path) -> dict:
    """A JSON object file's contents, {} when the file is absent; one-line error when unreadable."""
    if not path.is_file():
        return {}
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise SproutError(f"{path}: cannot read ({str(exc).splitlines()[0]})") from None
    if not isinstance(obj, dict):
        raise SproutError(f"{path}: expected a JSON object, got {type(obj).__name__}")
    return obj


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (Radford et al. 2019, encoder.py)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _load_ranks(path: Path) -> dict[bytes, int]:
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != R50K_SHA256:
        raise SproutError(f"{path}: sha256 {digest[:12]}… is not r50k_base's {R50K_SHA256[:12]}…; corrupted mirror file")
    ranks = {}
    for line in data.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks
