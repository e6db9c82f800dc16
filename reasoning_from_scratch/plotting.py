"""Plots of training metrics: one run's raw and smoothed curves with evaluation accuracy as bars
(`plot_grpo_metrics`, a run's metrics.png), and several runs on shared axes, seeds of one
setting as mean ± sd (`plot_runs`, chapters/compare_runs.py); token advantages of a group as a
heat map (`draw_token_advantages`, chapter 8).

The evaluation bars start with the model before training at step 0 (from `base`, or from the
run's summary.json), so a gain is read against where the run started.

Figures are drawn with the Agg canvas directly (no pyplot), so plotting works headless and never
changes the process-wide matplotlib backend of a notebook that imports this module.
"""

from __future__ import annotations

import csv
import json
import math
import statistics
from pathlib import Path

import matplotlib
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from .files import atomic_path
from .run_log import read_metrics, seed_groups

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


def _read_columns(csv_path, columns, skip_missing=False):
    """Steps and the requested columns (floats or None) of a metrics.csv; with `skip_missing`,
    a column the file lacks is left out of the data instead of raising."""
    with open(csv_path, newline="") as f:
        reader = csv.DictReader(f)
        header = reader.fieldnames or []
        missing = [c for c in ["step", *columns] if c not in header]
        if skip_missing and "step" in header:
            missing = []
        if missing:
            raise ValueError(f"{csv_path}: no column(s) {missing}; has {reader.fieldnames}")
        rows = list(reader)
    steps = [float(r["step"]) for r in rows]
    data = {c: [float(r[c]) if r[c] not in ("", None) else None for r in rows]
            for c in columns if c in header}
    return steps, data


def base_values(csv_path, base=None):
    """Evaluation column -> the starting model's value, for the bars at step 0.

    `base`: {column: value} (e.g. {"eval_accuracy": 0.22}); None reads base_<figure> from the
    summary.json beside `csv_path` (written by `train_grpo`), or finds none ({}).
    """
    if base is None:
        summary = Path(csv_path).with_name("summary.json")
        try:
            data = json.loads(summary.read_text())
        except (OSError, ValueError):
            return {}
        base = {c: data.get("base_" + c.removeprefix("eval_")) for c in BAR_COLUMNS}
    return {c: float(v) for c, v in base.items() if v is not None}


def _draw_bars(ax, points, base):
    """Evaluation values as bars, the base model's (if known) as a grey bar at step 0."""
    if base is not None:
        points = [(0.0, base), *[(x, y) for x, y in points if x != 0]]
    xs = [x for x, _ in points]
    width = 0.6 * (min(b - a for a, b in zip(xs, xs[1:])) if len(xs) > 1 else 1.0)
    is_base = [base is not None and i == 0 for i in range(len(points))]
    ax.bar(xs, [y for _, y in points], width=width,
           color=["tab:gray" if b else "tab:green" for b in is_base])
    for (x, y), b in zip(points, is_base):
        ax.annotate(f"base {y:.2f}" if b else f"{y:.2f}", (x, y), ha="center", va="bottom",
                    fontsize=8)


def _draw_curve(ax, xs, ys):
    """Raw values (faint) and their moving average; one solid line when the two coincide."""
    smooth = moving_average(list(ys))
    same = all(a == b or (math.isnan(a) and math.isnan(b)) for a, b in zip(ys, smooth))
    if same:  # a window of one point: the average is the raw curve, drawn once
        ax.plot(xs, ys, color="tab:blue")
        return
    ax.plot(xs, ys, color="tab:blue", alpha=0.3, label="raw")
    ax.plot(xs, smooth, color="tab:blue", label="moving average")
    ax.legend(fontsize=8, loc="best")


def _panel_grid(n: int, panel_height: float, fig: Figure | None = None):
    """A figure with n panels, two per row, and their axes in order; drawn into `fig` when
    given (e.g. a pyplot figure), else into a new Agg figure."""
    ncols = min(2, n)
    nrows = math.ceil(n / ncols)
    if fig is None:
        fig = Figure(layout="constrained")
        FigureCanvasAgg(fig)
    else:
        fig.set_layout_engine("constrained")
    fig.set_size_inches(6 * ncols, panel_height * nrows)
    return fig, [fig.add_subplot(nrows, ncols, i + 1) for i in range(n)]


def plot_grpo_metrics(csv_path, columns, save_as=None, base=None, fig=None, skip_missing=False):
    """One panel per column of a metrics.csv: raw (faint) and moving average; eval columns as bars.

    Evaluation columns get the starting model's value as a grey bar at step 0 (`base`, see
    `base_values`: given, or read from the run's summary.json). A curve whose moving average
    equals its raw values (too few points for a window) is drawn once. Returns the matplotlib
    Figure; writes a PNG to `save_as` when given. `fig`: an empty figure to draw into (default:
    a new one, without pyplot). A column the CSV lacks is an error, or, with `skip_missing`,
    gets no panel (the book's rule).
    """
    columns = list(columns)
    if not columns:
        raise ValueError("plot_grpo_metrics: no columns to plot")
    steps, data = _read_columns(csv_path, columns, skip_missing)
    columns = [c for c in columns if c in data]
    if not columns:
        raise ValueError(f"plot_grpo_metrics: none of the columns is in {csv_path}")
    starts = base_values(csv_path, base)
    fig, axes = _panel_grid(len(columns), panel_height=2.8, fig=fig)
    for col, ax in zip(columns, axes):
        points = [(s, v) for s, v in zip(steps, data[col]) if v is not None]
        if col in BAR_COLUMNS and (points or col in starts):
            _draw_bars(ax, points, starts.get(col))
        elif not points:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        else:
            _draw_curve(ax, *zip(*points))
        ax.set_title(col)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    if save_as is not None:
        save_figure(fig, save_as)
    return fig


