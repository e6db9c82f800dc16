"""The command-line scripts: every `--help` runs; the chapter 8 experiment (summary, table and
figure from `supervision_experiment`; the script end to end, tiny)."""

import json
import math
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from reasoning_from_scratch.supervision_experiment import (
    plot_process_vs_outcome,
    summarise,
    write_table,
)

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted([*ROOT.glob("chapters/*.py"), *ROOT.glob("benchmarks/*.py")])


def test_scripts_found():
    assert len(SCRIPTS) >= 2 and ROOT / "chapters" / "ch08_process_vs_outcome.py" in SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_help(script):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "usage" in res.stdout


def _ch08_main():
    """The experiment script's `main` (chapters/ is not a package)."""
    return runpy.run_path(str(ROOT / "chapters" / "ch08_process_vs_outcome.py"),
                          run_name="ch08_process_vs_outcome")["main"]


def _point(step, tokens, acc, step_correctness=0.9):
    return {"step": step, "seconds": step * 2.0, "gen_tokens": tokens, "scorer_tokens": 0.0,
            "tokens": tokens, "accuracy": acc, "step_correctness": step_correctness,
            "right_answer_wrong_step": None, "think_accuracy": acc, "format_rate": 1.0}


def test_ch08_summary_equal_steps_and_equal_tokens(tmp_path):
    base = {"accuracy": 0.4, "step_correctness": None, "right_answer_wrong_step": None,
            "think_accuracy": 0.4, "format_rate": 0.4}
    mc = [_point(5, 150.0, 0.7), _point(10, 300.0, 0.8)]
    for p in mc:
        p["scorer_tokens"] = p["tokens"] / 2
    curves = {
        "outcome": {0: [_point(5, 100.0, 0.5), _point(10, 200.0, 0.6)],
                    1: [_point(5, 110.0, 0.5, None), _point(10, 220.0, 0.7, None)]},
        "mc": {0: mc, 1: [_point(5, 160.0, 0.5), _point(10, 320.0, 0.6)]},
        "verifier": {0: [_point(5, 90.0, 0.6), _point(10, 200.0, 0.66)]},
    }
    summary = summarise(curves, base)
    assert summary["target"] == pytest.approx(0.65)  # outcome's mean final accuracy
    assert summary["token_budget"] == pytest.approx(210.0)  # outcome's mean total tokens
    outcome, mc_row, verifier = summary["rows"]
    assert outcome["final_accuracy"]["mean"] == pytest.approx(0.65)
    assert outcome["final_accuracy"]["sd"] == pytest.approx(0.0707107, abs=1e-6)
    assert outcome["final_step_correctness"]["mean"] == pytest.approx(0.9)  # None skipped
    assert math.isnan(outcome["final_right_answer_wrong_step"]["mean"])
    assert outcome["accuracy_at_budget"]["mean"] == pytest.approx(0.65)
    # Equal steps: the first evaluation at or above 0.65; equal tokens: both MC runs pass the
    # budget after step 5, so their step-5 accuracies count.
    assert mc_row["steps_to_target"] == [5, None]
    assert mc_row["accuracy_at_budget"]["mean"] == pytest.approx(0.6)
    assert mc_row["step_at_budget"]["mean"] == pytest.approx(5)
    assert verifier["accuracy_at_budget"]["mean"] == pytest.approx(0.66)  # within: final
    assert verifier["steps_to_target"] == [10]
    table = write_table(summary, base, tmp_path / "results.md")
    assert "| process (MC) | 2 | 0.700 ± 0.141 |" in table
    assert "5 (1/2 runs) | 0.600 ± 0.141 (step 5) |" in table
    assert "0.3 (scorer 0.1)" in table  # k tokens per run, Monte-Carlo share
    assert "n/a" in table  # the missing figures
    plot_process_vs_outcome(curves, base, tmp_path / "fig.png", summary["token_budget"])
    assert (tmp_path / "fig.png").stat().st_size > 1000


