"""Train a policy with GRPO (or Dr. GRPO, DAPO, GSPO, RLOO, CISPO, SAPO) on prompts with verifiable answers.

    python scripts/prepare_rl_prompts.py --config configs/demo/rl_prompts.yaml
    python scripts/train_grpo.py --config configs/demo/grpo.yaml --init runs/demo/sft_model
    accelerate launch --config_file configs/accelerate/cpu_ddp.yaml scripts/train_grpo.py --config ...
    python scripts/train_grpo.py --config ... --out runs/x --resume            # latest checkpoint in --out
    python scripts/train_grpo.py --config ... --grpo.loss_type grpo --grpo.beta 0.04 --grpo.num_iterations 2
    python scripts/train_grpo.py --config ... --grpo.advantage rloo --grpo.loss_type grpo   # TRL's RLOO loss
    python scripts/train_grpo.py --config ... --grpo.loss_type cispo --grpo.epsilon_high 5.0

--data takes the folder the prep wrote or any file of it; the held-out file is
prompts_dev.jsonl beside the train file (data.val_path to change it). Any
`--section.field VALUE` overrides the config; the resolved config is printed and saved as
<out>/config.yaml. See sprout/stages/grpo.py for the loss, the advantages and the metrics,
and sprout/stages/rl_stage.py for the rollouts and the buffer.
"""

from sprout.errors import run_main
from sprout.engine.cli import VERIFY_MANIFEST_HELP, add_input_flags, parse_run_config, run_parser
from sprout.stages.configs import GRPOConfig


def main() -> None:
    p = run_parser(__doc__, "configs/*/grpo.yaml")
    add_input_flags(p, data_help="the folder scripts/prepare_rl_prompts.py wrote, or any file of it "
                                  "(prompts.jsonl; prompts_dev.jsonl beside it is the held-out file)",
                    data_metavar="DIR|FILE.jsonl",
                    init_help="LM checkpoint (an SFT run dir)", verify_help=VERIFY_MANIFEST_HELP)
    args, cfg = parse_run_config(p, GRPOConfig)
    from sprout.stages.grpo import run_grpo  # after parsing: --help never loads torch

    run_grpo(cfg, resume=args.resume)


if __name__ == "__main__":
    run_main(main)
