"""Chapter 5 index: best-of-N with confidence, verifiers and PRMs, PRM-guided beam search and
self-refinement, and the accuracy-vs-tokens measurement (imports only). Also the book's names
for this chapter (docs/book_compatibility.md)."""

from .book import (
    generate_text_stream_concat_flex,
    generate_text_top_p_stream_cache,
    heuristic_score,
    make_critique_prompt,
    make_refine_prompt,
    self_critique_loop,
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
from .search import (
    StepScoreCritic,
    beam_search,
    sample_next_steps,
    self_refinement_loop,
    step_beam_search,
)
