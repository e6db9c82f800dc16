"""Tests for how an experiment names the settings that keep it from reusing a finished run."""

from reasoning_from_scratch.experiments.stats import settings_diff


def test_settings_diff_names_changed_and_absent_keys():
    old = {"steps": 60, "lr": 1e-4, "seed": 9}
    new = {"steps": 80, "lr": 1e-4, "seed": 9, "compile": None}
    # a key added after the run was made is named even when its value is None
    assert settings_diff(old, new) == "compile: (absent) -> None, steps: 60 -> 80"
    assert settings_diff(new, old) == "compile: None -> (absent), steps: 80 -> 60"
    assert settings_diff(old, dict(old)) == ""
