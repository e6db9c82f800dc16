"""Runs that lose nothing: Ctrl-C and the stop signals (SIGTERM, SIGHUP, SIGUSR1) at every
phase, a second signal while saving, a checkpoint write that fails (full disk), moved runs,
reused directories, bad flags, the NaN guard and corrupt checkpoints (tiny random model, CPU).
Signals sent from outside the process, torchrun's SIGTERM and SIGKILL: test_preemption.py."""

import importlib.util
import json
import os
import shutil
import signal
import warnings
from pathlib import Path

import pytest
import torch

from reasoning_from_scratch import checkpoints, files, run_dir, training
from reasoning_from_scratch.checkpoints import (
    CheckpointWriteError,
    checkpoint_problem,
    find_checkpoint,
)
from reasoning_from_scratch.interrupts import StopSignal, defer_interrupts
from reasoning_from_scratch.run_log import MetricsLog, read_metrics, truncate_samples
from reasoning_from_scratch.training import TIMING_COLUMNS, GRPOConfig, train_grpo
from reasoning_from_scratch.weights import load_pretrained, save_pretrained

ROOT = Path(__file__).resolve().parents[1]
TRAIN = [{"problem": f"{a}+{b}", "answer": str(a + b)} for a, b in [(2, 3), (4, 5), (6, 7), (8, 9)]]
HELD_OUT = [{"problem": "3+4", "answer": "7"}, {"problem": "5+6", "answer": "11"}]


def _config(out, **kw):
    """4 steps, evaluation and a checkpoint every 2, two inner epochs and a KL reference."""
    base = dict(steps=4, lr=1e-2, warmup_steps=1, prompts_per_step=2, num_rollouts=4,
                max_new_tokens=5, eval_every=2, eval_examples=2, eval_batch_size=2,
                sample_every=1, checkpoint_every=2, seed=3, output_dir=str(out), progress=False,
                inner_epochs=2, beta=0.05)
    return GRPOConfig(**{**base, **kw})


def _train(tiny_dir, config, reward, resume_from=None, hook=None, **kw):
    model, tok = load_pretrained(tiny_dir, device="cpu")
    return train_grpo(model, tok, TRAIN, HELD_OUT, "cpu", config, resume_from=resume_from,
                      reward_fn=reward, phase_hook=hook, **kw)


def _outcome(run_dir):
    """What must not differ between an interrupted+resumed run and an uninterrupted one."""
    rows = [{k: v for k, v in r.items() if k not in TIMING_COLUMNS}
            for r in read_metrics(run_dir / "metrics.csv")]
    weights = load_pretrained(run_dir / "final", device="cpu")[0].state_dict()
    samples = (run_dir / "samples.jsonl").read_text()
    summary = json.loads((run_dir / "summary.json").read_text())
    summary = {k: v for k, v in summary.items() if k not in ("wall_seconds", "output_dir")}
    return rows, weights, samples, summary


@pytest.fixture(scope="module")
def straight(tiny_dir, tmp_path_factory, even_reward):
    """The uninterrupted run everything is compared with."""
    out = tmp_path_factory.mktemp("straight") / "run"
    _train(tiny_dir, _config(out), even_reward)
    return _outcome(out)


def interrupt_at(phase, step, sig=signal.SIGINT):
    """A phase hook that sends this process a real signal (SIGINT: Ctrl-C) when `phase` of
    `step` starts."""
    def hook(p, s):
        if (p, s) == (phase, step):
            os.kill(os.getpid(), sig)
    return hook


# phase, step at which Ctrl-C arrives -> updates the checkpoint must hold
PHASES = [("base_eval", 0, 0), ("rollouts", 3, 2), ("update", 2, 2), ("eval", 2, 2),
          ("checkpoint", 2, 2), ("update", 4, 4), ("final_eval", 4, 4), ("final_save", 4, 4)]
# Ctrl-C and SIGTERM at every phase, SIGHUP and SIGUSR1 (SLURM's warning) at two
SIGNAL_CASES = [(sig, *case) for sig in (signal.SIGINT, signal.SIGTERM) for case in PHASES] + [
    (signal.SIGHUP, "update", 2, 2), (signal.SIGUSR1, "rollouts", 3, 2)]


