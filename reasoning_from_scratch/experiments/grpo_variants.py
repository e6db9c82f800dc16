"""Chapter 7's lessons measured side by side: GRPO variants on one task at equal rollouts.

Every arm trains the same base model with the same shared GRPOConfig (the comparison's budget:
`COMPARISON_DEFAULTS`, smaller than the chapter 7 default run so that 12 arms x 3 seeds fit in
about an hour on 2 CPU cores) and the same rollouts per step; an arm changes only what its
`ARMS` entry says. Two blocks:

- one update per batch (the chapter 7 default: the ratio is exactly 1, so clipping never acts):
  the chapter 6 recipe, the chapter 7 default (loss grpo), the loss aggregations dapo and
  dr_grpo (length bias, DAPO section 3.3, Dr. GRPO section 3.1), no format reward, and the KL
  term at beta 0.04 as per-token k3 vs the book's sequence-level log-ratio;
- four updates per batch (PPO-style inner epochs, the ratio leaves 1 and clipping matters):
  clipping at 0.2, no clipping, clip-higher (0.2 / 0.28, DAPO), gspo (3e-4 / 4e-4, the GSPO
  paper's ranges), cispo (the IS weight capped at 1.28, MiniMax-M1).

Per run: final held-out accuracy and accuracy among think-format answers (greedy, `evaluate`),
mean token entropy over the last 10 steps, mean length of wrong and of right training rollouts
over the last 20% of steps (samples.jsonl; length bias), clip fraction (low + high, mean over
steps), mean KL over the last 10 steps, training seconds (the trainer's step times). The table
(`write_comparison_table`) has mean +- sd over seeds; `plot_comparison` draws accuracy and
entropy per arm.
Runs are resumable and reused like chapter 8's (`stats.resume_point`).
"""

from __future__ import annotations

import copy
import json
import math
import shutil
from dataclasses import asdict
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from ..files import atomic_write_json
from ..run_log import read_metrics
from ..training import CHAPTER6_RECIPE, GRPOConfig, train_grpo
from .stats import (
    SETTINGS_FILE,
    cached_base_figures,
    format_pm,
    format_value,
    jsonable,
    mean_std,
    refuse_other_settings,
    resume_point,
    stat,
)

# The shared settings of every arm (GRPOConfig overrides): 60 steps x 8 prompts x 8 rollouts.
COMPARISON_DEFAULTS = dict(steps=60, prompts_per_step=8, num_rollouts=8, eval_every=0,
                           eval_examples=200, sample_every=5, checkpoint_every=0)

INNER = 4  # updates per batch in the off-policy block
# arm -> (label, GRPOConfig overrides on top of the shared settings)
ARMS = {
    "ch06": ("chapter 6 recipe (sequence loss, no clip, no KL, correctness only)",
             CHAPTER6_RECIPE),
    "grpo": ("chapter 7 default (grpo loss)", {}),
    "dapo": ("dapo loss (token mean over the batch)", {"loss_type": "dapo"}),
    "dr_grpo": ("dr_grpo loss + no std scaling", {"loss_type": "dr_grpo", "scale_rewards": "none"}),
    "no_format": ("no format reward", {"format_reward_weight": 0.0}),
    "kl_k3": ("KL beta 0.04, per-token k3", {"beta": 0.04}),
    "kl_sequence": ("KL beta 0.04, the book's sequence-level", {"beta": 0.04,
                                                                "kl_estimator": "sequence"}),
    "clip": (f"{INNER} inner epochs, clip 0.2", {"inner_epochs": INNER}),
    "no_clip": (f"{INNER} inner epochs, no clipping", {"inner_epochs": INNER, "epsilon": None}),
    "clip_higher": (f"{INNER} inner epochs, clip-higher 0.2 / 0.28",
                    {"inner_epochs": INNER, "epsilon_high": 0.28}),
    "gspo": (f"{INNER} inner epochs, gspo 3e-4 / 4e-4",
             {"inner_epochs": INNER, "loss_type": "gspo", "epsilon": 3e-4, "epsilon_high": 4e-4}),
    "cispo": (f"{INNER} inner epochs, cispo (weight cap 1.28)",
              {"inner_epochs": INNER, "loss_type": "cispo", "epsilon_high": 0.28}),
    "dynamic": ("grpo + DAPO dynamic sampling (more rollouts)", {"dynamic_sampling": True}),
}
DEFAULT_ARMS = ",".join(a for a in ARMS if a != "dynamic")
# what a run's settings may differ in without changing its result
COSMETIC = ("output_dir", "progress", "eval_batch_size", "report_to", "checkpoint_minutes",
            "keep_checkpoints", "stop_signals")


