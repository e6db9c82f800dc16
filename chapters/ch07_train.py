"""Chapter 7: GRPO with the improvements: clipped token-level loss, KL option, format reward, more.

Examples:
    python chapters/ch07_train.py                    # bundled tiny model, arithmetic world, CPU
    python chapters/ch07_train.py --eval-split val --seed 1      # tuning runs use the val split
    python chapters/ch07_train.py --resume runs/ch07-<timestamp>  # continue a run exactly
    torchrun --nproc-per-node 4 chapters/ch07_train.py    # data-parallel: 4 GPUs (or CPU procs)
    torchrun --nproc-per-node 8 chapters/ch07_train.py --fsdp  # sharded (docs/data_parallel.md)
    python chapters/ch07_train.py --model Qwen/Qwen3-0.6B-Base --dataset math --max-new-tokens 512 \
        --lr 1e-6 --prompts-per-step 8 --num-rollouts 8 --micro-batch-size 8 --eval-examples 500
"""

import sys

from reasoning_from_scratch.cli.train import parse_train_args, run_training
from reasoning_from_scratch.training import GRPOConfig

CH07_DEFAULTS = GRPOConfig()  # the library defaults are the chapter 7 recipe


def main(argv=None):
    """Parse and check the flags (every GRPOConfig field is one), then train; returns the
    summary."""
    run = parse_train_args(argv, __doc__.splitlines()[0], CH07_DEFAULTS, "ch07")
    return run_training(run)


if __name__ == "__main__":
    main(sys.argv[1:])
