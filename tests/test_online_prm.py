"""Tests for online_prm.py (a PRM re-fitted on the rollouts during RL) and the process hook's
outcome-anchored forms: labels, parameter updates, costs, the PURE share, the seed interface."""

from dataclasses import replace

import pytest
import torch
from rollout_helpers import rollouts_from_texts

from reasoning_from_scratch.online_prm import OnlinePRMStepScorer, OutcomeStepLabeler
from reasoning_from_scratch.prm import ProcessRewardModel, encode_steps, save_prm
from reasoning_from_scratch.process import process_advantages, split_steps, step_texts
from reasoning_from_scratch.process_supervision import (
    ProcessAdvantageFn,
    build_step_scorer,
    group_generator,
    make_process_advantage_fn,
    process_token_advantages,
)
from reasoning_from_scratch.prompts import render_prompt
from reasoning_from_scratch.step_scorers import VerifierStepScorer
from reasoning_from_scratch.training import compute_grpo_loss
from reasoning_from_scratch.weights import load_pretrained

EXAMPLE = {"problem": "Compute ((17+25)*3)-8", "answer": "118"}
GOOD = " <think>\nStep 1: 17+25=42\nStep 2: 42*3=126\nStep 3: 126-8=118\n</think>\n\\boxed{118}"
BAD = " <think>\nStep 1: 17+25=42\nStep 2: 42*3=124\nStep 3: 124-8=116\n</think>\n\\boxed{116}"
BARE = " \\boxed{116}"


def steps_of(text):
    return step_texts(text, split_steps(text))


@pytest.fixture()
def prm_and_tokenizer(tiny_dir):
    backbone, tokenizer = load_pretrained(tiny_dir, device="cpu", dtype=torch.float32)
    torch.manual_seed(0)
    return ProcessRewardModel(backbone=backbone), tokenizer


class SpyLabeler(VerifierStepScorer):
    """The verifier, recording what it was asked to label."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def score_group(self, prompt, steps_per_completion, example):
        labels = super().score_group(prompt, steps_per_completion, example)
        self.calls.append((prompt, [list(s) for s in steps_per_completion], labels))
        return labels


def test_online_prm_scores_then_updates_on_verifier_labels(prm_and_tokenizer):
    prm, tokenizer = prm_and_tokenizer
    labeler = SpyLabeler()
    scorer = OnlinePRMStepScorer(prm, tokenizer, labeler, lr=1e-2)
    before = [p.detach().clone() for p in prm.parameters()]
    group = [steps_of(GOOD), steps_of(BAD), []]
    from reasoning_from_scratch.prm import score_steps_batch
    expected = score_steps_batch(prm, tokenizer, [("P", group[0]), ("P", group[1])])
    scores = scorer.score_group("P", group, EXAMPLE)
    # the scores are the PRM's predictions *before* it saw these labels
    assert scores[:2] == [pytest.approx(e) for e in expected] and scores[2] == []
    assert any(not torch.equal(a, b) for a, b in zip(before, prm.parameters()))
    # the labels came from the verifier, on exactly these steps
    assert labeler.calls == [("P", group, [[1.0] * 4, [1.0, 0.0, 0.0, 0.0], []])]
    cost = scorer.cost()
    read = sum(len(encode_steps(tokenizer, "P", s)[0]) for s in group[:2])
    assert cost["forward_tokens"] == 2 * read  # read once to score, once to train
    assert cost["prm_updates"] == 1 and 0.0 <= cost["prm_agreement"] <= 1.0


def test_online_prm_learns_its_labels(prm_and_tokenizer):
    prm, tokenizer = prm_and_tokenizer
    scorer = OnlinePRMStepScorer(prm, tokenizer, lr=3e-3)
    group = [steps_of(GOOD), steps_of(BAD)]
    first = scorer.score_group("P", group, EXAMPLE)
    for _ in range(30):
        last = scorer.score_group("P", group, EXAMPLE)
    wrong_before = sum(abs(s - t) for s, t in zip(first[1], [1, 0, 0, 0]))
    wrong_after = sum(abs(s - t) for s, t in zip(last[1], [1, 0, 0, 0]))
    assert wrong_after < wrong_before / 2
    assert scorer.cost()["prm_updates"] == 31


def test_outcome_labels_give_every_step_the_outcome():
    labels = OutcomeStepLabeler().score_group("P", [steps_of(GOOD), steps_of(BAD)], EXAMPLE)
    assert labels == [[1.0] * 4, [0.0] * 4]


def test_online_prm_specs(prm_and_tokenizer, tmp_path):
    prm, tokenizer = prm_and_tokenizer
    save_prm(prm, tokenizer, tmp_path / "prm")
    plain = build_step_scorer(f"online-prm:{tmp_path / 'prm'}")
    assert isinstance(plain, OnlinePRMStepScorer)
    assert isinstance(plain.labeler, VerifierStepScorer) and plain.labeler.think_only
    outcome = build_step_scorer(f"online-prm-outcome:{tmp_path / 'prm'}")
    assert isinstance(outcome.labeler, OutcomeStepLabeler)


# ---------------------------------------------------------------------------------------------
# The process hook with the outcome-anchored forms
# ---------------------------------------------------------------------------------------------


def _rollouts(tokenizer, texts):
    """Rollouts of EXAMPLE's prompt with these completions (+ EOS)."""
    return rollouts_from_texts(tokenizer, render_prompt(EXAMPLE["problem"]), texts)


