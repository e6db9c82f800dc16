"""Benchmark: seconds from a stop signal that lands inside a rollout phase to the checkpoint.

A GRPO run (`training.train_grpo`) of a random model of the Qwen3-0.6B shape (2.4 GB in fp32,
saved in HF layout with the bundled tokenizer; `--model tiny`: the bundled model) runs in one
process (python) and in N Gloo processes (torchrun, one thread each). `--delay` seconds after
step `--signal-step`'s rollouts start, the last process sends itself SIGTERM: one process
signalled, as when a node's processes are stopped one by one; with several processes the
others learn of it where the decode loops look for an agreed stop (every STOP_CHECK_EVERY
tokens, `distributed.AgreedStop`). Printed for each process count: seconds from the signal to
the rollouts being abandoned (the stop raised, on the slowest process) and to the checkpoint
and `stopped` file being written (every process past the save). The checkpoint after the
first step's rollouts holds the weights and RNG states (AdamW has no state yet); a later
`--signal-step` adds the AdamW moments (2x the weights) but needs the memory of an update
(at the 0.6B shape ~12 GB per process replicated; `--fsdp`, the sharded run: ~10 GB per process
at N = 2, measured together 20.3 GB).
The checkpoint's size is printed too. Not a test: the figures depend on the machine and on
what else runs on it.

    python benchmarks/bench_stop.py                      # 0.6B shape, 1 and 2 processes
    python benchmarks/bench_stop.py --model tiny --delay 0.2 --max-new-tokens 64
"""

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from bench_fsdp import random_model_dir

from reasoning_from_scratch import distributed
from reasoning_from_scratch.datasets import load_dataset_by_name
from reasoning_from_scratch.fsdp import load_for_run
from reasoning_from_scratch.generation import STOP_CHECK_EVERY
from reasoning_from_scratch.interrupts import StopSignal
from reasoning_from_scratch.run_dir import RunDir
from reasoning_from_scratch.training import GRPOConfig, train_grpo
from reasoning_from_scratch.validation import positive_int

ROOT = Path(__file__).resolve().parents[1]
# The base model's figures, given so the run starts with its rollouts (no base evaluation).
NO_BASE_EVAL = {"accuracy": 0.0, "per_level": {}}


def worker(model_dir, out, delay, signal_step, max_new_tokens, num_rollouts, sharded=False):
    """One process of the run: train until the signal, print its times as one JSON line."""
    torch.set_num_threads(1)
    distributed.init_distributed(torch.device("cpu"), group_of_one=sharded)
    me, world = distributed.rank(), distributed.world_size()
    times = {"rank": me}
    real_save = RunDir.save_interrupted

    def timed_save(run, stop):  # the phase is abandoned: the run saves, then raises
        times["abandoned"] = time.time()
        real_save(run, stop)
        times["saved"] = time.time()

    def send():
        times["signal"], times["signal_phase"] = time.time(), times["phase"]
        os.kill(os.getpid(), signal.SIGTERM)

    def hook(phase, step):
        times["phase"] = f"{phase} {step}"
        if (phase, step) == ("rollouts", signal_step) and me == world - 1:
            threading.Timer(delay, send).start()

    RunDir.save_interrupted = timed_save
    model, tok = load_for_run(model_dir, torch.device("cpu"), None, sharded)
    examples = load_dataset_by_name("arith", "train", n=64)
    # every group kept: a random model's rewards are all equal, and the updates before the
    # signal must still run (and give AdamW its state, which the checkpoint then holds)
    config = GRPOConfig(steps=signal_step + 1, prompts_per_step=world, num_rollouts=num_rollouts,
                        max_new_tokens=max_new_tokens, warmup_steps=0, eval_every=0,
                        eval_examples=1, checkpoint_minutes=0, skip_zero_advantage=False,
                        fsdp=sharded, output_dir=str(out), progress=False)
    try:
        train_grpo(model, tok, examples, examples[:1], "cpu", config,
                   base_evaluation=NO_BASE_EVAL, phase_hook=hook)
        times["end"] = "finished before the signal (raise --max-new-tokens)"
    except StopSignal as stop:
        times["end"] = str(stop)
    print("STOPTIMES " + json.dumps(times), flush=True)
    distributed.shutdown_distributed()


