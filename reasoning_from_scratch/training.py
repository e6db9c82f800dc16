"""The GRPO training loop (book chapters 6-7, written out by hand): `GRPOConfig` and `train_grpo`.

One optimizer step = sample G rollouts for each of `prompts_per_step` prompts (one shared
prefill per prompt), score them, turn rewards into group-relative advantages, then run
`inner_epochs` AdamW updates on the clipped GRPO loss of that batch. Everything a run produces
lives in `config.output_dir`: metrics.csv (one row per step), samples.jsonl, checkpoints
(`checkpoint-<step>/`, see checkpoints.py), final/, summary.json (incl. the base model's
evaluation) and metrics.png (redrawn at every evaluation). With `report_to` the same rows,
evaluations and samples also go to TensorBoard and/or W&B as they are written (tracking.py).
The command-line front end is cli/train.py.

Interrupts lose nothing: the update, its metrics row and a checkpoint write are critical
sections (interrupts.py), and Ctrl-C or a stop signal (SIGTERM, SIGHUP, SIGUSR1:
`stop_signals`) at any other moment saves `checkpoint-<k>` holding exactly k updates, plus
whether step k's evaluation was still to run; `resume_from` then continues to the same weights
and metrics as an uninterrupted run. Checkpoints are also saved every `checkpoint_minutes` (and
`checkpoint_every` steps), the latest `keep_checkpoints` kept, for the kills no process can catch.

Data-parallel runs (`torchrun --nproc-per-node N`, distributed.py) run this same code in every
process. A step's prompts are split between the processes, whole groups each; every prompt
samples with its own generator, seeded by (seed, step, prompt index), so the rollouts do not
depend on how many processes share the step. Each process scales its loss by the whole batch's
normalisers (rollouts, or answer tokens for dapo / cispo; `global_totals`) and the gradients
are summed over the processes (torch's DistributedDataParallel with a summing hook, during
the last micro-batch's backward; every process runs as many micro-batches as the busiest, a
process without rows zero-weighted ones): the update is the one-process update, up to float
summation order. Rewards, samples and evaluation answers
are gathered, so metrics.csv, samples.jsonl and summary.json match a one-process run; its
timing columns are rank 0's own clock. Rank 0 alone writes. Ctrl-C on any process is agreed on
at the next phase boundary and stops every process there, with a checkpoint.

With `fsdp` the weights, gradients and AdamW state are sharded over the processes instead
(fsdp.py): rollouts, scoring and evaluation run on an unsharded replica refreshed after every
update, the micro-batch counts are evened out, gradients are reduce-scattered as sums, and
checkpoints hold the shards (torch.distributed.checkpoint) beside the weights in HF layout.
"""

from __future__ import annotations

import contextlib
import copy
import math
import random
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields, replace

import torch
from tqdm import tqdm

from .branching import (
    BRANCH_CONTROLS,
    BRANCH_MAX_NEW_TOKENS,
    BranchConfig,
    branch_rows,
    sample_branches,
    with_branch_rows,
)
from .checkpoints import (
    load_weights_into,
)
from .compile_check import CHECK_ROWS, check_decoding, check_logprobs
from .distributed import (
    all_gather_objects,
    all_ranks,
    all_reduce_max,
    all_reduce_sum,
    barrier,
    data_parallel,
    gather_groups,
    rank,
    run_on_main,
    shard,
    shard_range,
    world_size,
)
from .evaluation import EVAL_FIGURES, evaluate_policy
from .fsdp import (
    dummy_backward,
    empty_replica,
    full_tensor,
    is_sharded,
    local_tensor,
    refresh_replica,
    shard_sizes,
    shard_with_replica,
)
from .generation import (
    compile_decoding,
    generate,
    left_pad,
    reserve_decoding,
    stop_token_ids,
    warm_up_decoding,
)
from .grpo import (
    KL_ESTIMATORS,
    LOSS_TYPES,
    REWARD_NORMALIZATIONS,
    SCALE_REWARDS,
    SEQUENCE_LOSS_TYPES,
    FixedShape,
    RolloutBatch,
    batch_logprobs,
    collect_rollouts,
    concat_rollout_batches,
    grpo_loss_on_batch,
    warm_up_compiled_blocks,
)
from .interrupts import (
    DEFAULT_STOP_SIGNALS,
    defer_interrupts,
    polling_stops,
    stop_signal_names,
)
from .process import CREDIT_CONTROLS, LOCAL_STEP_WEIGHT, VARIANTS, step_statistics
from .process_supervision import make_process_advantage_fn
from .prompts import render_prompt
from .rewards import build_reward
from .run_dir import RunDir, start_run, stop_if_interrupted
from .run_log import append_samples, truncate_samples
from .tokenizer import pad_id_of
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
from .weights import save_pretrained

# Process supervision: `process.step_statistics` figure -> metrics.csv column ("proc_": of the
# reasoning steps, not the optimizer step), pooled over every completion of the step; empty in
# outcome runs, and where a figure has nothing to average (no completion with an error step).
PROCESS_COLUMNS = {"steps_per_completion": "proc_steps_per_completion",
                   "step_reward_mean": "proc_step_reward_mean",
                   "step_correct_rate": "proc_step_correct_rate",
                   "first_error_step": "proc_first_error_step",
                   "error_free_rate": "proc_error_free_rate"}
METRIC_COLUMNS = [
    "step", "loss", "pg_loss", "kl", "reward_mean", "reward_std", "correct_mean", "format_mean",
    "adv_mean", "adv_std", "zero_adv_frac", "entropy", "ratio_mean", "ratio_max",
    "clip_frac_low", "clip_frac_high", "len_mean", "len_max", "truncated_frac", "grad_norm",
    "skipped", "gen_tokens", "scorer_tokens", "decode_tokens", "forward_tokens", "tokens_per_s",
    "rollout_s", "update_s", "step_time", "lr", "sampling_rounds", "tis_weight_mean",
    "off_policy_mask_frac",
    *PROCESS_COLUMNS.values(), "branch_rows", "branch_correct_rate",
    "eval_accuracy", "eval_format_rate", "eval_think_accuracy",
    "eval_step_correctness",
]
# Step-scorer cost keys (`scorer.cost()`) of tokens sampled and of tokens only read (prefills,
# probes, a reward model's reads and training forwards): the decode_tokens and forward_tokens
# columns count every arm in the same two units.
DECODE_COST_KEYS = ("mc_generated_tokens",)
FORWARD_COST_KEYS = ("forward_tokens",)
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

# A run stops (with a checkpoint of its last finite weights) after this many steps in a row whose
# loss or gradient was NaN/inf: the updates were skipped, and more of the same will not help.
MAX_BAD_STEPS = 3

SUPERVISIONS = ("outcome", "process")
STEP_SPLITS = ("tags", "newlines", "blank_lines")
SAMPLER_DTYPES = ("auto", "float32", "bfloat16")
AUTOCASTS = ("auto", "off", "bfloat16")


