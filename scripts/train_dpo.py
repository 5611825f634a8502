"""Train a policy with DPO (or a variant: ipo, robust, simpo, orpo, ..., or a weighted mix) on preference pairs.

    python scripts/train_dpo.py --config configs/demo/dpo.yaml --init runs/demo/sft_model \\
        --data runs/demo/prefs/preferences.jsonl --out runs/demo/dpo_model
    accelerate launch --config_file configs/accelerate/cpu_ddp.yaml scripts/train_dpo.py --config ...
    python scripts/train_dpo.py --config ... --out runs/x --resume            # latest checkpoint in --out
    python scripts/train_dpo.py --config ... --dpo.loss_type '[sigmoid, sft]' --dpo.loss_weights '[1.0, 0.2]'
    python scripts/train_dpo.py --config ... --dpo.precompute_ref_logps true  # reference log-probs cached once

--data takes the folder the prep wrote or any file of it; the held-out file is
preferences_dev.jsonl beside the train file (data.val_path to change it). Any
`--section.field VALUE` overrides the config; the resolved config is printed and saved as
<out>/config.yaml. See sprout/stages/dpo.py for the losses, the reference and the metrics.
"""

from sprout.errors import run_main
from sprout.engine.cli import VERIFY_MANIFEST_HELP, add_input_flags, parse_run_config, run_parser
from sprout.stages.configs import DPOConfig


def main() -> None:
    p = run_parser(__doc__, "configs/*/dpo.yaml")
    add_input_flags(p, data_help="the folder scripts/prepare_preference_data.py wrote, or any file of it "
                                  "(preferences.jsonl; preferences_dev.jsonl beside it is the held-out file)",
                    data_metavar="DIR|FILE.jsonl",
                    init_help="LM checkpoint (an SFT run dir)", verify_help=VERIFY_MANIFEST_HELP)
    args, cfg = parse_run_config(p, DPOConfig)
    from sprout.stages.dpo import run_dpo  # after parsing: --help never loads torch

    run_dpo(cfg, resume=args.resume)


if __name__ == "__main__":
    run_main(main)
