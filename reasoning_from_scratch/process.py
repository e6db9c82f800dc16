"""Process supervision for GRPO: reasoning steps, their tokens, and token-level process advantages.

Outcome supervision gives one reward per completion; process supervision scores every intermediate
reasoning step. This module holds the three pieces that turn step scores into the per-token
advantages the clipped GRPO loss consumes:

1. `split_steps` cuts a completion's text into character spans (one per step) that cover the whole
   text, by explicit `Step N:` tags, blank lines, newlines or a user regex.
2. `step_token_ends` maps those character spans onto the completion's tokens with the tokenizer's
   character offsets, so each token belongs to exactly one step (step boundaries follow the text,
   not equal token counts per step), and returns the index of each step's last token.
3. `process_advantages` turns the step rewards of the G completions of one prompt into a
   `(G, T)` advantage tensor following DeepSeekMath section 4.1.3 (Shao et al. 2024,
   arXiv 2402.03300): normalise all step rewards of the group together, then give token t the sum
   of the normalised rewards of the steps that end at or after t. Variants: process + outcome,
   PURE's min-form credit (Cheng et al. 2025, arXiv 2504.15275), per-step-position normalisation.

`process_supervision.process_token_advantages` glues the three together for a batch of rollouts
and a step scorer (see `step_scorers.py`); `step_statistics` here gives the numbers that reveal
process-reward failure modes in training logs.

Known failure modes of process advantages (logged by `step_statistics`):
- With the summed ("sum") credit, a token's advantage is the sum over the steps still to come, so
  its magnitude grows with the number of remaining steps: early tokens of long solutions get large
  advantages, and when step rewards are mostly positive after normalisation the policy is pushed
  towards *more* steps (and towards fewer when they are mostly negative).
- Since the step is the unit of reward, a policy can game the splitter: split one step into many
  small correct-looking ones (more positive terms in the sum), or merge steps so a wrong one hides
  inside a right one. Watch steps per completion and tokens per step.
- Pooling rewards over all steps of the group mixes positions: late steps of a solution are more
  often wrong than early ones, so "position" normalisation compares each step only with the same
  step of the other completions.
"""

from __future__ import annotations

import bisect
import math
import random
import re
from collections.abc import Sequence

import torch

#: Default step tag: "Step 1:", "Step 12 :", "step 3:". The number is matched whole ("Step 10:"
#: is one tag, not "Step 1" + "0:"). A tag glued to a preceding digit ("=42Step 2:", a model that
#: forgot its newline) still starts a step; glued to a letter ("MyStep 2:") it does not.
STEP_TAG_PATTERN = r"(?<![A-Za-z])[Ss]tep[ \t]*\d+[ \t]*:"

#: Where the final answer starts; everything from there on is one final step. The last
#: "</think>" wins; without one, the last "\boxed{".
ANSWER_PATTERNS = (r"</think>", r"\\boxed\{")

SPLIT_MODES = ("tags", "blank_lines", "newlines", "regex")
#: Forms added to the outcome advantage: token t of completion i gets
#: `A_outcome_i + alpha * credit_{i,k(t)}`, k(t) the step that owns t (`anchored_credit`).
ANCHORED_VARIANTS = ("first-error", "progress", "progress-local", "clip", "delta", "pure",
                     "value-delta")
# The reward of a locally correct step after a completion's first error, relative to a correct
# step on a correct path (1): the default of `process_advantages(local_weight=...)`.
LOCAL_STEP_WEIGHT = 0.5
# Placebo controls of the anchored forms' step credit (`control_credit`).
CREDIT_CONTROLS = ("none", "flat", "shuffled")
VARIANTS = ("sum", "process+outcome", "min", "position", *ANCHORED_VARIANTS)

_NEWLINE = re.compile(r"\r\n|\n|\r")
_BLANK_LINES = re.compile(r"(?:\r\n|\n|\r)(?:[ \t]*(?:\r\n|\n|\r))+")
_THINK_OPEN = re.compile(r"<think>")


# ----------------------------------------------------------------------------------------------
# 1. Splitting text into steps
# ----------------------------------------------------------------------------------------------


def _answer_start(text: str, answer_patterns: Sequence[str] | None) -> int:
    """Character index where the final answer step starts, or len(text) if there is none."""
    for pat in answer_patterns or ():
        matches = list(re.finditer(pat, text))
        if matches:
            return matches[-1].start()
    return len(text)


def _boundaries(body: str, mode: str, pattern: str | None) -> list[int]:
    """Start indices (> 0) of the steps after the first, inside `body`."""
    if mode == "tags":
        # A tag begins a new step, so the boundary is at the tag's start.
        return [m.start() for m in re.finditer(pattern or STEP_TAG_PATTERN, body)]
    if mode == "regex":
        if pattern is None:
            raise ValueError("split_steps(mode='regex') needs pattern=...")
        # Like the tags mode: each match begins a new step (use a lookahead/lookbehind for a
        # zero-width boundary elsewhere).
        return [m.start() for m in re.finditer(pattern, body)]
    if mode == "newlines":
        # The line break belongs to the line it ends; "\r\n" is one break.
        return [m.end() for m in _NEWLINE.finditer(body)]
    if mode == "blank_lines":
        return [m.end() for m in _BLANK_LINES.finditer(body)]
    raise ValueError(f"split_steps: unknown mode {mode!r}; expected one of {SPLIT_MODES}")


