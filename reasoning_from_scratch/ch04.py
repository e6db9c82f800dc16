"""Chapter 4 index: inference-time scaling by sampling (chain-of-thought prompts, temperature,
top-p / top-k, pass@k, self-consistency; imports only). Also the book's names for this chapter
(docs/book_compatibility.md)."""

from .book import (
    generate_text_basic_stream_cache,
    generate_text_stream_concat_flex,
    generate_text_temp_stream_cache,
    generate_text_top_p_stream_cache,
    scale_logits_by_temperature,
)
from .generation import sample_next_token, sample_rollouts, sample_rollouts_batch, top_p_filter
from .grading import extract_final_candidate, grade_answer
from .inference_scaling import (
    extract_answers,
    majority_is_decided,
    majority_vote,
    pass_at_k,
    pool_answers,
    self_consistency_vote,
    self_consistency_vote_batch,
)
from .prompts import render_prompt, render_prompt_with_think_tokens
from .qwen3 import KVCache
