"""Chapter 6: plain GRPO: no clipping, no KL, correctness reward only, the book's sequence loss.

Examples:
    python chapters/ch06_train.py                    # bundled tiny model, arithmetic world, CPU
    python chapters/ch06_train.py --steps 20 --output-dir runs/ch06-short
"""

import sys

from reasoning_from_scratch.training import GRPOConfig
from reasoning_from_scratch.training_cli import run_cli

# Chapter 6's algorithm: loss = -(advantage * summed log-prob).mean() (the "sequence" loss at
# ratio 1), one update per batch, reward = correctness only.
CH06_DEFAULTS = GRPOConfig(
    loss_type="sequence", epsilon=None, epsilon_high=None, beta=0.0, format_reward_weight=0.0,
    format_reward_conditional=False, skip_zero_advantage=False, inner_epochs=1,
)


def main(argv=None):
    return run_cli(argv, __doc__.splitlines()[0], CH06_DEFAULTS, "ch06")


if __name__ == "__main__":
    main(sys.argv[1:])
