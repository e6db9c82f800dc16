"""Tests for reasoning_from_scratch.plotting."""

import math

import pytest

from reasoning_from_scratch.plotting import (
    base_values,
    draw_token_advantages,
    moving_average,
    plot_grpo_metrics,
)


def test_moving_average_trailing_window():
    # 8 values, window_fraction 0.25 -> window 2: running mean of the last two values
    assert moving_average([1, 3, 5, 7, 9, 11, 13, 15]) == [1, 2, 4, 6, 8, 10, 12, 14]
    # window 1 returns the input; None/NaN are skipped inside a window
    assert moving_average([1, 2, 3], window_fraction=0.1) == [1, 2, 3]
    out = moving_average([None, 2.0, float("nan"), 4.0], window_fraction=0.5)
    assert math.isnan(out[0]) and out[1:] == [2.0, 2.0, 4.0]
    assert moving_average([1, 2], window_fraction=0) == [1, 2]  # the book's "no smoothing"
    with pytest.raises(ValueError):
        moving_average([1, 2], window_fraction=1.5)


def test_plot_grpo_metrics_writes_png(tmp_path):
    csv_path = tmp_path / "metrics.csv"
    lines = ["step,reward_mean,eval_accuracy"]
    lines += [f"{s},{s / 10},{'' if s % 5 else s / 20}" for s in range(1, 11)]
    csv_path.write_text("\n".join(lines) + "\n")
    fig = plot_grpo_metrics(csv_path, ["reward_mean", "eval_accuracy"], save_as=tmp_path / "m.png")
    assert (tmp_path / "m.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(fig.axes) == 2
    assert len(fig.axes[1].patches) == 2  # eval accuracy at steps 5 and 10 drawn as bars
    with pytest.raises(ValueError, match="no column"):
        plot_grpo_metrics(csv_path, ["kl"])


def _metrics_csv(tmp_path, n=10):
    csv_path = tmp_path / "metrics.csv"
    lines = ["step,reward_mean,eval_accuracy"]
    lines += [f"{s},{s / 10},{'' if s % 5 else s / 20}" for s in range(1, n + 1)]
    csv_path.write_text("\n".join(lines) + "\n")
    return csv_path


def _bar_heights(ax):
    return [round(p.get_height(), 6) for p in ax.patches]


def test_base_accuracy_drawn_at_step_zero(tmp_path):
    csv_path = _metrics_csv(tmp_path)
    fig = plot_grpo_metrics(csv_path, ["eval_accuracy"], base={"eval_accuracy": 0.125})
    ax = fig.axes[0]
    assert [p.get_x() + p.get_width() / 2 for p in ax.patches] == [0.0, 5.0, 10.0]
    assert _bar_heights(ax) == [0.125, 0.25, 0.5]
    assert "base 0.12" in [t.get_text() for t in ax.texts]
    # without a base and without a summary.json: only the logged evaluations
    assert _bar_heights(plot_grpo_metrics(csv_path, ["eval_accuracy"]).axes[0]) == [0.25, 0.5]


def test_base_accuracy_read_from_summary_json(tmp_path):
    csv_path = _metrics_csv(tmp_path)
    (tmp_path / "summary.json").write_text('{"base_accuracy": 0.2, "final_accuracy": 0.5}')
    assert base_values(csv_path) == {"eval_accuracy": 0.2}
    fig = plot_grpo_metrics(csv_path, ["eval_accuracy"])
    assert _bar_heights(fig.axes[0]) == [0.2, 0.25, 0.5]
    # an explicit base wins over the file
    fig = plot_grpo_metrics(csv_path, ["eval_accuracy"], base={"eval_accuracy": 0.1})
    assert _bar_heights(fig.axes[0])[0] == 0.1


def test_smoothed_line_skipped_when_it_equals_the_raw_one(tmp_path):
    # 10 points: window 2, two lines; 3 points: window 1, the average is the raw curve
    ax = plot_grpo_metrics(_metrics_csv(tmp_path), ["reward_mean"]).axes[0]
    assert [line.get_label() for line in ax.lines] == ["raw", "moving average"]
    ax = plot_grpo_metrics(_metrics_csv(tmp_path, n=3), ["reward_mean"]).axes[0]
    assert len(ax.lines) == 1 and ax.get_legend() is None
    assert list(ax.lines[0].get_ydata()) == [0.1, 0.2, 0.3]


def test_token_advantage_heat_map_greys_past_the_end_and_marks_a_span():
    import torch
    from matplotlib.figure import Figure

    fig = Figure()
    ax = fig.subplots()
    adv = torch.tensor([[1.0, 2.0, 3.0], [-1.0, -2.0, 0.0]])
    im = draw_token_advantages(fig, ax, adv, [3, 2], [[0, 2], [1]], ["a", "b"], "test",
                               mark={0: (1, 2)})
    data = im.get_array()
    assert data[0].tolist() == [1.0, 2.0, 3.0] and data[1][:2].tolist() == [-1.0, -2.0]
    assert data.mask[1][2] and not data.mask[0].any()  # beyond completion b's end: grey
    assert len(ax.lines) == 1  # one step end inside completion a (its last end draws none)
    (rect,) = ax.patches
    assert (rect.get_x(), rect.get_width()) == (0.5, 2)  # tokens 1..2 of row 0
    assert [t.get_text() for t in ax.get_yticklabels()] == ["a", "b"]
