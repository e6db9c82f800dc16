"""Branches at the first error (branching.py): states, step cuts, grades and advantages by hand,
the rows they make, and one training step that learns from them."""

import json
import math
import random

import pytest
import torch

from reasoning_from_scratch.branching import (
    Branch,
    BranchConfig,
    branch_advantages,
    branch_rows,
    branch_step_tokens,
    first_error_states,
    grade_branch_step,
    sample_branches,
    with_branch_rows,
)
from reasoning_from_scratch.grpo import RolloutBatch, collect_rollouts
from reasoning_from_scratch.process_supervision import make_process_advantage_fn
from reasoning_from_scratch.rewards import build_reward
from reasoning_from_scratch.run_log import read_metrics
from reasoning_from_scratch.training import GRPOConfig
from reasoning_from_scratch.weights import load_pretrained

EXAMPLE = {"problem": "Compute ((16-8)*7)-6", "answer": "50"}


@pytest.fixture(scope="module")
def think_model():
    return load_pretrained("tiny-arith-think", device="cpu")


def test_first_error_states_by_hand():
    # four completions of three steps; tokens: each step is two tokens (ends 1, 3, 5)
    rewards = [[1, 0, 0], [1, 1, 1], [1, 0, 1], [0, 0, 0]]
    ends = [[1, 3, 5]] * 4
    ids = torch.tensor([[7, 8, 9, 9, 9, 9],     # A: right, then wrong at step 2
                        [7, 8, 5, 6, 1, 2],     # B: right throughout (reaches A's state)
                        [7, 8, 4, 4, 4, 4],     # C: same prefix as A, wrong at step 2
                        [3, 3, 3, 3, 3, 3]])    # D: wrong at step 1 (the prompt's state)
    states = first_error_states(rewards, ends, ids)
    # A and C share the state after step 1 (2 members; A, B, C reached it, B went on right);
    # D's state is the prompt, reached by all four, where A, B and C were right
    assert [(s.completion, s.cut, s.step, s.members, s.reached, s.right) for s in states] == [
        (0, 2, 1, 2, 3, 1), (3, 0, 0, 1, 4, 3)]
    assert len(first_error_states(rewards, ends, ids, max_states=1)) == 1
    assert first_error_states([[1, 1]], [[0, 1]], torch.tensor([[1, 2]])) == []


def test_branch_advantages_by_hand():
    # the state's own samples: 1 wrong step; two right branches: q = (0, 1, 1), mean 2/3,
    # unbiased std sqrt(1/3): each branch (1 - 2/3) / sqrt(1/3) = 1/sqrt(3)
    got = branch_advantages([1, 1], right=0, wrong=1, eps=0.0)
    assert got == pytest.approx([1 / math.sqrt(3)] * 2, abs=1e-6)
    # q = (1, 0, 1, 0): mean 1/2, std sqrt(1/3): +-(1/2) / sqrt(1/3)
    got = branch_advantages([1, 0], right=1, wrong=1, eps=0.0)
    assert got == pytest.approx([math.sqrt(3) / 2, -math.sqrt(3) / 2], abs=1e-6)
    assert branch_advantages([0, 0, 0], right=0, wrong=2) == [0.0, 0.0, 0.0]  # all wrong
    with pytest.raises(ValueError, match="unknown control"):
        branch_advantages([1, 0], control="flat")


def test_shuffled_branches_keep_each_states_advantages_and_lose_their_order():
    plain = branch_advantages([1, 0, 0, 1, 0], right=2, wrong=3)
    seen = set()
    for seed in range(20):
        got = branch_advantages([1, 0, 0, 1, 0], right=2, wrong=3, control="shuffled",
                                generator=random.Random(seed))
        assert sorted(got) == pytest.approx(sorted(plain))  # the same values, the same sum
        seen.add(tuple(round(x, 6) for x in got))
        assert got == branch_advantages([1, 0, 0, 1, 0], 2, 3, "shuffled", random.Random(seed))
    assert len(seen) > 1


def test_branch_step_tokens_cut_after_the_first_step(think_model):
    _, tok = think_model
    prefix = tok.encode(" <think>\nStep 1: 16-8=8\n")
    branch = tok.encode("Step 2: 8*7=56\nStep 3: 56-6=50\n")
    n, steps, final = branch_step_tokens(tok, prefix, branch, truncated=True, step=1)
    assert tok.decode(branch[:n]) == "Step 2: 8*7=56\n"
    assert steps == [" <think>\nStep 1: 16-8=8\n", "Step 2: 8*7=56\n"] and not final
    # the answer step ends the text: graded with the answer
    eos = tok.eos_token_id
    answer = tok.encode("</think>\n\\boxed{50}") + [eos]
    whole = tok.encode(" <think>\nStep 1: 16-8=8\nStep 2: 8*7=56\nStep 3: 56-6=50\n")
    n, steps, final = branch_step_tokens(tok, whole, answer, truncated=False, step=3)
    assert n == len(answer) and final and steps[-1] == "</think>\n\\boxed{50}"
    # a branch that writes no step of its own is not graded on the prefix's last step
    for tail, trunc in ((tok.encode(" and so on"), True), ([eos], False)):
        n, steps, final = branch_step_tokens(tok, prefix, tail, truncated=trunc, step=1)
        assert (n, steps, final) == (len(tail), [], False)
        assert grade_branch_step(steps, EXAMPLE, final) == 0.0


