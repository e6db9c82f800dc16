"""Chapter 6 index: plain GRPO (rollouts, correctness reward, advantages; imports only)."""

from .generation import sample_response, sample_rollouts
from .grading import reward_rlvr
from .grpo import (
    compute_advantage_stats,
    compute_grpo_loss,
    group_advantages,
    sequence_logprob,
)
from .plotting import moving_average, plot_grpo_metrics
from .prompts import render_prompt
from .training import GRPOConfig, train_grpo
