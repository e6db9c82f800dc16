"""Runs that survive the scheduler: a stop signal sent from outside to a training process (and
to torchrun) saves a checkpoint that resumes exactly, with exit status 75; a SIGKILL loses at
most the checkpoint interval; a run killed before its first checkpoint restarts in place; a
full disk stops the command with one line; the checkpoint policy and the signal names."""

import errno
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError
from test_distributed import WORKER

from reasoning_from_scratch import checkpoints, files
from reasoning_from_scratch.checkpoints import (
    CheckpointPolicy,
    checkpoint_problem,
    find_checkpoint,
    prune_checkpoints,
    read_trainer_state,
)
from reasoning_from_scratch.cli import train as training_cli
from reasoning_from_scratch.interrupts import (
    EXIT_STOPPED,
    StopSignal,
    defer_interrupts,
    exit_on_stop,
    exit_status,
    parse_stop_signals,
    stop_signals_raise,
)
from reasoning_from_scratch.run_log import read_metrics
from reasoning_from_scratch.training import TIMING_COLUMNS, GRPOConfig
from reasoning_from_scratch.weights import load_pretrained

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 120  # a tiny run here takes a few seconds; one still going after this is stuck

# The audited torchrun worker of test_distributed.py runs ch07_train.py in one plain process
# too (RANK=0): with STOP_AT "0,phase,step,file" it creates the file when that phase starts and
# waits until a stop signal reaches the process (the test sends it from outside, so the run
# stops where that signal lands, deterministically).

FLAGS = ["--steps", "4", "--prompts-per-step", "2", "--num-rollouts", "2",
         "--max-new-tokens", "4", "--eval-examples", "2", "--eval-every", "2",
         "--eval-batch-size", "2", "--train-examples", "20", "--sample-every", "1",
         "--checkpoint-every", "2", "--beta", "0.05", "--inner-epochs", "2", "--lr", "1e-2",
         "--no-progress", "--device", "cpu", "--threads", "1"]
# The bundled model on level 1-2 problems: its rollouts earn unequal rewards, so the updates
# are real and a resume that lost or repeated one would change the weights.
LEARNING = [*FLAGS, "--model", "tiny-arith", "--train-level-weights", "1,1,0,0,0",
            "--num-rollouts", "4", "--max-new-tokens", "24", "--lr", "1e-3"]
EVERY_STEP = [*FLAGS[:FLAGS.index("--checkpoint-every")], "--checkpoint-every", "1",
              *FLAGS[FLAGS.index("--checkpoint-every") + 2:]]  # a checkpoint after every step


def _script(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "chapters" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _outcome(run_dir):
    """Metrics rows without timing columns, and the final weights."""
    rows = [{k: v for k, v in r.items() if k not in TIMING_COLUMNS}
            for r in read_metrics(run_dir / "metrics.csv")]
    return rows, load_pretrained(run_dir / "final", device="cpu")[0].state_dict()


def _same(a, b):
    rows_a, w_a = a
    rows_b, w_b = b
    return rows_a == rows_b and all(torch.equal(w_a[k], w_b[k]) for k in w_a)


def _wait_for(path_or_fn, proc, what):
    """Poll until a file exists (or fn() is true) while `proc` runs; fail if it ends first."""
    check = path_or_fn if callable(path_or_fn) else Path(path_or_fn).exists
    deadline = time.time() + TIMEOUT_S
    while not check():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the run ended before {what} (exit {proc.returncode}):\n"
                        f"{out[-2000:]}\n{err[-2000:]}")
        if time.time() > deadline:
            proc.kill()
            pytest.fail(f"no {what} after {TIMEOUT_S} s")
        time.sleep(0.02)


def _finish(proc):
    try:
        return proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"still running after {TIMEOUT_S} s:\n{out[-2000:]}\n{err[-2000:]}")


