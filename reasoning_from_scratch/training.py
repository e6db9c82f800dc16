"""The GRPO loop (book chapters 6-7, written out by hand): `GRPOConfig`, one step in the book's
stages, and `train_grpo`.

One optimizer step, in reading order (`rollout_stage`, then `update_stage`):

    Stage 1-3  sample G rollouts for each of `prompts_per_step` prompts, reward them, turn the
               rewards into group-relative advantages, pack them (grpo.collect_rollouts)
    Stage 4    log-probs the loss compares with: the frozen reference's (beta > 0) and, with
               `inner_epochs` > 1, the sampling policy's
    Stage 5    `inner_epochs` AdamW updates on the clipped GRPO loss (`update`, grpo.policy_loss)
    Stage 6    log the step's metrics row and samples (the run directory, run_dir.py)

Everything else is a layer that plugs in at a named seam and is absent from the step when off:
- systems (systems.py): several processes (DDP, FSDP), the compiled decode step and update,
  the bfloat16 sampler replica and autocast replace `Step.rollouts`, `Step.update`,
  `Step.logprobs` with their general forms and add `Step.after_update`;
- the run (run_dir.py): directory, checkpoints, resume, interrupts, metrics, trackers,
  evaluation schedule, called by `train_grpo` between the stages;
- variants (variants.py): loss types, TIS, off-policy masks chosen by name (`Step.loss_fn`);
  dynamic sampling in the general rollout stage;
- process supervision: the advantage hook (`advantage_fn`) and the branch rows
  (branching.py) of the general rollout stage.
docs/architecture.md draws them. The command-line front end is cli/train.py.

A step's costs (`step_costs`), counted alike for every arm of an experiment: decode_tokens are
the tokens sampled (rollouts, a process scorer's continuations, branches); forward_tokens the
tokens read without sampling: each rollout's prompt once (sampling prefills a group's prompt
once and repeats its cache, so this counts (G - 1) prompts per group more than were computed,
the same for every arm), then each row of the update (its prompt without left padding and its
completion up to its last loss token; the right padding the pass also computes is logged apart,
forward_pad_tokens) once per
inner epoch, once more for the old policy's log-probs (inner epochs > 1) and once for the
reference's, plus a scorer's reads. Backward passes are not counted (about two forwards each).

Interrupts lose nothing: the update, its metrics row and a checkpoint write are critical
sections (interrupts.py); Ctrl-C or a stop signal at any other moment saves `checkpoint-<k>`
holding exactly k updates, and `resume_from` continues to the same weights and metrics as an
uninterrupted run (docs/run_directories.md, docs/preemption.md). Data-parallel runs
(`torchrun --nproc-per-node N`) run this same code in every process and give the run one
process gives (docs/data_parallel.md).
"""

from __future__ import annotations

import copy
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from functools import partial

import torch
from tqdm import tqdm

from .branching import BRANCH_CONTROLS, BRANCH_MAX_NEW_TOKENS
from .checkpoints import load_weights_into
from .distributed import all_gather_objects, run_on_main, world_size
from .evaluation import EVAL_FIGURES, evaluate_policy
from .fsdp import shard_sizes
from .generation import compile_decoding
from .grpo import (
    KL_ESTIMATORS,
    LOSS_TYPES,
    REWARD_NORMALIZATIONS,
    SCALE_REWARDS,
    RolloutBatch,
    add_stats,
    batch_logprobs,
    batch_totals,
    collect_rollouts,
    loss_on_batch,
    mean_over_epochs,
    micro_batch_weights,
    rollout_generators,
    step_prompts,
)
from .interrupts import DEFAULT_STOP_SIGNALS, defer_interrupts, polling_stops, stop_signal_names
from .process import CREDIT_CONTROLS, LOCAL_STEP_WEIGHT, VARIANTS
from .process_supervision import (
    PROCESS_COLUMNS,
    learned_states,
    make_process_advantage_fn,
)
from .prompts import render_prompt
from .rewards import build_reward
from .run_dir import StepRun, eval_line, print_line, start_run, stop_if_interrupted
from .run_log import forward_tokens
from .systems import SystemsLayer, check_processes, general_rollout_stage, systems_layer
from .tracking import report_problem, report_targets
from .validation import (
    at_least,
    check_fields,
    finite,
    in_range,
    non_negative,
    option,
    optional,
    positive,
    probability,
)
from .variants import clipped_policy_loss, loss_function
from .weights import save_pretrained

METRIC_COLUMNS = [
    "step", "loss", "pg_loss", "kl", "reward_mean", "reward_std", "correct_mean", "format_mean",
    "adv_mean", "adv_std", "zero_adv_frac", "entropy", "ratio_mean", "ratio_max",
    "clip_frac_low", "clip_frac_high", "len_mean", "len_max", "truncated_frac", "grad_norm",
    "skipped", "gen_tokens", "scorer_tokens", "decode_tokens", "forward_tokens",
    "forward_pad_tokens", "tokens_per_s", "rollout_s", "update_s", "step_time", "lr",
    "sampling_rounds", "tis_weight_mean", "off_policy_mask_frac",
    *PROCESS_COLUMNS.values(), "branch_rows", "branch_correct_rate",
    "eval_accuracy", "eval_format_rate", "eval_think_accuracy",
    "eval_step_correctness",
]
# Columns that measure time: they differ between two otherwise identical runs.
TIMING_COLUMNS = ("tokens_per_s", "rollout_s", "update_s", "step_time")
# Not "loss": with one update per batch it is ~0 by construction (ratio 1, advantages of mean 0).
PLOT_COLUMNS = ["reward_mean", "correct_mean", "format_mean", "eval_accuracy",
                "eval_think_accuracy", "eval_step_correctness", "entropy", "len_mean",
                "zero_adv_frac", "kl"]
