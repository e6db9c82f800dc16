"""Chapter 8's step-size search: every arm gets the same search over the size of its update.

A credit that learns faster and a step size that suits one arm better look the same in a table
of final accuracies. So before arms are compared, each is given the same search, fixed in
advance, over what sets the size of a GRPO update: the peak learning rate (`lr`), the updates
per batch of rollouts (`inner_epochs`, PPO-style: clipped ratios from the second update on) and
how the loss averages its tokens (`loss_type`: grpo's per-sequence mean or Dr. GRPO's sum over
a fixed length, arXiv 2503.20783). A full grid of 3 x 3 x 2 values costs 18 experiments per
arm; the search is staged instead (coordinate search, one stage per knob, in `STAGES` order):
each stage runs every candidate value with the values chosen so far, then keeps, per arm, the
one with the highest mean final accuracy over the seeds (ties: the earlier candidate). Stage
points are ordinary chapter 8 experiments (`process_vs_outcome.run_experiment`) in
<output-dir>/<point>/, so a point two stages share, or a rerun, is trained once.

Writes <output-dir>/search.md and search.json: every point's final accuracy (mean +- sd over
seeds), step correctness and decode / forward tokens per run, and each arm's choice. Searched
on the val split; the chosen settings are then reported once on test seeds the search never
saw (docs/process_vs_outcome.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

from ..files import atomic_write_json
from ..training import GRPOConfig
from .process_vs_outcome import ARMS, ExperimentSettings, run_experiment
from .stats import format_pm, jsonable

STAGES = ("lr", "inner_epochs", "loss_type")  # searched in this order, one knob per stage


@dataclass(frozen=True)
class SearchGrid:
    """Candidate values per knob; a knob with one value (or none) is not searched."""

    lr: tuple = ()  # peak AdamW learning rates
    inner_epochs: tuple = ()  # updates per batch of rollouts
    loss_type: tuple = ()  # GRPOConfig.loss_type values

    def stages(self):
        """The (knob, candidates) pairs searched, in `STAGES` order."""
        return [(k, tuple(getattr(self, k))) for k in STAGES if len(getattr(self, k)) > 1]


def short_number(x: float) -> str:
    """3e-4 for 0.0003, 1.5e-4 for 0.00015: the learning rate in a directory name."""
    mantissa, exponent = f"{x:e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def point_name(point: dict) -> str:
    """The directory of one search point: lr3e-4_e1_grpo."""
    return f"lr{short_number(point['lr'])}_e{point['inner_epochs']}_{point['loss_type']}"


def _row_figures(row):
    """The figures of one arm's row of `summarise` that the search table shows."""
    keys = ("final_accuracy", "final_step_correctness", "tokens", "forward_tokens")
    return {k: row[k] for k in keys}


def _best(results: dict, candidates) -> object:
    """The candidate with the highest mean final accuracy (the earlier one on a tie)."""
    scored = [(results[c]["final_accuracy"]["mean"], -i, c) for i, c in enumerate(candidates)
              if c in results and not math.isnan(results[c]["final_accuracy"]["mean"])]
    if not scored:
        raise ValueError("no finished run at any candidate of this stage")
    return max(scored)[2]


def run_search(settings: ExperimentSettings, config: GRPOConfig, arms, seeds,
               grid: SearchGrid) -> dict:
    """Run the staged search for every arm; returns {"points", "chosen", "stages"}.

    `config`'s values are the starting point of every knob; `settings.output_dir` holds one
    experiment per point. Every arm is searched alike: the same stages, candidates and seeds.
    """
    fixed = {arm: sorted(set(ARMS[arm].config) & set(STAGES)) for arm in arms}
    fixed = {arm: knobs for arm, knobs in fixed.items() if knobs}
    if fixed:
        raise ValueError(f"arms that set a searched knob themselves cannot be searched: {fixed}")
    out = Path(settings.output_dir)
    chosen = {arm: {k: getattr(config, k) for k in STAGES} for arm in arms}
    points = {}  # point name -> {"point": values, "arms": {arm: figures}}
    stages = []
    for knob, candidates in grid.stages():
        by_point = {}  # the arms that need each point: one experiment runs them together
        for arm in arms:
            for value in candidates:
                point = {**chosen[arm], knob: value}
                by_point.setdefault(point_name(point), (point, []))[1].append(arm)
        results = {arm: {} for arm in arms}
        for name, (point, group) in by_point.items():
            summary = run_experiment(replace(settings, output_dir=str(out / name)),
                                     replace(config, **point), group, seeds)
            entry = points.setdefault(name, {"point": point, "arms": {}})
            for row in summary["rows"]:
                entry["arms"][row["arm"]] = _row_figures(row)
                results[row["arm"]][point[knob]] = entry["arms"][row["arm"]]
        picks = {arm: _best(results[arm], candidates) for arm in arms}
        for arm, value in picks.items():
            chosen[arm][knob] = value
        stages.append({"knob": knob, "candidates": list(candidates), "picks": picks})
    record = {"points": points, "chosen": chosen, "stages": stages, "seeds": list(seeds),
              "eval_split": settings.eval_split, "model": settings.model}
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "search.json", jsonable(record))
    table = "\n".join(search_table(record))
    (out / "search.md").write_text(table + "\n")
    print(table)
    return record


def search_table(record: dict) -> list[str]:
    """The search as markdown: one row per point and arm, then each arm's choice."""
    lines = [f"Step-size search on the {record['eval_split']} split, seeds "
             f"{', '.join(map(str, record['seeds']))} ({record['model']}); mean +- sd over "
             "seeds at the last step; tokens per run.", "",
             "| point | arm | final accuracy | step correctness | decode tokens (k) | "
             "forward tokens (k) |", "|---|---|---|---|---|---|"]
    for name, entry in record["points"].items():
        for arm, f in entry["arms"].items():
            mark = "**" if all(entry["point"][k] == record["chosen"][arm][k] for k in STAGES) \
                else ""
            lines.append(f"| {mark}{name}{mark} | {arm} | {format_pm(f['final_accuracy'])} | "
                         f"{format_pm(f['final_step_correctness'])} | "
                         f"{f['tokens']['mean'] / 1e3:.0f} | "
                         f"{f['forward_tokens']['mean'] / 1e3:.0f} |")
    lines.append("")
    for arm, values in record["chosen"].items():
        lines.append(f"- {arm}: {point_name(values)}")
    return lines
