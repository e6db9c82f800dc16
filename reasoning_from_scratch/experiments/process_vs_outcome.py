"""The chapter 8 experiment: outcome vs process supervision in GRPO, at equal steps and tokens.

Trains the same base model with the same GRPO settings (GRPOConfig, the chapter 7 defaults unless
flags change them) for the same number of optimizer steps several ways ("arms", `ARMS`), several
seeds each:

- outcome: one reward per completion (chapter 7).
- verifier: process supervision with step rewards from the exact arithmetic verifier and
  DeepSeekMath process advantages (arXiv 2402.03300, section 4.1.3; --process-variant).
- mc: process supervision with Math-Shepherd Monte-Carlo step values (arXiv 2312.08935):
  --mc-rollouts continuations of the current policy from every step prefix. Costs extra
  generated tokens, which are counted.
- prm: process supervision with step rewards from a learned process reward model (step scorer
  prm:PATH). --prm PATH uses a saved PRM (chapters/ch08_train_prm.py); without it one is trained
  once from the base model's own completions with verifier labels
  (`prm.train_prm_on_arithmetic`, sized by the --prm-* flags) and cached in <output-dir>/prm/.
- verifier+outcome (and mc+outcome, not run by default): the verifier's (MC's) step advantages
  plus the outcome advantage on every token (`process_advantages(variant="process+outcome")`).
- the outcome-anchored forms (`ARMS`: first-error, progress, pure, vine, vps, online-prm,
  recommended, ...) and the controls that test what a gain is made of: outcome with the format
  reward paid whatever the answer (outcome-format-any, -w1), progress credit for the think
  format alone (format-progress), and recommended's own credit spread evenly over each
  completion's tokens (placebo) or shuffled among its steps (shuffled).

The process arms keep every group by default, even one with no signal at all.
--process-skip-zero-advantage (the trainer's `skip_zero_advantage` under a process advantage_fn)
drops the groups whose token advantages are all exactly zero: equal outcomes *and* no step
credit. A group with equal outcomes whose steps differ is kept either way.
What each reward contains: the outcome
reward is correctness + format bonus; the verifier's step rewards check the arithmetic and (last
step) the boxed answer, without the format bonus; the PRM estimates the verifier's labels.

Every run saves checkpoints at --eval-points evenly spaced steps, each evaluated greedily on the
held-out split with `evaluation.evaluate`: strict (boxed) accuracy, step correctness (fraction of
verifier-correct steps over think-format answers, a missing step counted as wrong), right answer
with a wrong step (among correct think-format answers), accuracy among think-format answers and
format rate, and each problem's outcome (`evaluation.problem_outcomes`, for the intervals).
Each checkpoint also records its training seconds (rollouts, step scoring and updates;
evaluation excluded) and its cumulative tokens in two units, from the run's metrics.csv:
decode tokens (sampled: rollouts + the step scorer's continuations, `gen_tokens` +
`scorer_tokens`) and forward tokens (read without sampling: rollout prompts, the update's
forward passes, the step scorer's prefills and forward passes, `forward_tokens`).

`run_experiment` writes into --output-dir: one run directory per arm and seed (<arm>-seed<seed>/,
with the trainer's files and curve.json), results.json, results.md (`write_table`) and
process_vs_outcome.png (`plot_process_vs_outcome`: accuracy and step correctness against training
step and against cumulative decode tokens, mean +- sd over seeds). The held-out split defaults
to val (choose there; report on test), all of its problems. The first table has one row per arm
(`summarise`), means +- sd over seeds:
- final accuracy, step correctness, right answer + wrong step, think accuracy: at the last step;
- decode and forward tokens (k) per run (the one-off cost of training the PRM is reported under
  the table, not included);
- train s: training seconds per run;
- steps to outcome's acc.: the first evaluated step whose accuracy reaches the outcome runs' mean
  final accuracy (mean over the runs that reach it, with their count): equal-steps comparison;
- acc. at outcome's decode tokens: accuracy at the outcome runs' mean total decode tokens,
  linear between each run's evaluated checkpoints (`interpolate_at`, the one definition of
  accuracy at a budget): the equal-tokens comparison.
The second table reads the curves at outcome's decode tokens, forward tokens and seconds, and
where they first cross outcome's final accuracy (`first_crossing`, biased early); the third
gives 95% paired bootstrap intervals over problems and seeds (`stats.paired_bootstrap`) of
final accuracy, step correctness and accuracy at outcome's decode tokens, and of their
differences from outcome and from the arm's placebo.

Resumable: a finished run (curve.json) is reused if it was run with the same settings, an
interrupted one continues from its last checkpoint; `ExperimentSettings.report_only` trains
nothing and only tabulates and plots the finished runs. chapters/ch08_process_vs_outcome.py is
the command line of this module.
"""

from __future__ import annotations

import copy
import json
import math
import multiprocessing
import shutil
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from ..cli.train import load_grpo_data
from ..device import get_device
from ..evaluation import evaluate_policy
from ..files import atomic_write_json, atomic_write_text
from ..prm import train_prm_on_arithmetic
from ..process import ANCHORED_VARIANTS
from ..run_log import read_metrics
from ..training import DEFAULT_TRAIN_LEVEL_WEIGHTS, GRPOConfig, train_grpo
from ..weights import load_pretrained
from .levels import (
    LEVEL_FILE,
    final_level_figures,
    level_figures,
    level_table,
    mean_levels,
)
from .stats import (
    SETTINGS_FILE,
    bootstrap_draws,
    cached_base_figures,
    format_interval,
    format_pm,
    jsonable,
    mean_std,
    paired_bootstrap,
    refuse_other_settings,
    resume_point,
    settings_diff,
    stat,
)
from .stats import format_value as _opt  # short: the table lines are long


@dataclass(frozen=True)
class Arm:
    """One arm of the experiment: how its runs are supervised and how the tables show them."""

    label: str  # its row in the tables, its line in the figure
    color: str  # its line's colour
    # step scorer spec (`process_supervision.build_step_scorer`; "prm" and "online-prm*" get the
    # PRM's path later: prm:PATH, online-prm:PATH, online-prm-outcome:PATH); None: outcome
    scorer: str | None = None
    variant: str | None = None  # process variant; None: --process-variant
    config: dict = field(default_factory=dict)  # GRPOConfig values that differ from the flags
    # its placebo control: the same arm without the part credited for its gain (its step
    # credit spread evenly over each completion; the branches' advantages shuffled)
    placebo: str | None = None


def _recommended(alpha: float, **extra) -> dict:
    """GRPOConfig values of the recommended form at step-credit weight `alpha`: the groups whose
    token advantages are all zero (equal outcomes and equal verified steps) are dropped: they
    carry no signal, and training on them doubled the update's cost."""
    return {"process_alpha": alpha, "skip_zero_advantage": True, **extra}


# The step-credit weight of `recommended` (and its controls `placebo`, `shuffled`): the form
# chosen on tiny-arith-think's val split (seeds 0-2, alphas 1, 2, 4, 8 of the credit whose last
# step reaches its own end: 4 had the highest mean final accuracy, all four within 0.005;
# docs/process_vs_outcome.md). `recommended-tiny-arith` keeps tiny-arith's choice (alpha 1).
RECOMMENDED_ALPHA = 4.0
# The update size each arm chose in the same step-size search on tiny-arith-think's val split
# (experiments/tuning.py: seeds 0-2, lr 3e-5 / 1e-4 / 3e-4 / 1e-3, then 1 / 2 / 4 updates per
# batch, then grpo / dr_grpo; docs/process_vs_outcome.md, section 00). The `-tuned` arms run
# with these values whatever the flags say; `outcome` and `recommended` keep the flags'.
TUNED_OUTCOME = {"lr": 1e-4, "inner_epochs": 2, "loss_type": "dr_grpo"}
TUNED_RECOMMENDED = {"lr": 1e-4, "inner_epochs": 2, "loss_type": "grpo"}
THINK = ("verifier-think", "progress")  # outcome + progress credit of the think-only verifier
LOCAL = ("verifier-think-local", "progress-local")  # ... with credit past the first error
FLAT, SHUFFLED = {"process_credit_control": "flat"}, {"process_credit_control": "shuffled"}
# Branches at the first error (branching.py): 4 one-step continuations from each of a group's
# two most shared first-error states, set before the design's first (val) run.
BRANCHES = {"branch_rollouts": 4, "branch_states": 2}


def _alpha_arms(suffix: str, alpha: float, color: str, placebo_color: str, shuffled_color: str,
                what: str) -> dict:
    """`recommended<suffix>` at step-credit weight `alpha` and its two controls."""
    return {
        f"recommended{suffix}": Arm(f"recommended, step credit x {what}", color, *THINK,
                                    _recommended(alpha), placebo=f"placebo{suffix}"),
        f"placebo{suffix}": Arm(f"control: recommended x {what}'s credit spread evenly over "
                                "each completion", placebo_color, *THINK,
                                _recommended(alpha, **FLAT)),
        f"shuffled{suffix}": Arm(f"control: recommended x {what}'s credit shuffled among each "
                                 "completion's steps", shuffled_color, *THINK,
                                 _recommended(alpha, **SHUFFLED)),
    }


