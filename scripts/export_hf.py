"""Export a checkpoint to a Hugging Face transformers folder (Llama/Qwen2ForCausalLM and its tokenizer).

    python scripts/export_hf.py runs/demo/sft_model exports/sft
    python -c "from transformers import AutoModelForCausalLM, AutoTokenizer; \\
        m = AutoModelForCausalLM.from_pretrained('exports/sft'); t = AutoTokenizer.from_pretrained('exports/sft')"

RUN_OR_CHECKPOINT is a checkpoint dir, a run dir or its checkpoints/ folder (newest one). OUT
gets config.json, model.safetensors, generation_config.json and the tokenizer files with the
chat template (see src/sprout/model/export.py). A model imported by scripts/import_model.py, or
trained from one, keeps its source's tokenizer files and Jinja chat template unchanged and
exports as a Llama, or as a Qwen2 when it has q/k/v biases (an imported Qwen2). A value head is
dropped (the policy LM is exported); a reward model becomes *ForSequenceClassification. Then the
folder is loaded with transformers and checked against sprout: logits within 1e-4, tokenizer ids
on sample texts, chat-template ids on sample conversations and, for an LM, transformers' greedy
answers to them equal to sprout's (`--no-check` skips this).

    python scripts/export_hf.py runs/demo/sft_lora exports/sft_lora --adapter

A LoRA run exports merged, as any other run. With --adapter, OUT also gets base/ (the run's
base, exported the same way) and adapter/ (a PEFT LoRA adapter: adapter_config.json and
adapter_model.safetensors), checked by loading adapter/ on base/ with peft's
PeftModel.from_pretrained: logits within 1e-4 of sprout's (see src/sprout/model/peft_adapter.py).
A LoRA reward model is refused with --adapter (its score head has no place in the adapter).
"""

from __future__ import annotations

import argparse

from sprout.errors import run_main


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", metavar="RUN_OR_CHECKPOINT", help="checkpoint dir, or a run dir (its latest checkpoint)")
    p.add_argument("out", metavar="OUT", help="folder to write (refused if it exists and is not empty)")
    p.add_argument("--tokenizer", help="tokenizer spec (default: the one the checkpoint was trained with)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    p.add_argument("--adapter", action="store_true", help="a LoRA run: also write OUT/base (its base) and OUT/adapter "
                   "(a PEFT LoRA adapter folder)")
    p.add_argument("--no-check", action="store_true", help="do not load the result with transformers to check it")
    args = p.parse_args()
    from sprout.model.export import export_hf, verify_export  # after parsing: --help never loads torch
    from sprout.model.peft_adapter import export_lora_adapter, verify_adapter

    if args.adapter:
        both, model, base, tok = export_lora_adapter(args.checkpoint, args.out, tokenizer=args.tokenizer,
                                                     overwrite=args.overwrite)
        result = both.merged
    else:
        result, model, tok = export_hf(args.checkpoint, args.out, tokenizer=args.tokenizer, overwrite=args.overwrite)
    print(f"{result.out}: {result.hf_class} from a sprout {result.architecture!r} checkpoint, "
          f"tokenizer {tok.spec}; wrote {', '.join(result.files)}")
    if args.adapter:
        print(f"{both.base.out}: {both.base.hf_class}, the LoRA run's base; {both.adapter}: a PEFT LoRA adapter "
              f"(r {both.config['r']}, lora_alpha {both.config['lora_alpha']:g} on "
              f"{', '.join(sorted(both.config['target_modules']))}); wrote {', '.join(both.adapter_files)}")
    if result.reward_score:
        print(f"a log-probability reward model: config.json's sprout_reward_score {result.reward_score} "
              "(a response scores beta x its summed log-probability given the prompt)")
    for name in result.dropped:
        print(f"dropped {name}: transformers' {result.hf_class} has no place for it")
    if not args.no_check:
        check = verify_export(result.out, model, tok)
        what = "score" if result.architecture == "reward" else "logit"
        fp64 = "" if check["max_abs_diff_fp64"] is None else f" (float64: {check['max_abs_diff_fp64']:.2g})"
        print(f"checked with transformers: max |{what} difference| {check['max_abs_diff']:.2g}{fp64}, "
              f"ids equal on {check['texts']} texts and {check['chats']} conversations")
        if check["answers"]:
            print(f"greedy chat answers equal on {check['answers']} conversations "
                  f"({check['answer_tokens']} new tokens)")
        if args.adapter:
            verify_export(both.base.out, base, tok)
            peft_check = verify_adapter(result.out, model, tok)
            print(f"checked with peft: adapter/ on base/ gives logits within {peft_check['max_abs_diff']:.2g} of "
                  f"the merged model's; base/ checked with transformers as above")


if __name__ == "__main__":
    run_main(main)
