"""benchmarks/gpu_check.py on the CPU: its GRPO setups are the training path's CUDA defaults,
its step is the training loop's, every part runs on tiny shapes, the budget skips parts in
priority order."""

import json
import math
import os
import runpy
import subprocess
import sys
import time
import warnings
from argparse import Namespace
from pathlib import Path

import pytest
import torch
from tolerance import all_printed_close

from reasoning_from_scratch import systems, training
from reasoning_from_scratch.qwen3 import tiny_config

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    """The script's names (it imports its sibling benchmarks from benchmarks/)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        yield runpy.run_path(str(SCRIPT), run_name="gpu_check")
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def small_args(**kw):
    """The step's flags at a tiny size, no compiling."""
    return Namespace(**{"prompts": 2, "num_rollouts": 4, "micro_batch_size": 3,
                        "compile": False, "seed": 0, **kw})


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA it runs the real 0.6B check")
def test_gpu_check_without_cuda_says_so_and_exits_0():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "gpu_check needs CUDA" in res.stdout


def test_cuda_default_setup_is_what_the_default_flags_pick_on_cuda(gpu_check):
    def picks(config):  # (sampler dtype, autocast dtype, compiled update) on CUDA
        return (systems.sampler_dtype(config, "cuda"), systems.autocast_dtype(config, "cuda"),
                systems.compiles_update(config, "cuda"))

    def setup(name, compile=True):
        return gpu_check["grpo_config"](name, 8, small_args(compile=compile))

    bf16 = torch.bfloat16
    default = training.GRPOConfig()  # "auto" dtypes, compile and compile_update None
    assert picks(setup("cuda-default")) == picks(default) == (bf16, bf16, True)
    assert gpu_check["GRPO_SETUPS"]["cuda-default"]["dtype"] == "float32"  # --dtype's default
    assert picks(setup("eager-update")) == (bf16, bf16, False)
    assert picks(setup("bf16-weights")) == (bf16, None, False)
    assert gpu_check["GRPO_SETUPS"]["bf16-weights"]["dtype"] == "bfloat16"
    assert setup("cuda-default").max_new_tokens == 8 and setup("cuda-default").prompts_per_step == 2
    # --no-compile (the CPU's default): nothing compiled in any setup
    assert not any(picks(setup(name, compile=False))[2] for name in gpu_check["GRPO_SETUPS"])


@pytest.mark.parametrize("setup,beta", [("cuda-default", 0.0), ("bf16-weights", 0.0),
                                        ("cuda-default", 0.04)])
def test_training_step_is_a_step_of_the_training_loop(gpu_check, setup, beta):
    torch.manual_seed(0)
    config = gpu_check["grpo_config"](setup, 5, small_args(), beta)
    run = gpu_check["build_step_run"](tiny_config(vocab_size=64), setup, config, "cpu")
    dtype = torch.float32 if setup == "cuda-default" else torch.bfloat16
    assert run.model.lm_head.weight.dtype == dtype
    before = {k: v.clone() for k, v in run.model.state_dict().items()}
    r = gpu_check["training_step"](run, 0)
    assert r["rows"] == 8 and r["tokens"] == 8 * 5  # 2 prompts x G = 4, no EOS: full length
    assert r["step_s"] >= r["rollout_s"] > 0 and r["update_s"] > 0
    assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0
    assert r["trained_tokens"] > r["tokens"]  # the prompts' positions as well
    after = run.model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)  # AdamW moved them
    if setup == "bf16-weights":
        assert run.policy is run.model  # a bfloat16 model samples itself
    else:  # the bfloat16 sampling copy was refreshed from the updated float32 weights
        sampled = run.policy.state_dict()
        assert all(sampled[k].dtype == torch.bfloat16 for k in sampled)
        assert all(torch.equal(sampled[k], after[k].to(torch.bfloat16)) for k in after)
    if beta:
        assert all(torch.equal(v, before[k]) for k, v in run.ref_model.state_dict().items())
    else:
        assert run.ref_model is None


def test_the_plan_runs_the_most_wanted_parts_first(gpu_check):
    def names(argv):
        args = gpu_check["parse_args"](argv)
        return [name for name, _, _ in gpu_check["plan"](args, {})]

    assert names(["--device", "cuda"]) == [
        "compile_check", "grpo 16x8x256 cuda-default", "grpo 16x8x256 eager-update",
        "grpo 16x8x256 bf16-weights",
        "decode 0.6B x128", "data_parallel two_steps", "data_parallel startup",
        "decode 0.6B x512", "decode 1.7B x128", "grpo 16x8x512 cuda-default",
        "grpo 16x8x256 cuda-default +ref", "default_run"]
    assert names(["--device", "cpu", "--parts", "grpo,default_run",
                  "--grpo-setups", "bf16-weights"]) == [
        "grpo 2x2x4 bf16-weights", "grpo 2x2x4 cuda-default +ref", "default_run"]
    # --quick: the check, today's CUDA step and one decode shape, in a 170 s budget
    assert names(["--device", "cuda", "--quick"]) == [
        "compile_check", "grpo 16x8x256 cuda-default", "decode 0.6B x128"]
    assert gpu_check["parse_args"](["--quick"]).budget_s == 170.0