def _tuned_arms(suffix: str, label: str, form: tuple, colors: tuple) -> dict:
    """`recommended<suffix>`: outcome + RECOMMENDED_ALPHA x the step credit of `form` (scorer,
    variant) at recommended's tuned update, and its two controls `placebo<suffix>` and
    `shuffled<suffix>` (colours: the arm's, the placebo's, the shuffle's)."""
    name = f"recommended{suffix}"
    tuned = {**_recommended(RECOMMENDED_ALPHA), **TUNED_RECOMMENDED}
    return {
        name: Arm(label, colors[0], *form, tuned, placebo=f"placebo{suffix}"),
        f"placebo{suffix}": Arm(f"control: {name}'s credit spread evenly over each completion",
                                colors[1], *form, {**tuned, **FLAT}),
        f"shuffled{suffix}": Arm(f"control: {name}'s credit shuffled among each completion's "
                                 "steps", colors[2], *form, {**tuned, **SHUFFLED}),
    }


ARMS = {
    "outcome": Arm("outcome", "tab:blue"),
    "verifier": Arm("process (verifier)", "tab:green", "verifier"),
    "mc": Arm("process (MC)", "tab:red", "mc"),
    "prm": Arm("process (learned PRM)", "tab:orange", "prm"),
    "verifier+outcome": Arm("process (verifier) + outcome", "tab:olive", "verifier",
                            "process+outcome"),
    "mc+outcome": Arm("process (MC) + outcome", "tab:purple", "mc", "process+outcome"),
    # outcome-anchored forms (process.anchored_credit)
    "first-error": Arm("outcome + first-error penalty (verifier)", "tab:gray", "verifier",
                       "first-error"),
    "progress": Arm("outcome + progress (verifier)", "tab:cyan", "verifier", "progress"),
    "progress-think": Arm("outcome + progress (verifier, think-format steps only)", "teal",
                          *THINK),
    "first-error-think": Arm("outcome + first-error penalty (verifier, think-format steps only)",
                             "dimgray", "verifier-think", "first-error"),
    "prm-clip": Arm("outcome + clip form (PRM)", "tab:pink", "prm", "clip"),
    "prm-delta": Arm("outcome + delta form (PRM)", "tab:brown", "prm", "delta"),
    "prm-pure": Arm("PURE min form (PRM)", "gold", "prm", "pure"),
    "prm-progress": Arm("outcome + progress (PRM)", "darkorange", "prm", "progress"),
    "mc-delta": Arm("outcome + MC value differences", "darkred", "mc", "value-delta"),
    # VinePPO values from the group itself plus continuations branched from the rollouts' caches
    "vine": Arm("outcome + MC value differences (group + branched caches, k = 4)", "firebrick",
                "mc-branch", "value-delta"),
    "vine-k2": Arm("outcome + MC value differences (group + branched caches, k = 2)", "salmon",
                   "mc-branch", "value-delta", {"mc_rollouts": 2}),
    "online-prm": Arm("outcome + progress (online PRM, verifier labels)", "tab:purple",
                      "online-prm", "progress"),
    "online-prm-outcome": Arm("outcome + progress (online PRM, outcome labels)", "indigo",
                              "online-prm-outcome", "progress"),
    # the configuration chapter 8 recommends (see docs/process_supervision_forms.md)
    "recommended": Arm("recommended: outcome + progress (verifier-think, skip zero-signal "
                       "groups)", "black", *THINK, _recommended(RECOMMENDED_ALPHA),
                       placebo="placebo"),
    "recommended-a05": Arm("recommended, step credit x 0.5", "dimgrey", *THINK,
                           _recommended(0.5)),
    "recommended-a1": Arm("recommended, step credit x 1", "black", *THINK, _recommended(1.0)),
    **_alpha_arms("-a2", 2.0, "darkviolet", "hotpink", "peru", "2"),
    **_alpha_arms("-a4", 4.0, "mediumorchid", "hotpink", "peru", "4"),
    **_alpha_arms("-a8", 8.0, "plum", "hotpink", "peru", "8"),
    # zero-signal groups kept, as every other form keeps them
    "recommended-a2-keep": Arm("recommended, step credit x 2, zero-signal groups kept",
                               "slateblue", *THINK, {"process_alpha": 2.0}),
    "recommended-a4-keep": Arm("recommended, step credit x 4, zero-signal groups kept",
                               "royalblue", *THINK, {"process_alpha": 4.0}),
    "pure": Arm("PURE min form (verifier)", "gold", "verifier", "pure"),
    # GRPO-VPS: value differences of the policy's belief in the gold answer (no verifier)
    "vps": Arm("outcome + answer-belief value differences (GRPO-VPS)", "tab:green", "belief",
               "value-delta"),
    # controls: what the recommended arm's gain is made of; the format reward paid whatever the
    # answer (weight 0.5 as outcome's, and 1.0)
    "outcome-format-any": Arm("control: outcome, format reward 0.5 whatever the answer",
                              "lightblue", config={"format_reward_conditional": False}),
    "outcome-format-any-w1": Arm("control: outcome, format reward 1.0 whatever the answer",
                                 "steelblue", config={"format_reward_conditional": False,
                                                      "format_reward_weight": 1.0}),
    "format-progress": Arm("control: outcome + progress of the think format alone", "tab:olive",
                           "format", "progress", _recommended(1.0)),
    # the recommended credit with its placement among the steps removed
    "placebo": Arm("control: recommended's credit spread evenly over each completion",
                   "tab:pink", *THINK, _recommended(RECOMMENDED_ALPHA, **FLAT)),
    "shuffled": Arm("control: recommended's credit shuffled among each completion's steps",
                    "tab:brown", *THINK, _recommended(RECOMMENDED_ALPHA, **SHUFFLED)),
    # outcome and recommended at the update size each chose in the same search, and the
    # recommended credit's two controls at recommended's
    "outcome-tuned": Arm("outcome, update size tuned on val", "tab:cyan", config=TUNED_OUTCOME),
    **_tuned_arms("-tuned", "recommended, update size tuned on val", THINK,
                  ("black", "tab:pink", "tab:brown")),
    # Progress past the first error (process.anchored_credit "progress-local"): the tuned
    # recommended form whose steps after the first error are checked on their own inputs.
    **_tuned_arms("-local-tuned", "recommended-tuned, with credit past the first error", LOCAL,
                  ("darkgreen", "lightpink", "peru")),
    # Branches at the first error (branching.py) on top of the tuned recommended form, and
    # their placebo: the same rows and cost, each state's branch advantages shuffled among its
    # branches (which branch was right is lost).
    "recommended-branch-tuned": Arm("recommended-tuned, with branches at the first error",
                                    "darkorange", *THINK, {**_recommended(RECOMMENDED_ALPHA),
                                                           **TUNED_RECOMMENDED, **BRANCHES},
                                    placebo="placebo-branch-tuned"),
    "placebo-branch-tuned": Arm("control: recommended-branch-tuned's branch advantages "
                                "shuffled among each state's branches", "navajowhite", *THINK,
                                {**_recommended(RECOMMENDED_ALPHA), **TUNED_RECOMMENDED,
                                 **BRANCHES, "branch_control": "shuffled"}),
    # tiny-arith's choice: recommended as first measured there (alpha 1), and its controls
    **_alpha_arms("-tiny-arith", 1.0, "black", "tab:pink", "tab:brown", "1 (tiny-arith)"),
}
DEFAULT_ARMS = "outcome,verifier,mc,prm,verifier+outcome"
LABELS = {name: arm.label for name, arm in ARMS.items()}  # the level table's row names
# The paired bootstrap of the intervals (`stats.paired_bootstrap`): resamples, RNG seed, level.
BOOTSTRAP = {"n_boot": 2000, "seed": 0, "level": 0.95}


def placebo_of(arm: str) -> str | None:
    """The placebo control of an arm, or None: the same arm without the part credited for its
    gain (its step credit spread evenly over each completion's tokens; the branches at the
    first error with their advantages shuffled among each state's branches)."""
    return ARMS[arm].placebo


# Held-out figures of every evaluated checkpoint (keys of evaluate()'s summary; may be None).
METRICS = ("accuracy", "step_correctness", "right_answer_wrong_step", "think_accuracy",
           "format_rate")
BRANCH_FIELDS = ("branch_rollouts", "branch_states", "branch_max_new_tokens", "branch_control")
# GRPOConfig fields the experiment sets for every run; their flags must stay at the default.
PER_RUN = {"seed": "--seeds sets each run's seed", "supervision": "each arm sets it",
           "step_scorer": "each arm sets it", "eval_every": "see --eval-points",
           "checkpoint_every": "see --eval-points"}
