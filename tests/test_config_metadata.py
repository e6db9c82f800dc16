"""One home per config field: every GRPOConfig and DistillConfig field carries its help, range
and choices in its metadata (a GRPOConfig field its group too), and the scripts' --help shows
exactly that help, the field's default and choices, under the field's group.

docs/flags.md, the table of every flag of chapters/ch07_train.py, is generated from the parser
here and checked against it; `python tests/test_config_metadata.py` rewrites it.
"""

import argparse
import re
import runpy
import sys
import warnings
from collections import Counter
from dataclasses import MISSING, fields
from pathlib import Path

import pytest

from reasoning_from_scratch.cli.train import (
    CONFIG_GROUPS,
    SCRIPT_GROUPS,
    add_config_arguments,
    build_parser,
    flags_table,
)
from reasoning_from_scratch.distillation_training import DISTILL_RULES, DistillConfig
from reasoning_from_scratch.training import CONFIG_RULES, GRPOConfig

ROOT = Path(__file__).resolve().parents[1]
# script -> the GRPOConfig its flags default to
SCRIPTS = {"ch06_train": "CH06_DEFAULTS", "ch07_train": "CH07_DEFAULTS"}


def _help_entries(text):
    """{'--flag': 'help text with (default: ...)'} from argparse's --help output."""
    entries, flag = {}, None
    for line in text.splitlines():
        m = re.match(r"  (--[\w-]+)(?: \{[^}]*\}| [A-Z_]+)?(?:, --[\w-]+)?( {2,}(.*))?$", line)
        m = m or re.match(r"  (--[\w-]+) \| --no-[\w-]+( {2,}(.*))?$", line)
        if m:
            flag = m.group(1)
            entries[flag] = (m.group(3) or "").strip()
        elif flag and line.startswith(" " * 10):
            entries[flag] = (entries[flag] + " " + line.strip()).strip()
        else:
            flag = None
    return entries


def _script_help(name, capsys):
    main = runpy.run_path(str(ROOT / "chapters" / f"{name}.py"), run_name=name)["main"]
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    return _help_entries(text), text


def test_every_field_has_help_and_the_rules_come_from_the_metadata():
    for f in fields(GRPOConfig):
        assert f.metadata["help"].strip(), f.name
        assert f.default is not MISSING, f.name
    assert CONFIG_RULES == {f.name: f.metadata["rule"] for f in fields(GRPOConfig)
                            if f.metadata["rule"] is not None}
    assert set(fields(GRPOConfig)[0].metadata) == {"help", "rule", "choices", "group"}


def _as_typed(default) -> str:
    """A config default as --help shows it, spaces removed: a tuple (--report-to) as it is
    typed on the command line, comma-separated, `none` when empty."""
    if isinstance(default, tuple):
        default = ",".join(default) or "none"
    return re.sub(r"\s+", "", str(default))


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_help_shows_the_metadata_help_default_and_choices(script, capsys, monkeypatch):
    monkeypatch.setattr("sys.argv", [f"{script}.py"])
    entries, text = _script_help(script, capsys)
    defaults = runpy.run_path(str(ROOT / "chapters" / f"{script}.py"),
                              run_name=script)[SCRIPTS[script]]
    for f in fields(GRPOConfig):
        if f.name == "output_dir":  # the scripts give it a timestamped default
            continue
        flag = "--" + f.name.replace("_", "-")
        assert flag in entries, flag
        shown = re.sub(r"\s+", "", entries[flag])  # argparse wraps lines at spaces and hyphens
        assert shown.startswith(re.sub(r"\s+", "", f.metadata["help"])), (flag, entries[flag])
        assert shown.endswith(f"(default:{_as_typed(getattr(defaults, f.name))})"), \
            (flag, entries[flag])
        if f.metadata["choices"]:  # e.g. every loss of grpo.LOSS_TYPES is a --loss-type choice
            assert f"{flag} {{{','.join(f.metadata['choices'])}}}" in text, flag


