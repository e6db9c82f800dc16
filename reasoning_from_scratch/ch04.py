"""Chapter 4 index: inference-time scaling by sampling (chain-of-thought prompts, temperature,
top-p / top-k, pass@k, self-consistency; imports only, and the line that makes it a
`book.BookIndex`). Also the book's names for this chapter; `self_consistency_vote` is the
book's, one sample at a time (this package's batched vote with early stopping:
`inference_scaling.self_consistency_vote`; docs/book_compatibility.md)."""

import sys

from .book import (
    BookIndex,
    generate_text_basic_stream_cache,
    generate_text_stream_concat_flex,
    generate_text_temp_stream_cache,
    generate_text_top_p_stream_cache,
    scale_logits_by_temperature,
    self_consistency_vote,
)
from .generation import sample_next_token, sample_rollouts, sample_rollouts_batch, top_p_filter
from .grading import extract_final_candidate, grade_answer
from .inference_scaling import (
    extract_answers,
    majority_is_decided,
    majority_vote,
    pass_at_k,
    pool_answers,
    self_consistency_vote_batch,
)
from .prompts import render_prompt, render_prompt_with_think_tokens
from .qwen3 import KVCache

__all__ = [
    "generate_text_basic_stream_cache",
    "generate_text_stream_concat_flex",
    "generate_text_temp_stream_cache",
    "generate_text_top_p_stream_cache",
    "scale_logits_by_temperature",
    "self_consistency_vote",
    "sample_next_token",
    "sample_rollouts",
    "sample_rollouts_batch",
    "top_p_filter",
    "extract_final_candidate",
    "grade_answer",
    "extract_answers",
    "majority_is_decided",
    "majority_vote",
    "pass_at_k",
    "pool_answers",
    "self_consistency_vote_batch",
    "render_prompt",
    "render_prompt_with_think_tokens",
    "KVCache",
]

sys.modules[__name__].__class__ = BookIndex  # a book function replaced here reaches its callers
