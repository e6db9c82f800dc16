"""Inference-time scaling by sampling many answers and picking one (chapters 4 and 5).

More compute at inference time, no training: sample N completions of a problem and choose.

- `pass_at_k`: the unbiased estimator of "at least one of k samples is right" (Chen et al. 2021,
  "Evaluating Large Language Models Trained on Code", arXiv 2107.03374, eq. 1). It needs the
  reference answer, so it is an *oracle* reference line, not a method.
- `majority_vote` / `self_consistency_vote`: self-consistency (Wang et al. 2022, "Self-Consistency
  Improves Chain of Thought Reasoning in Language Models", arXiv 2203.11171): the most frequent
  final answer wins. Answers are pooled by grader equivalence (`pool_answers`), so `\\frac{1}{2}`,
  `1/2` and `0.5` are one vote bucket. `self_consistency_vote` can stop early, in chunks, once no
  other answer can overtake the leader (`majority_is_decided`).
- `best_of_n` with pluggable completion scorers (`scorer(prompt, rollouts, example) ->
  [score per completion]`): the model's own confidence (`avg_logprob_answer`, `logprob_scorer`),
  step scores aggregated over a completion (`StepAggregateScorer`: the exact step verifier of the
  arithmetic world, blind to the reference answer (`BlindVerifierScorer`), or a learned process
  reward model, as in Lightman et al. 2023, "Let's Verify Step by Step", arXiv 2305.20050, and
  Math-Shepherd, Wang et al. 2024, arXiv 2312.08935), and `oracle_scorer` (the exact answer check:
  cheating as a "verifier" on held-out problems, a reference line only).
  `weighted_majority_vote` is PRM-weighted voting (Math-Shepherd section 4; Uesato et al. 2022).

Step-level search (beam search guided by step scores) and self-refinement live in search.py.
All samples of a prompt share one prefill (`generation.sample_rollouts_batch`), and
`self_consistency_vote_batch` decodes the samples of many prompts as one batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from .arithmetic import parse_problem, parse_steps, verify_steps
from .generation import Rollouts, sample_rollouts, sample_rollouts_batch
from .grading import (
    extract_final_candidate,
    get_last_boxed,
    grade_answer,
    normalize_text,
    reward_rlvr,
)
from .grpo import sequence_logprob
from .prm import PRMStepScorer, encode_steps, score_steps_batch
from .process import split_steps, step_texts
from .step_scorers import StepScorer, as_step_scorer

AGGREGATES = ("min", "prod", "last")
NO_ANSWER_SCORE = -1.0  # a completion with nothing to grade ranks below every scored one

# A completion scorer: (prompt, the G sampled completions, example or None) -> G floats.
CompletionScorer = Callable[[str, Rollouts, "dict | None"], list]


# ----------------------------------------------------------------------------------------------
# pass@k (Chen et al. 2021)
# ----------------------------------------------------------------------------------------------


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k).

    Exact for every 0 <= c <= n and 1 <= k <= n: the binomials are Python integers (no
    overflow, no cancellation), divided once at the end; C(n-c, k) = 0 when n - c < k (every
    k-subset holds a correct sample). Chen et al. 2021 (arXiv 2107.03374) eq. 1: the probability
    that a uniformly drawn k-subset of the n samples contains a correct one.
    """
    for name, value in (("n", n), ("c", c), ("k", k)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"pass_at_k: {name} must be an int, got {value!r}")
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n, got c={c}, n={n}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 1 <= k <= n, got k={k}, n={n}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


# ----------------------------------------------------------------------------------------------
# Voting (Wang et al. 2022)
# ----------------------------------------------------------------------------------------------


def extract_answers(texts: Sequence[str], fallback: str = "none") -> list[str | None]:
    """Final answer of each completion (`extract_final_candidate`), None where there is none.

    `fallback="none"` (default) counts only boxed answers, the strict grading every chapter
    reports (a completion ending "The answer is 11." has no answer); "number_then_full" is the
    book's lenient extraction (last number when nothing is boxed).
    """
    out = []
    for text in texts:
        answer = extract_final_candidate(text, fallback=fallback)
        out.append(answer if answer and answer.strip() else None)
    return out


