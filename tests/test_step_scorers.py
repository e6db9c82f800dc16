"""Tests for step_scorers.py and the rollouts -> token-advantage glue (process_supervision.py)."""

import pytest
import torch
from rollout_helpers import rollouts_from_texts

from reasoning_from_scratch.arithmetic import format_solution, make_split
from reasoning_from_scratch.process import process_advantages, split_steps, step_texts
from reasoning_from_scratch.process_supervision import (
    ProcessAdvantageFn,
    build_step_scorer,
    make_process_advantage_fn,
    process_token_advantages,
)
from reasoning_from_scratch.prompts import render_prompt
from reasoning_from_scratch.qwen3 import Qwen3Model, tiny_config
from reasoning_from_scratch.step_scorers import (
    CallableStepScorer,
    ForwardStepScorer,
    MonteCarloStepScorer,
    StepScorer,
    VerifierStepScorer,
    as_step_scorer,
)

EXAMPLE = {"problem": "Compute ((17+25)*3)-8", "answer": "118",
           "steps": ["17+25=42", "42*3=126", "126-8=118"]}
GOOD = " <think>\nStep 1: 17+25=42\nStep 2: 42*3=126\nStep 3: 126-8=118\n</think>\n\\boxed{118}"
# Step 2 is wrong (42*3 is not 124); step 3 correctly continues from the wrong 124.
BAD = " <think>\nStep 1: 17+25=42\nStep 2: 42*3=124\nStep 3: 124-8=116\n</think>\n\\boxed{116}"


def steps_of(text):
    return step_texts(text, split_steps(text))


@pytest.fixture(scope="module")
def tokenizer():
    from reasoning_from_scratch.tiny_world import train_bpe_tokenizer

    exs = make_split("train", 40, seed=0)
    texts = [render_prompt(e["problem"]) + format_solution(e) + "<|endoftext|>" for e in exs]
    return train_bpe_tokenizer(texts + [render_prompt(EXAMPLE["problem"]) + GOOD], vocab_size=300)


# ---------------------------------------------------------------------------------------------
# Verifier
# ---------------------------------------------------------------------------------------------


def test_verifier_scores_reference_and_wrong_step():
    v = VerifierStepScorer()
    assert v.score("p", steps_of(GOOD), EXAMPLE) == [1.0, 1.0, 1.0, 1.0]
    # After the first wrong step, later steps count as wrong (they can no longer reach 118).
    assert v.score("p", steps_of(BAD), EXAMPLE) == [1.0, 0.0, 0.0, 0.0]
    assert VerifierStepScorer(signed=True).score("p", steps_of(BAD), EXAMPLE) == [1, -1, -1, -1]
    # Without propagation the verifier credits step 3 (a correct operation on the written 124).
    assert VerifierStepScorer(propagate_errors=False).score("p", steps_of(BAD), EXAMPLE) == [
        1.0, 0.0, 1.0, 0.0]


def test_verifier_final_step_needs_boxed_answer_and_filler_steps_are_wrong():
    v = VerifierStepScorer()
    no_box = "\nStep 1: 17+25=42\nStep 2: 42*3=126\nStep 3: 126-8=118\nThe answer is 118."
    assert v.score("p", steps_of(no_box), EXAMPLE) == [1.0, 1.0, 0.0]
    assert VerifierStepScorer(final_step_is_outcome=False).score(
        "p", steps_of(no_box), EXAMPLE) == [1.0, 1.0, 1.0]
    # A direct answer is a single (answer) step, scored by its correctness.
    assert v.score("p", steps_of(" \\boxed{118}"), EXAMPLE) == [1.0]
    assert v.score("p", steps_of(" \\boxed{117}"), EXAMPLE) == [0.0]
    # A filler line in newline mode is an intermediate step without checkable work.
    text = "Let me think.\nStep 1: 17+25=42\n"
    assert v.score("p", step_texts(text, split_steps(text, "newlines")), EXAMPLE)[0] == 0.0


# ---------------------------------------------------------------------------------------------
# Monte-Carlo
# ---------------------------------------------------------------------------------------------


class ScriptedMC(MonteCarloStepScorer):
    """MC scorer whose continuations come from a table instead of a model."""

    def __init__(self, table, **kw):
        super().__init__(model=None, tokenizer=None, num_continuations=2, **kw)
        self.table, self.asked = table, []

    def _continue(self, texts):
        self.asked.extend(texts)
        return [self.table[t] for t in texts]


