"""Start from a published Llama-family model: import it into a sprout run folder.

    python scripts/import_model.py HuggingFaceTB/SmolLM2-135M-Instruct --out runs/smollm2  # a hub id
    python scripts/import_model.py path/to/hf_folder --out runs/mine       # config.json + safetensors
    python scripts/import_model.py model.Q4_1.gguf --out runs/mine         # via transformers' GGUF loader
    python scripts/chat.py runs/smollm2

SOURCE is a Hugging Face folder, a hub id (fetched into the usual cache; HF_HUB_OFFLINE=1 uses
the cache only) or a .gguf file (needs the 'import' extra: pip install 'sprout[import]').
Llama, Qwen2 and Mistral (without a sliding window shorter than the context) are imported;
anything else is refused in one line naming the config field. --out becomes an ordinary run
folder: checkpoints/step_00000000 (an 'lm' checkpoint, the source and its config.json in
meta.json, and a log-probability reward model's rule when config.json has sprout_reward_score)
and the tokenizer files in tokenizer/NAME/ with the chat format detected from the model's own
chat template (see src/sprout/model/hf_import.py). A folder that holds a run is refused unless
--overwrite, which replaces that run only once the new one is built. config.json is read as
transformers' AutoModelForCausalLM reads it, or refused in one line naming the field
(src/sprout/model/hf_config.py). --max-seq-len shortens the context, which is at most 1,048,576
tokens. The run is built in a staging folder inside --out and moved
into place; a refused import leaves --out as it was, and what a killed one left there goes when
the next import into --out starts (src/sprout/model/import_staging.py).

    python scripts/import_model.py path/to/hf_folder --adapter path/to/peft_adapter --out runs/mine

--adapter PEFT_DIR merges a PEFT LoRA adapter folder (adapter_config.json,
adapter_model.safetensors) made for SOURCE into the imported weights, W + s B A, and records it
in meta.json as `adapter`; DoRA and other LoRA variants, and adapters made for another model,
are refused in one line (see src/sprout/model/peft_adapter.py).
"""

import argparse
from pathlib import Path

from sprout.engine.cli import check_fresh_run, hold_run
from sprout.errors import run_main


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", metavar="SOURCE", help="a Hugging Face folder, a hub id (owner/name) or a .gguf file")
    p.add_argument("--out", required=True, help="run folder to write")
    p.add_argument("--overwrite", action="store_true", help="replace the run in --out (its run files only)")
    p.add_argument("--revision", help="hub revision (branch, tag or commit; default main)")
    p.add_argument("--tokenizer-name", metavar="NAME", help="the run's tokenizer folder, tokenizer/NAME/ (default: "
                   "the source's name); a pipeline names it so later stages find hf:RUN/tokenizer/NAME")
    p.add_argument("--adapter", metavar="PEFT_DIR", help="a PEFT LoRA adapter folder made for SOURCE, merged "
                   "into the imported weights")
    p.add_argument("--max-seq-len", type=int, help="context of the sprout model (default: the source's "
                                                     "max_position_embeddings)")
    args = p.parse_args()
    from sprout.model.hf_import import read_source, summary, write_run  # after parsing: --help never loads torch
    from sprout.model.import_staging import ImportStaging, clean_killed_imports

    def claim() -> list[Path]:
        """The old run's files the new one replaces (--overwrite), the folder held from now on."""
        old = check_fresh_run(args.out, args.overwrite, resumable=False)  # again: a run may have appeared
        if old:
            hold_run(args.out)  # no trainer writes the run this import moves aside
        return old

    clean_killed_imports(args.out)  # a killed import's staging folder, and what it had moved in
    check_fresh_run(args.out, args.overwrite, resumable=False)  # before the source is read, not only after
    with ImportStaging(args.out, claim) as staging:
        imported = read_source(args.source, staging.path / "source", revision=args.revision,
                               max_seq_len=args.max_seq_len, tokenizer_name=args.tokenizer_name, adapter=args.adapter)
        result = write_run(imported, args.out, staging)  # its last act: `staging.publish`, which claims
    if staging.replaced:
        print(f"--overwrite: deleted the previous run's {', '.join(staging.replaced)} in {args.out}", flush=True)
    print(summary(result))


if __name__ == "__main__":
    run_main(main)
