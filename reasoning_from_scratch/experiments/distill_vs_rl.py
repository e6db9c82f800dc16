"""Chapter 9's experiment: improve one student by distillation or by GRPO, at equal wall-clock.

DeepSeek-R1 (section 4.1, "Distillation v.s. Reinforcement Learning") found that for a small
model, fine-tuning on a strong teacher's solutions beat large-scale RL on the small model
itself. Here both arms start from the same student (the bundled base model) on the same task:

- distill: the teacher (the chapter 7 GRPO-trained model) samples 4 solutions to each of 2000
  training problems, the verified ones are kept (`generate_distillation_data`), the student is
  fine-tuned on them (`train_distillation`). Its cost = sampling seconds + SFT seconds;
- self_distill: the same with the student as its own teacher (rejection-sampling fine-tuning,
  as in STaR / RFT): what the verifier alone buys, without a stronger model's solutions;
- grpo: the chapter 7 recipe on the student itself (`train_grpo`), evaluated every few steps.
  Its cost = the trainer's step times (rollouts + updates).

Evaluations are not counted in either cost. Each run gives a curve of held-out accuracy against
seconds; the comparison reads GRPO's curve at the distillation run's total cost ("equal
wall-clock"). The teacher's own training (chapter 7's default run) is not charged to the
distillation arm, as R1 did not charge its 671B teacher: the question is what a given budget
buys the *student*. Runs are reused when finished and resumed when interrupted
(`stats.resume_point`).
"""

from __future__ import annotations

import copy
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from ..distillation import generate_distillation_data, read_traces, write_traces
from ..distillation_training import DistillConfig, train_distillation
from ..evaluation import evaluate_policy
from ..files import atomic_write_json, read_json
from ..run_log import read_metrics
from ..training import GRPOConfig, train_grpo
from ..weights import load_pretrained
from .stats import (
    SETTINGS_FILE,
    format_pm,
    format_value,
    jsonable,
    refuse_other_settings,
    resume_point,
    stat,
)

EXPERIMENT_ARMS = ("distill", "self_distill", "grpo")
# The experiment's settings (the chapter 9 script's defaults): what decides a run's result.
EXPERIMENT_DEFAULTS = dict(
    train_examples=2000, num_samples=4, max_per_problem=4, check_steps=True,
    teacher_temperature=1.0, max_new_tokens=112,
    distill_steps=300, distill_eval_every=50,
    grpo_steps=150, grpo_eval_every=10,
    eval_examples=200,
)


def distill_config(settings: dict, seed: int, run_dir) -> DistillConfig:
    """The distillation arm's DistillConfig (defaults but for steps, evaluation and seed)."""
    return DistillConfig(steps=settings["distill_steps"], eval_every=settings["distill_eval_every"],
                         eval_examples=settings["eval_examples"],
                         eval_max_new_tokens=settings["max_new_tokens"], seed=seed,
                         output_dir=str(run_dir), progress=False)


def grpo_config(settings: dict, seed: int, run_dir) -> GRPOConfig:
    """The GRPO arm's GRPOConfig: the chapter 7 recipe, shorter, evaluated more often."""
    return GRPOConfig(steps=settings["grpo_steps"], eval_every=settings["grpo_eval_every"],
                      eval_examples=settings["eval_examples"],
                      max_new_tokens=settings["max_new_tokens"], sample_every=0, seed=seed,
                      output_dir=str(run_dir), progress=False)


def _curve_distill(run_dir: Path, gen_seconds: float, base_acc: float) -> list[list[float]]:
    """[seconds, accuracy] points: nothing changes while the teacher samples, then SFT."""
    rows = read_metrics(run_dir / "metrics.csv")
    return [[0.0, base_acc], [gen_seconds, base_acc]] + [
        [gen_seconds + r["train_s"], r["eval_accuracy"]] for r in rows
        if r["eval_accuracy"] is not None]


def _curve_grpo(run_dir: Path, base_acc: float) -> list[list[float]]:
    """[seconds, accuracy] points of a GRPO run (seconds = summed step times)."""
    points, seconds = [[0.0, base_acc]], 0.0
    for r in read_metrics(run_dir / "metrics.csv"):
        seconds += r["step_time"] or 0.0
        if r["eval_accuracy"] is not None:
            points.append([seconds, r["eval_accuracy"]])
    return points