def test_mc_soft_hard_and_shared_prefixes():
    g, b = steps_of(GOOD), steps_of(BAD)
    p = "P:"
    table = {
        p + g[0]: ["Step 2: 42*3=126\n</think>\\boxed{118}", "</think>\\boxed{7}"],
        p + "".join(g[:2]): ["Step 3: 126-8=118\n</think>\\boxed{118}"] * 2,
        p + "".join(g[:3]): ["</think>\\boxed{118}", "</think>\\boxed{118}"],
        p + "".join(b[:2]): ["</think>\\boxed{116}", "</think>\\boxed{118}"],
        p + "".join(b[:3]): ["</think>\\boxed{116}", "</think>\\boxed{1}"],
    }
    soft = ScriptedMC(table, mode="soft")
    # Prefix values = fraction of the 2 continuations that end at 118; the final step is the
    # completion's own outcome.
    assert soft.score_group(p, [g, b], EXAMPLE) == [[0.5, 1.0, 1.0, 1.0], [0.5, 0.5, 0.0, 0.0]]
    # The shared first step of both completions is rolled out once.
    assert len(soft.asked) == 5 and len(set(soft.asked)) == 5
    hard = ScriptedMC(table, mode="hard")
    assert hard.score_group(p, [g, b], EXAMPLE) == [[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]]
    with pytest.raises(ValueError, match="mode"):
        ScriptedMC(table, mode="medium")


def test_mc_real_model_batched_and_costed(tokenizer):
    torch.manual_seed(0)
    model = Qwen3Model(tiny_config(vocab_size=tokenizer.vocab_size)).eval()
    mc = MonteCarloStepScorer(model, tokenizer, num_continuations=3, max_new_tokens=4,
                              batch_size=4, generator=torch.Generator().manual_seed(0))
    groups = [steps_of(GOOD), steps_of(BAD)]
    scores = mc.score_group(render_prompt(EXAMPLE["problem"]), groups, EXAMPLE)
    assert [len(s) for s in scores] == [4, 4]
    assert all(0.0 <= x <= 1.0 for s in scores for x in s)
    assert scores[0][-1] == 1.0 and scores[1][-1] == 0.0  # final steps = outcomes
    cost = mc.cost()
    # 5 distinct non-final prefixes x 3 continuations; at most 4 new tokens each.
    assert cost["mc_rollouts"] == 15
    assert 15 <= cost["mc_generated_tokens"] <= 60
    # each distinct prefix (prompt + steps so far) is prefilled once: forward tokens
    prompt = render_prompt(EXAMPLE["problem"])
    prefixes = {prompt + "".join(s[:j + 1]) for s in groups for j in range(len(s) - 1)}
    assert cost["forward_tokens"] == sum(len(tokenizer.encode(p)) for p in prefixes)
    assert not model.training


# ---------------------------------------------------------------------------------------------
# Adapters
# ---------------------------------------------------------------------------------------------


def test_adapters_and_as_step_scorer():
    class UserRM:  # a reward model called step by step: forward(prompt, step_text) -> float
        def forward(self, prompt, step_text):
            return float(len(step_text)) * 0.01 - (0.3 if "mistake" in step_text else 0.0)

    rm = as_step_scorer(UserRM())
    assert isinstance(rm, ForwardStepScorer)
    assert rm.score("p", ["abcd", "a mistake"], {}) == pytest.approx([0.04, 0.09 - 0.3])
    fn = as_step_scorer(lambda prompt, step: 1.0 if "=" in step else 0.0)
    assert isinstance(fn, CallableStepScorer)
    assert fn.score_group("p", [["1+1=2", "so"], ["x"]], {}) == [[1.0, 0.0], [0.0]]
    whole = CallableStepScorer(lambda p, steps, ex: [0.5] * len(steps), per_step=False)
    assert whole.score("p", ["a", "b"], {}) == [0.5, 0.5]
    bad = CallableStepScorer(lambda p, steps, ex: [1.0], per_step=False)
    with pytest.raises(ValueError, match="1 scores for 2 steps"):
        bad.score("p", ["a", "b"], {})
    v = VerifierStepScorer()
    assert as_step_scorer(v) is v and isinstance(v, StepScorer)
    with pytest.raises(TypeError):
        as_step_scorer(42)