def _run_config(arm, seed, shared: dict, run_dir) -> GRPOConfig:
    """One run's GRPOConfig: the shared values, the arm's overrides, the seed."""
    return GRPOConfig.from_dict({**shared, **ARMS[arm][1], "seed": seed,
                                 "output_dir": str(run_dir)})


def _run_settings(config: GRPOConfig, data: dict) -> dict:
    """What decides a run's result (a finished run is reused only if these match)."""
    s = {k: v for k, v in asdict(config).items() if k not in COSMETIC}
    return json.loads(json.dumps({**s, **data}))



def _run_figures(run_dir: Path, config: GRPOConfig, summary: dict) -> dict:
    """The table's figures of one finished run, from summary.json, metrics.csv, samples.jsonl."""
    rows = read_metrics(run_dir / "metrics.csv")
    last = rows[-10:]
    late = config.steps - max(1, config.steps // 5)  # the last 20% of steps
    samples = [json.loads(ln) for ln in (run_dir / "samples.jsonl").read_text().splitlines()]
    samples = [s for s in samples if s["step"] > late]

    def mean(xs):
        return mean_std(xs)[0]

    return {
        "accuracy": summary["final_accuracy"],
        "think_accuracy": summary["final_think_accuracy"],
        "step_correctness": summary["final_step_correctness"],
        "entropy": mean([r["entropy"] for r in last]),
        "wrong_length": mean([s["length"] for s in samples if not s.get("correct")]),
        "right_length": mean([s["length"] for s in samples if s.get("correct")]),
        "clip_frac": mean([(r["clip_frac_low"] or 0) + (r["clip_frac_high"] or 0)
                           for r in rows if r["clip_frac_low"] is not None]),
        "kl": mean([r["kl"] for r in last]),
        "train_seconds": sum(r["step_time"] or 0 for r in rows),
    }


def _run_one(arm, seed, shared, data, model, tokenizer, train, held_out, device, base, out):
    """Train (or reuse, or resume) one arm x seed; returns its figures."""
    run_dir = out / f"{arm}-seed{seed}"
    config = _run_config(arm, seed, shared, run_dir)
    settings = _run_settings(config, data)
    done = run_dir / "figures.json"
    if done.is_file():
        saved = json.loads(done.read_text())
        refuse_other_settings(run_dir, saved["settings"], settings)
        return saved["figures"]
    resume = resume_point(run_dir, settings)
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(run_dir / SETTINGS_FILE, settings)
    summary = train_grpo(copy.deepcopy(model), tokenizer, train, held_out, device, config,
                         resume_from=resume, base_evaluation=base)
    figures = _run_figures(run_dir, config, summary)
    for ckpt in [run_dir / "final", run_dir / "reference"]:  # keep the disk small
        if ckpt.is_dir():
            shutil.rmtree(ckpt)
    atomic_write_json(done, jsonable({"settings": settings, "figures": figures}))
    return figures


FIGURES = ("accuracy", "think_accuracy", "step_correctness", "entropy", "wrong_length",
           "right_length", "clip_frac", "kl", "train_seconds")


def summarise_comparison(results: dict) -> list[dict]:
    """Table rows: {arm, label, seeds, <figure>: {"mean", "sd"}} from {arm: {seed: figures}}."""
    return [{"arm": arm, "label": ARMS[arm][0], "seeds": sorted(runs),
             **{k: stat([f[k] for f in runs.values()]) for k in FIGURES}}
            for arm, runs in results.items() if runs]


def write_comparison_table(rows, base, path, note="") -> str:
    """results.md: the comparison table (mean ± sd over seeds) with its definitions."""
    lines = [
        "| arm | seeds | accuracy | think acc. | entropy (end) | wrong len | right len | "
        "clip frac | KL (end) | train s |",
        "|---|---|---|---|---|---|---|---|---|---|",
        f"| base model | - | {format_value(base['accuracy'])} | "
        f"{format_value(base['think_accuracy'])} | - | - | - | - | - | - |",
    ]
    for r in rows:
        lines.append(
            f"| {r['label']} | {len(r['seeds'])} | {format_pm(r['accuracy'])} | "
            f"{format_pm(r['think_accuracy'])} | {format_pm(r['entropy'], 2)} | "
            f"{format_pm(r['wrong_length'], 0)} | {format_pm(r['right_length'], 0)} | "
            f"{format_pm(r['clip_frac'], 3)} | {format_pm(r['kl'], 3)} | "
            f"{format_pm(r['train_seconds'], 0)} |")
    text = "\n".join(lines) + "\n\n" + note
    Path(path).write_text(text)
    return text


def plot_comparison(rows, base, path):
    """Final accuracy and end-of-run entropy per arm (mean ± sd over seeds), base as a line."""
    fig = Figure(figsize=(11, 0.45 * len(rows) + 1.6))
    FigureCanvasAgg(fig)
    ax_acc, ax_ent = fig.subplots(1, 2, sharey=True, gridspec_kw={"width_ratios": [3, 2]})
    labels = [r["label"] for r in rows][::-1]
    ys = range(len(rows))
    for ax, key, title in ((ax_acc, "accuracy", "held-out accuracy (greedy, strict)"),
                           (ax_ent, "entropy", "token entropy, last 10 steps")):
        means = [r[key]["mean"] for r in rows][::-1]
        sds = [0 if math.isnan(r[key]["sd"]) else r[key]["sd"] for r in rows][::-1]
        ax.barh(list(ys), means, xerr=sds, color="tab:blue", alpha=0.75, capsize=3)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="x", alpha=0.3)
    ax_acc.axvline(base["accuracy"], color="gray", ls="--", label="base model")
    ax_acc.legend(loc="lower right", fontsize=8)
    ax_acc.set_yticks(list(ys))
    ax_acc.set_yticklabels(labels, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=150)


