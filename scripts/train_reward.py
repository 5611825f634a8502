"""Train a reward model on preference pairs: the init LM plus a scalar score head, or (reward.score logprob) the LM itself, scoring an answer by β × its summed log-probability.

    python scripts/train_reward.py --config configs/demo/reward.yaml --init runs/demo/sft_model \\
        --data runs/demo/prefs/preferences.jsonl --out runs/demo/reward_model
    accelerate launch --config_file configs/accelerate/cpu_ddp.yaml scripts/train_reward.py --config ...
    python scripts/train_reward.py --config ... --out runs/x --resume            # latest checkpoint in --out
    python scripts/train_reward.py --config ... --reward.center_rewards_coefficient 0.01
    python scripts/train_reward.py --config ... --reward.score logprob --reward.beta 0.1

--data takes the folder the prep wrote or any file of it; the held-out file is
preferences_dev.jsonl beside the train file (data.val_path to change it). Any
`--section.field VALUE` overrides the config; the resolved config is printed and saved as
<out>/config.yaml. See sprout/stages/reward.py for the loss, metrics and eval.
"""

from sprout.errors import run_main
from sprout.engine.cli import VERIFY_MANIFEST_HELP, add_input_flags, parse_run_config, run_parser
from sprout.stages.configs import RewardConfig


def main() -> None:
    p = run_parser(__doc__, "configs/*/reward.yaml")
    add_input_flags(p, data_help="the folder scripts/prepare_preference_data.py wrote, or any file of it "
                                  "(preferences.jsonl; preferences_dev.jsonl beside it is the held-out file)",
                    data_metavar="DIR|FILE.jsonl",
                    init_help="LM checkpoint (an SFT run dir)", verify_help=VERIFY_MANIFEST_HELP)
    args, cfg = parse_run_config(p, RewardConfig)
    from sprout.stages.reward import run_reward  # after parsing: --help never loads torch

    run_reward(cfg, resume=args.resume)


if __name__ == "__main__":
    run_main(main)