@dataclass
class GRPOConfig:
    """Every knob of a GRPO run; defaults are the chapter 7 recipe for the bundled tiny model.
    Each field carries its help, valid range and choices (`validation.option`): the command line
    (cli/train.py) and the checks are built from them.

    Searched on the arithmetic val split (200 problems, greedy strict accuracy 0.255 before
    training; the table is in docs/grpo.md): 16 prompts x 8 rollouts per step beat 8 x 16 and 8 x 8,
    lr 1e-4 matched 2e-4 with less drift, and training problems weighted towards levels 3-5
    (DEFAULT_TRAIN_LEVEL_WEIGHTS) raised accuracy among think answers and step correctness where
    uniform levels left them flat. 112 new tokens fit the longest (level 5) solutions. For
    Qwen3-0.6B on MATH use the flags in chapters/ch07_train.py's docstring (lr ~1e-6, longer
    completions, micro-batches).
    """

    # optimisation (AdamW, linear warmup then constant learning rate, grad-norm clipping)
    steps: int = option(150,
        "optimizer steps (each: rollouts for prompts-per-step prompts, then the update(s))",
        rule=at_least(1))
    lr: float = option(1e-4, "peak AdamW learning rate", rule=positive)
    warmup_steps: int = option(5,
        "steps of linear learning-rate warmup from lr/warmup to lr",
        rule=non_negative)
    weight_decay: float = option(0.0, "AdamW weight decay", rule=non_negative)
    max_grad_norm: float = option(1.0, "clip the gradient norm to this value", rule=positive)
    # rollouts
    prompts_per_step: int = option(16, "training prompts per optimizer step", rule=at_least(1))
    num_rollouts: int = option(8, "G: sampled completions per prompt (one group)", rule=at_least(2))
    max_new_tokens: int = option(112, "maximum generated tokens per rollout", rule=at_least(1))
    temperature: float = option(1.0, "rollout sampling temperature", rule=positive)
    top_p: float = option(1.0, "rollout nucleus-sampling threshold", rule=probability)
    # rewards: correctness + format_reward_weight x think format (only if correct when
    # format_reward_conditional)
    format_reward_weight: float = option(0.5,
        "weight of the <think>...</think> format reward (0: correctness only)",
        rule=non_negative)
    format_reward_conditional: bool = option(True, "pay the format reward only for correct answers")
    # advantages
    scale_rewards: str = option("group",
        "advantage scaling: group std (GRPO), batch std, or none (Dr. GRPO)",
        choices=SCALE_REWARDS)
    skip_zero_advantage: bool = option(True,
        "drop groups with no learning signal: rewards all equal (outcome supervision), or, "
        "with process supervision, token advantages all exactly zero (equal outcomes and no "
        "step credit)")
    reward_normalization: str = option("sum",
        "sum: normalise the weighted sum of the reward terms in each group (GRPO); per_reward: "
        "normalise each term in its group, then sum (GDPO)",
        choices=REWARD_NORMALIZATIONS)
    dynamic_sampling: bool = option(False,
        "DAPO dynamic sampling: draw more prompts until prompts-per-step groups have unequal "
        "rewards (at most max-sampling-rounds batches of prompts)")
    max_sampling_rounds: int = option(3,
        "dynamic sampling: most batches of prompts sampled in one step",
        rule=at_least(1))
    supervision: str = option("outcome",
        "outcome (one reward per completion) or process (a reward per reasoning step, "
        "DeepSeekMath-style token advantages)",
        choices=SUPERVISIONS)
    step_scorer: str = option("verifier",
        "process supervision step scorer: verifier | verifier-signed | verifier-think (steps "
        "count only in the think format) | verifier-think-local (the same, each step checked on "
        "its own inputs, for progress-local) | format (the think format alone, a placebo) | belief "
        "(the policy's probability of the gold answer after each step, GRPO-VPS) | mc | mc-hard "
        "| mc-branch (Monte-Carlo from the group and branched caches) | prm:PATH | "
        "online-prm:PATH | "
        "online-prm-outcome:PATH (a PRM re-fitted on the rollouts with verifier / outcome labels)")
    process_variant: str = option("sum",
        "process advantage: sum (DeepSeekMath) | process+outcome | min (PURE) | position | "
        "outcome-anchored: first-error | progress | progress-local (credit past the first "
        "error) | clip | delta (Gao et al.) | pure (PURE min "
        "form) | value-delta (VinePPO); see process.anchored_credit",
        choices=VARIANTS)
    step_split: str = option("tags",
        "how completions are split into steps: tags | newlines | blank_lines",
        choices=STEP_SPLITS)
    mc_rollouts: int = option(4,
        "Monte-Carlo continuations per step prefix (step-scorer mc)",
        rule=at_least(1))
    process_alpha: float = option(1.0,
        "weight of the step credit in the outcome-anchored process variants (first-error, "
        "progress, clip, delta, pure, value-delta; process.anchored_credit)",
        rule=non_negative)
    process_local_weight: float = option(LOCAL_STEP_WEIGHT,
        "progress-local: reward of a step that is right on its own inputs after the "
        "completion's first error (a correct step on a correct path earns 1)",
        rule=in_range(0, 1))
    process_credit_control: str = option("none",
        "placebo controls of the outcome-anchored forms' step credit: none | flat (each "
        "completion's total credit spread evenly over its tokens) | shuffled (the credits "
        "permuted among a completion's own steps); process.control_credit",
        choices=CREDIT_CONTROLS)
    branch_rollouts: int = option(0,
        "branches at the first error: one-step continuations sampled from each of a group's "
        "first-error states, graded by the verifier and trained on as extra rows (0: off; "
        "process supervision with a verifier step scorer; branching.py)",
        rule=non_negative)
    branch_states: int = option(2,
        "branches: first-error states branched from per group, the most shared first",
        rule=at_least(1))
    branch_max_new_tokens: int = option(BRANCH_MAX_NEW_TOKENS,
        "branches: token budget of one branch (its first step is kept; never past the "
        "rollouts' budget)",
        rule=at_least(1))
    branch_control: str = option("none",
        "branches' placebo: none | shuffled (each state's branch advantages permuted among its "
        "branches: the same rows and cost, which branch was right lost)",
        choices=BRANCH_CONTROLS)
    # loss
    loss_type: str = option("grpo",
        "grpo: per-sequence token mean; dapo: batch token mean; dr_grpo: sum/(B*max tokens); "
        "sequence: the book's summed log-prob ratio; gspo: clipped length-normalised sequence "
        "ratio (GSPO); cispo: clipped, stop-gradient importance weight times log-prob "
        "(MiniMax-M1)",
        choices=LOSS_TYPES)
    epsilon: float | None = option(0.2,
        "PPO clip range: ratio clipped to [1-epsilon, 1+epsilon_high] ('none': no clip)",
        rule=optional(in_range(0, 1, low_open=True)))
    epsilon_high: float | None = option(None,
        "upper clip range (DAPO clip-higher; 'none': same as epsilon)",
        rule=optional(positive))
    beta: float = option(0.0,
        "weight of the k3 KL penalty to the frozen starting model (0: no reference model)",
        rule=non_negative)
    kl_estimator: str = option("k3",
        "k3: per-token k3 estimate (always >= 0); sequence: the book's summed logp - ref_logp per"
        " answer (zero gradient on average; shown to fail)",
        choices=KL_ESTIMATORS)
    tis_cap: float | None = option(None,
        "truncated importance sampling: weight each token by min(pi_old / pi_sampler, C) with the"
        " sampler's own log-probs ('none': off)",
        rule=optional(positive))
    off_policy_mask_threshold: float | None = option(None,
        "DeepSeek-V3.2 off-policy sequence masking: drop negative-advantage answers whose mean "
        "per-token KL to the sampler exceeds this ('none': off)",
        rule=optional(non_negative))
    entropy_coef: float = option(0.0, "entropy bonus coefficient", rule=finite)
    mask_truncated: bool = option(False,
        "leave completions cut off at max-new-tokens out of the loss (DAPO)")
    inner_epochs: int = option(1,
        "updates per batch of rollouts (PPO-style; >1 makes the ratio leave 1)",
        rule=at_least(1))
    micro_batch_size: int | None = option(None,
        "rollouts per forward/backward pass ('none': the whole batch)",
        rule=optional(at_least(1)))
    chunk_size: int = option(1024,
        "answer positions per lm_head chunk in the log-prob pass (memory bound)",
        rule=at_least(1))
    activation_checkpointing: bool = option(False,
        "recompute each decoder block in the backward pass instead of keeping its activations "
        "(torch.utils.checkpoint): the update's activation memory drops to the blocks' inputs "
        "for one more forward pass of compute (docs/data_parallel.md)")
    compile: bool | None = option(None,
        "decode rollouts, evaluations and Monte-Carlo step values with one static, compiled "
        "step (torch.compile; the same tokens; each shape compiles once, seconds on a CPU). "
        "Default: on for CUDA, off elsewhere (no gain on the CPU, docs/speed.md)")
    compile_update: bool | None = option(None,
        "run the update's decoder blocks compiled (torch.compile), every micro-batch padded to "
        "one of a few shapes (at most micro-batch size x longest training prompt + "
        "max-new-tokens; update-buckets), the padding left out of the loss, so the training "
        "step compiles once per shape; the same loss and gradients up to float rounding. "
        "Default: as compile; never with fsdp")
    update_buckets: int = option(4,
        "length buckets of the compiled update: rows and completion columns each get this many "
        "evenly spaced sizes up to the micro-batch size and max-new-tokens, and every "
        "micro-batch is padded to the smallest that holds it (padding at most ~1/N of each; "
        "a graph per size pair met, at most N**2; 1: the one full shape)",
        rule=at_least(1))
    sampler_dtype: str = option("auto",
        "dtype of the weights that sample rollouts and evaluations: a copy of the policy in "
        "that dtype, refreshed after every update (also the fsdp replica's dtype). auto: "
        "bfloat16 on CUDA, the model's own elsewhere",
        choices=SAMPLER_DTYPES)
    autocast: str = option("auto",
        "the update's forward passes under torch.autocast in this dtype (weights, gradients "
        "and AdamW state stay in the model's dtype). auto: bfloat16 on CUDA without fsdp "
        "(whose own mixed precision computes in bfloat16), off elsewhere",
        choices=AUTOCASTS)
    # evaluation, logging, checkpoints
    eval_every: int = option(25,
        "evaluate on the held-out set every N steps (0: only before and after)",
        rule=non_negative)
    eval_examples: int = option(200, "number of held-out examples for evaluation", rule=at_least(1))
    eval_max_new_tokens: int | None = option(None,
        "max generated tokens in evaluation ('none': max-new-tokens)",
        rule=optional(at_least(1)))
    eval_batch_size: int = option(50, "prompts per batch in evaluation", rule=at_least(1))
    sample_every: int = option(10,
        "append the step's completions to samples.jsonl every N steps (0: never)",
        rule=non_negative)
    checkpoint_every: int = option(0,
        "save a resumable checkpoint every N steps (0: none by steps)",
        rule=non_negative)
    report_to: tuple[str, ...] = option((),
        "watch the run live: log metrics, evaluations, reward histograms and sampled completions "
        "to tensorboard (<run>/tensorboard) and/or wandb (<run>/wandb, offline without an "
        "account); several comma-separated (tensorboard,wandb); none: off",
        rule=report_problem)
    checkpoint_minutes: float = option(10.0,
        "save a resumable checkpoint once this many minutes of wall time passed since the last "
        "one (0: off): a kill that no handler can catch (SIGKILL, out of memory, power loss) "
        "loses at most this long",
        rule=non_negative)
    keep_checkpoints: int = option(2,
        "checkpoint-<step> directories kept, the latest (0: all); final/ is always kept",
        rule=non_negative)
    stop_signals: str = option(DEFAULT_STOP_SIGNALS,
        "signals that save a checkpoint and stop the run like Ctrl-C, exit status 75 "
        "(comma-separated; 'none': only Ctrl-C)",
        rule=stop_signal_names)
    fsdp: bool = option(False,
        "shard the weights, gradients and AdamW state over the torchrun processes (FSDP2, "
        "fsdp.py); rollouts and evaluation run on an unsharded replica; sharded checkpoints")
    export_hf_checkpoints: bool = option(False,
        "with --fsdp: also write the whole weights in Hugging Face layout into every "
        "checkpoint-<k> (rank 0 writes a full copy of the model, 4 bytes per parameter in fp32, "
        "while the other processes wait; minutes for billions of parameters). final/ always "
        "has them; resuming reads the shards alone. Without --fsdp a checkpoint's weights are "
        "in HF layout anyway")
    seed: int = option(123, "random seed (prompt order, rollout sampling)", rule=non_negative)
    output_dir: str = option("runs/grpo",
        "run directory for metrics, samples, checkpoints, summary and plot")
    progress: bool = option(True, "show the progress bar and per-step lines")

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