def test_build_step_scorer_specs(tmp_path):
    assert isinstance(build_step_scorer("verifier"), VerifierStepScorer)
    assert build_step_scorer("verifier-signed").signed
    with pytest.raises(ValueError, match="policy"):
        build_step_scorer("mc")
    assert build_step_scorer("mc-hard", model=object(), tokenizer=object()).mode == "hard"
    with pytest.raises(ValueError, match="unknown step scorer"):
        build_step_scorer("oracle")
    with pytest.raises(FileNotFoundError):
        build_step_scorer(f"prm:{tmp_path}")


# ---------------------------------------------------------------------------------------------
# Rollouts -> token advantages
# ---------------------------------------------------------------------------------------------


def _rollouts(tokenizer, texts, truncated=()):
    """Rollouts of EXAMPLE's prompt with these completions (+ EOS unless truncated)."""
    return rollouts_from_texts(tokenizer, render_prompt(EXAMPLE["problem"]), texts, truncated)


def test_process_token_advantages_matches_hand_mapping(tokenizer):
    cut = GOOD[:30]  # a truncated completion: no EOS token
    ro = _rollouts(tokenizer, [GOOD, BAD, cut], truncated={2})
    adv, info = process_token_advantages(ro, EXAMPLE, tokenizer, VerifierStepScorer())
    assert adv.shape == ro.completion_ids.shape
    assert info["steps"][0] == steps_of(GOOD) and info["steps"][1] == steps_of(BAD)
    assert info["step_rewards"][:2] == [[1, 1, 1, 1], [1, 0, 0, 0]]
    # Step ends by hand: count the tokens of each step text; the EOS joins the last step.
    for g, text in enumerate([GOOD, BAD]):
        sizes = [len(tokenizer.encode(s)) for s in steps_of(text)]
        sizes[-1] += 1
        ends = torch.tensor(sizes).cumsum(0) - 1
        assert info["step_ends"][g] == ends.tolist()
    assert info["step_ends"][2][-1] == len(tokenizer.encode(cut)) - 1
    want = process_advantages(info["step_rewards"], info["step_ends"], ro.lengths)
    torch.testing.assert_close(adv[:, : want.shape[1]], want)
    # The good completion's tokens are pushed up; the bad one's step 2 onward pushed down.
    assert (adv[0, : int(ro.lengths[0])] > 0).all()
    e0 = info["step_ends"][1][0]
    assert (adv[1, e0 + 1 : int(ro.lengths[1])] < 0).all()
    assert info["stats"]["steps_per_completion"] == pytest.approx((4 + 4 + 1) / 3)


def test_process_advantage_hook_shapes(tokenizer):
    ro = _rollouts(tokenizer, [GOOD, BAD])
    hook = ProcessAdvantageFn(tokenizer, VerifierStepScorer(), variant="process+outcome")
    Tc = ro.completion_ids.shape[1] + 3  # the packed batch may be wider than this group
    mask = torch.zeros(2, Tc, dtype=torch.bool)
    mask[:, : ro.completion_ids.shape[1]] = ro.completion_mask
    out = hook([(EXAMPLE, ro, None)], torch.tensor([[1.0, -1.0]]), mask)
    assert out.shape == (2, Tc)
    assert torch.equal(out[~mask], torch.zeros(int((~mask).sum())))
    plain, _ = process_token_advantages(ro, EXAMPLE, tokenizer, VerifierStepScorer())
    torch.testing.assert_close(out[:, : plain.shape[1]],
                               (plain + torch.tensor([[1.0], [-1.0]])) * ro.completion_mask)
    assert hook.last_stats["step_correct_rate"] == pytest.approx(5 / 8)
    with pytest.raises(ValueError, match="variant"):
        ProcessAdvantageFn(tokenizer, VerifierStepScorer(), variant="avg")


# ---------------------------------------------------------------------------------------------
# A 3-step process-supervised GRPO run
# ---------------------------------------------------------------------------------------------


