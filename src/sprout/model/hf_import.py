"""Import a published Llama-family model into a sprout run folder (`scripts/import_model.py`).

    imported = read_source("HuggingFaceTB/SmolLM2-135M-Instruct", workdir)   # or a folder, or a .gguf
    result = write_run(imported, "runs/smollm2")
    print(summary(result))

A source is a local Hugging Face folder, a hub id (`huggingface_hub.snapshot_download`, the
revision recorded as the snapshot's commit) or a `.gguf` file (transformers' GGUF loader,
dequantised to float32). Only what `Transformer` computes exactly is imported (`ARCHITECTURES`,
no sliding window shorter than the context used); anything else is refused in one line naming
the config.json field. Config fields map as `sprout.model.export` writes them, read backwards;
weights by `sprout.model.export.sprout_weight_name`, every weight float32. The run folder
(`write_run`) is what a training stage leaves: an "lm" checkpoint of stage "import", step 0,
whose meta.json records the source and its config.json, and the tokenizer bundle with the
chat format detected from its own template (`sprout.chat_detect.detect_chat_format`). A PEFT
LoRA adapter beside the source is merged into the weights and recorded as meta.json's `adapter`.
"""

from __future__ import annotations

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
from sprout.chat_detect import CHAT_TEMPLATE_FILE, detect_chat_format, read_chat_template
from sprout.chat_formats import ChatFormat, write_chat_format
from sprout.checkpoint import bundle_tokenizer, save_rotating
from sprout.config import config_to_dict
from sprout.errors import SproutError
from sprout.formats.checkpoint_meta import logprob_rule
from sprout.mirror import expand_path
from sprout.model.config import LLAMA3_ROPE, ModelConfig
from sprout.model.export import LM_HEAD, REWARD_SCORE_KEY, sprout_weight_name
from sprout.model.peft_adapter import merge_peft_adapter
from sprout.model.transformer import Transformer
from sprout.tokenizer import HF_FILE, HF_SIDE_FILES, hf_special_tokens, load_tokenizer, read_json_object

ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
MOE_FIELDS = ("num_local_experts", "num_experts", "num_experts_per_tok", "n_routed_experts", "moe_intermediate_size",
              "shared_expert_intermediate_size")
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
    tok_dir, tok, fmt = stage_tokenizer(src.tokenizer_dir, workdir / "tokenizer" / src.name)
    if tok.vocab_size > cfg.vocab_size:
        raise SproutError(f"{tok.path}: vocab {tok.vocab_size} does not fit the model's vocab_size {cfg.vocab_size}")
    model = build_model(cfg, src)
    merged = None
    if adapter is not None:
        merged = merge_peft_adapter(model, expand_path(adapter), src.config_file)
    return Imported(src, model, tok_dir, tok, fmt, score, merged)


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
    return Source(path.stem, record, config, f"{path} (its config)", tok_dir, weights=model.state_dict(),
                  hf_model=model)


def read_config(path: Path) -> dict:
    if not path.is_file():
        raise SproutError(f"{path}: no config.json (not a Hugging Face model folder)")
    return read_json_object(path)


# ---- config --------------------------------------------------------------------------------------
def rope_settings(config: dict, where: str) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling for `ModelConfig`) of a config.json: transformers 5's
    `rope_parameters` or the older `rope_theta` + `rope_scaling`."""
    params = config.get("rope_parameters") or {}
    scaling = {**(config.get("rope_scaling") or {}), **params}
    if any(isinstance(v, dict) for v in scaling.values()):
        raise SproutError(f"{where}: rope_parameters per layer type are not supported")
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    if scaling.get("partial_rotary_factor", 1.0) != 1.0:
        raise SproutError(f"{where}: partial_rotary_factor {scaling['partial_rotary_factor']} is not supported")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise SproutError(f"{where}: rope_scaling type {kind!r} is not supported (supported: default, llama3)")
    scaling.setdefault("original_max_position_embeddings", config.get("max_position_embeddings"))
    return theta, {"rope_type": "llama3", **{k: scaling.get(k) for k in LLAMA3_ROPE}}


def model_config(config: dict, where: str, max_seq_len: int | None = None) -> ModelConfig:
    """The sprout `ModelConfig` of a transformers config.json (refusing what sprout does not compute,
    naming the field; see the module doc); `max_seq_len` shortens the context."""
    archs = config.get("architectures") or []
    if len(archs) != 1 or archs[0] not in ARCHITECTURES:
        raise SproutError(f"{where}: architectures {archs} is not supported (supported: {', '.join(ARCHITECTURES)})")
    arch = archs[0]
    act = config.get("hidden_act", "silu")
    if act != "silu":
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
            if config.get(name):
                raise SproutError(f"{where}: {name} true is not supported (sprout's Llama has no such biases)")
    context = int(config.get("max_position_embeddings", 2048))
    if max_seq_len is not None:
        if not 0 < max_seq_len <= context:
            raise SproutError(f"max_seq_len {max_seq_len} must be between 1 and the model's "
                              f"max_position_embeddings {context} ({where})")
        context = max_seq_len
    sliding = arch == "MistralForCausalLM" or config.get("use_sliding_window") \
        or "sliding_attention" in (config.get("layer_types") or [])
    window = config.get("sliding_window") if sliding else None
    if window is not None and window < context:
        raise SproutError(f"{where}: sliding_window {window} is shorter than the context {context} (sliding-window "
                          f"attention is not supported; a max_seq_len of at most {window} avoids it)")
    theta, scaling = rope_settings(config, where)
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    try:
        return ModelConfig(vocab_size=config["vocab_size"], d_model=hidden, n_layers=config["num_hidden_layers"],
                           n_heads=heads, n_kv_heads=config.get("num_key_value_heads") or heads,
                           d_ff=config["intermediate_size"], max_seq_len=context, rope_theta=theta,
                           norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                           tie_embeddings=bool(config.get("tie_word_embeddings", False)),
                           init_std=float(config.get("initializer_range", 0.02)),
                           d_head=None if head_dim * heads == hidden else head_dim,
                           attention_bias=arch == "Qwen2ForCausalLM", rope_scaling=scaling)
    except KeyError as exc:
        raise SproutError(f"{where}: field {exc.args[0]} is missing") from None
    except SproutError as exc:
        raise SproutError(f"{where}: {exc}") from None


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


def build_model(cfg: ModelConfig, src: Source) -> Transformer:
    """A sprout `Transformer` of `cfg` holding the source's weights (float32)."""
    model = Transformer(cfg).eval()
    own = model.state_dict()
    state = {}
    for hf_name, (tensor, where) in source_weights(src).items():
        if hf_name.endswith("rotary_emb.inv_freq") or (cfg.tie_embeddings and hf_name == LM_HEAD):
            continue  # a buffer older checkpoints stored; a tied head is the embedding
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
    return model