def step_prompts(examples, step, config):
    """The prompts of a step: a seeded reshuffle every epoch, so a step's prompts never depend on
    how the run got there (resume needs no data-loader state)."""
    n, k = len(examples), config.prompts_per_step
    first = step * k
    out = []
    for pos in range(first, first + k):
        epoch, idx = divmod(pos, n)
        g = torch.Generator().manual_seed(config.seed * 1_000_003 + epoch)
        out.append(examples[int(torch.randperm(n, generator=g)[idx])])
    return out


def rollout_seed(seed, step, index):
    """The sampling seed of prompt `index` of step `step`: distinct for every (step, index) below
    a million each, so no two prompts of a run share a random stream."""
    return ((seed * 1_000_003 + step) * 1_000_033 + index) % 2**63


def rollout_generators(device, seed, step, indices: Iterable[int]):
    """One sampling generator per prompt index of a step (dynamic sampling's round r numbers its
    prompts from r x prompts_per_step): a prompt's rollouts are the same however the run got
    there and whichever process samples it, alone or with any other prompts."""
    dev = torch.device(device)
    gen_device = dev if dev.type == "cuda" else torch.device("cpu")
    return [torch.Generator(device=gen_device).manual_seed(rollout_seed(seed, step, i))
            for i in indices]


def micro_batch_weight(mb, batch, loss_type, totals=None):
    """Scale of a micro-batch's loss so the accumulated gradient equals the full batch's.

    totals: (rollouts, answer tokens) of the whole step's batch when `batch` is one process's
    share of it (data-parallel runs, `global_totals`); default: `batch`'s own.
    """
    if totals is None:
        totals = (batch.size, float(batch.completion_mask.sum()))
    rows, tokens = totals
    if loss_type in ("dapo", "cispo"):  # token mean over the whole batch
        return float(mb.completion_mask.sum()) / max(1.0, tokens)
    return mb.size / max(1, rows)  # per-sequence means and dr_grpo's constant divisor


def global_totals(batch) -> tuple[int, float]:
    """(rollouts, answer tokens) entering the loss, summed over every process of the run: the
    normalisers that make N processes' update equal the one-process update."""
    rows, tokens = all_reduce_sum([batch.size, float(batch.completion_mask.sum())])
    return int(rows), tokens


def rollout_metrics(batch: RolloutBatch, reward_names):
    """Reward, advantage and length statistics of a step's rollouts (all groups); step
    statistics too under process supervision (`process_metrics`)."""
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
    return {**out, **process_metrics(batch.samples)}


def process_metrics(samples: list[dict]) -> dict:
    """The PROCESS_COLUMNS cells of a step: `step_statistics` of the step rewards of all its
    completions together ({} when none has any: outcome supervision). The samples are the whole
    step's, gathered from every process and sampling round, so a data-parallel run logs what one
    process would; ProcessAdvantageFn.last_stats, by contrast, averages per-group figures of one
    call on one process."""
    rewards = [s["step_rewards"] for s in samples if "step_rewards" in s]
    if not rewards:
        return {}
    stats = step_statistics(rewards)
    return {col: stats[k] for k, col in PROCESS_COLUMNS.items() if not math.isnan(stats[k])}


def plot_columns(config) -> list[str]:
    """The metrics.png panels of a run: PLOT_COLUMNS, plus PROCESS_PLOT_COLUMNS when process
    supervised."""
    return PLOT_COLUMNS + (PROCESS_PLOT_COLUMNS if config.supervision == "process" else [])


# ----------------------------------------------------------------------------------------------
# Precision and compiling of the sampler and the update
# ----------------------------------------------------------------------------------------------

def sampler_dtype(config, device) -> torch.dtype | None:
    """The dtype rollouts and evaluations sample in (`config.sampler_dtype`); None: the model's
    own. auto is bfloat16 on CUDA: decoding there reads the weights and the KV cache every
    token, half the bytes in bfloat16; on the CPU float32 keeps the tokens exact."""
    if config.sampler_dtype == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else None
    return getattr(torch, config.sampler_dtype)


def sampling_replica(model, device, dtype: torch.dtype | None):
    """A frozen copy of `model` in `dtype` to sample from (`fsdp.empty_replica`, filled by
    `fsdp.refresh_replica` and refreshed after every update), or None when `dtype` is the
    model's own (None included): the model then samples itself."""
    if dtype is None or dtype == next(model.parameters()).dtype:
        return None
    replica = empty_replica(model.cfg, device, dtype)
    refresh_replica(replica, model)
    return replica