def test_three_step_process_supervised_training_run(tokenizer, tmp_path):
    import csv

    from reasoning_from_scratch.process_supervision import make_process_advantage_fn
    from reasoning_from_scratch.training import GRPOConfig, train_grpo

    torch.manual_seed(0)
    model = Qwen3Model(tiny_config(vocab_size=tokenizer.vocab_size, num_hidden_layers=1)).eval()
    before = [p.detach().clone() for p in model.parameters()]
    # A random model writes no correct step, so give the scorer a signal it can see: steps with
    # more digits score higher. The path under test is scorer -> token advantages -> loss.
    scorer = CallableStepScorer(lambda prompt, step: float(sum(c.isdigit() for c in step)))
    adv_fn = make_process_advantage_fn(tokenizer, scorer, variant="sum", split_mode="newlines")
    config = GRPOConfig(steps=3, prompts_per_step=2, num_rollouts=3, max_new_tokens=10, lr=1e-3,
                        warmup_steps=1, eval_every=0, eval_examples=2, sample_every=0,
                        skip_zero_advantage=False, supervision="process", progress=False,
                        output_dir=str(tmp_path / "run"))
    train, held_out = make_split("train", 6, seed=0), make_split("val", 2)
    summary = train_grpo(model, tokenizer, train, held_out, "cpu", config, advantage_fn=adv_fn)
    assert summary["steps"] == 3
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    with open(tmp_path / "run" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if int(r["step"]) >= 1]  # (step 0: base eval)
    assert len(rows) == 3 and all(r["skipped"] == "0" for r in rows)
    assert adv_fn.last_stats["steps_per_completion"] >= 1
    assert len(adv_fn.last_infos) == 2  # two prompts per step


def test_completion_steps_edge_cases(tokenizer):
    from reasoning_from_scratch.process import completion_steps

    eos = tokenizer.eos_token_id
    # Only the EOS: one empty step that owns the EOS token.
    assert completion_steps(tokenizer, torch.tensor([eos]), 1, "", False) == ([""], [0])
    assert completion_steps(tokenizer, torch.tensor([eos]), 0, "", False) == ([], [])
    # A non-canonical tokenisation (one token per character) still maps exactly.
    text = "Step 1: 12+3=15\n"
    ids = [i for ch in text for i in tokenizer.encode(ch)]
    assert ids != tokenizer.encode(text) or len(ids) == len(text)
    steps, ends = completion_steps(tokenizer, torch.tensor(ids + [eos]), len(ids) + 1, text, False)
    assert steps == [text] and ends == [len(ids)]


def test_make_process_advantage_fn_with_mc(tokenizer):
    torch.manual_seed(0)
    model = Qwen3Model(tiny_config(vocab_size=tokenizer.vocab_size, num_hidden_layers=1)).eval()
    fn = make_process_advantage_fn(tokenizer, "mc", model=model, mc_rollouts=2,
                                   mc_max_new_tokens=3)
    assert isinstance(fn.step_scorer, MonteCarloStepScorer) and fn.step_scorer.k == 2
    ro = _rollouts(tokenizer, [GOOD, BAD])
    out = fn([(EXAMPLE, ro, None)], torch.zeros(1, 2), ro.completion_mask)
    assert out.shape == ro.completion_ids.shape
    # 5 distinct non-final prefixes x 2 continuations, each up to 3 tokens
    assert fn.last_stats["mc_rollouts"] == 10 and fn.last_stats["mc_generated_tokens"] <= 30


# ---------------------------------------------------------------------------------------------
# Monte-Carlo from the group and branched caches (MonteCarloStepScorer(branch=True))
# ---------------------------------------------------------------------------------------------


def _fake_branches(tokenizer, continuation, asked):
    """A stand-in for generation.branch_continuations: every cut continues with `continuation`."""
    from reasoning_from_scratch.generation import Branches

    def fake(model, seqs, cuts, budgets, *args, **kwargs):
        asked.extend(cuts)
        ids = tokenizer.encode(continuation) + [tokenizer.eos_token_id]
        return Branches([list(ids) for _ in cuts], [False] * len(cuts), len(ids) * len(cuts),
                        0)

    return fake