# Fields that do not change what a run learns or how it is scored (ignored when reusing runs).
COSMETIC = ("output_dir", "progress", "eval_batch_size", "report_to", "sample_every",
            "checkpoint_minutes", "keep_checkpoints", "stop_signals")
PROCESS_FIELDS = ("step_scorer", "process_variant", "step_split", "mc_rollouts", "process_alpha",
                  "process_credit_control", "process_local_weight", *BRANCH_FIELDS)


@dataclass
class ExperimentSettings:
    """The experiment's own settings (the GRPOConfig shared by every arm comes separately)."""

    output_dir: str = "runs/ch08-process-vs-outcome"  # run directories, PRM cache, results
    model: str = "tiny-arith"  # base model of every run and of the prm arm's PRM
    eval_points: int = 4  # a checkpoint every steps // eval_points steps
    eval_split: str = "val"  # val for choosing among arms, test for the reported table
    train_examples: int | None = None
    train_level_weights: tuple | list | None = DEFAULT_TRAIN_LEVEL_WEIGHTS
    # process arms: drop groups whose token advantages are all zero (outcome and step credit)
    process_skip_zero_advantage: bool = False
    report_only: bool = False  # train nothing: tabulate the finished runs
    # the arm whose final accuracy and totals are the target and budgets of the tables
    reference_arm: str = "outcome"
    jobs: int = 1  # runs trained at once, each in its own process with one CPU thread
    device: str | None = None
    prm: str | None = None  # a saved PRM for the prm arm (None: train one, cached)
    prm_labels: str = "verifier"  # verifier | mc
    prm_train_problems: int = 200
    prm_eval_problems: int = 100
    prm_samples: int = 4
    prm_max_new_tokens: int | None = None  # None: the GRPOConfig's max_new_tokens
    prm_epochs: int = 3
    prm_lr: float = 1e-3
    prm_batch_size: int = 16


# ----------------------------------------------------------------------------------------------
# Runs
# ----------------------------------------------------------------------------------------------


