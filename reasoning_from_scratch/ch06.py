"""Chapter 6 index: plain GRPO (rollouts, correctness reward, advantages; imports only). Also
the book's names for this chapter (docs/book_compatibility.md)."""

from .book import append_csv_metrics, train_rlvr_grpo
from .book import save_grpo_checkpoint as save_checkpoint
from .datasets import load_math_train
from .generation import sample_response, sample_rollouts, top_p_filter
from .grading import reward_rlvr
from .grpo import (
    compute_advantage_stats,
    compute_grpo_loss,
    group_advantages,
    sequence_logprob,
)
from .plotting import moving_average, plot_grpo_metrics
from .prompts import render_prompt
from .qwen3 import KVCache
from .training import GRPOConfig, train_grpo