@pytest.fixture(scope="module")
def cli_straight(tiny_dir, tmp_path_factory):
    """The uninterrupted command-line run the stopped ones are compared with."""
    out = tmp_path_factory.mktemp("straight") / "run"
    _script("ch07_train").main(["--output-dir", str(out), *LEARNING])
    outcome = _outcome(out)
    base = load_pretrained("tiny-arith", device="cpu")[0].state_dict()
    assert any(not torch.equal(base[k], outcome[1][k]) for k in base)  # it learned something
    return outcome


# signal, phase, step -> updates the checkpoint holds
OUTSIDE = [(signal.SIGTERM, "update", 2, 2), (signal.SIGHUP, "eval", 2, 2),
           (signal.SIGUSR1, "rollouts", 3, 2)]


@pytest.mark.parametrize("sig,phase,step,holds", OUTSIDE,
                         ids=[f"{c[0].name}-{c[1]}-{c[2]}" for c in OUTSIDE])
def test_a_stop_signal_from_outside_saves_exits_75_and_resumes_exactly(
        tiny_dir, tmp_path, cli_straight, sig, phase, step, holds):
    out, reached = tmp_path / "run", tmp_path / "reached"
    (tmp_path / "worker.py").write_text(WORKER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": "0",
           "STOP_AT": f"0,{phase},{step},{reached}"}
    proc = subprocess.Popen(
        [sys.executable, str(tmp_path / "worker.py"), str(tmp_path / "writes-%s.txt"), str(out),
         str(ROOT / "chapters" / "ch07_train.py"), "--output-dir", str(out), *LEARNING],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for(reached, proc, f"the {phase} phase of step {step}")
    proc.send_signal(sig)
    stdout, stderr = _finish(proc)
    assert proc.returncode == EXIT_STOPPED, stderr[-2000:]
    assert f"stopped by {sig.name}: {out / f'checkpoint-{holds}'} holds {holds} update(s)" \
        in stdout
    assert "Traceback" not in stderr
    assert find_checkpoint(out).name == f"checkpoint-{holds}"
    _script("ch07_train").main(["--resume", str(out)])
    assert _same(_outcome(out), cli_straight)


def test_sigkill_loses_at_most_the_checkpoint_interval(tiny_dir, tmp_path):
    """Default settings but a 0.3 s interval (and tiny steps): kill -9 mid-run, then resume."""
    out, minutes = tmp_path / "run", 0.005
    flags = ["--model", str(tiny_dir), "--steps", "1000", "--prompts-per-step", "2",
             "--num-rollouts", "2", "--max-new-tokens", "8", "--eval-examples", "2",
             "--eval-every", "0", "--train-examples", "40", "--no-progress", "--device", "cpu",
             "--checkpoint-minutes", str(minutes)]
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "chapters" / "ch07_train.py"), "--output-dir", str(out),
         *flags], cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def trained_a_while():  # several intervals' worth of steps
        try:
            rows = read_metrics(out / "metrics.csv")
        except (FileNotFoundError, KeyError, ValueError, TypeError):
            return False
        return sum(r["step_time"] for r in rows) > 5 * 60 * minutes

    _wait_for(trained_a_while, proc, "several checkpoint intervals of training")
    proc.kill()  # SIGKILL: no handler runs
    _finish(proc)
    ckpt = find_checkpoint(out)
    kept = read_trainer_state(ckpt)["step"]
    rows = read_metrics(out / "metrics.csv")
    lost = [r for r in rows if r["step"] > kept]
    assert kept > 0 and len(list(out.glob("checkpoint-*[0-9]"))) <= 2  # keep_checkpoints=2
    # the steps since the last checkpoint took less than the interval, plus the one in progress
    assert sum(r["step_time"] for r in lost) <= 60 * minutes + max(r["step_time"] for r in rows)
    _script("ch07_train").main(["--resume", str(out), "--steps", str(kept + 2)])
    assert [r["step"] for r in read_metrics(out / "metrics.csv")] == \
        [float(s) for s in range(1, kept + 3)]
    assert not list(out.glob("*.tmp")) and not list(out.glob("*.old"))


