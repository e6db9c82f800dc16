"""Tests for reasoning_from_scratch.rewards: the think-format reward and weighted combinations."""

import pytest
import torch

from reasoning_from_scratch.rewards import (
    CompositeReward,
    RewardTerm,
    build_reward,
    correctness_reward,
    reward_format,
)
from reasoning_from_scratch.tokenizer import END_THINK_TOKEN_ID, THINK_TOKEN_ID


def test_reward_format_book_semantics():
    T, E = THINK_TOKEN_ID, END_THINK_TOKEN_ID
    prompt = [5, 6, 7]
    assert reward_format(torch.tensor(prompt + [T, 9, 9, E, 4]), 3) == 1.0
    assert reward_format(torch.tensor(prompt + [E, 9, T]), 3) == 0.0  # wrong order
    assert reward_format(torch.tensor(prompt + [T, 9, 9]), 3) == 0.0  # no end tag
    assert reward_format(torch.tensor(prompt + [9, E]), 3) == 0.0  # no start tag
    # a <think> inside the prompt does not count: only the generated part is searched
    assert reward_format(torch.tensor([T, 6, 7, 9, E]), 3) == 0.0
    assert reward_format(torch.tensor(prompt), 3) == 0.0  # empty answer
    # tiny tokenizer ids passed explicitly
    ids = torch.tensor(prompt + [40, 41])
    assert reward_format(ids, 3, start_think_id=40, end_think_id=41) == 1.0


def _const(value):
    return lambda text, ids, prompt_len, example: value


def test_composite_reward_weights_and_gate():
    reward = CompositeReward([
        RewardTerm("correct", _const(0.0)),
        RewardTerm("format", _const(1.0), weight=0.5, only_if="correct"),
        RewardTerm("short", _const(1.0), weight=0.25),
    ])
    total, parts = reward("x", torch.tensor([1, 2]), 1, {})
    # gated format term pays nothing for a wrong answer, but its raw value is still reported
    assert total == 0.25 and parts == {"correct": 0.0, "format": 1.0, "short": 1.0}
    reward.terms[0].fn = _const(1.0)
    assert reward("x", torch.tensor([1, 2]), 1, {})[0] == 1.0 + 0.5 + 0.25
    with pytest.raises(ValueError, match="earlier term"):
        CompositeReward([RewardTerm("format", _const(1.0), only_if="correct")])
    with pytest.raises(ValueError, match="duplicate"):
        CompositeReward([RewardTerm("a", _const(1.0)), RewardTerm("a", _const(1.0))])


class _Tok:
    think_token_id = 40
    end_think_token_id = 41


def test_build_reward_correctness_plus_conditional_format():
    example = {"problem": "2+3", "answer": "5"}
    good_ids = torch.tensor([1, 2, 40, 9, 41])
    assert correctness_reward("so \\boxed{5}", good_ids, 2, example) == 1.0
    plain = build_reward(_Tok(), format_reward_weight=0.5)
    assert plain("\\boxed{5}", good_ids, 2, example)[0] == 1.5
    assert plain("\\boxed{6}", good_ids, 2, example) == (0.5, {"correct": 0.0, "format": 1.0})
    cond = build_reward(_Tok(), format_reward_weight=0.5, format_reward_conditional=True)
    assert cond("\\boxed{5}", good_ids, 2, example)[0] == 1.5
    assert cond("\\boxed{6}", good_ids, 2, example)[0] == 0.0
    # weight 0 (book chapter 6): correctness only, format still measured
    assert build_reward(_Tok())("\\boxed{5}", good_ids, 2, example) == (
        1.0, {"correct": 1.0, "format": 1.0})
