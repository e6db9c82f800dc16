"""Branches at the first error (branching.py): states, step cuts, grades and advantages by hand,
the rows they make, and one training step that learns from them."""

import json
import math
import random
import re
from dataclasses import replace

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
from reasoning_from_scratch.generation import Branches, stop_token_ids
from reasoning_from_scratch.grpo import RolloutBatch, collect_rollouts
from reasoning_from_scratch.process import ANSWER_PATTERNS
from reasoning_from_scratch.process_supervision import make_process_advantage_fn
from reasoning_from_scratch.rewards import build_reward
from reasoning_from_scratch.run_log import read_metrics
from reasoning_from_scratch.training import GRPOConfig
from reasoning_from_scratch.weights import BUNDLED_MODELS, load_pretrained

EXAMPLE = {"problem": "Compute ((16-8)*7)-6", "answer": "50"}


@pytest.fixture(scope="module")
def think_model():
    return load_pretrained("tiny-arith-think", device="cpu")


def test_first_error_states_by_hand():
    # five completions; tokens: each step is two tokens (ends 1, 3, 5)
    rewards = [[1, 0, 0], [1, 1, 1], [1, 0, 1], [0, 0, 0], [1]]
    ends = [[1, 3, 5]] * 4 + [[1]]
    ids = torch.tensor([[7, 8, 9, 9, 9, 9],     # A: right, then wrong at step 2
                        [7, 8, 5, 6, 1, 2],     # B: right throughout (reaches A's state)
                        [7, 8, 4, 4, 4, 4],     # C: same prefix as A, wrong at step 2
                        [3, 3, 3, 3, 3, 3],     # D: wrong at step 1 (the prompt's state)
                        [7, 8, 0, 0, 0, 0]])    # E: one right step and no step 2
    states = first_error_states(rewards, ends, ids)
    # A and C share the state after step 1 (2 members; A, B, C reached it, B went on right;
    # E stopped there: no next step of its own); D's state is the prompt, reached by all five,
    # where A, B, C and E were right
    assert [(s.completion, s.cut, s.step, s.members, s.reached, s.right) for s in states] == [
        (0, 2, 1, 2, 3, 1), (3, 0, 0, 1, 5, 4)]
    assert len(first_error_states(rewards, ends, ids, max_states=1)) == 1
    assert first_error_states([[1, 1]], [[0, 1]], torch.tensor([[1, 2]])) == []
    # a step is right from `threshold` up: 0.3 is wrong at 0.5, right at 0.2
    assert [s.cut for s in first_error_states([[0.6, 0.3]], [[0, 1]], torch.tensor([[1, 2]]))
            ] == [1]
    assert first_error_states([[0.6, 0.3]], [[0, 1]], torch.tensor([[1, 2]]), 0.2) == []
    # three distinct states: two by default, the most shared then the earliest
    three = ([[1, 1, 0], [1, 0, 0], [0, 0, 0]], [[0, 1, 2]] * 3,
             torch.tensor([[1, 1, 1], [2, 2, 2], [3, 3, 3]]))
    assert [s.cut for s in first_error_states(*three)] == [0, 1]
    assert [s.cut for s in first_error_states(*three, max_states=3)] == [0, 1, 2]