def _is_empty_step(piece: str, mode: str, pattern: str | None) -> bool:
    """True when a piece has no content beyond whitespace, a `<think>` tag and its step tag."""
    rest = re.sub(STEP_TAG_PATTERN, "", _THINK_OPEN.sub("", piece))
    if mode in ("tags", "regex") and pattern:
        rest = re.sub(pattern, "", rest)
    return rest.strip() == ""


def split_steps(
    text: str,
    mode: str = "tags",
    pattern: str | None = None,
    answer_patterns: Sequence[str] | None = ANSWER_PATTERNS,
) -> list[tuple[int, int]]:
    """Cut `text` into reasoning steps; returns `(start, end)` character spans covering all of it.

    Modes: `"tags"` (a new step at each `Step N:` tag, `STEP_TAG_PATTERN` or `pattern`),
    `"blank_lines"`, `"newlines"`, `"regex"` (a new step at each match of `pattern`).
    Rules, so that every character belongs to exactly one step:
    - spans are contiguous, start at 0 and end at len(text) (no gaps, no overlaps);
    - text before the first tag (e.g. " <think>\\n") joins the first step;
    - the answer after the last step (from the last `</think>`, else the last `\\boxed{`) is its
      own final step and is never split (pass `answer_patterns=()` to turn this off);
    - line breaks stay with the step they end ("\\r\\n" is never cut in two);
    - empty steps (only whitespace, `<think>` and the tag) merge into the step before them, or
      into the next one when they come first.
    An empty text gives `[]`; a text without boundaries gives one step.
    """
    if not isinstance(text, str):
        raise TypeError(f"split_steps: text must be str, got {type(text).__name__}")
    if mode not in SPLIT_MODES:
        raise ValueError(f"split_steps: unknown mode {mode!r}; expected one of {SPLIT_MODES}")
    if not text:
        return []
    ans = _answer_start(text, answer_patterns)
    body = text[:ans]
    cuts = sorted({b for b in _boundaries(body, mode, pattern) if 0 < b < len(body)})
    starts = [0, *cuts]
    spans = [(s, e) for s, e in zip(starts, [*cuts, len(body)]) if e > s]
    # Merge empty pieces: into the previous step, or forward when nothing precedes them. The text
    # before the first tag is merged forward even when it is not empty (" <think>\n" preamble).
    merged: list[list[int]] = []
    pending_start = None  # start of empty text waiting for the next non-empty piece
    for i, (s, e) in enumerate(spans):
        piece = text[s:e]
        preamble = mode in ("tags", "regex") and i == 0 and cuts and s < cuts[0] and not (
            re.match(pattern or STEP_TAG_PATTERN, piece)
        )
        if preamble or _is_empty_step(piece, mode, pattern):
            if merged:
                merged[-1][1] = e
            elif pending_start is None:
                pending_start = s
            continue
        merged.append([pending_start if pending_start is not None else s, e])
        pending_start = None
    if ans < len(text):
        # An all-empty body (e.g. "Step 1:\n" then the answer) merges into the answer step.
        merged.append([ans if pending_start is None else pending_start, len(text)])
    elif pending_start is not None:  # the whole text is empty pieces: keep it as one step
        merged.append([pending_start, len(text)])
    elif merged:
        merged[-1][1] = len(text)
    return [(s, e) for s, e in merged]


def step_texts(text: str, spans: Sequence[tuple[int, int]]) -> list[str]:
    """The substring of each span."""
    return [text[s:e] for s, e in spans]


# ----------------------------------------------------------------------------------------------
# 2. Mapping character spans onto tokens
# ----------------------------------------------------------------------------------------------


def token_step_owners(
    offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]
) -> list[int]:
    """Step index of every token: the span containing the token's first character."""
    if not spans:
        raise ValueError("step_token_ends: spans is empty but there are tokens to assign")
    for j in range(1, len(spans)):
        if spans[j][0] != spans[j - 1][1]:
            raise ValueError(f"step_token_ends: spans {j - 1} and {j} are not contiguous: {spans}")
    starts = [s for s, _ in spans]
    owners, prev = [], -1
    for k, (s, _e) in enumerate(offsets):
        if s < prev:
            raise ValueError(
                f"step_token_ends: token offsets must be non-decreasing; token {k} starts at {s} "
                f"after a token that starts at {prev}"
            )
        prev = s
        # bisect_right - 1: the last span starting at or before s. Tokens past the text's end
        # (an EOS with an empty offset at len(text)) fall into the last span.
        owners.append(max(0, bisect.bisect_right(starts, s) - 1))
    return owners


