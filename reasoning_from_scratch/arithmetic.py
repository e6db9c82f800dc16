"""The tiny arithmetic world: problems, difficulty levels, solution formats, flawed solutions, an
exact step verifier and held-out splits.

Every problem is a *chain* of 1 to 5 integer operations written with explicit parentheses,
for example ``"Compute ((17+5)*3)-8"``. A chain is evaluated left to right, one operation per
step, so the reference solution is unambiguous::

    Step 1: 17+5=22
    Step 2: 22*3=66
    Step 3: 66-8=58

Like MATH's levels 1-5, every problem has a difficulty level (:data:`LEVELS`): level k has k
operations, and the numbers grow with the level, from one operation on numbers up to 50 (results
below 100) to five operations with three-digit intermediate results and two-digit x one-digit
products. The held-out splits mix the five levels evenly and store the level on every example.

:func:`slip_result` and :func:`operand_slip` are the mistakes a learner makes (a dropped carry or
borrow, a transposed operand); the pretraining corpus of the bundled model contains worked
solutions with such slips, as real web text does, so the base model makes real step errors.

Because every intermediate result is known, a step can be checked exactly
(:func:`verify_steps`): this is the ground-truth process reward used in the process-supervision
chapter, and :func:`make_split` gives fixed, disjoint train / val / test sets.
"""

from __future__ import annotations

import hashlib
import operator
import random
import re

OPS = "+-*"
_OPERATORS = {"+": operator.add, "-": operator.sub, "*": operator.mul}

# Defaults of the bundled world; `make_split` with no knobs gives the held-out sets every chapter
# reports on, so change them only together with a rebuild of the bundled model.
DEFAULT_MIN_OPS = 1
DEFAULT_MAX_OPS = 3
DEFAULT_NUMBER_RANGE = (2, 20)  # first number, addends and subtrahends
DEFAULT_MULT_RANGE = (2, 9)  # multipliers
DEFAULT_MAX_VALUE = 99  # every intermediate result is in 1..max_value (at most two digits)
DEFAULT_MAX_MULT_VALUE = 99  # only numbers up to this are multiplied (2-digit x 1-digit products)
MAX_OPS = 5

# Difficulty levels (like MATH's 1-5): level k = k operations, bigger numbers higher up.
# `make_split` draws the level of each problem uniformly from 1..5 unless told otherwise.
LEVELS = {
    1: dict(min_ops=1, max_ops=1, number_range=(2, 50), max_value=99),
    2: dict(min_ops=2, max_ops=2, number_range=(2, 30), max_value=99),
    3: dict(min_ops=3, max_ops=3, number_range=(2, 50), max_value=199),
    4: dict(min_ops=4, max_ops=4, number_range=(2, 99), max_value=499),
    5: dict(min_ops=5, max_ops=5, number_range=(2, 99), max_value=999),
}
ALL_LEVELS = tuple(LEVELS)

# Seeds of the fixed splits; membership is decided by a hash of the problem string (see split_of),
# so the splits are disjoint whatever their sizes.
SPLIT_SEEDS = {"train": 0, "val": 1, "test": 2}
HELDOUT_PERCENT = {"test": 10, "val": 10}  # the rest of the problem space belongs to "train"

# Solution formats of the pretraining corpus (see format_solution).
STYLES = ("think", "steps_answer", "steps_boxed", "direct_boxed", "direct_answer")


def apply_op(op: str, a: int, b: int) -> int:
    """Result of `a op b` for one of the three operations."""
    if op not in _OPERATORS:
        raise ValueError(f"unknown operation {op!r}; expected one of {OPS!r}")
    return _OPERATORS[op](a, b)