def autocast_dtype(config, device) -> torch.dtype | None:
    """The dtype of the update's forward passes under torch.autocast (`config.autocast`), or
    None for none. auto is bfloat16 on CUDA without fsdp (FSDP's mixed-precision policy already
    computes in bfloat16 there) and off elsewhere: a CPU gains nothing from bfloat16 matmuls."""
    if config.autocast == "auto":
        on = torch.device(device).type == "cuda" and not config.fsdp
        return torch.bfloat16 if on else None
    return None if config.autocast == "off" else getattr(torch, config.autocast)


def update_autocast(config, device):
    """The context of the update's forward passes: torch.autocast at `autocast_dtype`, else none.
    The loss arithmetic stays float32 (the log-probs are taken from float32 logits)."""
    dtype = autocast_dtype(config, device)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=dtype)


def compiles_update(config, device) -> bool:
    """Whether the update runs its decoder blocks compiled: `compile_update`, by default as
    `compile` (`generation.compile_decoding`); never with fsdp."""
    if config.fsdp:
        return False
    if config.compile_update is None:
        return compile_decoding(config.compile, device)
    return bool(config.compile_update)


def prompt_lengths(tokenizer, examples, prompt_fn) -> list[int]:
    """Tokens of each example's rendered prompt."""
    return [len(tokenizer.encode(prompt_fn(ex["problem"]))) for ex in examples]


def update_shape(config, tokenizer, train_examples, prompt_fn) -> FixedShape:
    """The shapes the compiled update pads its micro-batches to: at most rows = the micro-batch
    size (at most this process's rollouts of a step and their branches) and columns = the
    longest training prompt + the token budget, in `update_buckets` row and completion-length
    buckets each (`grpo.FixedShape`), so every step of a run, whatever its prompts' and
    completions' lengths, uses one of at most update_buckets**2 shapes, each compiled when
    first met."""
    start, stop = shard_range(config.prompts_per_step)
    rows = (stop - start) * config.num_rollouts  # this process's rollouts of one step
    rows += (stop - start) * config.branch_states * config.branch_rollouts  # and its branches
    if config.micro_batch_size:
        rows = min(rows, config.micro_batch_size)
    rows = max(1, rows)  # 0: a process whose share has no prompt (it never pads)
    return FixedShape(rows, max(prompt_lengths(tokenizer, train_examples, prompt_fn)),
                      config.max_new_tokens, buckets=config.update_buckets)


# ----------------------------------------------------------------------------------------------
# The update
# ----------------------------------------------------------------------------------------------

def _update(model, optimizer, batch, old_logp, ref_logp, config, totals=None, fixed_shape=None):
    """One optimizer step on a batch (micro-batched); returns loss stats.

    The forward passes run under `update_autocast`; fixed_shape pads each micro-batch to its
    bucket for the compiled decoder blocks (`grpo.FixedShape`; None: eager, unpadded).

    Data-parallel runs: `batch` is this process's share and `totals` (`global_totals`) the whole
    step's counts; every micro-batch's loss is scaled by its share of the *whole* batch
    (`micro_batch_weight`) and the gradients are summed over the processes, which is exactly
    the one-process gradient, whatever each process's share and micro-batching: by FSDP, or for
    replicas by torch's DDP (`distributed.data_parallel`) during the last pass's backward (the
    earlier passes only accumulate). Every process then clips and steps identically.
    Skipped (weights and AdamW moments untouched) when the loss or the *clipped* gradient is
    not finite, on any process: the clipped gradient is what the optimizer would apply.
    """
    optimizer.zero_grad(set_to_none=True)
    rows, tokens = global_totals(batch) if totals is None else totals
    mbs = config.micro_batch_size or max(1, batch.size)
    per_sequence = config.loss_type in SEQUENCE_LOSS_TYPES  # their statistics count completions
    sums, finite_ = {"ratio_max": None}, True
    sharded = is_sharded(model)
    replicated = not sharded and world_size() > 1
    net = model if sharded else data_parallel(model)  # replicas: the DDP view
    starts = list(range(0, batch.size, mbs))
    # FSDP and DDP: every process runs as many forward/backward passes as the busiest one (their
    # collectives must pair up; DDP's only in the last one); the extra ones are zero-weighted
    parallel = sharded or replicated
    passes = int(all_reduce_max([len(starts)])[0]) if parallel else len(starts)
    for i in range(passes):
        if replicated:  # gradients summed over the processes in the last backward only
            net.sync_next_backward(i == passes - 1)
        if i >= len(starts):
            dummy_backward(net)
            continue
        start = starts[i]
        mb = batch.slice(start, start + mbs)
        w = micro_batch_weight(mb, batch, config.loss_type, (rows, tokens))
        # statistics are means over tokens (or completions): weight by this micro-batch's share
        w_stat = mb.size / rows if per_sequence else \
            float(mb.completion_mask.sum()) / max(1.0, tokens)
        sl = slice(start, start + mbs)
        with update_autocast(config, mb.input_ids.device):  # the backward runs outside it
            out = grpo_loss_on_batch(
                net, mb,
                old_logp=None if old_logp is None else old_logp[sl],
                ref_logp=None if ref_logp is None else ref_logp[sl],
                loss_type=config.loss_type, epsilon=config.epsilon,
                epsilon_high=config.epsilon_high, beta=config.beta,
                entropy_coef=config.entropy_coef, max_completion_length=config.max_new_tokens,
                chunk_size=config.chunk_size, temperature=config.temperature,
                sampler_logp=mb.sampler_logp, tis_cap=config.tis_cap,
                off_policy_mask_threshold=config.off_policy_mask_threshold,
                kl_estimator=config.kl_estimator, fixed_shape=fixed_shape,
            )
        loss = out.pop("loss")
        if not torch.isfinite(loss):
            finite_ = False
            if not parallel:
                break
            loss = loss * 0.0  # FSDP/DDP: the backward still runs everywhere; no update
        if loss.requires_grad:  # a micro-batch without loss tokens (all masked) has no graph
            (loss * w).backward()
        elif replicated:  # DDP's reduction needs every parameter's gradient
            dummy_backward(net)
        if not finite_:
            continue
        sums["loss"] = sums.get("loss", 0.0) + loss.item() * w
        for k in ("pg_loss", "kl"):
            sums[k] = sums.get(k, 0.0) + out[k] * w
        for k in ("entropy", "ratio_mean", "clip_frac_low", "clip_frac_high", "tis_weight_mean",
                  "off_policy_mask_frac"):
            if out.get(k) is not None:  # None: nothing counted in this micro-batch
                sums[k] = sums.get(k, 0.0) + out[k] * w_stat
        if w_stat and out.get("ratio_max") is not None and math.isfinite(out["ratio_max"]):
            sums["ratio_max"] = max(sums["ratio_max"] or out["ratio_max"], out["ratio_max"])
    finite_ = all_ranks(finite_)  # one process's NaN skips the update everywhere
    sums = _reduce_loss_stats(sums)
    grad_norm = float("nan")
    if finite_:
        # on DTensor shards the norm is the whole gradient's (FSDP: clipping the shards)
        grad_norm = float(full_tensor(torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                                     config.max_grad_norm)))
        finite_ = math.isfinite(grad_norm) and all_ranks(_grads_finite(model))
    if finite_:
        optimizer.step()
        if not all_ranks(_params_finite(model)):  # impossible with finite gradients and lr
            raise FloatingPointError("the optimizer step made weights non-finite; nothing was "
                                     "saved from this step (lower --lr or --max-grad-norm)")
    else:  # never let a NaN/inf reach the weights or the AdamW moments
        optimizer.zero_grad(set_to_none=True)
        sums.setdefault("loss", float("nan"))
    return {**sums, "grad_norm": grad_norm, "skipped": int(not finite_)}