@pytest.mark.parametrize("sig,phase,step,holds", SIGNAL_CASES,
                         ids=[f"{c[0].name}-{c[1]}-{c[2]}" for c in SIGNAL_CASES])
def test_a_signal_at_any_phase_then_resume_equals_the_uninterrupted_run(
        tiny_dir, tmp_path, even_reward, straight, sig, phase, step, holds):
    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt) as stop:
        _train(tiny_dir, _config(out), even_reward, hook=interrupt_at(phase, step, sig))
    assert isinstance(stop.value, StopSignal) == (sig != signal.SIGINT)
    assert getattr(stop.value, "signum", signal.SIGINT) == sig
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers restored
    ckpt = find_checkpoint(out)
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["step"] == holds  # labelled with the updates its weights contain
    rows, weights, samples, summary = straight
    written = read_metrics(out / "metrics.csv")
    assert [r["step"] for r in written][:holds] == [float(s) for s in range(1, holds + 1)]
    _train(tiny_dir, _config(out), even_reward, resume_from=out)
    rows2, weights2, samples2, summary2 = _outcome(out)
    assert rows2 == rows  # rows neither lost nor duplicated, evaluations in place
    assert samples2 == samples
    assert summary2 == summary
    assert all(torch.equal(weights[k], weights2[k]) for k in weights)


def test_a_second_signal_while_saving_leaves_a_whole_checkpoint(tiny_dir, tmp_path,
                                                               even_reward, monkeypatch):
    real, calls = checkpoints.save_checkpoint, []

    def save_under_fire(*args, **kwargs):  # SIGTERM again, then Ctrl-C, during the stop's save
        calls.append(args[0])
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        return real(*args, **kwargs)

    monkeypatch.setattr(run_dir, "save_checkpoint", save_under_fire)
    out = tmp_path / "run"
    with pytest.raises(StopSignal):
        _train(tiny_dir, _config(out, checkpoint_every=0), even_reward,
               hook=interrupt_at("rollouts", 3, signal.SIGTERM))
    assert calls == [out / "checkpoint-2"]  # saved once, to the end
    assert checkpoint_problem(out / "checkpoint-2") is None
    assert not list(out.glob("*.tmp")) and not list(out.glob("*.old"))


def test_a_failed_checkpoint_write_keeps_the_previous_one_and_resumes_exactly(
        tiny_dir, tmp_path, even_reward, straight, monkeypatch):
    real = checkpoints.save_pretrained

    def disk_full(model, tokenizer, out_dir, **kwargs):  # half a file, then ENOSPC
        if Path(out_dir).name == "checkpoint-4.tmp":
            Path(out_dir).mkdir(parents=True)
            (Path(out_dir) / "model.safetensors").write_bytes(b"\0" * 1000)
            raise OSError(28, "No space left on device")
        return real(model, tokenizer, out_dir, **kwargs)

    monkeypatch.setattr(checkpoints, "save_pretrained", disk_full)
    out = tmp_path / "run"
    with pytest.raises(CheckpointWriteError) as err:
        _train(tiny_dir, _config(out), even_reward)
    message = str(err.value)
    assert str(out / "checkpoint-4") in message and "No space left on device" in message
    assert " free on " in message and f"--resume {out}" in message
    assert not (out / "checkpoint-4.tmp").exists()  # the half-written copy is gone
    assert find_checkpoint(out).name == "checkpoint-2"
    monkeypatch.setattr(checkpoints, "save_pretrained", real)
    _train(tiny_dir, _config(out), even_reward, resume_from=out)
    rows, weights, samples, summary = _outcome(out)
    assert rows == straight[0] and samples == straight[2] and summary == straight[3]
    assert all(torch.equal(weights[k], straight[1][k]) for k in weights)


