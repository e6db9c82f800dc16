"""Inference-time scaling (chapters 4 and 5): pass@k, voting, best-of-N, step-level beam search,
self-refinement and the measurement's bookkeeping. Hand-computed expectations; the bundled tiny
model only where sampling itself is under test."""

import itertools
import math
from fractions import Fraction
from types import SimpleNamespace

import pytest
import torch

import reasoning_from_scratch.inference_scaling as inference_scaling
from reasoning_from_scratch.arithmetic import make_split
from reasoning_from_scratch.experiments.inference_scaling import (
    beam_shape,
    plot_inference_scaling,
    sampling_rows,
    scaling_table,
)
from reasoning_from_scratch.inference_scaling import (
    NO_ANSWER_SCORE,
    BlindVerifierScorer,
    ConfidenceStepScorer,
    StepAggregateScorer,
    aggregate_step_scores,
    avg_logprob_answer,
    best_of_n,
    completion_step_texts,
    extract_answers,
    majority_is_decided,
    majority_vote,
    mean_logprobs,
    pass_at_k,
    pool_answers,
    select_best,
    self_consistency_vote,
    self_consistency_vote_batch,
    weighted_majority_vote,
)
from reasoning_from_scratch.prompts import render_prompt
from reasoning_from_scratch.search import (
    StepProposal,
    StepScoreCritic,
    beam_search,
    has_step_content,
    run_refinement,
    sample_next_steps,
    self_refinement_loop,
    step_beam_search,
)
from reasoning_from_scratch.weights import load_pretrained

EXAMPLE = {"problem": "Compute ((17+25)*3)-8", "answer": "118"}
GOOD = " <think>\nStep 1: 17+25=42\nStep 2: 42*3=126\nStep 3: 126-8=118\n</think>\n\\boxed{118}"
BAD = " <think>\nStep 1: 17+25=42\nStep 2: 42*3=124\nStep 3: 124-8=116\n</think>\n\\boxed{116}"


@pytest.fixture(scope="module")
def tiny():
    """The bundled tiny-arith model (0.8M parameters) and its tokenizer, on the CPU."""
    torch.set_num_threads(1)
    return load_pretrained("tiny-arith", device="cpu", dtype=torch.float32)


# ---------------------------------------------------------------------------------------------
# pass@k
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n, c, k, expected", [
    (5, 2, 1, 0.4),  # c / n
    (5, 2, 2, 0.7),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
    (10, 0, 5, 0.0),
    (4, 4, 1, 1.0),
    (4, 3, 2, 1.0),  # n - c = 1 < k: every pair holds a correct sample
    (4, 1, 4, 1.0),
    (6, 1, 3, 0.5),  # 1 - C(5,3)/C(6,3) = 1 - 10/20
    (200, 1, 100, 0.5),  # big binomials, still exact: 1 - 100/200
    (100, 50, 1, 0.5),
])
def test_pass_at_k_hand_computed(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-15)


def test_pass_at_k_equals_brute_force_over_subsets():
    for n in range(1, 8):
        for c in range(n + 1):
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(range(n), k))  # samples 0..c-1 correct
                hit = Fraction(sum(any(i < c for i in s) for s in subsets), len(subsets))
                assert pass_at_k(n, c, k) == pytest.approx(float(hit), abs=1e-15), (n, c, k)


@pytest.mark.parametrize("args", [(3, 4, 1), (3, -1, 1), (3, 1, 0), (3, 1, 4), (3.0, 1, 1)])
def test_pass_at_k_rejects_impossible_counts(args):
    with pytest.raises((ValueError, TypeError)):
        pass_at_k(*args)


# ---------------------------------------------------------------------------------------------
# Voting
# ---------------------------------------------------------------------------------------------


def test_majority_vote_pools_grader_equivalent_answers():
    answers = ["3", "\\frac{1}{2}", "1/2", "3", "0.5", "\\dfrac12"]
    assert pool_answers(answers) == [("3", [0, 3]), ("\\frac{1}{2}", [1, 2, 4, 5])]
    assert majority_vote(answers) == ("\\frac{1}{2}", 4)
    assert majority_vote(["10,000", "10000", "7"]) == ("10,000", 2)


def test_majority_vote_ties_go_to_the_earliest_answer():
    assert majority_vote(["7", "5", "5", "7"]) == ("7", 2)
    assert majority_vote(["5", "7", "7", "5"]) == ("5", 2)
    assert majority_vote(["9", "8", "7"]) == ("9", 1)


