"""Checks for numeric settings, shared by the config dataclasses and the command-line flags.

A rule is a small function `rule(value) -> message | None`. The same rule guards a dataclass
field (`check(name, value, rule)` raises ValueError) and an argparse flag (`arg_type(int, rule)`
turns a bad value into a one-line argparse error, exit status 2), so a NaN learning rate or a
negative token budget is refused before anything is written, from Python as from the shell.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import field, fields

Rule = Callable[[object], "str | None"]


def _number_problem(value) -> str | None:
    """Why `value` is not a usable number (NaN, inf, not a number), or None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"expected a number, got {value!r}"
    if not math.isfinite(value):
        return f"must be a finite number, got {value}"
    return None


def at_least(low) -> Rule:
    """value >= low (and finite)."""
    def rule(value):
        return _number_problem(value) or (None if value >= low else f"must be >= {low}, "
                                          f"got {value}")
    return rule


def greater_than(low) -> Rule:
    """value > low (and finite)."""
    def rule(value):
        return _number_problem(value) or (None if value > low else f"must be > {low}, "
                                          f"got {value}")
    return rule


def in_range(low, high, low_open=False, high_open=False) -> Rule:
    """low <= value <= high, with either end optionally open."""
    def rule(value):
        problem = _number_problem(value)
        if problem:
            return problem
        ok_low = value > low if low_open else value >= low
        ok_high = value < high if high_open else value <= high
        if ok_low and ok_high:
            return None
        return (f"must be in {'(' if low_open else '['}{low}, {high}"
                f"{')' if high_open else ']'}, got {value}")
    return rule


def finite(value) -> str | None:
    """Any finite number."""
    return _number_problem(value)


positive = greater_than(0)
non_negative = at_least(0)
probability = in_range(0, 1, low_open=True)  # top-p: (0, 1]


def optional(rule: Rule) -> Rule:
    """None passes; anything else must pass `rule`."""
    def check_optional(value):
        return None if value is None else rule(value)
    return check_optional


def check(name: str, value, rule: Rule) -> None:
    """Raise ValueError naming the setting when `value` breaks `rule`."""
    problem = rule(value)
    if problem:
        raise ValueError(f"{name} {problem}")


def arg_type(kind: type, rule: Rule | None = None, allow_none: bool = False):
    """argparse `type=`: parse with `kind` ('none' -> None if allowed), then apply `rule`."""
    def parse(text):
        if allow_none and text.lower() == "none":
            return None
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind.__name__}, got {text!r}") from None
        problem = rule(value) if rule else None
        if problem:
            raise argparse.ArgumentTypeError(problem)
        return value
    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


# Ready-made argparse types for the scripts' common flags.
positive_int = arg_type(int, at_least(1))  # counts, steps, token budgets
non_negative_int = arg_type(int, at_least(0))  # seeds, threads (0: default), "every N" (0: never)
positive_float = arg_type(float, positive)  # learning rates
non_negative_float = arg_type(float, non_negative)  # temperature (0: greedy), weights
probability_float = arg_type(float, probability)  # top-p
unit_float = arg_type(float, in_range(0, 1))  # probabilities that may be 0
optional_positive_int = arg_type(int, optional(at_least(1)), allow_none=True)  # 'none' allowed


def seed_list(text):
    """argparse type: comma-separated non-negative integers, at least one ("0,1,2")."""
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}") from None
    if not seeds or min(seeds) < 0:
        raise argparse.ArgumentTypeError(f"expected non-negative integers, got {text!r}")
    return seeds


def value_list(item):
    """argparse type: comma-separated values, each parsed (and checked) by the argparse type
    `item` ("1e-4,3e-4" with `positive_float`), at least one."""
    def parse(text):
        values = [item(t.strip()) for t in text.split(",") if t.strip()]
        if not values:
            raise argparse.ArgumentTypeError(f"expected comma-separated values, got {text!r}")
        return values
    parse.__name__ = "list"
    return parse


def choice_list(choices):
    """argparse type: comma-separated names, each one of `choices`, at least one."""
    def parse(text):
        names = [a.strip() for a in text.split(",") if a.strip()]
        unknown = [a for a in names if a not in choices]
        if unknown or not names:
            raise argparse.ArgumentTypeError(
                f"unknown name(s) {unknown}; expected some of {list(choices)}")
        return names
    parse.__name__ = "list"
    return parse


def option(default, help: str, rule: Rule | None = None, choices=None, group: str | None = None):
    """A config field whose help, valid range (`rule`), choices and `group` (the section of
    --help and of the docs it is listed in, e.g. "core") sit next to its default (dataclass
    field metadata, as TRL's configs do); the command line is built from them."""
    return field(default=default,
                 metadata={"help": help, "rule": rule, "choices": choices, "group": group})


def check_fields(config) -> None:
    """ValueError naming the first field of a dataclass `config` outside its choices or range."""
    for f in fields(config):
        value, choices = getattr(config, f.name), f.metadata.get("choices")
        if choices is not None and value not in choices:
            raise ValueError(f"{f.name} must be one of {tuple(choices)}, got {value!r}")
        if f.metadata.get("rule") is not None:
            check(f.name, value, f.metadata["rule"])