def pool_answers(answers: Sequence[str | None]) -> list[tuple[str, list[int]]]:
    """Vote buckets: (representative answer, indices of the answers in it), first seen first.

    Two answers share a bucket when the grader says they are equal (`grade_answer` either way
    round, after a cheap exact match of `normalize_text`): `\\frac{1}{2}`, `1/2` and `0.5` are one
    bucket. The representative is the bucket's first spelling. None, empty answers and answers
    that normalise to nothing are unparseable and in no bucket.
    """
    buckets: list[tuple[str, list[int]]] = []
    bucket_of_key: dict[str, int] = {}  # normalised text -> bucket (skips repeated grading)
    for i, answer in enumerate(answers):
        if answer is None or not str(answer).strip():
            continue
        answer = str(answer)
        key = normalize_text(answer)
        if not key:
            continue
        b = bucket_of_key.get(key)
        if b is None:
            b = next((j for j, (rep, _) in enumerate(buckets)
                      if grade_answer(answer, rep) or grade_answer(rep, answer)), None)
            if b is None:
                b = len(buckets)
                buckets.append((answer, []))
            bucket_of_key[key] = b
        buckets[b][1].append(i)
    return buckets


def majority_vote(answers: Sequence[str | None]) -> tuple[str | None, int]:
    """(most frequent answer, its votes); answers pooled by grader equivalence (`pool_answers`).

    Tie rule (deterministic): among buckets with the most votes, the one whose first answer
    came earliest wins (the order `collections.Counter.most_common` gives, as in the book).
    Unparseable answers (None, empty) never win over a parseable one; (None, 0) if all are.
    """
    buckets = pool_answers(answers)
    if not buckets:
        return None, 0
    rep, idx = max(buckets, key=lambda b: len(b[1]))  # max keeps the first of equal keys
    return rep, len(idx)


def weighted_majority_vote(answers: Sequence[str | None],
                           weights: Sequence[float]) -> tuple[str | None, float]:
    """(answer with the largest summed weight, that sum): e.g. PRM-weighted voting.

    Each answer votes with its weight (a verifier's or PRM's score of its completion), pooled
    as in `majority_vote` (Math-Shepherd, arXiv 2312.08935, section 4: "self-consistency +
    verifier"; Uesato et al. 2022, arXiv 2211.14275). Same tie rule (earliest bucket). The
    weights of parseable answers must be finite and >= 0; unparseable answers (whatever their
    weight) never win; (None, 0.0) if all are.
    """
    if len(weights) != len(answers):
        raise ValueError(f"{len(answers)} answers but {len(weights)} weights")
    buckets = pool_answers(answers)
    bad = [weights[i] for _, idx in buckets for i in idx
           if not math.isfinite(weights[i]) or weights[i] < 0]
    if bad:
        raise ValueError(f"weights of parseable answers must be finite and >= 0, got {bad}")
    if not buckets:
        return None, 0.0
    totals = [sum(float(weights[i]) for i in idx) for _, idx in buckets]
    best = max(range(len(buckets)), key=lambda b: totals[b])
    return buckets[best][0], totals[best]


def majority_is_decided(answers: Sequence[str | None], remaining: int) -> bool:
    """True when `remaining` more votes cannot change `majority_vote`'s winner.

    The leader has L votes, the runner-up R (0 if none); any other answer, old or new, can end
    with at most R + remaining votes, so the leader is safe when L > R + remaining (strictly: a
    tie would be broken by order, which we do not rely on). Always True when nothing remains.
    """
    if remaining < 0:
        raise ValueError(f"remaining must be >= 0, got {remaining}")
    if remaining == 0:
        return True
    counts = sorted((len(idx) for _, idx in pool_answers(answers)), reverse=True)
    leader = counts[0] if counts else 0
    runner_up = counts[1] if len(counts) > 1 else 0
    return leader > runner_up + remaining