def test_branch_advantages_by_hand():
    # the state's own samples: 1 wrong step; two right branches: q = (0, 1, 1), mean 2/3,
    # unbiased std sqrt(1/3): each branch (1 - 2/3) / sqrt(1/3) = 1/sqrt(3)
    got = branch_advantages([1, 1], right=0, wrong=1, eps=0.0)
    assert got == pytest.approx([1 / math.sqrt(3)] * 2, abs=1e-6)
    # q = (1, 0, 1, 0): mean 1/2, std sqrt(1/3): +-(1/2) / sqrt(1/3)
    got = branch_advantages([1, 0], right=1, wrong=1, eps=0.0)
    assert got == pytest.approx([math.sqrt(3) / 2, -math.sqrt(3) / 2], abs=1e-6)
    assert branch_advantages([0, 0, 0], right=0, wrong=2) == [0.0, 0.0, 0.0]  # all wrong
    # the defaults: one wrong own step (the first error), eps 1e-4
    assert branch_advantages([1, 1]) == pytest.approx(
        [(1 / 3) / (math.sqrt(1 / 3) + 1e-4)] * 2, rel=1e-6)
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
    # without a generator the permutation is random.Random(0)'s: reproducible
    assert branch_advantages([1, 0, 0, 1, 0], 2, 3, "shuffled") == branch_advantages(
        [1, 0, 0, 1, 0], 2, 3, "shuffled", random.Random(0))


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
    # a branch cut by its budget: its last token is text (no EOS to drop); one step is not the
    # end of the text, but an answer is
    for tail, trunc, final in (("Step 2: 8*7=56", True, False),
                               ("Step 2: 8*7=56\n", True, False),
                               ("</think>\n\\boxed{5", True, True)):
        ids = tok.encode(tail)
        n, steps, ends = branch_step_tokens(tok, whole, ids, trunc, 3)
        assert (n, steps[-1], ends) == (len(ids), tail, final)
    n, steps, final = branch_step_tokens(tok, prefix, tok.encode("Step 2: 8*7=56"), True, 1)
    assert steps[-1] == "Step 2: 8*7=56" and not final
    assert grade_branch_step(steps, EXAMPLE, final) == 1.0
    # finished (EOS): the text ends with its only step, not with the first of two
    n, steps, final = branch_step_tokens(tok, prefix, tok.encode("Step 2: 8*7=56\n") + [eos],
                                         truncated=False, step=1)
    assert n == len(tok.encode("Step 2: 8*7=56\n")) + 1 and final
    n, steps, final = branch_step_tokens(tok, prefix, branch + [eos], truncated=False, step=1)
    assert tok.decode(branch[:n]) == "Step 2: 8*7=56\n" and not final
    # the run's splitter: regex mode with its pattern
    n, steps, final = branch_step_tokens(tok, prefix, branch, True, 1, "regex", r"Step \d+:")
    assert tok.decode(branch[:n]) == "Step 2: 8*7=56\n" and steps[-1] == "Step 2: 8*7=56\n"
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
    # a right final answer without the think format is not paid, as the rollouts' is not
    plain = ["Step 1: 16-8=8\nStep 2: 8*7=56\nStep 3: 56-6=50\n", "\\boxed{50}"]
    assert grade_branch_step(plain, EXAMPLE, final=True) == 0.0


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
    assert branch_rows(branches, groups).input_ids.equal(rows.input_ids)  # pad id 0 by default
    # another pad id, prompts of two lengths (the shorter left padded, unattended), and the
    # rows on the device asked for; no rollout rewards of their own
    other = type("R", (), {"prompt_ids": torch.tensor([4])})()
    rows = branch_rows([Branch(0, [1], [2], 1.0, 1.0), Branch(1, [], [3, 3], 0.0, -1.0)],
                       [(EXAMPLE, ro), (EXAMPLE, other)], pad_id=99)
    assert rows.input_ids.tolist() == [[5, 6, 1, 2], [99, 4, 3, 3]]
    assert rows.attention_mask.tolist() == [[1, 1, 1, 1], [0, 1, 1, 1]]
    assert rows.rewards.numel() == 0
    on = branch_rows(branches, groups, device="meta")
    assert {t.device.type for t in (on.input_ids, on.completion_mask, on.advantages)} == {"meta"}
    on = branch_rows([Branch(0, [1], [2], 1.0, 1.0), Branch(1, [], [3, 3], 0.0, -1.0)],
                     [(EXAMPLE, ro), (EXAMPLE, other)], device="meta")
    assert on.attention_mask.device.type == "meta"


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
    # rows that carry statistics of their own leave the rollouts' as they were
    own = replace(rows, num_generated_tokens=7, zero_adv_frac=1.0, samples=[{"x": 1}])
    merged = with_branch_rows(batch, own, pad_id=99)
    assert merged.num_generated_tokens == batch.num_generated_tokens and merged.samples == \
        batch.samples and merged.zero_adv_frac == 0.5
    assert merged.input_ids[:2, 7:].tolist() == [[99, 99]] * 2  # padded with the pad id given
    with pytest.raises(ValueError, match="no sampler log-probs"):
        with_branch_rows(replace(batch, sampler_logp=torch.zeros(2, 4)), rows)
    with pytest.raises(ValueError, match=r"needs token advantages \(B, Tc\)"):
        with_branch_rows(replace(batch, advantages=torch.ones(2)), rows)