# ... and, in process-supervised runs, how the step scorer judged the rollouts' steps.
PROCESS_PLOT_COLUMNS = ["proc_step_correct_rate"]

# The chapter 7 default mix of difficulty levels 1-5 in the arithmetic training problems: more of
# the levels where the base model still errs, where a group's rollouts disagree and RL has a
# signal (the held-out splits stay uniform). See docs/grpo.md's recipe search.
DEFAULT_TRAIN_LEVEL_WEIGHTS = (1.0, 1.0, 2.0, 2.0, 2.0)


# Chapter 6's algorithm as GRPOConfig overrides: loss = -(advantage x summed log-prob).mean()
# (the "sequence" loss at ratio 1), no clipping, no KL, one update per batch, correctness reward
# only, every group kept. chapters/ch06_train.py's defaults and a row of chapter 7's table.
CHAPTER6_RECIPE = dict(loss_type="sequence", epsilon=None, epsilon_high=None, beta=0.0,
                       format_reward_weight=0.0, format_reward_conditional=False,
                       skip_zero_advantage=False, inner_epochs=1)

SUPERVISIONS = ("outcome", "process")
STEP_SPLITS = ("tags", "newlines", "blank_lines")
SAMPLER_DTYPES = ("auto", "float32", "bfloat16")
AUTOCASTS = ("auto", "off", "bfloat16")


