"""The command-line scripts: every `--help` runs; the chapter 8 experiment (summary, table and
figure from `experiments.process_vs_outcome`; the script end to end, tiny)."""

import json
import math
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tolerance import training_bound

from reasoning_from_scratch.experiments.process_vs_outcome import (
    plot_process_vs_outcome,
    summarise,
    write_table,
)

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted([*ROOT.glob("chapters/*.py"), *ROOT.glob("benchmarks/*.py"),
                  *ROOT.glob("notebooks/*.py")])


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
    # Equal tokens, interpolated at outcome's 210: its seed 0 is past its end (0.6), its seed 1
    # at 0.5 + 100/110 x 0.2; MC between steps 5 and 10, the verifier past its end
    assert outcome["accuracy_at_budget"]["mean"] == pytest.approx((0.6 + 0.5 + 0.2 / 1.1) / 2)
    assert mc_row["accuracy_at_budget_per_seed"] == {
        0: pytest.approx(0.7 + 60 / 150 * 0.1), 1: pytest.approx(0.5 + 50 / 160 * 0.1)}
    assert verifier["accuracy_at_budget"]["mean"] == pytest.approx(0.66)
    # Equal steps: the first evaluation at or above 0.65
    assert mc_row["steps_to_target"] == [5, None]
    assert verifier["steps_to_target"] == [10]
    assert "intervals" not in mc_row  # no per-problem records: no intervals
    table = write_table(summary, base, tmp_path / "results.md")
    assert "| process (MC) | 2 | 0.700 ± 0.141 |" in table
    assert "5 (1/2 runs) | 0.636 ± 0.148 |" in table
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
    # every pair of arms, later minus earlier, with its paired interval and its levels
    pairs = {(p["arm"], p["vs"]): p for p in results["pairs"]}
    assert set(pairs) == {("verifier", "outcome"), ("prm", "outcome"), ("prm", "verifier")}
    rows = {r["arm"]: r for r in results["rows"]}
    diff = pairs[("prm", "verifier")]["final_accuracy"]
    assert diff["mean"] == pytest.approx(rows["prm"]["final_accuracy"]["mean"]
                                         - rows["verifier"]["final_accuracy"]["mean"])
    assert diff["lo"] <= diff["mean"] <= diff["hi"] and "levels" in pairs[("prm", "verifier")]
    assert "| prm - verifier |" in (tmp_path / "results.md").read_text()


def test_ch08_jobs_equal_the_sequential_runs(tmp_path):
    """--jobs 2 trains the runs in two worker processes (one thread each) and gets exactly the
    curves the sequential experiment gets."""
    main = _ch08_main()
    argv = ["--arms", "outcome,recommended", "--seeds", "0", "--eval-points", "2",
            "--steps", "2", "--eval-examples", "6", "--prompts-per-step", "2",
            "--num-rollouts", "3", "--max-new-tokens", "24", "--train-examples", "20",
            "--device", "cpu", "--no-progress", "--threads", "1"]
    threads = torch.get_num_threads()
    try:
        main([*argv, "--output-dir", str(tmp_path / "one")])
        main([*argv, "--output-dir", str(tmp_path / "two"), "--jobs", "2"])
    finally:
        torch.set_num_threads(threads)
    one, two = (json.loads((tmp_path / d / "results.json").read_text()) for d in ("one", "two"))
    strip = ("seconds",)  # wall clock differs
    for arm in ("outcome", "recommended"):
        a, b = one["curves"][arm]["0"], two["curves"][arm]["0"]
        assert [{k: v for k, v in p.items() if k not in strip} for p in a] == [
            {k: v for k, v in p.items() if k not in strip} for p in b]
    assert (tmp_path / "two" / "recommended-seed0" / "final_levels.json").is_file()


