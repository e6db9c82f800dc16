"""Exit races: run every two-process program of the package N times in a row and count aborts.

A Gloo process that leaves its group while another still exchanges messages with it can make
that other one abort at exit (SIGABRT, "terminate called without an active exception"), now
and then: a test that passes 29 times fails the 30th. `distributed.shutdown_distributed` meets
the other processes before it leaves; this script checks that no way out of a data-parallel
program still races, by running each of them `--runs` times:

- the two-process workers of the tests: the helpers (torch.multiprocessing.spawn,
  tests/test_distributed.py), the uneven FSDP update (tests/test_fsdp.py), the distillation
  worker with and without FSDP (tests/test_distill_parallel.py);
- the entry points under `torchrun --standalone --nproc-per-node 2`: chapters/ch07_train.py
  and chapters/ch09_distill.py, with and without --fsdp, at tiny settings (bundled model).

A run counts as an abort when a process died of a signal or C++'s terminate ran (the text in
stderr); as hung when it still runs after its timeout (its processes are then killed); as
another failure when it exited non-zero otherwise. Not a test (it takes minutes):
tests/test_process_group.py runs three targets once.

    python benchmarks/exit_races.py --runs 50
    python benchmarks/exit_races.py --runs 10 --targets ch07 ch07-fsdp
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from reasoning_from_scratch.validation import positive_int

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the test workers are defined beside their tests

import test_distill_parallel  # noqa: E402
import test_distributed  # noqa: E402
import test_fsdp  # noqa: E402
from test_distillation import TRACES  # noqa: E402

from reasoning_from_scratch.distillation import write_traces  # noqa: E402

TIMEOUT_S = 300  # a tiny run takes seconds; one still going after this is stuck
ABORT_MARKS = ("terminate called", "SIGABRT", "Signals.SIG", "core dumped")
MODEL = "tiny-arith"  # the bundled model: no download, a few seconds per run
CH07_FLAGS = ["--steps", "2", "--prompts-per-step", "2", "--num-rollouts", "2",
              "--max-new-tokens", "16", "--eval-examples", "2", "--eval-every", "0",
              "--eval-batch-size", "2", "--train-examples", "16", "--checkpoint-minutes", "0",
              "--threads", "1", "--device", "cpu", "--no-progress"]
CH09_FLAGS = ["--teacher", MODEL, "--student", MODEL, "--steps", "2", "--batch-size", "3",
              "--eval-examples", "2", "--eval-max-new-tokens", "4", "--eval-every", "0",
              "--val-fraction", "0", "--checkpoint-minutes", "0", "--no-progress",
              "--device", "cpu", "--threads", "1"]


def _torchrun(script, flags):
    """`torchrun --standalone --nproc-per-node 2 script flags`; the finished process."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", str(ROOT / "chapters" / script), *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)


def _helpers(tmp):
    """The helpers' test worker, two processes spawned by torch.multiprocessing; a finished
    process's stand-in (a worker that died raises in spawn)."""
    try:
        torch.multiprocessing.spawn(test_distributed._helpers_worker,
                                    args=(str(tmp / "init"), str(tmp)), nprocs=2)
    except Exception as err:  # ProcessExitedException (a signal) or ProcessRaisedException
        return subprocess.CompletedProcess([], 1, "", f"{type(err).__name__}: {err}")
    return subprocess.CompletedProcess([], 0, "", "")


def _ch09(tmp, fsdp):
    """chapters/ch09_distill.py on a few traces (no teacher sampling)."""
    traces = write_traces(TRACES, tmp / "traces.jsonl")
    return _torchrun("ch09_distill.py", [*CH09_FLAGS, "--traces", str(traces), "--output-dir",
                                         str(tmp / "run"), *(["--fsdp"] if fsdp else [])])


# name -> run(tmp directory) -> a finished process (returncode, stderr)
TARGETS = {
    "helpers-worker": _helpers,
    "uneven-fsdp-worker": lambda tmp: test_fsdp.launch_uneven(tmp)[0],
    "distill-worker": lambda tmp: test_distill_parallel._launch(tmp, MODEL, tmp / "run", 2),
    "distill-worker-fsdp": lambda tmp: test_distill_parallel._launch(tmp, MODEL, tmp / "run", 2,
                                                                     fsdp=True),
    "ch07": lambda tmp: _torchrun("ch07_train.py", [*CH07_FLAGS, "--output-dir",
                                                    str(tmp / "run")]),
    "ch07-fsdp": lambda tmp: _torchrun("ch07_train.py", [*CH07_FLAGS, "--output-dir",
                                                         str(tmp / "run"), "--fsdp"]),
    "ch09": lambda tmp: _ch09(tmp, fsdp=False),
    "ch09-fsdp": lambda tmp: _ch09(tmp, fsdp=True),
}


def classify(proc) -> str:
    """"ok", "abort" (a signal or C++'s terminate) or "failed" (any other non-zero exit)."""
    if any(mark in proc.stderr for mark in ABORT_MARKS) or proc.returncode < 0:
        return "abort"
    return "ok" if proc.returncode == 0 else "failed"


def _run_once(name, tmp: Path) -> tuple[str, str]:
    """(kind, stderr) of one run of a target: kind "ok", "abort", "failed" or "hung" (still
    running after its timeout; its processes, whose command lines name `tmp`, are killed)."""
    try:
        proc = TARGETS[name](tmp)
    except subprocess.TimeoutExpired as err:
        subprocess.run(["pkill", "-9", "-f", str(tmp)], check=False)  # workers left behind
        stderr = err.stderr.decode() if isinstance(err.stderr, bytes) else err.stderr or ""
        return "hung", f"{stderr}\n(still running after {err.timeout} s)"
    return classify(proc), proc.stderr


def run_target(name, runs):
    """{"ok", "abort", "failed", "hung": counts, "seconds", "last_error"} of `runs` runs of a
    target."""
    counts = {"ok": 0, "abort": 0, "failed": 0, "hung": 0, "seconds": 0.0, "last_error": ""}
    for i in range(runs):
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.time()
            kind, stderr = _run_once(name, Path(tmp))
            counts["seconds"] += time.time() - t0
        counts[kind] += 1
        if kind != "ok":  # shown at once: a rare abort's stderr is what explains it
            counts["last_error"] = stderr[-2000:]
            print(f"--- {name}, run {i + 1}: {kind}, stderr ---\n{stderr[-6000:]}", flush=True)
    return counts


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--runs", type=positive_int, default=50, help="runs of each target")
    p.add_argument("--targets", nargs="+", choices=list(TARGETS), default=list(TARGETS),
                   help="which programs to run")
    args = p.parse_args(argv)
    results = {}
    print(f"{'target':22}{'runs':>6}{'ok':>6}{'aborts':>8}{'failed':>8}{'hung':>6}{'s/run':>8}")
    for name in args.targets:
        r = results[name] = run_target(name, args.runs)
        print(f"{name:22}{args.runs:6}{r['ok']:6}{r['abort']:8}{r['failed']:8}{r['hung']:6}"
              f"{r['seconds'] / args.runs:8.1f}", flush=True)
    for name, r in results.items():
        if r["last_error"]:
            print(f"--- {name}: last failure's stderr ---\n{r['last_error']}")
    return results


if __name__ == "__main__":
    main()
