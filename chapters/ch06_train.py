"""Chapter 6: plain GRPO: no clipping, no KL, correctness reward only, the book's sequence loss.

Examples:
    python chapters/ch06_train.py                    # bundled tiny model, arithmetic world, CPU
    python chapters/ch06_train.py --steps 20 --output-dir runs/ch06-short
    torchrun --nproc-per-node 2 chapters/ch06_train.py    # data-parallel, the same run
"""

import sys

from reasoning_from_scratch.cli.train import parse_train_args, run_training
from reasoning_from_scratch.training import CHAPTER6_RECIPE, GRPOConfig

# Chapter 6's algorithm (see CHAPTER6_RECIPE): the book's sequence loss, no clipping, no KL,
# correctness reward only.
CH06_DEFAULTS = GRPOConfig(**CHAPTER6_RECIPE)


def main(argv=None):
    """Parse and check the flags (every GRPOConfig field is one), then train; returns the
    summary."""
    run = parse_train_args(argv, __doc__.splitlines()[0], CH06_DEFAULTS, "ch06")
    return run_training(run)


if __name__ == "__main__":
    main(sys.argv[1:])