def test_ch08_control_arms_run_with_their_settings(tmp_path):
    """The controls and the new forms train end to end (2 steps), each with its own settings."""
    main = _ch08_main()
    argv = ["--arms", "outcome,outcome-format-any-w1,format-progress,placebo,shuffled,vps,pure,"
            "recommended-local-tuned,placebo-branch-tuned",
            "--seeds", "0", "--eval-points", "1", "--steps", "2", "--eval-examples", "4",
            "--prompts-per-step", "2", "--num-rollouts", "3", "--max-new-tokens", "24",
            "--train-examples", "20", "--device", "cpu", "--no-progress",
            "--output-dir", str(tmp_path)]
    threads = torch.get_num_threads()
    try:
        main(argv)
    finally:
        torch.set_num_threads(threads)

    def settings(arm):
        return json.loads((tmp_path / f"{arm}-seed0" / "curve.json").read_text())["settings"]

    assert settings("outcome-format-any-w1")["format_reward_conditional"] is False
    assert settings("outcome-format-any-w1")["format_reward_weight"] == 1.0
    assert "process_credit_control" not in settings("outcome")
    assert settings("placebo")["process_credit_control"] == "flat"
    assert settings("shuffled")["process_credit_control"] == "shuffled"
    assert settings("placebo")["skip_zero_advantage"] is True
    assert (settings("format-progress")["step_scorer"], settings("vps")["step_scorer"]) == (
        "format", "belief")
    assert settings("vps")["process_variant"] == "value-delta"
    local = settings("recommended-local-tuned")  # credit past the first error, tuned steps
    assert (local["step_scorer"], local["process_variant"]) == ("verifier-think-local",
                                                                "progress-local")
    assert (local["process_local_weight"], local["inner_epochs"]) == (0.5, 2)
    assert "process_local_weight" not in settings("placebo")  # only progress-local reads it
    branch = settings("placebo-branch-tuned")  # branches at the first error, shuffled
    assert (branch["branch_rollouts"], branch["branch_control"]) == (4, "shuffled")
    assert "branch_rollouts" not in settings("placebo")  # runs without branches stay reusable
    rows = {r["arm"]: r for r in json.loads((tmp_path / "results.json").read_text())["rows"]}
    # the belief probes are read, not sampled: forward tokens, not the scorer's decode tokens
    assert rows["vps"]["scorer_tokens"]["mean"] == rows["placebo"]["scorer_tokens"]["mean"] == 0
    assert rows["vps"]["forward_tokens"]["mean"] > 0


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


def test_bench_generation_tiny_run():
    """The rollouts and prealloc knobs, tiny size, both dtypes, a few tokens (the compile knob
    is left out here: compiling takes tens of seconds; tests/test_compiled_decode.py covers
    the compiled step)."""
    main = runpy.run_path(str(ROOT / "benchmarks" / "bench_generation.py"),
                          run_name="bench_generation")["main"]
    rows = main(["--sizes", "tiny", "--dtypes", "float32,bfloat16", "--knobs", "rollouts,prealloc",
                 "--num-rollouts", "2", "--new-tokens", "3", "--prompt-len", "4", "--repeats", "1"])
    assert [(r["dtype"], r["knob"]) for r in rows] == [
        ("float32", "rollouts"), ("float32", "prealloc"),
        ("bfloat16", "rollouts"), ("bfloat16", "prealloc")]
    for r in rows:
        assert r["tokens"] == 2 * 3 and r["base_tps"] > 0 and r["knob_tps"] > 0
        assert r["ratio"] == pytest.approx(r["knob_tps"] / r["base_tps"])
    for bad in (["--knobs", "turbo"], ["--new-tokens", "0"], ["--dtypes", "float8"]):
        with pytest.raises(SystemExit):
            main(bad)


def _script_main(path, name):
    """`main` of a script in chapters/ or benchmarks/ (not packages)."""
    return runpy.run_path(str(ROOT / path), run_name=name)["main"]


