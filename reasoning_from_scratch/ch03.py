"""Chapter 3 index: prompts, answer extraction, grading, datasets and evaluation (imports only,
and the line that makes it a `book.BookIndex`). Also the book's names for this chapter; a name
the book defines is the book's function: `get_last_boxed` and `normalize_text` follow the book,
while `extract_final_candidate` and `grade_answer` are this package's grader, which gives the
book's verdicts (docs/book_compatibility.md)."""

import sys

import requests  # the book's module has it; its readers stub requests.get through it

from .book import (
    BookIndex,
    equality_check,
    eta_progress_message,
    evaluate_math500_stream,
    generate_text_basic_stream_cache,
    generate_text_stream_concat,
    get_last_boxed,
    load_model_and_tokenizer,
    load_tokenizer_only,
    normalize_text,
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
from .grading import extract_final_candidate, grade_answer, reward_rlvr
from .prompts import render_prompt, render_prompt_with_think_tokens

__all__ = [
    "equality_check",
    "eta_progress_message",
    "evaluate_math500_stream",
    "generate_text_basic_stream_cache",
    "generate_text_stream_concat",
    "get_last_boxed",
    "load_model_and_tokenizer",
    "load_tokenizer_only",
    "normalize_text",
    "run_demos_table",
    "split_into_parts",
    "sympy_parser",
    "load_arith",
    "load_dataset_by_name",
    "load_gsm8k",
    "load_math500",
    "load_math500_test",
    "load_math_train",
    "evaluate",
    "per_level_accuracy",
    "reasoning_stats",
    "step_verdicts",
    "extract_final_candidate",
    "grade_answer",
    "reward_rlvr",
    "render_prompt",
    "render_prompt_with_think_tokens",
]

sys.modules[__name__].__class__ = BookIndex  # a book function replaced here reaches its callers