S1 = " <think>\nStep 1: 16-8=8\n"
HAND_GROUP = (S1 + "Step 2: 8*7=54\nStep 3: 54-6=48\n</think>\n\\boxed{48}",  # wrong at step 2
              S1 + "Step 2: 8*7=56\nStep 3: 56-6=50\n</think>\n\\boxed{50}",  # right
              " <think>\nStep 1: 16-8=9\nStep 2: 9*7=63\n</think>\n\\boxed{63}",  # wrong at 1
              S1 + "Step 2: 8*7=55\n</think>\n\\boxed{49}")  # wrong at step 2
HAND_REWARDS = [[1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0], [1, 0, 0]]


def _hand_group(tok):
    """EXAMPLE's group of the four HAND_GROUP completions (EOS-ended), and its process info."""
    from reasoning_from_scratch.generation import Rollouts
    from reasoning_from_scratch.process import completion_steps
    ids = [tok.encode(t) + [tok.eos_token_id] for t in HAND_GROUP]
    T = max(map(len, ids))
    padded = torch.tensor([c + [0] * (T - len(c)) for c in ids])
    ro = Rollouts(torch.tensor(tok.encode(EXAMPLE["problem"])), padded, padded != 0,
                  list(HAND_GROUP), torch.tensor([len(c) for c in ids]),
                  torch.zeros(len(ids), dtype=torch.bool))
    ends = [completion_steps(tok, torch.tensor(c), len(c), t, False)[1]
            for c, t in zip(ids, HAND_GROUP)]
    return ro, {"step_rewards": HAND_REWARDS, "step_ends": ends}


