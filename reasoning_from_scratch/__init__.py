"""reasoning_from_scratch: reasoning LLMs trained with reinforcement learning, built by hand.

The top level exports the design's main functions, the ones a reader calls first; every other
name is imported from its home module (`from reasoning_from_scratch.grpo import k3_kl`) or from
its chapter's index (`from reasoning_from_scratch.ch07 import *`). The README's chapter map says
which module holds what. Drivers live beside the core: `cli/` (command lines) and `experiments/`
(measured comparisons).
"""

from .device import get_device
from .distillation import generate_distillation_data
from .distillation_training import DistillConfig, train_distillation
from .evaluation import evaluate
from .generation import generate, sample_response, sample_rollouts
from .grading import extract_final_candidate, grade_answer, reward_rlvr
from .grpo import compute_advantage_stats, sequence_logprob_and_entropy
from .inference_scaling import best_of_n, majority_vote, self_consistency_vote
from .plotting import plot_grpo_metrics
from .prm import ProcessRewardModel, train_prm
from .process import split_steps
from .process_supervision import build_step_scorer, make_process_advantage_fn
from .prompts import render_prompt, render_prompt_with_think_tokens
from .qwen3 import Qwen3Config, Qwen3Model
from .rewards import reward_format
from .search import self_refinement_loop, step_beam_search
from .sft import train_sft
from .tokenizer import Qwen3Tokenizer
from .training import GRPOConfig, compute_grpo_loss, train_grpo
from .variants import clipped_policy_loss
from .weights import load_pretrained, save_pretrained

__all__ = [
    # chapter 2: model, tokenizer, weights, generation
    "Qwen3Config", "Qwen3Model", "Qwen3Tokenizer", "load_pretrained", "save_pretrained",
    "get_device", "generate", "sample_response", "sample_rollouts",
    # chapter 3: prompts, grading, evaluation
    "render_prompt", "render_prompt_with_think_tokens", "extract_final_candidate",
    "grade_answer", "reward_rlvr", "evaluate",
    # chapters 4-5: inference-time scaling
    "majority_vote", "self_consistency_vote", "best_of_n", "step_beam_search",
    "self_refinement_loop",
    # chapters 6-7: GRPO
    "reward_format", "sequence_logprob_and_entropy", "compute_advantage_stats",
    "clipped_policy_loss", "compute_grpo_loss", "GRPOConfig", "train_grpo", "plot_grpo_metrics",
    # chapter 8: process supervision
    "split_steps", "build_step_scorer", "make_process_advantage_fn", "ProcessRewardModel",
    "train_prm",
    # chapter 9: distillation
    "generate_distillation_data", "train_sft", "DistillConfig", "train_distillation",
]