def step_token_ends(
    offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]
) -> list[int]:
    """Index of each step's last token, given the tokens' character `offsets` and step `spans`.

    Each token belongs to the step that contains its *first* character. A token that straddles a
    boundary (e.g. "2\\nStep" or "\\n\\n") was emitted while the policy was still writing the
    step it starts in, and assigning by the first character keeps every step a contiguous token
    range, so each token gets exactly one owner. Zero-width tokens (special tokens stripped from
    the text, the EOS at len(text)) go to the step containing their position: the last step for
    the EOS.
    Steps that end up with no token are merged away (their ends are not returned); use
    `align_steps_to_tokens` to get the matching merged spans. The result is strictly increasing and
    its last element is `len(offsets) - 1`; no tokens gives `[]`.
    """
    if len(offsets) == 0:
        return []
    return _owner_ends(token_step_owners(offsets, spans))


def _owner_ends(owners: Sequence[int]) -> list[int]:
    """Index of the last token of each run of equal owners."""
    last = len(owners) - 1
    return [k for k in range(len(owners)) if k == last or owners[k + 1] != owners[k]]


def align_steps_to_tokens(
    offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]
) -> tuple[list[tuple[int, int]], list[int]]:
    """Merge token-less spans into their neighbours; returns `(spans, ends)` of equal length.

    A span with no token of its own (all its characters lie inside a token that starts in the
    previous span) joins the previous span; leading token-less spans join the first span that
    owns a token. The merged spans still cover the same text.
    """
    if len(offsets) == 0:
        return ([(spans[0][0], spans[-1][1])] if spans else []), []
    owners = token_step_owners(offsets, spans)
    owned = sorted(set(owners))
    merged = []
    for n, j in enumerate(owned):
        start = spans[0][0] if n == 0 else spans[j][0]
        end = spans[owned[n + 1] - 1][1] if n + 1 < len(owned) else spans[-1][1]
        merged.append((start, end))
    return merged, _owner_ends(owners)


def _common_prefix_len(a: str, b: str) -> int:
    """Length of the longest common prefix of two strings."""
    # Slice comparisons run in C: a bisection beats a character loop on long completions.
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:  # the usual case: the decoded prefix is a prefix of the text
        return hi
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def token_offsets_from_ids(tokenizer, ids: Sequence[int], text: str | None = None):
    """Character offsets of generated token `ids` inside their decoded `text`.

    Re-encoding a generated text does not always reproduce the generated tokens (BPE has several
    tokenisations of one string), so when `tokenizer.encode_with_offsets(text)` gives other ids we
    decode prefixes instead: token k starts where the longest common prefix of
    `decode(ids[:k])` and the text ends (robust to tokens that hold half a UTF-8 character).
    """
    ids = [int(i) for i in ids]
    if text is None:
        text = tokenizer.decode(ids)
    if hasattr(tokenizer, "encode_with_offsets"):
        enc_ids, offsets = tokenizer.encode_with_offsets(text)
        if list(enc_ids) == ids:
            return [(int(s), int(e)) for s, e in offsets]
    starts = [_common_prefix_len(tokenizer.decode(ids[:k]), text) for k in range(len(ids))]
    # Starts must not decrease (a half character can shorten the common prefix).
    for k in range(len(starts) - 2, -1, -1):
        starts[k] = min(starts[k], starts[k + 1])
    ends = [*starts[1:], len(text)]
    return list(zip(starts, ends))


# ----------------------------------------------------------------------------------------------
# 3. Process advantages (DeepSeekMath 4.1.3)
# ----------------------------------------------------------------------------------------------


