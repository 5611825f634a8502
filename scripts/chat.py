"""Chat with a fine-tuned checkpoint: a multi-turn REPL, or one answer with --prompt.

    python scripts/chat.py runs/demo/sft_model                       # REPL; /reset clears, /quit (or Ctrl-D) ends
    python scripts/chat.py runs/demo/sft_model --prompt "Name three colours." --temperature 0
    python scripts/chat.py runs/demo/sft_model --system "You answer briefly." --top-p 0.9 --seed 1

A base (pretraining) checkpoint is not chat-tuned: chat says so on stderr and carries on;
scripts/sample.py continues raw text instead. The checkpoint may be a checkpoint dir, a run dir or its checkpoints/ folder (newest one).
The tokenizer is the copy its run folder keeps (a tiktoken one, which has no file: the spec its
meta names; `--tokenizer SPEC` to point elsewhere), so this works from any directory. The history
is rendered with the chat template and answered with KV-cache sampling until the
end-of-turn token; see sprout/model/chat_session.py.
"""

import argparse
import sys

from sprout.chat import ChatError
from sprout.errors import SproutError, run_main


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="checkpoint dir, or a run dir (its latest checkpoint)")
    p.add_argument("--prompt", help="answer this one message and exit")
    p.add_argument("--system", help="system message at the start of the conversation")
    p.add_argument("--temperature", type=float, default=0.7, help="0 = greedy (default 0.7)")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest tokens (default: all)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass (default: none, all tokens)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="tokens per answer at most (default 256)")
    p.add_argument("--seed", type=int, default=None, help="seed the sampler (default: random)")
    p.add_argument("--tokenizer", help="tokenizer spec (default: the one in the checkpoint's meta)")
    p.add_argument("--device", help="torch device (default: cuda when available, else cpu)")
    args = p.parse_args()
    import torch  # after parsing: --help never loads torch

    from sprout.model.chat_session import ChatSession, load_chat_model
    from sprout.model.generate import check_sampling

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.max_new_tokens < 1:
        raise SproutError(f"--max-new-tokens must be at least 1, not {args.max_new_tokens}")
    check_sampling(args.temperature, args.top_k, args.top_p, names=("--temperature", "--top-k", "--top-p"))
    model, tok, meta = load_chat_model(args.checkpoint, args.device, args.tokenizer)
    if meta.get("stage") == "pretrain":
        print(f"note: {meta['path']} is a base model (pretraining), not chat-tuned: expect text that ignores "
              f"the conversation; scripts/sample.py continues raw text", file=sys.stderr)
    session = ChatSession(model, tok, system=args.system, max_new_tokens=args.max_new_tokens,
                          temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    if args.prompt is not None:
        print(session.send(args.prompt).text)  # a ChatError here is a user error: one line, exit 2
        return
    print(f"{meta['path']} ({meta.get('stage')} step {meta.get('step')}, {model.num_params():,} params, "
          f"{tok.spec}); /reset clears the history, /quit or Ctrl-D ends")
    while True:
        try:
            text = input("you> ").strip()
        except EOFError:
            print()
            return
        if text in ("/quit", "/exit"):
            return
        if text == "/reset":
            session.reset()
            print("(history cleared)")
            continue
        if not text:
            continue
        try:
            reply = session.send(text)
        except ChatError as exc:
            print(f"(not sent: {exc})")
            continue
        print(f"assistant> {reply.text}" + ("" if reply.finished else " [cut: max new tokens or context reached]"))
        if not reply.text:
            print("(empty answer; not kept in the history)")


if __name__ == "__main__":
    run_main(main)