def vote_record(texts: list[str], fallback: str, lengths: list[int] | None = None) -> dict:
    """The voting record of sampled completions `texts`: the book's keys (final_answer,
    full_answers, short_answers, counts, groups, majority_winners) plus votes, num_samples and,
    given their token counts `lengths`, num_generated_tokens. Short answers by `fallback`
    (`extract_answers`), pooled as in `majority_vote`."""
    short = extract_answers(texts, fallback)
    buckets = pool_answers(short)
    final, votes = majority_vote(short)
    top = max((len(idx) for _, idx in buckets), default=0)
    record = {
        "final_answer": final,
        "votes": votes,
        "full_answers": texts,
        "short_answers": short,
        "counts": {rep: len(idx) for rep, idx in buckets},
        "groups": {rep: idx for rep, idx in buckets},
        # the book's key: every answer with the top vote count (several on a tie)
        "majority_winners": [rep for rep, idx in buckets if len(idx) == top],
        "num_samples": len(texts),
    }
    if lengths is not None:
        record["num_generated_tokens"] = int(sum(lengths))
    return record


def self_consistency_vote(model, tokenizer, prompt: str, device, num_samples: int = 10,
                          temperature: float = 1.0, top_p: float = 1.0, top_k: int | None = None,
                          max_new_tokens: int = 512, early_stop: bool = False,
                          chunk_size: int | None = None,
                          generator: torch.Generator | None = None,
                          fallback: str = "none", show_progress: bool = False,
                          show_long_answer: bool = False, seed: int | None = None) -> dict:
    """Self-consistency (Wang et al. 2022): sample, extract the final answers, majority vote.

    Samples are drawn in chunks of `chunk_size` (default: all `num_samples` at once), each chunk
    one prefill shared by its samples (`sample_rollouts`). With `early_stop`, sampling stops after
    a chunk once the vote is decided (`majority_is_decided`): the final answer is then the same as
    without early stopping (same chunks, same generator), at a fraction of the tokens.
    Returns final_answer, votes, full_answers, short_answers, counts, groups, majority_winners,
    num_samples (drawn), num_generated_tokens and stopped_early.
    The book's arguments: `seed` seeds a generator when none is given; `show_progress` prints
    each sample's short answer, `show_long_answer` its full text.
    """
    if generator is None and seed is not None:
        generator = torch.Generator(device=device).manual_seed(seed)
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    chunk = num_samples if chunk_size is None else chunk_size
    if chunk < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    texts: list[str] = []
    lengths: list[int] = []
    stopped_early = False
    while len(texts) < num_samples:
        g = min(chunk, num_samples - len(texts))
        ro = sample_rollouts(model, tokenizer, prompt, g, device, max_new_tokens=max_new_tokens,
                             temperature=temperature, top_p=top_p, top_k=top_k,
                             generator=generator)
        for text in ro.texts:
            texts.append(text)
            if show_long_answer:
                print(text)
            if show_progress:
                short = extract_answers([text], fallback)[0]
                print(f"[Sample {len(texts)}/{num_samples}] -> {short!r}")
        lengths += ro.lengths.tolist()
        remaining = num_samples - len(texts)
        if early_stop and remaining and majority_is_decided(extract_answers(texts, fallback),
                                                            remaining):
            stopped_early = True
            break
    return {**vote_record(texts, fallback, lengths), "stopped_early": stopped_early}


