"""Tests for reasoning_from_scratch.plotting."""

import math

import pytest

from reasoning_from_scratch.plotting import moving_average, plot_grpo_metrics


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
