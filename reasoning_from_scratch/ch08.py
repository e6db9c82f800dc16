"""Chapter 8 index: process supervision (steps, scorers, PRM, outcome vs process; imports only).

The book's chapter 8, distillation, is chapter 9 here (`ch09`; docs/book_compatibility.md).
Asking this index for one of the book's chapter 8 names raises an ImportError that says where
the job is done here (`BOOK_CHAPTER_8`), rather than a bare "cannot import name".
"""

from .arithmetic import first_error_step, parse_steps, verify_steps
from .branching import branch_advantages, first_error_states, sample_branches
from .experiments.process_vs_outcome import (
    plot_process_vs_outcome,
    run_experiment,
    summarise,
    write_table,
)
from .plotting import draw_token_advantages
from .prm import (
    PRMStepScorer,
    ProcessRewardModel,
    load_prm,
    save_prm,
    train_prm,
    train_prm_on_arithmetic,
)
from .process import (
    anchored_credit,
    control_credit,
    process_advantages,
    split_steps,
    step_statistics,
    step_token_ends,
)
from .process_supervision import (
    ProcessAdvantageFn,
    build_step_scorer,
    make_process_advantage_fn,
    process_token_advantages,
)
from .step_scorers import (
    AnswerBeliefStepScorer,
    FormatStepScorer,
    MonteCarloStepScorer,
    StepScorer,
    VerifierStepScorer,
)

__all__ = [
    "first_error_step",
    "parse_steps",
    "verify_steps",
    "branch_advantages",
    "first_error_states",
    "sample_branches",
    "plot_process_vs_outcome",
    "run_experiment",
    "summarise",
    "write_table",
    "draw_token_advantages",
    "PRMStepScorer",
    "ProcessRewardModel",
    "load_prm",
    "save_prm",
    "train_prm",
    "train_prm_on_arithmetic",
    "anchored_credit",
    "control_credit",
    "process_advantages",
    "split_steps",
    "step_statistics",
    "step_token_ends",
    "ProcessAdvantageFn",
    "build_step_scorer",
    "make_process_advantage_fn",
    "process_token_advantages",
    "AnswerBeliefStepScorer",
    "FormatStepScorer",
    "MonteCarloStepScorer",
    "StepScorer",
    "VerifierStepScorer",
]

# The book's chapter 8 (distillation) names -> where this package does that job (chapter 9).
BOOK_CHAPTER_8 = {
    "load_distill_data": "ch09.read_traces (teacher traces as JSONL; "
                         "ch09.generate_distillation_data samples them)",
    "format_distilled_answer": "ch09.traces_to_documents",
    "load_reasoning_tokenizer": "ch03.load_tokenizer_only('reasoning')",
    "build_examples": "ch09.traces_to_documents, then sft.tokenize_documents",
    "compute_length": "sft.tokenize_documents (the token ids of each document)",
    "filter_examples_by_max_len": "ch09.filter_traces (verified traces) and the tokenized "
                                  "lengths of sft.tokenize_documents",
    "compute_example_loss": "ch09.completion_loss",
    "evaluate_examples": "sft.mean_completion_loss",
    "train_distillation": "ch09.train_distillation(student, tokenizer, records, eval_examples, "
                          "device, ch09.DistillConfig(...))",
    "save_checkpoint": "weights.save_book_checkpoint (a .pth the book's code loads)",
    "append_csv_metrics": "ch06.append_csv_metrics",
    "plot_distill_metrics": "plotting.plot_grpo_metrics(csv_path, columns)",
}


def __getattr__(name):
    """An ImportError naming this package's home for a name of the book's chapter 8."""
    if name in BOOK_CHAPTER_8:
        raise ImportError(
            f"{name!r} is a name of the book's chapter 8 (distillation). Here chapter 8 is "
            f"process supervision and distillation is chapter 9: use {BOOK_CHAPTER_8[name]} "
            "(reasoning_from_scratch.ch09; docs/book_compatibility.md)", name=name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