def test_deferred_interrupt_raises_after_the_block():
    done = []
    with pytest.raises(KeyboardInterrupt):
        with defer_interrupts():
            os.kill(os.getpid(), signal.SIGINT)
            done.append("finished")  # still runs: the interrupt waits for the block's end
    assert done == ["finished"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_new_run_never_clobbers_an_existing_one(tiny_dir, tmp_path, even_reward):
    out = tmp_path / "run"
    _train(tiny_dir, _config(out, steps=2, beta=0.0), even_reward)
    before = (out / "metrics.csv").read_text()
    with pytest.raises(FileExistsError, match="--resume"):
        _train(tiny_dir, _config(out, steps=2, beta=0.0), even_reward)
    assert (out / "metrics.csv").read_text() == before and (out / "checkpoint-2").is_dir()
    # overwrite: the old run's checkpoints go too, so no later resume can pick a stale one
    _train(tiny_dir, _config(out, steps=1, beta=0.0, checkpoint_every=0), even_reward,
           overwrite=True)
    assert not (out / "checkpoint-2").exists()
    assert [r["step"] for r in read_metrics(out / "metrics.csv")] == [1.0]


# ----------------------------------------------------------------------------------------------
# NaN guard
# ----------------------------------------------------------------------------------------------

def test_nan_max_grad_norm_never_reaches_the_weights(tiny_dir, even_reward):
    from reasoning_from_scratch.grpo import collect_rollouts

    model, tok = load_pretrained(tiny_dir, device="cpu")
    batch = collect_rollouts(model, tok, TRAIN[:2], "cpu", even_reward, num_rollouts=4,
                             max_new_tokens=5, generator=torch.Generator().manual_seed(0))
    config = GRPOConfig()
    object.__setattr__(config, "max_grad_norm", float("nan"))  # past validation, on purpose
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    stats = training.update(model, opt, batch, None, None, config)
    assert stats["skipped"] == 1  # the clipped gradient is NaN: caught after clipping
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert not opt.state


def test_consecutive_bad_steps_stop_the_run_with_finite_weights(tiny_dir, tmp_path,
                                                               even_reward, monkeypatch):
    real = training.loss_on_batch

    def nan_loss(*args, **kwargs):
        out = real(*args, **kwargs)
        out["loss"] = out["loss"] * float("nan")
        return out

    monkeypatch.setattr(training, "loss_on_batch", nan_loss)
    out = tmp_path / "run"
    with pytest.raises(FloatingPointError, match="3 steps in a row"):
        _train(tiny_dir, _config(out, steps=10, beta=0.0, eval_every=0, checkpoint_every=0),
               even_reward)
    rows = read_metrics(out / "metrics.csv")
    assert [r["skipped"] for r in rows] == [1.0, 1.0, 1.0]
    ckpt = find_checkpoint(out)
    assert ckpt.name == "checkpoint-3" and checkpoint_problem(ckpt) is None


# ----------------------------------------------------------------------------------------------
# Corrupt checkpoints
# ----------------------------------------------------------------------------------------------

def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_corrupt_latest_checkpoint_falls_back_and_resumes_exactly(tiny_dir, tmp_path,
                                                                 even_reward, straight):
    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):  # stop after step 3 (checkpoint-2 and checkpoint-3)
        _train(tiny_dir, _config(out), even_reward, hook=interrupt_at("rollouts", 4))
    _truncate(out / "checkpoint-3" / "model.safetensors")
    with pytest.raises(ValueError, match="checkpoint-3.*truncated or corrupt"):
        load_pretrained(out / "checkpoint-3", device="cpu")
    with pytest.raises(ValueError, match="Intact checkpoints of that run: checkpoint-2"):
        find_checkpoint(out / "checkpoint-3")
    messages = []
    assert find_checkpoint(out, log=messages.append).name == "checkpoint-2"
    assert "skipping unusable checkpoint" in messages[0] and "checkpoint-3" in messages[0]
    _train(tiny_dir, _config(out), even_reward, resume_from=out)
    rows, weights, _, _ = _outcome(out)
    assert rows == straight[0]
    assert all(torch.equal(weights[k], straight[1][k]) for k in weights)


def test_truncated_trainer_state_and_nan_weights_are_named(tiny_dir, tmp_path):
    model, tok = load_pretrained(tiny_dir, device="cpu")
    with torch.no_grad():
        model.model.norm.weight[0] = float("nan")
    save_pretrained(model, tok, tmp_path / "nan")
    with pytest.warns(UserWarning, match="NaN or inf.*model.norm.weight"):
        load_pretrained(tmp_path / "nan", device="cpu")
    (tmp_path / "nan" / "trainer_state.json").write_text('{"step": 1, "config"')
    problem = checkpoint_problem(tmp_path / "nan")
    assert "trainer_state.json" in problem and "invalid JSON" in problem
    shutil.copytree(tiny_dir, tmp_path / "ok")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # finite weights load without a word
        load_pretrained(tmp_path / "ok", device="cpu")