def test_unparseable_answers_never_win():
    assert majority_vote([None, None, "", "  ", "4"]) == ("4", 1)
    assert majority_vote([None, "", None]) == (None, 0)
    assert majority_vote([]) == (None, 0)
    assert extract_answers(["The answer is 11.", "so \\boxed{11}", "\\boxed{}"]) == [
        None, "11", None]
    assert extract_answers(["The answer is 11."], fallback="number_then_full") == ["11"]


def test_weighted_majority_vote():
    assert weighted_majority_vote(["1", "2", "2"], [0.9, 0.3, 0.4]) == ("1", 0.9)
    answer, weight = weighted_majority_vote(["0.5", "3", "1/2"], [0.3, 0.5, 0.3])
    assert (answer, weight) == ("0.5", pytest.approx(0.6))
    assert weighted_majority_vote(["4", "6"], [0.5, 0.5]) == ("4", 0.5)  # tie: earliest
    assert weighted_majority_vote([None, "6"], [-1.0, 0.1]) == ("6", 0.1)  # None's weight unused
    with pytest.raises(ValueError):
        weighted_majority_vote(["4"], [-0.1])
    with pytest.raises(ValueError):
        weighted_majority_vote(["4", "5"], [1.0])


def test_majority_is_decided():
    assert majority_is_decided(["3", "3", "3"], 2)  # 3 > 0 + 2
    assert not majority_is_decided(["3", "3", "4"], 1)  # 2 > 1 + 1 fails: a tie is possible
    assert majority_is_decided(["3", "3", "3", "4"], 1)  # 3 > 1 + 1
    assert not majority_is_decided([None, None, None], 1)
    assert majority_is_decided(["3", "4"], 0)


def _scripted_sampler(texts, calls):
    """A stand-in for `sample_rollouts` that returns the scripted texts in order."""
    queue = list(texts)

    def sample(model, tokenizer, prompt, g, device, **kwargs):
        calls.append(g)
        out = [queue.pop(0) for _ in range(g)]
        return SimpleNamespace(texts=out, lengths=torch.tensor([len(t) for t in out]))

    return sample


def test_self_consistency_early_stop_stops_when_decided_with_the_same_answer(monkeypatch):
    script = ["\\boxed{5}"] * 6 + ["\\boxed{4}"] * 4
    results = {}
    for early in (False, True):
        calls = []
        monkeypatch.setattr(inference_scaling, "sample_rollouts", _scripted_sampler(script, calls))
        results[early] = self_consistency_vote(None, None, "p", "cpu", num_samples=10,
                                               chunk_size=2, early_stop=early)
        results[early]["calls"] = calls
    full, early = results[False], results[True]
    # After 4 samples 4 > 0 + 6 fails; after 6 samples 6 > 0 + 4: stop.
    assert early["calls"] == [2, 2, 2] and early["stopped_early"]
    assert early["num_samples"] == 6 and early["votes"] == 6
    assert full["calls"] == [2] * 5 and not full["stopped_early"]
    assert full["final_answer"] == early["final_answer"] == "5"
    assert full["counts"] == {"5": 6, "4": 4} and full["groups"]["4"] == [6, 7, 8, 9]


def test_self_consistency_vote_takes_the_books_seed_and_progress(tiny, capsys):
    """This package's batched vote with the book's keyword arguments: `seed` is a generator
    seeded with it, and `show_progress` prints one line per sample."""
    model, tok = tiny
    kw = dict(num_samples=3, temperature=1.0, max_new_tokens=4, fallback="full")
    seeded = self_consistency_vote(model, tok, "3+4=", "cpu", show_progress=True, seed=7, **kw)
    assert capsys.readouterr().out.count("[Sample ") == 3
    assert seeded == self_consistency_vote(model, tok, "3+4=", "cpu",
                                           generator=torch.Generator().manual_seed(7), **kw)


def test_self_consistency_early_stop_matches_full_run_on_the_tiny_model(tiny):
    model, tok = tiny
    ex = make_split("test", 40)
    problems = [e for e in ex if e["level"] == 2][:2]
    stopped = 0
    for e in problems:
        for seed in range(2):
            runs = [self_consistency_vote(model, tok, render_prompt(e["problem"]), "cpu",
                                          num_samples=12, chunk_size=4, max_new_tokens=64,
                                          early_stop=early,
                                          generator=torch.Generator().manual_seed(seed))
                    for early in (False, True)]
            assert runs[0]["final_answer"] == runs[1]["final_answer"]
            assert runs[1]["num_samples"] <= runs[0]["num_samples"] == 12
            assert runs[1]["full_answers"] == runs[0]["full_answers"][:runs[1]["num_samples"]]
            stopped += runs[1]["stopped_early"]
    assert stopped > 0  # level 2 answers agree: the vote is decided early at least once


