"""Import a published Llama-family model into a sprout run folder (`scripts/import_model.py`).

    imported = read_source("HuggingFaceTB/SmolLM2-135M-Instruct", workdir)   # or a folder, or a .gguf
    result = write_run(imported, "runs/smollm2")
    print(summary(result))

A source is a local Hugging Face folder, a hub id (`huggingface_hub.snapshot_download`, the
revision recorded as the snapshot's commit) or a `.gguf` file (transformers' GGUF loader,
dequantised to float32). config.json is read as transformers reads it (`sprout.model.hf_config`:
what sprout does not compute is refused in one line naming the field). Weights map by
`sprout.model.export.sprout_weight_name`, every weight float32 and finite; a tied head is
tied as `from_pretrained` ties it (a stored lm_head.weight that differs from the embedding is
kept: the model is untied; a stored head without an embedding is the embedding). The run folder
(`write_run`) is what a training stage leaves: an "lm" checkpoint of stage "import", step 0,
whose meta.json records the source and its config.json, and the tokenizer bundle with the chat
format detected from its own template (`sprout.chat_detect.folder_chat_format`); it is built in
a staging folder inside the run folder and moved into place (`sprout.model.import_staging`).
Errors name the source's files, never the staging copies. A PEFT LoRA adapter beside the source
is merged into the weights and recorded as meta.json's `adapter`.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from sprout.atomic import sha256_file
from sprout.chat_detect import folder_chat_format
from sprout.chat_formats import ChatFormat, read_chat_template, write_chat_format
from sprout.checkpoint import bundle_tokenizer, save_rotating
from sprout.config import config_to_dict
from sprout.errors import SproutError
from sprout.mirror import expand_path
from sprout.model.config import ModelConfig
from sprout.model.export import LM_HEAD, sprout_weight_name
from sprout.model.hf_config import architecture, import_reward_score, model_config, rope_note
from sprout.model.import_staging import ImportStaging
from sprout.model.peft_adapter import ADAPTER_WEIGHTS, merge_peft_adapter
from sprout.model.transformer import Transformer
from sprout.tokenizer import CHAT_TEMPLATE_FILE, HF_FILE, HF_SIDE_FILES, load_tokenizer, read_json_object

EMBED = "model.embed_tokens.weight"  # transformers' name of the embedding an LM head may be tied to
WEIGHTS_FILE, WEIGHTS_INDEX = "model.safetensors", "model.safetensors.index.json"
HUB_FILES = ["config.json", "model*.safetensors", WEIGHTS_INDEX, HF_FILE, *HF_SIDE_FILES, CHAT_TEMPLATE_FILE]
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
IMPORT_EXTRA = "pip install 'sprout[import]'"


@dataclass
class Source:
    """What an import reads: the model's config.json, its weights under transformers' names, and
    a folder holding its tokenizer files."""

    name: str  # the run's tokenizer folder: tokenizer/NAME/
    record: dict  # meta.json's `source`
    config: dict  # config.json
    config_file: str  # where config.json came from, for errors
    tokenizer_dir: Path
    tokenizer_origin: str = ""  # what errors name for the tokenizer files (a GGUF's are saved under workdir)
    weights: dict[str, torch.Tensor] | None = None  # read already (a GGUF), else from weight_files
    weight_files: list[Path] = field(default_factory=list)
    hf_model: object = None  # a GGUF's transformers model (tests compare against it)


@dataclass
class Imported:
    """A source read and checked: the sprout model, and its tokenizer staged with its chat format."""

    source: Source
    model: Transformer
    tokenizer_dir: Path  # tokenizer files + chat_template.jinja + chat_format.json, ready to bundle
    tokenizer: object
    chat_format: ChatFormat | None  # None: the source has no chat template
    reward_score: dict | None = None  # config.json's sprout_reward_score (`import_reward_score`)
    adapter: dict | None = None  # a PEFT LoRA adapter merged in: meta.json's `adapter` (`merge_peft_adapter`)
    notes: list[str] = field(default_factory=list)  # how a field was read, for the summary (e.g. untied)


@dataclass
class ImportResult:
    out: Path
    checkpoint: Path
    imported: Imported
    files: list[str]  # relative to out


# ---- sources -------------------------------------------------------------------------------------
def read_source(source: str, workdir: Path, *, revision: str | None = None, max_seq_len: int | None = None,
                tokenizer_name: str | None = None, adapter: str | None = None) -> Imported:
    """Open `source` (a folder, a hub id or a .gguf file; see the module doc; `${SPROUT_MIRROR}`
    is filled in), build the sprout model from it and stage its tokenizer under `workdir` with its
    chat format, in a folder named `tokenizer_name` (default: the source's name). `adapter`: a
    PEFT LoRA adapter folder merged into the weights (`sprout.model.peft_adapter.merge_peft_adapter`)."""
    source = expand_path(source)
    path = Path(source)
    if path.suffix == ".gguf":
        src = gguf_source(path, workdir)
    elif path.is_dir():
        src = folder_source(path)
    elif not path.exists() and HUB_ID.fullmatch(source):
        src = hub_source(source, revision)
    else:
        raise SproutError(f"{source}: no such folder or .gguf file, and not a hub id (owner/name)")
    src.name = tokenizer_name or src.name
    cfg = model_config(src.config, src.config_file, max_seq_len)
    score = import_reward_score(src.config, src.config_file)
    origin = src.tokenizer_origin or str(src.tokenizer_dir)
    tok_dir, tok, fmt = stage_tokenizer(src.tokenizer_dir, workdir / "tokenizer" / src.name, origin)
    if tok.vocab_size > cfg.vocab_size:
        named = origin if src.tokenizer_origin else Path(origin) / HF_FILE
        raise SproutError(f"{named}: vocab {tok.vocab_size} does not fit the model's vocab_size {cfg.vocab_size} "
                          f"({src.config_file})")
    model, notes = build_model(cfg, src)
    merged = None
    if adapter is not None:
        merged = merge_peft_adapter(model, expand_path(adapter), src.config_file)
        where = f"{Path(merged['path']) / ADAPTER_WEIGHTS} merged into the model of {src.config_file}"
        for name, p in model.state_dict().items():
            check_finite(name, p, where)
    note = rope_note(src.config)
    if merged is not None and (base := merged["base_model_name_or_path"]) and not names_source(base, source):
        notes.append(f"adapter: {merged['path']} names {base} as its base (adapter_config.json "
                     f"base_model_name_or_path), not {source}; its shapes match, check it is the same model")
    return Imported(src, model, tok_dir, tok, fmt, score, merged, notes + ([note] if note else []))


def names_source(base: str, source: str) -> bool:
    """Whether an adapter's base name could be `source`: its last part (`SmolLM2-135M-Instruct` of
    a hub id or a folder) within the source's path or id, or the other way round, ignoring case."""
    last = [Path(x.rstrip("/")).name.lower() for x in (base, source)]
    return last[0] in source.lower() or Path(last[1]).stem.split(".")[0] in base.lower()