# Loss statistics of `_update` that are sums of shares of the whole batch (see `w`, `w_stat`).
_SUMMED_STATS = ("loss", "pg_loss", "kl", "entropy", "ratio_mean", "clip_frac_low",
                 "clip_frac_high", "tis_weight_mean", "off_policy_mask_frac")


def _reduce_loss_stats(sums):
    """`_update`'s statistics of the whole batch: each process's weighted sums added up (a
    statistic no process measured stays absent), ratio_max the maximum over processes."""
    flat = [x for k in _SUMMED_STATS for x in (sums.get(k, 0.0), float(k in sums))]
    total = all_reduce_sum(flat)  # (value, present) pairs
    out = {k: total[2 * i] for i, k in enumerate(_SUMMED_STATS) if total[2 * i + 1]}
    top = all_reduce_max([-math.inf if sums["ratio_max"] is None else sums["ratio_max"]])[0]
    out["ratio_max"] = None if top == -math.inf else top
    return out


def _grads_finite(model) -> bool:
    """Every gradient finite (after clipping: a NaN max norm would make them NaN)."""
    return all(bool(torch.isfinite(local_tensor(p.grad)).all()) for p in model.parameters()
               if p.grad is not None)


def _params_finite(model) -> bool:
    """Every parameter finite."""
    return all(bool(torch.isfinite(local_tensor(p)).all()) for p in model.parameters())


# ----------------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------------

class _Run(RunDir):
    """A GRPO run's directory (run_dir.py) with its step rows, samples.jsonl and the count of
    consecutive non-finite steps."""

    def __init__(self, out, model, tokenizer, optimizer, config, columns, replica=None):
        super().__init__(out, model, tokenizer, optimizer, config, columns,
                         plot_columns(config), replica=replica)
        self.bad_steps = 0  # consecutive steps with a non-finite loss or gradient

    def _open_logs(self, resumed):
        """`open_logs` on rank 0, samples.jsonl cut back to a resumed step as well."""
        super()._open_logs(resumed)
        truncate_samples(self.out / "samples.jsonl", self.completed)

    def log_step(self, row, samples):
        """Rank 0: a step's metrics row, and its completions every `sample_every` steps."""
        if not self.main:
            return
        self.log.append(row)
        every = self.config.sample_every
        sampled = bool(every and row["step"] % every == 0)
        if sampled:
            append_samples(self.out / "samples.jsonl", row["step"], samples)
        self.tracker.log_row(row)
        self.tracker.log_rollouts(row["step"], samples, with_text=sampled)


def train_grpo(model, tokenizer, train_examples, eval_examples, device, config: GRPOConfig,
               resume_from=None, reward_fn=None, advantage_fn: Callable | None = None,
               prompt_fn=render_prompt, overwrite=False, base_evaluation: dict | None = None,
               phase_hook: Callable[[str, int], None] | None = None) -> dict:
    """Train `model` with GRPO on `train_examples`; returns the summary dict (also summary.json).

    reward_fn(text, token_ids, prompt_len, example) -> (total, components); default
    `build_reward(tokenizer, format_reward_weight, format_reward_conditional)`.
    advantage_fn: token-level advantages for config.supervision == "process" (see
    `grpo.collect_rollouts`). resume_from: a checkpoint dir or a run dir (its latest intact
    checkpoint) to continue exactly where it stopped. A new run refuses an output_dir that holds
    a run unless `overwrite`. Ctrl-C (KeyboardInterrupt) and the stop signals (StopSignal, a
    KeyboardInterrupt) save a checkpoint before re-raising. base_evaluation: the
    starting model's `evaluate_policy` figures on `eval_examples`, if already known (experiments
    that train one base model many times evaluate it once).
    phase_hook(phase, step): called as each phase starts ("base_eval", "rollouts", "update",
    "eval", "checkpoint", "final_eval", "final_save"; step = the update being made or just
    made); for progress displays and for tests that interrupt a run at a chosen moment.

    Data-parallel (distributed.py): every process of a torchrun group calls this with the same
    arguments and its own device, after `distributed.init_distributed`. Each samples its share
    of every step's prompts (whole groups) and the update is the one-process update on the whole
    batch, so N processes give the run one process gives (up to float summation order). Rank 0
    alone writes files and prints; resume_from must be readable by every process. Ctrl-C on any
    process stops them all at the next phase boundary (after the rollouts, the update, an
    evaluation), where they agree on it, with a checkpoint of the completed updates.
    """
    world = world_size()
    if world > config.prompts_per_step:
        raise ValueError(f"{world} processes need at least as many prompts per step, got "
                         f"prompts_per_step={config.prompts_per_step}")
    config, out, hook = start_run(config, resume_from, overwrite, phase_hook)
    replica = sampler = None
    if config.fsdp:  # shard before the optimizer exists: AdamW then holds shards only
        model, replica = shard_with_replica(model, device, sampler_dtype(config, device))
    else:  # a copy in the sampling dtype (bfloat16 on CUDA), or None: the model samples
        sampler = sampling_replica(model, device, sampler_dtype(config, device))
    trained = model if replica is None else replica  # the policy's weights, whole
    policy = trained if sampler is None else sampler  # what samples and evaluates
    model.activation_checkpointing = config.activation_checkpointing  # the update's passes only
    eval_set = list(eval_examples)[:config.eval_examples]
    config, compile_report = _check_compiled_paths(policy, trained, tokenizer, train_examples,
                                                   eval_set, device, config, prompt_fn)
    if config.supervision == "process" and advantage_fn is None:
        advantage_fn = _process_advantage_fn(policy, tokenizer, device, config)
    t_start = time.time()
    if reward_fn is None:
        reward_fn = build_reward(tokenizer, config.format_reward_weight,
                                 config.format_reward_conditional)
    reward_names = getattr(reward_fn, "names", ["correct", "format"])
    columns = METRIC_COLUMNS + [f"{n}_mean" for n in reward_names
                                if f"{n}_mean" not in METRIC_COLUMNS]

    torch.manual_seed(config.seed)
    random.seed(config.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr,
                                  weight_decay=config.weight_decay)
    run = _Run(out, model, tokenizer, optimizer, config, columns, replica)
    if run.restore(resume_from, base_evaluation) is not None:
        run.saved = (None, run.completed, run.eval_pending)
        if sampler is not None:
            refresh_replica(sampler, model)
    run.open_logs(resumed=resume_from is not None)
    ref_model = _reference_model(trained, tokenizer, out, config,
                                 resumed=resume_from is not None)
    fixed_shape = update_shape(config, tokenizer, train_examples, prompt_fn) \
        if compiles_update(config, device) else None

    def evaluate_now():  # a phase whose decoding polls for an agreed stop (`stops`, below)
        with polling_stops(stops):
            return evaluate_policy(policy, tokenizer, eval_set, device, config.eval_tokens,
                                   config.eval_batch_size, prompt_fn,
                                   compile=compile_decoding(config.compile, device))

    bar = tqdm(total=config.steps, initial=run.completed, desc="grpo",
               disable=not config.progress)
    # Several processes stop only where all of them check: between phases
    # (`stop_if_interrupted`) and, inside the rollout and evaluation phases, every
    # STOP_CHECK_EVERY tokens of decoding (`stops`); a stop checkpoints (`RunDir.stoppable`).
    with run.stoppable() as (interrupted, stops), contextlib.closing(bar):
        if run.base is None:
            hook("base_eval", 0)
            run.base = run.last_eval = evaluate_now()
            run.log_eval(run.base)
            _print(config, f"base model: held-out {_eval_line(run.base)} "
                           f"({len(eval_set)} examples)")
        if run.eval_pending and run.completed < config.steps:  # interrupted mid-evaluation
            stop_if_interrupted(interrupted)
            _evaluate_step(run, evaluate_now, hook)
        if compile_decoding(config.compile, device) and run.completed < config.steps:
            with polling_stops(stops):
                _warm_up_decoding(policy, tokenizer, train_examples, eval_set, config,
                                  prompt_fn)
        if fixed_shape is not None and fixed_shape.compile and run.completed < config.steps:
            _warm_up_update(model, ref_model, config, fixed_shape, device)
        while run.completed < config.steps:
            step = run.completed
            # Stages 1-3: rollouts, rewards, advantages (grpo.collect_rollouts)
            stop_if_interrupted(interrupted)
            hook("rollouts", step + 1)
            with polling_stops(stops):  # a stop in here abandons the step's rollouts
                batch, cost = _rollouts(policy, tokenizer, train_examples, device, config,
                                        reward_fn, advantage_fn, prompt_fn, step)
            stop_if_interrupted(interrupted)
            with defer_interrupts():  # the update, its row and its samples: all or nothing
                # Stages 4-5: log-probs and the update (grpo.grpo_loss_on_batch)
                row = _apply_update(model, optimizer, batch, config, ref_model,
                                    reward_names, step, cost, hook,
                                    replica if sampler is None else sampler, fixed_shape)
                # Stage 6: log
                _log_step(run, row, batch.samples)
            _show_step(bar, run, row)
            if run.bad_steps >= MAX_BAD_STEPS:
                _stop_after_bad_steps(run)
            if run.eval_pending:
                stop_if_interrupted(interrupted)
                _evaluate_step(run, evaluate_now, hook)
            if run.checkpoint_due():
                with defer_interrupts():
                    hook("checkpoint", run.completed)
                    run.checkpoint()
        bar.close()
        final, summary = run.finish(evaluate_now, interrupted, hook, lambda final: {
            **_summary(run, final, len(eval_set), time.time() - t_start),
            **({"compile_check": compile_report} if compile_report else {})})
    _print(config, f"held-out before: {_eval_line(run.base)}\nheld-out after:  "
                   f"{_eval_line(final)}\nwrote {out}")
    return summary


