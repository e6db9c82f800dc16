"""reasoning_from_scratch: reasoning LLMs trained with reinforcement learning, built by hand.

Every function has one home module (see the README's chapter map); this file only re-exports
the public names so that `from reasoning_from_scratch import compute_grpo_loss` works.
"""

from .arithmetic import (
    LEVELS,
    classify_carry_steps,
    first_error_step,
    flawed_solution,
    format_solution,
    generate_level_problem,
    generate_problem,
    is_large_step,
    make_split,
    operand_slip,
    parse_problem,
    parse_steps,
    problem_level,
    slip_result,
    verify_steps,
)
from .checkpoints import (
    check_new_run_dir,
    checkpoint_problem,
    find_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from .datasets import (
    fetch_url,
    load_arith,
    load_dataset_by_name,
    load_gsm8k,
    load_math500,
    load_math_train,
)
from .device import check_device, default_dtype, get_device
from .evaluation import evaluate, per_level_accuracy, reasoning_stats, step_verdicts
from .generation import (
    GenerationOutput,
    Rollouts,
    TextStreamer,
    generate,
    generate_batch,
    sample_next_token,
    sample_response,
    sample_rollouts,
    sample_rollouts_batch,
    top_p_filter,
)
from .grading import (
    extract_final_candidate,
    get_last_boxed,
    grade_answer,
    normalize_text,
    reward_rlvr,
)
from .grpo import (
    aggregate_loss,
    clipped_policy_loss,
    clipped_surrogate,
    collect_rollouts,
    compute_advantage_stats,
    compute_grpo_loss,
    group_advantages,
    k3_kl,
    sequence_logprob,
    sequence_logprob_and_entropy,
    token_logprobs_and_entropy,
)
from .interrupts import defer_interrupts
from .plotting import moving_average, plot_grpo_metrics
from .prm import ProcessRewardModel, load_prm, save_prm, train_prm
from .process import (
    make_process_advantage_fn,
    process_advantages,
    process_token_advantages,
    split_steps,
    step_statistics,
    step_token_ends,
)
from .prompts import render_prompt, render_prompt_with_think_tokens
from .qwen3 import (
    QWEN3_0_6B_CONFIG,
    FeedForward,
    GroupedQueryAttention,
    KVCache,
    Qwen3Config,
    Qwen3Model,
    RMSNorm,
    TransformerBlock,
    apply_rope,
    compute_rope_params,
    tiny_config,
)
from .rewards import reward_format
from .run_log import MetricsLog, read_metrics
from .step_scorers import (
    MonteCarloStepScorer,
    PRMStepScorer,
    StepScorer,
    VerifierStepScorer,
    build_step_scorer,
)
from .supervision_experiment import (
    plot_process_vs_outcome,
    run_experiment,
    summarise,
    write_table,
)
from .tokenizer import END_THINK_TOKEN_ID, THINK_TOKEN_ID, Qwen3Tokenizer
from .training import GRPOConfig, train_grpo
from .training_cli import load_grpo_data, run_cli
from .weights import load_pretrained, save_pretrained

__version__ = "0.1.0"
