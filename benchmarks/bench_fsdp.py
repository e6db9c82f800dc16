"""Benchmark: sharded (`--fsdp`) against replicated data-parallel GRPO, same processes.

Runs `torchrun --standalone --nproc-per-node N chapters/ch07_train.py` twice per repeat, with
and without `--fsdp`, alternating, on the bundled tiny model (CPU, Gloo, one thread per
process), and prints rank 0's step time, rollout and update seconds and generated tokens per
second side by side with their ratio (fsdp / data-parallel), plus the largest weight
difference between the two runs' final/ (the same run, up to float summation order). What FSDP
adds per step: refreshing the unsharded rollout replica (an all-gather of every weight), the
per-block all-gathers of every forward and backward pass of the update, the reduce-scatter of
the gradients, and the dummy passes that even out the micro-batch counts. Not a test: the
numbers depend on the machine (and on what else runs on it).

    python benchmarks/bench_fsdp.py                        # 5 steps, 2 processes, 2 repeats
    python benchmarks/bench_fsdp.py --steps 10 --repeats 3
"""

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from reasoning_from_scratch.run_log import read_metrics
from reasoning_from_scratch.validation import positive_int
from reasoning_from_scratch.weights import load_pretrained

ROOT = Path(__file__).resolve().parents[1]
MODES = {"data-parallel": [], "fsdp": ["--fsdp"]}


def run_once(out, flags, processes):
    """One torchrun run into `out`; returns its metrics rows (raises with stderr if it fails)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(processes), str(ROOT / "chapters" / "ch07_train.py"),
           "--output-dir", str(out), *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr[-3000:]}")
    return read_metrics(out / "metrics.csv")


def figures(rows):
    """Seconds of the steps (sums over rows), of which rollouts and updates; tokens per s."""
    step = sum(r["step_time"] for r in rows)
    return {"step_s": step, "rollout_s": sum(r["rollout_s"] for r in rows),
            "update_s": sum(r["update_s"] for r in rows),
            "tokens_per_s": sum(r["gen_tokens"] for r in rows) / max(step, 1e-9)}


def max_weight_diff(a, b):
    """Largest absolute difference between two runs' final/ weights."""
    wa = load_pretrained(a / "final", device="cpu")[0].state_dict()
    wb = load_pretrained(b / "final", device="cpu")[0].state_dict()
    return max((wa[k] - wb[k]).abs().max().item() for k in wa)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=positive_int, default=5)
    p.add_argument("--processes", type=positive_int, default=2)
    p.add_argument("--repeats", type=positive_int, default=2)
    p.add_argument("--prompts-per-step", type=positive_int, default=16)
    p.add_argument("--num-rollouts", type=positive_int, default=8)
    p.add_argument("--max-new-tokens", type=positive_int, default=112)
    p.add_argument("--eval-examples", type=positive_int, default=4)
    args = p.parse_args(argv)
    flags = ["--steps", str(args.steps), "--prompts-per-step", str(args.prompts_per_step),
             "--num-rollouts", str(args.num_rollouts), "--max-new-tokens",
             str(args.max_new_tokens), "--eval-examples", str(args.eval_examples),
             "--eval-every", "0", "--checkpoint-minutes", "0", "--threads", "1",
             "--device", "cpu", "--no-progress"]
    results = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for mode, extra in MODES.items():  # alternating: drift hits both alike
                out = Path(tmp) / f"{mode}-{rep}"
                results[mode].append(figures(run_once(out, [*flags, *extra], args.processes)))
        diff = max_weight_diff(Path(tmp) / "data-parallel-0", Path(tmp) / "fsdp-0")
    mean = {mode: {k: sum(r[k] for r in runs) / len(runs) for k in runs[0]}
            for mode, runs in results.items()}
    print(f"{args.processes} processes, {args.steps} steps of {args.prompts_per_step} x "
          f"{args.num_rollouts} rollouts (<= {args.max_new_tokens} tokens), mean of "
          f"{args.repeats} runs each")
    print(f"{'':18}{'data-parallel':>15}{'fsdp':>12}{'fsdp / dp':>12}")
    for key, label in (("step_s", "steps (s)"), ("rollout_s", "  rollouts (s)"),
                       ("update_s", "  updates (s)"), ("tokens_per_s", "tokens / s")):
        dp, fs = mean["data-parallel"][key], mean["fsdp"][key]
        print(f"{label:18}{dp:15.2f}{fs:12.2f}{fs / max(dp, 1e-9):11.2f}x")
    print(f"largest weight difference between the two final/: {diff:.2e}")
    return {"runs": results, "mean": mean, "max_weight_diff": diff, "args": vars(args)}


if __name__ == "__main__":
    main()
