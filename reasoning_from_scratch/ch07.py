"""Chapter 7 index: improving GRPO (format reward, clipping, KL, entropy; imports only). Also
the book's names for this chapter (docs/book_compatibility.md)."""

from .downloads import download_from_github
from .generation import sample_response, sample_rollouts
from .grading import reward_rlvr
from .grpo import (
    aggregate_loss,
    clipped_policy_loss,
    clipped_surrogate,
    compute_advantage_stats,
    compute_grpo_loss,
    k3_kl,
    sequence_logprob,
    sequence_logprob_and_entropy,
    token_logprobs_and_entropy,
)
from .plotting import moving_average, plot_grpo_metrics
from .prompts import render_prompt_with_think_tokens
from .rewards import reward_format
from .tokenizer import END_THINK_TOKEN_ID, THINK_TOKEN_ID
from .training import GRPOConfig, train_grpo