@dataclass
class GRPOConfig:
    """Every knob of a GRPO run; defaults are the chapter 7 recipe for the bundled tiny model.
    Each field carries its help, valid range, choices and group (`validation.option`): the command
    line (cli/train.py) and the checks are built from them. The fields sit in their groups, in
    --help's order: core (the GRPO step itself), process, variants, systems and run; code reads
    them flat all the same (config.lr).

    Searched on the arithmetic val split (200 problems, greedy strict accuracy 0.255 before
    training; the table is in docs/grpo.md): 16 prompts x 8 rollouts per step beat 8 x 16 and 8 x 8,
    lr 1e-4 matched 2e-4 with less drift, and training problems weighted towards levels 3-5
    (DEFAULT_TRAIN_LEVEL_WEIGHTS) raised accuracy among think answers and step correctness where
    uniform levels left them flat. 112 new tokens fit the longest (level 5) solutions. For
    Qwen3-0.6B on MATH use the flags in chapters/ch07_train.py's docstring (lr ~1e-6, longer
    completions, micro-batches).
    """

    # ---- core: the GRPO step of chapters 6-7 (the book's algorithm, chapter 7's additions)
    # optimisation (AdamW, linear warmup then constant learning rate, grad-norm clipping)
    steps: int = option(150,
        "optimizer steps (each: rollouts for prompts-per-step prompts, then the update(s))",
        rule=at_least(1), group="core")
    lr: float = option(1e-4, "peak AdamW learning rate", rule=positive, group="core")
    warmup_steps: int = option(5,
        "steps of linear learning-rate warmup from lr/warmup to lr",
        rule=non_negative, group="core")
    weight_decay: float = option(0.0, "AdamW weight decay", rule=non_negative, group="core")
    max_grad_norm: float = option(1.0, "clip the gradient norm to this value", rule=positive,
        group="core")
    # rollouts
    prompts_per_step: int = option(16, "training prompts per optimizer step", rule=at_least(1),
        group="core")
    num_rollouts: int = option(8, "G: sampled completions per prompt (one group)", rule=at_least(2),
        group="core")
    max_new_tokens: int = option(112, "maximum generated tokens per rollout", rule=at_least(1),
        group="core")
    temperature: float = option(1.0, "rollout sampling temperature", rule=positive, group="core")
    top_p: float = option(1.0, "rollout nucleus-sampling threshold", rule=probability, group="core")
    # rewards: correctness + format_reward_weight x think format (only if correct when
    # format_reward_conditional)
    format_reward_weight: float = option(0.5,
        "weight of the <think>...</think> format reward (0: correctness only)",
        rule=non_negative, group="core")
    format_reward_conditional: bool = option(True, "pay the format reward only for correct answers",
        group="core")
    # advantages
    scale_rewards: str = option("group",
        "advantage scaling: group std (GRPO), batch std, or none (Dr. GRPO)",
        choices=SCALE_REWARDS, group="core")
    skip_zero_advantage: bool = option(True,
        "drop groups with no learning signal: rewards all equal (outcome supervision), or, "
        "with process supervision, token advantages all exactly zero (equal outcomes and no "
        "step credit)", group="core")
    # loss and update
    loss_type: str = option("grpo",
        "grpo: per-sequence token mean; dapo: batch token mean; dr_grpo: sum/(B*max tokens); "
        "sequence: the book's summed log-prob ratio; gspo: clipped length-normalised sequence "
        "ratio (GSPO); cispo: clipped, stop-gradient importance weight times log-prob "
        "(MiniMax-M1)",
        choices=LOSS_TYPES, group="core")
    epsilon: float | None = option(0.2,
        "PPO clip range: ratio clipped to [1-epsilon, 1+epsilon_high] ('none': no clip)",
        rule=optional(in_range(0, 1, low_open=True)), group="core")
    epsilon_high: float | None = option(None,
        "upper clip range (DAPO clip-higher; 'none': same as epsilon)",
        rule=optional(positive), group="core")
    beta: float = option(0.0,
        "weight of the k3 KL penalty to the frozen starting model (0: no reference model)",
        rule=non_negative, group="core")
    entropy_coef: float = option(0.0, "entropy bonus coefficient", rule=finite, group="core")
    inner_epochs: int = option(1,
        "updates per batch of rollouts (PPO-style; >1 makes the ratio leave 1)",
        rule=at_least(1), group="core")
    micro_batch_size: int | None = option(None,
        "rollouts per forward/backward pass ('none': the whole batch)",
        rule=optional(at_least(1)), group="core")
    chunk_size: int = option(1024,
        "answer positions per lm_head chunk in the log-prob pass (memory bound)",
        rule=at_least(1), group="core")
    # seed and run directory
    seed: int = option(123, "random seed (prompt order, rollout sampling)", rule=non_negative,
        group="core")
    output_dir: str = option("runs/grpo",
        "run directory for metrics, samples, checkpoints, summary and plot", group="core")

    # ---- process: process supervision (chapter 8): step scorers, process advantages, branches
    supervision: str = option("outcome",
        "outcome (one reward per completion) or process (a reward per reasoning step, "
        "DeepSeekMath-style token advantages)",
        choices=SUPERVISIONS, group="process")
    step_scorer: str = option("verifier",
        "process supervision step scorer: verifier | verifier-signed | verifier-think (steps "
        "count only in the think format) | verifier-think-local (the same, each step checked on "
        "its own inputs, for progress-local) | format (the think format alone, a placebo) | belief "
        "(the policy's probability of the gold answer after each step, GRPO-VPS) | mc | mc-hard "
        "| mc-branch (Monte-Carlo from the group and branched caches) | prm:PATH | "
        "online-prm:PATH | "
        "online-prm-outcome:PATH (a PRM re-fitted on the rollouts with verifier / outcome labels)",
        group="process")
    process_variant: str = option("sum",
        "process advantage: sum (DeepSeekMath) | process+outcome | min (PURE) | position | "
        "outcome-anchored: first-error | progress | progress-local (credit past the first "
        "error) | clip | delta (Gao et al.) | pure (PURE min "
        "form) | value-delta (VinePPO); see process.anchored_credit",
        choices=VARIANTS, group="process")
    step_split: str = option("tags",
        "how completions are split into steps: tags | newlines | blank_lines",
        choices=STEP_SPLITS, group="process")
    mc_rollouts: int = option(4,
        "Monte-Carlo continuations per step prefix (step-scorer mc)",
        rule=at_least(1), group="process")
    process_alpha: float = option(1.0,
        "weight of the step credit in the outcome-anchored process variants (first-error, "
        "progress, clip, delta, pure, value-delta; process.anchored_credit)",
        rule=non_negative, group="process")
    process_local_weight: float = option(LOCAL_STEP_WEIGHT,
        "progress-local: reward of a step that is right on its own inputs after the "
        "completion's first error (a correct step on a correct path earns 1)",
        rule=in_range(0, 1), group="process")
    process_credit_control: str = option("none",
        "placebo controls of the outcome-anchored forms' step credit: none | flat (each "
        "completion's total credit spread evenly over its tokens) | shuffled (the credits "
        "permuted among a completion's own steps); process.control_credit",
        choices=CREDIT_CONTROLS, group="process")
    # branches at the first error
    branch_rollouts: int = option(0,
        "branches at the first error: one-step continuations sampled from each of a group's "
        "first-error states, graded by the verifier and trained on as extra rows (0: off; "
        "process supervision with a verifier step scorer; branching.py)",
        rule=non_negative, group="process")
    branch_states: int = option(2,
        "branches: first-error states branched from per group, the most shared first",
        rule=at_least(1), group="process")
    branch_max_new_tokens: int = option(BRANCH_MAX_NEW_TOKENS,
        "branches: token budget of one branch (its first step is kept; never past the "
        "rollouts' budget)",
        rule=at_least(1), group="process")
    branch_control: str = option("none",
        "branches' placebo: none | shuffled (each state's branch advantages permuted among its "
        "branches: the same rows and cost, which branch was right lost)",
        choices=BRANCH_CONTROLS, group="process")

    # ---- variants: GRPO variants of the literature (GDPO, DAPO, KL estimator, TIS, masking)
    reward_normalization: str = option("sum",
        "sum: normalise the weighted sum of the reward terms in each group (GRPO); per_reward: "
        "normalise each term in its group, then sum (GDPO)",
        choices=REWARD_NORMALIZATIONS, group="variants")
    dynamic_sampling: bool = option(False,
        "DAPO dynamic sampling: draw more prompts until prompts-per-step groups have unequal "
        "rewards (at most max-sampling-rounds batches of prompts)", group="variants")
    max_sampling_rounds: int = option(3,
        "dynamic sampling: most batches of prompts sampled in one step",
        rule=at_least(1), group="variants")
    kl_estimator: str = option("k3",
        "k3: per-token k3 estimate (always >= 0); sequence: the book's summed logp - ref_logp per"
        " answer (zero gradient on average; shown to fail)",
        choices=KL_ESTIMATORS, group="variants")
    tis_cap: float | None = option(None,
        "truncated importance sampling: weight each token by min(pi_old / pi_sampler, C) with the"
        " sampler's own log-probs ('none': off)",
        rule=optional(positive), group="variants")
    off_policy_mask_threshold: float | None = option(None,
        "DeepSeek-V3.2 off-policy sequence masking: drop negative-advantage answers whose mean "
        "per-token KL to the sampler exceeds this ('none': off)",
        rule=optional(non_negative), group="variants")
    mask_truncated: bool = option(False,
        "leave completions cut off at max-new-tokens out of the loss (DAPO)", group="variants")

    # ---- systems: speed and memory (compiled paths, precision, activation checkpointing, FSDP)
    activation_checkpointing: bool = option(False,
        "recompute each decoder block in the backward pass instead of keeping its activations "
        "(torch.utils.checkpoint): the update's activation memory drops to the blocks' inputs "
        "for one more forward pass of compute (docs/data_parallel.md)", group="systems")
    compile: bool | None = option(None,
        "decode rollouts, evaluations and Monte-Carlo step values with one static, compiled "
        "step (torch.compile; the same tokens; each shape compiles once, seconds on a CPU). "
        "Default: on for CUDA, off elsewhere (no gain on the CPU, docs/speed.md)", group="systems")
    compile_update: bool | None = option(None,
        "run the update's decoder blocks compiled (torch.compile), every micro-batch padded to "
        "one of a few shapes (at most micro-batch size x longest training prompt + "
        "max-new-tokens; update-buckets), the padding left out of the loss, so the training "
        "step compiles once per shape; the same loss and gradients up to float rounding. "
        "Default: as compile; never with fsdp", group="systems")
    update_buckets: int = option(4,
        "length buckets of the compiled update: rows and completion columns each get this many "
        "evenly spaced sizes up to the micro-batch size and max-new-tokens, and every "
        "micro-batch is padded to the smallest that holds it (padding at most ~1/N of each; "
        "a graph per size pair met, at most N**2; 1: the one full shape)",
        rule=at_least(1), group="systems")
    sampler_dtype: str = option("auto",
        "dtype of the weights that sample rollouts and evaluations: a copy of the policy in "
        "that dtype, refreshed after every update (also the fsdp replica's dtype). auto: "
        "bfloat16 on CUDA, the model's own elsewhere",
        choices=SAMPLER_DTYPES, group="systems")
    autocast: str = option("auto",
        "the update's forward passes under torch.autocast in this dtype (weights, gradients "
        "and AdamW state stay in the model's dtype). auto: bfloat16 on CUDA without fsdp "
        "(whose own mixed precision computes in bfloat16), off elsewhere",
        choices=AUTOCASTS, group="systems")
    fsdp: bool = option(False,
        "shard the weights, gradients and AdamW state over the torchrun processes (FSDP2, "
        "fsdp.py); rollouts and evaluation run on an unsharded replica; sharded checkpoints",
        group="systems")
    export_hf_checkpoints: bool = option(False,
        "with --fsdp: also write the whole weights in Hugging Face layout into every "
        "checkpoint-<k> (rank 0 writes a full copy of the model, 4 bytes per parameter in fp32, "
        "while the other processes wait; minutes for billions of parameters). final/ always "
        "has them; resuming reads the shards alone. Without --fsdp a checkpoint's weights are "
        "in HF layout anyway", group="systems")

    # ---- run: evaluation, samples, checkpoints, live logging, stop signals, progress
    # evaluation and samples
    eval_every: int = option(25,
        "evaluate on the held-out set every N steps (0: only before and after)",
        rule=non_negative, group="run")
    eval_examples: int = option(200, "number of held-out examples for evaluation", rule=at_least(1),
        group="run")
    eval_max_new_tokens: int | None = option(None,
        "max generated tokens in evaluation ('none': max-new-tokens)",
        rule=optional(at_least(1)), group="run")
    eval_batch_size: int = option(50, "prompts per batch in evaluation", rule=at_least(1),
        group="run")
    sample_every: int = option(10,
        "append the step's completions to samples.jsonl every N steps (0: never)",
        rule=non_negative, group="run")
    # checkpoints and stopping
    checkpoint_every: int = option(0,
        "save a resumable checkpoint every N steps (0: none by steps)",
        rule=non_negative, group="run")
    checkpoint_minutes: float = option(10.0,
        "save a resumable checkpoint once this many minutes of wall time passed since the last "
        "one (0: off): a kill that no handler can catch (SIGKILL, out of memory, power loss) "
        "loses at most this long",
        rule=non_negative, group="run")
    keep_checkpoints: int = option(2,
        "checkpoint-<step> directories kept, the latest (0: all); final/ is always kept",
        rule=non_negative, group="run")
    stop_signals: str = option(DEFAULT_STOP_SIGNALS,
        "signals that save a checkpoint and stop the run like Ctrl-C, exit status 75 "
        "(comma-separated; 'none': only Ctrl-C)",
        rule=stop_signal_names, group="run")
    # watching the run
    report_to: tuple[str, ...] = option((),
        "watch the run live: log metrics, evaluations, reward histograms and sampled completions "
        "to tensorboard (<run>/tensorboard) and/or wandb (<run>/wandb, offline without an "
        "account); several comma-separated (tensorboard,wandb); none: off",
        rule=report_problem, group="run")
    progress: bool = option(True, "show the progress bar and per-step lines", group="run")

    def __post_init__(self):
        check_fields(self)
        if self.fsdp and self.compile_update:
            raise ValueError("compile_update does not work with fsdp (its sharded blocks "
                             "gather their weights in hooks the compiled block cannot run)")
        self.report_to = report_targets(self.report_to)  # "none", names or a list -> a tuple
        if self.branch_rollouts:
            self._check_branches()

    def _check_branches(self):
        """Branches need what they are built from: the verifier's step rewards of one
        sampling round, and no sampler log-probs (their rows have none)."""
        if self.supervision != "process" or not self.step_scorer.startswith("verifier"):
            raise ValueError("branch_rollouts needs supervision='process' with a verifier step "
                             f"scorer, got {self.supervision!r} / {self.step_scorer!r}")
        if self.dynamic_sampling:
            raise ValueError("branch_rollouts does not work with dynamic_sampling (branches "
                             "come from one sampling round)")
        if self.tis_cap is not None or self.off_policy_mask_threshold is not None:
            raise ValueError("branch_rollouts does not work with tis_cap or "
                             "off_policy_mask_threshold (branch rows have no sampler "
                             "log-probs)")

    @property
    def eval_tokens(self) -> int:
        """Answer budget of the held-out evaluations (eval_max_new_tokens, else max_new_tokens)."""
        return self.eval_max_new_tokens or self.max_new_tokens

    @classmethod
    def from_dict(cls, d: dict) -> GRPOConfig:
        """Config from a dict, ignoring unknown keys (e.g. a trainer_state.json of a newer run)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


# The valid range of each numeric GRPOConfig field, from its metadata (kept for importers)
CONFIG_RULES = {f.name: f.metadata["rule"] for f in fields(GRPOConfig) if f.metadata["rule"]}


# ----------------------------------------------------------------------------------------------
# Small pieces
# ----------------------------------------------------------------------------------------------

def lr_at_step(step, config):
    """Linear warmup over `warmup_steps` (step 0 gets lr / warmup), then constant."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    return config.lr