@pytest.fixture(scope="module")
def arith_tokenizer():
    return load_pretrained("tiny-arith", device="cpu")[1]


def test_hook_progress_with_the_seed_reward_model_interface(arith_tokenizer):
    """A `reward_model(prompt, step_text) -> float` object still works as the step scorer."""

    class StepIsRight:
        def forward(self, prompt, step_text):
            return 0.0 if "124" in step_text else 1.0

    ro = _rollouts(arith_tokenizer, [GOOD, BAD, BARE])
    hook = ProcessAdvantageFn(arith_tokenizer, StepIsRight(), variant="progress", alpha=0.5)
    oa = torch.tensor([[1.0, -0.5, -0.5]])
    out = hook([(EXAMPLE, ro, None)], oa, ro.completion_mask)
    _, info = process_token_advantages(ro, EXAMPLE, arith_tokenizer, StepIsRight())
    assert info["step_rewards"] == [[1, 1, 1, 1], [1, 0, 0, 1], [1]]  # the answer: no "124"
    want = process_advantages(info["step_rewards"], info["step_ends"], ro.lengths, "progress",
                              oa[0], alpha=0.5)
    torch.testing.assert_close(out[:, : want.shape[1]], want * ro.completion_mask)
    # hand check of the credit: M = (4, 1, 1), V_0 = 2, V_1 = mean(3, 0, 0) = 1, std(M) = sqrt(3)
    # GOOD step 1: 1 + V_1 - V_0 = 0; BAD step 2 (its first error): 0 - V_1 = -1
    s = 3 ** 0.5 + 1e-4
    e = info["step_ends"]
    assert out[0, 0].item() == pytest.approx(1.0)
    assert out[1, e[1][0] + 1].item() == pytest.approx(-0.5 - 0.5 / s)
    assert out[1, e[1][1] + 1].item() == pytest.approx(-0.5)  # after the first error: anchor only


def test_hook_pure_gives_the_outcome_term_to_its_share_of_groups(arith_tokenizer):
    ro = _rollouts(arith_tokenizer, [GOOD, BAD])
    hook = ProcessAdvantageFn(arith_tokenizer, VerifierStepScorer(), variant="pure",
                              verifiable_share=0.25)
    oa = torch.tensor([[1.0, -1.0]] * 8)
    out = hook([(EXAMPLE, ro, None)] * 8, oa, ro.completion_mask.repeat(8, 1))
    rows = out.reshape(8, 2, -1)
    with_outcome = [n for n in range(8) if not torch.equal(rows[n], rows[0])]
    assert with_outcome == [3, 7]  # floor((n + 1) / 4) > floor(n / 4)
    torch.testing.assert_close(rows[3] - rows[0],
                               torch.tensor([[1.0], [-1.0]]) * ro.completion_mask)
    with pytest.raises(ValueError, match="verifiable_share"):
        ProcessAdvantageFn(arith_tokenizer, VerifierStepScorer(), verifiable_share=1.5)


