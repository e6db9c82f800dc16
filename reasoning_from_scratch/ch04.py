"""Chapter 4 index: inference-time scaling by sampling (chain-of-thought prompts, temperature,
top-p / top-k, pass@k, self-consistency; imports only)."""

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