def test_resume_of_a_run_without_a_checkpoint_starts_it_over(tiny_dir, tmp_path, capsys):
    script = _script("ch07_train")
    out = tmp_path / "run"
    script.main(["--model", str(tiny_dir), "--output-dir", str(out), *FLAGS])
    first = _outcome(out)
    for ckpt in [*out.glob("checkpoint-*"), out / "final", out / "summary.json"]:
        shutil.rmtree(ckpt) if ckpt.is_dir() else ckpt.unlink()  # as if killed early
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:  # a new run there is refused, naming both ways out
        script.main(["--model", str(tiny_dir), "--output-dir", str(out), *FLAGS])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"--resume {out}" in err and "--overwrite" in err
    script.main(["--resume", str(out)])  # its model and settings come from the run directory
    assert "holds no checkpoint (the run stopped before its first one): starting it over" \
        in capsys.readouterr().out
    assert _same(_outcome(out), first)


def test_a_full_disk_stops_the_command_with_one_line(tiny_dir, tmp_path, capsys,
                                                     monkeypatch):
    real = checkpoints.save_pretrained

    def disk_full(model, tokenizer, out_dir, **kwargs):
        if Path(out_dir).name == "checkpoint-2.tmp":
            raise OSError(28, "No space left on device")
        return real(model, tokenizer, out_dir, **kwargs)

    monkeypatch.setattr(checkpoints, "save_pretrained", disk_full)
    out = tmp_path / "run"
    script = _script("ch07_train")
    with pytest.raises(SystemExit) as exc:
        script.main(["--model", str(tiny_dir), "--output-dir", str(out), *EVERY_STEP])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 1
    assert err[-1].startswith(f"error: could not write checkpoint {out / 'checkpoint-2'} "
                              "(No space left on device; ") and " free on " in err[-1]
    assert not any("Traceback" in line for line in err)
    assert checkpoint_problem(out / "checkpoint-1") is None
    monkeypatch.setattr(checkpoints, "save_pretrained", real)
    script.main(["--resume", str(out)])
    assert [r["step"] for r in read_metrics(out / "metrics.csv")] == [1.0, 2.0, 3.0, 4.0]


def _mount_tmpfs(path, size):
    """A tmpfs of `size` bytes at `path`, or skip the test where mounting is not allowed."""
    path.mkdir(parents=True, exist_ok=True)
    if shutil.which("mount") is None:
        pytest.skip("no mount command here")
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                         capture_output=True, text=True)
    if res.returncode:
        pytest.skip(f"cannot mount a small filesystem here ({res.stderr.strip()[:80]})")


