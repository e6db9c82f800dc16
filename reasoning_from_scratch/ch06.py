"""Chapter 6 index: plain GRPO (rollouts, correctness reward, advantages; imports only, and the
line that makes it a `book.BookIndex`). Also the book's names for this chapter;
`sample_response` and `compute_grpo_loss` are the book's, one rollout at a time (this package's
batched ones: `generation.sample_response`, `training.compute_grpo_loss`; the full training loop:
`train_grpo`; docs/book_compatibility.md)."""

import sys

import requests  # the book's module has it; its readers stub requests.get through it

from .book import (
    BookIndex,
    append_csv_metrics,
    compute_grpo_loss,
    plot_grpo_metrics,
    sample_response,
    train_rlvr_grpo,
)
from .book import save_grpo_checkpoint as save_checkpoint
from .datasets import load_math_train
from .generation import sample_rollouts, top_p_filter
from .grading import reward_rlvr
from .grpo import compute_advantage_stats, group_advantages, sequence_logprob
from .plotting import moving_average
from .prompts import render_prompt
from .qwen3 import KVCache
from .training import GRPOConfig, train_grpo

__all__ = [
    "append_csv_metrics",
    "compute_grpo_loss",
    "plot_grpo_metrics",
    "sample_response",
    "train_rlvr_grpo",
    "save_checkpoint",
    "load_math_train",
    "sample_rollouts",
    "top_p_filter",
    "reward_rlvr",
    "compute_advantage_stats",
    "group_advantages",
    "sequence_logprob",
    "moving_average",
    "render_prompt",
    "KVCache",
    "GRPOConfig",
    "train_grpo",
]

sys.modules[__name__].__class__ = BookIndex  # a book function replaced here reaches its callers
