"""Chapter 8's step-size search (experiments/tuning.py) and the gradient-noise statistics."""

import math
import runpy
from pathlib import Path

import pytest
import torch

from reasoning_from_scratch.experiments import tuning
from reasoning_from_scratch.experiments.process_vs_outcome import ExperimentSettings
from reasoning_from_scratch.experiments.stats import gradient_noise
from reasoning_from_scratch.training import GRPOConfig


def test_gradient_noise_by_hand():
    # mean (2, 0); squared deviations 1, 1, 4, 4 -> trace 10/3; signal 4 - (10/3)/4 = 19/6
    g = torch.tensor([[1.0, 0.0], [3.0, 0.0], [2.0, 2.0], [2.0, -2.0]])
    out = gradient_noise(g, batch_size=64)
    assert out["trace"] == pytest.approx(10 / 3)
    assert out["signal"] == pytest.approx(19 / 6)
    assert out["snr"] == pytest.approx(0.95)
    assert out["noise_scale"] == pytest.approx(64 / 0.95)
    assert out["mean_norm"] == pytest.approx(2.0)
    assert out["batch_norm"] == pytest.approx((1 + 3 + 2 * math.sqrt(8)) / 4)
    assert out["half_cosine"] == pytest.approx(1.0)  # both halves average to (2, 0)


def test_gradient_noise_pure_noise_has_no_signal():
    # opposite gradients: the mean is zero, so the unbiased signal is negative and SNR < 0
    out = gradient_noise(torch.tensor([[1.0, 0.0], [-1.0, 0.0]]), batch_size=8)
    assert out["trace"] == pytest.approx(2.0) and out["signal"] == pytest.approx(-1.0)
    assert out["snr"] < 0 and out["noise_scale"] == math.inf
    with pytest.raises(ValueError, match="at least 2"):
        gradient_noise(torch.ones(1, 3), batch_size=8)


def test_point_names_and_stages():
    assert tuning.short_number(3e-4) == "3e-4" and tuning.short_number(1.5e-4) == "1.5e-4"
    assert tuning.short_number(1e-3) == "1e-3"
    point = {"lr": 3e-4, "inner_epochs": 2, "loss_type": "dr_grpo"}
    assert tuning.point_name(point) == "lr3e-4_e2_dr_grpo"
    grid = tuning.SearchGrid(lr=(1e-4, 3e-4), inner_epochs=(1,), loss_type=("grpo", "dr_grpo"))
    assert grid.stages() == [("lr", (1e-4, 3e-4)), ("loss_type", ("grpo", "dr_grpo"))]


def _figures(acc):
    return {"final_accuracy": {"mean": acc, "sd": 0.01},
            "final_step_correctness": {"mean": 0.7, "sd": 0.0},
            "tokens": {"mean": 1000.0, "sd": 0.0}, "forward_tokens": {"mean": 2000.0, "sd": 0.0}}


def test_staged_search_chooses_per_arm_and_shares_points(tmp_path, monkeypatch):
    """A fake experiment whose accuracy is a known function of the point: outcome peaks at
    lr 3e-4 with 2 updates, process at lr 1e-4 with 1; every arm sees the same candidates,
    a point two arms need runs once for both, and a tie keeps the earlier candidate."""
    def accuracy(arm, cfg):
        best_lr, best_e = (3e-4, 2) if arm == "outcome" else (1e-4, 1)
        return 0.5 - abs(math.log10(cfg.lr / best_lr)) / 10 - abs(cfg.inner_epochs - best_e) / 100

    calls = []

    def fake_run_experiment(settings, config, arms, seeds):
        calls.append((settings.output_dir, tuple(arms)))
        rows = [{"arm": a, **_figures(accuracy(a, config))} for a in arms]
        return {"rows": rows}

    monkeypatch.setattr(tuning, "run_experiment", fake_run_experiment)
    grid = tuning.SearchGrid(lr=(1e-4, 3e-4, 1e-3), inner_epochs=(1, 2, 4),
                             loss_type=("grpo", "dr_grpo"))
    record = tuning.run_search(ExperimentSettings(output_dir=str(tmp_path)), GRPOConfig(),
                               ["outcome", "recommended"], [0, 1, 2], grid)
    assert record["chosen"]["outcome"] == {"lr": 3e-4, "inner_epochs": 2, "loss_type": "grpo"}
    assert record["chosen"]["recommended"] == {"lr": 1e-4, "inner_epochs": 1,
                                               "loss_type": "grpo"}  # dr_grpo ties: grpo kept
    stage1 = calls[:3]  # both arms at each lr, in one experiment
    assert [arms for _, arms in stage1] == [("outcome", "recommended")] * 3
    assert stage1[0][0] == str(tmp_path / "lr1e-4_e1_grpo")
    assert (tmp_path / "search.json").is_file()
    table = (tmp_path / "search.md").read_text()
    assert "| **lr3e-4_e2_grpo** | outcome | 0.500 ± 0.010 |" in table
    assert "- recommended: lr1e-4_e1_grpo" in table


def test_search_flags_reach_the_search(monkeypatch, tmp_path):
    script = Path(__file__).resolve().parents[1] / "chapters" / "ch08_process_vs_outcome.py"
    seen = {}

    def fake_search(settings, config, arms, seeds, grid):
        seen.update(grid=grid, arms=arms, lr=config.lr)
        return {}

    monkeypatch.setattr(tuning, "run_search", fake_search)
    main = runpy.run_path(str(script), run_name="ch08")["main"]
    threads = torch.get_num_threads()
    try:
        main(["--arms", "outcome", "--search-lr", "1e-4,3e-4", "--search-loss-types",
              "grpo,dr_grpo", "--output-dir", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    assert seen["grid"] == tuning.SearchGrid((1e-4, 3e-4), (), ("grpo", "dr_grpo"))
    with pytest.raises(SystemExit):
        main(["--search-lr", "1e-4,-1"])


def test_arms_with_their_own_update_size_are_not_searched(tmp_path):
    with pytest.raises(ValueError, match="outcome-tuned"):
        tuning.run_search(ExperimentSettings(output_dir=str(tmp_path)), GRPOConfig(),
                          ["outcome", "outcome-tuned"], [0], tuning.SearchGrid(lr=(1e-4, 3e-4)))
