"""Tests for the chapter 8 equal-compute read-outs, interpolated between checkpoints."""

import pytest

from reasoning_from_scratch.experiments.process_vs_outcome import (
    first_crossing,
    interpolate_at,
    summarise,
)


def _pts(*rows):
    return [{"step": s, "tokens": t, "seconds": t / 10, "accuracy": a} for s, t, a in rows]


def test_interpolate_at_and_first_crossing_by_hand():
    pts = _pts((0, 0.0, 0.2), (5, 100.0, 0.3), (10, 200.0, 0.5))
    assert interpolate_at(pts, 150.0) == pytest.approx(0.4)
    assert interpolate_at(pts, 15.0, key="seconds") == pytest.approx(0.4)
    assert interpolate_at(pts, 500.0) == pytest.approx(0.5)  # held flat past the last point
    assert first_crossing(pts, 0.45) == pytest.approx(175.0)
    assert first_crossing(pts, 0.2) == 0.0
    assert first_crossing(pts, 0.6) is None


def test_summary_equal_compute_rows():
    base = {"accuracy": 0.2, "step_correctness": None, "right_answer_wrong_step": None,
            "think_accuracy": None, "format_rate": 0.5}

    def point(step, tokens, acc):
        return {"step": step, "tokens": tokens, "gen_tokens": tokens, "scorer_tokens": 0.0,
                "seconds": step * 1.0, "accuracy": acc, "step_correctness": None,
                "right_answer_wrong_step": None, "think_accuracy": None, "format_rate": 0.5}

    curves = {"outcome": {0: [point(5, 100.0, 0.3), point(10, 200.0, 0.4)]},
              "progress": {0: [point(5, 120.0, 0.35), point(10, 240.0, 0.55)]}}
    rows = {r["arm"]: r for r in summarise(curves, base)["rows"]}
    # outcome's budget is 200 tokens, its target 0.4; progress is at 0.35 + 80/120 * 0.2
    at_budget = rows["progress"]["accuracy_at_budget_interp"]["mean"]
    assert at_budget == pytest.approx(0.35 + 0.2 * 80 / 120)
    assert rows["progress"]["accuracy_at_budget_per_seed"] == {0: pytest.approx(0.4833333)}
    # progress reaches 0.4 at 120 + 120 * 0.25 = 150 tokens: 75% of outcome's
    assert rows["progress"]["tokens_to_target_share"] == [pytest.approx(0.75)]
    assert rows["outcome"]["tokens_to_target_share"] == [pytest.approx(1.0)]
    # at outcome's 10 seconds progress is at step 10
    assert rows["progress"]["accuracy_at_seconds"]["mean"] == pytest.approx(0.55)
