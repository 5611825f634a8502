"""Pretrain a base model on token shards.

    python scripts/pretrain.py --config configs/demo/pretrain.yaml --data runs/demo/data --out runs/demo/base
    accelerate launch --config_file configs/accelerate/cpu_ddp.yaml scripts/pretrain.py --config ...
    torchrun --nproc_per_node 8 scripts/pretrain.py --config configs/gpt2-small/pretrain.yaml
    python scripts/pretrain.py --out runs/x --resume                         # its config.yaml, latest checkpoint
    python scripts/pretrain.py --out runs/x --resume --train.max_steps 600   # ... and train longer
    python scripts/pretrain.py --config ... --train.max_steps 50 --model.d_model 128

--data takes the folder the prep wrote or any file of it. Any `--section.field VALUE`
overrides the config (the fields are listed below); the resolved
config is printed and saved as <out>/config.yaml. An --out that already holds a run needs
--resume or --overwrite. Ctrl-C or SIGTERM stops after the current step with a checkpoint and
prints the command that resumes. See sprout/stages/pretrain.py for what is checked before training.
"""

from sprout.errors import run_main
from sprout.engine.cli import VERIFY_FILES_HELP, add_input_flags, parse_run_config, run_parser
from sprout.stages.configs import PretrainConfig


def main() -> None:
    p = run_parser(__doc__, "configs/*/pretrain.yaml")
    add_input_flags(p, data_help="the folder scripts/prepare_pretrain_data.py wrote, or any file of it (its "
                                  "manifest.json, a .bin shard, either file of an HDF5 pair)",
                    data_metavar="DIR|FILE", data_field="dir",
                    verify_help=VERIFY_FILES_HELP)
    args, cfg = parse_run_config(p, PretrainConfig)
    from sprout.stages.pretrain import run_pretrain  # after parsing: --help never loads torch

    run_pretrain(cfg, resume=args.resume)


if __name__ == "__main__":
    run_main(main)
