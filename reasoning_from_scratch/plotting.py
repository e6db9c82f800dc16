"""Plots of GRPO training metrics: raw and smoothed curves, evaluation accuracy as bars.

Figures are drawn with the Agg canvas directly (no pyplot), so plotting works headless and never
changes the process-wide matplotlib backend of a notebook that imports this module.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

BAR_COLUMNS = ("eval_accuracy", "eval_format_rate", "eval_think_accuracy",
               "eval_step_correctness")  # measured only at eval steps


def moving_average(values, window_fraction=0.25):
    """Trailing mean over a window of `window_fraction` x len(values) points (at least 1).

    The first points average what exists so far, so the output has the input's length.
    None/NaN entries are skipped inside each window (NaN where a window holds none).
    """
    if not 0 <= window_fraction <= 1:  # 0: a 1-point window, no smoothing (as in the book)
        raise ValueError(f"window_fraction must be in [0, 1], got {window_fraction}")
    window = max(1, int(len(values) * window_fraction))
    out = []
    for i in range(len(values)):
        chunk = [v for v in values[max(0, i - window + 1):i + 1]
                 if v is not None and not math.isnan(v)]
        out.append(sum(chunk) / len(chunk) if chunk else math.nan)
    return out


def _read_columns(csv_path, columns):
    """Steps and the requested columns (floats or None) of a metrics.csv."""
    with open(csv_path, newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in ["step", *columns] if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{csv_path}: no column(s) {missing}; has {reader.fieldnames}")
        rows = list(reader)
    steps = [float(r["step"]) for r in rows]
    data = {c: [float(r[c]) if r[c] not in ("", None) else None for r in rows] for c in columns}
    return steps, data


def plot_grpo_metrics(csv_path, columns, save_as=None):
    """One panel per column of a metrics.csv: raw (faint) and moving average; eval columns as bars.

    Returns the matplotlib Figure; writes a PNG to `save_as` when given.
    """
    columns = list(columns)
    if not columns:
        raise ValueError("plot_grpo_metrics: no columns to plot")
    steps, data = _read_columns(csv_path, columns)
    ncols = min(2, len(columns))
    nrows = math.ceil(len(columns) / ncols)
    fig = Figure(figsize=(6 * ncols, 2.8 * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    for i, col in enumerate(columns):
        ax = fig.add_subplot(nrows, ncols, i + 1)
        points = [(s, v) for s, v in zip(steps, data[col]) if v is not None]
        if not points:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        elif col in BAR_COLUMNS:
            xs, ys = zip(*points)
            width = 0.6 * (min(b - a for a, b in zip(xs, xs[1:])) if len(xs) > 1 else 1.0)
            ax.bar(xs, ys, width=width, color="tab:green")
            for x, y in points:
                ax.annotate(f"{y:.2f}", (x, y), ha="center", va="bottom", fontsize=8)
        else:
            xs, ys = zip(*points)
            ax.plot(xs, ys, color="tab:blue", alpha=0.3, label="raw")
            ax.plot(xs, moving_average(list(ys)), color="tab:blue", label="moving average")
            ax.legend(fontsize=8, loc="best")
        ax.set_title(col)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    if save_as is not None:
        Path(save_as).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(save_as, dpi=100)
    return fig
