"""Held-out figures level by level, for the experiments that compare trained policies.

Step correctness and accuracy among think answers are measured over the answers a policy
writes in the think format, so they depend on *which* problems it answers that way: a policy
that also uses the format on the hardest level (five-step chains with three-digit carries) has
a lower overall step correctness than one that keeps it for easy problems, with the same steps
at every level. This module evaluates each run's final model once more with the answers kept
(`evaluation.per_level_reasoning`, cached as `final_levels.json` in the run directory) and
reweights the per-level figures to one reference mix of levels: "at the reference's mix" is
what the arm would score on the problems the reference answers in the think format.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from ..evaluation import evaluate, per_level_reasoning
from ..files import atomic_write_json
from ..weights import load_pretrained
from .stats import format_value

LEVEL_FILE = "final_levels.json"
FIGURES = ("think_rate", "step_correctness", "think_accuracy")


def level_figures(model, tokenizer, held_out, device, config) -> dict[str, dict]:
    """{level (str): per-level figures} of one model, greedy on the held-out problems."""
    res = evaluate(model, tokenizer, held_out[: config.eval_examples], device,
                   max_new_tokens=config.eval_tokens, batch_size=config.eval_batch_size,
                   progress=False)
    return {str(k): v for k, v in per_level_reasoning(res["records"]).items()}


def final_level_figures(run_dir, tokenizer, held_out, device, config) -> dict | None:
    """A finished run's final model, level by level (cached in the run directory); None if the
    run directory has no final model."""
    run_dir = Path(run_dir)
    cache = run_dir / LEVEL_FILE
    if cache.is_file():
        return json.loads(cache.read_text())
    if not (run_dir / "final").is_dir():
        return None
    model, _ = load_pretrained(run_dir / "final", device=device, dtype=torch.float32)
    figures = level_figures(model, tokenizer, held_out, device, config)
    atomic_write_json(cache, figures)
    return figures


def _mean(values):
    values = [v for v in values if v is not None and not math.isnan(v)]
    return sum(values) / len(values) if values else math.nan


def mean_levels(runs: list[dict]) -> dict[str, dict[str, float]]:
    """Per level, each figure's mean over runs (runs without think answers there are skipped)."""
    levels = sorted({lv for run in runs for lv in run}, key=int)
    keys = (*FIGURES, "accuracy", "carry_step_correctness", "think_answers", "think_steps")
    return {lv: {k: _mean([run[lv].get(k) for run in runs if lv in run]) for k in keys}
            for lv in levels}


def at_mix(levels: dict, mix: dict, figure: str = "step_correctness") -> float:
    """`figure` averaged over levels with weights `mix` {level: weight} (the reference's think
    steps per level for step correctness, its think answers for think accuracy: the weights
    that make a run's own figures come back); levels where the arm has no value are left out."""
    pairs = [(mix[lv], levels[lv][figure]) for lv in mix
             if lv in levels and not math.isnan(levels[lv][figure])]
    total = sum(w for w, _ in pairs)
    return sum(w * v for w, v in pairs) / total if total else math.nan


def level_table(by_arm: dict[str, list[dict]], labels: dict, reference: str,
                base: dict | None = None) -> list[str]:
    """Markdown lines: think rate and step correctness per level of each arm (mean over seeds),
    then step correctness and think accuracy at the reference arm's mix of think answers (and
    step correctness at the base model's mix, given `base`)."""
    means = {arm: mean_levels(runs) for arm, runs in by_arm.items() if runs}
    if reference not in means:
        return []

    def mixes(m):  # (step weights, answer weights) of one arm's think answers
        return ({lv: f["think_steps"] for lv, f in m.items()},
                {lv: f["think_answers"] for lv, f in m.items()})

    mix, answer_mix = mixes(means[reference])
    base_mix = mixes(mean_levels([base]))[0] if base else None
    levels = list(mix)
    rows = ([("base model", mean_levels([base]))] if base else []) + [
        (labels.get(arm, arm), m) for arm, m in means.items()]
    name = labels.get(reference, reference)
    head = ("| supervision | " + " | ".join(f"level {lv}: think rate / step corr." for lv in levels)
            + f" | step corr. at {name}'s mix | think acc. at {name}'s mix |"
            + (" step corr. at the base model's mix |" if base_mix else ""))
    lines = [head, "|---" * (len(levels) + 3 + bool(base_mix)) + "|"]
    for label, m in rows:
        cells = [f"{format_value(m[lv]['think_rate'], 2)} / "
                 f"{format_value(m[lv]['step_correctness'])}" if lv in m else "n/a"
                 for lv in levels]
        cells += [format_value(at_mix(m, mix)),
                  format_value(at_mix(m, answer_mix, "think_accuracy"))]
        if base_mix:
            cells.append(format_value(at_mix(m, base_mix)))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return ["", "Final models level by level (held-out problems of each level; mean over seeds; "
            f"a mix: the per-level figures weighted by the think-format steps (step correctness) "
            f"or answers (think accuracy) per level of {name}, mean over its seeds, or of the "
            "base model):", "", *lines]