def save_figure(fig, path, dpi=100):
    """Write `fig` to `path` atomically (redrawn during a run, it is never seen half-written);
    the format follows the suffix (PNG without one)."""
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=dpi, format=Path(path).suffix.lstrip(".") or "png")


def _run_curve(rows, column, smooth):
    """(steps, values) of one run's column, missing cells left out, optionally smoothed."""
    points = [(r["step"], r[column]) for r in rows if r.get(column) is not None]
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    return xs, (moving_average(ys, smooth) if smooth and ys else ys)


def _mean_sd_curve(curves):
    """(steps, means, sds) over the runs that have a value at each step."""
    at = {}
    for xs, ys in curves:
        for x, y in zip(xs, ys):
            at.setdefault(x, []).append(y)
    steps = sorted(at)
    means = [statistics.fmean(at[x]) for x in steps]
    sds = [statistics.stdev(at[x]) if len(at[x]) > 1 else 0.0 for x in steps]
    return steps, means, sds


def plot_runs(run_dirs, columns, group_seeds=True, smooth=0.0, save_as=None):
    """Several runs' metrics.csv columns on shared axes, one panel per column, one line per run.

    With `group_seeds`, runs whose config.json differ only in the seed (`run_log.seed_groups`)
    are one line, their mean at each step, with a band of ± one sample sd. smooth: the
    `moving_average` window as a fraction of a run's points (0: raw). Evaluation columns,
    sparse, are drawn with markers. Returns the Figure; writes it to `save_as` when given.
    """
    columns = list(columns)
    if not columns or not run_dirs:
        raise ValueError("plot_runs: needs at least one run directory and one column")
    groups = seed_groups(run_dirs) if group_seeds else [(Path(d).name, [Path(d)])
                                                        for d in run_dirs]
    rows = {}
    for _, dirs in groups:
        for d in dirs:
            rows[d] = read_metrics(Path(d) / "metrics.csv")
            have = set(rows[d][0]) if rows[d] else set()
            if missing := [c for c in columns if c not in have]:
                raise ValueError(f"{Path(d) / 'metrics.csv'}: no column(s) {missing}; has "
                                 f"{sorted(have)}")
    fig, axes = _panel_grid(len(columns), panel_height=3.2)
    for col, ax in zip(columns, axes):
        marker = "o" if col in BAR_COLUMNS else None
        for k, (label, dirs) in enumerate(groups):
            color = f"C{k % 10}"
            steps, means, sds = _mean_sd_curve([_run_curve(rows[d], col, smooth) for d in dirs])
            ax.plot(steps, means, color=color, marker=marker, markersize=3, label=label)
            if len(dirs) > 1:
                ax.fill_between(steps, [m - s for m, s in zip(means, sds)],
                                [m + s for m, s in zip(means, sds)], color=color, alpha=0.2,
                                linewidth=0)
        ax.set_title(col + (" (mean ± sd over seeds)" if any(len(d) > 1 for _, d in groups)
                            else ""))
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    if save_as is not None:
        save_figure(fig, save_as)
    return fig


def draw_token_advantages(fig, ax, advantages, lengths, step_ends, row_labels, title,
                          vmax=4.5, mark=None):
    """A heat map of token advantages on `ax`: rows are completions, columns tokens (grey past a
    completion's end), black bars at step ends; `mark` = {row: (first, last) token} outlines a
    span (a carry step, say). `advantages`: (G, T) tensor or array."""
    adv = advantages.numpy() if hasattr(advantages, "numpy") else advantages
    lengths = [int(n) for n in lengths]
    shown = [[adv[i][t] if t < lengths[i] else math.nan for t in range(len(adv[i]))]
             for i in range(len(adv))]
    cmap = matplotlib.colormaps["RdBu"].with_extremes(bad="lightgrey")
    im = ax.imshow(shown, cmap=cmap, vmin=-vmax, vmax=vmax, aspect="auto",
                   interpolation="nearest")
    for i, ends in enumerate(step_ends):
        for e in list(ends)[:-1]:
            ax.plot([e + 0.5, e + 0.5], [i - 0.5, i + 0.5], color="black", linewidth=1.5)
    for i, (first, last) in (mark or {}).items():
        ax.add_patch(Rectangle((first - 0.5, i - 0.5), last - first + 1, 1, fill=False,
                               edgecolor="gold", linewidth=2.5))
    ax.set_yticks(range(len(row_labels)), row_labels)
    ax.set_title(f"token advantages, {title}; black bars: step ends")
    fig.colorbar(im, ax=ax)
    return im