def test_self_consistency_batch_matches_votes(tiny):
    model, tok = tiny
    prompts = [render_prompt(e["problem"]) for e in make_split("test", 3)]
    out = self_consistency_vote_batch(model, tok, prompts, "cpu", num_samples=4, batch_size=2,
                                      max_new_tokens=48,
                                      generator=torch.Generator().manual_seed(0))
    assert len(out) == 3
    for r in out:
        assert r["num_samples"] == 4 and len(r["full_answers"]) == 4
        assert (r["final_answer"], r["votes"]) == majority_vote(r["short_answers"])
        assert r["num_generated_tokens"] > 0


# ---------------------------------------------------------------------------------------------
# Confidence scores
# ---------------------------------------------------------------------------------------------


def test_avg_logprob_answer_by_hand(tiny):
    model, tok = tiny
    prompt, answer = render_prompt(EXAMPLE["problem"]), GOOD
    p_ids, a_ids = tok.encode(prompt), tok.encode(answer)
    ids = torch.tensor([p_ids + a_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids)[0].float(), dim=-1)  # (T, V)
    expected = sum(float(logp[len(p_ids) + i - 1, t]) for i, t in enumerate(a_ids)) / len(a_ids)
    assert avg_logprob_answer(model, tok, prompt, answer, "cpu") == pytest.approx(expected,
                                                                                  abs=1e-5)
    assert avg_logprob_answer(model, tok, prompt, "", "cpu") == float("-inf")


def test_sampler_logprobs_are_the_models_at_temperature_one(tiny):
    model, tok = tiny
    from reasoning_from_scratch.generation import sample_rollouts_batch
    from reasoning_from_scratch.grpo import token_logprobs_and_entropy

    prompt = render_prompt(EXAMPLE["problem"])
    ro = sample_rollouts_batch(model, tok, [prompt], 3, "cpu", max_new_tokens=40,
                               temperature=1.0, top_p=1.0, return_logprobs=True,
                               generator=torch.Generator().manual_seed(1))[0]
    ids = torch.cat([ro.prompt_ids.expand(3, -1), ro.completion_ids], dim=1)
    with torch.no_grad():
        logp, _ = token_logprobs_and_entropy(model, ids, prompt_len=ro.prompt_len,
                                             completion_mask=ro.completion_mask)
    assert torch.allclose(logp, ro.logprobs, atol=1e-4)
    means = mean_logprobs(ro)
    for g in range(3):
        n = int(ro.lengths[g])
        assert means[g] == pytest.approx(float(logp[g, :n].mean()), abs=1e-4)


def test_confidence_step_scorer_by_hand(tiny):
    model, tok = tiny
    prompt = render_prompt(EXAMPLE["problem"])
    steps = completion_step_texts(GOOD)
    scores = ConfidenceStepScorer(model, tok).score(prompt, steps)
    ids, offsets = tok.encode_with_offsets(prompt + GOOD)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids]))[0].float(), dim=-1)
    bounds = [len(prompt)]
    for s in steps:
        bounds.append(bounds[-1] + len(s))
    expected = []
    for a, b in zip(bounds, bounds[1:]):  # a token belongs to the step its first char is in
        ks = [k for k, (s, _) in enumerate(offsets) if a <= s < b]
        expected.append(min(math.exp(float(logp[k - 1, ids[k]])) for k in ks))
    assert scores == pytest.approx(expected, abs=1e-5)


# ---------------------------------------------------------------------------------------------
# Step scores and best-of-N
# ---------------------------------------------------------------------------------------------