@pytest.mark.parametrize("name,bad", [("num_rollouts", "1"), ("top_p", "1.5"), ("lr", "0"),
                                      ("loss_type", "ppo"), ("epsilon", "2")])
def test_the_metadata_range_and_choices_refuse_bad_flags(name, bad, capsys):
    main = runpy.run_path(str(ROOT / "chapters" / "ch07_train.py"), run_name="ch07_train")["main"]
    with pytest.raises(SystemExit) as exit_:
        main(["--" + name.replace("_", "-"), bad])
    assert exit_.value.code == 2
    assert "--" + name.replace("_", "-") in capsys.readouterr().err
    with pytest.raises(ValueError, match=name):  # the config refuses the same value itself
        GRPOConfig(**{name: {"1": 1, "1.5": 1.5, "0": 0.0, "ppo": "ppo", "2": 2.0}[bad]})


def test_distill_help_shows_the_distill_config_metadata(capsys, monkeypatch):
    monkeypatch.setattr("sys.argv", ["ch09_distill.py"])
    entries, _ = _script_help("ch09_distill", capsys)
    for f in fields(DistillConfig):
        if f.name == "progress":  # --no-progress
            continue
        shown = re.sub(r"\s+", "", entries["--" + f.name.replace("_", "-")])
        assert shown.startswith(re.sub(r"\s+", "", f.metadata["help"])), f.name
        default = None if f.name == "output_dir" else f.default  # runs/ch09-<time>
        assert shown.endswith(f"(default:{_as_typed(default)})"), (f.name, shown)
    assert DISTILL_RULES == {f.name: f.metadata["rule"] for f in fields(DistillConfig)
                             if f.metadata["rule"] is not None}


# ----------------------------------------------------------------------------------------------
# Groups: the fields' metadata, --help's sections and docs/flags.md
# ----------------------------------------------------------------------------------------------

CORE_MAX_FIELDS = 25  # what the book's GRPO step needs; the rest goes to the other groups
FLAGS_PAGE = ROOT / "docs" / "flags.md"


def _flag(name):
    return "--" + name.replace("_", "-")


def _help_sections(text):
    """{'--flag': title of the --help section it is listed in}."""
    where, title = {}, None
    for line in text.splitlines():
        if m := re.match(r"(\S.*):$", line):
            title = m.group(1)
        elif m := re.match(r"  (--[\w-]+)", line):
            where.setdefault(m.group(1), title)
    return where


def test_every_field_has_a_group_and_core_stays_small():
    groups = Counter(f.metadata["group"] for f in fields(GRPOConfig))
    assert set(groups) == set(CONFIG_GROUPS), groups  # each field in one, none empty
    assert groups["core"] <= CORE_MAX_FIELDS, groups
    assert sum(groups.values()) == len(fields(GRPOConfig))
    # declared group by group, in --help's order (the comment headers of GRPOConfig)
    order = [f.metadata["group"] for f in fields(GRPOConfig)]
    assert order == sorted(order, key=list(CONFIG_GROUPS).index)
    assert {f.metadata["group"] for f in fields(DistillConfig)} == {None}  # optional elsewhere


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_help_lists_each_flag_under_its_group_core_first(script, capsys, monkeypatch):
    monkeypatch.setattr("sys.argv", [f"{script}.py"])
    _, text = _script_help(script, capsys)
    titles = [line[:-1] for line in text.splitlines() if re.match(r"\S.*:$", line)]
    assert titles == ["options", "core", *SCRIPT_GROUPS, *list(CONFIG_GROUPS)[1:]], titles
    for title, about in {**CONFIG_GROUPS, **SCRIPT_GROUPS}.items():  # the description below
        assert re.sub(r"\s+", " ", about) in re.sub(r"\s+", " ", text), title
    sections = _help_sections(text)
    for f in fields(GRPOConfig):  # --output-dir too: the scripts add it to core
        assert sections[_flag(f.name)] == f.metadata["group"], f.name
    for flag in ("--model", "--dataset", "--resume", "--overwrite", "--device", "--dtype"):
        assert sections[flag] in SCRIPT_GROUPS, flag