def accuracy_at(curve, seconds: float) -> float:
    """The accuracy of the last evaluated model that cost at most `seconds` (a step function:
    the model you would hold had you stopped the run then)."""
    return [acc for s, acc in curve if s <= seconds + 1e-9][-1]


def _figures(arm, summary, curve, extra=None) -> dict:
    """What the table and figure need from one finished run."""
    return {"accuracy": summary["final_accuracy"], "seconds": curve[-1][0],
            "step_correctness": summary["final_step_correctness"],
            "format_rate": summary["final_format_rate"], "curve": curve, **(extra or {})}


def _done(run_dir: Path, settings: dict):
    """A finished run's figures if run with `settings`; None if unfinished; exits on a clash."""
    done = run_dir / "figures.json"
    if not done.is_file():
        return None
    saved = read_json(done)
    refuse_other_settings(run_dir, saved["settings"], settings, defaults={})  # not GRPO's
    return saved["figures"]


def _begin(run_dir: Path, settings: dict):
    """(figures, None) for a run finished with `settings`; else (None, the checkpoint to resume
    from or None) with the run directory prepared and its settings written."""
    figures = _done(run_dir, settings)
    if figures is not None:
        return figures, None
    resume = resume_point(run_dir, settings)
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(run_dir / SETTINGS_FILE, settings)
    return None, resume


def _finish(run_dir: Path, settings: dict, figures: dict) -> dict:
    """Write figures.json (the run is done) and return the figures."""
    atomic_write_json(run_dir / "figures.json", jsonable({"settings": settings,
                                                          "figures": figures}))
    return figures


def run_distill_arm(arm, seed, settings, teacher_source, student, tokenizer, train, held_out,
                    device, base, out) -> dict:
    """Sample and verify teacher traces, then fine-tune a copy of the student; its figures.
    (arm "self_distill" passes the student's own source as the teacher.)"""
    run_dir = out / f"{arm}-seed{seed}"
    run_settings = jsonable({**settings, "arm": arm, "seed": seed, "teacher": teacher_source})
    figures, resume = _begin(run_dir, run_settings)
    if figures is not None:
        return figures
    if (run_dir / "generation.json").is_file():  # sampled before an interruption
        records, stats = read_traces(run_dir / "traces.jsonl"), read_json(
            run_dir / "generation.json")
    else:
        teacher, teacher_tok = load_pretrained(teacher_source, device=device)
        records, stats = generate_distillation_data(
            teacher, teacher_tok, train[:settings["train_examples"]],
            num_samples=settings["num_samples"], max_per_problem=settings["max_per_problem"],
            temperature=settings["teacher_temperature"], max_new_tokens=settings["max_new_tokens"],
            check_steps=settings["check_steps"], seed=seed, teacher_name=teacher_source,
            progress=False)
        if not records:  # nothing written: a rerun samples again
            raise SystemExit(f"error: {arm}, seed {seed}: the teacher {teacher_source} gave no "
                             f"verified trace in {stats['samples']} samples of "
                             f"{stats['problems']} problems; raise --num-samples or "
                             "--train-examples, or pass --no-check-steps")
        write_traces(records, run_dir / "traces.jsonl")
        atomic_write_json(run_dir / "generation.json", stats)  # last: marks the traces complete
    summary = train_distillation(copy.deepcopy(student), tokenizer, records, held_out, device,
                                 distill_config(settings, seed, run_dir), resume_from=resume,
                                 base_evaluation=base)
    curve = _curve_distill(run_dir, stats["seconds"], base["accuracy"])
    return _finish(run_dir, run_settings, _figures(arm, summary, curve, {
        "gen_seconds": stats["seconds"], "traces": stats["kept"],
        "sft_seconds": summary["train_seconds"]}))


def run_grpo_arm(seed, settings, student, tokenizer, train, held_out, device, base, out) -> dict:
    """Train a copy of the student with the chapter 7 recipe; its figures."""
    run_dir = out / f"grpo-seed{seed}"
    run_settings = jsonable({**settings, "arm": "grpo", "seed": seed})
    figures, resume = _begin(run_dir, run_settings)
    if figures is not None:
        return figures
    summary = train_grpo(copy.deepcopy(student), tokenizer, train, held_out, device,
                         grpo_config(settings, seed, run_dir), resume_from=resume,
                         base_evaluation=base)
    return _finish(run_dir, run_settings,
                   _figures("grpo", summary, _curve_grpo(run_dir, base["accuracy"])))


