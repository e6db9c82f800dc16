"""The shared script flags of cli/arguments.py: names, order, defaults, ranges and help."""

import argparse

import pytest
import torch

from reasoning_from_scratch.cli.arguments import (
    SAMPLING_FLAGS,
    add_dataset_arguments,
    add_runtime_arguments,
    add_sampling_arguments,
    add_seed_argument,
    set_threads,
)


def _parser():
    return argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)


def _flags(parser):
    return [a.option_strings[0] for a in parser._actions if a.option_strings[0] != "-h"]


def test_sampling_flags_come_in_the_order_given_with_their_defaults():
    p = _parser()
    add_sampling_arguments(p, top_p=0.9, top_k=3, max_new_tokens=512)
    assert _flags(p) == ["--top-p", "--top-k", "--max-new-tokens"]
    args = p.parse_args([])
    assert (args.top_p, args.top_k, args.max_new_tokens) == (0.9, 3, 512)
    args = p.parse_args(["--top-p", "0.5", "--top-k", "7", "--max-new-tokens", "8"])
    assert (args.top_p, args.top_k, args.max_new_tokens) == (0.5, 7, 8)


@pytest.mark.parametrize("argv", [["--temperature", "-0.1"], ["--top-p", "0"],
                                  ["--top-p", "1.5"], ["--max-new-tokens", "0"],
                                  ["--top-k", "0"], ["--top-k", "none"]])
def test_sampling_flags_refuse_values_out_of_range(argv, capsys):
    p = _parser()
    add_sampling_arguments(p, max_new_tokens=16, temperature=1.0, top_p=1.0, top_k=3)
    with pytest.raises(SystemExit) as exit_:
        p.parse_args(argv)
    assert exit_.value.code == 2
    assert argv[0] in capsys.readouterr().err


def test_top_k_defaulting_to_none_takes_none():
    p = _parser()
    add_sampling_arguments(p, top_k=None)
    assert p.parse_args(["--top-k", "none"]).top_k is None
    assert p.parse_args(["--top-k", "4"]).top_k == 4


def test_help_is_the_shared_one_unless_replaced_and_shows_the_default(capsys):
    p = _parser()
    add_sampling_arguments(p, temperature=0.0, top_p=1.0, helps={"top_p": "nucleus threshold"})
    with pytest.raises(SystemExit):
        p.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"{SAMPLING_FLAGS['temperature'][1]} (default: 0.0)" in text
    assert "nucleus threshold (default: 1.0)" in text


def test_prefix_names_the_flags_and_their_attributes():
    p = _parser()
    add_sampling_arguments(p, prefix="teacher_", temperature=0.7, top_p=0.95)
    assert _flags(p) == ["--teacher-temperature", "--teacher-top-p"]
    args = p.parse_args(["--teacher-temperature", "0"])
    assert (args.teacher_temperature, args.teacher_top_p) == (0.0, 0.95)


@pytest.mark.parametrize("kwargs", [{"top_q": 0.9}, {"temperature": 1.0,
                                                     "helps": {"top_p": "help of an absent flag"}}])
def test_an_unknown_sampling_flag_is_a_type_error(kwargs):
    with pytest.raises(TypeError, match="not a sampling flag"):
        add_sampling_arguments(_parser(), **kwargs)


@pytest.mark.parametrize("text,value", [("3", 3), ("0", 0), ("none", None), ("None", None)])
def test_threads_takes_a_count_zero_or_none(text, value):
    p = _parser()
    add_runtime_arguments(p)
    args = p.parse_args(["--threads", text])
    assert args.threads == value and args.device is None


def test_threads_and_device_refuse_bad_values(capsys):
    p = _parser()
    add_runtime_arguments(p)
    for argv in (["--threads", "-1"], ["--threads", "two"], ["--device", "tpu"]):
        with pytest.raises(SystemExit) as exit_:
            p.parse_args(argv)
        assert exit_.value.code == 2
        assert argv[0] in capsys.readouterr().err


def test_set_threads_keeps_torch_default_for_zero_and_none():
    before = torch.get_num_threads()
    try:
        for keep in (0, None):
            set_threads(keep)
            assert torch.get_num_threads() == before
        set_threads(1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_dataset_limit_is_optional_only_when_it_defaults_to_none(capsys):
    p = _parser()
    add_dataset_arguments(p)
    assert _flags(p) == ["--dataset", "--split", "--data-path", "--cache-dir", "--limit"]
    assert p.parse_args([]).limit is None and p.parse_args(["--limit", "none"]).limit is None
    p = _parser()
    add_dataset_arguments(p, limit=50, limit_help="number of problems")
    assert p.parse_args([]).limit == 50
    with pytest.raises(SystemExit):
        p.parse_args(["--limit", "none"])
    assert "--limit" in capsys.readouterr().err


def test_seed_is_a_non_negative_integer():
    p = _parser()
    add_seed_argument(p, 123)
    assert p.parse_args([]).seed == 123
    with pytest.raises(SystemExit):
        p.parse_args(["--seed", "-1"])