def _run_config(arm, seed, values, args, prm_path, run_dir):
    """The GRPOConfig of one run: the shared values plus the arm's supervision."""
    spec, variant = ARMS[arm].scorer, ARMS[arm].variant
    d = {**values, "seed": seed, "output_dir": str(run_dir), "eval_every": 0,
         "checkpoint_every": max(1, values["steps"] // args.eval_points),
         "keep_checkpoints": 0}  # every evaluation point's checkpoint is evaluated afterwards
    if spec is None:
        d["supervision"] = "outcome"
    else:
        d.update(supervision="process",
                 step_scorer=f"{spec}:{prm_path}" if _uses_prm(arm) else spec,
                 process_variant=variant or values["process_variant"],
                 skip_zero_advantage=args.process_skip_zero_advantage)
    d.update(ARMS[arm].config)
    return GRPOConfig.from_dict(d)


def _uses_prm(arm):
    """Whether an arm's step scorer is the learned PRM (static or online)."""
    spec = ARMS[arm].scorer
    return spec is not None and (spec == "prm" or spec.startswith("online-prm"))


def _run_settings(config, args, prm_report=None):
    """What decides a run's result: reuse a finished run only if these match."""
    s = {k: v for k, v in asdict(config).items() if k not in COSMETIC}
    if config.supervision == "outcome":
        for k in PROCESS_FIELDS:
            s.pop(k)
    elif not config.step_scorer.startswith("mc"):
        s.pop("mc_rollouts")
    if config.supervision == "process" and config.process_variant not in ANCHORED_VARIANTS:
        s.pop("process_alpha")
        s.pop("process_credit_control")
    if s.get("process_credit_control") == "none":
        s.pop("process_credit_control")  # runs from before the controls existed stay reusable
    if s.get("process_variant") != "progress-local":
        s.pop("process_local_weight", None)  # only progress-local reads it
    if not s.get("branch_rollouts"):
        for k in BRANCH_FIELDS:  # runs from before the branches existed stay reusable
            s.pop(k, None)
    s.update(model=args.model, eval_split=args.eval_split, train_examples=args.train_examples,
             train_level_weights=args.train_level_weights)
    if config.supervision == "process" and config.step_scorer.split(":")[0] in (
            "prm", "online-prm", "online-prm-outcome"):
        s["prm_settings"] = (prm_report or {}).get("settings")
    return json.loads(json.dumps(s))  # as it reads back from JSON


def _load_curve(run_dir):
    """A finished run's curve.json, or None (none yet, or the old list format)."""
    path = Path(run_dir) / "curve.json"
    if not path.is_file():
        return None
    curve = json.loads(path.read_text())
    if not isinstance(curve, dict) or "points" not in curve:
        print(f"{path}: written by an older version of this experiment; ignored")
        return None
    return curve


COST_COLUMNS = ("step_time", "gen_tokens", "scorer_tokens", "forward_tokens",
                "forward_pad_tokens")


def _cumulative_costs(metrics_csv):
    """step -> (training seconds, rollout tokens, step-scorer tokens, forward tokens, their right
    padding), summed up to that step.

    Seconds are the trainer's step_time (rollouts + scoring + updates, no evaluation); a token
    sum is NaN if the run's metrics.csv has no such column (written by an older version).
    """
    out, sums = {0: (0.0,) * len(COST_COLUMNS)}, [0.0] * len(COST_COLUMNS)
    for r in read_metrics(metrics_csv):
        for i, col in enumerate(COST_COLUMNS):
            v = r.get(col)
            sums[i] += (0.0 if col == "step_time" else math.nan) if v is None else v
        out[int(r["step"])] = tuple(sums)
    return out


def _make_point(step, costs, figures):
    """One evaluated checkpoint: step, seconds, cumulative tokens (sampled: `tokens`, rollouts +
    scorer; read without sampling: `forward_tokens`) and the held-out figures."""
    secs, gen, scorer, forward, padding = costs.get(step, (math.nan,) * len(COST_COLUMNS))
    return {"step": step, "seconds": secs, "gen_tokens": gen, "scorer_tokens": scorer,
            "tokens": gen + scorer, "forward_tokens": forward, "forward_pad_tokens": padding,
            **figures}


def _checkpoint_points(run_dir, config, tokenizer, held_out, device, summary):
    """The points of a trained run: its checkpoints evaluated, then deleted (final/ stays).

    Evaluations are cached in evals.json, so an interrupted evaluation resumes; the final
    figures come from the trainer's summary.
    """
    costs = _cumulative_costs(run_dir / "metrics.csv")
    cache_file = run_dir / "evals.json"
    cache = json.loads(cache_file.read_text()) if cache_file.is_file() else {}
    points, every = [], config.checkpoint_every
    steps = [*range(every, config.steps, every), config.steps]
    for step in steps:
        if str(step) not in cache:  # the final model too, for its per-problem outcomes
            name = "final" if step == config.steps else f"checkpoint-{step}"
            model, _ = load_pretrained(run_dir / name, device=device, dtype=torch.float32)
            cache[str(step)] = evaluate_policy(model, tokenizer, held_out[:config.eval_examples],
                                               device, config.eval_tokens,
                                               config.eval_batch_size, per_problem=True)
            atomic_write_json(cache_file, cache)
    for step in steps[:-1]:
        points.append(_make_point(step, costs, cache[str(step)]))
    final = {k: summary[f"final_{k}"] for k in METRICS}
    final["per_level"] = {lv: v["final"] for lv, v in summary.get("per_level", {}).items()}
    final["per_problem"] = cache[str(config.steps)].get("per_problem")
    points.append(_make_point(config.steps, costs, final))
    for ckpt in run_dir.glob("checkpoint-*"):
        shutil.rmtree(ckpt)  # keep the disk small
    return points


def _run_one(config, settings, base_model, tokenizer, train, held_out, device, base=None):
    """Train and evaluate one run, or reuse / resume it; returns its curve dict."""
    run_dir = Path(config.output_dir)
    done = _load_curve(run_dir)
    if done is not None:
        refuse_other_settings(run_dir, done.get("settings") or {}, settings)
        return done
    resume = resume_point(run_dir, settings)
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(run_dir / SETTINGS_FILE, settings)
    model = copy.deepcopy(base_model)
    summary = train_grpo(model, tokenizer, train, held_out, device, config, resume_from=resume,
                         base_evaluation=base)  # evaluated once for all runs
    del model
    points = _checkpoint_points(run_dir, config, tokenizer, held_out, device, summary)
    curve = {"settings": settings, "summary": summary, "points": points}
    atomic_write_json(run_dir / "curve.json", jsonable(curve))
    return json.loads(json.dumps(jsonable(curve)))



def _prm_settings_differ(a, b):
    """Whether two PRM settings differ (mc_rollouts counts only with Monte-Carlo labels)."""
    drop = () if a.get("labels") == "mc" or b.get("labels") == "mc" else ("mc_rollouts",)
    return {k: v for k, v in a.items() if k not in drop} != {
        k: v for k, v in b.items() if k not in drop}


def _prepare_prm(args, config, base_model, tokenizer, device, out):
    """(path, report) of the prm arm's PRM: --prm, or one trained from the base model once.

    The trained one is cached in <output-dir>/prm/; the report (prm_report.json) is None if
    there is none.
    """
    def report_of(path):
        """The PRM's prm_report.json, or None."""
        f = Path(path) / "prm_report.json"
        return json.loads(f.read_text()) if f.is_file() else None

    if args.prm:
        path = Path(args.prm)
        if not (path / "prm_config.json").is_file():
            raise SystemExit(f"--prm {path}: no PRM there (prm_config.json, see ch08_train_prm.py)")
        return path, report_of(path)
    path = out / "prm"
    settings = dict(labels=args.prm_labels, train_problems=args.prm_train_problems,
                    eval_problems=args.prm_eval_problems, samples=args.prm_samples,
                    max_new_tokens=args.prm_max_new_tokens or config.max_new_tokens,
                    temperature=config.temperature, mc_rollouts=config.mc_rollouts,
                    epochs=args.prm_epochs, lr=args.prm_lr, batch_size=args.prm_batch_size,
                    seed=0)
    report = report_of(path)
    if args.report_only or ((path / "prm_config.json").is_file() and report is not None
                            and not _prm_settings_differ(report.get("settings", {}), settings)):
        if report is not None:
            print(f"PRM: reusing {path}")
        return path, report
    if report is not None:
        print(f"PRM: {path} was trained with other settings "
              f"({settings_diff(report.get('settings', {}), settings)}); training it again")
    shutil.rmtree(path, ignore_errors=True)
    print(f"PRM: training one from {args.model} into {path}")
    report = train_prm_on_arithmetic(base_model, tokenizer, path, device=device,
                                     info={"model": args.model}, **settings)
    return path, json.loads(json.dumps(report))


# ----------------------------------------------------------------------------------------------
# Summary: table and figure
# ----------------------------------------------------------------------------------------------


def _first_reaching(points, target):
    """Step of the first point whose accuracy is >= target, or None."""
    for p in points:
        if p["accuracy"] is not None and p["accuracy"] >= target - 1e-9:
            return p["step"]
    return None


def _has(p, key):
    """Whether point `p` has a number under `key` (not None, not NaN)."""
    return p.get(key) is not None and not math.isnan(p[key])


def _bracket(points, x, key):
    """[(point, weight)]: the evaluated points around `key` = x with their linear weights (the
    last point alone past its end, the first before its start); None if a point has no `key`
    (a run from before that column existed). Points are in step order, the first at x = 0."""
    if not points or not all(_has(p, key) for p in points):
        return None
    if x >= points[-1][key]:
        return [(points[-1], 1.0)]
    for a, b in zip(points, points[1:]):
        if a[key] <= x <= b[key]:
            w = 0.0 if b[key] == a[key] else (x - a[key]) / (b[key] - a[key])
            return [(a, 1.0 - w), (b, w)]
    return [(points[0], 1.0)]


def interpolate_at(points, x, key="tokens", value="accuracy"):
    """`value` at `key` = x (decode tokens, forward tokens, seconds), linear between the
    evaluated points and held flat past the last: the one definition of "accuracy at a
    budget". None if a needed point has no value or a point has no `key`."""
    around = _bracket(points, x, key)
    if around is None or any(p.get(value) is None for p, _ in around):
        return None
    return sum(w * p[value] for p, w in around)


def per_problem_at(points, x, key="tokens", field="correct"):
    """`interpolate_at` problem by problem: the list of each problem's `field`
    (`evaluation.problem_outcomes`) at `key` = x, linear between the evaluated points (so its
    mean is `interpolate_at`'s accuracy); None if a needed point has no per-problem record."""
    around = _bracket(points, x, key)
    if around is None or any(not p.get("per_problem") for p, _ in around):
        return None
    rows = [[w * v for v in p["per_problem"][field]] for p, w in around]
    return [sum(col) for col in zip(*rows)]


def first_crossing(points, target, key="tokens", value="accuracy"):
    """The `key` (tokens, seconds) at which `value` first reaches `target`, linear between the
    evaluated points; None if it never does. Points without a value or a `key` are left out.

    Biased early: a noisy curve crosses a level the first time noise lifts it there, so the
    first crossing comes on average before the crossing of the mean curve, the more so the
    noisier the checkpoints and the flatter the curve near the target.
    """
    pts = [p for p in points if _has(p, value) and _has(p, key)]
    prev = None
    for p in pts:
        if p[value] >= target - 1e-9:
            if prev is None:
                return p[key]
            w = (target - prev[value]) / (p[value] - prev[value])
            return prev[key] + w * (p[key] - prev[key])
        prev = p
    return None


def _crossing_shares(curve, target, xs):
    """(B,) the x at which each row of `curve` (B, J), read at `xs` (J,), first reaches
    `target` (B,), linear between grid points; inf where it never does."""
    above = curve >= target[:, None] - 1e-9  # (B, J)
    j = torch.where(above.any(1), above.float().argmax(1), torch.full_like(target, -1).long())
    out = torch.full_like(target, math.inf)
    for b in torch.nonzero(j >= 0).flatten().tolist():
        k = int(j[b])
        if k == 0:
            out[b] = xs[0]
            continue
        lo, hi = curve[b, k - 1], curve[b, k]
        w = (target[b] - lo) / (hi - lo) if hi > lo else 1.0
        out[b] = xs[k - 1] + w * (xs[k] - xs[k - 1])
    return out


def mean_curve_crossing(runs, reference, budget, max_share=1.5, grid=150, n_boot=2000,
                        seed=0, level=0.95):
    """Where the seed-mean accuracy curve of `runs` reaches `reference`'s mean final accuracy,
    as a share of `budget` (outcome's mean decode tokens), with a paired bootstrap interval.

    `runs`, `reference`: {seed: points from step 0, with per-problem records}; the seeds both
    have are paired. Each seed's curve is read problem by problem on `grid` + 1 evenly spaced
    token counts up to `max_share` x budget (`per_problem_at`: linear between checkpoints,
    flat past the last), averaged over seeds and problems, and crossed with the target
    linearly between grid points. Unlike a run's first crossing (`first_crossing`, biased
    early by noise), the mean curve's crossing is the one a reader sees in the figure.
    Every bootstrap resample draws seeds and problems with replacement (`stats.
    bootstrap_draws`) and recomputes both the curve and the target on them. Returns
    {"mean", "lo", "hi", "never"} (shares; inf: not reached within max_share; "never": the
    fraction of resamples that do not reach it), or None without per-problem records.
    """
    seeds = [s for s in runs if s in reference]
    xs = [budget * max_share * j / grid for j in range(grid + 1)]
    rows = [[per_problem_at(runs[s], x) for x in xs] for s in seeds]
    finals = [reference[s][-1].get("per_problem") for s in seeds]
    if not seeds or any(r is None for rs in rows for r in rs) or not all(finals):
        return None
    A = torch.tensor(rows, dtype=torch.float64)  # (S, J, N)
    ref = torch.tensor([f["correct"] for f in finals], dtype=torch.float64)  # (S, N)
    if ref.shape[1] != A.shape[2]:
        return None
    S, N = ref.shape
    seed_idx, prob_idx = bootstrap_draws(S, N, n_boot, seed)
    ws = torch.stack([torch.bincount(r, minlength=S) for r in seed_idx]).double()  # (B, S)
    wp = torch.stack([torch.bincount(r, minlength=N) for r in prob_idx]).double()  # (B, N)
    ws, wp = torch.cat([torch.ones(1, S), ws]), torch.cat([torch.ones(1, N), wp])  # row 0: data
    curve = torch.einsum("sjn,bn,bs->bj", A, wp, ws) / (S * N)  # (B+1, J)
    target = torch.einsum("sn,bn,bs->b", ref, wp, ws) / (S * N)  # (B+1,)
    shares = _crossing_shares(curve, target, torch.tensor(xs, dtype=torch.float64)) / budget
    q = torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64)
    finite = torch.where(torch.isinf(shares[1:]), torch.tensor(1e9, dtype=torch.float64),
                         shares[1:])  # percentiles with "never" ranked last
    lo, hi = torch.quantile(finite, q).tolist()
    return {"mean": float(shares[0]), "lo": lo if lo < 1e9 else math.inf,
            "hi": hi if hi < 1e9 else math.inf,
            "never": float(torch.isinf(shares[1:]).double().mean())}


