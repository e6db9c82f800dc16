"""Chapter 8 experiment: outcome vs process supervision (verifier, Monte-Carlo) in GRPO.

Trains the same base model with the same GRPO defaults and the same number of policy updates
three ways, for several seeds each:

- outcome: one reward per completion (chapter 7),
- process-verifier: step rewards from the exact arithmetic verifier, DeepSeekMath process
  advantages (arXiv 2402.03300, section 4.1.3),
- process-mc: step rewards from Math-Shepherd Monte-Carlo rollouts of the current policy
  (arXiv 2312.08935), which costs extra generation (counted, and visible in the wall-time plot).

Every arm uses the same GRPOConfig (the chapter 7 defaults unless flags change them), except
that the process arms keep the groups whose outcome rewards are all equal (the trainer's
`skip_zero_advantage` looks at outcome rewards only, and such groups still differ step by step;
`--process-skip-zero-advantage` restores the skipping). Note what each reward contains: the outcome
reward is correctness + format bonus, the verifier's step rewards check the arithmetic and (last
step) the boxed answer, without the format bonus; the "+outcome" arms add the outcome advantage to
every token (`process_advantages(variant="process+outcome")`).

Checkpoints are evaluated on the held-out split (greedy): strict (boxed) accuracy and mean step
correctness (the fraction of written "Step k:" lines the exact verifier accepts). Writes
results.json, results.md (table: final accuracy mean +- std, steps and seconds to reach the
outcome runs' final accuracy) and process_vs_outcome.png (accuracy and step correctness against
training step and against training wall time) into --output-dir.

Examples:
    python chapters/ch08_process_vs_outcome.py                     # the full experiment
    python chapters/ch08_process_vs_outcome.py --seeds 0 --steps 10 --arms outcome,verifier
"""

import argparse
import copy
import csv
import json
import math
import shutil
import sys
import time
from dataclasses import fields
from pathlib import Path

import torch

from reasoning_from_scratch.arithmetic import parse_steps, verify_steps
from reasoning_from_scratch.device import get_device
from reasoning_from_scratch.evaluation import evaluate
from reasoning_from_scratch.process import VARIANTS, make_process_advantage_fn
from reasoning_from_scratch.training import (
    GRPOConfig,
    add_config_arguments,
    load_grpo_data,
    train_grpo,
)
from reasoning_from_scratch.weights import load_pretrained

# arm -> (step scorer spec, process variant; None = --process-variant)
ARMS = {
    "outcome": (None, None), "verifier": ("verifier", None), "mc": ("mc", None),
    "verifier+outcome": ("verifier", "process+outcome"), "mc+outcome": ("mc", "process+outcome"),
}
LABELS = {
    "outcome": "outcome", "verifier": "process (verifier)", "mc": "process (MC)",
    "verifier+outcome": "process (verifier) + outcome", "mc+outcome": "process (MC) + outcome",
}


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="tiny-arith", help="base model for every run")
    p.add_argument("--arms", default="outcome,verifier,mc",
                   help="comma-separated runs: outcome, verifier (process), mc (process), "
                        "verifier+outcome, mc+outcome (process + outcome advantage)")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds, one run per arm each")
    p.add_argument("--eval-points", type=int, default=4,
                   help="evaluate this many evenly spaced checkpoints per run (+ the base model)")
    p.add_argument("--eval-split", default="test", help="held-out arithmetic split")
    p.add_argument("--process-variant", default="sum", choices=VARIANTS,
                   help="process advantage variant (process.process_advantages)")
    p.add_argument("--mc-rollouts", type=int, default=4,
                   help="Monte-Carlo continuations per step prefix (arm mc)")
    p.add_argument("--process-skip-zero-advantage", default=False,
                   action=argparse.BooleanOptionalAction,
                   help="skip groups with equal outcome rewards in the process runs too (they "
                        "can still differ step by step, so the default keeps them)")
    p.add_argument("--report-only", action="store_true",
                   help="train nothing: tabulate and plot the runs already finished")
    p.add_argument("--output-dir", default="runs/ch08-process-vs-outcome",
                   help="experiment directory")
    p.add_argument("--device", default=None, help="cuda, mps or cpu (None: the best available)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (1 is fastest for the tiny model on a busy machine)")
    defaults = GRPOConfig()
    add_config_arguments(p, defaults)
    return p


def step_correctness(texts, examples):
    """Fraction of written 'Step k:' lines the exact verifier accepts, over all completions."""
    good = total = 0
    for text, ex in zip(texts, examples):
        exprs = parse_steps(text)
        if exprs:
            verdicts = verify_steps(ex["problem"], exprs)
            good += sum(verdicts)
            total += len(verdicts)
    return good / total if total else float("nan")


