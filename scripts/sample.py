"""Continue a text with a base (pretrained) model: raw next-token sampling, no chat template.

    python scripts/sample.py runs/demo/base --prompt "Once upon a time"
    python scripts/sample.py runs/demo/base --prompt "The river" --max-new-tokens 80 --temperature 0.8 \\
        --top-k 50 --top-p 0.95 --seed 0

The checkpoint may be a checkpoint dir, a run dir or its checkpoints/ folder (newest one);
its tokenizer is the copy its run folder keeps (`--tokenizer SPEC` to point elsewhere).
The prompt is encoded as plain text and continued until the end-of-text token,
--max-new-tokens or the context; the prompt and its continuation are printed. For a
fine-tuned (chat) model use scripts/chat.py, which renders the chat template.
"""

import argparse
import sys

from sprout.errors import SproutError, run_main


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="checkpoint dir, or a run dir (its latest checkpoint)")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=100, help="tokens to add at most (default 100)")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest tokens (default: all)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass (default: none, all tokens)")
    p.add_argument("--seed", type=int, default=None, help="seed the sampler (default: random)")
    p.add_argument("--tokenizer", help="tokenizer spec (default: the one the checkpoint records)")
    p.add_argument("--device", help="torch device (default: cuda when available, else cpu)")
    args = p.parse_args()
    import torch  # after parsing: --help never loads torch

    from sprout.checkpoint import checkpoint_tokenizer
    from sprout.model.generate import check_sampling, generate
    from sprout.model.load import load_model

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.max_new_tokens < 1:
        raise SproutError(f"--max-new-tokens must be at least 1, not {args.max_new_tokens}")
    check_sampling(args.temperature, args.top_k, args.top_p, names=("--temperature", "--top-k", "--top-p"))
    model, meta = load_model(args.checkpoint, args.device)
    if meta["architecture"] == "reward":
        raise SproutError(f"{meta['path']}/meta.json: a reward model scores text; it has no LM head to sample from")
    tok = checkpoint_tokenizer(meta, args.tokenizer)
    if tok.vocab_size > model.config.vocab_size:
        raise SproutError(f"{tok.spec}: vocab {tok.vocab_size} does not fit the model's {model.config.vocab_size}")
    ids = tok.encode(args.prompt)
    if not ids:
        raise SproutError("--prompt: the prompt encodes to no tokens; give some text to continue")
    if len(ids) >= model.config.max_seq_len:
        raise SproutError(f"--prompt: {len(ids)} tokens leave no room in the model's context of "
                          f"{model.config.max_seq_len}")
    generator = torch.Generator(args.device).manual_seed(args.seed) if args.seed is not None else None
    gen = generate(model.eval(), [ids], args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                   top_p=args.top_p, stop_ids={tok.eot_id}, generator=generator, vocab_size=tok.vocab_size)
    tokens, finished = gen.tokens[0], gen.finished[0]
    print(tok.decode(ids + (tokens[:-1] if finished else tokens)))  # decoded together: no seam at the join
    if meta.get("stage") not in (None, "pretrain"):
        print(f"note: {meta['path']} is a checkpoint of stage {meta['stage']!r}; scripts/chat.py talks to it with "
              f"the chat template", file=sys.stderr)


if __name__ == "__main__":
    run_main(main)
