"""Train a reward model (the init LM plus a scalar score head) on preference pairs.

    python scripts/train_reward.py --config configs/demo/reward.yaml --init runs/demo/sft_model \\
        --data runs/demo/prefs/preferences.jsonl --out runs/demo/reward_model
    accelerate launch --config_file configs/accelerate/cpu_ddp.yaml scripts/train_reward.py --config ...
    python scripts/train_reward.py --config ... --out runs/x --resume            # latest checkpoint in --out
    python scripts/train_reward.py --config ... --reward.center_rewards_coefficient 0.01

The held-out file is preferences_test.jsonl beside --data (data.val_path to change it). Any
`--section.field VALUE` overrides the config; the resolved config is printed and saved as
<out>/config.yaml. See sprout/train/reward.py for the loss, metrics and eval.
"""

from sprout.errors import run_main
from sprout.formats.verify import VERIFY_MODES
from sprout.train.reward import RewardConfig, run_reward
from sprout.train.run import parse_run_config, run_parser


def main() -> None:
    p = run_parser(__doc__, "configs/*/reward.yaml")
    p.add_argument("--data", metavar="FILE.jsonl",
                   help="preference pairs (scripts/prepare_preference_data.py); overrides data.path")
    p.add_argument("--init", metavar="CKPT", help="LM checkpoint (an SFT run dir); overrides init")
    p.add_argument("--data-verify", choices=VERIFY_MODES, help="start-up data check: full (both files listed "
                   "in the prep's manifest.json with their sha256, the default) or sizes (listed only, no "
                   "hashing); overrides data.verify")
    args, cfg = parse_run_config(p, RewardConfig)
    if args.data_verify:
        cfg.data.verify = args.data_verify
    if args.data:
        cfg.data.path = args.data
    if args.init:
        cfg.init = args.init
    run_reward(cfg, resume=args.resume)


if __name__ == "__main__":
    run_main(main)