def _check_compiled_paths(policy, trained, tokenizer, train_examples, eval_set, device, config,
                          prompt_fn):
    """The first-use check (compile_check.py) of a run that compiles its decoding or its update
    -> (config, report). Decoding: the evaluation's first batch (the shape it compiles anyway),
    greedy, compiled against eager, `trained` (the float32 weights behind a bfloat16 sampler)
    setting the rounding tolerance. The update: the first CHECK_ROWS of those rows whose prompt
    and completion fit the update's padded shapes. On a mismatch on any process: one warning
    with the figures, and the run goes on eagerly (the returned config has compile and
    compile_update off; it is the one config.json and the checkpoints record); the report goes
    to summary.json either way. None: nothing compiled, no check."""
    decode, update = compile_decoding(config.compile, device), compiles_update(config, device)
    if not (decode or update) or not eval_set:
        return config, None
    t0 = time.time()
    was_training = policy.training
    policy.eval()
    stops = stop_token_ids(tokenizer)
    mine = shard(eval_set) or eval_set[:1]
    prompts = sorted((prompt_fn(ex["problem"]) for ex in mine),
                     key=lambda p: -len(tokenizer.encode(p)))[:config.eval_batch_size]
    encoded = [tokenizer.encode(p) for p in prompts]
    ids, mask = left_pad(encoded, pad_id_of(tokenizer))
    ids, mask = ids.to(device), mask.to(device)
    report = {}
    if decode:
        found = check_decoding(policy, ids, mask, config.eval_tokens, stops,
                               reference=None if trained is policy else trained)
        out = found.pop("output")
        report["decoding"] = found
    else:
        out = generate(policy, ids, mask, config.eval_tokens, eos_token_id=stops)
    policy.train(was_training)
    if update:
        report["update"] = _check_update(trained, tokenizer, train_examples, ids, mask, out,
                                         config, device, prompt_fn)
    ok = all_ranks(all(part.get("ok", True) for part in report.values()))
    report.update(ok=ok, seconds=round(time.time() - t0, 3), fell_back_to_eager=not ok)
    _print(config, f"compile check ({report['seconds']:.1f} s): {_check_line(report)}")
    if not ok:
        warnings.warn(f"the compiled paths disagree with the eager code ({_check_line(report)});"
                      " this run goes on eagerly (compile and compile_update off). Run with "
                      "--no-compile --no-compile-update to skip compiling, and please report "
                      "the figures with your torch version and GPU", RuntimeWarning,
                      stacklevel=3)
        config = replace(config, compile=False, compile_update=False)
    return config, report


def _check_update(model, tokenizer, train_examples, ids, mask, out, config, device, prompt_fn):
    """`compile_check.check_logprobs` of up to CHECK_ROWS decoded rows within the run's padded
    update shapes (prompt columns cut to the longest of them; completions cut to the widest
    bucket), or a report saying why none fit."""
    shape = update_shape(config, tokenizer, train_examples, prompt_fn)
    rows = min(CHECK_ROWS, shape.rows, ids.shape[0])
    lead = int((~mask[:rows]).all(dim=0).cumprod(0).sum())  # columns of padding only
    P = ids.shape[1] - lead
    if P > shape.prompt_cols or not rows:
        return {"ok": True, "skipped": f"the evaluation prompts ({P} tokens) are longer than "
                                       f"the update's ({shape.prompt_cols})"}
    cols = min(out.completion_ids.shape[1], shape.completion_cols)
    seq = torch.cat([ids[:rows, lead:], out.completion_ids[:rows, :cols]], dim=1)
    full = torch.cat([mask[:rows, lead:], out.completion_mask[:rows, :cols]], dim=1)
    return check_logprobs(model, seq, full.long(), P, out.completion_mask[:rows, :cols], shape,
                          lambda: update_autocast(config, device), config.chunk_size,
                          config.temperature)


def _check_line(report) -> str:
    """One line of the compile check's figures."""
    parts = []
    if "decoding" in report:
        d = report["decoding"]
        parts.append(f"decoding {d['rows']} rows, {d['tokens']} tokens, "
                     f"{'equal to' if d['tokens_equal'] else 'apart from'} eager, max logit gap "
                     f"{d['max_logit_gap']:.3g} (tolerance {d['logit_tolerance']:.3g})")
    if "update" in report:
        u = report["update"]
        parts.append(u["skipped"] if "skipped" in u else
                     f"update log-probs of {u['rows']} rows within {u['max_logprob_diff']:.3g} "
                     f"(tolerance {u['logprob_tolerance']:.3g})")
    return "; ".join(parts)


def _warm_up_decoding(model, tokenizer, train_examples, eval_set, config, prompt_fn):
    """Compile the decode step, before the first step, for every shape the run's rollouts and
    evaluations decode: this process's prompts-per-step x G rows at every prompt-length bucket
    of the training prompts, and the evaluation's batches (in `evaluation.evaluate`'s order,
    longest prompts first). No later step then compiles (the Monte-Carlo scorers' shapes aside).
    """
    was_training = model.training
    model.eval()
    stops = stop_token_ids(tokenizer)
    start, stop = shard_range(config.prompts_per_step)
    lengths = set(prompt_lengths(tokenizer, train_examples, prompt_fn))
    rollouts = [((stop - start) * config.num_rollouts, n) for n in lengths]
    mine = shard(eval_set)
    lengths = sorted(prompt_lengths(tokenizer, mine, prompt_fn), reverse=True)
    batches = [lengths[i:i + config.eval_batch_size]
               for i in range(0, len(lengths), config.eval_batch_size)]
    evaluations = [(len(b), b[0]) for b in batches]
    # each row bucket's KV memory at once at its largest: no later call moves a shape's buffers
    reserve_decoding(model, [(r, n, config.max_new_tokens) for r, n in rollouts]
                     + [(r, n, config.eval_tokens) for r, n in evaluations])
    warm_up_decoding(model, rollouts, config.max_new_tokens, config.temperature, config.top_p,
                     eos_token_id=stops, return_logprobs=config.tis_cap is not None
                     or config.off_policy_mask_threshold is not None)
    warm_up_decoding(model, evaluations, config.eval_tokens, eos_token_id=stops)
    model.train(was_training)


