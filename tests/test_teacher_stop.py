"""A stop before the student's run has anything to checkpoint: chapter 9's teacher phase.

Rejection sampling appends each finished batch, with the sampling generator's state after it, to
a partial file (`distillation.SampledBatches`), so sampling stopped by a signal (or killed, which
may tear the last line) continues after its last whole batch and ends with the records of a
sampling never stopped. chapters/ch09_distill.py stopped while its teacher samples writes
config.json, data.json and `stopped` (75), and `--resume` ends with the uninterrupted run's
traces and weights; with two processes a signal to the one waiting for rank 0's sampling stops
both at the same poll (tiny random model, CPU, Gloo)."""

import json
import os
import runpy
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_distillation import _accept_every_sample

from reasoning_from_scratch import distillation
from reasoning_from_scratch.checkpoints import STOPPED_FILE
from reasoning_from_scratch.cli import distill as distillation_cli
from reasoning_from_scratch.distillation import generate_distillation_data
from reasoning_from_scratch.interrupts import EXIT_STOPPED, StopSignal
from reasoning_from_scratch.weights import load_pretrained

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 180
EXAMPLES = [{"problem": f"Compute {a} + {b}.", "answer": str(a + b)}
            for a, b in [(1, 2), (3, 4), (5, 6), (7, 8), (9, 1), (2, 2)]]
SAMPLING = dict(num_samples=2, max_per_problem=2, max_new_tokens=6, prompts_per_batch=2,
                seed=5, teacher_name="t", progress=False)


