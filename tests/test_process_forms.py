"""Tests for the outcome-anchored process forms (process.anchored_credit): hand-computed credits."""

import pytest
import torch

from reasoning_from_scratch.process import (
    ANCHORED_VARIANTS,
    anchored_credit,
    prefix_correct,
    process_advantages,
    progress_state_values,
)


def close(got, want, tol=1e-3):
    """Nested lists equal within tol."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g == pytest.approx(w, abs=tol)


def test_prefix_correct_is_a_running_minimum():
    assert prefix_correct([[1, 1, 0, 1], [0.7, 0.2], []]) == [[1, 1, 0, 0], [1, 0], []]
    # a score at the threshold counts as correct (1[s >= threshold])
    assert prefix_correct([[0.5, 0.49, 1.0]]) == [[1, 0, 0]]
    assert prefix_correct([[0.3, 0.29]], threshold=0.3) == [[1, 0]]


def test_first_error_marks_only_the_first_wrong_step():
    close(anchored_credit([[1, 1, 0, 0], [1, 1, 1], [0]], "first-error"),
          [[0, 0, -1, 0], [0, 0, 0], [-1]])


def test_first_error_token_advantages_by_hand():
    # completion 0: steps end at tokens 1, 3, 5, 6; its third step is the first wrong one
    adv = process_advantages([[1, 1, 0, 0], [1, 1, 1]], [[1, 3, 5, 6], [0, 2, 4]], [7, 5],
                             variant="first-error", outcome_advantages=[-1.0, 1.0], alpha=0.5)
    want = torch.tensor([[-1, -1, -1, -1, -1.5, -1.5, -1], [1, 1, 1, 1, 1, 0, 0]])
    torch.testing.assert_close(adv, want.float())


def test_progress_state_values_by_hand():
    # A: 2 correct then wrong; C: 4 correct; B: a bare wrong answer (one step)
    correct = [[1, 1, 0], [1, 1, 1, 1], [0]]
    # V_0 = mean(2, 4, 0); V_1 = mean(1, 3) over A, C; V_2 = mean(0, 2); V_3 = 1 (C); V_4 = 0
    assert progress_state_values(correct) == pytest.approx([2, 2, 1, 1, 0])


def test_progress_credit_by_hand():
    # TD credit c_k + c_k V_k - V_{k-1}, over std(M) = std(2, 4, 0) = 2 (unbiased)
    got = anchored_credit([[1, 1, 0], [1, 1, 1, 1], [0]], "progress", eps=0.0)
    close(got, [[0.5, 0.0, -0.5], [0.5, 0.0, 0.5, 0.0], [-1.0]])
    # the credits of a completion sum to its group-normalised correct-step count
    for credit, m in zip(got, [2, 4, 0]):
        assert sum(credit) == pytest.approx((m - 2) / 2)


def test_progress_credit_mixed_lengths_by_hand():
    # A completion that stops early reaches its own end (value 0), not the group's V_{K_i}.
    # correct prefixes (1), (1, 1, 1), (1, 0, 0), (0, 0, 0): M = (1, 3, 1, 0), mean 1.25,
    # std = sqrt(4.75 / 3) = 1.25831; V_0 = 1.25, V_1 = mean(0, 2, 0) = 2/3, V_2 = 1, V_3 = 0
    got = anchored_credit([[1], [1, 1, 1], [1, 0, 1], [0, 1, 1]], "progress", eps=0.0)
    s = (4.75 / 3) ** 0.5
    close(got, [[(1 + 0 - 1.25) / s],  # its last step reaches its end: 1 + 0 - V_0
                [(1 + 2 / 3 - 1.25) / s, (1 + 1 - 2 / 3) / s, (1 + 0 - 1) / s],
                [(1 + 2 / 3 - 1.25) / s, (0 - 2 / 3) / s, 0.0],  # 0 after the first error
                [-1.25 / s, 0.0, 0.0]], tol=1e-5)
    close([sum(c) for c in got], [-0.199, 1.391, -0.199, -0.993])


def test_progress_credit_sums_to_the_normalised_count_on_random_mixed_groups():
    import random

    rng = random.Random(0)
    for _ in range(200):
        G = rng.randint(2, 6)
        rewards = [[rng.random() for _ in range(rng.randint(1, 6))] for _ in range(G)]
        got = anchored_credit(rewards, "progress", threshold=0.3)
        m = torch.tensor([sum(c) for c in prefix_correct(rewards, 0.3)])
        want = ([0.0] * G if bool((m == m[0]).all())
                else ((m - m.mean()) / (m.std() + 1e-4)).tolist())
        close([sum(c) for c in got], want, tol=1e-4)


def test_progress_two_completions_blame_only_where_they_part():
    # both correct for two steps; A slips at step 3, C goes on: only step 3 gets credit
    got = anchored_credit([[1, 1, 0], [1, 1, 1, 1]], "progress", eps=0.0)
    s = 2 ** 0.5  # std(2, 4)
    close(got, [[0, 0, -1 / s], [0, 0, 1 / s, 0]])


def test_progress_never_lets_hiding_the_steps_pay():
    # a bare wrong answer (no steps) vs shown work that fails at its first step: equal (both 0
    # correct steps), and below shown work with one correct step
    got = anchored_credit([[0], [0, 0, 0], [1, 0, 0]], "progress", eps=0.0)
    assert sum(got[0]) == pytest.approx(sum(got[1]))
    assert sum(got[0]) < sum(got[2])


def test_equal_groups_give_zero_advantages():
    for variant in ANCHORED_VARIANTS:
        rewards = [[1, 1, 0], [1, 1, 0], [1, 1, 0]]
        adv = process_advantages(rewards, [[0, 1, 2]] * 3, [3, 3, 3], variant=variant,
                                 outcome_advantages=[0.0, 0.0, 0.0])
        if variant == "first-error":  # a penalty, not centred: the same wrong step in each
            assert torch.equal(adv, torch.tensor([[0.0, 0.0, -1.0]] * 3))
        elif variant == "value-delta":  # values, not a contrast: V(s_0) = 0 -> 1 -> 1 -> 0
            assert torch.equal(adv, torch.tensor([[1.0, 0.0, -1.0]] * 3))
        else:
            assert torch.equal(adv, torch.zeros(3, 3)), variant


SCORES = [[0.9, 0.2, 0.6], [0.3, 0.8]]  # reward-model scores of two completions' steps


def test_clip_form_by_hand():
    # clipped rewards min(r - 0.5, 0): (0, -0.3, 0), (-0.2, 0); returns (-0.3, -0.3, 0),
    # (-0.2, 0); per-index baselines -0.25, -0.15, 0
    close(anchored_credit(SCORES, "clip", eta=0.5), [[-0.05, -0.15, 0.0], [0.05, 0.15]])


def test_delta_form_by_hand():
    # delta rewards r_k - r_{k+1} telescope to the return r_k; baselines 0.6, 0.5, 0.6
    close(anchored_credit(SCORES, "delta"), [[0.3, -0.3, 0.0], [-0.3, 0.3]])


def test_pure_min_form_by_hand():
    # suffix minima (0.2, 0.2, 0.6), (0.3, 0.8); baselines 0.25, 0.5, 0.6
    close(anchored_credit(SCORES, "pure"), [[-0.05, -0.3, 0.0], [0.05, 0.3]])
    # without outcome advantages PURE's advantages are the credits alone
    adv = process_advantages(SCORES, [[0, 1, 2], [0, 1]], [3, 2], variant="pure")
    torch.testing.assert_close(adv, torch.tensor([[-0.05, -0.3, 0.0], [0.05, 0.3, 0.0]]))


def test_value_delta_by_hand():
    # V(s_0) = mean of the last values (1.0, 0.0) = 0.5: credits V_k - V_{k-1}
    close(anchored_credit([[0.5, 0.25, 1.0], [0.0]], "value-delta"),
          [[0.0, -0.25, 0.75], [-0.5]])
    close(anchored_credit([[0.5], [1.0]], "value-delta", prompt_value=0.0), [[0.5], [1.0]])
    # equal completions whose values are their outcome all along: no credit
    close(anchored_credit([[1.0, 1.0], [1.0, 1.0]], "value-delta"), [[0.0, 0.0], [0.0, 0.0]])


def test_anchored_variants_need_outcome_advantages():
    for variant in ("first-error", "progress", "clip", "delta", "value-delta"):
        with pytest.raises(ValueError, match="outcome_advantages"):
            process_advantages([[1]], [[0]], [1], variant=variant)
    with pytest.raises(ValueError, match="unknown variant"):
        anchored_credit([[1]], "sum")


def test_progress_token_advantages_add_the_outcome_anchor():
    rewards, ends, lengths = [[1, 1, 0], [1, 1, 1, 1]], [[0, 1, 3], [0, 1, 2, 4]], [4, 5]
    oa = torch.tensor([-0.7, 0.7])
    adv = process_advantages(rewards, ends, lengths, variant="progress", outcome_advantages=oa,
                             alpha=2.0)
    s = 2.0 / (2 ** 0.5 + 1e-4)
    want = torch.tensor([[-0.7, -0.7, -0.7 - s, -0.7 - s, 0.0],
                         [0.7, 0.7, 0.7 + s, 0.7, 0.7]])
    torch.testing.assert_close(adv, want)


# ---------------------------------------------------------------------------------------------
# Placebo controls of the credit (process.control_credit)
# ---------------------------------------------------------------------------------------------


def test_flat_control_spreads_each_completions_total_over_its_tokens():
    from reasoning_from_scratch.process import control_credit

    # completion 0: steps of 2, 2, 1 tokens (ends 1, 3, 4) with credit 1, -0.5, 2
    # -> total 1*2 - 0.5*2 + 2*1 = 3 over 5 tokens = 0.6 each
    credit = [[1.0, -0.5, 2.0], [0.3]]
    ends = [[1, 3, 4], [2]]
    close(control_credit(credit, ends, "flat"), [[0.6] * 3, [0.3]])
    adv = process_advantages([[1, 1, 0], [1]], ends, [5, 3], variant="progress",
                             outcome_advantages=[0.5, -0.5], alpha=1.0, control="flat", eps=0.0)
    plain = process_advantages([[1, 1, 0], [1]], ends, [5, 3], variant="progress",
                               outcome_advantages=[0.5, -0.5], alpha=1.0, eps=0.0)
    # same total per completion, every token of a completion equal
    torch.testing.assert_close(adv.sum(dim=1), plain.sum(dim=1))
    assert torch.all(adv[0, :5] == adv[0, 0]) and torch.all(adv[1, :3] == adv[1, 0])


def test_shuffled_control_permutes_within_each_completion_reproducibly():
    import random

    from reasoning_from_scratch.process import control_credit

    credit = [[1.0, 2.0, 3.0, 4.0], [5.0, 6.0]]
    ends = [[0, 1, 2, 3], [0, 1]]
    a = control_credit(credit, ends, "shuffled", random.Random(7))
    b = control_credit(credit, ends, "shuffled", random.Random(7))
    assert a == b  # seeded
    assert sorted(a[0]) == credit[0] and sorted(a[1]) == credit[1]
    assert a != credit  # seed 7 moves something: rng.shuffle of [1, 2, 3, 4] is not the identity
    assert control_credit(credit, ends, "none") == credit
    with pytest.raises(ValueError, match="unknown control"):
        control_credit(credit, ends, "mixed")


def test_shuffled_control_moves_credit_mass_by_hand():
    from reasoning_from_scratch.process import control_credit

    class Reverse:  # a "generator" whose shuffle reverses: the permutation (2, 1, 0)
        def shuffle(self, x):
            x.reverse()

    # steps of 2, 2, 1 tokens with credit 1, -0.5, 3 (token-weighted total 2 - 1 + 3 = 4):
    # step 0 gets step 2's mass 3 * 1 over its 2 tokens, step 2 gets step 0's 1 * 2 over 1 token
    got = control_credit([[1.0, -0.5, 3.0]], [[1, 3, 4]], "shuffled", Reverse())
    close(got, [[1.5, -0.5, 2.0]])


def test_shuffled_control_keeps_every_completions_token_weighted_total():
    import random

    from reasoning_from_scratch.process import control_credit, step_sizes

    rng = random.Random(1)
    moved = 0
    for _ in range(200):
        credit, ends = [], []
        for _ in range(rng.randint(1, 5)):
            sizes = [rng.randint(1, 9) for _ in range(rng.randint(1, 6))]
            ends.append([sum(sizes[: k + 1]) - 1 for k in range(len(sizes))])
            credit.append([rng.uniform(-2, 2) for _ in sizes])
        got = control_credit(credit, ends, "shuffled", random.Random(rng.random()))
        for cr, sh, es in zip(credit, got, ends):
            n = step_sizes(es)
            assert sum(c * k for c, k in zip(sh, n)) == pytest.approx(
                sum(c * k for c, k in zip(cr, n)), abs=1e-9)
            moved += sh != cr
    assert moved > 100  # and the placement does change


def test_format_scorer_with_progress_credits_the_first_step_only():
    from reasoning_from_scratch.step_scorers import FormatStepScorer

    think = [" <think>\nStep 1: 1+2=3\n", "</think>\n\\boxed{3}"]
    plain = ["Step 1: 1+2=3\n", "\\boxed{3}"]
    scores = FormatStepScorer().score_group("", [think, plain, think, ["\\boxed{4}"]], {})
    assert scores == [[1.0, 0.0], [0.0, 0.0], [1.0, 0.0], [0.0]]
    # f = (1, 0, 1, 0): credit (f - 0.5) / std(f), std = sqrt(1/3), on step 1 alone
    got = anchored_credit(scores, "progress", eps=0.0)
    c = 0.5 / (1 / 3) ** 0.5
    close(got, [[c, 0.0], [-c, 0.0], [c, 0.0], [-c]])


# ---------------------------------------------------------------------------------------------
# Progress past the first error (process._local_progress_credit)
# ---------------------------------------------------------------------------------------------


def test_local_step_rewards_pay_locally_right_steps_after_the_first_error():
    from reasoning_from_scratch.process import local_step_rewards

    # slips at step 1 then continues right; all right; right then wrong on its own inputs
    got = local_step_rewards([[0, 1, 1], [1, 1, 1], [1, 0, 0.2]], local_weight=0.5)
    assert got == [[0.0, 0.5, 0.5], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]]
    # a propagating scorer's rewards (every step after the first error wrong): the prefix
    assert local_step_rewards([[1, 0, 0]], local_weight=0.5) == [[1.0, 0.0, 0.0]]


def test_local_progress_credit_by_hand():
    # local verdicts: A slips at step 1 and goes on right; B right throughout; C slips at
    # step 2 and stays wrong; D slips at 1, gets step 3 right on its own inputs.
    # rewards (w = 0.5): A (0, .5, .5, .5) R 1.5; B (1, 1, 1, 1) R 4; C (1, 0, 0, 0) R 1;
    # D (0, 0, .5, 0) R .5. mean R 1.75, std R = sqrt(7.25 / 3).
    # V(0) 1.75; on path: V(1) = mean(3, 0) = 1.5 (B, C), V(2) = 2, V(3) = 1 (B);
    # off path: V(1) = mean(1.5, .5) = 1 (A, D), V(2) = mean(1, 0, .5) = .5 (A, C, D),
    # V(3) = mean(.5, 0, 0) = 1/6.
    got = anchored_credit([[0, 1, 1, 1], [1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 1, 0]],
                          "progress-local", eps=0.0, local_weight=0.5)
    s = (7.25 / 3) ** 0.5
    close(got, [[(0 + 1 - 1.75) / s, (0.5 + 0.5 - 1) / s, (0.5 + 1 / 6 - 0.5) / s,
                 (0.5 + 0 - 1 / 6) / s],
                [(1 + 1.5 - 1.75) / s, (1 + 2 - 1.5) / s, (1 + 1 - 2) / s, (1 + 0 - 1) / s],
                [(1 + 1.5 - 1.75) / s, (0 + 0.5 - 1.5) / s, (0 + 1 / 6 - 0.5) / s,
                 (0 + 0 - 1 / 6) / s],
                [(0 + 1 - 1.75) / s, (0 + 0.5 - 1) / s, (0.5 + 1 / 6 - 0.5) / s,
                 (0 + 0 - 1 / 6) / s]], tol=1e-6)
    # the two locally right third steps after an error are paid alike; plain progress gives
    # every step after the first error 0
    assert got[0][2] == pytest.approx(got[3][2]) and got[0][2] > 0
    assert anchored_credit([[0, 1, 1, 1]] + [[1] * 4], "progress", eps=0.0)[0][1:] == [0, 0, 0]


def test_local_progress_with_weight_zero_is_progress_on_random_groups():
    import random

    rng = random.Random(3)
    for _ in range(200):
        rewards = [[rng.choice([0.0, 1.0]) for _ in range(rng.randint(1, 6))]
                   for _ in range(rng.randint(2, 6))]
        close(anchored_credit(rewards, "progress-local", local_weight=0.0),
              anchored_credit(rewards, "progress"), tol=1e-9)


def test_local_progress_credit_sums_to_the_normalised_return_on_random_groups():
    import random

    from reasoning_from_scratch.process import local_step_rewards

    rng = random.Random(4)
    for _ in range(200):
        G, w = rng.randint(2, 6), rng.uniform(0, 1)
        rewards = [[rng.random() for _ in range(rng.randint(1, 6))] for _ in range(G)]
        got = anchored_credit(rewards, "progress-local", threshold=0.4, local_weight=w)
        r = torch.tensor([sum(x) for x in local_step_rewards(rewards, 0.4, w)],
                         dtype=torch.float64)
        want = ([0.0] * G if bool((r == r[0]).all())
                else ((r - r.mean()) / (r.std() + 1e-4)).tolist())
        close([sum(c) for c in got], want, tol=1e-4)


def test_local_verifier_checks_each_step_on_its_own_inputs():
    from reasoning_from_scratch.process_supervision import build_step_scorer

    example = {"problem": "Compute (3+4)+5", "answer": "12"}
    # step 1 slips (3+4=8); step 2 continues right from the written 8 (8+5=13)
    steps = ["<think>\nStep 1: 3+4=8\n", "Step 2: 8+5=13\n", "</think>\n\\boxed{13}"]
    assert build_step_scorer("verifier-think").score("", steps, example) == [0.0, 0.0, 0.0]
    assert build_step_scorer("verifier-think-local").score("", steps, example) == [0.0, 1.0, 0.0]
    # outside the think format no step counts, as for verifier-think
    plain = ["Step 1: 3+4=7\n", "Step 2: 7+5=12\n", "\\boxed{12}"]
    assert build_step_scorer("verifier-think-local").score("", plain, example) == [0.0] * 3