def _warm_up_update(model, ref_model, config, fixed_shape, device):
    """Compile the update's decoder blocks (`compile_update`) before the first step, at every
    padded shape a step can meet (`grpo.warm_up_compiled_blocks`), in each setting the steps
    use them: the reference's log-probs and (inner epochs > 1) the old policy's without
    gradients in eval mode, the update's with gradients in train mode, all under the update's
    autocast. No step then compiles. Printed with its time."""
    t0 = time.time()
    with update_autocast(config, device):
        if ref_model is not None:
            warm_up_compiled_blocks(ref_model, fixed_shape, False, config.chunk_size,
                                    config.temperature)
        model.eval()
        if config.inner_epochs > 1:
            warm_up_compiled_blocks(model, fixed_shape, False, config.chunk_size,
                                    config.temperature)
        model.train()
        shapes = warm_up_compiled_blocks(model, fixed_shape, True, config.chunk_size,
                                         config.temperature)
        model.eval()
    _print(config, f"compiled the update for {shapes} padded shapes in {time.time() - t0:.1f} s")


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


def _log_step(run, row, samples):
    """Write the step's metrics row and samples and advance the run's counters."""
    config = run.config
    run.log_step(row, samples)
    run.completed = row["step"]
    run.eval_pending = bool(config.eval_every and run.completed % config.eval_every == 0
                            and run.completed < config.steps)
    run.bad_steps = run.bad_steps + 1 if row["skipped"] else 0


def _show_step(bar, run, row):
    """Progress bar and the printed line of a finished step (rank 0 with progress on)."""
    bar.update(1)
    bar.set_postfix(reward=f"{row['reward_mean']:.2f}", correct=f"{row.get('correct_mean', 0):.2f}",
                    acc=f"{run.last_eval['accuracy']:.2f}")
    _print(run.config, _row_line(row))


def _evaluate_step(run, evaluate_now, hook):
    """The evaluation due after step `run.completed` (`RunDir.evaluate_step`), printed."""
    figures = run.evaluate_step(evaluate_now, hook)
    _print(run.config, f"step {run.completed}: EVAL {_eval_line(figures)}")


def _stop_after_bad_steps(run):
    """Save the (finite) weights and stop: several updates in a row were NaN/inf and skipped."""
    with defer_interrupts():
        path = run.checkpoint()
    barrier()  # every process raises: none before rank 0 has saved
    raise FloatingPointError(
        f"{run.bad_steps} steps in a row had a non-finite loss or gradient and were skipped; "
        f"stopping. {path} holds the last finite weights; lower --lr or --max-grad-norm, or "
        f"check the rewards, before resuming")


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


def _rollouts(model, tokenizer, examples, device, config, reward_fn, advantage_fn, prompt_fn,
              step):
    """Sample, score and pack step `step`'s rollouts; returns (batch, cost) where cost has the
    start time, the rollout seconds, the process scorer's generated tokens and the sampling
    rounds (DAPO dynamic sampling draws more prompts until `prompts_per_step` groups carry a
    learning signal, at most `max_sampling_rounds` batches of prompts; DAPO section 3.2).

    Each prompt samples with its own generator (`rollout_generators`). In a data-parallel run
    every process takes a contiguous share of each batch of prompts (whole groups), so the
    rollouts, and dynamic sampling's decisions, are those of one process: `batch` holds this
    process's rows, its statistics fields (rewards, samples, zero_adv_frac,
    num_generated_tokens) the whole step's, in prompt order, round after round.
    """
    t0 = time.time()
    scorer_before = _scorer_tokens(advantage_fn)
    forward_before = _scorer_tokens(advantage_fn, FORWARD_COST_KEYS)
    P, G = config.prompts_per_step, config.num_rollouts
    start, stop = shard_range(P)  # this process's prompts of each batch
    rounds = config.max_sampling_rounds if config.dynamic_sampling else 1
    batches, shares = [], []  # per round: this process's batch, every process's summary
    for r in range(rounds):
        prompts = step_prompts(examples, step, config) if r == 0 else \
            extra_prompts(examples, step, r, config)
        batch = collect_rollouts(
            model, tokenizer, prompts[start:stop], device, reward_fn, num_rollouts=G,
            max_new_tokens=config.max_new_tokens, temperature=config.temperature,
            top_p=config.top_p,
            generator=rollout_generators(device, config.seed, step,
                                         range(r * P + start, r * P + stop)),
            scale_rewards=config.scale_rewards,
            skip_zero_advantage=config.skip_zero_advantage or config.dynamic_sampling,
            mask_truncated=config.mask_truncated, prompt_fn=prompt_fn, advantage_fn=advantage_fn,
            record_logprobs=config.tis_cap is not None
            or config.off_policy_mask_threshold is not None,
            reward_normalization=config.reward_normalization, gather_groups=gather_groups,
            compile=compile_decoding(config.compile, device),
        )
        batches.append(batch)
        shares.append(all_gather_objects(_share_summary(batch, G)))
        if sum(share["kept"] for rnd in shares for share in rnd) >= P:
            break
    kept = [[share["kept"] for share in rnd] for rnd in shares]
    batch = _first_groups(batches, kept, P, G, pad_id_of(tokenizer))
    counts = [0.0] * 5
    if config.branch_rollouts:  # rows below the rollouts': the step's branches at first errors
        batch, counts = _branches(model, tokenizer, batch, advantage_fn, config, device,
                                  prompts[start:stop])
    scorer_tokens, scorer_forward, drawn, right, rows = all_reduce_sum([
        _scorer_tokens(advantage_fn) - scorer_before + counts[0],
        _scorer_tokens(advantage_fn, FORWARD_COST_KEYS) - forward_before + counts[1],
        *counts[2:]])
    branch = {"branch_rows": int(rows), "branch_correct_rate": right / drawn if drawn else None} \
        if config.branch_rollouts else {}
    return _with_step_statistics(batch, shares), {
        "t0": t0, "rollout_s": time.time() - t0, "sampling_rounds": len(batches),
        "scorer_tokens": int(scorer_tokens), "scorer_forward_tokens": int(scorer_forward),
        "branch": branch}


def _branches(model, tokenizer, batch, advantage_fn, config, device, prompts):
    """`batch` with the step's branches at the first error as rows below its own
    (`branching`), and their counts: tokens sampled, tokens prefilled, branches drawn, branches
    right, rows kept (a row per branch with an advantage). The branches start from the groups
    the process hook just scored (`ProcessAdvantageFn.last_groups`, this step's `prompts`)."""
    groups = getattr(advantage_fn, "last_groups", None)
    if groups is None or [g[0] for g in groups] != list(prompts):
        raise ValueError("branch_rollouts needs the process advantage hook of this step's "
                         "groups (process_supervision.ProcessAdvantageFn)")
    pad = pad_id_of(tokenizer)
    branches, cost = sample_branches(model, tokenizer, groups, advantage_fn.last_infos,
                                     BranchConfig(
        k=config.branch_rollouts, max_states=config.branch_states,
        max_new_tokens=config.branch_max_new_tokens, rollout_tokens=config.max_new_tokens,
        temperature=config.temperature, top_p=config.top_p, alpha=config.process_alpha,
        control=config.branch_control, split_mode=config.step_split, seed=config.seed,
        compile=compile_decoding(config.compile, device)))
    rows = branch_rows(branches, groups, pad, batch.input_ids.device)
    counts = [cost["branch_generated_tokens"], cost["branch_prefill_tokens"], len(branches),
              sum(b.correct for b in branches), 0 if rows is None else rows.size]
    return with_branch_rows(batch, rows, pad), [float(c) for c in counts]


def _share_summary(batch, G):
    """What the other processes need of this process's batch of one sampling round."""
    groups = batch.rewards.shape[0]
    return {"kept": batch.size // G, "groups": groups, "rewards": batch.rewards.cpu(),
            "zero_groups": round(batch.zero_adv_frac * groups), "samples": batch.samples,
            "tokens": batch.num_generated_tokens}