def test_grade_branch_step_by_hand():
    first = " <think>\nStep 1: 16-8=8\n"
    assert grade_branch_step([first, "Step 2: 8*7=56\n"], EXAMPLE, final=False) == 1.0
    assert grade_branch_step([first, "Step 2: 8*7=54\n"], EXAMPLE, final=False) == 0.0
    # outside the think format the outcome reward pays for: not a step
    assert grade_branch_step(["Step 1: 16-8=8\n"], EXAMPLE, final=False) == 0.0
    done = [first, "Step 2: 8*7=56\n", "Step 3: 56-6=50\n"]
    assert grade_branch_step(done + ["</think>\n\\boxed{50}"], EXAMPLE, final=True) == 1.0
    assert grade_branch_step(done + ["</think>\n\\boxed{51}"], EXAMPLE, final=True) == 0.0
    assert grade_branch_step([], EXAMPLE, final=False) == 0.0


def _batch(rows=2, P=3, T=4):
    ids = torch.arange(rows * (P + T)).reshape(rows, P + T)
    mask = torch.ones(rows, T, dtype=torch.bool)
    return RolloutBatch(ids, None, P, mask, torch.ones(rows, T), torch.zeros(1, rows),
                        samples=[{"prompt_tokens": P}] * rows, zero_adv_frac=0.5,
                        num_generated_tokens=rows * T)


def test_branch_rows_train_only_the_branch_step():
    ro = type("R", (), {"prompt_ids": torch.tensor([5, 6])})()
    groups = [(EXAMPLE, ro)]
    branches = [Branch(0, [1, 2, 3], [4, 9], 1.0, 0.5), Branch(0, [1, 2, 3], [8], 0.0, 0.0),
                Branch(0, [], [7, 7, 7], 0.0, -1.5)]
    rows = branch_rows(branches, groups, pad_id=0)
    # the zero-advantage branch carries no signal: dropped; prompt | prefix | step
    assert rows.size == 2 and rows.prompt_len == 2
    assert rows.input_ids.tolist() == [[5, 6, 1, 2, 3, 4, 9], [5, 6, 7, 7, 7, 0, 0]]
    assert rows.completion_mask.tolist() == [[False, False, False, True, True],
                                             [True, True, True, False, False]]
    assert rows.advantages.tolist() == [[0, 0, 0, 0.5, 0.5], [-1.5, -1.5, -1.5, 0, 0]]
    assert branch_rows(branches[1:2], groups) is None


def test_with_branch_rows_appends_and_keeps_the_rollouts_statistics():
    batch = _batch()
    ro = type("R", (), {"prompt_ids": torch.tensor([5, 6])})()
    rows = branch_rows([Branch(0, [1], [4, 9, 9, 9, 9], 1.0, 2.0)], [(EXAMPLE, ro)])
    merged = with_branch_rows(batch, rows)
    assert merged.size == 3
    # the rollouts' rows unchanged, right padded to the longer branch (prompts of one width)
    assert merged.input_ids[:2, :7].tolist() == batch.input_ids.tolist()
    assert merged.input_ids[:2, 7:].tolist() == [[0, 0]] * 2
    assert merged.advantages[:2].tolist() == [[1, 1, 1, 1, 0, 0]] * 2
    assert merged.completion_mask[2].tolist() == [False] + [True] * 5
    assert merged.advantages[2].tolist() == [0, 2, 2, 2, 2, 2]
    assert merged.attention_mask[2].tolist()[:1] == [0]  # the shorter prompt is left padded
    assert (merged.rewards is batch.rewards and merged.samples is batch.samples
            and merged.num_generated_tokens == batch.num_generated_tokens
            and merged.zero_adv_frac == 0.5)
    assert with_branch_rows(batch, None) is batch


def _scored_groups(model, tok, seed=0):
    from reasoning_from_scratch.datasets import load_arith
    examples = load_arith("train", n=40, seed=1, level_weights=(1, 1, 2, 2, 2))[20:26]
    fn = make_process_advantage_fn(tok, "verifier-think", "progress", alpha=4.0)
    collect_rollouts(model, tok, examples, "cpu", build_reward(tok, 0.5, True), num_rollouts=8,
                     max_new_tokens=112, temperature=1.0, top_p=1.0,
                     generator=torch.Generator().manual_seed(seed), advantage_fn=fn,
                     skip_zero_advantage=True)
    return fn.last_groups, fn.last_infos


