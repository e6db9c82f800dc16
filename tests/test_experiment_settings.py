"""Tests for how an experiment names the settings that keep it from reusing a finished run."""

import json
from pathlib import Path

import pytest

from reasoning_from_scratch.experiments import stats
from reasoning_from_scratch.experiments.stats import (
    GRPO_DEFAULTS,
    SETTINGS_FILE,
    field_defaults,
    refuse_other_settings,
    resume_point,
    settings_diff,
    with_added_defaults,
)
from reasoning_from_scratch.training import GRPOConfig


def test_settings_diff_names_changed_and_absent_keys():
    old = {"steps": 60, "lr": 1e-4, "seed": 9}
    new = {"steps": 80, "lr": 1e-4, "seed": 9, "compile": None}
    # a key added after the run was made is named even when its value is None
    assert settings_diff(old, new) == "compile: (absent) -> None, steps: 60 -> 80"
    assert settings_diff(new, old) == "compile: None -> (absent), steps: 80 -> 60"
    assert settings_diff(old, dict(old)) == ""


def test_a_run_made_before_a_field_existed_counts_as_made_at_its_default():
    current = {"steps": 60, "activation_checkpointing": False, "update_buckets": 4}
    saved = {"steps": 60}  # both fields were added after this run was made
    assert GRPO_DEFAULTS["activation_checkpointing"] is False
    assert GRPO_DEFAULTS["update_buckets"] == 4
    assert with_added_defaults(saved, current) == current  # reused
    asked = {**current, "update_buckets": 8}  # the run is asked for with another value
    filled = with_added_defaults(saved, asked)
    assert filled != asked and settings_diff(filled, asked) == "update_buckets: 4 -> 8"
    assert with_added_defaults({"steps": 60, "update_buckets": 2}, current)["update_buckets"] == 2
    assert with_added_defaults(saved, {"steps": 60, "model": "x"}) == saved  # no default known


def test_a_finished_run_with_other_settings_is_refused_naming_them(tmp_path):
    current = {"steps": 60, "update_buckets": 4}
    refuse_other_settings(tmp_path, {"steps": 60}, current)  # the added key at its default
    with pytest.raises(SystemExit, match=r"run with other settings \(update_buckets: 4 -> 8\)"):
        refuse_other_settings(tmp_path, {"steps": 60}, {**current, "update_buckets": 8})
    with pytest.raises(SystemExit, match=r"update_buckets: \(absent\) -> 4"):
        refuse_other_settings(tmp_path, {"steps": 60}, current, defaults={})  # none known


def test_an_unfinished_run_of_before_a_field_existed_resumes(tmp_path, monkeypatch):
    monkeypatch.setattr(stats, "find_checkpoint", lambda d: Path(d) / "checkpoint-2")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / SETTINGS_FILE).write_text(json.dumps({"steps": 60}))
    assert field_defaults(GRPOConfig)["activation_checkpointing"] is False
    resume = resume_point(run_dir, {"steps": 60, "activation_checkpointing": False})
    assert resume == run_dir / "checkpoint-2"
    assert resume_point(run_dir, {"steps": 60, "activation_checkpointing": True}) is None
    assert not run_dir.exists()  # another value: the run starts afresh