@pytest.mark.parametrize("mode,k,expected_bad,asked_for", [
    # k = 2: steps 2 and 3 of BAD are the only prefixes with fewer than 2 completions through
    # them; each gets one continuation (it reaches 118), so its value is (0 + 1) / 2.
    ("soft", 2, [2 / 3, 0.5, 0.5, 0.0], 2),
    ("hard", 2, [1.0, 1.0, 1.0, 0.0], 2),
    # k = 4: step 1 (3 completions) needs 1 more, steps 2-3 of GOOD (2 each) need 2, BAD's 3.
    ("soft", 4, [3 / 4, 3 / 4, 3 / 4, 0.0], 1 + 2 + 2 + 3 + 3),
])
def test_mc_branch_counts_the_group_as_samples(tokenizer, monkeypatch, mode, k, expected_bad,
                                               asked_for):
    from reasoning_from_scratch import step_scorers

    asked = []
    monkeypatch.setattr(step_scorers, "branch_continuations",
                        _fake_branches(tokenizer, "</think>\n\\boxed{118}", asked))
    ro = _rollouts(tokenizer, [GOOD, GOOD, BAD])
    mc = MonteCarloStepScorer(torch.nn.Linear(1, 1), tokenizer, num_continuations=k, mode=mode,
                              branch=True)
    _, info = process_token_advantages(ro, EXAMPLE, tokenizer, mc)
    rewards = info["step_rewards"]
    assert len(asked) == asked_for and mc.rollouts == asked_for
    assert rewards[2] == pytest.approx(expected_bad)
    assert rewards[0] == rewards[1]  # identical completions, identical prefixes
    assert rewards[0][-1] == 1.0 and rewards[2][-1] == 0.0  # final steps: the outcomes
    # Continuations start where a step prefix ends, from the first completion through it
    # (never from completion 1, a copy of completion 0).
    P = ro.prompt_len
    assert {n for _, n in asked} <= {P + e + 1 for es in info["step_ends"] for e in es[:-1]}
    assert {i for i, _ in asked} <= {0, 2}
    # Samples from the group: 3 + 2 + 2 (GOOD's prefixes) + 1 + 1 (BAD's own).
    assert mc.cost()["mc_reused"] == 9


def test_mc_branch_on_a_real_model_costs_less_than_the_text_scorer(tokenizer):
    torch.manual_seed(0)
    model = Qwen3Model(tiny_config(vocab_size=tokenizer.vocab_size, num_hidden_layers=1)).eval()
    ro = _rollouts(tokenizer, [GOOD, GOOD, BAD, BAD])
    scorers = {spec: build_step_scorer(spec, model, tokenizer, num_continuations=3,
                                       max_new_tokens=40, temperature=1.0,
                                       generator=torch.Generator().manual_seed(0))
               for spec in ("mc", "mc-branch")}
    infos = {spec: process_token_advantages(ro, EXAMPLE, tokenizer, sc, variant="value-delta",
                                            outcome_advantages=torch.zeros(4))[1]
             for spec, sc in scorers.items()}
    for info in infos.values():
        assert [r[-1] for r in info["step_rewards"]] == [1.0, 1.0, 0.0, 0.0]
        assert all(0.0 <= x <= 1.0 for r in info["step_rewards"] for x in r)
    text, branch = (scorers[s].cost() for s in ("mc", "mc-branch"))
    # 5 distinct prefixes x 3 continuations for the text scorer. The branch scorer has all 4
    # completions through step 1 (no sampling) and 2 through each later prefix (one more each).
    assert text["mc_rollouts"] == 15 and branch["mc_rollouts"] == 4
    assert branch["mc_generated_tokens"] < text["mc_generated_tokens"]
    assert branch["mc_prefill_tokens"] > 0 and "mc_prefill_tokens" not in text
    assert branch["forward_tokens"] == branch["mc_prefill_tokens"]  # counted as forward
    assert not model.training


# ---------------------------------------------------------------------------------------------
# Answer belief (GRPO-VPS)
# ---------------------------------------------------------------------------------------------


def test_answer_cue_closes_an_open_think_block():
    from reasoning_from_scratch.step_scorers import answer_cue

    assert answer_cue(" <think>\nStep 1: 1+2=3\n") == "</think>\n\\boxed{"
    assert answer_cue(" <think>\nStep 1: 1+2=3") == "\n</think>\n\\boxed{"
    assert answer_cue("Step 1: 1+2=3\n") == "\\boxed{"