def test_sample_branches_by_hand(think_model, monkeypatch):
    """sample_branches on a hand-made group, its continuations scripted: two states (after S1,
    where A and D erred and B went on right: 1 right, 2 wrong own steps; the prompt, where C
    erred: 3 right, 1 wrong), k = 2 continuations of each from the right rows and cuts, within
    `min(max_new_tokens, rollout_tokens - cut)` (a state with no budget left is not branched),
    drawn with the run's sampling settings and the group's own seed; each cut after its first
    step and graded (an EOS ends the text: graded as a final step); advantages alpha x GRPO's
    over the state's samples; the cost summed over groups; the placebo's order from the
    group's own seed too."""
    import reasoning_from_scratch.branching as branching
    _, tok = think_model
    model = torch.nn.Linear(1, 1)  # never run: the continuations are scripted
    ro, info = _hand_group(tok)
    P, c1, eos = ro.prompt_len, len(tok.encode(S1)), tok.eos_token_id
    script = [(tok.encode("Step 2: 8*7=56\nStep 3: 56"), True),   # after S1: right
              (tok.encode("Step 2: 8*7=56\n") + [eos], False),   # ends the text: no answer
              (tok.encode(" <think>\nStep 1: 16-8=8\nStep 2: 8"), True),  # from the prompt: right
              (tok.encode(" <think>\nStep 1: 16-8=9\n"), True)]          # wrong
    calls = []

    def scripted(model_, seqs, cuts, budgets, temperature, top_p, stops, gen, compile):
        calls.append(dict(cuts=cuts, budgets=budgets, setting=(temperature, top_p, stops,
                          compile, model_.training), seed=gen.initial_seed()))
        out = [script[(n != P + c1) * 2 + cuts[:i].count((g, n)) % 2] for i, (g, n) in
               enumerate(cuts)]
        assert [seqs[g][:n] for g, n in cuts] == [ro.full_ids(g)[:n].tolist() for g, n in cuts]
        return Branches([o[0] for o in out], [o[1] for o in out],
                        sum(len(o[0]) for o in out), 10)

    monkeypatch.setattr(branching, "branch_continuations", scripted)
    config = BranchConfig(k=2, alpha=2.0, seed=3, max_new_tokens=24, rollout_tokens=c1 + 20,
                          temperature=0.7, top_p=0.9, split_mode="regex",
                          pattern=r"Step \d+:", compile=True)
    model.train()
    branches, cost = sample_branches(model, tok, [(EXAMPLE, ro)] * 2, [info] * 2, config)
    assert model.training
    assert branching._group_seed(3, ro) == 0xFA2A4C6511881EF  # pinned: which branches a run draws
    assert calls == [dict(cuts=[(0, P + c1)] * 2 + [(2, P)] * 2, budgets=[20, 20, 24, 24],
                          setting=(0.7, 0.9, [eos], True, False),
                          seed=branching._group_seed(3, ro))] * 2
    steps = [tok.decode(b.step_ids) for b in branches[:4]]
    assert steps == ["Step 2: 8*7=56\n", "Step 2: 8*7=56\n<|endoftext|>",
                     " <think>\nStep 1: 16-8=8\n", " <think>\nStep 1: 16-8=9\n"]
    assert [b.prefix for b in branches[:4]] == [tok.encode(S1)] * 2 + [[]] * 2
    assert [(b.group, b.correct) for b in branches] == [(0, 1.0), (0, 0.0), (0, 1.0), (0, 0.0),
                                                        (1, 1.0), (1, 0.0), (1, 1.0), (1, 0.0)]
    # after S1 q = (1, 0, 0 | 1, 0): mean 2/5, std sqrt(3/10); from the prompt
    # q = (1, 1, 1, 0 | 1, 0): mean 2/3, std sqrt(4/15); times alpha = 2
    after = [2 * x / (math.sqrt(3 / 10) + 1e-4) for x in (3 / 5, -2 / 5)]
    start = [2 * x / (math.sqrt(4 / 15) + 1e-4) for x in (1 / 3, -2 / 3)]
    assert [b.advantage for b in branches] == pytest.approx((after + start) * 2, rel=1e-6)
    drawn = sum(len(t) for t, _ in script)
    assert cost == {"branch_generated_tokens": 2 * drawn, "branch_prefill_tokens": 2 * 10,
                    "branch_states": 4}
    # budgets: the state after S1 keeps one token of budget, then none (not branched)
    for left, cuts in ((1, [(0, P + c1)] * 2 + [(2, P)] * 2), (0, [(2, P)] * 2)):
        calls.clear()
        sample_branches(model, tok, [(EXAMPLE, ro)], [info],
                        replace(config, rollout_tokens=c1 + left))
        assert calls[0]["cuts"] == cuts and calls[0]["budgets"][:1] == [left or c1]
    calls.clear()
    assert len(sample_branches(model, tok, [(EXAMPLE, ro)], [info],
                               replace(config, max_states=1))[0]) == 2  # the most shared
    # the placebo (k = 4: the script twice per state): each state's advantages permuted by
    # the group's own generator (seed + 1), reproducibly
    shuffled, _ = sample_branches(model, tok, [(EXAMPLE, ro)], [info],
                                  replace(config, k=4, seed=5, control="shuffled"))
    order = random.Random(branching._group_seed(6, ro))
    want = [2 * a for r, w in ((1, 2), (3, 1))
            for a in branch_advantages([1, 0, 1, 0], r, w, "shuffled", order)]
    assert [b.advantage for b in shuffled] == pytest.approx(want, rel=1e-6)


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
    """Branches of the think model's own groups: each one step within its budget, graded on
    that step after the verified prefix (not on the prefix's last step), with the advantage
    alpha * (q_b - mean q) / (std q + eps) over its state's samples (q: the `right` right and
    `reached - right` wrong next steps of the group, then the k branches); the same branches
    however the groups are ordered; the placebo permutes each state's advantages."""
    model, tok = think_model
    groups, infos = _scored_groups(model, tok)
    config = BranchConfig(k=4, alpha=4.0, seed=3)
    branches, cost = sample_branches(model, tok, groups, infos, config)
    assert branches and cost["branch_generated_tokens"] > 0 and cost["branch_states"] > 0
    assert len(branches) == 4 * cost["branch_states"]
    stops, states = stop_token_ids(tok), {}
    for b in branches:  # every branch is at most one step, within its budget
        text = tok.decode(b.step_ids)
        assert text.count("Step ") <= 1 and b.correct in (0.0, 1.0)
        assert 0 < len(b.step_ids) <= config.max_new_tokens
        ended = b.step_ids[-1] in stops
        step = tok.decode(b.step_ids[:-1] if ended else b.step_ids, skip_special_tokens=False)
        final = ended or any(re.search(p, step) for p in ANSWER_PATTERNS)
        before = [tok.decode(b.prefix, skip_special_tokens=False)] if b.prefix else []
        assert b.correct == grade_branch_step(before + [step], groups[b.group][0], final)
        states.setdefault((b.group, tuple(b.prefix)), []).append(b)
    told_apart = set()
    for (n, prefix), mine in states.items():
        ids, info = groups[n][1].completion_ids, infos[n]
        s, = [s for s in first_error_states(info["step_rewards"], info["step_ends"], ids)
              if tuple(ids[s.completion, :s.cut].tolist()) == prefix]
        q = torch.tensor([1.0] * s.right + [0.0] * (s.reached - s.right)
                         + [b.correct for b in mine])
        want = 4.0 * (q[-4:] - q.mean()) / (q.std() + 1e-4)
        assert [b.advantage for b in mine] == pytest.approx(want.tolist(), abs=1e-5)
        if want.any() and 2 * s.right != s.reached:
            told_apart.add("right and wrong counts")
        if s.step > 0 and not all(b.correct for b in mine):
            told_apart.add("a wrong step after a verified prefix")
    assert len(told_apart) == 2, told_apart  # this run holds what the checks above tell apart
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
    """One step of ch07_train.py with branches: their sampled tokens are counted as the step
    scorer's, and their rows enter the update: the saved weights moved from the bundled ones,
    and differ from those of the same step without branches (same seed, same rollouts)."""
    from safetensors.torch import load_file
    from test_training import _load_script

    def run(out, *flags):
        return _load_script("ch07_train").main([
            "--model", "tiny-arith-think", "--supervision", "process",
            "--step-scorer", "verifier-think", "--process-variant", "progress",
            "--process-alpha", "4", "--steps", "1", "--seed", "1",
            "--prompts-per-step", "6", "--num-rollouts", "8", "--eval-examples", "2",
            "--eval-every", "0", "--train-examples", "40", "--output-dir", str(out),
            "--no-progress", "--device", "cpu", *flags])

    out = tmp_path / "run"
    summary = run(out, "--branch-rollouts", "4")
    assert summary["steps"] == 1
    assert json.loads((out / "config.json").read_text())["branch_rollouts"] == 4
    row = read_metrics(out / "metrics.csv")[0]
    assert row["branch_rows"] > 0 and 0 <= row["branch_correct_rate"] <= 1
    # the verifier samples nothing: every scorer token is a branch's
    assert row["scorer_tokens"] > 0
    assert row["decode_tokens"] == row["gen_tokens"] + row["scorer_tokens"]
    run(tmp_path / "plain")
    start = load_file(BUNDLED_MODELS["tiny-arith-think"] / "model.safetensors")
    final, plain = (load_file(tmp_path / d / "final" / "model.safetensors")
                    for d in ("run", "plain"))
    assert sorted(final) == sorted(start) == sorted(plain)
    assert not any(torch.equal(final[k], start[k]) for k in start)  # the weights move
    assert not all(torch.equal(final[k], plain[k]) for k in start)  # the branches move them


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


