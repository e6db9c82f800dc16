"""Chapter 7 index: improving GRPO (format reward, clipping, KL, entropy; imports only, and the
line that makes it a `book.BookIndex`). Also the book's names for this chapter. The loss with
clipping, KL and entropy for one prompt is `training.compute_grpo_loss` (also at the top level;
`compute_grpo_loss` in the indexes is the book's chapter 6 loss); docs/book_compatibility.md."""

import sys

import matplotlib.pyplot as plt  # the book's module has it; its readers stub plt.show through it
import requests  # the book's module has it; its readers stub requests.get through it

from .book import BookIndex, plot_grpo_metrics, sample_response
from .downloads import download_from_github
from .generation import sample_rollouts
from .grading import reward_rlvr
from .grpo import (
    aggregate_loss,
    clipped_surrogate,
    compute_advantage_stats,
    k3_kl,
    sequence_logprob,
    sequence_logprob_and_entropy,
    token_logprobs_and_entropy,
)
from .plotting import moving_average
from .prompts import render_prompt_with_think_tokens
from .rewards import reward_format
from .tokenizer import END_THINK_TOKEN_ID, THINK_TOKEN_ID
from .training import GRPOConfig, train_grpo
from .variants import clipped_policy_loss

__all__ = [
    "plot_grpo_metrics",
    "sample_response",
    "download_from_github",
    "sample_rollouts",
    "reward_rlvr",
    "aggregate_loss",
    "clipped_policy_loss",
    "clipped_surrogate",
    "compute_advantage_stats",
    "k3_kl",
    "sequence_logprob",
    "sequence_logprob_and_entropy",
    "token_logprobs_and_entropy",
    "moving_average",
    "render_prompt_with_think_tokens",
    "reward_format",
    "END_THINK_TOKEN_ID",
    "THINK_TOKEN_ID",
    "GRPOConfig",
    "train_grpo",
]

sys.modules[__name__].__class__ = BookIndex  # a book function replaced here reaches its callers
