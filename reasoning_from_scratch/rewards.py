"""Rewards for GRPO: the think-format reward and pluggable, weighted combinations of rewards.

A reward function is any callable ``fn(text, token_ids, prompt_len, example) -> float`` where
``text`` is the decoded completion, ``token_ids`` the 1-D prompt+completion ids, ``prompt_len`` the
number of prompt tokens and ``example`` the task dict (``{"problem", "answer", ...}``).
``CompositeReward`` adds several of them with weights; a term may be gated on another one (the
format reward "only when the answer is correct", which stops the policy from farming format
reward with wrong answers).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .grading import reward_rlvr
from .tokenizer import END_THINK_TOKEN_ID, THINK_TOKEN_ID

RewardFn = Callable[[str, torch.Tensor, int, dict], float]


def reward_format(token_ids, prompt_len, start_think_id=THINK_TOKEN_ID,
                  end_think_id=END_THINK_TOKEN_ID):
    """1.0 if the generated part has the start think token before the end think token, else 0.0."""
    # Book chapter 7: `.index` finds the first occurrence of each; a missing one raises ValueError.
    try:
        gen = token_ids[prompt_len:].tolist()
        return float(gen.index(start_think_id) < gen.index(end_think_id))
    except ValueError:
        return 0.0


def correctness_reward(text, token_ids, prompt_len, example):
    """RLVR correctness: 1.0 iff the completion's boxed answer grades equal to the reference."""
    return reward_rlvr(text, example["answer"])


def make_format_reward(start_think_id=THINK_TOKEN_ID, end_think_id=END_THINK_TOKEN_ID) -> RewardFn:
    """Wrap `reward_format` as a reward function for a tokenizer's think-token ids."""

    def format_reward(text, token_ids, prompt_len, example):
        return reward_format(token_ids, prompt_len, start_think_id, end_think_id)

    return format_reward


@dataclass
class RewardTerm:
    """A weighted reward function; `only_if` names an earlier term that must be > 0 to pay."""

    name: str
    fn: RewardFn
    weight: float = 1.0
    only_if: str | None = None


class CompositeReward:
    """Weighted sum of reward terms; calling it returns (total, {name: raw value}).

    The components are the raw (ungated, unweighted) values, so a gated format term still logs the
    true format rate; the gate only decides whether the term adds to the total.
    """

    def __init__(self, terms: Sequence[RewardTerm]):
        names = [t.name for t in terms]
        if len(set(names)) != len(names):
            raise ValueError(f"CompositeReward: duplicate term names in {names}")
        for i, term in enumerate(terms):
            if term.only_if is not None and term.only_if not in names[:i]:
                raise ValueError(
                    f"CompositeReward: term {term.name!r} is gated on {term.only_if!r}, "
                    f"which must be an earlier term (have {names[:i]})"
                )
        self.terms = list(terms)

    @property
    def names(self) -> list[str]:
        """Names of the terms in order (the keys of the components dict)."""
        return [t.name for t in self.terms]

    def paid(self, components: dict) -> list[float]:
        """Each term's unweighted value as it enters the total (0 where its gate did not pay), in
        the order of `terms`; GDPO normalises each of them in its group."""
        return [0.0 if t.only_if is not None and components[t.only_if] <= 0
                else components[t.name] for t in self.terms]

    def __call__(self, text, token_ids, prompt_len, example):
        components: dict[str, float] = {}
        total = 0.0
        for term in self.terms:
            value = float(term.fn(text, token_ids, prompt_len, example))
            components[term.name] = value
            if term.only_if is not None and components[term.only_if] <= 0:
                continue  # gated off: the term pays only when its gate term paid
            total += term.weight * value
        return total, components


def build_reward(tokenizer=None, format_reward_weight=0.0, format_reward_conditional=False,
                 extra_terms: Sequence[RewardTerm] = ()) -> CompositeReward:
    """Correctness (`reward_rlvr`) + `format_reward_weight` x think format (book ch. 7) + extras.

    The think ids come from `tokenizer.think_token_id` / `end_think_token_id` when given, else
    Qwen3's ids. With `format_reward_conditional` the format term pays only for correct answers.
    The "format" component is always computed (weight 0 when off) so it can be logged.
    """
    start_id, end_id = THINK_TOKEN_ID, END_THINK_TOKEN_ID
    if tokenizer is not None:
        start_id = getattr(tokenizer, "think_token_id", None) or start_id
        end_id = getattr(tokenizer, "end_think_token_id", None) or end_id
    terms = [
        RewardTerm("correct", correctness_reward, 1.0),
        RewardTerm("format", make_format_reward(start_id, end_id), format_reward_weight,
                   only_if="correct" if format_reward_conditional else None),
    ]
    return CompositeReward(terms + list(extra_terms))


class TimedReward:
    """A reward function that adds up the seconds spent in it (`seconds`), for benchmarks that
    split a GRPO step into rollouts, scoring and update; `names` passes through."""

    def __init__(self, fn):
        self.fn, self.seconds = fn, 0.0
        self.names = getattr(fn, "names", None)

    def __call__(self, *args):
        t = time.perf_counter()
        out = self.fn(*args)
        self.seconds += time.perf_counter() - t
        return out