def test_blind_verifier_judges_steps_without_the_answer():
    v = BlindVerifierScorer()
    ex = {"problem": EXAMPLE["problem"]}  # no reference answer
    assert v.score("p", completion_step_texts(GOOD), ex) == [1.0, 1.0, 1.0, 1.0]
    assert v.score("p", completion_step_texts(BAD), ex) == [1.0, 0.0, 0.0, 0.0]
    boxed_wrong = GOOD.replace("\\boxed{118}", "\\boxed{117}")
    assert v.score("p", completion_step_texts(boxed_wrong), ex) == [1.0, 1.0, 1.0, 0.0]
    missing = " <think>\nStep 1: 17+25=42\nStep 2: 42*3=126\n</think>\n\\boxed{126}"
    assert v.score("p", completion_step_texts(missing), ex) == [1.0, 1.0, 0.0]
    assert v.score("p", completion_step_texts(" \\boxed{118}"), ex) == [0.0]
    prefix = " <think>\nStep 1: 17+25=42\nStep 2: 42*3=126\n"  # a beam-search prefix
    assert v.score("p", completion_step_texts(prefix), ex) == [1.0, 1.0]


def test_aggregate_step_scores_and_select_best():
    assert aggregate_step_scores([0.9, 0.5, 0.8], "min") == 0.5
    assert aggregate_step_scores([0.9, 0.5, 0.8], "prod") == pytest.approx(0.36)
    assert aggregate_step_scores([0.9, 0.5, 0.8], "last") == 0.8
    assert aggregate_step_scores([], "min") == 0.0
    with pytest.raises(ValueError):
        aggregate_step_scores([1.0], "mean")
    assert select_best([0.2, 0.7, 0.7, 0.1]) == 1  # ties: the earliest
    assert select_best([float("nan"), -5.0]) == 1


def test_step_aggregate_scorer_requires_an_answer():
    steps_answer = "\nStep 1: 17+25=42\nStep 2: 42*3=126\nStep 3: 126-8=118\nThe answer is 118."
    rollouts = SimpleNamespace(texts=[GOOD, BAD, steps_answer])
    ex = {"problem": EXAMPLE["problem"]}
    assert StepAggregateScorer(BlindVerifierScorer(), "min")("p", rollouts, ex) == [
        1.0, 0.0, NO_ANSWER_SCORE]
    assert StepAggregateScorer(BlindVerifierScorer(), "min", require_answer=False)(
        "p", rollouts, ex) == [1.0, 0.0, 1.0]


def test_best_of_n_picks_the_highest_score(tiny):
    model, tok = tiny

    def longest(prompt, rollouts, example):  # a hand-built scorer: longer is better
        return [float(n) for n in rollouts.lengths]

    out = best_of_n(model, tok, render_prompt(EXAMPLE["problem"]), "cpu", num_samples=4,
                    scorer=longest, max_new_tokens=64, generator=torch.Generator().manual_seed(0))
    lengths = out["scores"]
    assert out["best_index"] == lengths.index(max(lengths))
    assert out["final_answer"] == out["short_answers"][out["best_index"]]
    assert out["num_generated_tokens"] == int(sum(lengths))


# ---------------------------------------------------------------------------------------------
# Beam search
# ---------------------------------------------------------------------------------------------


def test_beam_search_on_a_hand_built_tree():
    # prefix -> its proposed next steps (text, tokens, finished); scores are hand-set per prefix
    tree = {
        "": [("A", 1, False), ("B", 1, False), ("C", 2, True), ("A", 1, False)],
        "A": [("1", 2, False), ("2", 2, True)],
        "B": [("1", 2, True), ("2", 2, False)],
        "B2": [("x", 3, True), ("y", 3, True)],
    }
    score_of = {"A": 0.9, "B": 0.8, "C": 0.5, "A1": 0.3, "A2": 0.6, "B1": 0.4, "B2": 0.95,
                "B2x": 0.2, "B2y": 0.7}
    asked = []

    def propose(prefixes, k):
        asked.append(([text for _, text in prefixes], k))
        return [[StepProposal(*p) for p in tree[text][:k]] for _, text in prefixes]

    def score(candidates):
        return [score_of[text] for _, text, _ in candidates]

    (res,) = beam_search(1, propose, score, beam_width=2, expansions=2)
    # Round 0 samples width x expansions = 4 first steps: A .9, B .8, C .5 (finished) and A
    # again (a duplicate, dropped) -> keep A, B.
    # Round 1: A1 .3, A2 .6 (finished), B1 .4 (finished), B2 .95 -> keep B2, A2.
    # Round 2: B2x .2, B2y .7 (both finished); with A2 .6 -> keep B2y, A2: all finished.
    assert asked == [([""], 4), (["A", "B"], 2), (["B2"], 2)]
    assert res["text"] == "B2y" and res["score"] == 0.7 and res["finished"]
    assert res["rounds"] == 3
    assert res["num_generated_tokens"] == (1 + 1 + 2 + 1) + (2 + 2 + 2 + 2) + (3 + 3)


