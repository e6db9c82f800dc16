"""Chapter 6: plain GRPO: no clipping, no KL, correctness reward only, the book's sequence loss.

Examples:
    python chapters/ch06_train.py                    # bundled tiny model, arithmetic world, CPU
    python chapters/ch06_train.py --steps 20 --output-dir runs/ch06-short
    torchrun --nproc-per-node 2 chapters/ch06_train.py    # data-parallel, the same run
"""

import sys

from reasoning_from_scratch.cli.train import run_cli
from reasoning_from_scratch.training import CHAPTER6_RECIPE, GRPOConfig

# Chapter 6's algorithm (see CHAPTER6_RECIPE): the book's sequence loss, no clipping, no KL,
# correctness reward only.
CH06_DEFAULTS = GRPOConfig(**CHAPTER6_RECIPE)


def main(argv=None):
    return run_cli(argv, __doc__.splitlines()[0], CH06_DEFAULTS, "ch06")


if __name__ == "__main__":
    main(sys.argv[1:])
