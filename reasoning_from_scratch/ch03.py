"""Chapter 3 index: prompts, answer extraction, grading, datasets and evaluation (imports only).
Also the book's names for this chapter (docs/book_compatibility.md)."""

from .book import (
    equality_check,
    eta_progress_message,
    evaluate_math500_stream,
    generate_text_basic_stream_cache,
    generate_text_stream_concat,
    load_model_and_tokenizer,
    load_tokenizer_only,
    run_demos_table,
    split_into_parts,
    sympy_parser,
)
from .datasets import (
    load_arith,
    load_dataset_by_name,
    load_gsm8k,
    load_math500,
    load_math500_test,
    load_math_train,
)
from .evaluation import evaluate, per_level_accuracy, reasoning_stats, step_verdicts
from .grading import (
    extract_final_candidate,
    get_last_boxed,
    grade_answer,
    normalize_text,
    reward_rlvr,
)
from .prompts import render_prompt, render_prompt_with_think_tokens