def _equal_compute(row, runs, target, budgets):
    """The interpolated equal-compute figures of one arm's row (added in place); `runs`:
    {seed: points from step 0}, seeds in order; `budgets`: outcome's mean totals by key."""
    seeds, pts = list(runs), list(runs.values())
    if budgets.get("tokens") is not None:
        at = [interpolate_at(p, budgets["tokens"]) for p in pts]
        row["accuracy_at_budget"] = stat(at)
        row["accuracy_at_budget_per_seed"] = dict(zip(seeds, at))
    if budgets.get("forward_tokens") is not None:
        row["accuracy_at_forward_budget"] = stat(
            [interpolate_at(p, budgets["forward_tokens"], "forward_tokens") for p in pts])
    if target is not None and budgets.get("tokens"):
        reach = [first_crossing(p, target) for p in pts]
        row["tokens_to_target_share"] = [None if r is None else r / budgets["tokens"]
                                         for r in reach]
    if budgets.get("seconds") is not None:
        row["accuracy_at_seconds"] = stat(
            [interpolate_at(p, budgets["seconds"], "seconds") for p in pts])


def _problem_matrices(runs, seeds, budget):
    """Per-problem figures of one arm's `seeds` (seeds x problems): final correct, verified
    and all steps, and correct at the decode-token `budget`; None if a run lacks them."""
    finals = [runs[s][-1].get("per_problem") for s in seeds]
    if not seeds or not all(finals):
        return None
    out = {k: [f[k] for f in finals] for k in ("correct", "steps_good", "steps_total")}
    if budget is not None:
        at = [per_problem_at(runs[s], budget) for s in seeds]
        out["at_budget"] = at if all(a is not None for a in at) else None
    if len({len(row) for rows in out.values() if rows for row in rows}) != 1:
        return None  # evaluated on different problem sets: nothing to pair
    return out


def _intervals(a, b=None):
    """Paired bootstrap intervals of final accuracy, step correctness and accuracy at the
    budget, of `_problem_matrices` `a` or of the difference a - b."""
    b = b or {}
    out = {"final_accuracy": paired_bootstrap(a["correct"], reference=b.get("correct"),
                                              **BOOTSTRAP),
           "final_step_correctness": paired_bootstrap(
               a["steps_good"], a["steps_total"], b.get("steps_good"), b.get("steps_total"),
               **BOOTSTRAP)}
    if a.get("at_budget") is not None and (not b or b.get("at_budget") is not None):
        out["accuracy_at_budget"] = paired_bootstrap(a["at_budget"],
                                                     reference=b.get("at_budget"), **BOOTSTRAP)
    return out


def _add_intervals(row, curves, budget, reference="outcome"):
    """95% paired bootstrap intervals over problems and seeds (`stats.paired_bootstrap`): the
    arm's own figures, and its differences from the `reference` arm (under "vs_outcome", the
    arm named in it) and from its placebo (on the seeds both have), in row["intervals"];
    nothing for runs without per-problem records."""
    arm = row["arm"]
    own = _problem_matrices(curves[arm], list(curves[arm]), budget)
    if own is None:
        return
    row["intervals"] = {"self": _intervals(own)}
    for name, ref in (("vs_outcome", reference), ("vs_placebo", placebo_of(arm))):
        if ref is None or ref == arm or ref not in curves:
            continue
        seeds = [s for s in curves[arm] if s in curves[ref]]
        a = _problem_matrices(curves[arm], seeds, budget)
        b = _problem_matrices(curves[ref], seeds, budget)
        if a is not None and b is not None and len(a["correct"][0]) == len(b["correct"][0]):
            row["intervals"][name] = {"arm": ref, "seeds": seeds, **_intervals(a, b)}


def _pair_intervals(curves, budget):
    """{(arm, other): `_intervals` of arm - other} for every pair of arms, the later arm in
    `curves`' order first, on the seeds both have; pairs without per-problem records are
    left out."""
    arms, out = list(curves), {}
    for i, other in enumerate(arms):
        for arm in arms[i + 1:]:
            seeds = [s for s in curves[arm] if s in curves[other]]
            a = _problem_matrices(curves[arm], seeds, budget)
            b = _problem_matrices(curves[other], seeds, budget)
            if a is not None and b is not None and len(a["correct"][0]) == len(b["correct"][0]):
                out[(arm, other)] = _intervals(a, b)
    return out


# The figures every pair of arms is compared on (`pair_differences`): the per-problem ones get
# a paired bootstrap interval when the runs' per-problem records are at hand.
PAIR_FIGURES = ("final_accuracy", "final_step_correctness", "accuracy_at_budget",
                "accuracy_at_forward_budget")


def pair_differences(rows, intervals=None):
    """Every pairwise comparison of an experiment's arms, as results.json keeps it: for each
    pair of `rows` (`summarise`'s rows), the later row minus the earlier, the difference of
    their mean `PAIR_FIGURES` ({"mean"}), with its 95% paired bootstrap interval ({"mean",
    "lo", "hi"}) where `intervals` ({(arm, other): ...}, `_pair_intervals`) has one."""
    intervals, pairs = intervals or {}, []
    for i, earlier in enumerate(rows):
        for row in rows[i + 1:]:
            pair = {"arm": row["arm"], "vs": earlier["arm"]}
            bootstrap = intervals.get((row["arm"], earlier["arm"]), {})
            for key in PAIR_FIGURES:
                a, b = row.get(key, stat([]))["mean"], earlier.get(key, stat([]))["mean"]
                if a is not None and b is not None and not math.isnan(a - b):
                    pair[key] = bootstrap.get(key) or {"mean": a - b}
            pairs.append(pair)
    return pairs


LEVEL_PAIR_FIGURES = ("accuracy", "step_correctness", "carry_step_correctness")


def add_level_differences(pairs, levels):
    """Each pair's per-level differences of the final models' mean `LEVEL_PAIR_FIGURES`
    (`levels.mean_levels` over seeds; `_final_levels`' figures), under "levels" {level:
    {figure: difference}}, in place."""
    means = {arm: mean_levels(runs) for arm, runs in (levels or {}).get("runs", {}).items()
             if runs}
    for pair in pairs:
        a, b = means.get(pair["arm"]), means.get(pair["vs"])
        if a is None or b is None:
            continue
        pair["levels"] = {lv: {k: a[lv][k] - b[lv][k] for k in LEVEL_PAIR_FIGURES
                               if not math.isnan(a[lv][k] - b[lv][k])}
                          for lv in a if lv in b}
    return pairs


def summary_pairs(summary):
    """`pair_differences` (with the per-level differences) of a results.json summary from its
    rows and levels alone: the point differences of a summary whose runs' per-problem records
    are no longer at hand (no intervals)."""
    return add_level_differences(pair_differences(summary["rows"]), summary.get("levels"))


def summarise(curves, base, reference="outcome"):
    """Per-arm rows of the table, plus the reference runs' target accuracy and budgets.

    `reference`: the arm whose mean final accuracy is the target and whose mean totals are
    the budgets of the equal-compute figures ("outcome"; an equally tuned outcome arm such as
    "outcome-tuned" to compare with it instead).
    `curves`: {arm: {seed: [point, ...]}}, points in step order without the base model (step 0),
    whose figures are `base`. Figures are {"mean", "sd"} over seeds (NaN when no run has one),
    per-seed lists in seed order; "intervals" holds 95% paired bootstrap intervals over
    problems and seeds where the points carry per-problem records.
    """
    start = {"step": 0, "seconds": 0.0, "gen_tokens": 0.0, "scorer_tokens": 0.0, "tokens": 0.0,
             "forward_tokens": 0.0, "forward_pad_tokens": 0.0, **base}
    curves = {arm: {s: [start, *runs[s]] for s in sorted(runs)} for arm, runs in curves.items()}
    finals = {arm: [pts[-1] for pts in runs.values()] for arm, runs in curves.items()}
    target, budgets = None, {}
    if finals.get(reference):
        target = mean_std([p["accuracy"] for p in finals[reference]])[0]
        target = None if math.isnan(target) else target
        for key in ("tokens", "forward_tokens", "seconds"):
            m = mean_std([p.get(key) for p in finals[reference]])[0]
            budgets[key] = None if math.isnan(m) else m
    rows = []
    for arm, runs in curves.items():
        last = finals[arm]
        row = {"arm": arm, "label": ARMS[arm].label, "seeds": list(runs),
               **{f"final_{k}": stat([p[k] for p in last]) for k in METRICS},
               "tokens": stat([p["tokens"] for p in last]),
               "forward_tokens": stat([p.get("forward_tokens") for p in last]),
               "forward_pad_tokens": stat([p.get("forward_pad_tokens") for p in last]),
               "scorer_tokens": stat([p["scorer_tokens"] for p in last]),
               "train_seconds": stat([p["seconds"] for p in last]),
               "steps": max(p["step"] for p in last)}
        if target is not None:
            row["steps_to_target"] = [_first_reaching(pts, target) for pts in runs.values()]
        _equal_compute(row, runs, target, budgets)
        if target is not None and budgets.get("tokens") and reference in curves:
            row["mean_curve_share"] = mean_curve_crossing(runs, curves[reference],
                                                          budgets["tokens"], **BOOTSTRAP)
        _add_intervals(row, curves, budgets.get("tokens"), reference)
        rows.append(row)
    return {"reference": reference, "target": target, "token_budget": budgets.get("tokens"),
            "forward_token_budget": budgets.get("forward_tokens"),
            "seconds_budget": budgets.get("seconds"), "rows": rows,
            "pairs": pair_differences(rows, _pair_intervals(curves, budgets.get("tokens")))}


