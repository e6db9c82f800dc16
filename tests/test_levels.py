"""Level-by-level figures of the experiments (`experiments/levels.py`), hand-computed."""

import math

import pytest

from reasoning_from_scratch.experiments.levels import at_mix, level_table, mean_levels


def _lv(think_rate, step_correctness, think_accuracy, think_answers, steps_each=1):
    return {"think_rate": think_rate, "step_correctness": step_correctness,
            "think_accuracy": think_accuracy, "think_answers": think_answers,
            "think_steps": think_answers * steps_each}


# Two seeds of an arm; level 2 of seed 1 has no think answers (its figures are None).
SEED0 = {"1": _lv(1.0, 0.9, 0.8, 40), "2": _lv(0.5, 0.6, 0.5, 20)}
SEED1 = {"1": _lv(0.8, 0.7, 0.6, 32), "2": _lv(0.0, None, None, 0)}


def test_mean_levels_skips_runs_without_think_answers():
    m = mean_levels([SEED0, SEED1])
    assert m["1"]["step_correctness"] == pytest.approx(0.8)
    assert m["1"]["think_answers"] == pytest.approx(36)
    assert m["2"]["step_correctness"] == pytest.approx(0.6)  # seed 1 has none there
    assert m["2"]["think_rate"] == pytest.approx(0.25)


def test_at_mix_reweights_levels():
    m = mean_levels([SEED0, SEED1])
    # weights 1 : 3 -> (0.8 * 1 + 0.6 * 3) / 4
    assert at_mix(m, {"1": 1, "2": 3}) == pytest.approx(0.65)
    assert at_mix(m, {"1": 1, "2": 3}, "think_accuracy") == pytest.approx((0.7 + 0.5 * 3) / 4)
    # a level the arm has no value at is left out of the weights
    hard_only = mean_levels([SEED1])
    assert at_mix(hard_only, {"1": 1, "2": 3}) == pytest.approx(0.7)
    assert math.isnan(at_mix(hard_only, {"2": 1}))


def test_level_table_uses_the_reference_mix():
    # The reference answers level 1 in the think format only; the other arm both levels.
    ref = {"1": _lv(0.5, 0.9, 0.9, 10), "2": _lv(0.0, None, None, 0)}
    other = {"1": _lv(1.0, 0.95, 0.9, 20), "2": _lv(1.0, 0.5, 0.2, 20, steps_each=2)}
    # the base: 10 think answers of 1 step at level 1, 10 of 3 steps at level 2 -> steps 1 : 3
    base = {"1": _lv(0.5, 0.8, 0.8, 10), "2": _lv(0.5, 0.4, 0.1, 10, steps_each=3)}
    lines = level_table({"outcome": [ref], "x": [other]}, {"x": "arm x"}, "outcome", base)
    rows = [line for line in lines if line.startswith("| ")]
    assert rows[0].startswith("| supervision | level 1") and "outcome's mix" in rows[0]
    assert rows[1].startswith("| base model | 0.50 / 0.800 | 0.50 / 0.400 |")
    # At its own mix the reference gets its own figures back (0.900, 0.900). The other arm is
    # worse overall (0.95 * 20 + 0.5 * 40) / 60 = 0.65, better at the reference's mix (level 1
    # only): 0.95; at the base's step mix 1 : 3, (0.95 + 3 * 0.5) / 4 = 0.6125.
    assert rows[2] == "| outcome | 0.50 / 0.900 | 0.00 / n/a | 0.900 | 0.900 | 0.900 |"
    assert rows[-1] == "| arm x | 1.00 / 0.950 | 1.00 / 0.500 | 0.950 | 0.900 | 0.613 |"
    assert level_table({"x": [other]}, {}, "outcome") == []