def rollout_metrics(batch: RolloutBatch, reward_names):
    """Reward, advantage and length statistics of a step's rollouts (all groups)."""
    r = batch.rewards.flatten()
    adv = torch.tensor([s["advantage"] for s in batch.samples])
    lengths = torch.tensor([s["length"] for s in batch.samples], dtype=torch.float32)
    out = {
        "reward_mean": r.mean().item(), "reward_std": r.std().item() if r.numel() > 1 else 0.0,
        "adv_mean": adv.mean().item(), "adv_std": adv.std().item() if adv.numel() > 1 else 0.0,
        "zero_adv_frac": batch.zero_adv_frac,
        "len_mean": lengths.mean().item(), "len_max": lengths.max().item(),
        "truncated_frac": sum(s["truncated"] for s in batch.samples) / len(batch.samples),
    }
    for name in reward_names:
        out[f"{name}_mean"] = sum(s.get(name, 0.0) for s in batch.samples) / len(batch.samples)
    return out


def plot_columns(config) -> list[str]:
    """The metrics.png panels of a run: PLOT_COLUMNS, plus PROCESS_PLOT_COLUMNS when process
    supervised."""
    return PLOT_COLUMNS + (PROCESS_PLOT_COLUMNS if config.supervision == "process" else [])


# ----------------------------------------------------------------------------------------------
# One step
# ----------------------------------------------------------------------------------------------