def test_beam_search_token_budget_and_ties():
    def propose(prefixes, k):
        return [[StepProposal(f"x{j}", 5, False) for j in range(k)] for _ in prefixes]

    (res,) = beam_search(1, propose, lambda c: [0.5] * len(c), beam_width=1, expansions=2,
                         max_tokens=10)
    # Equal scores keep the earliest candidate; two steps of 5 tokens use the budget of 10.
    assert res["text"] == "x0x0" and res["finished"] and res["rounds"] == 2
    assert res["num_generated_tokens"] == 2 * 5 + 2 * 5


def test_sample_next_steps_stops_at_step_boundaries(tiny):
    model, tok = tiny
    prompt = render_prompt(EXAMPLE["problem"])
    props = sample_next_steps(model, tok, [prompt, prompt + " <think>\nStep 1: 17+25=42\n"], 4,
                              "cpu", generator=torch.Generator().manual_seed(0))
    assert [len(p) for p in props] == [4, 4]
    for row in props:
        for p in row:
            assert p.num_tokens >= 1
            assert p.finished or p.text.endswith("\n")
            assert has_step_content(p.text)
            assert p.finished or p.text.count("\n") <= 2  # " <think>\n" + one step line
    assert not has_step_content(" <think>\n") and not has_step_content("</think>\nStep 2:")


def test_step_beam_search_with_the_verifier(tiny):
    model, tok = tiny
    examples = make_split("test", 3)
    prompts = [render_prompt(e["problem"]) for e in examples]
    res = step_beam_search(model, tok, prompts, "cpu", BlindVerifierScorer(),
                           [{"problem": e["problem"]} for e in examples], beam_width=2,
                           expansions=2, aggregate="min", max_new_tokens=112,
                           generator=torch.Generator().manual_seed(0))
    for r in res:
        assert r["num_generated_tokens"] > 0 and r["rounds"] >= 1
        if r["finished"] and r["score"] == 1.0:  # a fully verified chain is right
            assert r["final_answer"] is not None


def test_beam_shape():
    assert beam_shape(1) == (1, 1) and beam_shape(2) == (1, 2) and beam_shape(16) == (4, 4)
    with pytest.raises(ValueError):
        beam_shape(6)


# ---------------------------------------------------------------------------------------------
# Self-refinement
# ---------------------------------------------------------------------------------------------


def test_refinement_stop_rules():
    drafts = {
        "A": " <think>\nStep 1: 1+1=2\n</think>\n\\boxed{2}",  # critic accepts
        "B": " <think>\nStep 1: 1+1=3\nStep 2: 3+1=4\n</think>\n\\boxed{4}",  # same answer again
        "C": " <think>\nStep 1: 1+1=3\n</think>\n\\boxed{3}",  # a new answer every round
        "D": " The answer is 2.",  # no boxed answer, no wrong step: redone from the start
        "E": "\nStep 1: 1+1=2\nStep 2: 2+2=5\nThe answer is 5.",  # no box, step 2 wrong
    }
    conts = {"B": iter(["Step 2: 3+1=4\n</think>\n\\boxed{4.0}"]),
             "C": iter([f" \\boxed{{{v}}}" for v in (5, 6, 7)]),
             "D": iter([" \\boxed{2}"]), "E": iter([" \\boxed{4}"])}
    asked = []

    def critique(prompts, texts, examples):
        return [None if p in "AD" or texts[i].endswith("}") and p == "E" else 1
                for i, p in enumerate(prompts)]

    def resample(texts):
        asked.extend(texts)
        out = [next(conts[t[0]]) for t in texts]
        return out, [10] * len(out)

    res = run_refinement(list("ABCDE"), [drafts[k] for k in "ABCDE"], critique, resample,
                         max_rounds=3, draft_tokens=[7, 7, 7, 7, 7])
    a, b, c, d, e = res
    assert (a["stop_reason"], a["rounds"], a["num_generated_tokens"]) == ("accepted", 0, 7)
    assert (b["stop_reason"], b["rounds"], b["final_answer"]) == ("unchanged", 1, "4.0")
    assert b["final_text"] == " <think>\nStep 1: 1+1=3\nStep 2: 3+1=4\n</think>\n\\boxed{4.0}"
    assert (c["stop_reason"], c["rounds"], c["final_answer"]) == ("max_rounds", 3, "7")
    assert [h[0] for h in c["history"]] == ["3", "5", "6", "7"]
    assert [h[1] for h in c["history"]] == [7, 17, 27, 37]
    # D: redone from step 0 in round 1 (prompt only), then accepted in round 2.
    assert (d["stop_reason"], d["rounds"], d["final_answer"]) == ("accepted", 1, "2")
    assert "D" in asked and "B <think>\nStep 1: 1+1=3\n" in asked  # kept prefix of B
    # E: the critic names step 2, but without a box the format is wrong: redone from the start.
    assert "E" in asked and (e["stop_reason"], e["final_answer"]) == ("accepted", "4")
    assert run_refinement(["A"], [drafts["A"]], critique, resample, max_rounds=0)[0][
        "stop_reason"] == "max_rounds"