def _rollout_rows(tok):
    """Three of HAND_GROUP's completions of EXAMPLE as a batch with token advantages."""
    from reasoning_from_scratch.grpo import pack_rollouts
    comps = [tok.encode(t) + [tok.eos_token_id] for t in HAND_GROUP[:3]]
    T = max(map(len, comps))
    ids = torch.tensor([c + [0] * (T - len(c)) for c in comps])
    mask = torch.arange(T)[None] < torch.tensor([len(c) for c in comps])[:, None]
    input_ids, am, P, cmask = pack_rollouts([torch.tensor(tok.encode(EXAMPLE["problem"]))],
                                            [ids], [mask])
    adv = cmask.float() * torch.tensor([[1.0], [-0.5], [0.25]])
    return RolloutBatch(input_ids, am, P, cmask, adv, torch.zeros(1, 3),
                        samples=[{"prompt_tokens": P}] * 3)


def _update_grad(model, batch, loss_type, mbs=None):
    """The gradient `training.update` leaves (SGD at lr 0, no clipping)."""
    import copy

    from reasoning_from_scratch import training
    m = copy.deepcopy(model)
    config = GRPOConfig(loss_type=loss_type, max_grad_norm=1e9, micro_batch_size=mbs)
    out = training.update(m, torch.optim.SGD(m.parameters(), lr=0.0), batch, None, None, config)
    assert out["skipped"] == 0
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten()
                      for p in m.parameters()])


