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

--startup measures instead the peak memory of each process while an FSDP run starts, for a
random model of the Qwen3-0.6B shape saved in HF layout (2.4 GB on disk), the way the package
started before (every process loads the whole fp32 model, deep-copies it for the rollout replica,
casts the copy to the replica's dtype, then shards) against the sharded start (built on the meta
device, sharded, filled by a broadcast from rank 0 (`fsdp.load_model_sharded`), the replica
built empty in its dtype and filled from the shards (`fsdp.shard_with_replica`)). The peak is
the process's maximum resident set size above what it held before the start, in GB and in
bytes per parameter. The replica dtype: float32 (the CPU's compute dtype) or bfloat16 (CUDA's).

    python benchmarks/bench_fsdp.py --startup                      # 0.6B shape, 2 processes
    python benchmarks/bench_fsdp.py --startup --startup-model tiny # the bundled model (seconds)

`--startup-device cuda` starts on GPUs instead (NCCL, one GPU per process): the peak is then
`torch.cuda.max_memory_allocated` above what the process had allocated before the start
(benchmarks/gpu_check.py runs it with one process).
"""

import argparse
import copy
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

from reasoning_from_scratch import distributed, fsdp
from reasoning_from_scratch.memory import count_parameters
from reasoning_from_scratch.qwen3 import QWEN3_0_6B_CONFIG, Qwen3Model
from reasoning_from_scratch.run_log import read_metrics
from reasoning_from_scratch.validation import positive_int
from reasoning_from_scratch.weights import (
    SINGLE_FILE,
    load_pretrained,
    resolve_model_dir,
    save_pretrained,
)

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


def saved_state(model_dir, dtype=None) -> dict:
    """A saved model's tensors as saved (a float64 run's stay float64), or cast to `dtype`."""
    state = load_file(str(Path(model_dir) / SINGLE_FILE))
    return state if dtype is None else {k: v.to(dtype) for k, v in state.items()}


def max_weight_diff(wa: dict, wb: dict) -> float:
    """Largest absolute difference between two state dicts (the same keys)."""
    return max((wa[k] - wb[k]).abs().max().item() for k in wa)


def _max_rss_bytes() -> int:
    """This process's peak resident set size so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _peak_bytes(device) -> int:
    """The process's peak memory so far on `device`: allocated CUDA memory, or on the CPU the
    peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return _max_rss_bytes()


def start_old(model_dir, dtype, device="cpu"):
    """How an FSDP run started before: the whole fp32 model on every process, deep-copied and
    cast for the replica, then sharded."""
    model = load_pretrained(model_dir, device=device)[0]
    replica = copy.deepcopy(model).eval().requires_grad_(False).to(dtype)
    fsdp.shard_model(model)
    return model, replica


def start_sharded(model_dir, dtype, device="cpu"):
    """The sharded start: `load_model_sharded`, then the replica from the shards."""
    device = torch.device(device)
    model = fsdp.load_model_sharded(model_dir, device)
    return fsdp.shard_with_replica(model, device, dtype)


STARTS = {"before": start_old, "sharded": start_sharded}


def startup_worker(mode, model_dir, dtype_name, device_type="cpu"):
    """One torchrun process of `--startup`: start, then print its peak above the baseline."""
    device = distributed.init_distributed(torch.device(device_type))  # CUDA: GPU LOCAL_RANK
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    else:
        base = _max_rss_bytes()
    model, replica = STARTS[mode](model_dir, getattr(torch, dtype_name), device)
    peak = _peak_bytes(device) - base
    print("STARTUP " + json.dumps({"rank": distributed.rank(), "peak_bytes": peak}), flush=True)
    distributed.shutdown_distributed()


def random_model_dir(out, shape):
    """A random model of `shape` ("0.6B": Qwen3-0.6B's config; "tiny": the bundled model's)
    in HF layout under `out`, with the bundled tokenizer; returns (dir, parameter count)."""
    _, tok = load_pretrained("tiny-arith", device="cpu")
    if shape == "tiny":
        return resolve_model_dir("tiny-arith"), count_parameters(
            load_pretrained("tiny-arith", device="cpu")[0].cfg)
    torch.manual_seed(0)
    model = Qwen3Model(QWEN3_0_6B_CONFIG)
    save_pretrained(model, tok, out)
    return out, count_parameters(QWEN3_0_6B_CONFIG)


def measure_startup(shape, processes, dtype_name, device_type="cpu"):
    """{mode: [peak bytes of each rank]} for both starts, one torchrun each (`device_type`
    cuda: one GPU per process, NCCL; cpu: Gloo)."""
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, n = random_model_dir(Path(tmp) / "model", shape)
        peaks = {}
        for mode in STARTS:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", str(processes), __file__, "--startup-worker", mode,
                   str(model_dir), dtype_name, device_type]
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
            if res.returncode:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr[-3000:]}")
            # the processes print at once: their lines may run into each other
            rows = [json.loads(m) for m in re.findall(r"STARTUP (\{[^}]*\})", res.stdout)]
            peaks[mode] = [r["peak_bytes"] for r in sorted(rows, key=lambda r: r["rank"])]
    backend = "NCCL" if device_type == "cuda" else "Gloo"
    print(f"start-up peak per process above baseline, {shape} shape ({n / 1e9:.2f} B "
          f"parameters), {processes} {backend} processes, replica {dtype_name}")
    for mode, per_rank in peaks.items():
        cells = ", ".join(f"rank {r}: {b / 1e9:.2f} GB ({b / n:.1f} B/param)"
                          for r, b in enumerate(per_rank))
        print(f"  {mode:8} {cells}")
    ratio = max(peaks["sharded"]) / max(peaks["before"])
    print(f"  largest process, sharded / before: {ratio:.2f}x")
    return {"peaks": peaks, "params": n, "ratio": ratio}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--startup-worker"]:  # one process of measure_startup
        return startup_worker(*argv[1:5])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=positive_int, default=5, help="GRPO steps of each run")
    p.add_argument("--processes", type=positive_int, default=2, help="torchrun processes")
    p.add_argument("--repeats", type=positive_int, default=2,
                   help="runs of each mode, alternating (the figures are their means)")
    p.add_argument("--prompts-per-step", type=positive_int, default=16,
                   help="prompts per step, over all processes")
    p.add_argument("--num-rollouts", type=positive_int, default=8, help="rollouts per prompt")
    p.add_argument("--max-new-tokens", type=positive_int, default=112,
                   help="longest rollout, in tokens")
    p.add_argument("--eval-examples", type=positive_int, default=4,
                   help="held-out examples of the final evaluation")
    p.add_argument("--train-level-weights", default=None,
                   help="ch07_train.py's --train-level-weights (None: its default); '1,1,0,0,0' "
                        "keeps to the short problems a few tokens can solve")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32",
                   help="the runs' weights: float64 makes the two runs agree far beyond "
                        "rounding (the weight difference is then a check of the sharding)")
    p.add_argument("--startup", action="store_true",
                   help="measure the start-up peak memory per process instead (see above)")
    p.add_argument("--startup-model", choices=("0.6B", "tiny"), default="0.6B",
                   help="--startup: a random Qwen3-0.6B-shaped model, or the bundled one")
    p.add_argument("--replica-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="--startup: the rollout replica's dtype (float32 on the CPU, "
                        "bfloat16 on CUDA)")
    p.add_argument("--startup-device", choices=("cpu", "cuda"), default="cpu",
                   help="--startup: CPU processes (Gloo; peak RSS) or one GPU per process "
                        "(NCCL; peak allocated CUDA memory)")
    args = p.parse_args(argv)
    if args.startup:
        return measure_startup(args.startup_model, args.processes, args.replica_dtype,
                               args.startup_device)
    flags = ["--steps", str(args.steps), "--prompts-per-step", str(args.prompts_per_step),
             "--num-rollouts", str(args.num_rollouts), "--max-new-tokens",
             str(args.max_new_tokens), "--eval-examples", str(args.eval_examples),
             "--eval-every", "0", "--checkpoint-minutes", "0", "--threads", "1",
             "--device", "cpu", "--no-progress", "--dtype", args.dtype,
             "--warmup-steps", "0"]  # the first update moves the weights: the weight check
    if args.train_level_weights is not None:
        flags += ["--train-level-weights", args.train_level_weights]
    results = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for mode, extra in MODES.items():  # alternating: drift hits both alike
                out = Path(tmp) / f"{mode}-{rep}"
                results[mode].append(figures(run_once(out, [*flags, *extra], args.processes)))
        plain = saved_state(Path(tmp) / "data-parallel-0" / "final")
        diff = max_weight_diff(plain, saved_state(Path(tmp) / "fsdp-0" / "final"))
        start = saved_state(resolve_model_dir("tiny-arith"), getattr(torch, args.dtype))
        moved = max_weight_diff(plain, start)  # how far training moved the weights
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
    print(f"largest weight difference between the two final/: {diff:.2e} ({args.dtype}; "
          f"training moved the weights by up to {moved:.2e})")
    return {"runs": results, "mean": mean, "max_weight_diff": diff, "max_weight_moved": moved,
            "args": vars(args)}


if __name__ == "__main__":
    main()
