"""Tests for the arithmetic world: generator, formats, step verifier, splits."""

import random
import re

import pytest

from reasoning_from_scratch.arithmetic import (
    LEVELS,
    STYLES,
    apply_op,
    classify_completion,
    example_from_chain,
    first_error_step,
    flawed_solution,
    format_solution,
    make_split,
    operand_slip,
    parse_problem,
    parse_steps,
    problem_level,
    slip_result,
    split_of,
    verify_steps,
)

PROBLEM = "Compute ((17+25)*3)-8"
REFERENCE = ["17+25=42", "42*3=126", "126-8=118"]


def _left_to_right(problem):
    """Independent evaluation of a chain problem: drop the parentheses, apply ops in order."""
    tokens = re.findall(r"\d+|[+\-*]", problem)
    value = int(tokens[0])
    for op, b in zip(tokens[1::2], tokens[2::2]):
        b = int(b)
        value = value + b if op == "+" else value - b if op == "-" else value * b
    return value


def test_generator_is_deterministic_and_seed_dependent():
    assert make_split("train", 50, seed=3) == make_split("train", 50, seed=3)
    assert make_split("train", 50, seed=3) != make_split("train", 50, seed=4)
    assert make_split("test", 20) == make_split("test", 20)


def test_answers_and_steps_are_correct():
    for ex in make_split("train", 300, seed=1):
        numbers, ops = parse_problem(ex["problem"])
        assert int(ex["answer"]) == _left_to_right(ex["problem"])
        assert len(ex["steps"]) == len(ops) == ex["level"] == problem_level(ex["problem"])
        knobs = LEVELS[ex["level"]]
        running = numbers[0]
        for step, op, b in zip(ex["steps"], ops, numbers[1:]):
            lhs, c = step.split("=")
            assert lhs == f"{running}{op}{b}"
            if op == "*":  # two-digit x one-digit products only
                assert running <= 99 and 2 <= b <= 9
            running = int(c)
            # no negative (or zero) intermediate results, none above the level's bound
            assert 1 <= running <= knobs["max_value"]
        assert str(running) == ex["answer"]
        assert all(verify_steps(ex["problem"], ex["steps"]))


def test_levels_are_mixed_evenly_and_can_be_chosen():
    test = make_split("test", 500)
    counts = [sum(e["level"] == lv for e in test) for lv in LEVELS]
    assert all(70 <= c <= 130 for c in counts), counts  # uniform: 100 each in expectation
    hard = make_split("train", 50, seed=0, levels=(5,))
    assert {e["level"] for e in hard} == {5} and max(int(e["answer"]) for e in hard) > 99
    assert {e["level"] for e in make_split("train", 60, seed=0, level_weights=(1, 0, 0, 0, 1))} \
        == {1, 5}
    with pytest.raises(ValueError):
        make_split("train", 1, levels=(6,))


def test_knobs():
    exs = make_split("train", 40, seed=0, ops="+", min_ops=2, max_ops=2, max_value=500)
    assert all(len(e["steps"]) == 2 and "-" not in e["problem"] for e in exs)
    assert {len(e["steps"]) for e in make_split("train", 200, seed=0, max_ops=4)} == {1, 2, 3, 4}
    with pytest.raises(ValueError):
        make_split("train", 1, ops="/")
    with pytest.raises(ValueError):
        make_split("dev", 1)


def test_reference_format_matches_design():
    ex = example_from_chain([17, 25, 3, 8], ["+", "*", "-"])
    assert ex == {"problem": PROBLEM, "answer": "118", "steps": REFERENCE, "level": 3}
    assert format_solution(ex) == (
        " <think>\nStep 1: 17+25=42\nStep 2: 42*3=126\nStep 3: 126-8=118\n</think>\n\\boxed{118}"
    )
    assert format_solution(ex, "steps_answer").endswith("Step 3: 126-8=118\nThe answer is 118.")
    assert format_solution(ex, "direct_boxed") == " \\boxed{118}"
    for style in STYLES:
        assert classify_completion(format_solution(ex, style)) == style
        expected_steps = [] if style.startswith("direct") else REFERENCE
        assert parse_steps(format_solution(ex, style)) == expected_steps
    assert classify_completion("<think>\nStep 1: 17+25=42") == "other"