def folder_source(folder: Path) -> Source:
    """A local Hugging Face folder: config.json, safetensors weights, tokenizer files."""
    config_file = folder / "config.json"
    index = folder / WEIGHTS_INDEX
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise SproutError(f"{index}: not a safetensors index ({exc})") from None
        files = [folder / name for name in shards]
    elif (folder / WEIGHTS_FILE).is_file():
        files = [folder / WEIGHTS_FILE]
    else:
        raise SproutError(f"{folder}: no {WEIGHTS_FILE} or {WEIGHTS_INDEX} (only safetensors weights are imported)")
    for f in files:
        if not f.is_file():
            raise SproutError(f"{f}: weights shard missing (named by {index})")
    return Source(folder.resolve().name, {"kind": "folder", "path": str(folder.resolve())}, read_config(config_file),
                  str(config_file), folder, weight_files=files)


def hub_source(repo_id: str, revision: str | None) -> Source:
    """A hub model, through `huggingface_hub.snapshot_download` (its cache; HF_HUB_OFFLINE honoured)."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    except ImportError:
        raise SproutError(f"{repo_id}: fetching from the hub needs huggingface_hub: {IMPORT_EXTRA}") from None
    try:
        folder = Path(snapshot_download(repo_id, revision=revision, allow_patterns=HUB_FILES))
    except LocalEntryNotFoundError:
        raise SproutError(f"{repo_id}: not in the Hugging Face cache, and the hub cannot be reached "
                          f"(offline, or HF_HUB_OFFLINE=1)") from None
    except (HfHubHTTPError, OSError, ValueError) as exc:
        raise SproutError(f"{repo_id}: cannot fetch from the hub ({str(exc).splitlines()[0]})") from None
    src = folder_source(folder)
    src.name, src.record = repo_id.rsplit("/", 1)[-1], {"kind": "hub", "id": repo_id, "revision": folder.name}
    return src


def gguf_source(path: Path, workdir: Path) -> Source:
    """A GGUF file through transformers' GGUF loader: the model dequantised to float32, the
    tokenizer saved as tokenizer files under `workdir`."""
    if not path.is_file():
        raise SproutError(f"{path}: no such GGUF file")
    try:
        import gguf  # noqa: F401 - transformers' loader needs it; checked here to say so in one line
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError:
        raise SproutError(f"{path}: reading a GGUF file needs the 'import' extra: {IMPORT_EXTRA}") from None
    folder, name = path.resolve().parent, path.name
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise SproutError(f"{path}: transformers cannot read this GGUF ({str(exc).splitlines()[0]})") from None
    tok_dir = workdir / "gguf_tokenizer"
    tokenizer.save_pretrained(tok_dir)
    config = json.loads(model.config.to_json_string(use_diff=False))
    config["architectures"] = config.get("architectures") or [type(model).__name__]
    config.pop("quantization_config", None)  # {"quant_method": "gguf"}: the loader has dequantised the weights
    record = {"kind": "gguf", "path": str(path.resolve()), "sha256": sha256_file(path)}
    return Source(path.stem, record, config, f"{path} (its config)", tok_dir, f"{path} (its tokenizer)",
                  weights=model.state_dict(), hf_model=model)


def read_config(path: Path) -> dict:
    if not path.is_file():
        raise SproutError(f"{path}: no config.json (not a Hugging Face model folder)")
    return read_json_object(path)


# ---- weights -------------------------------------------------------------------------------------
def source_weights(src: Source) -> dict[str, tuple[torch.Tensor, str]]:
    """{transformers name: (tensor, the file it came from)} of a source."""
    if src.weights is not None:
        return {name: (t, src.record.get("path", src.name)) for name, t in src.weights.items()}
    out = {}
    for f in src.weight_files:
        try:
            tensors = load_file(f)
        except (SafetensorError, OSError) as exc:
            raise SproutError(f"{f}: not a readable safetensors file ({str(exc).splitlines()[0]}); "
                              f"truncated or corrupted?") from None
        out.update((name, (t, str(f))) for name, t in tensors.items())
    return out


def check_finite(name: str, tensor: torch.Tensor, where: str) -> None:
    """Refuse a weight holding NaN or infinite values, naming the tensor and `where` (its file)."""
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        bad = ~torch.isfinite(tensor)
        first = [int(i) for i in bad.nonzero()[0]]
        raise SproutError(f"{where}: tensor {name} holds {int(bad.sum()):,} NaN or infinite value(s) (the first "
                          f"at index {first}); a model with them computes NaN logits")


def build_model(cfg: ModelConfig, src: Source) -> tuple[Transformer, list[str]]:
    """(a sprout `Transformer` of `cfg` holding the source's weights in float32, notes for the
    summary); the head tied or not as transformers ties it (module doc)."""
    weights = source_weights(src)
    for hf_name, (tensor, where) in weights.items():
        check_finite(hf_name, tensor, where)
    notes = []
    head, embed = weights.get(LM_HEAD), weights.get(EMBED)
    if cfg.tie_embeddings and head is not None:
        if embed is None:
            weights[EMBED] = head
            notes.append("tie_word_embeddings: the folder stores lm_head.weight and no embedding; the embedding "
                         "is that head, as transformers ties them")
        elif not torch.equal(head[0].to(torch.float32), embed[0].to(torch.float32)):
            cfg = dataclasses.replace(cfg, tie_embeddings=False)
            notes.append(f"tie_word_embeddings is true, but {head[1]} stores its own lm_head.weight, which differs "
                         f"from the embedding: imported untied, as transformers loads it")
    model = Transformer(cfg).eval()
    own = model.state_dict()
    state = {}
    for hf_name, (tensor, where) in weights.items():
        if hf_name.endswith("rotary_emb.inv_freq") or (cfg.tie_embeddings and hf_name == LM_HEAD):
            continue  # a buffer older checkpoints stored; a tied head is the embedding (equal to it)
        name = sprout_weight_name(hf_name)
        if name not in own:
            raise SproutError(f"{where}: tensor {hf_name} has no place in sprout's model ({src.config_file})")
        if tuple(tensor.shape) != tuple(own[name].shape):
            raise SproutError(f"{where}: tensor {hf_name} has shape {tuple(tensor.shape)}, the config gives "
                              f"{tuple(own[name].shape)}")
        state[name] = tensor.to(torch.float32)
    if cfg.tie_embeddings and "embed_tokens.weight" in state:
        state[LM_HEAD] = state["embed_tokens.weight"]
    missing = sorted(set(own) - set(state))
    if missing:
        hint = " (tie_word_embeddings is false)" if missing == [LM_HEAD] else ""
        raise SproutError(f"{src.config_file}: the weights lack {', '.join(missing[:4])}{hint}")
    model.load_state_dict(state, strict=True)
    return model, notes


# ---- tokenizer and chat format -------------------------------------------------------------------
def stage_tokenizer(folder: Path, dest: Path, origin: str | None = None):
    """(dest, tokenizer, chat format or None): the tokenizer files of `folder` copied to `dest`
    with the Jinja template as `chat_template.jinja` and the detected `chat_format.json`. Errors
    name `origin` (default: `folder`), never `dest`: the staging copy is gone by the time they are read."""
    try:
        return _stage_tokenizer(folder, dest)
    except SproutError as exc:
        message = str(exc)
        for staged in sorted({str(p) for q in (dest, folder) for p in (q, q.resolve())}, key=len, reverse=True):
            message = message.replace(staged, origin or str(folder))
        raise SproutError(message) from None


def _stage_tokenizer(folder: Path, dest: Path):
    if not (folder / HF_FILE).is_file():
        raise SproutError(f"{folder}: no {HF_FILE} (an import needs the Hugging Face tokenizer files: "
                          f"{HF_FILE}, {HF_SIDE_FILES[0]})")
    dest.mkdir(parents=True)
    for name in (HF_FILE, *HF_SIDE_FILES, CHAT_TEMPLATE_FILE):
        if (folder / name).is_file():
            shutil.copyfile(folder / name, dest / name)
    tok = load_tokenizer(f"hf:{dest}")
    found = read_chat_template(dest)
    if found is None:
        return dest, tok, None
    fmt = folder_chat_format(dest, tok)  # before the template is written as a file: errors name where it was
    (dest / CHAT_TEMPLATE_FILE).write_text(found[0], encoding="utf-8")
    write_chat_format(dest, fmt)
    return dest, tok, fmt


# ---- the run folder ------------------------------------------------------------------------------
def write_run(imported: Imported, out: str | Path, staging: ImportStaging | None = None) -> ImportResult:
    """Write the run folder (see the module doc): built under `staging` (an `ImportStaging` of
    `out`; one of its own when None), the tokenizer first, then the checkpoint, whose `latest`
    pointer comes last, every file atomically; then moved into `out` (`ImportStaging.publish`)."""
    out = Path(out)
    if staging is None:
        with ImportStaging(out) as own:
            return write_run(imported, out, own)
    src, model, tok, fmt = imported.source, imported.model, imported.tokenizer, imported.chat_format
    fields = bundle_tokenizer(f"hf:{imported.tokenizer_dir}", staging.run)
    run_copy = (out / fields["tokenizer_file"]).parent.resolve()
    meta = {"model_config": config_to_dict(model.config), "tokenizer": f"hf:{run_copy}", **fields,
            "tokenizer_fingerprint": tok.fingerprint(), "stage": "import", "step": 0, "tokens_seen": 0,
            "run_id": uuid.uuid4().hex, "source": src.record, "source_config": src.config}
    if fmt is not None:
        meta["template_version"] = fmt.version
    if imported.reward_score is not None:
        meta["reward_score"] = imported.reward_score
    if imported.adapter is not None:
        meta["adapter"] = imported.adapter
    ckpt = save_rotating(staging.run / "checkpoints", 0, model, meta=meta).relative_to(staging.run)
    staging.publish(last="checkpoints")  # `latest` arrives with the last rename
    tok_files = [f"{Path(fields['tokenizer_file']).parent}/{n}" for n in
                 (HF_FILE, *fields["tokenizer_side_sha256"])]
    files = [f"{ckpt}/{n}" for n in ("model.safetensors", "train_state.pt", "meta.json")]
    return ImportResult(out, out / ckpt, imported, files + ["checkpoints/latest"] + tok_files)


def summary(result: ImportResult) -> str:
    """What `scripts/import_model.py` prints: source, shape, parameters, vocab, chat format, files."""
    imp = result.imported
    src, c = imp.source, imp.model.config
    origin = {"folder": lambda r: f"folder {r['path']}", "hub": lambda r: f"hub {r['id']} at revision {r['revision']}",
              "gguf": lambda r: f"GGUF {r['path']} (sha256 {r['sha256'][:12]}…)"}[src.record["kind"]](src.record)
    scores = (f", a reward model scoring {imp.reward_score['beta']:g} × a response's summed log-probability"
              if imp.reward_score else "")
    arch = architecture(src.config, src.config_file)
    lines = [f"imported {arch} from {origin} as a sprout 'lm' checkpoint{scores}",
             f"  {imp.model.num_params():,} parameters: {c.n_layers} layers, d_model {c.d_model}, {c.n_heads} heads "
             f"({c.kv_heads} key/value) of size {c.head_dim}, feed-forward {c.ff_dim}, context {c.max_seq_len:,}"
             + (", tied embeddings" if c.tie_embeddings else "") + (", q/k/v biases" if c.attention_bias else "")
             + (f", rope scaling {c.rope_scaling['rope_type']}" if c.rope_scaling else ""),
             f"  vocab {c.vocab_size:,} (tokenizer {imp.tokenizer.vocab_size:,} ids)"]
    lines += [f"  {note}" for note in imp.notes]
    if imp.adapter is not None:
        a = imp.adapter
        lines.append(f"  merged the PEFT LoRA adapter {a['path']} (r {a['r']}, lora_alpha {a['lora_alpha']:g}"
                     f"{', rslora' if a['use_rslora'] else ''} on {', '.join(map(str, a['target_modules']))}; "
                     f"sha256 {a['sha256'][:12]}…) into the weights")
    if imp.chat_format is None:
        lines.append("  chat format: the source has no chat template; none written, sprout's default format applies")
    else:
        fmt = imp.chat_format
        system = f", default system message {fmt.default_system!r}" if fmt.default_system else ""
        lines.append(f"  chat format: {fmt.name} ({fmt.version}){system}, detected from its chat template")
    folders: dict[str, list[str]] = {}
    for f in result.files:
        folders.setdefault(str(Path(f).parent), []).append(Path(f).name)
    written = [f"{d}/{names[0]}" if len(names) == 1 else f"{d}/{{{', '.join(names)}}}" for d, names in folders.items()]
    lines.append(f"wrote {result.out}/: " + ", ".join(written))
    return "\n".join(lines)