def test_ch04_inference_scaling_tiny_run(tmp_path):
    main = _script_main("chapters/ch04_inference_scaling.py", "ch04_inference_scaling")
    threads = torch.get_num_threads()
    try:
        out = main(["--limit", "2", "--num-samples", "3", "--temperatures", "0,1",
                    "--max-new-tokens", "24", "--early-stop-problems", "1", "--chunk-size", "1",
                    "--device", "cpu", "--output", str(tmp_path / "ch04.json")])
    finally:
        torch.set_num_threads(threads)  # the script sets 1 thread for itself
    assert set(out["prompts"]) == {"standard", "think"}
    assert len(out["sampling"]) == 4  # two temperatures, the top-p and the top-k row
    greedy = out["sampling"][0]  # temperature 0: every sample is the greedy answer
    assert greedy["distinct_answers"] <= 1.0
    for row in out["sampling"]:
        assert sorted(row["pass_at_k"]) == [1, 2, 3]
        assert row["pass_at_k"][1] <= row["pass_at_k"][3]
    assert out["early_stopping"]["same_answer"] == 1
    assert json.loads((tmp_path / "ch04.json").read_text())["prompts"]


def test_ch05_best_of_n_tiny_run(tmp_path):
    """Two models (the same weights twice), every method, N in {1, 2, 4}, an untrained PRM."""
    from reasoning_from_scratch.prm import ProcessRewardModel, save_prm
    from reasoning_from_scratch.weights import load_pretrained

    model, tok = load_pretrained("tiny-arith", device="cpu", dtype=torch.float32)
    save_prm(ProcessRewardModel.from_pretrained_backbone(model), tok, tmp_path / "prm")
    main = _script_main("chapters/ch05_best_of_n.py", "ch05_best_of_n")
    threads = torch.get_num_threads()
    try:
        results = main(["--model", "tiny-arith", "--model", "tiny-arith", "--label", "a",
                        "--label", "b", "--limit", "3", "--ns", "1,2,4", "--beam-ns", "4",
                        "--max-new-tokens", "32", "--prm", str(tmp_path / "prm"),
                        "--device", "cpu", "--output-dir", str(tmp_path / "out")])
    finally:
        torch.set_num_threads(threads)
    rows = results["a"]["rows"]
    methods = {r["method"] for r in rows}
    assert methods == {"pass@N", "majority", "logprob", "verifier", "prm-min", "prm-prod",
                       "prm-last", "prm-vote", "beam-prm", "beam-verifier", "refine-verifier",
                       "refine-prm", "refine-self"}
    for r in rows:
        assert 0.0 <= r["accuracy"] <= 1.0 and r["tokens"] > 0 and r["seconds"] >= 0
    # Same weights, same seed: the two models' measurements agree exactly.
    assert [r["accuracy"] for r in results["b"]["rows"]] == [r["accuracy"] for r in rows]
    for name in ("results.md", "results.json", "inference_scaling.png"):
        assert (tmp_path / "out" / name).stat().st_size > 0, name
    assert "| greedy | 1 |" in (tmp_path / "out" / "results.md").read_text()
    with pytest.raises(SystemExit):
        main(["--beam-ns", "6", "--output-dir", str(tmp_path / "x")])


def test_bench_checkpoint_tiny_run():
    main = _script_main("benchmarks/bench_checkpoint.py", "bench_checkpoint")
    threads = torch.get_num_threads()
    try:
        out = main(["--repeats", "1", "--run-steps", "1", "--prompts-per-step", "2",
                    "--max-new-tokens", "4"])
    finally:
        torch.set_num_threads(threads)
    (tiny,) = out["saves"]
    assert tiny["size"] == "tiny" and tiny["checkpoint_s"] > 0
    assert tiny["checkpoint_bytes"] > 3 * 4 * tiny["params"] * 0.99  # weights + 2 AdamW moments
    assert out["run"]["off_s_per_step"] > 0 and out["run"]["every_step_s_per_step"] > 0


def test_bench_metrics_log_tiny_run():
    out = _script_main("benchmarks/bench_metrics_log.py", "bench_metrics_log")(
        ["--rows", "20", "--window", "5"])
    assert out["rows"] == 20 and out["bytes"] > 20 * 40  # 20 rows of 40-odd cells
    assert sorted(out["at"]) == [2, 10, 20]
    assert all(r["append_ms"] > 0 and r["patch_ms"] > 0 for r in out["at"].values())