@pytest.mark.parametrize("loss_type,mbs", [("grpo", None), ("grpo", 2), ("dapo", None),
                                           ("dapo", 2)])
def test_branch_rows_add_their_terms_without_diluting_the_rollouts(think_model, loss_type,
                                                                    mbs):
    """The rollouts keep the weight they have without branches: the gradient on rollouts +
    branch rows is the rollouts' own plus the branch rows' terms, each branch row weighted as
    one rollout (grpo: per row; dapo: per answer token); micro-batches change nothing.
    Dividing by every row instead (the mean over all rows) scales the whole gradient down, the
    rollouts' part to 3/5 of what it is without branches."""
    import copy

    from reasoning_from_scratch.grpo import batch_totals
    from reasoning_from_scratch.training import grpo_loss_on_batch
    model, tok = think_model
    rollouts = _rollout_rows(tok)
    prefix = tok.encode(" <think>\nStep 1: 16-8=8\n")
    good, bad = tok.encode("Step 2: 8*7=56\n"), tok.encode("Step 2: 8*7=54\n")
    ro = type("R", (), {"prompt_ids": torch.tensor(tok.encode(EXAMPLE["problem"]))})()
    rows = branch_rows([Branch(0, prefix, good, 1.0, 2.0), Branch(0, prefix, bad, 0.0, -1.0)],
                       [(EXAMPLE, ro)])
    merged = with_branch_rows(rollouts, rows)
    assert merged.extra_rows == 2 and merged.size == 5
    rows_all, tokens_all, own, own_tokens = batch_totals(merged)
    assert (rows_all, own) == (5, 3) and own_tokens == float(rollouts.completion_mask.sum())
    assert tokens_all == own_tokens + float(rows.completion_mask.sum())

    m = copy.deepcopy(model)
    scale = rows.size / 3 if loss_type == "grpo" else \
        float(rows.completion_mask.sum()) / own_tokens
    (grpo_loss_on_batch(m, rows, loss_type=loss_type)["loss"] * scale).backward()
    branch_grad = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten()
                             for p in m.parameters()])
    expected = _update_grad(model, rollouts, loss_type) + branch_grad
    got = _update_grad(model, merged, loss_type, mbs)
    assert torch.allclose(got, expected, rtol=1e-4, atol=1e-6)
    n_own, n_rows = (3, 2) if loss_type == "grpo" else (own_tokens, tokens_all - own_tokens)
    diluted = (n_own * _update_grad(model, rollouts, loss_type)
               + n_rows * branch_grad / scale) / (n_own + n_rows)  # the mean over every row
    assert torch.allclose(diluted, got * n_own / (n_own + n_rows), rtol=1e-4, atol=1e-6)
    assert not torch.allclose(got, diluted, rtol=1e-2, atol=1e-5)