def _first_groups(batches, kept, limit, G, pad_id):
    """This process's rows among the step's first `limit` kept groups, counted round by round
    and, within a round, process by process (prompt order): dynamic sampling's batch size
    stays fixed, later groups are left out. kept[r][k]: groups process k kept in round r."""
    if len(batches) == 1:  # one round never holds more than `limit` groups
        return batches[0]
    me, before, keep = rank(), 0, []
    for rnd, b in zip(kept, batches):
        mine = min(rnd[me], max(0, limit - before - sum(rnd[:me])))  # groups still in budget
        keep += [True] * (mine * G) + [False] * (b.size - mine * G)
        before += sum(rnd)
    batch = concat_rollout_batches(batches, pad_id)
    if all(keep):
        return batch
    return batch.rows(torch.tensor(keep, dtype=torch.bool, device=batch.input_ids.device))


def _with_step_statistics(batch, shares):
    """`batch` with the statistics fields of every process's share of every round."""
    parts = [share for rnd in shares for share in rnd]  # round-major, then process order
    groups = sum(p["groups"] for p in parts)
    return replace(
        batch, rewards=torch.cat([p["rewards"] for p in parts]),  # (N_all, G)
        samples=[s for p in parts for s in p["samples"]],
        zero_adv_frac=sum(p["zero_groups"] for p in parts) / max(1, groups),
        num_generated_tokens=sum(p["tokens"] for p in parts))


def extra_prompts(examples, step, round_, config):
    """Dynamic sampling's further prompts of a step: `prompts_per_step` drawn without
    replacement, seeded by (seed, step, round) so a resumed run draws the same ones."""
    g = torch.Generator().manual_seed(config.seed * 1_000_003 + 104_729 * step + round_)
    idx = torch.randperm(len(examples), generator=g)[:config.prompts_per_step]
    return [examples[int(i)] for i in idx]


def _apply_update(model, optimizer, batch, config, ref_model, reward_names, step, cost, hook,
                  replica=None, fixed_shape=None):
    """`inner_epochs` updates on a step's batch; returns the step's metrics row. `replica`, the
    copy that sampled (FSDP's unsharded one, or `sampling_replica`'s), is refreshed after the
    update; FSDP runs also take the no-grad log-probs from it (a sharded forward pass is a
    collective), the others from the model being trained (pi_old is the trainer's policy; a
    bfloat16 sampler's own log-probs are what `tis_cap` compares with). fixed_shape: the
    compiled update's padding (`update_shape`)."""
    hook("update", step + 1)
    t1 = time.time()
    lr = lr_at_step(step, config)
    for group in optimizer.param_groups:
        group["lr"] = lr
    row = {"step": step + 1, "lr": lr, **rollout_metrics(batch, reward_names)}
    totals = global_totals(batch)  # a process may hold no rows while others do
    if totals[0]:
        # Stage 4: log-probs of the frozen reference and (inner epochs) of the sampling policy
        model.eval()  # as the compiled update's warm-up ran them (`_warm_up_update`)
        with torch.no_grad():
            ref_logp = old_logp = None
            if ref_model is not None:
                ref_logp = _logprobs_no_grad(ref_model, batch, config, fixed_shape)
            if config.inner_epochs > 1:  # the sampling policy's log-probs, computed once
                old_logp = _logprobs_no_grad(replica if is_sharded(model) else model, batch,
                                             config, fixed_shape)
        # Stage 5: the update(s): loss, backward, clip, AdamW step
        model.train()
        epochs = [_update(model, optimizer, batch, old_logp, ref_logp, config, totals,
                          fixed_shape)
                  for _ in range(config.inner_epochs)]
        model.eval()
        if replica is not None:
            refresh_replica(replica, model)  # the next rollouts sample from the new weights
        for k in epochs[0]:
            vals = [e[k] for e in epochs if e.get(k) is not None]
            if not vals:
                row[k] = None
            elif k in ("ratio_max", "skipped"):
                row[k] = max(vals)
            else:
                row[k] = sum(vals) / len(vals)
        if row["skipped"]:
            _print(config, f"step {step + 1}: non-finite loss or gradient, update skipped")
    else:  # every group (of every process) had equal rewards: nothing to learn from
        row.update(loss=0.0, pg_loss=0.0, kl=0.0, skipped=0)
    t2 = time.time()  # this process's own clock: rank 0's times are the ones logged
    row.update(rollout_s=cost["rollout_s"], update_s=t2 - t1, step_time=t2 - cost["t0"],
               sampling_rounds=cost["sampling_rounds"],
               tokens_per_s=batch.num_generated_tokens / max(t2 - cost["t0"], 1e-9),
               gen_tokens=batch.num_generated_tokens, scorer_tokens=cost["scorer_tokens"],
               decode_tokens=batch.num_generated_tokens + cost["scorer_tokens"],
               forward_tokens=_forward_tokens(batch, config, ref_model is not None)
               + cost["scorer_forward_tokens"], **cost.get("branch", {}))
    return row


def _forward_tokens(batch, config, with_reference: bool) -> int:
    """Tokens the policy (and its reference) read in one step without sampling them, summed over
    processes: each rollout's prompt once (`prompt_tokens` of its sample; sampling prefills a
    group's prompt once and repeats its cache, so this counts (G - 1) prompts per group more
    than were computed, the same for every arm), then each row that enters the update (its
    positions less the prompt's left padding; the completions' right padding is counted, as
    the forward pass computes it) once per inner epoch with gradients, once more without for
    the old policy's log-probs (inner epochs > 1) and once for the reference's. A backward
    pass is not counted (it costs about two forwards of the same tokens, for every arm
    alike)."""
    prefill = sum(s.get("prompt_tokens", 0) for s in batch.samples)  # the whole step's
    if batch.attention_mask is None:
        rows = batch.input_ids.numel()
    else:
        rows = int(batch.attention_mask.sum())
    passes = config.inner_epochs + (config.inner_epochs > 1) + with_reference
    return int(prefill + all_reduce_sum([float(rows * passes)])[0])


def _scorer_tokens(advantage_fn, keys=DECODE_COST_KEYS):
    """Tokens spent so far by a process step scorer, summed over the cost keys `keys`: by default
    the tokens it sampled (Monte-Carlo continuations), with `FORWARD_COST_KEYS` the tokens it
    read without sampling (prefilled prefixes, a reward model's or a probe's forward passes);
    0 if free."""
    scorer = getattr(advantage_fn, "step_scorer", None)
    cost = scorer.cost() if scorer is not None and hasattr(scorer, "cost") else {}
    return int(sum(cost.get(k, 0) for k in keys))


def _logprobs_no_grad(model, batch, config, fixed_shape=None):
    """Per-token log-probs (B, Tc) of a whole batch, micro-batched, without gradients (the
    caller's no_grad), under the update's autocast and padding (`fixed_shape`)."""
    if not batch.size:  # this process's share kept no group (data-parallel runs)
        return torch.zeros(batch.completion_mask.shape, device=batch.input_ids.device)
    mbs = config.micro_batch_size or batch.size
    # at the sampling temperature: the distribution the rollouts were drawn from (as TRL does)
    with update_autocast(config, batch.input_ids.device):
        parts = [batch_logprobs(model, batch.slice(s, s + mbs), config.chunk_size, False,
                                config.temperature, fixed_shape)[0]
                 for s in range(0, batch.size, mbs)]
    return torch.cat(parts)


def _row_line(row):
    """One printed line per step."""
    keys = [("reward_mean", "reward"), ("correct_mean", "correct"), ("format_mean", "format"),
            ("loss", "loss"), ("kl", "kl"), ("entropy", "entropy"), ("len_mean", "len"),
            ("zero_adv_frac", "zero_adv"), ("proc_step_correct_rate", "steps_ok"),
            ("step_time", "s")]
    parts = [f"step {row['step']}"] + [f"{name} {row[k]:.3f}" for k, name in keys
                                       if isinstance(row.get(k), float)]
    return " | ".join(parts)


def _eval_line(figures):
    """One line of evaluation figures (accuracy, format, think accuracy, step correctness)."""
    def f(v):
        return "n/a" if v is None else f"{v:.3f}"
    return (f"accuracy {f(figures.get('accuracy'))}, format rate "
            f"{f(figures.get('format_rate'))}, accuracy in think format "
            f"{f(figures.get('think_accuracy'))}, step correctness "
            f"{f(figures.get('step_correctness'))}")


def _print(config, msg):
    if config.progress:
        tqdm.write(msg)