def test_the_budget_limits_and_skips_parts(gpu_check):
    now = [0.0]
    jobs = [("a",), ("b",), ("c",), ("d",), ("e",)]
    skipped, ran = [], []
    for job, limit in gpu_check["within_budget"](jobs, 303.0, 120.0, skipped, lambda: now[0]):
        ran.append((job[0], limit))
        now[0] += 100.0  # every part takes 100 s
    # left before each: 303, 203, 103, 3 (under MIN_PART_S = 5), then -97
    assert ran == [("a", 120.0), ("b", 120.0), ("c", pytest.approx(103.0))]
    assert skipped == ["d", "e"]


def test_max_metric_diff(gpu_check):
    a = [{"loss": 1.0, "reward_mean": 0.5}, {"loss": 2.0, "reward_mean": 0.25}]
    b = [{"loss": 1.5, "reward_mean": 0.5}, {"loss": 2.0, "reward_mean": 0.0}]
    assert gpu_check["max_metric_diff"](a, b) == {"loss": 0.5, "reward_mean": 0.25}
    with pytest.raises(ValueError, match="2 and 1 steps"):
        gpu_check["max_metric_diff"](a, b[:1])


def test_a_tiny_budget_skips_every_part(gpu_check, tmp_path):
    out = tmp_path / "gpu_results.json"
    assert gpu_check["main"](["--device", "cpu", "--budget-s", "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    args = gpu_check["parse_args"](["--device", "cpu"])
    assert res["skipped"] == [name for name, _, _ in gpu_check["plan"](args, {})]
    assert res["part_s"] == {} and res["grpo"] == {} and res["default_run"] is None


def test_gpu_check_cpu_path_writes_every_figure(gpu_check, tmp_path):
    """`gpu_check.py --device cpu`: every part on a tiny model, the JSON at the given path."""
    out = tmp_path / "gpu_results.json"
    assert gpu_check["main"](["--device", "cpu", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["device"] == "cpu" and res["compile"] is False
    assert not res["errors"] and not res["timed_out"] and not res["skipped"]
    assert not res["compile_failures"]
    assert len(res["part_s"]) == 9
    check = res["compile_check"]  # compiled against eager, whatever --compile says
    assert check["ok"] and check["decoding"]["tokens_equal"]
    assert check["update"]["max_logprob_diff"] <= check["update"]["logprob_tolerance"]
    assert set(res["grpo"]) == {"2x2x4 cuda-default", "2x2x4 eager-update",
                                "2x2x4 bf16-weights", "2x2x4 cuda-default +ref"}
    for label, g in res["grpo"].items():
        assert g["tokens"] == 2 * 2 * 4 and g["trained_tokens"] > g["tokens"]
        for key in ("step_s", "rollout_s", "update_s", "rollout_tok_s", "warmup_step_s"):
            assert math.isfinite(g[key]) and g[key] > 0, (label, key)
        assert math.isfinite(g["loss"]) and math.isfinite(g["grad_norm"])
        assert "update_mfu" not in g and "peak_gib" not in g  # CUDA only
    assert res["grpo"]["2x2x4 cuda-default +ref"]["settings"]["beta"] == 0.04
    for path in ("ours_eager", "ours_fast", "hf_static"):
        assert res["decode_tok_s"][path]["tiny x4"] > 0
    two = res["data_parallel"]["two_steps"]
    assert two["plain"]["steps"] == two["fsdp"]["steps"] == 2
    assert two["plain"]["wall_s"] > 0 and two["fsdp"]["wall_s"] > 0
    assert set(two["max_diff"]) == {"loss", "reward_mean"}
    # float64 on the CPU: the same run, equal to the 6 digits metrics.csv prints
    for key, plain in two["values"]["plain"].items():
        assert all_printed_close(plain, two["values"]["fsdp"][key]), key
    start = res["data_parallel"]["startup"]
    assert set(start["peaks"]) == {"before", "sharded"} and start["params"] == 834_816
    assert all(len(p) == 1 and p[0] >= 0 for p in start["peaks"].values())  # one process
    assert res["default_run"]["wall_s"] > 0 and res["default_run"]["final_accuracy"] is not None


def test_a_part_over_its_limit_a_failing_part_and_a_compile_fallback_are_recorded(gpu_check):
    args = gpu_check["parse_args"](["--device", "cpu"])
    results = gpu_check["new_results"](args)

    def slow():
        time.sleep(5)

    def broken():
        raise ValueError("no such shape")

    def falls_back():
        warnings.warn("torch.compile of the decode step failed (X); decoding eagerly",
                      RuntimeWarning, stacklevel=2)

    for name, fn in (("slow", slow), ("broken", broken), ("falls back", falls_back)):
        gpu_check["run_part"](name, fn, (), 0.2, results, "cpu")
    assert results["timed_out"] == ["slow"] and results["part_s"]["slow"] < 4
    assert results["errors"] == {"broken": "ValueError: no such shape"}
    assert results["compile_failures"] == {
        "falls back": ["torch.compile of the decode step failed (X); decoding eagerly"]}
