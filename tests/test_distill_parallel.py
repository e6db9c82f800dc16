"""Data-parallel and sharded distillation (`torchrun ... ch09_distill.py [--fsdp]`): two Gloo
processes make the one-process run's weights, with and without FSDP, including an update where
one process has no rows; SIGTERM on one process leaves a checkpoint that a different number of
processes resumes to the uninterrupted run; final/ is one HF model that load_pretrained reads;
chapters/ch09_distill.py runs under torchrun with --fsdp. The runs compared train in float64,
so they agree far beyond any summation order's rounding (tests/tolerance.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_distillation import HELD_OUT, TRACES
from tolerance import all_printed_close, assert_trained_alike, saved_weights

from reasoning_from_scratch.distillation import read_traces, write_traces
from reasoning_from_scratch.distillation_training import DistillConfig, train_distillation
from reasoning_from_scratch.fsdp import SHARDED_DIR
from reasoning_from_scratch.interrupts import EXIT_STOPPED
from reasoning_from_scratch.run_log import read_metrics
from reasoning_from_scratch.weights import load_pretrained

pytestmark = pytest.mark.slow  # process groups under torchrun: pyproject.toml's markers

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 120  # a tiny run takes seconds; one still going after this is stuck
DTYPE = torch.float64  # of the runs compared: rounding ~1e-16, summed in any order

# 8 traces, 2 held back: 6 to train on in batches of 5 and 1, so every other update leaves one of
# two processes without a row (it adds nothing; under FSDP it runs a zero-weighted pass).
CONFIG = dict(steps=4, batch_size=5, lr=1e-2, warmup=1, val_fraction=0.25, eval_every=2,
              eval_examples=2, eval_max_new_tokens=4, eval_batch_size=2, seed=1,
              progress=False)

# One process of a run: train_distillation as chapters/ch09_distill.py calls it, joined to
# torchrun's group when started by it (else alone, or in a group of one for FSDP). "stop":
# [rank, phase, step]: that process sends itself SIGTERM when the phase starts.
WORKER = r'''
import json, os, signal, sys
import torch
from reasoning_from_scratch.distillation import read_traces, write_traces
from reasoning_from_scratch.distillation_training import DistillConfig, train_distillation
from reasoning_from_scratch.distributed import init_distributed, shutdown_distributed
from reasoning_from_scratch.interrupts import exit_status
from reasoning_from_scratch.weights import load_pretrained
spec = json.loads(open(sys.argv[1]).read())
torch.set_num_threads(1)
config = DistillConfig(**spec["config"])
device = init_distributed(torch.device("cpu"), group_of_one=config.fsdp)
stop = spec.get("stop")
def hook(phase, step):
    if stop and os.environ.get("RANK", "0") == str(stop[0]) and [phase, step] == stop[1:]:
        os.kill(os.getpid(), signal.SIGTERM)
model, tok = load_pretrained(spec["model"], device="cpu", dtype=spec["dtype"])
try:
    train_distillation(model, tok, spec["traces"], spec["held_out"], device, config,
                       resume_from=spec.get("resume"), phase_hook=hook)
except KeyboardInterrupt as err:
    sys.exit(exit_status(err))
finally:  # every process meets the others before it leaves the group
    shutdown_distributed()
'''


def _launch(tmp, model_dir, out, processes, fsdp=False, stop=None, resume=False):
    """Run the worker: `torchrun --nproc-per-node processes` (Gloo), or plain python for one
    process; returns the finished process."""
    spec = {"model": str(model_dir), "traces": TRACES, "held_out": HELD_OUT,
            "config": {**CONFIG, "output_dir": str(out), "fsdp": fsdp}, "stop": stop,
            "dtype": str(DTYPE).removeprefix("torch."),
            "resume": str(out) if resume else None}
    (tmp / "worker.py").write_text(WORKER)
    spec_file = tmp / f"spec-{out.name}-{processes}-{int(resume)}.json"
    spec_file.write_text(json.dumps(spec))
    launcher = [sys.executable]
    if processes > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                     str(processes)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([*launcher, str(tmp / "worker.py"), str(spec_file)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


def _weights(run_dir):
    return saved_weights(run_dir / "final")  # as saved: float64 if the run trained in it


def _start(tiny_dir):
    return saved_weights(tiny_dir, DTYPE)  # saved in float32: the runs' exact start


def _losses(run_dir):
    return [r["loss"] for r in read_metrics(run_dir / "metrics.csv")]


@pytest.fixture(scope="module")
def one_process(tiny_dir, tmp_path_factory):
    """The reference: the same run in this process, without torchrun."""
    out = tmp_path_factory.mktemp("dp") / "one"
    model, tok = load_pretrained(tiny_dir, device="cpu", dtype=DTYPE)
    threads = torch.get_num_threads()
    try:
        train_distillation(model, tok, TRACES, HELD_OUT, "cpu",
                           DistillConfig(**CONFIG, output_dir=str(out)))
    finally:
        torch.set_num_threads(threads)
    return out


@pytest.mark.parametrize("fsdp", [False, True], ids=["replicas", "fsdp"])
def test_two_processes_make_the_one_process_run(one_process, tiny_dir, tmp_path, fsdp):
    out = tmp_path / "two"
    proc = _launch(tmp_path, tiny_dir, out, 2, fsdp=fsdp)
    assert proc.returncode == 0, proc.stderr[-8000:]
    diff = assert_trained_alike(_weights(out), _weights(one_process), _start(tiny_dir))
    print(f"fsdp={fsdp}: max |w_2proc - w_1proc| = {diff:.2e}")
    assert all_printed_close(_losses(out), _losses(one_process))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2
    assert summary["final_accuracy"] == json.loads(
        (one_process / "summary.json").read_text())["final_accuracy"]
    if fsdp:  # each process wrote its shards; final/ is still one HF model
        assert (out / "final" / SHARDED_DIR / "__1_0.distcp").is_file()
        model = load_pretrained(tiny_dir, device="cpu")[0]
        assert sum(s["param_elements"] for s in summary["shards"]) == \
            sum(p.numel() for p in model.parameters())  # no element held twice


@pytest.mark.parametrize("fsdp,stopped_with,resumed_with", [(False, 2, 1), (True, 1, 2)],
                         ids=["replicas-2-then-1", "fsdp-1-then-2"])
def test_sigterm_then_resume_with_another_process_count_equals_the_straight_run(
        one_process, tiny_dir, tmp_path, fsdp, stopped_with, resumed_with):
    out = tmp_path / "run"
    # the last process gets SIGTERM as update 2 starts: every process stops after it
    proc = _launch(tmp_path, tiny_dir, out, stopped_with, fsdp=fsdp,
                   stop=[stopped_with - 1, "update", 2])
    # one process exits 75; torchrun reports its workers' 75 and fails itself
    assert proc.returncode == EXIT_STOPPED if stopped_with == 1 else \
        f"exitcode: {EXIT_STOPPED}" in proc.stderr, proc.stderr[-8000:]
    state = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["step"] == 2 and (out / "stopped").is_file()
    proc = _launch(tmp_path, tiny_dir, out, resumed_with, fsdp=fsdp, resume=True)
    assert proc.returncode == 0, proc.stderr[-8000:]
    diff = assert_trained_alike(_weights(out), _weights(one_process), _start(tiny_dir))
    print(f"fsdp={fsdp}: stopped with {stopped_with}, resumed with {resumed_with}: "
          f"max |w - w_straight| = {diff:.2e}")
    assert [r["step"] for r in read_metrics(out / "metrics.csv")] == [1, 2, 3, 4]
    assert all_printed_close(_losses(out), _losses(one_process))
    assert not (out / "stopped").exists()


def test_ch09_distill_script_under_torchrun_with_fsdp(tiny_dir, tmp_path):
    traces = write_traces(TRACES, tmp_path / "traces.jsonl")
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", str(ROOT / "chapters" / "ch09_distill.py"), "--teacher", str(tiny_dir),
           "--student", str(tiny_dir), "--traces", str(traces), "--output-dir", str(out),
           "--fsdp", "--steps", "2", "--batch-size", "3", "--eval-examples", "2",
           "--eval-max-new-tokens", "4", "--eval-every", "0", "--val-fraction", "0",
           "--no-progress", "--device", "cpu", "--threads", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-8000:]
    assert proc.stdout.count("student_final_accuracy") == 1  # rank 0 alone prints
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["config"]["fsdp"] is True
    assert read_traces(out / "traces.jsonl") == read_traces(traces)
    assert load_pretrained(out / "final", device="cpu")[0] is not None
    assert (out / "final" / SHARDED_DIR / ".metadata").is_file()