def measure(model_dir, processes, args):
    """{abandoned_s, saved_s, ...} of one run with `processes` processes."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        inner = [__file__, "--worker", str(model_dir), str(out), str(args.delay),
                 str(args.signal_step), str(args.max_new_tokens), str(args.num_rollouts),
                 str(int(args.fsdp))]
        launch = [sys.executable] if processes == 1 else [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            str(processes)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        res = subprocess.run([*launch, *inner], cwd=ROOT, env=env, capture_output=True,
                             text=True)
        rows = [json.loads(m) for m in re.findall(r"STOPTIMES (\{[^}]*\})", res.stdout)]
        planned = f"rollouts {args.signal_step}"
        if len(rows) != processes or any(r["end"] != "stopped by SIGTERM" for r in rows) \
                or any(r.get("signal_phase", planned) != planned for r in rows):
            raise RuntimeError(f"the run did not stop in {planned} (rollouts shorter than "
                               f"--delay?):\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}")
        stopped = (out / "stopped").read_text().strip()
        ckpt = out / f"checkpoint-{args.signal_step - 1}"
        holds = json.loads((ckpt / "trainer_state.json").read_text())["step"]
        size = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
    sent = next(r["signal"] for r in rows if "signal" in r)
    return {"processes": processes,
            "abandoned_s": max(r["abandoned"] for r in rows) - sent,
            "saved_s": max(r["saved"] for r in rows) - sent,
            "exit_status_file": stopped, "checkpoint_step": holds, "checkpoint_bytes": size}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:  # one process of `measure`
        model_dir, out, delay, step, tokens, rollouts, sharded = argv[1:8]
        return worker(model_dir, out, float(delay), int(step), int(tokens), int(rollouts),
                      bool(int(sharded)))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", choices=("0.6B", "tiny"), default="0.6B",
                   help="a random Qwen3-0.6B-shaped model, or the bundled tiny one")
    p.add_argument("--processes", type=positive_int, nargs="+", default=[1, 2],
                   help="process counts to measure (1: python, more: torchrun)")
    p.add_argument("--delay", type=float, default=5.0,
                   help="seconds after the rollouts start at which SIGTERM is sent")
    p.add_argument("--signal-step", type=positive_int, default=1,
                   help="the step whose rollouts are stopped (1: before any update)")
    p.add_argument("--max-new-tokens", type=positive_int, default=256,
                   help="rollout length: enough that the rollouts outlast --delay")
    p.add_argument("--num-rollouts", type=positive_int, default=4,
                   help="rollouts per prompt (one prompt per process)")
    p.add_argument("--fsdp", action="store_true",
                   help="the sharded run (fsdp.py): checkpoints of DCP shards, HF weights only "
                        "at final/")
    args = p.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, n = random_model_dir(Path(tmp) / "model", args.model)
        for processes in args.processes:
            results.append(measure(model_dir, processes, args))
    print(f"stop signal {args.delay:g} s into step {args.signal_step}'s rollouts, "
          f"{'sharded (--fsdp), ' if args.fsdp else ''}{args.model} shape ({n / 1e9:.2f} B "
          f"parameters), {args.num_rollouts} rollouts per process, the decode loops looking "
          f"every {STOP_CHECK_EVERY} tokens")
    print(f"{'processes':>10}{'abandoned (s)':>15}{'checkpoint (s)':>16}{'its size (GB)':>15}")
    for r in results:
        print(f"{r['processes']:>10}{r['abandoned_s']:15.2f}{r['saved_s']:16.2f}"
              f"{r['checkpoint_bytes'] / 1e9:15.2f}")
    return {"results": results, "args": vars(args)}


if __name__ == "__main__":
    main()