@dataclass
class Step:
    """What every step of a run uses, fixed before the first: the models, data, reward and loss,
    and the stage functions. These are this module's plain ones unless a systems layer
    (systems.py: several processes, compiled paths, precision, sampling rounds, branches)
    replaced them."""

    model: torch.nn.Module  # the policy being trained
    optimizer: torch.optim.Optimizer
    policy: torch.nn.Module  # what samples the rollouts: the model, or a replica of it
    tokenizer: object
    examples: list  # the training problems
    device: torch.device
    config: GRPOConfig
    reward_fn: Callable  # (text, token_ids, prompt_len, example) -> (total, components)
    reward_names: list
    prompt_fn: Callable  # problem -> prompt text
    loss_fn: Callable  # the run's loss (variants.loss_function)
    advantage_fn: Callable | None = None  # process supervision's token advantages
    ref_model: torch.nn.Module | None = None  # the frozen start (beta > 0)
    compiled_decoding: bool = False  # rollouts decoded by the compiled step
    rollouts: Callable = None  # (step_parts, step) -> (batch, cost): `rollout_stage`
    update: Callable = None  # one AdamW step on a batch: `update`
    logprobs: Callable = None  # per-token log-probs without gradients: `logprobs`
    after_update: Callable | None = None  # (model): e.g. refresh the sampler's weights
    old_policy: torch.nn.Module | None = None  # pi_old for inner epochs (default: the model)
    total: Callable = list  # values summed over the processes (one process: themselves)


def rollout_stage(s: Step, step: int):
    """Stages 1-3 of step `step`: its prompts' rollouts sampled, rewarded and turned into
    group-relative advantages, packed into one batch (grpo.collect_rollouts). Returns (batch,
    cost); process supervision's is systems.general_rollout_stage (its hook and scorer)."""
    t0, c = time.time(), s.config
    prompts = step_prompts(s.examples, step, c)
    batch = collect_rollouts(
        s.policy, s.tokenizer, prompts, s.device, s.reward_fn, num_rollouts=c.num_rollouts,
        max_new_tokens=c.max_new_tokens, temperature=c.temperature, top_p=c.top_p,
        generator=rollout_generators(s.device, c.seed, step, range(len(prompts))),
        scale_rewards=c.scale_rewards, skip_zero_advantage=c.skip_zero_advantage,
        mask_truncated=c.mask_truncated, prompt_fn=s.prompt_fn,
        record_logprobs=c.tis_cap is not None or c.off_policy_mask_threshold is not None,
        reward_normalization=c.reward_normalization, compile=s.compiled_decoding)
    return batch, {"t0": t0, "rollout_s": time.time() - t0, "sampling_rounds": 1,
                   "scorer_tokens": 0, "scorer_forward_tokens": 0}


