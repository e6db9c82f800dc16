"""Step scorers: one float per reasoning step, behind one small interface.

A step scorer answers `score(prompt, steps, example) -> list[float]` (one reward per step of one
completion) and `score_group(prompt, steps_per_completion, example) -> list[list[float]]` (all G
completions of a prompt, batched where that saves work). `steps` are the step texts from
`process.split_steps`; joined they give back the completion text. Scorers here:

- `VerifierStepScorer`: the exact arithmetic verifier of the tiny world (`arithmetic.verify_steps`).
- `MonteCarloStepScorer`: Math-Shepherd (Wang et al. 2024, arXiv 2312.08935, section 3.3): from
  each step prefix sample k continuations with the current policy; "soft" = fraction that reach
  the correct answer, "hard" = 1 if any does. Costs generated tokens, which it counts.
- `FormatStepScorer`: a placebo that sees only the think format (step 1: think or not).
- `AnswerBeliefStepScorer`: GRPO-VPS (Zhu et al. 2026, arXiv 2604.20659): the policy's own
  probability of the gold answer, appended with an answer cue after each step prefix; one
  batched forward per group, no sampling, no extra model.
- `ForwardStepScorer` / `CallableStepScorer`: adapters for any object with
  `forward(prompt, step_text) -> float` (a reward model called step by step) or any callable;
  `as_step_scorer` picks the right one.

The learned PRM's scorer (`PRMStepScorer`) lives in prm.py, next to the model, and
`process_supervision.build_step_scorer("verifier" | "verifier-signed" | "mc" | "prm:PATH", ...)`
builds any of them from a command-line string: both sit above this module.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from .arithmetic import parse_steps, verify_steps
from .evaluation import has_think_format
from .generation import (
    branch_continuations,
    gather_cache_rows,
    generate,
    prefill_rows,
    stop_token_ids,
)
from .grading import reward_rlvr


class StepScorer:
    """Interface: one reward per step. Subclasses implement `score`; `score_group` may batch."""

    name = "step_scorer"
    # V(s_0), the value of the prompt itself, of the last group scored, where the scorer
    # measures it on its own scale (the value forms' start, `process.anchored_credit`)
    last_prompt_value: float | None = None

    def score(self, prompt: str, steps: Sequence[str], example: dict) -> list[float]:
        """Rewards, one per entry of `steps`, for one completion of `prompt`."""
        raise NotImplementedError

    def score_group(
        self, prompt: str, steps_per_completion: Sequence[Sequence[str]], example: dict
    ) -> list[list[float]]:
        """Rewards of all completions of one prompt (default: one `score` call each)."""
        return [self.score(prompt, steps, example) for steps in steps_per_completion]

    def cost(self) -> dict[str, float]:
        """Work done so far (e.g. generated tokens); empty for free scorers."""
        return {}

    def score_rollouts(self, prompt: str, rollouts, steps_per_completion: Sequence[Sequence[str]],
                       step_ends: Sequence[Sequence[int]], example: dict) -> list[list[float]]:
        """Rewards of a group given as sampled `generation.Rollouts` too (their token ids and
        each step's last token index, as `process.completion_steps` gives them). Scorers that
        can reuse the rollouts' tokens override this; the default scores the texts."""
        return self.score_group(prompt, steps_per_completion, example)


def _check_lengths(scorer, steps, scores) -> list[float]:
    """A scorer must return exactly one finite float per step."""
    scores = [float(s) for s in scores]
    if len(scores) != len(steps):
        raise ValueError(f"{type(scorer).__name__} returned {len(scores)} scores for "
                         f"{len(steps)} steps")
    return scores


# ----------------------------------------------------------------------------------------------
# Exact verifier
# ----------------------------------------------------------------------------------------------


class VerifierStepScorer(StepScorer):
    """Exact step rewards from the arithmetic world's verifier: correct 1, wrong 0 (or +1 / -1).

    A step is correct when every `Step k: a op b = c` line in it verifies (in order across the
    whole completion, see `arithmetic.verify_steps`). Choices, all documented options:
    - `propagate_errors=True`: after the first wrong step every later step counts as wrong. The
      verifier alone credits a step that correctly continues from a wrong result, but in a chain
      problem such a step can no longer reach the right answer; propagating matches PRM800K's
      first-error labels and Math-Shepherd's "can this prefix still succeed" labels.
    - `final_step_is_outcome=True`: the last step must also carry a correct boxed answer
      (`reward_rlvr` of the full completion), so all-correct steps with a missing or wrong final
      answer are not fully rewarded.
    - steps with no checkable `Step k:` line that are not the last step count as wrong (so the
      policy cannot farm reward with filler steps).
    - `signed=True` gives +1 / -1 instead of 1 / 0.
    - `think_only=True`: work shown outside the `<think>...</think>` format the outcome reward
      pays for counts as not shown: every step of a completion without that format is wrong.
      Otherwise a progress reward pays for correct steps in the plain formats ("Step 1: ...
      The answer is 82.") as much as in the think format, and the policy drifts to them.
    """

    name = "verifier"

    def __init__(self, signed: bool = False, propagate_errors: bool = True,
                 final_step_is_outcome: bool = True, think_only: bool = False):
        self.signed = signed
        self.propagate_errors = propagate_errors
        self.final_step_is_outcome = final_step_is_outcome
        self.think_only = think_only

    def correct_steps(self, steps: Sequence[str], example: dict) -> list[bool]:
        """Correctness of each step (before mapping to reward values)."""
        if self.think_only and not has_think_format("".join(steps)):
            return [False] * len(steps)
        exprs = [parse_steps(s) for s in steps]  # the 'a op b = c' parts of each step
        flat = [e for es in exprs for e in es]
        verdicts = verify_steps(example["problem"], flat) if flat else []
        ok, k = [], 0
        for j, es in enumerate(exprs):
            good = all(verdicts[k : k + len(es)])
            k += len(es)
            last = j == len(steps) - 1
            if last and self.final_step_is_outcome:
                good = good and reward_rlvr("".join(steps), example["answer"]) == 1.0
            elif not es:
                good = False  # no checkable work in an intermediate step
            ok.append(good)
        if self.propagate_errors:
            for j in range(1, len(ok)):
                ok[j] = ok[j] and ok[j - 1]
        return ok

    def score(self, prompt, steps, example):
        wrong = -1.0 if self.signed else 0.0
        return [1.0 if good else wrong for good in self.correct_steps(steps, example)]


class FormatStepScorer(StepScorer):
    """A placebo scorer that sees only the format: step 1 scores 1.0 for a think-format
    completion (0.0 otherwise), every later step 0.0. With the `progress` form the credit is
    `(f_i - mean f) / std f` on the first step and nothing else: a format reward placed where
    the think-only verifier's credit mostly lands, without any arithmetic."""

    name = "format"

    def score(self, prompt, steps, example):
        think = 1.0 if has_think_format("".join(steps)) else 0.0
        return [think] + [0.0] * (len(steps) - 1)


# ----------------------------------------------------------------------------------------------
# Answer belief (GRPO-VPS)
# ----------------------------------------------------------------------------------------------


def answer_cue(prefix: str) -> str:
    """Text that asks for the final answer right after `prefix`: close an open think block,
    then open the box, as the think format ends (`"\\n</think>\\n\\boxed{"`)."""
    newline = "" if prefix.endswith("\n") or not prefix else "\n"
    if "<think>" in prefix and "</think>" not in prefix:
        return newline + "</think>\n\\boxed{"
    return newline + "\\boxed{"


class AnswerBeliefStepScorer(StepScorer):
    """Step values from the policy's belief in the gold answer (GRPO-VPS, arXiv 2604.20659).

    After each step prefix but the last, the value is `exp(mean log p(answer tokens | prompt +
    prefix + answer_cue(prefix)))`, the geometric mean probability of the gold answer's tokens,
    in [0, 1]; the last step's value is the outcome (`reward_rlvr` of the completion, 1 or 0),
    as VinePPO's last step. Use it with the `value-delta` form: a step's credit is how much it
    raised the belief.

    Given the rollouts (`score_rollouts`, as training calls it), the probes branch from their
    KV caches: each completion is prefilled once up to its last probed step, and each probe
    reads only its cue and the answer from a copy of that cache cut at its step
    (`generation.gather_cache_rows`), O(L) per completion instead of O(K L); the empty prefix
    (the prompt alone) is probed too, so V(s_0) is a belief on the same scale as V(s_k)
    (`last_prompt_value`). Given texts only (`score_group`), each probe re-reads prompt +
    prefix + cue + answer in one right-padded no-grad forward (causal attention, so the
    padding after a row never reaches it). Every token run counts as a forward token (read,
    not sampled: `cost()["forward_tokens"]`).
    """

    name = "belief"

    def __init__(self, model, tokenizer, device=None, batch_rows: int = 64):
        self.model, self.tokenizer = model, tokenizer
        self.device = device if device is not None else next(model.parameters()).device
        self.batch_rows = batch_rows
        self.tokens = 0

    def cost(self):
        return {"forward_tokens": float(self.tokens)}

    def _rows(self, prompt, steps_per_completion, answer):
        """(ids, answer length) of every (completion, step prefix) to probe, and their keys."""
        answer_ids = self.tokenizer.encode(answer)
        rows, keys = [], []
        for i, steps in enumerate(steps_per_completion):
            for k in range(1, len(steps)):  # the last step is scored by the outcome
                prefix = "".join(steps[:k])
                ids = self.tokenizer.encode(prompt + prefix + answer_cue(prefix))
                rows.append((ids + answer_ids, len(answer_ids)))
                keys.append((i, k - 1))
        return rows, keys

    @torch.no_grad()
    def beliefs(self, rows) -> list[float]:
        """exp(mean log-prob) of each row's last `n` tokens, `rows` = [(ids, n), ...]."""
        out = []
        for start in range(0, len(rows), self.batch_rows):
            chunk = rows[start:start + self.batch_rows]
            width = max(len(ids) for ids, _ in chunk)
            batch = torch.zeros(len(chunk), width, dtype=torch.long)
            for r, (ids, _) in enumerate(chunk):  # right padding: positions stay 0..len-1
                batch[r, : len(ids)] = torch.tensor(ids)
            # The logits only where an answer token is predicted: a real vocabulary at every
            # position of every row would not fit.
            rows_idx = [r for r, (ids, n) in enumerate(chunk) for _ in range(n)]
            pos_idx = [len(ids) - n - 1 + j for ids, n in chunk for j in range(n)]
            targets = torch.tensor([t for ids, n in chunk for t in ids[len(ids) - n:]])
            h = self.model.forward_hidden(batch.to(self.device))  # (B, T, C)
            logits = self.model.lm_head(h[rows_idx, pos_idx]).float()  # (answer tokens, V)
            lp = torch.log_softmax(logits, dim=-1).cpu().gather(-1, targets[:, None])[:, 0]
            for piece in lp.split([n for _, n in chunk]):
                out.append(float(piece.mean().exp()))
            self.tokens += sum(len(ids) for ids, _ in chunk)
        return out

    def score_group(self, prompt, steps_per_completion, example):
        self.last_prompt_value = None  # not probed: the value form falls back to its default
        answer = str(example["answer"])
        rows, keys = self._rows(prompt, steps_per_completion, answer)
        values = [[0.0] * len(s) for s in steps_per_completion]
        for (i, j), v in zip(keys, self.beliefs(rows)):
            values[i][j] = v
        for i, steps in enumerate(steps_per_completion):
            if steps:
                values[i][-1] = reward_rlvr("".join(steps), answer)
        return values

    def score(self, prompt, steps, example):
        return self.score_group(prompt, [steps], example)[0]

    def probes(self, rollouts, steps_per_completion, step_ends, answer_ids):
        """[(completion, cut, tail ids)]: the empty prefix (completion 0 cut after the prompt),
        then every non-final step of every completion (cut after the step's last token); the
        tail is the answer cue's tokens + the answer's."""
        P = rollouts.prompt_len
        out = [(0, P, self.tokenizer.encode(answer_cue("")) + answer_ids)]
        for g, (steps, ends) in enumerate(zip(steps_per_completion, step_ends)):
            for k, e in enumerate(list(ends)[:-1], start=1):
                cue = answer_cue("".join(steps[:k]))
                out.append((g, P + int(e) + 1, self.tokenizer.encode(cue) + answer_ids))
        return out

    @torch.no_grad()
    def branched_beliefs(self, seqs, probes, n_answer: int) -> list[float]:
        """exp(mean log p(answer)) of each probe `(row, cut, tail)` of `probes`: `seqs[row][:cut]`
        from a cache of its completion (prefilled once, up to its longest cut), then the tail,
        whose last `n_answer` tokens are the answer."""
        used = sorted({g for g, _, _ in probes})
        trunk = {g: max(n for h, n, _ in probes if h == g) for g in used}
        cache = prefill_rows(self.model, [seqs[g][: trunk[g]] for g in used], self.device)
        row_of = {g: r for r, g in enumerate(used)}
        self.tokens += sum(trunk.values())
        out = []
        for start in range(0, len(probes), self.batch_rows):
            chunk = probes[start:start + self.batch_rows]
            branch = gather_cache_rows(cache, [row_of[g] for g, _, _ in chunk],
                                       [n for _, n, _ in chunk])
            width = max(len(t) for _, _, t in chunk)
            ids = torch.zeros(len(chunk), width, dtype=torch.long)  # (R, W) right padded
            mask = torch.zeros(len(chunk), width, dtype=torch.bool)
            for r, (_, _, tail) in enumerate(chunk):
                ids[r, : len(tail)] = torch.tensor(tail)
                mask[r, : len(tail)] = True
            h = self.model.forward_hidden(ids.to(self.device), mask.to(self.device), branch)
            # the answer's tokens are predicted from the position before each of them
            rows_idx = [r for r in range(len(chunk)) for _ in range(n_answer)]
            pos_idx = [len(t) - n_answer - 1 + j for _, _, t in chunk for j in range(n_answer)]
            targets = torch.tensor([x for _, _, t in chunk for x in t[len(t) - n_answer:]])
            logits = self.model.lm_head(h[rows_idx, pos_idx]).float()  # (R n_answer, V)
            lp = torch.log_softmax(logits, dim=-1).cpu().gather(-1, targets[:, None])[:, 0]
            out += [float(p.mean().exp()) for p in lp.split(n_answer)]
            self.tokens += sum(len(t) for _, _, t in chunk)
        return out

    def score_rollouts(self, prompt, rollouts, steps_per_completion, step_ends, example):
        answer = str(example["answer"])
        answer_ids = self.tokenizer.encode(answer)
        G = len(rollouts)
        seqs = [rollouts.full_ids(g).tolist() for g in range(G)]
        probes = self.probes(rollouts, steps_per_completion, step_ends, answer_ids)
        was_training = self.model.training
        self.model.eval()
        try:
            beliefs = self.branched_beliefs(seqs, probes, len(answer_ids))
        finally:
            self.model.train(was_training)
        self.last_prompt_value = beliefs[0]
        values, i = [], 1
        for steps, ends in zip(steps_per_completion, step_ends):
            row = beliefs[i:i + max(0, len(ends) - 1)]
            i += len(row)
            values.append(row + [reward_rlvr("".join(steps), answer)] if len(ends) else [])
        return values


# ----------------------------------------------------------------------------------------------
# Monte-Carlo (Math-Shepherd)
# ----------------------------------------------------------------------------------------------


def sample_continuations(model, tokenizer, texts: Sequence[str], k: int, max_new_tokens: int,
                         temperature: float = 1.0, top_p: float = 1.0,
                         generator: torch.Generator | None = None, batch_size: int = 64,
                         device=None, compile: bool = False) -> tuple[list[list[str]], int]:
    """k sampled continuations (text, EOS dropped) of each text, and the generated token count.

    Texts are encoded as they are, left padded into batches of at most `batch_size` rows, and
    each is prefilled once (`generate(num_return_sequences=k)`). The model runs in eval mode.
    `compile`: `generate`'s compiled decode step.
    """

    device = device or next(model.parameters()).device
    pad = getattr(tokenizer, "pad_token_id", None)
    pad = 0 if pad is None else int(pad)  # any id: padded slots are masked
    per_chunk = max(1, batch_size // k)
    out: list[list[str]] = []
    n_tokens = 0
    was_training = model.training
    model.eval()
    try:
        for c in range(0, len(texts), per_chunk):
            encoded = [tokenizer.encode(t) for t in texts[c : c + per_chunk]]
            P = max(len(ids) for ids in encoded)
            ids = torch.full((len(encoded), P), pad, dtype=torch.long)
            mask = torch.zeros(len(encoded), P, dtype=torch.bool)
            for i, row in enumerate(encoded):  # left padding
                ids[i, P - len(row):] = torch.tensor(row, dtype=torch.long)
                mask[i, P - len(row):] = True
            gen = generate(model, ids.to(device), mask.to(device), max_new_tokens=max_new_tokens,
                           temperature=temperature, top_p=top_p,
                           eos_token_id=stop_token_ids(tokenizer), generator=generator,
                           num_return_sequences=k, compile=compile)
            n_tokens += int(gen.lengths.sum())
            for b in range(len(encoded)):
                conts = []
                for g in range(b * k, (b + 1) * k):
                    real = gen.completion_ids[g][gen.completion_mask[g]].tolist()
                    if not bool(gen.truncated[g]) and real:
                        real = real[:-1]  # drop the EOS
                    conts.append(tokenizer.decode(real, skip_special_tokens=False))
                out.append(conts)
    finally:
        model.train(was_training)
    return out, n_tokens


def _default_reward(text: str, example: dict) -> float:
    """Outcome reward of a finished completion: strict boxed-answer correctness."""
    return reward_rlvr(text, example["answer"])


class MonteCarloStepScorer(StepScorer):
    """Math-Shepherd step values: roll out k completions from every step prefix with the policy.

    The value of step j is estimated from k continuations of `prompt + steps[0..j]` sampled with
    `model` (normally the current policy): `mode="soft"` is the fraction that end with the
    correct answer, `mode="hard"` is 1.0 if any does (Math-Shepherd, arXiv 2312.08935, eq. 1-2).
    The last step's prefix is the finished completion itself, so its value is the completion's own
    outcome reward (no sampling). All prefixes of a group (identical prefixes shared) are decoded
    together in left-padded batches of at most `batch_size` rows, with `num_return_sequences=k`
    so each prefix is prefilled once. Cost: every step of every completion costs k rollouts of up
    to `max_new_tokens` tokens; `cost()` reports generated tokens, rollouts and seconds.

    `branch=True` (spec `mc-branch`; used where the rollouts' tokens are at hand, i.e.
    `score_rollouts` in training) changes how the same values are estimated, at a fraction of
    the cost, in the manner of VinePPO (arXiv 2410.01679) and TreeRPO (arXiv 2506.05183):
    - the group is the first source of samples: a completion whose tokens start with a step
      prefix *is* a sample of that prefix's value (it was drawn from the same policy after the
      same tokens), so only `k - members` continuations are sampled, none where k completions
      of the group already share the prefix;
    - continuations branch from the rollouts' own tokens: each completion is prefilled once and
      every step boundary continues from a copy of its cache (`generation.branch_continuations`),
      never re-encoding or recomputing a prefix;
    - a continuation gets the budget its completion had left (`max_new_tokens` minus the
      prefix's generated tokens), so it is drawn as the rollouts were.
    """

    name = "mc"

    def __init__(self, model, tokenizer, num_continuations: int = 4, mode: str = "soft",
                 max_new_tokens: int = 64, temperature: float = 0.8, top_p: float = 1.0,
                 batch_size: int = 64, generator: torch.Generator | None = None,
                 reward_fn: Callable[[str, dict], float] = _default_reward, device=None,
                 branch: bool = False, compile: bool = False):
        if mode not in ("soft", "hard"):
            raise ValueError(f"MonteCarloStepScorer: mode must be 'soft' or 'hard', got {mode!r}")
        if num_continuations < 1:
            raise ValueError("MonteCarloStepScorer: num_continuations must be >= 1")
        self.model, self.tokenizer = model, tokenizer
        self.k, self.mode = int(num_continuations), mode
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p
        self.batch_size, self.generator, self.reward_fn = batch_size, generator, reward_fn
        self.device, self.branch = device, branch
        self.compile = compile  # decode with generation's compiled step
        self.generated_tokens = 0
        self.prefill_tokens = 0  # tokens prefilled: the prefixes (re-read, or branch mode's)
        self.rollouts = 0
        self.reused = 0  # branch mode: group completions counted as samples of a prefix value
        self.seconds = 0.0

    def cost(self):
        """Sampled tokens (`mc_generated_tokens`), the prefixes' prefill (`forward_tokens`; in
        branch mode also `mc_prefill_tokens`), continuations, seconds."""
        cost = {"mc_generated_tokens": float(self.generated_tokens),
                "forward_tokens": float(self.prefill_tokens),
                "mc_rollouts": float(self.rollouts), "mc_seconds": self.seconds}
        if self.branch:
            cost.update(mc_prefill_tokens=float(self.prefill_tokens),
                        mc_reused=float(self.reused))
        return cost

    def _continue(self, texts: list[str]) -> list[list[str]]:
        """k sampled continuations of each text, batched; counts the cost."""
        conts, n_tokens = sample_continuations(
            self.model, self.tokenizer, texts, self.k, self.max_new_tokens, self.temperature,
            self.top_p, self.generator, self.batch_size, self.device, self.compile)
        self.generated_tokens += n_tokens
        self.prefill_tokens += sum(len(self.tokenizer.encode(t)) for t in texts)  # once each
        self.rollouts += len(texts) * self.k
        return conts

    def score_group(self, prompt, steps_per_completion, example):
        t0 = time.perf_counter()
        prefixes: dict[str, float | None] = {}  # completion-so-far -> value (shared prefixes once)
        for steps in steps_per_completion:
            for j in range(len(steps) - 1):
                prefixes.setdefault("".join(steps[: j + 1]), None)
        todo = list(prefixes)
        if todo:
            conts = self._continue([prompt + p for p in todo])
            for p, cs in zip(todo, conts):
                hits = [self.reward_fn(p + c, example) >= 1.0 for c in cs]
                prefixes[p] = float(any(hits)) if self.mode == "hard" else sum(hits) / len(hits)
        out = []
        for steps in steps_per_completion:
            values = [prefixes["".join(steps[: j + 1])] for j in range(len(steps) - 1)]
            if steps:
                values.append(float(self.reward_fn("".join(steps), example) >= 1.0))
            out.append(values)
        self.seconds += time.perf_counter() - t0
        return out

    def score(self, prompt, steps, example):
        return self.score_group(prompt, [steps], example)[0]

    def score_rollouts(self, prompt, rollouts, steps_per_completion, step_ends, example):
        if not self.branch:
            return self.score_group(prompt, steps_per_completion, example)
        t0 = time.perf_counter()
        P, G = rollouts.prompt_len, len(rollouts)
        seqs = [rollouts.full_ids(g).tolist() for g in range(G)]
        outcome = [float(self.reward_fn(rollouts.texts[g], example) >= 1.0) for g in range(G)]
        # Each non-final step prefix, as tokens (prompt included) -> the completions through it.
        members: dict[tuple[int, ...], list[int]] = {}
        for g, ends in enumerate(step_ends):
            for e in list(ends)[:-1]:
                members.setdefault(tuple(seqs[g][: P + e + 1]), [])
        for key, through in members.items():
            through.extend(g for g in range(G) if tuple(seqs[g][: len(key)]) == key)
        hits = self._branch_hits(members, seqs, P, example)
        values = {}
        for key, through in members.items():
            samples = [outcome[g] for g in through] + hits[key]
            self.reused += len(through)
            values[key] = (float(any(samples)) if self.mode == "hard"
                           else sum(samples) / len(samples))
        out = []
        for g, ends in enumerate(step_ends):
            row = [values[tuple(seqs[g][: P + e + 1])] for e in list(ends)[:-1]]
            out.append(row + [outcome[g]] if len(ends) else [])
        self.seconds += time.perf_counter() - t0
        return out

    def _branch_hits(self, members, seqs, P, example) -> dict[tuple[int, ...], list[float]]:
        """Outcomes of the `k - members` continuations each prefix still needs (branch mode)."""
        cuts, keys = [], []
        for key, through in members.items():
            for _ in range(max(0, self.k - len(through))):
                cuts.append((through[0], len(key)))
                keys.append(key)
        hits: dict[tuple[int, ...], list[float]] = {key: [] for key in members}
        if not cuts:  # the group alone supplied every sample
            return hits
        budgets = [max(1, self.max_new_tokens - (n - P)) for _, n in cuts]
        was_training = self.model.training
        self.model.eval()
        try:
            br = branch_continuations(
                self.model, seqs, cuts, budgets, self.temperature, self.top_p,
                stop_token_ids(self.tokenizer), self.generator, self.batch_size, self.compile)
        finally:
            self.model.train(was_training)
        self.generated_tokens += br.generated_tokens
        self.prefill_tokens += br.prefill_tokens
        self.rollouts += len(cuts)
        for key, ids, cut in zip(keys, br.ids, br.truncated):
            if ids and not cut:
                ids = ids[:-1]  # drop the EOS
            text = self.tokenizer.decode(list(key[P:]) + ids, skip_special_tokens=False)
            hits[key].append(float(self.reward_fn(text, example) >= 1.0))
        return hits


# ----------------------------------------------------------------------------------------------
# Learned PRM and adapters
# ----------------------------------------------------------------------------------------------


class ForwardStepScorer(StepScorer):
    """Adapter for an object with `forward(prompt, step_text) -> float` (a step reward model).

    Such a scorer sees one step at a time, without the steps before it, so it cannot judge a
    step that is only wrong in context (e.g. a correct sum of a wrongly carried number).
    """

    name = "forward"

    def __init__(self, obj):
        self.obj = obj

    def score(self, prompt, steps, example):
        return _check_lengths(self, steps, [self.obj.forward(prompt, s) for s in steps])


class CallableStepScorer(StepScorer):
    """Adapter for a callable: `fn(prompt, step_text) -> float` per step (`per_step=True`) or
    `fn(prompt, steps, example) -> list[float]` for the whole completion."""

    name = "callable"

    def __init__(self, fn: Callable, per_step: bool = True):
        self.fn, self.per_step = fn, per_step

    def score(self, prompt, steps, example):
        if self.per_step:
            return _check_lengths(self, steps, [self.fn(prompt, s) for s in steps])
        return _check_lengths(self, steps, self.fn(prompt, list(steps), example))


def as_step_scorer(obj) -> StepScorer:
    """A StepScorer for `obj`: itself, a `forward(prompt, step)` object, or a per-step callable."""
    if isinstance(obj, StepScorer):
        return obj
    if callable(getattr(obj, "score_group", None)) and callable(getattr(obj, "score", None)):
        return obj  # duck-typed scorer
    if callable(getattr(obj, "forward", None)):
        return ForwardStepScorer(obj)
    if callable(obj):
        return CallableStepScorer(obj)
    raise TypeError(f"cannot use {type(obj).__name__} as a step scorer: it needs score(), "
                    "forward(prompt, step_text) or to be callable")