def run_comparison(model, tokenizer, train, held_out, device, shared: dict, data: dict,
                   arms, seeds, out, report_only=False, log=print) -> dict:
    """Run (or reuse) every arm x seed, then write results.md, results.json and the figure.

    shared: GRPOConfig values every arm starts from; data: what else decides a result (model
    name, data flags), stored with each run's settings. Seeds are the outer loop, so a stopped
    experiment has every arm for the seeds it finished.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = GRPOConfig.from_dict(shared)
    base = cached_base_figures(model, tokenizer, held_out, device, config, data, out)
    log(f"base model: accuracy {format_value(base['accuracy'])}, think accuracy "
        f"{format_value(base['think_accuracy'])}")
    results = {arm: {} for arm in arms}
    for seed in seeds:
        for arm in arms:
            if report_only:
                done = out / f"{arm}-seed{seed}" / "figures.json"
                if done.is_file():
                    results[arm][seed] = json.loads(done.read_text())["figures"]
                continue
            f = _run_one(arm, seed, shared, data, model, tokenizer, train, held_out, device, base,
                        out)
            results[arm][seed] = f
            log(f"{arm} seed {seed}: accuracy {format_value(f['accuracy'])}, think accuracy "
                f"{format_value(f['think_accuracy'])}, entropy {format_value(f['entropy'])}, "
                f"{f['train_seconds']:.0f}s")
    rows = summarise_comparison(results)
    if not rows:
        raise SystemExit(f"no finished runs in {out}")
    note = (f"{shared['steps']} steps x {shared['prompts_per_step']} prompts x "
            f"{shared['num_rollouts']} rollouts per run; held-out: {len(held_out)} problems.")
    table = write_comparison_table(rows, base, out / "results.md", note)
    plot_comparison(rows, base, out / "grpo_variants.png")
    atomic_write_json(out / "results.json", jsonable({"base": base, "rows": rows,
                                                      "runs": results, "shared": shared,
                                                      "data": data}))
    log(table)
    return {"base": base, "rows": rows}