def update_stage(s: Step, batch: RolloutBatch, step: int, cost: dict, hook) -> dict:
    """Stages 4-5 of step `step` on its batch: the log-probs the loss compares with, then
    `inner_epochs` AdamW updates. Returns the step's metrics row."""
    hook("update", step + 1)
    t1, c = time.time(), s.config
    lr = lr_at_step(step, c)
    for group in s.optimizer.param_groups:
        group["lr"] = lr
    row = {"step": step + 1, "lr": lr, **rollout_metrics(batch, s.reward_names)}
    if s.total([batch.size])[0]:  # 0: every group of the step had equal rewards
        # Stage 4: log-probs of the frozen reference and (inner epochs) of the sampling policy
        s.model.eval()
        with torch.no_grad():
            ref_logp = None if s.ref_model is None else s.logprobs(s.ref_model, batch, c)
            old_logp = None if c.inner_epochs == 1 else \
                s.logprobs(s.old_policy or s.model, batch, c)
        # Stage 5: the update(s): loss, backward, clip, AdamW step
        s.model.train()
        epochs = [s.update(s.model, s.optimizer, batch, old_logp, ref_logp, c, s.loss_fn)
                  for _ in range(c.inner_epochs)]
        s.model.eval()
        if s.after_update is not None:
            s.after_update(s.model)  # the next rollouts sample from the new weights
        row.update(epochs[0] if len(epochs) == 1 else mean_over_epochs(epochs))
    else:
        row.update(loss=0.0, pg_loss=0.0, kl=0.0, skipped=0)
    return {**row, **step_costs(s, batch, cost, t1)}


def logprobs(model, batch: RolloutBatch, config):
    """Per-token log-probs (B, Tc) of a batch without gradients (the caller's no_grad), at the
    sampling temperature (the distribution the rollouts were drawn from, as TRL does)."""
    mbs = config.micro_batch_size or batch.size
    return torch.cat([batch_logprobs(model, batch.slice(i, i + mbs), config.chunk_size, False,
                                     config.temperature)[0]
                      for i in range(0, batch.size, mbs)])


def update(model, optimizer, batch: RolloutBatch, old_logp, ref_logp, config, loss_fn=None):
    """Stage 5: one AdamW step on the batch's loss, accumulated over micro-batches; skipped (the
    weights and AdamW moments untouched) when the loss or the clipped gradient is not finite."""
    loss_fn = loss_fn or loss_function(config)
    optimizer.zero_grad(set_to_none=True)
    totals = batch_totals(batch)
    mbs = config.micro_batch_size or max(1, batch.size)
    sums, finite_ = {"ratio_max": None}, True
    for i in range(0, batch.size, mbs):
        mb, part = batch.slice(i, i + mbs), slice(i, i + mbs)
        out = loss_on_batch(model, mb, None if old_logp is None else old_logp[part],
                            None if ref_logp is None else ref_logp[part], loss_fn,
                            config.chunk_size, config.temperature)
        loss = out.pop("loss")
        if not torch.isfinite(loss):
            finite_ = False
            break
        w, w_stat = micro_batch_weights(mb, totals, config.loss_type)
        if loss.requires_grad:  # a micro-batch without loss tokens (all masked) has no graph
            (loss * w).backward()
        add_stats(sums, out, loss, w, w_stat)
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)) \
        if finite_ else float("nan")
    finite_ = finite_ and math.isfinite(grad_norm) and all(  # the *clipped* gradient: finite
        bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None)
    if not finite_:  # never let a NaN/inf reach the weights or the AdamW moments
        optimizer.zero_grad(set_to_none=True)
        sums.setdefault("loss", float("nan"))
        return {**sums, "grad_norm": grad_norm, "skipped": 1}
    optimizer.step()
    return {**sums, "grad_norm": grad_norm, "skipped": 0}


def step_costs(s: Step, batch: RolloutBatch, cost: dict, t1: float) -> dict:
    """A row's seconds and tokens: sampled (decode_tokens) and read (forward_tokens)."""
    t2 = time.time()  # this process's own clock: rank 0's times are the ones logged
    scorer = cost["scorer_tokens"]
    forward, padding = forward_tokens(batch, s.config, s.ref_model is not None, s.total)
    return dict(rollout_s=cost["rollout_s"], update_s=t2 - t1, step_time=t2 - cost["t0"],
                sampling_rounds=cost["sampling_rounds"],
                tokens_per_s=batch.num_generated_tokens / max(t2 - cost["t0"], 1e-9),
                gen_tokens=batch.num_generated_tokens, scorer_tokens=scorer,
                decode_tokens=batch.num_generated_tokens + scorer,
                forward_tokens=forward + cost["scorer_forward_tokens"],
                forward_pad_tokens=padding, **cost.get("metrics", {}))


def grpo_loss_on_batch(model, batch: RolloutBatch, old_logp=None, ref_logp=None, loss_type="grpo",
                       epsilon=0.2, epsilon_high=None, beta=0.0, entropy_coef=0.0,
                       max_completion_length=None, chunk_size=1024, temperature=1.0,
                       sampler_logp=None, tis_cap=None, off_policy_mask_threshold=None,
                       kl_estimator="k3", fixed_shape=None):
    """The loss dict of `variants.clipped_policy_loss` on a packed batch, log-probs with grad
    (`grpo.loss_on_batch` with the loss's settings as keywords). sampler_logp: the batch's own
    when None."""
    loss_fn = partial(clipped_policy_loss, loss_type=loss_type, epsilon=epsilon,
                      epsilon_high=epsilon_high, beta=beta, entropy_coef=entropy_coef,
                      max_completion_length=max_completion_length, tis_cap=tis_cap,
                      off_policy_mask_threshold=off_policy_mask_threshold,
                      kl_estimator=kl_estimator)
    if sampler_logp is not None:
        batch = replace(batch, sampler_logp=sampler_logp)
    return loss_on_batch(model, batch, old_logp, ref_logp, loss_fn, chunk_size, temperature,
                         fixed_shape)