def test_answer_belief_by_hand_on_a_tiny_model(tokenizer):
    from reasoning_from_scratch.process_supervision import build_step_scorer
    from reasoning_from_scratch.step_scorers import AnswerBeliefStepScorer, answer_cue

    torch.manual_seed(0)
    model = Qwen3Model(tiny_config(vocab_size=tokenizer.vocab_size)).eval()
    scorer = AnswerBeliefStepScorer(model, tokenizer, batch_rows=3)  # rows in two batches
    prompt = render_prompt(EXAMPLE["problem"])
    good, bad = steps_of(GOOD), steps_of(BAD)
    values = scorer.score_group(prompt, [good, bad], EXAMPLE)
    assert values[0][-1] == 1.0 and values[1][-1] == 0.0  # last steps: the outcome
    # step 2's value of the wrong completion, by hand: one unpadded row
    prefix = "".join(bad[:2])
    ids = tokenizer.encode(prompt + prefix + answer_cue(prefix))
    ans = tokenizer.encode(EXAMPLE["answer"])
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids + ans])), dim=-1)[0]
    want = torch.stack([logp[len(ids) + j - 1, a] for j, a in enumerate(ans)]).mean().exp()
    assert values[1][1] == pytest.approx(float(want), abs=1e-5)
    assert all(0.0 < v < 1.0 for v in values[0][:-1] + values[1][:-1])
    # every token of the probed rows is counted: (len(good) - 1) + (len(bad) - 1) rows
    assert scorer.cost()["forward_tokens"] > (len(good) + len(bad) - 2) * len(ids) * 0.5
    assert isinstance(build_step_scorer("belief", model, tokenizer), AnswerBeliefStepScorer)
    with pytest.raises(ValueError, match="needs the policy model"):
        build_step_scorer("belief")


def test_belief_probes_from_the_rollouts_caches_equal_re_reading_them(tokenizer):
    """The branched probes give the beliefs a full re-read of the same token ids gives, at
    fewer forward tokens; the empty prefix gives V(s_0) on the same scale."""
    from reasoning_from_scratch.process import completion_steps
    from reasoning_from_scratch.step_scorers import AnswerBeliefStepScorer

    torch.manual_seed(0)
    model = Qwen3Model(tiny_config(vocab_size=tokenizer.vocab_size)).eval()
    ro = _rollouts(tokenizer, [GOOD, BAD, " \\boxed{118}"])
    steps, ends = zip(*[completion_steps(tokenizer, ro.completion_ids[g], int(ro.lengths[g]),
                                         ro.texts[g], False) for g in range(3)])
    scorer = AnswerBeliefStepScorer(model, tokenizer, batch_rows=3)  # probes in three batches
    values = scorer.score_rollouts("", ro, steps, ends, EXAMPLE)
    branched = scorer.cost()["forward_tokens"]
    answer_ids = tokenizer.encode("118")
    probes = scorer.probes(ro, steps, ends, answer_ids)
    assert len(probes) == 1 + sum(len(e) - 1 for e in ends)  # V(s_0) + non-final steps
    reread = AnswerBeliefStepScorer(model, tokenizer)
    want = reread.beliefs([(ro.full_ids(g).tolist()[:cut] + tail, len(answer_ids))
                           for g, cut, tail in probes])
    assert scorer.last_prompt_value == pytest.approx(want[0], abs=1e-5)
    got = [v for row in values for v in row[:-1]]
    assert got == [pytest.approx(w, abs=1e-5) for w in want[1:]]
    assert [row[-1] for row in values] == [1.0, 0.0, 1.0]  # last steps: the outcome
    assert branched < reread.cost()["forward_tokens"]  # each completion read once, not K times
    # value-delta's first credit starts from the probed V(s_0), not the group's mean outcome
    adv, _ = process_token_advantages(ro, EXAMPLE, tokenizer, scorer, variant="value-delta",
                                      outcome_advantages=torch.zeros(3))
    assert adv[0, 0].item() == pytest.approx(values[0][0] - scorer.last_prompt_value, abs=1e-5)


def test_make_process_advantage_fn_passes_compile_to_the_monte_carlo_scorer():
    """`mc_compile` reaches the scorers that decode; the verifier has nothing to compile."""
    for spec in ("mc", "mc-branch"):
        for flag in (False, True):
            fn = make_process_advantage_fn(object(), spec, model=object(), mc_compile=flag)
            assert fn.step_scorer.compile is flag
    assert not hasattr(make_process_advantage_fn(object(), "verifier").step_scorer, "compile")