# ----------------------------------------------------------------------------------------------
# The command line: moved runs, refusal before writing, argument validation
# ----------------------------------------------------------------------------------------------

def _script(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "chapters" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TINY_FLAGS = ["--steps", "2", "--prompts-per-step", "2", "--num-rollouts", "2",
              "--max-new-tokens", "4", "--eval-examples", "2", "--eval-every", "0",
              "--train-examples", "20", "--no-progress", "--device", "cpu"]


def test_resume_of_a_moved_run_writes_where_the_run_now_is(tiny_dir, tmp_path):
    script = _script("ch07_train")
    first, moved = tmp_path / "first", tmp_path / "moved"
    script.main(["--model", str(tiny_dir), "--output-dir", str(first), *TINY_FLAGS])
    shutil.move(first, moved)
    summary = script.main(["--resume", str(moved), "--steps", "3", "--device", "cpu"])
    assert not first.exists()  # nothing written to the old place
    assert summary["output_dir"] == str(moved.resolve())
    assert [r["step"] for r in read_metrics(moved / "metrics.csv")] == [1.0, 2.0, 3.0]
    with pytest.raises(SystemExit) as exc:  # a resume continues in the run's own directory
        script.main(["--resume", str(moved), "--output-dir", str(tmp_path / "elsewhere")])
    assert exc.value.code == 2


def test_cli_refuses_a_used_run_dir_before_writing(tiny_dir, tmp_path, capsys):
    script = _script("ch07_train")
    out = tmp_path / "run"
    script.main(["--model", str(tiny_dir), "--output-dir", str(out), *TINY_FLAGS])
    files = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    with pytest.raises(SystemExit) as exc:
        script.main(["--model", str(tiny_dir), "--output-dir", str(out), *TINY_FLAGS])
    assert exc.value.code == 2
    assert "--resume" in capsys.readouterr().err
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == files
    # a resume that fails to load writes nothing either
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SystemExit):
        script.main(["--resume", str(empty)])
    assert list(empty.iterdir()) == []


BAD_FLAGS = [
    ["--max-grad-norm", "nan"], ["--beta", "nan"], ["--format-reward-weight", "nan"],
    ["--temperature", "nan"], ["--lr", "0"], ["--lr", "inf"], ["--micro-batch-size", "0"],
    ["--epsilon", "-1"], ["--max-grad-norm", "0"], ["--warmup-steps", "-2"],
    ["--max-new-tokens", "-5"], ["--top-p", "1.5"], ["--num-rollouts", "1"],
    ["--train-examples", "0"], ["--threads", "-1"], ["--steps", "two"],
]


@pytest.mark.parametrize("flags", BAD_FLAGS, ids=lambda f: " ".join(f))
def test_bad_training_flags_are_one_line_argparse_errors(flags, tmp_path, capsys):
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exc:
        _script("ch07_train").main(["--output-dir", str(out), *flags])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "error: argument " + flags[0] + ":" in err[-1]
    assert not out.exists()