def compute_grpo_loss(model, tokenizer, example, device, num_rollouts=8, max_new_tokens=512,
                      temperature=0.8, top_p=0.9, *, reward_fn=None, format_reward_weight=0.0,
                      format_reward_conditional=False, loss_type="grpo", epsilon=0.2,
                      epsilon_high=None, beta=0.0, ref_model=None, scale_rewards="group",
                      entropy_coef=0.0, mask_truncated=False, chunk_size=1024, generator=None,
                      prompt_fn=render_prompt, advantage_fn=None, supervision="outcome",
                      logprob_temperature=1.0):
    """GRPO loss for one example (book chapters 6-7 contract), batched over its G rollouts.

    Samples `num_rollouts` completions with one shared prefill, scores them with `reward_fn`
    (default: correctness + `format_reward_weight` x think format, optionally only when correct),
    normalises the rewards within the group, and returns a dict with loss, pg_loss, kl_loss,
    rewards, advantages, samples, loss_tensor (backpropagate this), policy_ratio, clip_fraction,
    entropy. A KL term needs `beta > 0` and a frozen `ref_model`. See `clipped_policy_loss` and
    `aggregate_loss` for loss_type/epsilon/epsilon_high, `group_advantages` for scale_rewards,
    `collect_rollouts` for advantage_fn (token-level advantages). supervision="process" needs
    that advantage_fn, built by `process_supervision.make_process_advantage_fn` (DeepSeekMath
    section 4.1.3). logprob_temperature: the T of the policy's and reference's log-probs (1.0:
    the book's; TRL uses the sampling `temperature`).
    """
    if supervision not in ("outcome", "process"):
        raise ValueError(f"supervision must be 'outcome' or 'process', got {supervision!r}")
    if supervision == "process" and advantage_fn is None:
        raise ValueError("supervision='process' needs advantage_fn=make_process_advantage_fn("
                         "tokenizer, step_scorer, ...) from process_supervision.py")
    if beta and ref_model is None:
        raise ValueError("compute_grpo_loss: beta > 0 needs a frozen ref_model")
    if reward_fn is None:
        reward_fn = build_reward(tokenizer, format_reward_weight, format_reward_conditional)
    batch = collect_rollouts(model, tokenizer, [example], device, reward_fn,
                             num_rollouts=num_rollouts, max_new_tokens=max_new_tokens,
                             temperature=temperature, top_p=top_p, generator=generator,
                             scale_rewards=scale_rewards, mask_truncated=mask_truncated,
                             prompt_fn=prompt_fn, advantage_fn=advantage_fn)
    ref_logp = None
    if beta:
        with torch.no_grad():
            ref_logp, _ = batch_logprobs(ref_model, batch, chunk_size, False, logprob_temperature)
    out = grpo_loss_on_batch(model, batch, ref_logp=ref_logp, loss_type=loss_type,
                             epsilon=epsilon, epsilon_high=epsilon_high, beta=beta,
                             entropy_coef=entropy_coef, max_completion_length=max_new_tokens,
                             chunk_size=chunk_size, temperature=logprob_temperature)
    loss_tensor = out["loss"]
    return {
        "loss": loss_tensor.item(),
        "pg_loss": out["pg_loss"],
        "kl_loss": out["kl"],
        "rewards": batch.rewards[0].tolist(),
        "advantages": batch.advantages.tolist(),
        "samples": batch.samples,
        "loss_tensor": loss_tensor,
        "policy_ratio": out["ratio_mean"],
        "clip_fraction": out["clip_frac_low"] + out["clip_frac_high"],
        "entropy": out["entropy"],
    }


# ----------------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------------

