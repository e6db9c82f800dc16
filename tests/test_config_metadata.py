"""One home per config field: every GRPOConfig and DistillConfig field carries its help, range
and choices in its metadata, and the scripts' --help shows exactly that help, the field's default
and choices."""

import re
import runpy
from dataclasses import MISSING, fields
from pathlib import Path

import pytest

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
    assert set(fields(GRPOConfig)[0].metadata) == {"help", "rule", "choices"}


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