def normalize_pool(rewards: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """`(r - mean) / (std + eps)` over a 1-D pool; zeros when < 2 values or all are equal.

    torch's default std is the unbiased one (divide by n - 1), as in the GRPO advantage; with one
    value it is NaN, hence the explicit zero.
    """
    rewards = rewards.to(torch.float32)
    if rewards.numel() < 2 or bool((rewards == rewards[0]).all()):
        return torch.zeros_like(rewards)
    return (rewards - rewards.mean()) / (rewards.std() + eps)


def _validate(step_rewards, step_ends, completion_lengths) -> list[int]:
    """Check the shapes and index rules of process_advantages' inputs; returns the lengths."""
    lengths = [int(x) for x in torch.as_tensor(completion_lengths).reshape(-1).tolist()]
    if len(step_rewards) != len(lengths) or len(step_ends) != len(lengths):
        raise ValueError(
            f"process_advantages: got {len(step_rewards)} step_rewards lists, {len(step_ends)} "
            f"step_ends lists and {len(lengths)} completion_lengths; they must be equal (G)"
        )
    if not lengths:
        raise ValueError("process_advantages: empty group (G = 0)")
    for i, (rs, es, n) in enumerate(zip(step_rewards, step_ends, lengths)):
        rs, es = list(rs), [int(e) for e in es]
        where = f"process_advantages: completion {i}"
        if n < 0:
            raise ValueError(f"{where}: negative completion length {n}")
        if len(rs) != len(es):
            raise ValueError(f"{where}: {len(rs)} step rewards but {len(es)} step ends")
        if n == 0:
            if es:
                raise ValueError(f"{where}: length 0 but has step ends {es}")
            continue
        if not es:
            raise ValueError(f"{where}: length {n} but no steps (need at least one step)")
        if es[0] < 0 or any(b <= a for a, b in zip(es, es[1:])):
            raise ValueError(f"{where}: step_ends must be strictly increasing and >= 0, got {es}")
        if es[-1] != n - 1:
            raise ValueError(
                f"{where}: last step end must be completion_length - 1 = {n - 1}, got {es[-1]}"
            )
        if any(not math.isfinite(float(r)) for r in rs):
            raise ValueError(f"{where}: step rewards must be finite, got {rs}")
    return lengths


def _normalized_rewards(step_rewards, normalize: str, eps: float) -> list[torch.Tensor]:
    """Normalised step rewards per completion: over the whole group pool or per step position."""
    flat = torch.tensor([float(r) for rs in step_rewards for r in rs], dtype=torch.float32)
    if normalize == "group":
        # DeepSeekMath 4.1.3: one pool of all steps of all G completions.
        normed = normalize_pool(flat, eps)
        out, k = [], 0
        for rs in step_rewards:
            out.append(normed[k : k + len(rs)])
            k += len(rs)
        return out
    # Per step position j: compare step j only with the step j of the other completions.
    out = [torch.zeros(len(rs), dtype=torch.float32) for rs in step_rewards]
    max_steps = max((len(rs) for rs in step_rewards), default=0)
    for j in range(max_steps):
        rows = [i for i, rs in enumerate(step_rewards) if len(rs) > j]
        pool = normalize_pool(torch.tensor([float(step_rewards[i][j]) for i in rows]), eps)
        for i, v in zip(rows, pool):
            out[i][j] = v
    return out


def process_advantages(
    step_rewards: Sequence[Sequence[float]],
    step_ends: Sequence[Sequence[int]],
    completion_lengths: Sequence[int] | torch.Tensor,
    variant: str = "sum",
    outcome_advantages: Sequence[float] | torch.Tensor | None = None,
    eps: float = 1e-4,
    alpha: float = 1.0,
    threshold: float = 0.5,
    eta: float = 0.5,
    control: str = "none",
    generator: random.Random | None = None,
    prompt_value: float | None = None,
    local_weight: float = LOCAL_STEP_WEIGHT,
) -> torch.Tensor:
    """Token-level process advantages `(G, max(completion_lengths))` for one group of rollouts.

    DeepSeekMath section 4.1.3: pool the step rewards of all G completions, normalise each as
    `(r - mean(pool)) / (std(pool) + eps)` (unbiased std; all zeros when the pool has < 2 rewards
    or they are all equal), and give token t of completion i the sum of the normalised rewards of
    its steps whose end index is >= t (the credit of every step the token leads into). Positions
    at or beyond a completion's length are 0.

    `step_rewards[i]`, `step_ends[i]`: one entry per step of completion i; `step_ends[i]` are
    0-based token indices into the completion, strictly increasing, the last equal to
    `completion_lengths[i] - 1` (a length-0 completion has no steps). Violations raise a
    ValueError naming the completion.

    Variants:
    - `"sum"`: DeepSeekMath as above. Failure mode: the suffix sum grows with the number of
      remaining steps, so step counts are rewarded or punished for themselves.
    - `"process+outcome"`: `"sum"` plus `outcome_advantages[i]` (the usual group-normalised
      outcome advantage, shape `(G,)`) added to every token of completion i: a wrong final answer
      still costs every token even when the steps looked fine.
    - `"min"`: PURE's min-form credit (arXiv 2504.15275): token t gets the *minimum* of the
      normalised rewards of its remaining steps, so the value is bounded by the worst step to
      come and adding more steps cannot raise it (against step-count reward hacking).
    - `"position"`: the suffix sum of rewards normalised per step position (step j of every
      completion pooled only with the step j of the others).
    - the outcome-anchored forms `ANCHORED_VARIANTS` (first-error, progress, progress-local,
      clip, delta, pure, value-delta; formulas in `anchored_credit`): token t of completion i gets
      `outcome_advantages[i] + alpha * credit_{i,k(t)}` on raw (not pooled) step rewards, with
      `threshold` deciding a correct step and `eta` the clip form's threshold. The outcome term
      is needed (GRPO-VPS, arXiv 2604.20659; VPPO, arXiv 2601.18984); only `"pure"` runs without
      it (`outcome_advantages=None`: PURE gives verifiable rewards to a share of prompts only).
      `control` ("flat", "shuffled"; `generator` for the shuffle) replaces their credit by a
      placebo of it first (`control_credit`); `prompt_value` is value-delta's V(s_0) (a step
      scorer's `last_prompt_value`; None: the group's mean outcome); `local_weight` is
      progress-local's reward of a locally correct step after the first error.
    """
    if variant not in VARIANTS:
        raise ValueError(f"process_advantages: unknown variant {variant!r}; expected {VARIANTS}")
    lengths = _validate(step_rewards, step_ends, completion_lengths)
    G, T = len(lengths), max(lengths)
    if variant in ANCHORED_VARIANTS:
        credit = anchored_credit(step_rewards, variant, threshold, eta, prompt_value, eps,
                                 local_weight)
        credit = control_credit(credit, step_ends, control, generator)
        adv = _expand_steps(credit, step_ends, lengths, T) * alpha  # (G, T)
        if outcome_advantages is None and variant == "pure":
            return adv
        return adv + _outcome_tokens(outcome_advantages, lengths, T, variant)
    pool = "position" if variant == "position" else "group"
    normed = _normalized_rewards(step_rewards, pool, eps)
    adv = torch.zeros(G, T, dtype=torch.float32)  # (G, T)
    for i, (r, es, n) in enumerate(zip(normed, step_ends, lengths)):
        if n == 0:
            continue
        if variant == "min":
            # Suffix minimum: min over steps k >= j, via a reversed running minimum.
            credit = torch.flip(torch.cummin(torch.flip(r, [0]), 0).values, [0])
        else:
            # Suffix sum: sum over steps k >= j.
            credit = torch.flip(torch.cumsum(torch.flip(r, [0]), 0), [0])
        es_t = torch.tensor([int(e) for e in es])
        step_len = torch.diff(es_t, prepend=torch.tensor([-1]))  # tokens per step
        adv[i, :n] = torch.repeat_interleave(credit, step_len)
    if variant == "process+outcome":
        adv = adv + _outcome_tokens(outcome_advantages, lengths, T, variant)
    return adv


def step_sizes(ends: Sequence[int]) -> list[int]:
    """Tokens of each step, from the steps' last token indices."""
    return [int(e) - p for p, e in zip([-1, *[int(x) for x in ends][:-1]], ends)]


def control_credit(credit, step_ends, control: str = "none",
                   generator: random.Random | None = None) -> list[list[float]]:
    """A placebo of the step credit, one list per completion, to test *where* credit lands.

    - `"none"`: the credit itself.
    - `"flat"`: every step of a completion gets the token-weighted mean of its credits, so each
      token carries `sum_k credit_k * n_k / sum_k n_k` (n_k: tokens of step k): the completion's
      total credit over its tokens is unchanged, its distribution among the steps is gone.
    - `"shuffled"`: each step's credit *mass* (credit x tokens) moved to another of the
      completion's own steps by a random permutation and spread over that step's tokens: step k
      gets `credit_{p(k)} * n_{p(k)} / n_k`. Each completion keeps its token-weighted total (the
      amount), only the placement changes. With `generator` (a `random.Random`; a fresh unseeded
      one if None).
    """
    if control not in CREDIT_CONTROLS:
        raise ValueError(f"control_credit: unknown control {control!r}; expected "
                         f"{CREDIT_CONTROLS}")
    if control == "none":
        return [list(cr) for cr in credit]
    if control == "shuffled":
        rng = generator if generator is not None else random.Random()
        out = []
        for cr, es in zip(credit, step_ends):
            sizes = step_sizes(es)
            perm = list(range(len(cr)))
            rng.shuffle(perm)
            out.append([float(cr[j]) * sizes[j] / sizes[k] for k, j in enumerate(perm)])
        return out
    out = []
    for cr, es in zip(credit, step_ends):
        sizes = step_sizes(es)
        total = sum(float(c) * n for c, n in zip(cr, sizes))
        out.append([total / sum(sizes)] * len(cr) if sizes else [])
    return out


def _expand_steps(credit, step_ends, lengths, T) -> torch.Tensor:
    """`(G, T)`: every token gets the credit of the step that owns it; 0 past its length."""
    # Rows built as Python lists and converted once: a few small tensors per completion cost
    # more than the credit itself.
    rows = []
    for cr, es in zip(credit, step_ends):
        row, prev = [], -1
        for c, e in zip(cr, es):
            row += [float(c)] * (int(e) - prev)
            prev = int(e)
        rows.append(row + [0.0] * (T - len(row)))
    return torch.tensor(rows, dtype=torch.float32).reshape(len(lengths), T)


def _outcome_tokens(outcome_advantages, lengths, T, variant) -> torch.Tensor:
    """`(G, T)`: completion i's outcome advantage on each of its tokens."""
    if outcome_advantages is None:
        raise ValueError(f"process_advantages(variant={variant!r}) needs outcome_advantages (G,)")
    G = len(lengths)
    oa = torch.as_tensor(outcome_advantages, dtype=torch.float32).reshape(-1)
    if oa.numel() != G:
        raise ValueError(f"process_advantages: outcome_advantages has {oa.numel()} values, "
                         f"expected G = {G}")
    mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]  # (G, T)
    return oa[:, None] * mask