def _stop_at_call(monkeypatch, call):
    """The sampler raises a stop signal as its `call`-th batch starts (counted from 1)."""
    real, calls = distillation.sample_rollouts_batch, []

    def sampler(*args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            raise StopSignal(signal.SIGTERM)
        return real(*args, **kwargs)
    monkeypatch.setattr(distillation, "sample_rollouts_batch", sampler)
    return real


def _without_seconds(stats):
    return {k: v for k, v in stats.items() if k != "seconds"}


def test_sampling_stopped_after_two_batches_continues_to_the_straight_records(
        tiny_dir, tmp_path, monkeypatch):
    _accept_every_sample(monkeypatch)
    model, tok = load_pretrained(tiny_dir, device="cpu")
    straight, straight_stats = generate_distillation_data(model, tok, EXAMPLES, **SAMPLING)
    assert len(straight) == 12  # every sample accepted, the samples of a problem differ
    partial = tmp_path / "traces.partial.jsonl"
    real = _stop_at_call(monkeypatch, 3)
    with pytest.raises(StopSignal):
        generate_distillation_data(model, tok, EXAMPLES, partial_path=partial, **SAMPLING)
    lines = partial.read_text().splitlines()
    assert [json.loads(x).get("start") for x in lines] == [None, 0, 2]  # header, 2 batches
    with open(partial, "a") as f:  # a kill during the third batch's write tears its line
        f.write('{"start": 4, "records": [{"probl')
    calls = []
    monkeypatch.setattr(distillation, "sample_rollouts_batch",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    resumed, stats = generate_distillation_data(model, tok, EXAMPLES, partial_path=partial,
                                                **SAMPLING)
    assert len(calls) == 1  # only the last batch was sampled again
    assert resumed == straight  # same samples: the generator continued from its saved state
    assert _without_seconds(stats) == _without_seconds(straight_stats)
    # every sample of the 6 problems verified and kept; the totals add all three batches,
    # the two read back from the file and the one sampled again
    assert (stats["verified"], stats["kept"]) == (12, 12)
    batches = [json.loads(x) for x in partial.read_text().splitlines()[1:]]
    assert len(batches) == 3  # the torn line gone, batch 3 appended
    assert stats["generated_tokens"] == sum(b["tokens"] for b in batches) > 0
    assert stats["seconds"] == pytest.approx(sum(b["seconds"] for b in batches))


def test_a_partial_file_of_other_settings_or_with_a_bad_line_is_refused(
        tiny_dir, tmp_path, monkeypatch):
    _accept_every_sample(monkeypatch)
    model, tok = load_pretrained(tiny_dir, device="cpu")
    partial = tmp_path / "traces.partial.jsonl"
    _stop_at_call(monkeypatch, 3)
    with pytest.raises(StopSignal):
        generate_distillation_data(model, tok, EXAMPLES, partial_path=partial, **SAMPLING)
    with pytest.raises(ValueError, match="other sampling settings"):
        generate_distillation_data(model, tok, EXAMPLES, partial_path=partial,
                                   **{**SAMPLING, "seed": 6})
    with pytest.raises(ValueError, match="other sampling settings"):  # other problems
        generate_distillation_data(model, tok, EXAMPLES[::-1], partial_path=partial, **SAMPLING)
    lines = partial.read_text().splitlines()
    partial.write_text("\n".join([lines[0], "{not json", lines[2]]) + "\n")
    with pytest.raises(ValueError, match=r"traces.partial.jsonl, line 2: not JSON"):
        generate_distillation_data(model, tok, EXAMPLES, partial_path=partial, **SAMPLING)


# The command line
# ----------------------------------------------------------------------------------------------

FLAGS = ["--train-examples", "6", "--num-samples", "2", "--max-per-problem", "2",
         "--prompts-per-batch", "2", "--max-new-tokens", "6", "--steps", "3", "--batch-size",
         "2", "--eval-examples", "2", "--eval-max-new-tokens", "6", "--eval-every", "0",
         "--val-fraction", "0", "--no-progress", "--device", "cpu", "--threads", "1"]


def _ch09(argv):
    return runpy.run_path(str(ROOT / "chapters" / "ch09_distill.py"), run_name="ch09")["main"](
        argv)


def _argv(tiny_dir, out):
    return ["--teacher", str(tiny_dir), "--student", str(tiny_dir), "--output-dir", str(out),
            *FLAGS]


@pytest.fixture(scope="module")
def straight(tiny_dir, tmp_path_factory):
    """The uninterrupted run: its traces and final weights."""
    out = tmp_path_factory.mktemp("straight") / "run"
    with pytest.MonkeyPatch.context() as mp:
        _accept_every_sample(mp)
        _ch09(_argv(tiny_dir, out))
    return (out / "traces.jsonl").read_text(), _weights(out)


def _weights(out):
    return load_pretrained(out / "final", device="cpu")[0].state_dict()


def _check_resumes_to(out, straight):
    """`--resume out` (one process) ends with the straight run's traces and weights."""
    _ch09(["--resume", str(out), "--threads", "1"])
    traces, weights = straight
    assert (out / "traces.jsonl").read_text() == traces
    resumed = _weights(out)
    assert all(torch.equal(resumed[k], weights[k]) for k in weights)
    assert not (out / STOPPED_FILE).exists() and not (out / "traces.partial.jsonl").exists()


def test_ch09_stopped_while_its_teacher_samples_resumes_to_the_straight_run(
        tiny_dir, tmp_path, monkeypatch, straight, capsys):
    _accept_every_sample(monkeypatch)
    real = distillation.sample_rollouts_batch
    calls = []

    def sampler(*args, **kwargs):  # SIGTERM to this process as the third batch starts
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)
    monkeypatch.setattr(distillation, "sample_rollouts_batch", sampler)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as end:
        _ch09(_argv(tiny_dir, out))
    assert end.value.code == EXIT_STOPPED
    assert "stopped by SIGTERM before the student's training" in capsys.readouterr().out
    assert (out / STOPPED_FILE).read_text() == "75\n"
    data = json.loads((out / "data.json").read_text())
    assert data["teacher_accuracy"] is not None  # evaluated before the stop: not again
    assert json.loads((out / "config.json").read_text())["steps"] == 3
    assert len((out / "traces.partial.jsonl").read_text().splitlines()) == 3  # header + 2
    assert not (out / "traces.jsonl").exists()
    monkeypatch.setattr(distillation, "sample_rollouts_batch", real)
    _accept_every_sample(monkeypatch)
    evaluated = []
    monkeypatch.setattr(distillation_cli, "evaluate_policy",
                        lambda *a, **k: evaluated.append(1))
    _check_resumes_to(out, straight)
    assert evaluated == []  # the teacher's accuracy was kept, not evaluated again
    assert json.loads((out / "summary.json").read_text())["teacher_accuracy"] == \
        data["teacher_accuracy"]


# Rank 0 samples the teacher while rank 1 waits; at rank 0's 2nd decode call of the sampling
# (its first batch of 6 new tokens), rank 1 alone is sent SIGTERM (as a scheduler might signal
# one node). The decode loops poll every 16 tokens: here at each batch's first token. Rank 1
# sits in a poll's all-reduce when the signal lands and sees it when that poll returns, so its
# stop reaches the next poll or the one after: batch 2's or batch 3's first token.
WORKER = r'''
import os, runpy, signal, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])  # tests/: the helper that accepts every sample
import pytest
from test_distillation import _accept_every_sample
from reasoning_from_scratch import distillation, generation
rank, pids = os.environ["RANK"], Path(sys.argv[2])
(pids / f"pid{rank}").write_text(str(os.getpid()))
with pytest.MonkeyPatch.context() as mp:
    _accept_every_sample(mp)
    sampling, calls = [False], [0]
    real_sampler, real_decode = distillation.sample_rollouts_batch, generation._decode_logits
    def sampler(*args, **kwargs):
        sampling[0] = True
        return real_sampler(*args, **kwargs)
    def decode(*args, **kwargs):
        if sampling[0]:
            calls[0] += 1
            if calls[0] == 2:
                os.kill(int((pids / "pid1").read_text()), signal.SIGTERM)
        return real_decode(*args, **kwargs)
    mp.setattr(distillation, "sample_rollouts_batch", sampler)
    mp.setattr(generation, "_decode_logits", decode)
    runpy.run_path(sys.argv[3], run_name="ch09")["main"](sys.argv[4:])
'''


def test_two_processes_stop_while_rank_0_samples_when_the_other_is_signalled(
        tiny_dir, tmp_path, monkeypatch, straight):
    out = tmp_path / "run"
    (tmp_path / "worker.py").write_text(WORKER)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", str(tmp_path / "worker.py"), str(ROOT / "tests"), str(tmp_path),
           str(ROOT / "chapters" / "ch09_distill.py"), *_argv(tiny_dir, out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    assert f"exitcode: {EXIT_STOPPED}" in proc.stderr, proc.stderr[-8000:]  # torchrun fails
    assert "stopped by SIGTERM before the student's training" in proc.stdout
    assert (out / STOPPED_FILE).read_text() == "75\n"
    batches = len((out / "traces.partial.jsonl").read_text().splitlines()) - 1
    assert batches in (1, 2)  # stopped at batch 2's or 3's first poll, of 3 batches
    _accept_every_sample(monkeypatch)
    _check_resumes_to(out, straight)