def test_hook_shuffled_control_is_the_same_whatever_the_group_order_or_restart(arith_tokenizer):
    """The shuffle's permutations come from (seed, the group's tokens): scoring the groups in
    another order, or with a fresh hook after a restart, draws the same; another seed does not
    (for some seed); the completions' token-weighted totals are the unshuffled ones."""
    wrong_late = GOOD.replace("126-8=118", "126-8=117")
    groups = [(EXAMPLE, _rollouts(arith_tokenizer, [GOOD, BAD, BARE, wrong_late]), None),
              (EXAMPLE, _rollouts(arith_tokenizer, [BAD, GOOD, wrong_late]), None)]
    oa = [torch.tensor([1.0, -0.5, -0.5, 0.0]), torch.tensor([-0.5, 1.0, -0.5])]

    def run(hook, order):
        out = {}
        for n in order:
            ro = groups[n][1]
            out[n] = hook([groups[n]], oa[n][None], ro.completion_mask)
        return out

    def hook(control="shuffled", seed=3):
        return ProcessAdvantageFn(arith_tokenizer, VerifierStepScorer(think_only=True),
                                  variant="progress", credit_control=control, seed=seed)

    first, reordered, restarted = run(hook(), [0, 1]), run(hook(), [1, 0]), run(hook(), [0, 1])
    plain = run(hook("none"), [0, 1])
    for n in (0, 1):
        assert torch.equal(first[n], reordered[n]) and torch.equal(first[n], restarted[n])
        torch.testing.assert_close(first[n].sum(1), plain[n].sum(1))
    assert any(not torch.allclose(first[n], plain[n]) for n in (0, 1))  # something moved
    others = [run(hook(seed=s), [0, 1]) for s in range(4, 12)]
    assert any(not torch.equal(o[0], first[0]) for o in others)


def test_group_generator_reads_the_completions_real_tokens_only(arith_tokenizer):
    """Two groups of one prompt whose completions differ draw different permutations; more
    padding after the same completions draws the same."""
    def first_draw(ro):
        return group_generator(3, ro).random()

    ro = _rollouts(arith_tokenizer, [GOOD, BARE])
    wider = replace(ro, completion_ids=torch.cat(
        [ro.completion_ids, torch.full((2, 5), 7, dtype=ro.completion_ids.dtype)], 1))
    assert first_draw(wider) == first_draw(ro)
    swapped = _rollouts(arith_tokenizer, [BARE, GOOD])
    assert first_draw(swapped) != first_draw(ro)
    assert group_generator(4, ro).random() != first_draw(ro)


@pytest.mark.parametrize("variant", ["progress", "first-error", "clip"])
def test_compute_grpo_loss_accepts_the_new_forms(variant):
    model, tokenizer = load_pretrained("tiny-arith", device="cpu")
    g = torch.Generator().manual_seed(0)
    adv_fn = make_process_advantage_fn(tokenizer, "verifier-think", variant, alpha=0.5)
    out = compute_grpo_loss(model, tokenizer, {"problem": "Compute (12+7)*3", "answer": "57"},
                            "cpu", num_rollouts=4, max_new_tokens=40, temperature=1.0, top_p=1.0,
                            generator=g, supervision="process", advantage_fn=adv_fn)
    assert torch.isfinite(out["loss_tensor"]).all()


def test_verifier_think_only_counts_work_outside_the_think_format_as_not_shown():
    plain = GOOD.replace(" <think>\n", "\n").replace("</think>\n", "")  # same steps, no tags
    verifier, think_only = VerifierStepScorer(), build_step_scorer("verifier-think")
    assert verifier.score("", steps_of(plain), EXAMPLE) == [1.0] * 4
    assert think_only.score("", steps_of(plain), EXAMPLE) == [0.0] * 4
    assert think_only.score("", steps_of(GOOD), EXAMPLE) == [1.0] * 4
    # so under the progress form the plain solution ranks with a bare wrong answer
    credit = process_advantages([[0.0] * 4, [0.0], [1.0] * 4], [[0, 1, 2, 3], [0], [0, 1, 2, 3]],
                                [4, 1, 4], "progress", [0.0, 0.0, 0.0])
    assert credit[0, 0] == credit[1, 0] < 0 < credit[2, 0]