def test_device_this_torch_lacks_is_refused_before_writing(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exc:
        _script("ch07_train").main(["--output-dir", str(out), "--device", "cuda"])
    assert exc.value.code == 2 and "no CUDA GPU" in capsys.readouterr().err
    assert not out.exists()


def test_config_rules_hold_in_python_too():
    for bad in (dict(lr=float("nan")), dict(beta=-1.0), dict(top_p=0.0), dict(epsilon=1.5),
                dict(micro_batch_size=0), dict(temperature=0.0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            GRPOConfig(**bad)


@pytest.mark.parametrize("script,flags", [
    ("ch02_generate", ["--temperature", "-1"]), ("ch02_generate", ["--max-new-tokens", "0"]),
    ("ch03_evaluate", ["--limit", "0"]), ("ch03_evaluate", ["--top-p", "0"]),
    ("ch08_train_prm", ["--lr", "nan"]), ("ch08_process_vs_outcome", ["--eval-points", "0"]),
    ("build_tiny_model", ["--slip-prob-large", "1.5"]),
])
def test_other_scripts_validate_their_flags(script, flags, capsys, monkeypatch):
    module = _script(script)
    monkeypatch.setattr("sys.argv", [f"{script}.py", *flags])
    with pytest.raises(SystemExit) as exc:
        module.main() if script == "build_tiny_model" else module.main(flags)
    assert exc.value.code == 2
    assert "error: argument " + flags[0] in capsys.readouterr().err


def test_ch03_on_an_empty_file_says_so(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(SystemExit, match="empty.jsonl: the dataset holds no examples"):
        _script("ch03_evaluate").main(["--data-path", str(empty), "--dataset", "math500"])


# ---------------------------------------------------------------------------------------------
# metrics.csv and samples.jsonl when a write is cut short
# ---------------------------------------------------------------------------------------------

COLUMNS = ["step", "loss", "eval_accuracy"]


def test_metrics_row_cut_short_mid_write_leaves_the_previous_file(tmp_path, monkeypatch):
    """A kill while metrics.csv is written (here: half the bytes, then KeyboardInterrupt) leaves
    the file as it was, whole rows only; the row is written in full when the step is redone."""
    path = tmp_path / "metrics.csv"
    log = MetricsLog(path, COLUMNS)
    log.append({"step": 1, "loss": 0.5})
    log.append({"step": 2, "loss": 0.25})
    log.patch_last_row({"eval_accuracy": 0.75})
    before = path.read_bytes()

    class HalfWritten:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            self.f.write(data[: len(data) // 2])
            self.f.flush()
            raise KeyboardInterrupt  # the kill arrives mid-write

    real_open = open
    monkeypatch.setattr(files, "open", lambda *a, **k: HalfWritten(real_open(*a, **k)),
                        raising=False)
    with pytest.raises(KeyboardInterrupt):
        log.append({"step": 3, "loss": 0.125})
    with pytest.raises(KeyboardInterrupt):
        log.patch_last_row({"eval_accuracy": 0.0})
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.csv"]  # no temp file left over
    log.append({"step": 3, "loss": 0.125})
    assert read_metrics(path) == [
        {"step": 1.0, "loss": 0.5, "eval_accuracy": None},
        {"step": 2.0, "loss": 0.25, "eval_accuracy": 0.75},
        {"step": 3.0, "loss": 0.125, "eval_accuracy": None}]


def test_a_truncated_last_metrics_line_is_dropped_with_a_warning(tmp_path):
    """A file from an append cut short (before writes were atomic): the cut-off row of step 13
    reads "1", which must not come back as a second step 1 on resume after step 2."""
    path = tmp_path / "metrics.csv"
    path.write_text("step,loss,eval_accuracy\r\n1,0.5,\r\n2,0.25,0.75\r\n1", newline="")
    with pytest.warns(UserWarning, match="metrics.csv: dropped a truncated last line"):
        assert [r["step"] for r in read_metrics(path)] == [1.0, 2.0]
    with pytest.warns(UserWarning, match="truncated"):
        log = MetricsLog(path, COLUMNS, keep_upto=2)
    assert path.read_text() == "step,loss,eval_accuracy\n1,0.5,\n2,0.25,0.75\n"
    log.append({"step": 3, "loss": 0.125})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a whole file reads without a warning
        assert [r["step"] for r in read_metrics(path)] == [1.0, 2.0, 3.0]


def test_truncate_samples_drops_a_half_written_last_line(tmp_path):
    path = tmp_path / "samples.jsonl"
    path.write_text('{"step": 1, "text": "a"}\n{"step": 2, "text": "b"}\n{"step": 3, "te')
    with pytest.warns(UserWarning, match="samples.jsonl: dropped a truncated last line"):
        truncate_samples(path, 2)
    assert path.read_text() == '{"step": 1, "text": "a"}\n{"step": 2, "text": "b"}\n'


def test_the_temp_file_of_a_killed_write_is_removed_when_the_run_opens_again(tmp_path):
    (tmp_path / "metrics.csv").write_text("step\n1\n")
    stale = tmp_path / ".metrics.csv.k3j2x9.tmp"  # what atomic_path leaves after a kill -9
    stale.write_text("step\n1\n2")
    (tmp_path / "notes.tmp").write_text("not ours")  # not an atomic_path name: kept
    assert files.remove_stale_temp_files(tmp_path) == [stale]
    assert not stale.exists() and (tmp_path / "notes.tmp").exists()
    assert (tmp_path / "metrics.csv").read_text() == "step\n1\n"