# ----------------------------------------------------------------------------------------------
# 3b. Outcome-anchored step credit: bounded forms, progress and value differences
# ----------------------------------------------------------------------------------------------


def prefix_correct(step_rewards: Sequence[Sequence[float]], threshold: float = 0.5):
    """`c_{i,k} = min_{j<=k} 1[s_{i,j} >= threshold]`: 1 while every step so far is correct."""
    out = []
    for rs in step_rewards:
        c, ok = [], 1.0
        for r in rs:
            ok = ok if float(r) >= threshold else 0.0
            c.append(ok)
        out.append(c)
    return out


def _first_error_credit(step_rewards, threshold):
    """`d_{i,k} = c_{i,k} - c_{i,k-1}` (c_{i,0} = 1): -1 on the first wrong step, else 0."""
    out = []
    for c in prefix_correct(step_rewards, threshold):
        out.append([ck - cp for cp, ck in zip([1.0, *c[:-1]], c)])
    return out


def progress_state_values(correct: Sequence[Sequence[float]]) -> list[float]:
    """`V_k`, k = 0..K: mean correct steps still to come, over the group's completions whose
    first k steps are all correct (`correct` from `prefix_correct`); 0 where none is.

    In a chain problem every completion with k correct steps is in the same state (the same
    running value), so the G rollouts of one prompt are Monte-Carlo samples of that state's
    value, as the branches of a tree rollout are (TreeRPO, arXiv 2506.05183), at no extra cost.
    A completion that ends after its k-th step counts with 0 steps to come.
    """
    K = max((len(c) for c in correct), default=0)
    values = []
    for k in range(K + 1):
        members = [c for c in correct if k == 0 or (len(c) >= k and c[k - 1] > 0)]
        togo = [sum(c[k:]) for c in members]
        values.append(sum(togo) / len(togo) if togo else 0.0)
    return values