def train_grpo(model, tokenizer, train_examples, eval_examples, device, config: GRPOConfig,
               resume_from=None, reward_fn=None, advantage_fn: Callable | None = None,
               prompt_fn=render_prompt, overwrite=False, base_evaluation: dict | None = None,
               phase_hook: Callable[[str, int], None] | None = None) -> dict:
    """Train `model` with GRPO on `train_examples`; returns the summary dict (also summary.json).

    reward_fn: default `build_reward(tokenizer, format_reward_weight, format_reward_conditional)`.
    advantage_fn: process supervision's token advantages (`grpo.collect_rollouts`), built from
    the config's step scorer when None. resume_from: a checkpoint or run directory to continue
    exactly. overwrite: replace a run already in output_dir. base_evaluation: the starting
    model's `evaluate_policy` figures, if known. phase_hook(phase, step): called as each phase
    starts ("base_eval", "rollouts", "update", "eval", "checkpoint", "final_eval",
    "final_save"). Data-parallel: every process of a torchrun group calls this with the same
    arguments and its own device (docs/data_parallel.md); rank 0 alone writes and prints."""
    check_processes(config)  # before anything is written
    config, out, hook = start_run(config, resume_from, overwrite, phase_hook)
    layer = systems_layer(model, tokenizer, train_examples, eval_examples, device, config,
                          prompt_fn)
    model, config = layer.model, layer.config  # (FSDP: the sharded model; the compile check's)
    s = _step_parts(model, tokenizer, train_examples, device, config, reward_fn, advantage_fn,
                    prompt_fn, layer)
    t_start = time.time()
    columns = METRIC_COLUMNS + [f"{n}_mean" for n in s.reward_names
                                if f"{n}_mean" not in METRIC_COLUMNS]
    run = StepRun(out, model, tokenizer, s.optimizer, config, columns, plot_columns(config),
                  layer.replica, learned_states(s.advantage_fn))  # an online PRM's, if any
    if run.restore(resume_from, base_evaluation) is not None:
        run.saved = (None, run.completed, run.eval_pending)
        layer.refresh_sampler()
    run.open_logs(resumed=resume_from is not None)
    s.ref_model = _reference_model(layer.trained, tokenizer, out, config,
                                   resumed=resume_from is not None)

    def evaluate_now():  # a phase whose decoding polls for an agreed stop (`stops`, below)
        with polling_stops(stops):
            return evaluate_policy(s.policy, tokenizer, layer.eval_set, device,
                                   config.eval_tokens, config.eval_batch_size, prompt_fn,
                                   compile=s.compiled_decoding)

    bar = tqdm(total=config.steps, initial=run.completed, desc="grpo",
               disable=not config.progress)
    with run.stoppable() as (interrupted, stops), bar:
        run.start(evaluate_now, interrupted, hook, len(layer.eval_set))
        if run.completed < config.steps:
            with polling_stops(stops):
                layer.warm_up(s.ref_model)
        while run.completed < config.steps:
            step = run.completed
            stop_if_interrupted(interrupted)
            hook("rollouts", step + 1)
            with polling_stops(stops):  # a stop in here abandons the step's rollouts
                batch, cost = s.rollouts(s, step)  # Stages 1-3
            stop_if_interrupted(interrupted)
            with defer_interrupts():  # the update, its row and its samples: all or nothing
                row = update_stage(s, batch, step, cost, hook)  # Stages 4-5
                run.log_step(row, batch.samples)  # Stage 6
            run.after_step(bar, row, evaluate_now, interrupted, hook)
        bar.close()
        final, summary = run.finish(evaluate_now, interrupted, hook, lambda final: {
            **_summary(run, final, len(layer.eval_set), time.time() - t_start),
            **({"compile_check": layer.compile_report} if layer.compile_report else {})})
    print_line(config, f"held-out before: {eval_line(run.base)}\nheld-out after:  "
                       f"{eval_line(final)}\nwrote {out}")
    return summary


def _step_parts(model, tokenizer, train_examples, device, config, reward_fn, advantage_fn,
                prompt_fn, layer: SystemsLayer) -> Step:
    """The run's `Step`: the reward, the process hook, the loss, AdamW, and the stage functions
    (the plain ones, or the systems layer's)."""
    if config.supervision == "process" and advantage_fn is None:
        advantage_fn = _process_advantage_fn(layer.policy, tokenizer, device, config)
    if reward_fn is None:
        reward_fn = build_reward(tokenizer, config.format_reward_weight,
                                 config.format_reward_conditional)
    torch.manual_seed(config.seed)
    random.seed(config.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr,
                                  weight_decay=config.weight_decay)
    s = Step(model, optimizer, layer.policy, tokenizer, train_examples, device, config,
             reward_fn, getattr(reward_fn, "names", ["correct", "format"]), prompt_fn,
             loss_function(config), advantage_fn,
             compiled_decoding=compile_decoding(config.compile, device),
             rollouts=rollout_stage if advantage_fn is None else general_rollout_stage,
             update=update, logprobs=logprobs)
    return replace(s, **layer.stages)


def _process_advantage_fn(model, tokenizer, device, config):
    """Process supervision's token advantages from the config's step scorer (DeepSeekMath
    section 4.1.3); "mc" continues with the policy being trained (decoding compiled as
    `config.compile` says)."""
    return make_process_advantage_fn(
        tokenizer, config.step_scorer, config.process_variant, config.step_split,
        model=model, device=device, mc_rollouts=config.mc_rollouts,
        mc_max_new_tokens=config.max_new_tokens, mc_temperature=config.temperature,
        alpha=config.process_alpha, credit_control=config.process_credit_control,
        seed=config.seed, mc_compile=compile_decoding(config.compile, device),
        local_weight=config.process_local_weight,
    )


def _summary(run, final, eval_examples, wall_seconds):
    """summary.json: base and final figures, accuracy per level, run facts."""
    base = run.base
    return {
        **{f"{when}_{k}": figures.get(k)
           for k in EVAL_FIGURES for when, figures in (("base", base), ("final", final))},
        "per_level": {lv: {"base": base.get("per_level", {}).get(lv), "final": acc}
                      for lv, acc in final["per_level"].items()},
        "steps": run.config.steps, "wall_seconds": wall_seconds,
        "eval_examples": eval_examples, "output_dir": str(run.out),
        "world_size": world_size(),
        # FSDP: what each process holds of the weights and the AdamW state (`fsdp.shard_sizes`)
        **({"shards": all_gather_objects(shard_sizes(run.model, run.optimizer))}
           if run.replica is not None else {}),
    }


def _reference_model(model, tokenizer, out, config, resumed):
    """Frozen copy of the starting policy, only when beta > 0; kept on disk for exact resumes
    (written by rank 0, read by every process)."""
    if not config.beta:
        return None
    ref = copy.deepcopy(model).eval()
    ref.requires_grad_(False)
    if resumed:
        load_weights_into(ref, out / "reference")
    else:
        run_on_main(save_pretrained, ref, tokenizer, out / "reference")
    return ref