def test_a_really_full_filesystem_keeps_the_previous_checkpoint(tiny_dir, tmp_path, capsys,
                                                                monkeypatch):
    """A real small filesystem (tmpfs; root only, skipped elsewhere), filled up just before
    checkpoint-2 is written, with room left for half of checkpoint-1."""
    disk = tmp_path / "disk"
    _mount_tmpfs(disk, 16 * 2**20)
    out, script = disk / "run", _script("ch07_train")
    real = training_cli.train_grpo

    def filling(*args, **kwargs):
        def hook(phase, step):
            if (phase, step) == ("checkpoint", 2):
                size = sum(f.stat().st_size for f in (out / "checkpoint-1").rglob("*"))
                free = shutil.disk_usage(disk).free
                (disk / "ballast").write_bytes(b"\0" * (free - size // 2))
        return real(*args, phase_hook=hook, **kwargs)

    try:
        monkeypatch.setattr(training_cli, "train_grpo", filling)
        with pytest.raises(SystemExit) as exc:
            script.main(["--model", str(tiny_dir), "--output-dir", str(out), *EVERY_STEP])
        err = capsys.readouterr().err.strip().splitlines()
        assert exc.value.code == 1
        assert err[-1].startswith(f"error: could not write checkpoint {out / 'checkpoint-2'} "
                                  "(No space left on device; ") and f"free on {disk}" in err[-1]
        assert find_checkpoint(out).name == "checkpoint-1" and not list(out.glob("*.tmp"))
        assert checkpoint_problem(out / "checkpoint-1") is None
        (disk / "ballast").unlink()  # room made: the run continues
        monkeypatch.setattr(training_cli, "train_grpo", real)
        script.main(["--resume", str(out)])
        assert [r["step"] for r in read_metrics(out / "metrics.csv")] == [1.0, 2.0, 3.0, 4.0]
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def test_safetensors_write_errors_become_os_errors(tmp_path, monkeypatch):
    def full(tensors, filename, metadata=None):  # what safetensors raises on a full disk
        Path(filename).write_bytes(b"\0" * 10)
        raise SafetensorError("Error while serializing: I/O error: No space left on device "
                              "(os error 28)")

    monkeypatch.setattr(files, "save_file", full)
    with pytest.raises(OSError) as err:
        files.atomic_save_safetensors({"x": torch.zeros(3)}, tmp_path / "a.safetensors")
    assert err.value.errno == errno.ENOSPC and "a.safetensors" in str(err.value)
    assert list(tmp_path.iterdir()) == []  # the partial temp file is gone


# ----------------------------------------------------------------------------------------------
# The pieces
# ----------------------------------------------------------------------------------------------

def test_stop_signal_names_and_exit_statuses():
    assert parse_stop_signals("SIGTERM,hup, usr1") == (signal.SIGTERM, signal.SIGHUP,
                                                        signal.SIGUSR1)
    assert parse_stop_signals("none") == () and parse_stop_signals("") == ()
    for bad, why in (("SIGINT", "always handled"), ("KILL", "cannot be caught"),
                     ("SIGTREM", "unknown signal")):
        with pytest.raises(ValueError, match=why):
            parse_stop_signals(bad)
    with pytest.raises(ValueError, match="stop_signals unknown signal"):
        GRPOConfig(stop_signals="TERM,BOGUS")
    assert exit_status(StopSignal(signal.SIGTERM)) == 75
    assert exit_status(KeyboardInterrupt()) == 130

    def stopped(argv):  # an experiment script's main whose current run was stopped
        raise StopSignal(signal.SIGHUP)
    with pytest.raises(SystemExit) as exc:
        exit_on_stop(stopped, [])
    assert exc.value.code == 75
    assert str(StopSignal(signal.SIGUSR1)) == "stopped by SIGUSR1"


def test_a_stop_signal_is_deferred_like_ctrl_c_and_raised_once():
    done = []
    with stop_signals_raise("SIGTERM"):
        with pytest.raises(StopSignal):
            with defer_interrupts():
                os.kill(os.getpid(), signal.SIGTERM)
                os.kill(os.getpid(), signal.SIGTERM)
                done.append("finished")
        os.kill(os.getpid(), signal.SIGTERM)  # the run is already stopping: dropped
    assert done == ["finished"]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_checkpoint_policy_by_steps_and_by_time():
    now = [0.0]
    policy = CheckpointPolicy(every_steps=5, every_minutes=1.0, clock=lambda: now[0])
    assert not policy.due(1) and policy.due(5)
    now[0] = 59.0
    assert not policy.due(6)
    now[0] = 60.0
    assert policy.due(7)  # a minute since the start
    policy.saved()
    now[0] = 100.0
    assert not policy.due(8) and policy.due(10)
    assert not CheckpointPolicy(0, 0.0, clock=lambda: 1e9).due(10)  # both off


def test_prune_keeps_the_latest_k_and_final(tmp_path):
    for name in ("checkpoint-1", "checkpoint-2", "checkpoint-3", "checkpoint-9", "final",
                 "checkpoint-4.tmp", "checkpoint-3.old"):
        (tmp_path / name).mkdir()
    removed = prune_checkpoints(tmp_path, keep=2, upto=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "checkpoint-2", "checkpoint-3", "checkpoint-9", "final"]  # 9: past the resumed step
    assert {p.name for p in removed} == {"checkpoint-1", "checkpoint-4.tmp", "checkpoint-3.old"}
    prune_checkpoints(tmp_path, keep=0, upto=9)  # 0 keeps every checkpoint
    assert len(list(tmp_path.iterdir())) == 4