def _progress_credit(step_rewards, threshold, eps):
    """Temporal-difference credit of verified steps against the group's state values.

    Step k of completion i, while its prefix is correct: `c_{i,k} + c_{i,k} V_k - V_{k-1}`
    (reward 1 for a correct step, plus the value of the state it reaches, minus the value of the
    state it starts from); 0 after the first wrong step. The state after a completion's last
    step K_i is its own end, with nothing to come: its value is 0, not the group's `V_{K_i}`
    (which counts the steps *other*, longer completions still had to write). Divided by the
    group's (unbiased) std of the completions' correct-step counts `M_i`, so the credits of a
    completion telescope to `(M_i - V_0) / (std M + eps)` with `V_0 = mean M`:
    `(M_i - mean M) / (std M + eps)`, a group-normalised progress score, placed on the steps
    where the completions part ways.
    """
    correct = prefix_correct(step_rewards, threshold)
    totals = torch.tensor([sum(c) for c in correct], dtype=torch.float32)  # M_i, (G,)
    if totals.numel() < 2 or bool((totals == totals[0]).all()):
        return [[0.0] * len(c) for c in correct]
    scale = float(totals.std()) + eps
    values = progress_state_values(correct)
    out = []
    for c in correct:
        credit, on_path = [], True
        for k, ck in enumerate(c, start=1):
            reached = values[k] if k < len(c) else 0.0  # after the last step: its own end
            credit.append((ck + ck * reached - values[k - 1]) / scale if on_path else 0.0)
            on_path = on_path and ck > 0
        out.append(credit)
    return out


def local_step_rewards(step_rewards: Sequence[Sequence[float]], threshold: float = 0.5,
                       local_weight: float = LOCAL_STEP_WEIGHT) -> list[list[float]]:
    """`r_{i,k} = c_{i,k} + w (1 - c_{i,k}) l_{i,k}`: 1 for a correct step on a correct path, `w`
    for a step that is correct on its own inputs after the first error, else 0.

    `l_{i,k} = 1[s_{i,k} >= threshold]` is the step's local verdict (a scorer that does not
    propagate errors, e.g. `VerifierStepScorer(propagate_errors=False)`: a step that continues
    correctly from an earlier wrong result is correct) and `c_{i,k}` its prefix verdict
    (`prefix_correct`). With a propagating scorer every step after the first error has
    `l = 0`, so the rewards are `c` and the local form is the plain progress credit.
    """
    out = []
    for rs, cs in zip(step_rewards, prefix_correct(step_rewards, threshold)):
        out.append([c + local_weight * (1.0 - c) * float(float(r) >= threshold)
                    for r, c in zip(rs, cs)])
    return out


def local_state_values(rewards: Sequence[Sequence[float]],
                       correct: Sequence[Sequence[float]]) -> dict[tuple[int, bool], float]:
    """`V(k, on)`: the group's mean reward still to come after k steps, pooled over the
    completions in the same state class: on the correct path (`on`: its first k steps all
    correct, `correct` from `prefix_correct`) or off it.

    On the path every completion with k correct steps holds the same running value, so the
    class is one state (as in `progress_state_values`, of which `V(k, True)` is the local
    form). Off the path the running values differ, but the steps to come are the same
    operations, each checked on its own inputs; pooling them by k gives each post-error step a
    baseline from the group's other off-path completions, where a state of its own would give
    it none (a one-member state's value is its own return, so its steps' credits are 0).
    A completion that ends after its k-th step counts with 0 to come.
    """
    pools: dict[tuple[int, bool], list[float]] = {}
    for r, c in zip(rewards, correct):
        for k in range(len(r) + 1):
            on = k == 0 or c[k - 1] > 0
            pools.setdefault((k, on), []).append(sum(r[k:]))
    return {key: sum(v) / len(v) for key, v in pools.items()}


