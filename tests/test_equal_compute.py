"""Tests for the chapter 8 equal-compute read-outs, interpolated between checkpoints."""

import math

import pytest

from reasoning_from_scratch.experiments.process_vs_outcome import (
    first_crossing,
    interpolate_at,
    mean_curve_crossing,
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
    # a point without a value is left out: the crossing is read between its neighbours
    gap = _pts((0, 0.0, 0.2), (5, 100.0, None), (10, 200.0, 0.5))
    assert first_crossing(gap, 0.35) == pytest.approx(100.0)
    gap[1]["accuracy"] = float("nan")
    assert first_crossing(gap, 0.35) == pytest.approx(100.0)
    # a point without tokens (an older run's metrics): no budget can be read
    pts[1]["tokens"] = float("nan")
    assert interpolate_at(pts, 150.0) is None


def test_the_cost_columns_add_up_step_by_step(tmp_path):
    """A run's point at step k carries its metrics.csv costs summed over steps 1..k: decode
    tokens `tokens` = rollout tokens + the step scorer's sampled tokens, `forward_tokens` read
    without sampling; a column an older run lacks sums to NaN (no budget read), a missing
    step_time cell counts 0 s."""
    from reasoning_from_scratch.experiments.process_vs_outcome import (
        _cumulative_costs,
        _make_point,
    )

    csv = tmp_path / "metrics.csv"
    csv.write_text("step,step_time,gen_tokens,scorer_tokens,forward_tokens,forward_pad_tokens\n"
                   "1,2.0,100,30,500,50\n"
                   "2,,120,10,700,0\n"
                   "3,1.5,80,0,400,25\n")
    costs = _cumulative_costs(csv)
    assert costs == {0: (0.0,) * 5, 1: (2.0, 100.0, 30.0, 500.0, 50.0),
                     2: (2.0, 220.0, 40.0, 1200.0, 50.0), 3: (3.5, 300.0, 40.0, 1600.0, 75.0)}
    point = _make_point(2, costs, {"accuracy": 0.5})
    assert point == {"step": 2, "seconds": 2.0, "gen_tokens": 220.0, "scorer_tokens": 40.0,
                     "tokens": 260.0, "forward_tokens": 1200.0, "forward_pad_tokens": 50.0,
                     "accuracy": 0.5}
    old = tmp_path / "old.csv"  # written before forward_tokens (and its padding) was logged
    old.write_text("step,step_time,gen_tokens,scorer_tokens\n1,2.0,100,30\n")
    secs, gen, scorer, forward, padding = _cumulative_costs(old)[1]
    assert (secs, gen, scorer) == (2.0, 100.0, 30.0) and math.isnan(forward)
    assert math.isnan(padding)


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
    at_budget = rows["progress"]["accuracy_at_budget"]["mean"]
    assert at_budget == pytest.approx(0.35 + 0.2 * 80 / 120)
    assert rows["progress"]["accuracy_at_budget_per_seed"] == {0: pytest.approx(0.4833333)}
    # progress reaches 0.4 at 120 + 120 * 0.25 = 150 tokens: 75% of outcome's
    assert rows["progress"]["tokens_to_target_share"] == [pytest.approx(0.75)]
    assert rows["outcome"]["tokens_to_target_share"] == [pytest.approx(1.0)]
    # at outcome's 10 seconds progress is at step 10
    assert rows["progress"]["accuracy_at_seconds"]["mean"] == pytest.approx(0.55)
    # progress as the reference: target 0.55 and budget 240 tokens, which outcome never reaches
    summary = summarise(curves, base, reference="progress")
    assert summary["reference"] == "progress" and summary["target"] == pytest.approx(0.55)
    assert summary["token_budget"] == pytest.approx(240.0)
    rows = {r["arm"]: r for r in summary["rows"]}
    assert rows["outcome"]["tokens_to_target_share"] == [None]
    assert rows["outcome"]["accuracy_at_budget"]["mean"] == pytest.approx(0.4)  # flat past 200


def test_paired_bootstrap_by_hand():
    from reasoning_from_scratch.experiments.stats import (
        bootstrap_draws,
        paired_bootstrap,
        resampled_statistic,
    )

    # one seed, problems (0, 1): resample means 0, 0.5, 1 with chances 1/4, 1/2, 1/4, so the
    # 2.5% and 97.5% points of 2000 resamples are 0 and 1
    assert paired_bootstrap([[0, 1]], seed=0) == {"mean": 0.5, "lo": 0.0, "hi": 1.0}
    # an arm against itself: every paired difference is 0
    v = [[0, 1, 1, 0, 1], [1, 1, 0, 0, 1]]
    assert paired_bootstrap(v, reference=v) == {"mean": 0.0, "lo": 0.0, "hi": 0.0}
    # the statistic of each resample, recomputed with loops on the same draws (RNG seed 3):
    # mean over the drawn seeds of each seed's mean over the drawn problems, and with
    # denominators each seed's ratio of sums
    good, total = [[1, 2, 0], [2, 2, 1]], [[2, 2, 1], [2, 3, 1]]
    seeds, problems = bootstrap_draws(2, 3, n_boot=6, seed=3)
    means = resampled_statistic(good, (seeds, problems))
    ratios = resampled_statistic(good, (seeds, problems), total)
    for b in range(6):
        s_idx, p_idx = seeds[b].tolist(), problems[b].tolist()
        want = sum(sum(good[s][p] for p in p_idx) / 3 for s in s_idx) / 2
        assert means[b].item() == pytest.approx(want)
        want = sum(sum(good[s][p] for p in p_idx) / sum(total[s][p] for p in p_idx)
                   for s in s_idx) / 2
        assert ratios[b].item() == pytest.approx(want)
    # the estimate itself: seed 0 3/5, seed 1 5/6
    got = paired_bootstrap(good, total, n_boot=200, seed=3)
    assert got["mean"] == pytest.approx((3 / 5 + 5 / 6) / 2)
    assert got["lo"] <= got["mean"] <= got["hi"]
    with pytest.raises(ValueError, match="pair the same seeds"):
        paired_bootstrap(good, reference=[[1, 2]])


def test_summary_intervals_and_per_seed_labels_follow_the_seeds():
    def point(step, tokens, correct):
        return {"step": step, "tokens": tokens, "gen_tokens": tokens, "scorer_tokens": 0.0,
                "forward_tokens": 10 * tokens, "seconds": step * 1.0,
                "accuracy": sum(correct) / len(correct), "step_correctness": 0.5,
                "right_answer_wrong_step": None, "think_accuracy": None, "format_rate": 1.0,
                "per_problem": {"correct": correct, "steps_good": [1] * len(correct),
                                "steps_total": [2] * len(correct)}}

    base = {**point(0, 0.0, [0, 0, 0, 0]), "accuracy": 0.0}
    # seeds inserted out of order: seed 2 is the better outcome run
    curves = {"outcome": {2: [point(10, 100.0, [1, 1, 0, 0])],
                          1: [point(10, 100.0, [1, 0, 0, 0])]},
              "recommended-a2": {1: [point(10, 200.0, [1, 1, 1, 0])],
                                 2: [point(10, 200.0, [1, 1, 1, 1])]}}
    rows = {r["arm"]: r for r in summarise(curves, base)["rows"]}
    assert rows["outcome"]["seeds"] == [1, 2]
    assert rows["outcome"]["accuracy_at_budget_per_seed"] == {1: 0.25, 2: 0.5}
    # at outcome's 100 decode tokens recommended is halfway from the base model (0) to step 10
    assert rows["recommended-a2"]["accuracy_at_budget_per_seed"] == {1: 0.375, 2: 0.5}
    # and at outcome's 1000 forward tokens the same
    assert rows["recommended-a2"]["accuracy_at_forward_budget"]["mean"] == pytest.approx(0.4375)
    iv = rows["recommended-a2"]["intervals"]
    assert iv["self"]["final_accuracy"]["mean"] == pytest.approx(0.875)
    assert iv["self"]["final_step_correctness"]["mean"] == pytest.approx(0.5)
    assert iv["self"]["accuracy_at_budget"]["mean"] == pytest.approx(0.4375)
    assert iv["vs_outcome"]["final_accuracy"]["mean"] == pytest.approx(0.875 - 0.375)
    assert iv["vs_outcome"]["final_accuracy"]["lo"] >= 0  # never behind on a problem and seed
    assert "vs_placebo" not in iv  # placebo-a2 not run


def test_arm_records():
    from reasoning_from_scratch.experiments.process_vs_outcome import (
        ARMS,
        RECOMMENDED_ALPHA,
        placebo_of,
    )

    # the think-native choice `recommended` and its controls share one alpha; tiny-arith's
    # choice keeps alpha 1 under its own name
    for name in ("recommended", "placebo", "shuffled"):
        assert ARMS[name].config["process_alpha"] == RECOMMENDED_ALPHA
    assert ARMS["recommended-tiny-arith"].config == {"process_alpha": 1.0,
                                                     "skip_zero_advantage": True}
    assert ARMS["placebo-a2"].config == {"process_alpha": 2.0, "skip_zero_advantage": True,
                                         "process_credit_control": "flat"}
    assert ARMS["recommended-a2-keep"].config == {"process_alpha": 2.0}
    assert ARMS["outcome"].scorer is None and ARMS["vine-k2"].config == {"mc_rollouts": 2}
    assert placebo_of("recommended-a2") == "placebo-a2" and placebo_of("outcome") is None
    # credit past the first error: recommended-tuned's settings, a local scorer and form
    local, tuned = ARMS["recommended-local-tuned"], ARMS["recommended-tuned"]
    assert local.config == tuned.config
    assert (local.scorer, local.variant) == ("verifier-think-local", "progress-local")
    assert ARMS["shuffled-local-tuned"].config == {**local.config,
                                                   "process_credit_control": "shuffled"}
    # branches at the first error: recommended-tuned's settings and 4 x 2 branches
    branch = ARMS["recommended-branch-tuned"]
    assert branch.config == {**tuned.config, "branch_rollouts": 4, "branch_states": 2}
    assert (branch.scorer, branch.variant) == (tuned.scorer, tuned.variant)
    for arm in ARMS.values():  # a placebo is the same form with its credit spread evenly,
        if arm.placebo:        # or, for the branches, their advantages shuffled
            p = ARMS[arm.placebo]
            assert (p.scorer, p.variant) == (arm.scorer, arm.variant)
            control = {"branch_control": "shuffled"} if arm.config.get("branch_rollouts") \
                else {"process_credit_control": "flat"}
            assert p.config == {**arm.config, **control}


def _pp(tokens, correct):
    return {"tokens": tokens, "per_problem": {"correct": correct}}


def test_mean_curve_crossing_by_hand():
    # outcome ends at [1, 0] on both seeds: target 0.5; the arm's curve climbs from 0 to 1 on
    # every problem over its first 50 of outcome's 100 decode tokens, so it reaches 0.5 at 25
    # tokens (share 0.25). A resample's target is its share of problem 0's draws, t in
    # {0, 0.5, 1}, crossed at 50 t tokens: shares 0, 0.25, 0.5 (the interval's ends).
    outcome = {s: [_pp(0.0, [0, 0]), _pp(100.0, [1, 0])] for s in (0, 1)}
    arm = {s: [_pp(0.0, [0, 0]), _pp(50.0, [1, 1])] for s in (0, 1)}
    out = mean_curve_crossing(arm, outcome, budget=100.0, n_boot=400)
    assert out["mean"] == pytest.approx(0.25)
    assert out["lo"] == pytest.approx(0.0) and out["hi"] == pytest.approx(0.5)
    assert out["never"] == 0.0
    # an arm that stays at 0: never reached, in every resample whose target is above 0
    flat = {s: [_pp(0.0, [0, 0]), _pp(100.0, [0, 0])] for s in (0, 1)}
    out = mean_curve_crossing(flat, outcome, budget=100.0, n_boot=400)
    assert math.isinf(out["mean"]) and math.isinf(out["hi"])
    assert 0.6 < out["never"] < 0.9  # P(target > 0) = 3/4 for two problems
    assert mean_curve_crossing({0: [{"tokens": 0.0}]}, outcome, budget=100.0) is None