def test_sample_branches_on_the_think_model(think_model):
    model, tok = think_model
    groups, infos = _scored_groups(model, tok)
    config = BranchConfig(k=4, alpha=4.0, seed=3)
    branches, cost = sample_branches(model, tok, groups, infos, config)
    assert branches and cost["branch_generated_tokens"] > 0 and cost["branch_states"] > 0
    assert len(branches) == 4 * cost["branch_states"]
    for b in branches:  # every branch is at most one step, within its budget
        text = tok.decode(b.step_ids)
        assert text.count("Step ") <= 1 and b.correct in (0.0, 1.0)
        assert 0 < len(b.step_ids) <= config.max_new_tokens
    # a group's branches depend on its own tokens, not on where it sits in the batch
    again, _ = sample_branches(model, tok, groups[::-1], infos[::-1], config)
    key = [(tuple(b.prefix), tuple(b.step_ids), b.advantage) for b in branches]
    assert sorted(key) == sorted((tuple(b.prefix), tuple(b.step_ids), b.advantage)
                                 for b in again)
    # the placebo: the same branches, each state's advantages permuted among its branches
    placebo, _ = sample_branches(model, tok, groups, infos,
                                 BranchConfig(k=4, alpha=4.0, seed=3, control="shuffled"))
    assert [b.step_ids for b in placebo] == [b.step_ids for b in branches]
    for s in range(0, len(branches), 4):
        assert sorted(b.advantage for b in placebo[s:s + 4]) == pytest.approx(
            sorted(b.advantage for b in branches[s:s + 4]))


def test_branches_need_a_verifier_and_one_sampling_round():
    with pytest.raises(ValueError, match="verifier step scorer"):
        GRPOConfig(branch_rollouts=2)
    with pytest.raises(ValueError, match="dynamic_sampling"):
        GRPOConfig(branch_rollouts=2, supervision="process", dynamic_sampling=True)
    with pytest.raises(ValueError, match="tis_cap"):
        GRPOConfig(branch_rollouts=2, supervision="process", tis_cap=2.0)
    GRPOConfig(branch_rollouts=2, supervision="process", step_scorer="verifier-think")


def test_ch07_script_trains_on_branches(tmp_path):
    """One step of ch07_train.py with branches: their rows enter the update, their sampled
    tokens are counted as the step scorer's, and the weights move."""
    from test_training import _load_script
    out = tmp_path / "run"
    summary = _load_script("ch07_train").main([
        "--model", "tiny-arith-think", "--supervision", "process",
        "--step-scorer", "verifier-think", "--process-variant", "progress",
        "--process-alpha", "4", "--branch-rollouts", "4", "--steps", "1", "--seed", "1",
        "--prompts-per-step", "6", "--num-rollouts", "8", "--eval-examples", "2",
        "--eval-every", "0", "--train-examples", "40", "--output-dir", str(out),
        "--no-progress", "--device", "cpu",
    ])
    assert summary["steps"] == 1
    assert json.loads((out / "config.json").read_text())["branch_rollouts"] == 4
    row = read_metrics(out / "metrics.csv")[0]
    assert row["branch_rows"] > 0 and 0 <= row["branch_correct_rate"] <= 1
    # the verifier samples nothing: every scorer token is a branch's
    assert row["scorer_tokens"] > 0
    assert row["decode_tokens"] == row["gen_tokens"] + row["scorer_tokens"]


def test_a_branch_rows_loss_and_gradient_come_from_its_step_alone(think_model):
    """At ratio 1 the grpo loss of the rows is minus the mean over rows of each step's mean
    advantage; one small gradient step on it raises the objective and widens the gap between
    the right and the wrong digit the two branches part at."""
    import copy

    from reasoning_from_scratch.grpo import batch_logprobs
    from reasoning_from_scratch.training import grpo_loss_on_batch
    model, tok = think_model
    model = copy.deepcopy(model)
    ro = type("R", (), {"prompt_ids": torch.tensor(tok.encode("Compute ((16-8)*7)-6"))})()
    prefix = tok.encode(" <think>\nStep 1: 16-8=8\n")
    good, bad = tok.encode("Step 2: 8*7=56\n"), tok.encode("Step 2: 8*7=54\n")
    rows = branch_rows([Branch(0, prefix, good, 1.0, 2.0), Branch(0, prefix, bad, 0.0, -1.0)],
                       [(EXAMPLE, ro)], pad_id=0)
    out = grpo_loss_on_batch(model, rows)
    assert float(out["loss"].detach()) == pytest.approx(-(2.0 - 1.0) / 2, abs=1e-5)
    m = rows.completion_mask.float()

    def objective_and_gap():
        with torch.no_grad():
            logp, _ = batch_logprobs(model, rows, with_entropy=False)  # (2, Tc)
        per_row = (logp * rows.advantages * m).sum(1) / m.sum(1)
        part = next(i for i, (x, y) in enumerate(zip(good, bad)) if x != y)
        col = len(prefix) + part  # the column of the digit the branches part at
        return float(per_row.mean()), float(logp[0, col] - logp[1, col])

    j0, gap0 = objective_and_gap()
    out["loss"].backward()
    torch.optim.SGD(model.parameters(), lr=1e-2).step()
    j1, gap1 = objective_and_gap()
    assert j1 > j0 and gap1 > gap0