def summarise_distill_vs_rl(results: dict) -> dict:
    """Per seed, GRPO read at the distillation run's cost; mean +- sd of every figure."""
    seeds = sorted(set(results.get("distill", {})) & set(results.get("grpo", {})))
    distill, grpo = results.get("distill", {}), results.get("grpo", {})
    equal = {s: accuracy_at(grpo[s]["curve"], distill[s]["seconds"]) for s in seeds}
    keys = ("accuracy", "seconds", "gen_seconds", "sft_seconds", "traces", "step_correctness",
            "format_rate")
    return {
        "seeds": seeds,
        "distill": {k: stat([f[k] for f in distill.values()]) for k in keys},
        "self_distill": {k: stat([f[k] for f in results.get("self_distill", {}).values()])
                         for k in keys},
        "self_distill_seeds": sorted(results.get("self_distill", {})),
        "grpo_equal_time": {"accuracy": stat(list(equal.values())),
                            "seconds": stat([distill[s]["seconds"] for s in seeds])},
        "grpo_full": {k: stat([f[k] for f in grpo.values()])
                      for k in ("accuracy", "seconds", "step_correctness", "format_rate")},
    }


def write_distill_table(summary: dict, base: dict, teacher: dict, settings: dict, path) -> str:
    """results.md: the comparison table (mean ± sd over seeds) and what each row means."""
    d, eq, g = summary["distill"], summary["grpo_equal_time"], summary["grpo_full"]
    sd = summary["self_distill"]
    n = len(summary["seeds"])
    lines = [
        "| student trained by | seeds | cost (s) | held-out accuracy | step correctness |",
        "|---|---|---|---|---|",
        f"| nothing (base model) | - | 0 | {format_value(base['accuracy'])} | "
        f"{format_value(base['step_correctness'])} |",
        f"| **distillation** (teacher samples + SFT) | {n} | {format_pm(d['seconds'], 0)} | "
        f"**{format_pm(d['accuracy'])}** | {format_pm(d['step_correctness'])} |",
        *([f"| self-distillation (its own verified samples + SFT) | "
           f"{len(summary['self_distill_seeds'])} | {format_pm(sd['seconds'], 0)} | "
           f"{format_pm(sd['accuracy'])} | {format_pm(sd['step_correctness'])} |"]
          if summary["self_distill_seeds"] else []),
        f"| GRPO, same wall-clock as distillation | {n} | {format_pm(eq['seconds'], 0)} | "
        f"{format_pm(eq['accuracy'])} | - |",
        f"| GRPO, {settings['grpo_steps']} steps | {n} | {format_pm(g['seconds'], 0)} | "
        f"{format_pm(g['accuracy'])} | {format_pm(g['step_correctness'])} |",
    ]
    if teacher:
        lines.append(f"| (teacher: GRPO, chapter 7 default run) | 1 | "
                     f"{format_value(teacher.get('seconds'), 0)} | "
                     f"{format_value(teacher['accuracy'])} | "
                     f"{format_value(teacher.get('step_correctness'))} |")
    note = (f"Cost: distillation = teacher sampling ({format_pm(d['gen_seconds'], 0)} s for "
            f"{settings['train_examples']} problems x {settings['num_samples']} samples, "
            f"{format_pm(d['traces'], 0)} verified traces kept) + SFT "
            f"({format_pm(d['sft_seconds'], 0)} s, {settings['distill_steps']} updates); GRPO = "
            "summed step times; evaluations excluded. 'Same wall-clock' reads each seed's GRPO "
            "run at its last evaluation (every "
            f"{settings['grpo_eval_every']} steps) within that seed's distillation cost. "
            f"Held-out: {settings['eval_examples']} test problems, greedy, strict (boxed) answers.")
    text = "\n".join(lines) + "\n\n" + note + "\n"
    Path(path).write_text(text)
    return text