def _operand_choices(op, value, number_range, mult_range, max_value, max_mult_value):
    """Second operands `b` that keep `value op b` inside 1..max_value."""
    lo, hi = number_range
    if op == "+":
        return list(range(lo, min(hi, max_value - value) + 1))
    if op == "-":
        return list(range(lo, min(hi, value - 1) + 1))  # result stays >= 1
    if value > max_mult_value:  # keep products to (at most) two digits x one digit
        return []
    m_lo, m_hi = mult_range
    return list(range(m_lo, min(m_hi, max_value // max(value, 1)) + 1))


def _chain_expression(numbers: list[int], ops: list[str]) -> str:
    """Parenthesised chain: [17, 5, 3], ['+', '*'] -> '(17+5)*3'."""
    expr = str(numbers[0])
    for i, (op, b) in enumerate(zip(ops, numbers[1:])):
        expr = f"({expr}){op}{b}" if i > 0 else f"{expr}{op}{b}"
    return expr


def example_from_chain(numbers: list[int], ops: list[str]) -> dict:
    """Build the example dict (problem, answer, steps) of a chain of numbers and operations."""
    if len(numbers) != len(ops) + 1 or not ops:
        raise ValueError(f"need len(numbers) == len(ops) + 1 >= 2, got {numbers} and {ops}")
    value, steps = numbers[0], []
    for op, b in zip(ops, numbers[1:]):
        result = apply_op(op, value, b)
        steps.append(f"{value}{op}{b}={result}")
        value = result
    return {
        "problem": f"Compute {_chain_expression(numbers, ops)}",
        "answer": str(value),
        "steps": steps,
        "level": len(ops),
    }


def problem_level(problem: str) -> int:
    """Difficulty level of a chain problem: its number of operations (see LEVELS)."""
    return len(parse_problem(problem)[1])


def generate_level_problem(rng: random.Random, level: int) -> dict:
    """Draw one problem of a difficulty level (1-5) with that level's knobs."""
    if level not in LEVELS:
        raise ValueError(f"unknown level {level!r}; expected one of {ALL_LEVELS}")
    return generate_problem(rng, **LEVELS[level])


def generate_problem(
    rng: random.Random,
    min_ops: int = DEFAULT_MIN_OPS,
    max_ops: int = DEFAULT_MAX_OPS,
    number_range: tuple[int, int] = DEFAULT_NUMBER_RANGE,
    mult_range: tuple[int, int] = DEFAULT_MULT_RANGE,
    max_value: int = DEFAULT_MAX_VALUE,
    ops: str = OPS,
    max_mult_value: int = DEFAULT_MAX_MULT_VALUE,
) -> dict:
    """Draw one chain problem with a uniform number of operations in [min_ops, max_ops]."""
    if not 1 <= min_ops <= max_ops <= MAX_OPS:
        raise ValueError(f"need 1 <= min_ops <= max_ops <= {MAX_OPS}, got {min_ops}, {max_ops}")
    if not ops or any(op not in OPS for op in ops):
        raise ValueError(f"ops must be a non-empty subset of {OPS!r}, got {ops!r}")
    n_ops = rng.randint(min_ops, max_ops)
    for _ in range(1000):  # rejection: restart the chain if no operation fits
        numbers, chosen = [rng.randint(*number_range)], []
        value = numbers[0]  # the running result of the chain
        for _ in range(n_ops):
            feasible = {
                op: c
                for op in ops
                if (c := _operand_choices(op, value, number_range, mult_range, max_value,
                                          max_mult_value))
            }
            if not feasible:
                break
            op = rng.choice(sorted(feasible))
            chosen.append(op)
            numbers.append(rng.choice(feasible[op]))
            value = apply_op(op, value, numbers[-1])
        if len(chosen) == n_ops:
            return example_from_chain(numbers, chosen)
    raise ValueError("could not draw a problem with these knobs; widen the ranges")


def split_of(problem: str) -> str:
    """The split ('train', 'val' or 'test') a problem string belongs to, by a stable hash."""
    bucket = int(hashlib.sha256(problem.encode("utf-8")).hexdigest()[:8], 16) % 100
    if bucket < HELDOUT_PERCENT["test"]:
        return "test"
    if bucket < HELDOUT_PERCENT["test"] + HELDOUT_PERCENT["val"]:
        return "val"
    return "train"


def make_split(
    split: str,
    n: int,
    seed: int | None = None,
    levels=ALL_LEVELS,
    level_weights=None,
    **knobs,
) -> list[dict]:
    """`n` problems of one split; deterministic for a given seed (default: the split's own seed).

    By default every problem's level is drawn from `levels` (uniformly, or by `level_weights`)
    and the problem from that level's knobs (LEVELS). Generator knobs (`max_ops=2`,
    `number_range=...`, see `generate_problem`) instead draw every problem from those knobs: a
    custom world. Either way each example carries its "level" (its number of operations).

    The three splits never share a problem string: a problem belongs to the split `split_of`
    assigns it to. The held-out splits ("val", "test") also hold no duplicates; "train" is a
    stream that may repeat easy problems, as a real corpus does.
    """
    if split not in SPLIT_SEEDS:
        raise ValueError(f"unknown split {split!r}; expected one of {sorted(SPLIT_SEEDS)}")
    rng = random.Random(SPLIT_SEEDS[split] if seed is None else seed)
    levels = tuple(levels)
    if any(level not in LEVELS for level in levels):
        raise ValueError(f"levels must be in {ALL_LEVELS}, got {levels}")
    out, seen = [], set()
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 1000 * (n + 10):
            raise ValueError(f"cannot draw {n} distinct {split!r} problems with knobs {knobs}")
        if knobs:
            ex = generate_problem(rng, **knobs)
        else:
            ex = generate_level_problem(rng, rng.choices(levels, weights=level_weights)[0])
        if split_of(ex["problem"]) != split:
            continue
        if split != "train":
            if ex["problem"] in seen:
                continue
            seen.add(ex["problem"])
        out.append(ex)
    return out


def format_solution(example: dict, style: str = "think") -> str:
    """Completion text (what follows "Answer:") of an example in one of the STYLES.

    - "think": the reference, " <think>\\nStep 1: 17+5=22\\n...</think>\\n\\boxed{58}"
    - "steps_answer": steps, then "The answer is 58." (no box: strict reward 0)
    - "steps_boxed": steps without think tags, then "\\boxed{58}"
    - "direct_boxed": " \\boxed{58}" without any steps
    - "direct_answer": " The answer is 58." without any steps
    """
    steps = "\n".join(f"Step {i}: {s}" for i, s in enumerate(example["steps"], start=1))
    answer = example["answer"]
    if style == "think":
        return f" <think>\n{steps}\n</think>\n\\boxed{{{answer}}}"
    if style == "steps_answer":
        return f"\n{steps}\nThe answer is {answer}."
    if style == "steps_boxed":
        return f"\n{steps}\n\\boxed{{{answer}}}"
    if style == "direct_boxed":
        return f" \\boxed{{{answer}}}"
    if style == "direct_answer":
        return f" The answer is {answer}."
    raise ValueError(f"unknown style {style!r}; expected one of {STYLES}")


_PROBLEM_RE = re.compile(r"^\s*(?:Compute\s+)?([0-9+\-*()\s]+?)\s*[.?]?\s*$")
_STEP_LINE_RE = re.compile(r"^\s*Step\s*\d+\s*:\s*(.*?)\s*$", re.MULTILINE)
_STEP_PREFIX_RE = re.compile(r"^\s*Step\s*\d+\s*:\s*")
_STEP_RE = re.compile(r"^\s*(\d+)\s*([+\-*])\s*(\d+)\s*=\s*(\d+)\s*\.?\s*$")


def parse_problem(problem: str) -> tuple[list[int], list[str]]:
    """Numbers and operations of a chain problem: 'Compute (17+5)*3' -> ([17, 5, 3], ['+', '*'])."""
    m = _PROBLEM_RE.match(problem)
    if m is None:
        raise ValueError(f"not a chain arithmetic problem: {problem!r}")
    tokens = re.findall(r"\d+|[+\-*]", m.group(1))
    numbers, ops = [int(t) for t in tokens[0::2]], tokens[1::2]
    if (
        len(numbers) != len(ops) + 1
        or not ops
        or any(t.isdigit() for t in ops)
        or any(op not in OPS for op in ops)
    ):
        raise ValueError(f"not a chain arithmetic problem: {problem!r}")
    return numbers, ops


def parse_steps(completion_text: str) -> list[str]:
    """The step expressions of a completion: every 'Step k: ...' line, prefix removed."""
    return _STEP_LINE_RE.findall(completion_text)


def verify_steps(problem: str, step_texts: list[str]) -> list[bool]:
    """Exact correctness of each step ('17+5=22' or 'Step 1: 17+5=22') of a chain problem.

    Step k is correct iff it has the form `a op b = c` with integers, `c == a op b`, `op` is the
    problem's k-th operation, and its operands are the ones available at that point in the
    problem's evaluation order: the running value and the problem's (k+1)-th number (either order
    for + and *, running value first for -). The running value is the first number for step 1 and
    afterwards the result *written* in the previous step, so a step that correctly continues from an
    earlier wrong result is itself correct (the error is counted once, where it happens; see
    `first_error_step`). Steps beyond the problem's number of operations are incorrect.
    """
    numbers, ops = parse_problem(problem)
    verdicts, running = [], numbers[0]
    for k, text in enumerate(step_texts):
        m = _STEP_RE.match(_STEP_PREFIX_RE.sub("", text))
        true_next = apply_op(ops[k], running, numbers[k + 1]) if k < len(ops) else None
        if m is None or k >= len(ops):
            verdicts.append(False)
            running = true_next  # an unreadable step: continue from the correct value
            continue
        a, op, b, c = int(m.group(1)), m.group(2), int(m.group(3)), int(m.group(4))
        if op == "-":
            operands_ok = (a, b) == (running, numbers[k + 1])
        else:
            operands_ok = sorted((a, b)) == sorted((running, numbers[k + 1]))
        verdicts.append(op == ops[k] and operands_ok and c == apply_op(op, a, b))
        running = c
    return verdicts


def first_error_step(problem: str, step_texts: list[str]) -> int | None:
    """0-based index of the first incorrect step, or None when every given step is correct."""
    for i, ok in enumerate(verify_steps(problem, step_texts)):
        if not ok:
            return i
    return None


# ----------------------------------------------------------------------------------------------
# Slips: the mistakes of a learner (and of a base model that read their solutions)
# ----------------------------------------------------------------------------------------------


def slip_result(a: int, op: str, b: int) -> int | None:
    """The result of `a op b` with the carry (or borrow) out of the units column forgotten.

    The classic column-arithmetic slips, each changing exactly one digit (the tens) of the result:
    - addition: the carry from the units is not added (47+38 -> 75, not 85);
    - subtraction: the units borrow, but the tens are not decreased (52-37 -> 25, not 15);
    - multiplication by a one-digit number: the carry from the units product is not added
      (47*3 -> 121, not 141).
    None when the step has no such carry, or when forgetting it would change more than one digit
    (95+5 -> 90 instead of 100): a slip is one wrong digit, never a different-looking number.
    """
    if op not in OPS:
        raise ValueError(f"unknown operation {op!r}; expected one of {OPS!r}")
    true = apply_op(op, a, b)
    if op == "+":
        carry = (a % 10 + b % 10) // 10
        slip = true - 10 * carry
    elif op == "-":
        borrow = int(a % 10 < b % 10)
        slip = true + 10 * borrow
    else:
        big, small = (a, b) if a >= b else (b, a)
        if small > 9:
            return None  # only one-digit multipliers are written column by column here
        slip = true - 10 * ((big % 10) * small // 10)
    if slip == true or true < 1 or len(str(slip)) != len(str(true)):
        return None
    differing = sum(x != y for x, y in zip(str(slip), str(true)))
    return slip if differing == 1 else None


def is_large_step(a: int, op: str, b: int) -> bool:
    """Whether step `a op b` involves a three-digit number (an operand or the result)."""
    return max(a, b, apply_op(op, a, b)) >= 100


def classify_carry_steps(problem: str, step_texts: list[str]) -> list[str]:
    """What a solution wrote at each three-digit step that has a slip (`slip_result`): "correct",
    "slip" (exactly the forgotten carry) or "other" (another wrong result).

    Only steps whose operands are the right ones (the running value as written, the problem's
    next number) are classified, so a step is judged on its own arithmetic.
    """
    numbers, ops = parse_problem(problem)
    kinds, running = [], numbers[0]
    for k, text in enumerate(step_texts[: len(ops)]):
        m = _STEP_RE.match(_STEP_PREFIX_RE.sub("", text))
        if m is None:
            break
        a, op, b, c = int(m.group(1)), m.group(2), int(m.group(3)), int(m.group(4))
        expected = (running, numbers[k + 1])
        operands_ok = (a, b) == expected or (op != "-" and (b, a) == expected)
        if op == ops[k] and operands_ok and is_large_step(a, op, b):
            slip = slip_result(a, op, b)
            if slip is not None:
                kinds.append("correct" if c == apply_op(op, a, b) else
                             "slip" if c == slip else "other")
        running = c
    return kinds


def operand_slip(b: int) -> int | None:
    """A copying slip: the operand's two digits transposed (38 -> 83); None if it reads the same."""
    text = str(b)
    if len(text) != 2 or text[0] == text[1] or text[1] == "0":
        return None
    return int(text[::-1])


def flawed_solution(example: dict, rng: random.Random, slip_prob, operand_prob=0.0) -> dict:
    """A copy of `example` whose worked steps contain a learner's slips (and the answer they give).

    Step k uses the running value *as written so far*, so a slip propagates to the answer, as in
    a real wrong solution. `slip_prob(a, op, b)` is the probability of forgetting the units carry of
    that step (only steps that have carries can slip, see `slip_result`); `operand_prob` that of
    transposing the operand taken from the problem (`operand_slip`). A chain that would go below
    1 after a slip is written without slips. The copy's "slips" lists the 0-based slipped steps.
    """
    numbers, ops = parse_problem(example["problem"])
    value, steps, slipped = numbers[0], [], []
    for k, (op, b) in enumerate(zip(ops, numbers[1:])):
        written_b = b
        swapped = operand_slip(b)
        if swapped is not None and operand_prob and rng.random() < operand_prob:
            written_b = swapped
        result = apply_op(op, value, written_b)
        slip = slip_result(value, op, written_b)
        if slip is not None and rng.random() < slip_prob(value, op, written_b):
            result = slip
        if written_b != b or result != apply_op(op, value, b):
            slipped.append(k)
        if result < 1:
            return {**example, "slips": []}
        steps.append(f"{value}{op}{written_b}={result}")
        value = result
    return {**example, "steps": steps, "answer": str(value), "slips": slipped}


_BOXED_RE = re.compile(r"\\boxed\{")


def classify_completion(text: str) -> str:
    """Which of the STYLES a completion looks like ("other" if none), judged by its markers.

    Used to report the format mix a model samples; the think format here means a <think> before
    a </think> and a boxed answer after it, as in the reference solution.
    """
    has_steps = bool(parse_steps(text))
    boxed = bool(_BOXED_RE.search(text))
    start, end = text.find("<think>"), text.find("</think>")
    if 0 <= start < end:
        return "think" if boxed and _BOXED_RE.search(text[end:]) else "other"
    if "<think>" in text or "</think>" in text:
        return "other"
    answer_is = "The answer is" in text
    if has_steps:
        return "steps_boxed" if boxed else ("steps_answer" if answer_is else "other")
    return "direct_boxed" if boxed else ("direct_answer" if answer_is else "other")