# ---- tokenizer and chat format -------------------------------------------------------------------
def stage_tokenizer(folder: Path, dest: Path):
    """(dest, tokenizer, chat format or None): the tokenizer files of `folder` copied to `dest`
    with the Jinja template as `chat_template.jinja` and the detected `chat_format.json`."""
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
    template, where = found
    (dest / CHAT_TEMPLATE_FILE).write_text(template, encoding="utf-8")
    specials = hf_special_tokens(dest)
    try:
        fmt = detect_chat_format(template, tok, specials.get("bos_token") or "", specials.get("eos_token") or "")
    except SproutError as exc:
        raise SproutError(f"{folder / where.name}: {exc}") from None
    write_chat_format(dest, fmt)
    return dest, tok, fmt


# ---- the run folder ------------------------------------------------------------------------------
def write_run(imported: Imported, out: str | Path) -> ImportResult:
    """Write the run folder (see the module doc): the tokenizer first, then the checkpoint, whose
    `latest` pointer comes last; every file atomically."""
    out = Path(out)
    src, model, tok, fmt = imported.source, imported.model, imported.tokenizer, imported.chat_format
    fields = bundle_tokenizer(f"hf:{imported.tokenizer_dir}", out)
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
    checkpoint = save_rotating(out / "checkpoints", 0, model, meta=meta)
    tok_files = [f"{Path(fields['tokenizer_file']).parent}/{n}" for n in
                 (HF_FILE, *fields["tokenizer_side_sha256"])]
    ckpt = checkpoint.relative_to(out)
    files = [f"{ckpt}/{n}" for n in ("model.safetensors", "train_state.pt", "meta.json")]
    return ImportResult(out, checkpoint, imported, files + ["checkpoints/latest"] + tok_files)


def summary(result: ImportResult) -> str:
    """What `scripts/import_model.py` prints: source, shape, parameters, vocab, chat format, files."""
    imp = result.imported
    src, c = imp.source, imp.model.config
    origin = {"folder": lambda r: f"folder {r['path']}", "hub": lambda r: f"hub {r['id']} at revision {r['revision']}",
              "gguf": lambda r: f"GGUF {r['path']} (sha256 {r['sha256'][:12]}…)"}[src.record["kind"]](src.record)
    scores = (f", a reward model scoring {imp.reward_score['beta']:g} × a response's summed log-probability"
              if imp.reward_score else "")
    lines = [f"imported {src.config['architectures'][0]} from {origin} as a sprout 'lm' checkpoint{scores}",
             f"  {imp.model.num_params():,} parameters: {c.n_layers} layers, d_model {c.d_model}, {c.n_heads} heads "
             f"({c.kv_heads} key/value) of size {c.head_dim}, feed-forward {c.ff_dim}, context {c.max_seq_len:,}"
             + (", tied embeddings" if c.tie_embeddings else "") + (", q/k/v biases" if c.attention_bias else "")
             + (f", rope scaling {c.rope_scaling['rope_type']}" if c.rope_scaling else ""),
             f"  vocab {c.vocab_size:,} (tokenizer {imp.tokenizer.vocab_size:,} ids)"]
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