def test_ch08_process_vs_outcome_tiny_run(tmp_path):
    """Two steps per arm (outcome, verifier, a PRM it trains itself), one seed, 8 held-out
    problems; then a rerun reuses every finished run."""
    main = _ch08_main()
    argv = ["--arms", "outcome,verifier,prm", "--seeds", "0", "--eval-points", "1",
            "--steps", "2", "--eval-examples", "8", "--prompts-per-step", "2",
            "--num-rollouts", "2", "--max-new-tokens", "24", "--train-examples", "20",
            "--prm-train-problems", "4", "--prm-eval-problems", "2", "--prm-samples", "2",
            "--prm-epochs", "1", "--device", "cpu", "--no-progress",
            "--output-dir", str(tmp_path)]
    threads = torch.get_num_threads()
    try:
        main(argv)
        curve_file = tmp_path / "prm-seed0" / "curve.json"
        stamp = curve_file.stat().st_mtime_ns
        again = main(argv)  # everything finished: reused, nothing trained
    finally:
        torch.set_num_threads(threads)  # the script sets 1 thread for itself
    assert curve_file.stat().st_mtime_ns == stamp
    for name in ("results.md", "results.json", "process_vs_outcome.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert (tmp_path / "prm" / "prm_config.json").is_file()  # the cached PRM
    curve = json.loads(curve_file.read_text())
    assert curve["settings"]["step_scorer"] == f"prm:{tmp_path / 'prm'}"
    results = json.loads((tmp_path / "results.json").read_text())
    assert [r["arm"] for r in results["rows"]] == ["outcome", "verifier", "prm"]
    assert [r["final_accuracy"]["mean"] for r in again["rows"]] == [
        r["final_accuracy"]["mean"] for r in results["rows"]]
    for row in results["rows"]:
        acc = row["final_accuracy"]["mean"]
        assert acc is not None and math.isfinite(acc) and 0.0 <= acc <= 1.0
        assert row["tokens"]["mean"] > 0
        assert row["accuracy_at_budget"]["mean"] is not None
    for runs in results["curves"].values():
        last = runs["0"][-1]
        assert last["step"] == 2 and last["tokens"] > 0
    assert "| process (learned PRM) | 1 |" in (tmp_path / "results.md").read_text()


def test_ch07_compare_tiny_run(tmp_path):
    """Three arms (one of them with 4 inner epochs) x 2 steps, 1 seed; then --report-only."""
    main = runpy.run_path(str(ROOT / "chapters" / "ch07_compare.py"),
                          run_name="ch07_compare")["main"]
    argv = ["--arms", "ch06,grpo,gspo", "--seeds", "0", "--steps", "2", "--eval-examples", "8",
            "--prompts-per-step", "2", "--num-rollouts", "4", "--max-new-tokens", "24",
            "--train-examples", "20", "--sample-every", "1", "--device", "cpu", "--no-progress",
            "--output-dir", str(tmp_path)]
    threads = torch.get_num_threads()
    try:
        first = main(argv)
        stamp = (tmp_path / "grpo-seed0" / "figures.json").stat().st_mtime_ns
        again = main([*argv, "--report-only"])
    finally:
        torch.set_num_threads(threads)  # the script sets 1 thread for itself
    assert (tmp_path / "grpo-seed0" / "figures.json").stat().st_mtime_ns == stamp
    assert [r["arm"] for r in first["rows"]] == ["ch06", "grpo", "gspo"]
    assert again["rows"] == first["rows"]
    for name in ("results.md", "results.json", "grpo_variants.png", "base.json"):
        assert (tmp_path / name).stat().st_size > 0, name
    settings = json.loads((tmp_path / "gspo-seed0" / "settings.json").read_text())
    assert settings["loss_type"] == "gspo" and settings["inner_epochs"] == 4
    assert json.loads((tmp_path / "ch06-seed0" / "settings.json").read_text())["epsilon"] is None
    table = (tmp_path / "results.md").read_text()
    assert "| chapter 7 default (grpo loss) | 1 |" in table
    with pytest.raises(SystemExit):
        main([*argv, "--arms", "nonsense"])
