"""Chapter 5 index: best-of-N with confidence, verifiers and PRMs, PRM-guided beam search and
the accuracy-vs-tokens measurement (imports only, and the line that makes it a
`book.BookIndex`). Also the book's names for this chapter; `self_refinement_loop` is the book's
(the model critiques and rewrites its own draft); this package's refinement with a step critic
is `search.self_refinement_loop` (docs/book_compatibility.md)."""

import sys

from .book import (
    BookIndex,
    generate_text_stream_concat_flex,
    generate_text_top_p_stream_cache,
    heuristic_score,
    make_critique_prompt,
    make_refine_prompt,
    self_refinement_loop,
)
from .experiments.inference_scaling import (
    plot_inference_scaling,
    run_scaling_experiment,
    scaling_table,
)
from .grading import extract_final_candidate
from .inference_scaling import (
    BlindVerifierScorer,
    ConfidenceStepScorer,
    StepAggregateScorer,
    aggregate_step_scores,
    avg_logprob_answer,
    best_of_n,
    logprob_scorer,
    mean_logprobs,
    oracle_scorer,
    select_best,
    weighted_majority_vote,
)
from .prm import PRMStepScorer, load_prm, train_prm_on_arithmetic
from .prompts import render_prompt
from .search import StepScoreCritic, beam_search, sample_next_steps, step_beam_search

__all__ = [
    "generate_text_stream_concat_flex",
    "generate_text_top_p_stream_cache",
    "heuristic_score",
    "make_critique_prompt",
    "make_refine_prompt",
    "self_refinement_loop",
    "plot_inference_scaling",
    "run_scaling_experiment",
    "scaling_table",
    "extract_final_candidate",
    "BlindVerifierScorer",
    "ConfidenceStepScorer",
    "StepAggregateScorer",
    "aggregate_step_scores",
    "avg_logprob_answer",
    "best_of_n",
    "logprob_scorer",
    "mean_logprobs",
    "oracle_scorer",
    "select_best",
    "weighted_majority_vote",
    "PRMStepScorer",
    "load_prm",
    "train_prm_on_arithmetic",
    "render_prompt",
    "StepScoreCritic",
    "beam_search",
    "sample_next_steps",
    "step_beam_search",
]

sys.modules[__name__].__class__ = BookIndex  # a book function replaced here reaches its callers
