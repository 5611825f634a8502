"""Pretrain a base model on token shards.

    python scripts/pretrain.py --config configs/demo/pretrain.yaml --data runs/demo/data --out runs/demo/base
    accelerate launch --config_file configs/accelerate/cpu_ddp.yaml scripts/pretrain.py --config ...
    torchrun --nproc_per_node 8 scripts/pretrain.py --config configs/gpt2-small/pretrain.yaml
    python scripts/pretrain.py --config ... --out runs/x --resume            # latest checkpoint in --out
    python scripts/pretrain.py --config ... --train.max_steps 50 --model.d_model 128

Any `--section.field VALUE` overrides the config; the resolved config is printed and saved
as <out>/config.yaml. See sprout/train/pretrain.py for what is checked before training.
"""

import argparse

from sprout.config import load_config
from sprout.errors import run_main
from sprout.train.pretrain import PretrainConfig, run_pretrain


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML config (configs/*/pretrain.yaml)")
    p.add_argument("--data", help="shard directory (or a <dataset>_train.h5 file); overrides data.dir")
    p.add_argument("--out", help="run directory; overrides out")
    p.add_argument("--resume", nargs="?", const="latest", metavar="PATH|latest",
                   help="continue from a checkpoint (default: the latest in --out)")
    args, overrides = p.parse_known_args()
    cfg = load_config(PretrainConfig, args.config, overrides)
    if args.data:
        cfg.data.dir = args.data
    if args.out:
        cfg.out = args.out
    run_pretrain(cfg, resume=args.resume)


if __name__ == "__main__":
    run_main(main)