def _fmt_reach(values):
    """The steps-to-target cell: mean step of the runs that reach it, and their count."""
    reached = [v for v in values if v is not None]
    if not reached:
        return f"not reached (0/{len(values)})"
    return f"{sum(reached) / len(reached):.0f} ({len(reached)}/{len(values)} runs)"


def _k(n):
    """Thousands, with a decimal below 10k."""
    return f"{n / 1000:.1f}" if n < 10_000 else f"{n / 1000:.0f}"


def _fmt_tokens(row):
    """The decode-tokens cell: k tokens per run, with the step scorer's share when it has one."""
    total, scorer = row["tokens"]["mean"], row["scorer_tokens"]["mean"]
    if math.isnan(total):
        return "n/a"
    return _k(total) + (f" (scorer {_k(scorer)})" if scorer and not math.isnan(scorer) else "")


def _fmt_k(st):
    """A k-tokens cell of a {"mean", "sd"} figure."""
    return "n/a" if math.isnan(st["mean"]) else _k(st["mean"])


def _fmt_share(share):
    """The seed-mean crossing cell: share [95%], '> 1.5' where it is not reached."""
    if not share:
        return "n/a"
    def cell(v):
        return "> 1.5" if math.isinf(v) else f"{v:.2f}"
    return f"{cell(share['mean'])} [{cell(share['lo'])}, {cell(share['hi'])}]"


TOKEN_UNITS = ("Decode tokens: sampled (rollouts + the step scorer's continuations). Forward "
               "tokens: read without sampling (rollout prompts, the update's forward passes of "
               "the policy and its reference, the step scorer's prefills and forward passes).")
CROSSING_NOTE = ("A first crossing is biased early (noise lifts a curve over the level before "
                 "its mean gets there).")


def _equal_compute_table(summary):
    """The second table: accuracy at outcome's decode tokens, forward tokens and seconds,
    interpolated between the evaluated checkpoints, and the share of outcome's decode tokens
    spent when a run first reaches outcome's final accuracy."""
    budget, target = summary["token_budget"], summary["target"]
    forward, seconds = summary.get("forward_token_budget"), summary.get("seconds_budget")
    if budget is None:
        return []
    lines = ["", "| supervision | acc. at outcome's decode tokens | per seed | "
             "acc. at outcome's forward tokens | outcome's final acc. reached at (share of "
             "outcome's decode tokens, per seed) | reached by the seed-mean curve at [95%] | "
             "acc. at outcome's train s | final format rate |",
             "|---|---|---|---|---|---|---|---|"]
    for r in summary["rows"]:
        seeds = ", ".join("n/a" if v is None else f"{v:.3f}"
                          for v in r.get("accuracy_at_budget_per_seed", {}).values())
        shares = ", ".join("never" if v is None else f"{v:.2f}"
                           for v in r.get("tokens_to_target_share", []))
        lines.append(f"| {r['label']} | {format_pm(r['accuracy_at_budget'])} | {seeds} | "
                     f"{format_pm(r.get('accuracy_at_forward_budget', stat([])))} | "
                     f"{shares} | {_fmt_share(r.get('mean_curve_share'))} | "
                     f"{format_pm(r.get('accuracy_at_seconds', stat([])))} | "
                     f"{format_pm(r['final_format_rate'])} |")
    lines += ["", f"Equal compute, mean ± sd over seeds, interpolated linearly between the "
              f"evaluated checkpoints (step 0: the base model): accuracy at the outcome runs' "
              f"mean {_k(budget)}k decode tokens, at their mean "
              f"{'n/a' if forward is None else _k(forward) + 'k'} forward tokens and at their "
              f"mean {'n/a' if seconds is None else f'{seconds:.0f}'} training seconds (wall "
              "clock on a shared machine: noisy); share of those decode tokens spent when a "
              "run's accuracy first reaches "
              f"{'n/a' if target is None else f'{target:.3f}'}, outcome's mean final accuracy, "
              "and where the seed-mean curve reaches it (problem by problem between the "
              "checkpoints, with a paired bootstrap interval over problems and seeds, the "
              "target resampled too; `mean_curve_crossing`). "
              + CROSSING_NOTE + " " + TOKEN_UNITS]
    return lines