def test_bench_mc_scorer_tiny_run():
    main = _script_main("benchmarks/bench_mc_scorer.py", "bench_mc_scorer")
    out = main(["--prompts", "2", "--num-rollouts", "3", "--max-new-tokens", "24", "--k", "2",
                "--device", "cpu"])
    text, branch = out["results"]["mc-k2"], out["results"]["mc-branch-k2"]
    assert out["rollout_tokens"] > 0
    # the group's own completions are samples too: never more continuations than mc's
    assert branch["mc_rollouts"] <= text["mc_rollouts"]
    assert branch["mc_reused"] > 0 and "mc_prefill_tokens" in branch


def test_bench_process_credit_tiny_run():
    main = _script_main("benchmarks/bench_process_credit.py", "bench_process_credit")
    threads = torch.get_num_threads()
    try:
        out = main(["--steps", "1", "--prompts", "2", "--num-rollouts", "3",
                    "--max-new-tokens", "16", "--repeats", "1", "--warmup", "0",
                    "--device", "cpu"])
    finally:
        torch.set_num_threads(threads)
    assert out["generated_tokens"] > 0 and out["credit"] > 0 and out["rollouts"] > 0
    assert out["credit_share"] > 0 and out["credit_prefix_decoding"] > 0
    for arm in ("outcome", "process"):  # whole groups of G = 3, every row with its tokens
        assert out[f"{arm}_rows"] == 3 * out[f"{arm}_groups"] <= 6
        assert out[f"{arm}_rows"] <= out[f"{arm}_tokens"] <= 16 * out[f"{arm}_rows"]


def test_bench_gradient_noise_tiny_run():
    main = _script_main("benchmarks/bench_gradient_noise.py", "bench_gradient_noise")
    threads = torch.get_num_threads()
    try:
        out = main(["--batches", "3", "--prompts", "2", "--num-rollouts", "3",
                    "--max-new-tokens", "24", "--arms", "outcome,recommended", "--device", "cpu"])
    finally:
        torch.set_num_threads(threads)
    stats = out["stats"]
    assert set(stats) == {"outcome", "recommended"}
    for arm, s in stats.items():
        assert s["batches"] == 3 and s["trace"] >= 0 and out["rows"][arm] % 3 == 0
        # the mean of K gradients is never longer than their mean length
        assert s["mean_norm"] <= s["batch_norm"] + 1e-9
    assert stats["outcome"]["cosine_outcome"] == pytest.approx(1.0) or \
        stats["outcome"]["mean_norm"] == 0
    # the branches are rows of their own, not a credit: refused, not measured without them
    with pytest.raises(SystemExit, match="branches"):
        main(["--batches", "2", "--arms", "recommended-branch-tuned", "--device", "cpu"])


def test_bench_inference_scaling_tiny_run():
    main = _script_main("benchmarks/bench_inference_scaling.py", "bench_inference_scaling")
    threads = torch.get_num_threads()
    try:
        out = main(["--problems", "2", "--num-samples", "2", "--max-new-tokens", "16",
                    "--batch-size", "2", "--device", "cpu"])
    finally:
        torch.set_num_threads(threads)
    assert out["loop_s"] > 0 and out["batched_s"] > 0


def test_bench_fsdp_tiny_run():
    main = _script_main("benchmarks/bench_fsdp.py", "bench_fsdp")
    out = main(["--steps", "1", "--repeats", "1", "--prompts-per-step", "4", "--num-rollouts",
                "4", "--max-new-tokens", "48", "--eval-examples", "1", "--dtype", "float64",
                "--train-level-weights", "1,1,0,0,0"])  # rewards that differ: a real update
    for mode in ("data-parallel", "fsdp"):
        (run,) = out["runs"][mode]
        assert run["step_s"] > 0 and run["tokens_per_s"] > 0
    # the same run either way: in float64 the weights agree to sqrt(eps) of how far they moved
    assert out["max_weight_moved"] > 1e-5  # AdamW's first step: about lr (1e-4) per weight
    assert out["max_weight_diff"] <= training_bound(out["max_weight_moved"])