def plot_distill_vs_rl(results: dict, base: dict, teacher: dict, path):
    """Held-out accuracy against seconds of training: every run, distillation and GRPO."""
    fig = Figure(figsize=(7.5, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    colors = {"distill": "tab:orange", "self_distill": "tab:purple", "grpo": "tab:blue"}
    names = {"distill": "distillation (teacher samples, then SFT)",
             "self_distill": "self-distillation (its own verified samples, then SFT)",
             "grpo": "GRPO on the student (chapter 7 recipe)"}
    for arm, runs in results.items():
        for i, f in enumerate(runs[s] for s in sorted(runs)):
            xs, ys = zip(*f["curve"])
            ax.plot(xs, ys, marker="o", ms=3, color=colors[arm], alpha=0.8,
                    label=names[arm] if i == 0 else None)
    ax.axhline(base["accuracy"], color="gray", ls="--", label="base model (student)")
    if teacher:
        ax.axhline(teacher["accuracy"], color="tab:green", ls=":",
                   label="teacher (the chapter 7 GRPO run)")
    ax.set_xlabel("training seconds (1 CPU thread; evaluations excluded)")
    ax.set_ylabel("held-out accuracy (greedy, strict)")
    ax.set_title("Distillation vs RL on the same student, one curve per seed", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=150)
    return fig


def teacher_figures(teacher_source) -> dict:
    """The teacher's accuracy and training seconds, if it is the final/ of a GRPO run: seconds
    are its summed step times (metrics.csv), the GRPO arm's accounting; else {}."""
    run_dir = Path(teacher_source).parent
    if not (run_dir / "summary.json").is_file() or not (run_dir / "metrics.csv").is_file():
        return {}
    s = read_json(run_dir / "summary.json")
    seconds = sum(r["step_time"] or 0.0 for r in read_metrics(run_dir / "metrics.csv"))
    return {"accuracy": s.get("final_accuracy"), "seconds": seconds,
            "step_correctness": s.get("final_step_correctness")}


def run_distill_vs_rl(student, tokenizer, train, held_out, device, teacher_source, settings,
                      arms, seeds, out, report_only=False, figure=None, log=print) -> dict:
    """Run (or reuse) every arm x seed, then write results.md, results.json and the figure."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    held_out = list(held_out)[:settings["eval_examples"]]
    base_path = out / "base.json"
    base_settings = jsonable({"eval_examples": settings["eval_examples"],
                              "max_new_tokens": settings["max_new_tokens"]})
    if base_path.is_file() and read_json(base_path)["settings"] == base_settings:
        base = read_json(base_path)["figures"]
    else:
        base = evaluate_policy(student, tokenizer, held_out, device, settings["max_new_tokens"])
        atomic_write_json(base_path, jsonable({"settings": base_settings, "figures": base}))
    log(f"student base model: accuracy {format_value(base['accuracy'])}")
    results = {arm: {} for arm in EXPERIMENT_ARMS}
    for seed in seeds:
        for arm in arms:
            if report_only:
                done = out / f"{arm}-seed{seed}" / "figures.json"
                if done.is_file():
                    results[arm][seed] = read_json(done)["figures"]
                continue
            if arm in ("distill", "self_distill"):
                source = teacher_source if arm == "distill" else settings["student"]
                f = run_distill_arm(arm, seed, settings, source, student, tokenizer, train,
                                    held_out, device, base, out)
            else:
                f = run_grpo_arm(seed, settings, student, tokenizer, train, held_out, device,
                                 base, out)
            results[arm][seed] = f
            log(f"{arm} seed {seed}: accuracy {format_value(f['accuracy'])} after "
                f"{f['seconds']:.0f} s")
    if not (results["distill"] and results["grpo"]):
        if report_only:
            raise SystemExit(f"{out}: no finished runs of both distill and grpo to compare")
        log(f"{out}: runs finished; the table needs distill and grpo runs (run the missing "
            "arms, then --report-only)")
        return {"base": base, "runs": results}
    summary = summarise_distill_vs_rl(results)
    teacher = teacher_figures(teacher_source)
    table = write_distill_table(summary, base, teacher, settings, out / "results.md")
    plot_distill_vs_rl(results, base, teacher, figure or out / "distill_vs_rl.png")
    atomic_write_json(out / "results.json", jsonable({
        "base": base, "teacher": teacher, "summary": summary, "runs": results,
        "settings": settings, "teacher_source": teacher_source}))
    log(table)
    return {"base": base, "teacher": teacher, "summary": summary}