def test_config_arguments_into_an_argument_group_stay_in_it():
    """A script with its own group for the config (ch07_compare.py, ch08_process_vs_outcome.py)
    gets every flag in that group: argparse does not nest groups."""
    p = argparse.ArgumentParser()
    g = p.add_argument_group("GRPO settings")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nesting argument groups is deprecated
        where = add_config_arguments(g, GRPOConfig())
    assert set(where) == set(CONFIG_GROUPS) and all(w is g for w in where.values())
    assert len(p._action_groups) == 3  # positionals, options, g
    assert {a.dest for a in g._group_actions} == {f.name for f in fields(GRPOConfig)} - \
        {"output_dir"}
    assert p.parse_args(["--lr", "3e-4", "--no-progress"]).lr == 3e-4


def _ch07_parser():
    """chapters/ch07_train.py's parser (the script builds it from the library defaults)."""
    ch07 = runpy.run_path(str(ROOT / "chapters" / "ch07_train.py"), run_name="ch07_train")
    assert ch07["CH07_DEFAULTS"] == GRPOConfig()
    return build_parser("", ch07["CH07_DEFAULTS"], "ch07")


def flags_page() -> str:
    """docs/flags.md: the groups, then every flag of chapters/ch07_train.py in one table."""
    parser = _ch07_parser()
    counts = Counter(f.metadata["group"] for f in fields(GRPOConfig))
    groups = ["| group | config fields | what they set |", "|---|---|---|"]
    for title, about in {**CONFIG_GROUPS, **SCRIPT_GROUPS}.items():
        groups.append(f"| {title} | {counts.get(title, '-')} | {about} |")
    return "\n".join([
        "# Every flag of chapters/ch07_train.py",
        "",
        "[Back to the training options](training_options.md).",
        "",
        "Generated from the script's parser by tests/test_config_metadata.py, which fails when "
        "this page is out of date (`python tests/test_config_metadata.py` rewrites it). A flag's "
        "group is the section of `--help` that lists it: a `GRPOConfig` field's group comes "
        "from its metadata (`option(..., group=...)` in training.py), core first; the script's "
        "own flags follow core. chapters/ch06_train.py has the same flags, with the chapter 6 "
        "recipe's defaults (`CHAPTER6_RECIPE`). Defaults are as `--help` shows them.",
        "",
        *groups,
        "",
        "## Flags",
        "",
        flags_table(parser),
    ])


def test_flags_page_is_up_to_date():
    text = flags_page()
    assert FLAGS_PAGE.is_file() and FLAGS_PAGE.read_text() == text, \
        "docs/flags.md is out of date: python tests/test_config_metadata.py rewrites it"
    for f in fields(GRPOConfig):  # grep -- --lr docs/ finds each flag with its group
        row = next(line for line in text.splitlines() if line.startswith(f"| `{_flag(f.name)}`"))
        assert f"| {f.metadata['group']} |" in row, row
    options = (ROOT / "docs" / "training_options.md").read_text()
    assert "(flags.md)" in options
    for group, n in Counter(f.metadata["group"] for f in fields(GRPOConfig)).items():
        assert f"\n| {group} | {n} |" in options, group  # its table of the groups


if __name__ == "__main__":
    if sys.argv[1:] not in ([], ["--check"]):
        sys.exit("usage: python tests/test_config_metadata.py [--check]  (rewrites docs/flags.md)")
    if sys.argv[1:] == ["--check"]:
        sys.exit(0 if FLAGS_PAGE.read_text() == flags_page() else "docs/flags.md is out of date")
    FLAGS_PAGE.write_text(flags_page())
    print(f"wrote {FLAGS_PAGE}")