def test_step_score_critic_finds_the_first_wrong_step():
    critic = StepScoreCritic(BlindVerifierScorer())
    ex = {"problem": EXAMPLE["problem"]}
    assert critic(["p", "p"], [GOOD, BAD], [ex, ex]) == [None, 1]


def test_self_refinement_loop_with_the_verifier_critic(tiny):
    model, tok = tiny
    ex = make_split("test", 5)[4]
    out = self_refinement_loop(model, tok, ex["problem"], "cpu",
                               StepScoreCritic(BlindVerifierScorer()),
                               example={"problem": ex["problem"]}, max_rounds=3,
                               max_new_tokens=112, generator=torch.Generator().manual_seed(0))
    assert out["stop_reason"] in ("accepted", "unchanged", "max_rounds")
    assert len(out["history"]) == out["rounds"] + 1 <= 4
    assert out["num_generated_tokens"] == out["history"][-1][1] > 0


# ---------------------------------------------------------------------------------------------
# The measurement's bookkeeping
# ---------------------------------------------------------------------------------------------


def test_sampling_rows_by_hand(tmp_path):
    pool = [  # two problems, three samples each
        {"texts": ["\\boxed{1}", "\\boxed{2}", "\\boxed{2}"], "tokens": [2, 4, 6],
         "logprob": [-0.1, -0.5, -0.2], "seconds": [1.0, 1.0, 1.0]},
        {"texts": ["no", "\\boxed{7}", "\\boxed{8}"], "tokens": [1, 1, 1],
         "logprob": [-0.01, -0.3, -0.2], "seconds": [0.5, 0.5, 0.5]},
    ]
    examples = [{"answer": "2"}, {"answer": "7"}]
    rows = sampling_rows(pool, examples, [1, 2, 3], methods=("majority", "logprob"))
    get = {(r["method"], r["n"]): r for r in rows}
    # pass@N from all 3 samples: problem 1 has c=2, problem 2 c=1.
    assert get["pass@N", 1]["accuracy"] == pytest.approx((2 / 3 + 1 / 3) / 2)
    assert get["pass@N", 2]["accuracy"] == pytest.approx((1.0 + 2 / 3) / 2)
    # Majority over the first N: N=1 -> "1" wrong, None (never wins) -> both wrong.
    assert get["majority", 1]["accuracy"] == 0.0
    assert get["majority", 2]["accuracy"] == 0.5  # tie 1 vs 2 -> "1"; problem 2: "7"
    assert get["majority", 3]["accuracy"] == 1.0  # "2" wins; problem 2: tie 7/8 -> "7"
    assert get["logprob", 3]["accuracy"] == 0.0  # -0.1 picks "1"; "no" has no answer -> "8"
    assert get["logprob", 2]["tokens"] == pytest.approx((2 + 4 + 1 + 1) / 2)
    assert get["logprob", 2]["seconds"] == pytest.approx(2.0 + 1.0)
    results = {"base": {"rows": rows, "num_examples": 2,
                        "greedy": {"method": "greedy", "n": 1, "accuracy": 0.5, "tokens": 3.0,
                                   "seconds": 0.2}}}
    table = scaling_table(results, tmp_path / "t.md")
    assert "| greedy | 1 | 0.500 | 3 | 0.2 |" in table
    assert "| self-consistency (majority vote) | 2 | 0.500 | 4 | 3.0 |" in table
    assert (tmp_path / "t.md").read_text() == table
    plot_inference_scaling(results, tmp_path / "fig.png")
    assert (tmp_path / "fig.png").stat().st_size > 1000
