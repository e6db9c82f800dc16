"""Chapter 3 index: prompts, answer extraction, grading, datasets and evaluation (imports only)."""

from .datasets import (
    load_arith,
    load_dataset_by_name,
    load_gsm8k,
    load_math500,
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
