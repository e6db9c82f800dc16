"""Chapter 8 index: process supervision (steps, scorers, PRM, outcome vs process; imports only).
The book's chapter 8, distillation, is chapter 9 here (`ch09`; docs/book_compatibility.md)."""

from .arithmetic import first_error_step, parse_steps, verify_steps
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