def _local_progress_credit(step_rewards, threshold, eps, local_weight):
    """Progress credit past the first error: the temporal-difference credit of
    `local_step_rewards` against `local_state_values`.

    Step k of completion i gets `(r_{i,k} + V(k, c_{i,k}) - V(k-1, c_{i,k-1})) / (std R + eps)`
    (the completion's own end has value 0), where `R_i = sum_k r_{i,k}`. The credits of a
    completion telescope to `(R_i - mean R) / (std R + eps)` whatever the pooling, so the
    classes only move credit between steps: on the path as `progress`; the first wrong step
    loses the path's value; each later step is paid `w` for being right on its own inputs,
    against the other off-path completions at the same step. `local_weight = 0` gives
    `progress` exactly. All zeros when the group's `R` are all equal.
    """
    correct = prefix_correct(step_rewards, threshold)
    rewards = local_step_rewards(step_rewards, threshold, local_weight)
    totals = torch.tensor([sum(r) for r in rewards], dtype=torch.float32)  # R_i, (G,)
    if totals.numel() < 2 or bool((totals == totals[0]).all()):
        return [[0.0] * len(r) for r in rewards]
    scale = float(totals.std()) + eps
    values = local_state_values(rewards, correct)
    out = []
    for r, c in zip(rewards, correct):
        credit, before = [], values[(0, True)]
        for k, (rk, ck) in enumerate(zip(r, c), start=1):
            after = values[(k, ck > 0)] if k < len(r) else 0.0  # after the last step: its end
            credit.append((rk + after - before) / scale)
            before = after
        out.append(credit)
    return out


def _suffix(values: list[float], op) -> list[float]:
    """Suffix reduction: out[k] = op(values[k:])."""
    out, acc = [], None
    for v in reversed(values):
        acc = v if acc is None else op(v, acc)
        out.append(acc)
    return out[::-1]


def _centred(returns):
    """Returns minus a per-position baseline: the group's mean return at the same step index
    (over the completions that have that step), so equal completions get zero credit."""
    K = max((len(r) for r in returns), default=0)
    base = []
    for k in range(K):
        at = [r[k] for r in returns if len(r) > k]
        base.append(sum(at) / len(at))
    return [[x - b for x, b in zip(r, base)] for r in returns]


def anchored_credit(
    step_rewards: Sequence[Sequence[float]],
    variant: str,
    threshold: float = 0.5,
    eta: float = 0.5,
    prompt_value: float | None = None,
    eps: float = 1e-4,
    local_weight: float = LOCAL_STEP_WEIGHT,
) -> list[list[float]]:
    """Per-step credit of the outcome-anchored forms, one list per completion (before alpha).

    - `"first-error"`: `d_{i,k} = c_{i,k} - c_{i,k-1}` with `c_{i,k} = min_{j<=k} s_{i,j}`
      (prefix still correct): -1 on the first wrong step, 0 elsewhere (Lightman et al. 2023,
      arXiv 2305.20050 first-error labels; VPPO, arXiv 2601.18984: penalise from the first
      wrong step, keep the good prefix).
    - `"progress"`: `_progress_credit`, the temporal-difference credit of verified steps with
      state values estimated by the group (Setlur et al. 2024, arXiv 2410.08146, progress;
      VinePPO / SPO / TreeRPO, value differences). Bounded, zero for equal groups, and a
      completion whose steps are missing or unverified scores 0 correct steps, never more than
      one that shows them.
    - `"progress-local"`: `_local_progress_credit`, progress past the first error: a step the
      verifier finds right on its own inputs after the first wrong one earns `local_weight`
      (needs a scorer that does not propagate errors, `verifier-think-local`), with state values
      pooled over the group's on-path and off-path completions at each step.
    - `"clip"`: Gao et al. 2024 (arXiv 2410.15115) clip form: step rewards `min(r_k - eta, 0)`
      summed over the steps still to come, `G_k = sum_{j>=k} min(r_j - eta, 0)`. Never positive,
      so more steps cannot pay.
    - `"delta"`: Gao et al. delta form: step rewards `r_k - r_{k+1}` (the last: `r_K`), whose
      sum over the steps still to come telescopes to `G_k = r_k`.
    - `"pure"`: PURE's min form (Cheng et al. 2025, arXiv 2504.15275): the return from step k is
      `G_k = min_{j>=k} r_j`, the worst step to come.
    These three are centred per step index: credit `G_{i,k} - mean_j G_{j,k}` over the
    completions j of the group that have a step k (a baseline, as RLOO's in Gao et al. and PURE).
    - `"value-delta"`: VinePPO (arXiv 2410.01679): step rewards are value estimates
      `V(s_k)` (Monte-Carlo success rates of the prefix, the last step the outcome); the credit
      is `V(s_k) - V(s_{k-1})`, with `V(s_0) = prompt_value` (default: the group's mean of the
      last-step values, the G rollouts being Monte-Carlo samples of the prompt itself).
    """
    if variant == "first-error":
        return _first_error_credit(step_rewards, threshold)
    if variant == "progress":
        return _progress_credit(step_rewards, threshold, eps)
    if variant == "progress-local":
        return _local_progress_credit(step_rewards, threshold, eps, local_weight)
    rows = [[float(r) for r in rs] for rs in step_rewards]
    if variant == "clip":
        return _centred([_suffix([min(r - eta, 0.0) for r in rs], lambda a, b: a + b)
                         for rs in rows])
    if variant == "delta":
        return _centred([list(rs) for rs in rows])  # the telescoped return of step k is r_k
    if variant == "pure":
        return _centred([_suffix(rs, min) for rs in rows])
    if variant == "value-delta":
        if prompt_value is None:
            lasts = [rs[-1] for rs in rows if rs]
            prompt_value = sum(lasts) / len(lasts) if lasts else 0.0
        return [[v - p for p, v in zip([prompt_value, *rs[:-1]], rs)] for rs in rows]
    raise ValueError(f"anchored_credit: unknown variant {variant!r}; "
                     f"expected one of {ANCHORED_VARIANTS}")


