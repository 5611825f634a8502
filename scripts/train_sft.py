"""Supervised fine-tuning of a base checkpoint on packed chat rows (masked loss on assistant turns).

    python scripts/train_sft.py --config configs/demo/sft.yaml --init runs/demo/base \\
        --data runs/demo/sft/sft.h5 --out runs/demo/sft_model
    accelerate launch --config_file configs/accelerate/cpu_ddp.yaml scripts/train_sft.py --config ...
    python scripts/train_sft.py --out runs/x --resume                        # its config.yaml, latest checkpoint
    python scripts/train_sft.py --config ... --train.max_steps 50 --optim.lr 1e-4

--data takes the folder the prep wrote or either file of it; the val file is the `_val` one
beside the train file (sft_val.h5). Any `--section.field VALUE`
overrides the config (the fields are listed below); the resolved config is printed and saved
as <out>/config.yaml. An --out that already holds a run needs --resume or --overwrite. Ctrl-C
or SIGTERM stops after the current step with a checkpoint and prints the command that resumes.
See sprout/stages/sft.py for what is checked before training.
"""

from sprout.errors import run_main
from sprout.engine.cli import VERIFY_FILES_HELP, add_input_flags, parse_run_config, run_parser
from sprout.stages.configs import SFTConfig


def main() -> None:
    p = run_parser(__doc__, "configs/*/sft.yaml")
    add_input_flags(p, data_help="the folder scripts/prepare_sft_data.py wrote, or either file of it (sft.h5; "
                                  "the sft_val.h5 beside it is the val file)", data_metavar="DIR|FILE.h5",
                    init_help="base checkpoint, or its run dir", verify_help=VERIFY_FILES_HELP)
    args, cfg = parse_run_config(p, SFTConfig)
    from sprout.stages.sft import run_sft  # after parsing: --help never loads torch

    run_sft(cfg, resume=args.resume)


if __name__ == "__main__":
    run_main(main)
