"""Train a policy with PPO: a value head, rewards from a reward model and/or verifiers, KL to a frozen reference.

    python scripts/prepare_rl_prompts.py --config configs/demo/rl_prompts.yaml
    python scripts/train_ppo.py --config configs/demo/ppo.yaml --init runs/demo/sft_model \\
        --reward-model runs/demo/reward_model
    accelerate launch --config_file configs/accelerate/cpu_ddp.yaml scripts/train_ppo.py --config ...
    python scripts/train_ppo.py --config ... --out runs/x --resume            # latest checkpoint in --out
    python scripts/train_ppo.py --config ... --ppo.kl_in loss --ppo.adaptive_kl true --ppo.target_kl 2

--data takes the folder the prep wrote or any file of it; the held-out file is
prompts_dev.jsonl beside the train file (data.val_path to change it). Any
`--section.field VALUE` overrides the config; the resolved config is printed and saved as
<out>/config.yaml. See sprout/stages/ppo.py for the models, rewards, KL, losses and metrics,
and sprout/stages/rl_stage.py for the rollouts and the buffer.
"""

from sprout.errors import run_main
from sprout.engine.cli import VERIFY_MANIFEST_HELP, add_input_flags, parse_run_config, run_parser
from sprout.stages.configs import PPOConfig


def main() -> None:
    p = run_parser(__doc__, "configs/*/ppo.yaml")
    add_input_flags(p, data_help="the folder scripts/prepare_rl_prompts.py wrote, or any file of it "
                                  "(prompts.jsonl; prompts_dev.jsonl beside it is the held-out file)",
                    data_metavar="DIR|FILE.jsonl",
                    init_help="LM checkpoint (an SFT run dir)", verify_help=VERIFY_MANIFEST_HELP)
    p.add_argument("--reward-model", metavar="RUN", help="reward model run or checkpoint; overrides reward_model")
    args, cfg = parse_run_config(p, PPOConfig)
    if args.reward_model:
        cfg.reward_model = args.reward_model
    from sprout.stages.ppo import run_ppo  # after parsing: --help never loads torch

    run_ppo(cfg, resume=args.resume)


if __name__ == "__main__":
    run_main(main)