def self_consistency_vote_batch(model, tokenizer, prompts: Sequence[str], device,
                                num_samples: int = 10, batch_size: int = 16,
                                temperature: float = 1.0, top_p: float = 1.0,
                                top_k: int | None = None, max_new_tokens: int = 512,
                                generator: torch.Generator | None = None,
                                fallback: str = "none") -> list[dict]:
    """`self_consistency_vote` for many prompts: `batch_size` prompts x `num_samples` samples are
    decoded as one batch (one prefill per prompt), so the per-token cost is shared by
    batch_size * num_samples rows. No early stopping (every row runs to its EOS anyway)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    results = []
    for b in range(0, len(prompts), batch_size):
        groups = sample_rollouts_batch(model, tokenizer, list(prompts[b:b + batch_size]),
                                       num_samples, device, max_new_tokens=max_new_tokens,
                                       temperature=temperature, top_p=top_p, top_k=top_k,
                                       generator=generator)
        for ro in groups:
            results.append({**vote_record(ro.texts, fallback, ro.lengths.tolist()),
                            "stopped_early": False})
    return results


# ----------------------------------------------------------------------------------------------
# Confidence: the model's own log-probabilities
# ----------------------------------------------------------------------------------------------


@torch.no_grad()
def avg_logprob_answer(model, tokenizer, prompt: str, answer: str, device="cpu") -> float:
    """Mean log-probability of the tokens of `answer` after `prompt` (the book's confidence).

    Prompt and answer are encoded separately and concatenated (the book's convention); the
    log-probs come from one plain forward pass, ``model(ids)`` (`grpo.sequence_logprob`), at
    temperature 1, the model's own distribution. -inf for an empty answer (never preferred).
    """
    prompt_ids, answer_ids = tokenizer.encode(prompt), tokenizer.encode(answer)
    if not answer_ids:
        return float("-inf")
    if not prompt_ids:
        raise ValueError("the prompt encodes to zero tokens")
    ids = torch.tensor(prompt_ids + answer_ids, dtype=torch.long, device=device)  # (L,)
    with torch.no_grad():
        return float(sequence_logprob(model, ids, len(prompt_ids))) / len(answer_ids)


def mean_logprobs(rollouts: Rollouts) -> list[float]:
    """Mean sampled-token log-prob of each completion, from the sampler's own record.

    Needs `sample_rollouts_batch(..., return_logprobs=True)`: log softmax(logits / T) of every
    generated token, EOS included, recorded while decoding (no extra forward pass). At T = 1 this
    is the model's distribution, as in `avg_logprob_answer` (which also leaves out the EOS).
    """
    if rollouts.logprobs is None:
        raise ValueError("these rollouts carry no log-probs: sample with return_logprobs=True")
    mask = rollouts.completion_mask.float()  # (G, T)
    total = (rollouts.logprobs * mask).sum(dim=1)  # (G,)
    count = mask.sum(dim=1)  # (G,)
    return [float(t / c) if c > 0 else float("-inf") for t, c in zip(total, count)]


def logprob_scorer(prompt: str, rollouts: Rollouts, example: dict | None = None) -> list[float]:
    """Completion scorer: the model's confidence (`mean_logprobs`); needs no reference."""
    return mean_logprobs(rollouts)


def oracle_scorer(prompt: str, rollouts: Rollouts, example: dict | None = None) -> list[float]:
    """Completion scorer that reads the reference answer: 1.0 if correct (strict), else 0.0.

    Not a verifier: on held-out problems it is cheating (best-of-N with it is pass@N). Use it
    only for the oracle reference line.
    """
    if example is None or "answer" not in example:
        raise ValueError("oracle_scorer needs the example with its reference answer")
    return [reward_rlvr(t, example["answer"]) for t in rollouts.texts]


# ----------------------------------------------------------------------------------------------
# Step scores -> one score per completion
# ----------------------------------------------------------------------------------------------


def completion_step_texts(text: str, split_mode: str = "tags") -> list[str]:
    """The steps of a completion (`process.split_steps`), [] for an empty text."""
    return step_texts(text, split_steps(text, split_mode))


def aggregate_step_scores(scores: Sequence[float], how: str = "min") -> float:
    """One completion score from its step scores: "min", "prod" or "last"; 0.0 with no steps.

    "min" and "prod" (Lightman et al. 2023 use the product of step correctness probabilities)
    punish any bad step; "last" trusts the score of the final step, which a PRM trained on
    first-error labels reads as P(everything so far is right) (Snell et al. 2024, arXiv
    2408.03314, found it best). A completion without steps (empty text) scores 0.0.
    """
    if how not in AGGREGATES:
        raise ValueError(f"unknown aggregate {how!r}; expected one of {AGGREGATES}")
    if len(scores) == 0:
        return 0.0
    if how == "min":
        return float(min(scores))
    if how == "prod":
        return float(math.prod(scores))
    return float(scores[-1])


def score_step_lists(step_scorer, groups) -> list[list[list[float]]]:
    """Step scores for groups of completions: `groups` = [(prompt, [steps, ...], example), ...].

    A learned PRM (`PRMStepScorer`) scores all completions of all groups in shared batches
    (one forward pass per batch of texts); other scorers go group by group (`score_group`).
    Empty step lists get [].
    """
    scorer = as_step_scorer(step_scorer)
    if isinstance(scorer, PRMStepScorer):
        items = [(p, list(s)) for p, steps_list, _ in groups for s in steps_list if s]
        flat = iter(score_steps_batch(scorer.prm, scorer.tokenizer, items,
                                      batch_size=max(scorer.batch_size, 64)))
        return [[next(flat) if s else [] for s in steps_list] for _, steps_list, _ in groups]
    out = []
    for prompt, steps_list, example in groups:
        nonempty = [list(s) for s in steps_list if s]
        scores = iter(scorer.score_group(prompt, nonempty, example) if nonempty else [])
        out.append([next(scores) if s else [] for s in steps_list])
    return out


class StepAggregateScorer:
    """Completion scorer from a step scorer: split, score every step, aggregate (min/prod/last).

    `step_scorer`: any chapter 8 scorer (`BlindVerifierScorer`, a learned PRM's `PRMStepScorer`,
    `MonteCarloStepScorer`) or `ConfidenceStepScorer`. Called as `scorer(prompt, rollouts,
    example)`; `score_texts` scores many prompts' completions at once. With `require_answer`
    (default) a completion without a boxed final answer scores `NO_ANSWER_SCORE` (-1, below any
    probability): its steps may look fine ("The answer is 11."), but there is nothing to grade.
    """

    def __init__(self, step_scorer, aggregate: str = "min", split_mode: str = "tags",
                 require_answer: bool = True):
        if aggregate not in AGGREGATES:
            raise ValueError(f"unknown aggregate {aggregate!r}; expected one of {AGGREGATES}")
        self.step_scorer = as_step_scorer(step_scorer)
        self.aggregate, self.split_mode = aggregate, split_mode
        self.require_answer = require_answer

    def step_scores(self, prompts, texts_per_prompt, examples) -> list[list[list[float]]]:
        """Per-step scores of every completion of every prompt."""
        groups = [(p, [completion_step_texts(t, self.split_mode) for t in texts], ex)
                  for p, texts, ex in zip(prompts, texts_per_prompt, examples)]
        return score_step_lists(self.step_scorer, groups)

    def score_texts(self, prompts, texts_per_prompt, examples) -> list[list[float]]:
        """One aggregated score per completion, for every prompt."""
        out = []
        for texts, group in zip(texts_per_prompt,
                                self.step_scores(prompts, texts_per_prompt, examples)):
            scores = [aggregate_step_scores(s, self.aggregate) for s in group]
            if self.require_answer:
                answers = extract_answers(texts)
                scores = [NO_ANSWER_SCORE if a is None else s for a, s in zip(answers, scores)]
            out.append(scores)
        return out

    def __call__(self, prompt: str, rollouts: Rollouts, example: dict | None = None):
        return self.score_texts([prompt], [rollouts.texts], [example])[0]


class BlindVerifierScorer(StepScorer):
    """The arithmetic world's exact step verifier, blind to the reference answer.

    `step_scorers.VerifierStepScorer(final_step_is_outcome=True)` checks the final answer against
    the reference, which on held-out problems is the oracle. This one judges only what a
    completion wrote: each `Step k: a op b = c` line with `arithmetic.verify_steps` (operands,
    operation and arithmetic), and the answer step (the one holding the boxed answer) is right
    when every operation of the problem has a verified step and the box repeats the last
    step's result. Steps without checkable work (and answers without a box) count as wrong, and
    after the first wrong step every later one does too (first-error labels, as a PRM learns
    them). Scores 1.0 / 0.0. Only for arithmetic chain problems (ValueError otherwise).
    """

    name = "blind-verifier"

    def correct_steps(self, steps: Sequence[str], example: dict) -> list[bool]:
        """Correctness of each step, judged without the reference answer."""
        n_ops = len(parse_problem(example["problem"])[1])
        exprs = [parse_steps(s) for s in steps]  # the 'a op b = c' parts of each step
        verdicts = verify_steps(example["problem"], [e for es in exprs for e in es])
        ok, k, last_result = [], 0, None
        for step, es in zip(steps, exprs):
            if es:
                good = all(verdicts[k:k + len(es)])
                k += len(es)
                last_result = es[-1].rsplit("=", 1)[-1].strip().rstrip(".")
            else:
                boxed = get_last_boxed(step)
                good = (boxed is not None and k == n_ops and all(verdicts)
                        and last_result is not None and boxed.strip() == last_result)
            ok.append(good)
        for j in range(1, len(ok)):
            ok[j] = ok[j] and ok[j - 1]
        return ok

    def score(self, prompt, steps, example):
        return [1.0 if good else 0.0 for good in self.correct_steps(steps, example)]


class ConfidenceStepScorer(StepScorer):
    """The model judging its own steps: per step, the probability of its least likely token.

    A slip (a forgotten carry) is often a low-probability token the sampler happened to draw, so
    a step whose least likely token is improbable (say < 0.3) is suspect. Needs no reference and
    no other model: the self-critique of `search.self_refinement_loop` (critic "self"). A weak
    critic on the tiny model: its correct steps also hold uncertain tokens. One forward pass per
    group of completions (right padded, no mask needed for a causal model).
    """

    name = "confidence"

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer

    @torch.no_grad()
    def score_group(self, prompt, steps_per_completion, example=None):
        encoded = [encode_steps(self.tokenizer, prompt, list(s)) for s in steps_per_completion]
        if not encoded:
            return []
        device = next(self.model.parameters()).device
        T = max(len(ids) for ids, _ in encoded)
        ids = torch.zeros(len(encoded), T, dtype=torch.long)
        for i, (row, _) in enumerate(encoded):
            ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
        logits = self.model(ids.to(device)).float()  # (B, T, V); right padding is never seen
        logp = torch.log_softmax(logits[:, :-1], dim=-1)  # row t predicts token t + 1
        token_logp = logp.gather(-1, ids[:, 1:].to(device)[..., None])[..., 0]  # (B, T-1)
        out = []
        for i, ((_, ends), steps) in enumerate(zip(encoded, steps_per_completion)):
            scores, start = [], self._first_step_token(prompt, steps)
            for end in ends:
                span = token_logp[i, start - 1:end]  # tokens start..end, predicted from t-1
                scores.append(float(span.min().exp()) if span.numel() else 1.0)
                start = end + 1
            out.append(scores)
        return out

    def _first_step_token(self, prompt: str, steps) -> int:
        """Index of the first token owned by the steps (a token belongs to the text its first
        character is in, as in `prm.encode_steps`); at least 1, so it has a predecessor."""
        _, offsets = self.tokenizer.encode_with_offsets(prompt + "".join(steps))
        return max(1, sum(1 for s, _ in offsets if s < len(prompt)))

    def score(self, prompt, steps, example=None):
        return self.score_group(prompt, [steps], example)[0]


# ----------------------------------------------------------------------------------------------
# Best-of-N
# ----------------------------------------------------------------------------------------------


def select_best(scores: Sequence[float]) -> int:
    """Index of the highest score; ties go to the earliest sample (deterministic). NaN loses."""
    if len(scores) == 0:
        raise ValueError("select_best: no scores")
    clean = [s if not math.isnan(s) else -math.inf for s in scores]
    return max(range(len(clean)), key=lambda i: clean[i])


def best_of_n(model, tokenizer, prompt: str, device, num_samples: int = 8,
              scorer: CompletionScorer = logprob_scorer, example: dict | None = None,
              max_new_tokens: int = 512, temperature: float = 1.0, top_p: float = 1.0,
              top_k: int | None = None, generator: torch.Generator | None = None,
              fallback: str = "none") -> dict:
    """Best-of-N: sample N completions (one prefill), score each with `scorer`, keep the best.

    `scorer(prompt, rollouts, example) -> [score per completion]`: `logprob_scorer` (default),
    `StepAggregateScorer(verifier or PRM, "min" | "prod" | "last")`, or `oracle_scorer` (the
    reference answer: a reference line, not a method). The completions are sampled with
    return_logprobs, so the confidence score costs nothing extra. Ties go to the earliest
    sample. Returns final_answer, best_index, scores, full_answers, short_answers and
    num_generated_tokens.
    """
    ro = sample_rollouts_batch(model, tokenizer, [prompt], num_samples, device,
                               max_new_tokens=max_new_tokens, temperature=temperature,
                               top_p=top_p, top_k=top_k, generator=generator,
                               return_logprobs=True)[0]
    scores = [float(s) for s in scorer(prompt, ro, example)]
    best = select_best(scores)
    short = extract_answers(ro.texts, fallback)
    return {"final_answer": short[best], "best_index": best, "scores": scores,
            "full_answers": ro.texts, "short_answers": short,
            "num_generated_tokens": int(ro.lengths.sum())}