def evaluate_model(model, tokenizer, examples, device, config):
    """Greedy held-out strict accuracy and mean step correctness."""
    res = evaluate(model, tokenizer, examples, device,
                   max_new_tokens=config.eval_max_new_tokens or config.max_new_tokens,
                   batch_size=config.eval_batch_size, progress=False)
    texts = [r["generated_text"] for r in res["records"]]
    return {"accuracy": res["accuracy"], "step_correct": step_correctness(texts, examples),
            "format_rate": res["format_rate"]}


def cumulative_seconds(metrics_csv):
    """Training wall time (rollouts + scoring + updates, evaluation excluded) after each step."""
    with open(metrics_csv, newline="") as f:
        rows = list(csv.DictReader(f))
    out, total = {0: 0.0}, 0.0
    for r in rows:
        total += float(r["step_time"] or 0.0)
        out[int(r["step"])] = total
    return out


def run_one(arm, seed, base_model, tokenizer, train, held_out, device, values, args, out_dir):
    """Train one run, evaluate its checkpoints; returns the curve [(step, seconds, metrics)]."""
    run_dir = out_dir / f"{arm}-seed{seed}"
    if (run_dir / "curve.json").is_file():  # finished earlier: reuse (resumable experiment)
        return json.loads((run_dir / "curve.json").read_text())
    if run_dir.exists():
        shutil.rmtree(run_dir)
    every = max(1, values["steps"] // max(1, args.eval_points))
    config = GRPOConfig.from_dict({
        **values, "seed": seed, "output_dir": str(run_dir), "eval_every": 0,
        "checkpoint_every": every, "supervision": "outcome" if arm == "outcome" else "process",
    })
    if arm != "outcome":
        # The trainer's skip_zero_advantage drops groups whose *outcome* rewards are all equal,
        # before step rewards are seen; such groups still carry step-level signal.
        config.skip_zero_advantage = args.process_skip_zero_advantage
    model = copy.deepcopy(base_model)
    adv_fn = None
    if arm != "outcome":
        spec, variant = ARMS[arm]
        adv_fn = make_process_advantage_fn(
            tokenizer, spec, variant or args.process_variant, model=model, device=device,
            mc_rollouts=args.mc_rollouts, mc_max_new_tokens=config.max_new_tokens,
            mc_temperature=config.temperature)
    t0 = time.time()
    summary = train_grpo(model, tokenizer, train, held_out, device, config, advantage_fn=adv_fn)
    seconds = cumulative_seconds(run_dir / "metrics.csv")
    curve = []
    for step in range(every, config.steps, every):
        ckpt = run_dir / f"checkpoint-{step}"
        m, _ = load_pretrained(ckpt, device=device, dtype=torch.float32)
        curve.append([step, seconds.get(step, float("nan")),
                      evaluate_model(m, tokenizer, held_out, device, config)])
        shutil.rmtree(ckpt)  # keep the disk small; the final model stays in final/
    shutil.rmtree(run_dir / f"checkpoint-{config.steps}", ignore_errors=True)
    curve.append([config.steps, seconds[config.steps],
                  evaluate_model(model, tokenizer, held_out, device, config)])
    extra = {"summary": summary, "run_seconds": time.time() - t0}
    if adv_fn is not None:
        extra["scorer_cost"] = adv_fn.step_scorer.cost()
    (run_dir / "curve.json").write_text(json.dumps(curve))
    (run_dir / "run_info.json").write_text(json.dumps(extra, indent=2))
    return curve


def mean_std(xs):
    xs = [x for x in xs if not math.isnan(x)]
    if not xs:
        return float("nan"), float("nan")
    m = sum(xs) / len(xs)
    s = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    return m, s


def first_reaching(curve, target, index):
    """Step (index 0) or seconds (index 1) of the first evaluation with accuracy >= target."""
    for point in curve:
        if point[2]["accuracy"] >= target - 1e-9:
            return point[index]
    return None


def summarise(curves, base):
    """The table rows: per arm, final accuracy / step correctness mean +- std, time to target."""
    finals = {arm: [c[-1][2]["accuracy"] for c in runs.values()] for arm, runs in curves.items()}
    target = mean_std(finals["outcome"])[0] if finals.get("outcome") else None
    rows = []
    for arm, runs in curves.items():
        acc = mean_std([c[-1][2]["accuracy"] for c in runs.values()])
        sc = mean_std([c[-1][2]["step_correct"] for c in runs.values()])
        secs = mean_std([c[-1][1] for c in runs.values()])
        row = {"arm": arm, "seeds": len(runs), "final_accuracy": acc, "final_step_correct": sc,
               "train_seconds": secs, "target": target}
        if target is not None:
            full = {s: [[0, 0.0, base], *c] for s, c in runs.items()}
            row["steps_to_target"] = [first_reaching(c, target, 0) for c in full.values()]
            row["seconds_to_target"] = [first_reaching(c, target, 1) for c in full.values()]
        rows.append(row)
    return rows


def _fmt_reach(values):
    reached = [v for v in values if v is not None]
    if not reached:
        return "not reached"
    m = sum(reached) / len(reached)
    return f"{m:.0f} ({len(reached)}/{len(values)} runs)"


def write_table(rows, base, path):
    """results.md: the table for the README."""
    lines = [
        f"Base model: held-out accuracy {base['accuracy']:.3f}, step correctness "
        f"{base['step_correct']:.3f}.",
        "",
        "| supervision | seeds | final accuracy | final step correctness | train s | "
        "steps to outcome's final acc. | seconds to it |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        (a, sa), (c, sc), (t, _) = r["final_accuracy"], r["final_step_correct"], r["train_seconds"]
        lines.append(
            f"| {LABELS[r['arm']]} | {r['seeds']} | {a:.3f} ± {sa:.3f} | {c:.3f} ± {sc:.3f} | "
            f"{t:.0f} | {_fmt_reach(r.get('steps_to_target', []))} | "
            f"{_fmt_reach(r.get('seconds_to_target', []))} |")
    if rows and rows[0].get("target") is not None:
        lines += ["", f"Target = mean final accuracy of the outcome runs ({rows[0]['target']:.3f});"
                  " checked at the evaluated checkpoints only."]
    Path(path).write_text("\n".join(lines) + "\n")
    return "\n".join(lines)


def plot(curves, base, path):
    """2x2 figure: accuracy / step correctness against step and against training seconds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    colors = {"outcome": "tab:blue", "verifier": "tab:green", "mc": "tab:red",
              "verifier+outcome": "tab:olive", "mc+outcome": "tab:purple"}
    for arm, runs in curves.items():
        for n, curve in enumerate(runs.values()):
            pts = [[0, 0.0, base], *curve]
            for col, xi in ((0, 0), (1, 1)):
                for row, key in ((0, "accuracy"), (1, "step_correct")):
                    axes[row, col].plot([p[xi] for p in pts], [p[2][key] for p in pts],
                                        marker="o", ms=3, color=colors.get(arm), alpha=0.8,
                                        label=LABELS[arm] if n == 0 else None)
    lowest = min([base["step_correct"]] + [p[2]["step_correct"] for runs in curves.values()
                                            for c in runs.values() for p in c])
    for row, name in ((0, "held-out strict accuracy"), (1, "held-out step correctness")):
        for col, xlabel in ((0, "training step"), (1, "training wall time (s)")):
            ax = axes[row, col]
            ax.set_xlabel(xlabel)
            ax.set_ylabel(name)
            ax.grid(alpha=0.3)
            if row == 1 and not math.isnan(lowest):  # a flat line at 1.0 should look flat
                ax.set_ylim(min(0.9, lowest - 0.01), 1.005)
    axes[0, 0].legend()
    fig.suptitle("GRPO on the tiny arithmetic world: outcome vs process supervision "
                 "(one line per seed)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    values = {f.name: getattr(args, f.name) for f in fields(GRPOConfig) if f.name != "output_dir"}
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    for a in arms:
        if a not in ARMS:
            raise SystemExit(f"unknown arm {a!r}; expected some of {list(ARMS)}")
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    device = get_device(args.device)
    base_model, tokenizer = load_pretrained(args.model, device=device, dtype=torch.float32)
    config = GRPOConfig.from_dict(values)
    train, held_out = load_grpo_data("arith", None, args.eval_split, config.eval_examples)
    base_file = out / "base.json"
    if base_file.is_file():
        base = json.loads(base_file.read_text())
    else:
        base = evaluate_model(base_model, tokenizer, held_out, device, config)
        base_file.write_text(json.dumps(base))
    print(f"base: {base}")
    curves = {arm: {} for arm in arms}
    for seed in seeds:  # seeds outer: a stopped experiment still has every arm for some seeds
        for arm in arms:
            if args.report_only and not (out / f"{arm}-seed{seed}" / "curve.json").is_file():
                continue
            t0, reused = time.time(), (out / f"{arm}-seed{seed}" / "curve.json").is_file()
            curves[arm][seed] = run_one(arm, seed, base_model, tokenizer, train, held_out,
                                        device, values, args, out)
            last = curves[arm][seed][-1]
            print(f"{arm} seed {seed}: final accuracy {last[2]['accuracy']:.3f}, step correctness "
                  f"{last[2]['step_correct']:.3f}, train {last[1]:.0f}s "
                  + ("(finished earlier)" if reused else
                     f"({time.time() - t0:.0f}s with evaluation)"))
    curves = {arm: runs for arm, runs in curves.items() if runs}
    rows = summarise(curves, base)
    table = write_table(rows, base, out / "results.md")
    plot(curves, base, out / "process_vs_outcome.png")
    (out / "results.json").write_text(json.dumps({"base": base, "rows": rows, "curves": curves,
                                                   "args": vars(args)}, indent=2))
    print(table)
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