def test_verify_steps_hand_cases():
    assert verify_steps(PROBLEM, REFERENCE) == [True, True, True]
    assert first_error_step(PROBLEM, REFERENCE) is None
    # Commuted + and * are fine; a reversed subtraction is not.
    assert verify_steps(PROBLEM, ["25+17=42", "3*42=126", "8-126=118"]) == [True, True, False]
    # Wrong arithmetic is caught once; the next steps continue correctly from the written result.
    assert verify_steps(PROBLEM, ["17+25=43", "43*3=129", "129-8=121"]) == [False, True, True]
    assert first_error_step(PROBLEM, ["17+25=43", "43*3=129", "129-8=121"]) == 0
    # Right arithmetic on an operand the problem does not offer at that point.
    assert verify_steps(PROBLEM, ["17+26=43"]) == [False]
    assert verify_steps(PROBLEM, ["17+25=42", "25*3=75"]) == [True, False]
    assert verify_steps(PROBLEM, ["42*3=126"]) == [False]  # skips the first operation
    assert verify_steps(PROBLEM, ["17*25=425"]) == [False]  # wrong operation
    # Not continuing from the previous (written) result.
    assert verify_steps(PROBLEM, ["17+25=42", "43*3=129"]) == [True, False]
    assert first_error_step(PROBLEM, ["17+25=42", "43*3=129"]) == 1
    # "Step k:" prefixes and spaces are accepted; unreadable and extra steps are wrong.
    assert verify_steps(PROBLEM, ["Step 1: 17 + 25 = 42", "Step 2: 42*3=126"]) == [True, True]
    assert verify_steps(PROBLEM, ["we add", "42*3=126"]) == [False, True]
    assert verify_steps(PROBLEM, [*REFERENCE, "118+0=118"]) == [True, True, True, False]
    with pytest.raises(ValueError):
        verify_steps("What is the capital of France?", ["1+1=2"])


def test_parse_steps():
    text = " <think>\nStep 1: 3+4=7\nStep 2:7*2=14 \n</think>\n\\boxed{14}"
    assert parse_steps(text) == ["3+4=7", "7*2=14"]
    assert parse_steps(" \\boxed{14}") == []


def test_splits_are_disjoint_and_held_out_sets_unique():
    test, val = make_split("test", 200), make_split("val", 200)
    train = make_split("train", 3000)
    test_p, val_p, train_p = (set(e["problem"] for e in s) for s in (test, val, train))
    assert len(test_p) == 200 and len(val_p) == 200
    assert not test_p & train_p and not val_p & train_p and not test_p & val_p
    assert all(split_of(p) == "test" for p in test_p)
    # The training stream of any seed avoids the held-out problems too.
    assert not test_p & set(e["problem"] for e in make_split("train", 3000, seed=7))


def test_slip_result_hand_cases():
    # The carry out of the units forgotten: exactly one digit (the tens) of the result changes.
    assert slip_result(47, "+", 38) == 75  # not 85
    assert slip_result(95, "+", 17) == 102  # not 112
    assert slip_result(158, "+", 69) == 217  # not 227
    assert slip_result(12, "+", 13) is None  # no carry, no slip
    assert slip_result(95, "+", 5) is None  # 90 for 100 would change more than one digit
    # The units borrow, but the tens are not decreased.
    assert slip_result(52, "-", 37) == 25  # not 15
    assert slip_result(304, "-", 58) == 256  # not 246
    assert slip_result(23, "-", 5) == 28  # not 18
    assert slip_result(58, "-", 23) is None
    assert slip_result(100, "-", 1) is None  # 109 for 99: a different-looking number
    # The carry of the units product forgotten.
    assert slip_result(47, "*", 3) == 121  # not 141
    assert slip_result(3, "*", 47) == 121  # either order
    assert slip_result(21, "*", 4) is None
    assert slip_result(26, "*", 4) is None  # 84 for 104
    # Every slip differs from the truth in exactly one digit.
    for a_ in range(2, 400, 7):
        for b_ in range(2, 99, 3):
            for op in "+-*":
                s_ = slip_result(a_, op, b_)
                if s_ is not None:
                    t = str(apply_op(op, a_, b_))
                    assert len(str(s_)) == len(t)
                    assert sum(x != y for x, y in zip(str(s_), t)) == 1
    assert operand_slip(38) == 83 and operand_slip(33) is None and operand_slip(30) is None
    assert operand_slip(7) is None


def test_flawed_solution_propagates_and_is_caught_by_the_verifier():
    ex = example_from_chain([47, 38, 2], ["+", "-"])  # 47+38=85, 85-2=83
    always = flawed_solution(ex, random.Random(0), lambda a, op, b: 1.0)
    assert always["steps"] == ["47+38=75", "75-2=73"] and always["answer"] == "73"
    assert always["slips"] == [0]
    # The slipped step is wrong; the next step continues correctly from the written 75.
    assert verify_steps(ex["problem"], always["steps"]) == [False, True]
    never = flawed_solution(ex, random.Random(0), lambda a, op, b: 0.0)
    assert never["steps"] == ex["steps"] and never["answer"] == "83" and never["slips"] == []
    transposed = flawed_solution(ex, random.Random(0), lambda a, op, b: 0.0, operand_prob=1.0)
    assert transposed["steps"][0] == "47+83=130" and transposed["slips"] == [0]
    assert verify_steps(ex["problem"], transposed["steps"])[0] is False
    # A slip rate of 0.5 slips about half of the carry steps.
    rng = random.Random(1)
    rate = sum(bool(flawed_solution(ex, rng, lambda a, op, b: 0.5)["slips"])
               for _ in range(2000)) / 2000
    assert 0.45 < rate < 0.55
