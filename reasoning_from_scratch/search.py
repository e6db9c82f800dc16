"""Searching over reasoning steps at inference time: PRM-guided beam search and self-refinement.

Where inference_scaling.py samples whole completions and picks one, this module works step by
step, with a step scorer (the blind step verifier, a learned PRM, the model's own confidence):

- `sample_next_steps`: K sampled next steps of many partial completions, decoded as one batch;
  a step ends at a newline (the arithmetic world writes one `Step k: a op b = c` per line, see
  `arithmetic.format_solution`), or at EOS for the final answer.
- `beam_search` (generic) and `step_beam_search` (with a model and a step scorer): sample K
  next steps for each of B beams, score every new prefix, keep the best B, until the beams have
  finished (Snell et al. 2024, "Scaling LLM Test-Time Compute Optimally can be More Effective
  than Scaling Model Parameters", arXiv 2408.03314, section 5: beam search against a PRM).
- `self_refinement_loop` / `self_refinement_batch` / `run_refinement`: draft -> critique ->
  refine rounds (Madaan et al. 2023, "Self-Refine", arXiv 2303.17651), stopping when the critic
  accepts, when the answer stops changing, or after a round limit. The bundled tiny model was
  pretrained only on prompt -> solution documents, so a "please revise" prompt means nothing to
  it; the refine step here is what such a model can do: keep the steps the critic accepts and
  resample from the first step it rejects. The critic is a `StepScoreCritic` over the blind step
  verifier (which step is wrong), a learned PRM, or the model itself (`ConfidenceStepScorer`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .generation import generate, generate_batch, left_pad, stop_token_ids
from .inference_scaling import (
    NO_ANSWER_SCORE,
    aggregate_step_scores,
    completion_step_texts,
    extract_answers,
    pool_answers,
    score_step_lists,
)
from .process import STEP_TAG_PATTERN
from .prompts import render_prompt
from .step_scorers import as_step_scorer
from .tokenizer import pad_id_of

_THINK_TAGS = re.compile(r"</?think>")


# ----------------------------------------------------------------------------------------------
# Sampling one step at a time
# ----------------------------------------------------------------------------------------------


@dataclass
class StepProposal:
    """One sampled next step of a partial completion."""

    text: str  # the step, ending with its newline (or the final answer, EOS dropped)
    num_tokens: int  # tokens sampled for it (EOS included)
    finished: bool  # True when the completion ended here (EOS)


def newline_token_ids(tokenizer) -> list[int]:
    """Ids of the tokens whose text contains a newline: the places a step can end."""
    return [i for i in range(tokenizer.vocab_size)
            if "\n" in tokenizer.decode([i], skip_special_tokens=False)]


def has_step_content(text: str) -> bool:
    """True if `text` holds more than whitespace, think tags and a `Step k:` tag."""
    return re.sub(STEP_TAG_PATTERN, "", _THINK_TAGS.sub("", text)).strip() != ""


def _sample_chunks(model, tokenizer, texts, k, device, max_tokens, stops, eos, sampling,
                   batch_size):
    """For each text, k (chunk text, tokens, ended at EOS) up to the first stop token."""
    out = []
    per_batch = max(1, batch_size // k)
    for b in range(0, len(texts), per_batch):
        ids, mask = left_pad([tokenizer.encode(t) for t in texts[b:b + per_batch]],
                             pad_id_of(tokenizer))
        gen = generate(model, ids.to(device), mask.to(device), max_new_tokens=max_tokens,
                       eos_token_id=stops, num_return_sequences=k, **sampling)
        for row in range(gen.completion_ids.shape[0]):
            real = gen.completion_ids[row][gen.completion_mask[row]].tolist()
            ended = bool(real) and real[-1] in eos
            text = tokenizer.decode(real[:-1] if ended else real, skip_special_tokens=False)
            out.append((text, len(real), ended))
    return [out[i * k:(i + 1) * k] for i in range(len(texts))]


@torch.no_grad()
def sample_next_steps(model, tokenizer, texts: Sequence[str], num_samples: int, device,
                      max_step_tokens: int = 32, temperature: float = 1.0, top_p: float = 1.0,
                      top_k: int | None = None, generator: torch.Generator | None = None,
                      stop_ids: Sequence[int] | None = None, batch_size: int = 256,
                      max_continuations: int = 3,
                      compile: bool = False) -> list[list[StepProposal]]:
    """`num_samples` next steps of each text (a prompt plus the completion so far).

    All texts are decoded together (left padded, each prefilled once and its cache repeated
    `num_samples` times, `batch_size` rows at a time). A row stops at a newline token
    (`stop_ids`, default `newline_token_ids`), at EOS (the completion is finished) or after
    `max_step_tokens`. A piece with no step content yet (" <think>\\n", "</think>\\n") is not a
    step: such rows are continued, up to `max_continuations` times, so the final answer after
    "</think>" is one step, as `process.split_steps` cuts it. Texts are re-encoded from their
    text each time (the model's own step boundaries are newline tokens, so nothing is split
    differently). `compile`: `generation.generate`'s compiled decode step.
    """
    eos = set(stop_token_ids(tokenizer))
    stops = sorted(eos | set(newline_token_ids(tokenizer) if stop_ids is None else stop_ids))
    sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k, generator=generator,
                    compile=compile)
    was_training = model.training
    model.eval()
    try:
        chunks = _sample_chunks(model, tokenizer, list(texts), num_samples, device,
                                max_step_tokens, stops, eos, sampling, batch_size)
        props = [[StepProposal(t, n, e) for t, n, e in row] for row in chunks]
        for _ in range(max_continuations):
            todo = [(i, j) for i, row in enumerate(props) for j, p in enumerate(row)
                    if not p.finished and not has_step_content(p.text)]
            if not todo:
                break
            more = _sample_chunks(model, tokenizer, [texts[i] + props[i][j].text for i, j in todo],
                                  1, device, max_step_tokens, stops, eos, sampling, batch_size)
            for (i, j), [(t, n, e)] in zip(todo, more):
                p = props[i][j]
                props[i][j] = StepProposal(p.text + t, p.num_tokens + n, e)
    finally:
        model.train(was_training)
    return props


# ----------------------------------------------------------------------------------------------
# Beam search over steps (Snell et al. 2024)
# ----------------------------------------------------------------------------------------------


@dataclass
class Beam:
    """A partial (or finished) completion in the beam."""

    text: str = ""  # the completion so far (steps joined)
    score: float = 0.0  # its score as a prefix (aggregated step scores)
    finished: bool = False
    num_tokens: int = 0  # tokens sampled along this beam's own path


# propose(prefixes as (problem index, completion so far), k) -> k proposals per prefix
Proposer = Callable[[list[tuple[int, str]], int], list[list[StepProposal]]]
# score([(problem index, completion, finished), ...]) -> one score per candidate
PrefixScorer = Callable[[list[tuple[int, str, bool]]], list[float]]


def _select(pool: list[Beam], width: int) -> list[Beam]:
    """The `width` best beams; equal scores keep pool order (deterministic)."""
    order = sorted(range(len(pool)), key=lambda i: (-pool[i].score, i))
    return [pool[i] for i in order[:width]]


def beam_search(num_problems: int, propose: Proposer, score: PrefixScorer, beam_width: int = 4,
                expansions: int = 4, max_steps: int = 64,
                max_tokens: int | None = None) -> list[dict]:
    """Step-level beam search for `num_problems` problems at once (Snell et al. 2024, sec. 5).

    Round 0 samples beam_width * expansions first steps from the empty completion; every later
    round samples `expansions` next steps from each unfinished beam. New prefixes are scored
    (`score`), duplicates (same text) kept once, and the `beam_width` best of (finished beams so
    far + new prefixes) survive; ties keep earlier candidates. A beam is finished at EOS or when
    its own path has used `max_tokens`. The search ends when every surviving beam is finished,
    or after `max_steps` rounds. Per problem: the best finished beam (else the best beam) as
    `text`, its `score`, `finished`, the tokens of *all* proposals (`num_generated_tokens`: the
    compute spent) and the number of `rounds`.
    """
    if beam_width < 1 or expansions < 1:
        raise ValueError(f"beam_width and expansions must be >= 1, got {beam_width}, "
                         f"{expansions}")
    beams = [[Beam()] for _ in range(num_problems)]
    spent = [0] * num_problems
    rounds = [0] * num_problems
    for step in range(max_steps):
        active = [(p, b) for p in range(num_problems) for b in beams[p] if not b.finished]
        if not active:
            break
        k = beam_width * expansions if step == 0 else expansions
        proposals = propose([(p, b.text) for p, b in active], k)
        new: list[list[Beam]] = [[] for _ in range(num_problems)]
        for (p, b), props in zip(active, proposals):
            rounds[p] = step + 1
            for prop in props:
                spent[p] += prop.num_tokens
                tokens = b.num_tokens + prop.num_tokens
                done = prop.finished or (max_tokens is not None and tokens >= max_tokens)
                new[p].append(Beam(b.text + prop.text, 0.0, done, tokens))
        for p in range(num_problems):  # identical prefixes waste beam slots: keep one
            seen = {b.text for b in beams[p] if b.finished}
            unique = []
            for b in new[p]:
                if b.text not in seen:
                    seen.add(b.text)
                    unique.append(b)
            new[p] = unique
        flat = [(p, b) for p in range(num_problems) for b in new[p]]
        for (_, b), s in zip(flat, score([(p, b.text, b.finished) for p, b in flat])):
            b.score = float(s)
        for p in range(num_problems):
            if new[p]:
                beams[p] = _select([b for b in beams[p] if b.finished] + new[p], beam_width)
    results = []
    for p in range(num_problems):
        done = [b for b in beams[p] if b.finished]
        best = _select(done or beams[p], 1)[0]
        results.append({"text": best.text, "score": best.score, "finished": best.finished,
                        "num_generated_tokens": spent[p], "rounds": rounds[p]})
    return results


def step_beam_search(model, tokenizer, prompts: Sequence[str], device, step_scorer,
                     examples: Sequence[dict] | None = None, beam_width: int = 4,
                     expansions: int = 4, aggregate: str = "last", max_new_tokens: int = 512,
                     max_step_tokens: int = 32, max_steps: int = 64, temperature: float = 1.0,
                     top_p: float = 1.0, top_k: int | None = None,
                     generator: torch.Generator | None = None, split_mode: str = "tags",
                     batch_size: int = 256) -> list[dict]:
    """PRM-guided (or verifier-guided) step-level beam search with a model, for many prompts.

    Steps come from `sample_next_steps`; a prefix's score is its step scores (`step_scorer`,
    e.g. a learned PRM's `PRMStepScorer`) aggregated by `aggregate` ("last": the PRM's estimate
    that everything so far is right, Snell et al.'s choice; or "min" / "prod"). A finished
    completion without a boxed answer scores `NO_ANSWER_SCORE`. `examples[i]` is what the step
    scorer may read (the problem text for the blind verifier); never the reference answer here.
    Returns `beam_search`'s dicts plus `final_answer` (strict extraction).
    """
    examples = list(examples) if examples is not None else [None] * len(prompts)
    scorer = as_step_scorer(step_scorer)
    stops = newline_token_ids(tokenizer)  # once: a real vocabulary has 150k tokens to decode

    def propose(prefixes, k):
        return sample_next_steps(model, tokenizer, [prompts[p] + text for p, text in prefixes],
                                 k, device, max_step_tokens, temperature, top_p, top_k,
                                 generator, stop_ids=stops, batch_size=batch_size)

    def score(candidates):
        groups = [(prompts[p], [completion_step_texts(text, split_mode)], examples[p])
                  for p, text, _ in candidates]
        step_scores = score_step_lists(scorer, groups)
        out = []
        for (_, text, finished), [s] in zip(candidates, step_scores):
            value = aggregate_step_scores(s, aggregate)
            if finished and extract_answers([text])[0] is None:
                value = NO_ANSWER_SCORE
            out.append(value)
        return out

    results = beam_search(len(prompts), propose, score, beam_width, expansions, max_steps,
                          max_new_tokens)
    for r in results:
        r["final_answer"] = extract_answers([r["text"]])[0]
    return results


# ----------------------------------------------------------------------------------------------
# Self-refinement (Madaan et al. 2023)
# ----------------------------------------------------------------------------------------------


class StepScoreCritic:
    """A critic from a step scorer: the first step scoring below `threshold` is the wrong one.

    `critic(prompts, texts, examples) -> [index of the first wrong step, or None]`, with steps
    cut by `process.split_steps`. Works with `BlindVerifierScorer` (1/0: which step is wrong),
    a learned PRM (P(step correct)) and `ConfidenceStepScorer` (the model's own confidence).
    """

    def __init__(self, step_scorer, threshold: float = 0.5, split_mode: str = "tags"):
        self.step_scorer = as_step_scorer(step_scorer)
        self.threshold, self.split_mode = threshold, split_mode

    def __call__(self, prompts, texts, examples) -> list[int | None]:
        steps = [completion_step_texts(t, self.split_mode) for t in texts]
        groups = [(p, [s], ex) for p, s, ex in zip(prompts, steps, examples)]
        out = []
        for [scores] in score_step_lists(self.step_scorer, groups):
            out.append(next((j for j, s in enumerate(scores) if s < self.threshold), None))
        return out


# critique(prompts, texts, examples) -> first wrong step per text (None: accepted)
Critic = Callable[[list[str], list[str], list], list]
# resample(prompts + kept prefixes) -> (continuation texts, tokens generated for each)
Resampler = Callable[[list[str]], tuple[list[str], list[int]]]


@dataclass
class _Refinement:
    """The state of one problem in `run_refinement`."""

    text: str
    answer: str | None
    tokens: int
    history: list = field(default_factory=list)
    stop_reason: str | None = None


def _same_answer(a: str | None, b: str | None) -> bool:
    """Both parseable and grader-equivalent (a None answer never counts as unchanged)."""
    return a is not None and b is not None and len(pool_answers([a, b])) == 1


def run_refinement(prompts: Sequence[str], drafts: Sequence[str], critique: Critic,
                   resample: Resampler, examples: Sequence | None = None, max_rounds: int = 4,
                   stop_when_unchanged: bool = True, draft_tokens: Sequence[int] | None = None,
                   split_mode: str = "tags") -> list[dict]:
    """The refinement loop, for many problems at once: critique, keep, resample, repeat.

    Each round, for every problem still running: the critic names the first wrong step of the
    current completion (None: accepted). Stop rules, in this order:
    1. "accepted": the critic finds no wrong step and the completion has a boxed answer;
    2. otherwise the steps before the wrong one are kept and the rest resampled; "unchanged":
       the new answer equals the previous one (both parseable; grader equivalence). A
       completion without a boxed answer is never accepted and is redone from the start,
       whatever the critic says: a model chooses its answer format with its first tokens
       (after "\nStep 1:" the tiny model ends with "The answer is 11.", never with a box);
    3. "max_rounds": `max_rounds` refinements done.
    Per problem: `final_text`, `final_answer`, `stop_reason`, `rounds` (refinements done),
    `num_generated_tokens` (draft + resampled tokens; critiques are scoring, not generation),
    and `history`: [(answer, tokens so far, step resampled from)] after the draft (step None)
    and after each round.
    """
    examples = list(examples) if examples is not None else [None] * len(prompts)
    draft_tokens = list(draft_tokens) if draft_tokens is not None else [0] * len(prompts)
    states = [_Refinement(t, extract_answers([t])[0], n) for t, n in zip(drafts, draft_tokens)]
    for s in states:
        s.history.append((s.answer, s.tokens, None))
    for _ in range(max_rounds):
        live = [i for i, s in enumerate(states) if s.stop_reason is None]
        if not live:
            break
        wrong = critique([prompts[i] for i in live], [states[i].text for i in live],
                         [examples[i] for i in live])
        redo, prefixes, redone = [], [], []
        for i, j in zip(live, wrong):
            s = states[i]
            if j is None and s.answer is not None:
                s.stop_reason = "accepted"
                continue
            steps = completion_step_texts(s.text, split_mode)
            if s.answer is None:
                j = 0  # no boxed answer: the format, chosen by the first tokens, was wrong
            redo.append(i)
            redone.append(j)
            prefixes.append("".join(steps[:j]))
        if not redo:
            continue
        conts, tokens = resample([prompts[i] + p for i, p in zip(redo, prefixes)])
        for i, j, prefix, cont, n in zip(redo, redone, prefixes, conts, tokens):
            s = states[i]
            new_text = prefix + cont
            new_answer = extract_answers([new_text])[0]
            unchanged = _same_answer(s.answer, new_answer)
            s.text, s.answer, s.tokens = new_text, new_answer, s.tokens + int(n)
            s.history.append((s.answer, s.tokens, j))
            if stop_when_unchanged and unchanged:
                s.stop_reason = "unchanged"
    results = []
    for s in states:
        results.append({"final_text": s.text, "final_answer": s.answer,
                        "stop_reason": s.stop_reason or "max_rounds",
                        "rounds": len(s.history) - 1, "num_generated_tokens": s.tokens,
                        "history": s.history})
    return results


def self_refinement_batch(model, tokenizer, problems: Sequence[str], device, critic: Critic,
                          examples: Sequence[dict] | None = None, max_rounds: int = 4,
                          max_new_tokens: int = 512, draft_temperature: float = 0.0,
                          temperature: float = 1.0, top_p: float = 1.0,
                          generator: torch.Generator | None = None,
                          prompt_fn: Callable[[str], str] = render_prompt,
                          stop_when_unchanged: bool = True, batch_size: int = 64,
                          compile: bool = False) -> list[dict]:
    """Draft (greedy by default) -> critique -> refine for many problems (`run_refinement`).

    Drafts and every round's resamples are decoded `batch_size` prompts at a time. The
    resample continues `prompt + kept steps` to EOS at `temperature` (a fresh attempt from the
    first rejected step). `examples[i]` is passed to the critic (the blind verifier reads the
    problem from it, never the answer). `compile`: `generation.generate`'s compiled decode step.
    """
    prompts = [prompt_fn(p) for p in problems]

    def complete(texts, temp):
        out_texts, out_tokens = [], []
        for b in range(0, len(texts), batch_size):
            chunk, ids, mask = generate_batch(model, tokenizer, list(texts[b:b + batch_size]),
                                              device, max_new_tokens, temperature=temp,
                                              top_p=top_p, generator=generator,
                                              compile=compile)
            out_texts += chunk
            out_tokens += mask.sum(dim=1).tolist()
        return out_texts, out_tokens

    drafts, draft_tokens = complete(prompts, draft_temperature)
    return run_refinement(prompts, drafts, critic, lambda texts: complete(texts, temperature),
                          examples, max_rounds, stop_when_unchanged, draft_tokens)


def self_refinement_loop(model, tokenizer, problem: str, device, critic: Critic,
                         example: dict | None = None, max_rounds: int = 4,
                         max_new_tokens: int = 512, draft_temperature: float = 0.0,
                         temperature: float = 1.0, top_p: float = 1.0,
                         generator: torch.Generator | None = None,
                         prompt_fn: Callable[[str], str] = render_prompt,
                         stop_when_unchanged: bool = True) -> dict:
    """The book's loop for one problem: draft, then critique and refine up to `max_rounds` times.

    See `run_refinement` for the stop rules and `self_refinement_batch` for the refine step.
    """
    return self_refinement_batch(model, tokenizer, [problem], device, critic,
                                 [example] if example is not None else None, max_rounds,
                                 max_new_tokens, draft_temperature, temperature, top_p,
                                 generator, prompt_fn, stop_when_unchanged)[0]