# ----------------------------------------------------------------------------------------------
# 4. Logging
# ----------------------------------------------------------------------------------------------


def step_statistics(
    step_rewards: Sequence[Sequence[float]],
    step_ends: Sequence[Sequence[int]] | None = None,
    correct_threshold: float = 0.5,
) -> dict[str, float]:
    """Numbers that reveal process-reward failure modes; plain floats for metrics.csv.

    Keys: `steps_per_completion` (mean), `steps_per_completion_max`, `tokens_per_step` (mean over
    all steps; needs `step_ends`), `step_reward_mean`, `step_reward_std` (population std),
    `step_correct_rate` (fraction of steps with reward >= `correct_threshold`, which suits 0/1 and
    signed -1/+1 verifier rewards), `first_error_step` (mean 1-based index of the first step
    below the threshold, over completions that have one; NaN when none has) and
    `error_free_rate` (fraction of completions with no step below the threshold).
    """
    counts = [len(rs) for rs in step_rewards]
    flat = [float(r) for rs in step_rewards for r in rs]
    n = len(flat)
    mean = sum(flat) / n if n else float("nan")
    std = math.sqrt(sum((r - mean) ** 2 for r in flat) / n) if n else float("nan")
    first_errors = []
    for rs in step_rewards:
        bad = [j for j, r in enumerate(rs) if float(r) < correct_threshold]
        if bad:
            first_errors.append(bad[0] + 1)
    stats = {
        "steps_per_completion": sum(counts) / len(counts) if counts else float("nan"),
        "steps_per_completion_max": float(max(counts, default=0)),
        "step_reward_mean": mean,
        "step_reward_std": std,
        "step_correct_rate": (sum(r >= correct_threshold for r in flat) / n) if n else float("nan"),
        "first_error_step": (sum(first_errors) / len(first_errors)) if first_errors
        else float("nan"),
        "error_free_rate": 1.0 - len(first_errors) / len(counts) if counts else float("nan"),
    }
    if step_ends is not None:
        sizes = [n for es in step_ends for n in step_sizes(es)]
        stats["tokens_per_step"] = sum(sizes) / len(sizes) if sizes else float("nan")
    return stats


# ----------------------------------------------------------------------------------------------
# 5. From rollouts to token advantages (the training-path glue)
# ----------------------------------------------------------------------------------------------


def completion_steps(
    tokenizer, completion_ids, length: int, text: str, truncated: bool,
    split_mode: str = "tags", pattern: str | None = None,
) -> tuple[list[str], list[int]]:
    """Step texts and step end indices of one generated completion.

    `completion_ids[:length]` are the generated tokens; `text` is their decoding without the final
    EOS (as `sample_rollouts` gives it) unless `truncated`. The EOS has no characters: it joins the
    last step. Steps that own no token are merged into a neighbour, so both lists have one entry
    per step, and a text without any step gets a single step.
    """
    # One tolist() call: iterating a tensor makes a tensor per id.
    ids = [int(i) for i in torch.as_tensor(completion_ids[:length]).tolist()]
    if not ids:
        return [], []
    text_ids = ids if truncated else ids[:-1]  # the EOS is not part of the text
    offsets = token_offsets_from_ids(tokenizer, text_ids, text)
    if not truncated:
        offsets.append((len(text), len(text)))
    spans = split_steps(text, split_mode, pattern) or [(0, len(text))]
    spans, ends = align_steps_to_tokens(offsets, spans)
    return step_texts(text, spans), ends