def _interval_table(summary):
    """The third table: 95% paired bootstrap intervals over problems and seeds."""
    rows = [r for r in summary["rows"] if "intervals" in r]
    if not rows:
        return []
    lines = ["", "| supervision | final accuracy | step correctness | acc. at outcome's "
             "decode tokens | final acc. - outcome | step corr. - outcome | acc. at outcome's "
             "decode tokens - outcome | final acc. - placebo |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        iv = r["intervals"]
        own, vs_o, vs_p = iv["self"], iv.get("vs_outcome", {}), iv.get("vs_placebo", {})
        lines.append(
            f"| {r['label']} | {format_interval(own['final_accuracy'])} | "
            f"{format_interval(own['final_step_correctness'])} | "
            f"{format_interval(own.get('accuracy_at_budget'))} | "
            f"{format_interval(vs_o.get('final_accuracy'))} | "
            f"{format_interval(vs_o.get('final_step_correctness'))} | "
            f"{format_interval(vs_o.get('accuracy_at_budget'))} | "
            f"{format_interval(vs_p.get('final_accuracy'))} |")
    lines += ["", f"Estimate [{BOOTSTRAP['level']:.0%} interval]: paired percentile bootstrap "
              f"over problems and seeds together ({BOOTSTRAP['n_boot']} resamples, RNG seed "
              f"{BOOTSTRAP['seed']}; `stats.paired_bootstrap`): every resample draws the seeds "
              "and the problems with replacement, the same draws for an arm and the arm it is "
              "compared with (on the seeds both have). Step correctness: verified steps / all "
              "steps over the resampled problems, per seed. Accuracy at outcome's decode tokens: "
              "each problem's outcome interpolated between the checkpoints around the budget, "
              "the budget held fixed. Placebo (`placebo_of`): the arm's credit spread evenly over "
              "each completion's tokens; for the branches at the first error, their advantages "
              "shuffled among each state's branches."]
    return lines


def _pairs_table(summary):
    """The fourth table: every pair of arms (`pair_differences`), later minus earlier."""
    pairs = summary.get("pairs") or []
    if not pairs:
        return []
    lines = ["", "| arm - other arm | final accuracy | step correctness | acc. at outcome's "
             "decode tokens | acc. at outcome's forward tokens |", "|---|---|---|---|---|"]
    for pair in pairs:
        cells = [format_interval(pair.get(key)) for key in PAIR_FIGURES]
        lines.append(f"| {pair['arm']} - {pair['vs']} | " + " | ".join(cells) + " |")
    lines += ["", "Every pair of arms, the later row minus the earlier, on the seeds both have: "
              "the difference of the means with its paired bootstrap interval as above (none "
              "for the accuracy at outcome's forward tokens, and none when per-problem records "
              "are missing)."]
    return lines


def write_table(summary, base, path, prm_report=None, held_out_name="held-out"):
    """results.md: the tables of docs/process_vs_outcome.md, with the definitions under them."""
    rows, target, budget = summary["rows"], summary["target"], summary["token_budget"]
    lines = [
        "| supervision | seeds | final accuracy | step correctness | right answer, wrong step | "
        "think accuracy | decode tokens (k) | forward tokens (k) | train s | "
        "steps to outcome's acc. | acc. at outcome's decode tokens |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        t = r["train_seconds"]["mean"]
        lines.append(
            f"| {r['label']} | {len(r['seeds'])} | {format_pm(r['final_accuracy'])} | "
            f"{format_pm(r['final_step_correctness'])} | "
            f"{format_pm(r['final_right_answer_wrong_step'])} | "
            f"{format_pm(r['final_think_accuracy'])} | {_fmt_tokens(r)} | "
            f"{_fmt_k(r.get('forward_tokens', stat([])))} | "
            f"{'n/a' if math.isnan(t) else f'{t:.0f}'} | "
            f"{_fmt_reach(r.get('steps_to_target', [])) if target is not None else 'n/a'} | "
            f"{format_pm(r.get('accuracy_at_budget', stat([])))} |")
    lines += [
        "",
        f"Base model ({held_out_name}): accuracy {_opt(base['accuracy'])}, step correctness "
        f"{_opt(base['step_correctness'])}, right answer with a wrong step "
        f"{_opt(base['right_answer_wrong_step'])}, think accuracy {_opt(base['think_accuracy'])}.",
        "Mean ± sd over seeds, at the last step. Step correctness: fraction of verifier-correct "
        "steps (a missing step counts as wrong) over think-format answers; right answer, wrong "
        "step: among correct think-format answers; think accuracy: accuracy among think-format "
        "answers. " + TOKEN_UNITS + " Tokens per run; scorer = the step scorer's decode tokens "
        "(Monte-Carlo continuations; the verifier and the PRM sample nothing). Train s: "
        "rollouts, scoring and updates, evaluation excluded.",
    ]
    ref = summary.get("reference", "outcome")
    if ref != "outcome":
        lines.append(f"Here 'outcome' in the column names is the reference arm `{ref}` "
                     f"({ARMS[ref].label}): its mean final accuracy and totals are the target "
                     "and the budgets, and the differences are taken from it.")
    if target is not None:
        lines.append(f"Steps to outcome's acc.: first evaluated step (0 = base model) reaching "
                     f"the outcome runs' mean final accuracy {target:.3f}; mean over the runs "
                     "that reach it. " + CROSSING_NOTE)
    if budget is not None:
        lines.append(f"Acc. at outcome's decode tokens: accuracy at the outcome runs' mean total "
                     f"of {_k(budget)}k decode tokens, interpolated linearly between each run's "
                     "evaluated checkpoints (`interpolate_at`): the equal-tokens comparison.")
    lines += _equal_compute_table(summary)
    lines += _interval_table(summary)
    lines += _pairs_table(summary)
    if prm_report is not None and any(_uses_prm(r["arm"]) for r in rows):
        h = prm_report.get("held_out", {})
        extra = prm_report.get("sampled_tokens", 0) + prm_report.get("mc_generated_tokens", 0)
        lines.append(
            f"Learned PRM ({prm_report.get('output_dir', '?')}): trained once before the runs on "
            f"{prm_report.get('train_steps', '?')} labelled steps "
            f"({(prm_report.get('settings') or {}).get('labels', '?')} labels), "
            f"{_k(extra)}k generated tokens for its data and "
            f"{prm_report.get('data_seconds', 0) + prm_report.get('train_seconds', 0):.0f} s, "
            "not included above; held-out step accuracy "
            f"{_opt(h.get('accuracy'))} (majority baseline {_opt(h.get('majority_accuracy'))}).")
    text = "\n".join(lines) + "\n"
    Path(path).write_text(text)
    return text


def _aggregate(runs, key):
    """Per step over the seeds of one arm: (steps, mean tokens, mean seconds, mean, sd) of `key`.

    The points without a value (None / NaN) are left out.
    """
    steps = sorted({p["step"] for pts in runs for p in pts})
    xs, toks, secs, ms, ss = [], [], [], [], []
    for step in steps:
        at = [p for pts in runs for p in pts if p["step"] == step]
        m, s = mean_std([p.get(key) for p in at])
        if math.isnan(m):
            continue
        xs.append(step)
        toks.append(mean_std([p["tokens"] for p in at])[0])
        secs.append(mean_std([p.get("seconds") for p in at])[0])
        ms.append(m)
        ss.append(s)
    return xs, toks, secs, ms, ss


def plot_process_vs_outcome(curves, base, path, token_budget=None, seconds_budget=None):
    """2x3 figure: accuracy / step correctness against training step, generated tokens and
    training seconds (equal steps, equal tokens, equal seconds), mean +- sd over seeds."""
    start = {"step": 0, "tokens": 0.0, "seconds": 0.0, **base}
    fig = Figure(figsize=(17, 8.5))
    FigureCanvasAgg(fig)  # drawn without pyplot: leaves a notebook's backend alone
    axes = fig.subplots(2, 3)
    n_seeds = max((len(runs) for runs in curves.values()), default=0)
    for arm, runs in curves.items():
        pts = [[start, *p] for p in runs.values()]
        for row, key in ((0, "accuracy"), (1, "step_correctness")):
            steps, toks, secs, m, s = _aggregate(pts, key)
            for col, x in ((0, steps), (1, [t / 1000 for t in toks]), (2, secs)):
                keep = [i for i, v in enumerate(x) if not math.isnan(v)]
                xk = [x[i] for i in keep]
                lo = [m[i] - s[i] for i in keep]
                hi = [m[i] + s[i] for i in keep]
                ax = axes[row, col]
                ax.plot(xk, [m[i] for i in keep], marker="o", ms=3, color=ARMS[arm].color,
                        label=ARMS[arm].label)
                ax.fill_between(xk, lo, hi, color=ARMS[arm].color, alpha=0.15, linewidth=0)
    budgets = {1: (token_budget / 1000 if token_budget else None, " outcome's tokens"),
               2: (seconds_budget, " outcome's seconds")}
    for row, name in ((0, "held-out strict accuracy"), (1, "held-out step correctness")):
        for col, xlabel in ((0, "training step"),
                            (1, "decode tokens (k): rollouts + scorer continuations"),
                            (2, "training seconds (shared machine)")):
            ax = axes[row, col]
            ax.set_xlabel(xlabel)
            ax.set_ylabel(name)
            ax.grid(alpha=0.3)
            x, text = budgets.get(col, (None, ""))
            if x is not None:
                ax.axvline(x, color="tab:blue", ls=":", lw=1)
                if row == 0:
                    ax.text(x, 0.02, text, color="tab:blue", transform=ax.get_xaxis_transform(),
                            fontsize=8)
    axes[0, 0].legend(fontsize=8)
    fig.suptitle("GRPO on the tiny arithmetic world: outcome vs process supervision "
                 f"(mean ± sd over {n_seeds} seed{'s' if n_seeds != 1 else ''})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# The arms of the tuned comparison's figure (`plot_tuned_comparison`), in drawing order
TUNED_FIGURE_ARMS = ("outcome-tuned", "recommended-tuned", "placebo-tuned",
                     "recommended-local-tuned", "recommended-branch-tuned",
                     "placebo-branch-tuned")


def _stored_readings(row, summary, unit):
    """(x, y, x sd, y sd) of the readings a results.json row keeps on the `unit` axis
    ("tokens": decode, "forward_tokens"): the reading at the reference's mean total
    (`accuracy_at_budget` / `accuracy_at_forward_budget`) and the final model at the arm's own
    mean total, each mean with its sd over seeds."""
    budget = summary["token_budget" if unit == "tokens" else "forward_token_budget"]
    at = row.get("accuracy_at_budget" if unit == "tokens" else "accuracy_at_forward_budget")
    points = []
    if budget is not None and at is not None and at["mean"] is not None:
        points.append((budget, at["mean"], 0.0, at["sd"] or 0.0))
    total, final = row[unit], row["final_accuracy"]
    points.append((total["mean"], final["mean"], total["sd"] or 0.0, final["sd"] or 0.0))
    return sorted(points)


def plot_tuned_comparison(summaries, path, arms=TUNED_FIGURE_ARMS):
    """The tuned comparison from its stored summaries: accuracy against decode tokens and
    against forward tokens (columns), val and test (rows), mean over seeds with the seeds' sd
    as bands. `summaries`: {"val": [results.json summaries], "test": [...]} (an arm found in
    several is drawn from the first); each arm is drawn at the readings its rows keep
    (`_stored_readings`), joined by a dotted line (the checkpoints' curves are not in a
    summary); the reference arm's totals and the base model's accuracy are marked."""
    fig = Figure(figsize=(13, 9))
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 2)
    for r, split in enumerate(("val", "test")):
        found = {}
        for summary in summaries.get(split, []):
            for row in summary["rows"]:
                found.setdefault(row["arm"], (row, summary))
        for c, (unit, name) in enumerate((("tokens", "decode tokens (k)"),
                                          ("forward_tokens", "forward tokens (k)"))):
            ax = axes[r, c]
            for arm in (a for a in arms if a in found):
                row, summary = found[arm]
                pts = _stored_readings(row, summary, unit)
                color = ARMS[arm].color
                ax.plot([p[0] / 1000 for p in pts], [p[1] for p in pts], ls=":", marker="o",
                        ms=4, color=color, label=arm)
                for x, y, xs, ys in pts:
                    width = max(2 * xs, 0.01 * x) / 1000  # a band, however alike the seeds
                    ax.add_patch(Rectangle((x / 1000 - width / 2, y - ys), width, 2 * ys,
                                           color=color, alpha=0.2, lw=0))
            seeds = sorted({s for row, _ in found.values() for s in row["seeds"]})
            summary = next(iter(summaries.get(split, [])), None)
            if summary is not None:
                budget = summary["token_budget" if unit == "tokens" else "forward_token_budget"]
                ax.axvline(budget / 1000, color="grey", ls="--", lw=1)
                ax.axhline(summary["base"]["accuracy"], color="grey", ls=":", lw=1)
                ax.text(0.01, summary["base"]["accuracy"], " base model", fontsize=8,
                        color="grey", transform=ax.get_yaxis_transform(), va="bottom")
                ax.text(budget / 1000, 0.02, f" {summary['reference']}'s total", fontsize=8,
                        color="grey", transform=ax.get_xaxis_transform())
            ax.set_title(f"{split} split, seeds {seeds[0]}-{seeds[-1]}" if seeds else split)
            ax.set_xlabel(name)
            ax.set_ylabel("held-out strict accuracy")
            ax.grid(alpha=0.3)
    axes[1, 0].legend(fontsize=8, loc="lower right")
    fig.suptitle("tiny-arith-think, update sizes tuned on val: accuracy at the tuned outcome's "
                 "total and at the end, mean over seeds, bands: sd over seeds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def add_pairs_to_file(path):
    """Recompute every pairwise comparison (`summary_pairs`) of each results.json summary
    stored in the JSON file `path` (a docs/ file: {experiment: summary}) and write them in,
    keeping the file's one-space indent; returns the experiments updated."""
    data = json.loads(Path(path).read_text())
    done = []
    for name, summary in data.items():
        if isinstance(summary, dict) and "rows" in summary:
            summary["pairs"] = summary_pairs(summary)
            done.append(name)
    atomic_write_text(path, json.dumps(jsonable(data), indent=1, ensure_ascii=False) + "\n")
    return done


# ----------------------------------------------------------------------------------------------
# The whole experiment
# ----------------------------------------------------------------------------------------------


def run_experiment(settings: ExperimentSettings, config: GRPOConfig, arms, seeds):
    """Run (or reuse) every arm x seed, then write results.md, results.json and the figure.

    `config`: the GRPO settings shared by every arm (each arm sets its supervision, seed, output
    directory and checkpoints, `PER_RUN`); `arms`: names from `ARMS`; `seeds`: ints. Returns
    `summarise`'s summary.
    """
    args = settings
    values = {f.name: getattr(config, f.name) for f in fields(GRPOConfig) if f.name != "output_dir"}
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    device = get_device(args.device)
    base_model, tokenizer = load_pretrained(args.model, device=device, dtype=torch.float32)
    train, held_out = load_grpo_data("arith", args.train_examples, args.eval_split,
                                     config.eval_examples,
                                     args.train_level_weights)
    base = cached_base_figures(base_model, tokenizer, held_out, device, config,
                               {"model": args.model, "eval_split": args.eval_split}, out,
                               per_problem=True)
    print("base model: " + ", ".join(f"{k} {_opt(base[k])}" for k in METRICS))
    prm_path = prm_report = None
    if any(_uses_prm(arm) for arm in arms):
        prm_path, prm_report = _prepare_prm(args, config, base_model, tokenizer, device, out)
    curves = _run_arms(args, arms, seeds, values, prm_path, prm_report, base_model, tokenizer,
                      train, held_out, device, base)
    if not curves:
        raise SystemExit(f"no finished runs in {out}")
    record = {**asdict(settings), **values, "arms": list(arms), "seeds": list(seeds)}
    levels = _final_levels(curves, base_model, tokenizer, held_out, device, config, out)
    return _write_results(curves, base, out, prm_report, record,
                         f"{args.eval_split} split, {len(held_out)} problems", levels,
                         args.reference_arm)


def _final_levels(curves, base_model, tokenizer, held_out, device, config, out):
    """Per-level figures of the base model and of every run's final model (cached)."""
    base_file = out / f"base_{LEVEL_FILE}"
    key = {"problems": [ex["problem"] for ex in held_out[: config.eval_examples]],
           "eval_tokens": config.eval_tokens}
    cached = json.loads(base_file.read_text()) if base_file.is_file() else {}
    base = cached.get("figures") if cached.get("key") == key else None
    if base is None:
        base = level_figures(base_model, tokenizer, held_out, device, config)
        atomic_write_json(base_file, {"key": key, "figures": base})
    runs = {arm: [final_level_figures(out / f"{arm}-seed{seed}", tokenizer, held_out, device,
                                      config) for seed in seeds]
            for arm, seeds in curves.items()}
    return {"base": base, "runs": {arm: [f for f in fs if f] for arm, fs in runs.items()}}


def _train_in_worker(args, arm, seed, values, prm_path, prm_report, base):
    """One run (and its final level figures) in a worker process of `_train_in_parallel`."""
    torch.set_num_threads(1)  # one core per run: `jobs` runs fill `jobs` cores
    device = get_device(args.device)
    base_model, tokenizer = load_pretrained(args.model, device=device, dtype=torch.float32)
    train, held_out = load_grpo_data("arith", args.train_examples, args.eval_split,
                                     values["eval_examples"], args.train_level_weights)
    run_dir = Path(args.output_dir) / f"{arm}-seed{seed}"
    cfg = _run_config(arm, seed, values, args, prm_path, run_dir)
    _run_one(cfg, _run_settings(cfg, args, prm_report), base_model, tokenizer, train, held_out,
             device, base)
    final_level_figures(run_dir, tokenizer, held_out, device, cfg)
    return arm, seed


def _train_in_parallel(args, pairs, values, prm_path, prm_report, base):
    """Train the (arm, seed) runs `args.jobs` at a time in fresh processes (spawned, so no
    worker inherits a parent's threads or open files); each finished run lands in its own
    directory, which the sequential pass of `_run_arms` then reuses."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=args.jobs, mp_context=context) as pool:
        futures = [pool.submit(_train_in_worker, args, arm, seed, values, prm_path, prm_report,
                               base) for arm, seed in pairs]
        for future in futures:
            arm, seed = future.result()  # re-raises a worker's error here
            print(f"{arm} seed {seed}: trained in a worker")


def _run_arms(args, arms, seeds, values, prm_path, prm_report, base_model, tokenizer, train,
             held_out, device, base=None):
    """{arm: {seed: points}} of the finished runs, training the missing ones (not report_only;
    `args.jobs` > 1: in parallel worker processes first)."""
    out = Path(args.output_dir)
    curves = {arm: {} for arm in arms}
    if args.jobs > 1 and not args.report_only:
        todo = [(arm, seed) for seed in seeds for arm in arms
                if _load_curve(out / f"{arm}-seed{seed}") is None]
        _train_in_parallel(args, todo, values, prm_path, prm_report, base)
    for seed in seeds:  # seeds outer: a stopped experiment still has every arm for some seeds
        for arm in arms:
            run_dir = out / f"{arm}-seed{seed}"
            t0 = time.time()
            if args.report_only:
                curve = _load_curve(run_dir)
                if curve is None:
                    continue
            else:
                cfg = _run_config(arm, seed, values, args, prm_path, run_dir)
                settings = _run_settings(cfg, args, prm_report)
                curve = _run_one(cfg, settings, base_model, tokenizer, train, held_out, device,
                                base)
            curves[arm][seed] = curve["points"]
            last = curve["points"][-1]
            tokens = "n/a" if last["tokens"] is None else f"{_k(last['tokens'])}k"
            print(f"{arm} seed {seed}: accuracy {_opt(last['accuracy'])}, step correctness "
                  f"{_opt(last['step_correctness'])}, {tokens} generated tokens, train "
                  f"{last['seconds'] or 0:.0f}s ({time.time() - t0:.0f}s in this call)")
    return {arm: runs for arm, runs in curves.items() if runs}


def _write_results(curves, base, out, prm_report, record, held_out_name, levels=None,
                   reference="outcome"):
    """Summarise the curves into results.md, process_vs_outcome.png and results.json in `out`
    (with `levels`, `_final_levels`' figures, a table of the final models level by level);
    `reference`: `summarise`'s reference arm."""
    summary = summarise(curves, base, reference)
    if levels:
        add_level_differences(summary["pairs"], levels)
    table = write_table(summary, base, out / "results.md", prm_report, held_out_name)
    if levels:
        if reference not in levels["runs"]:
            reference = next(iter(levels["runs"]))
        lines = level_table(levels["runs"], LABELS, reference, levels["base"])
        table += "\n".join(["", *lines])
        (out / "results.md").write_text(table + "\n")
    plot_process_vs_outcome(curves, base, out / "process_vs_outcome.png",
                            summary["token_budget"], summary.get("seconds_budget"))
    # per-problem records stay in each run's curve.json: results.json keeps their intervals
    slim = {arm: {seed: [{k: v for k, v in p.items() if k != "per_problem"} for p in pts]
                  for seed, pts in runs.items()} for arm, runs in curves.items()}
    atomic_write_json(out / "results.json", jsonable({
        "base": {k: v for k, v in base.items() if k != "per_problem"}, **summary,
        "curves": slim, "prm": prm_report, "args": record, "levels": levels}))
    print(table)
    print(f"wrote {out / 'results.md'}, {out / 'results.json'}, {out / 'process_vs_outcome.png'}")
    return summary
