"""The run directory's life cycle (`run_dir.RunDir`) shared by the GRPO and distillation loops:
one checkpoint per state, a loop's own bookkeeping in it, and what a stop leaves behind."""

import os
import signal

import pytest
import torch

from reasoning_from_scratch import run_dir
from reasoning_from_scratch.checkpoints import STOPPED_FILE, read_trainer_state
from reasoning_from_scratch.distillation_training import DistillConfig, _DistillRun
from reasoning_from_scratch.interrupts import StopSignal
from reasoning_from_scratch.run_dir import StepRun
from reasoning_from_scratch.training import GRPOConfig, plot_columns
from reasoning_from_scratch.weights import load_pretrained


@pytest.fixture
def tiny():
    torch.manual_seed(0)
    model, tok = load_pretrained("tiny-arith", device="cpu")
    return model, tok, torch.optim.AdamW(model.parameters(), lr=1e-3)


def test_a_state_already_saved_is_not_written_again(tiny, tmp_path, monkeypatch):
    model, tok, opt = tiny
    writes = []
    real = run_dir.save_checkpoint
    monkeypatch.setattr(run_dir, "save_checkpoint",
                        lambda path, *a, **k: writes.append(path.name) or real(path, *a, **k))
    config = GRPOConfig(output_dir=str(tmp_path), keep_checkpoints=0, progress=False)
    run = StepRun(tmp_path, model, tok, opt, config, ["step"], plot_columns(config))
    run.completed = 3
    assert run.checkpoint() == run.checkpoint() == tmp_path / "checkpoint-3"
    run.eval_pending = True  # a new state: saved again, to the same place
    run.checkpoint()
    run.checkpoint("final")
    assert writes == ["checkpoint-3", "checkpoint-3", "final"]


def test_a_distillation_checkpoint_keeps_its_training_seconds(tiny, tmp_path):
    model, tok, opt = tiny
    config = DistillConfig(output_dir=str(tmp_path), keep_checkpoints=0, progress=False)
    run = _DistillRun(tmp_path, model, tok, opt, config)
    run.completed, run.train_seconds, run.base = 2, 12.5, {"accuracy": 0.25}
    state = read_trainer_state(run.checkpoint())
    assert (state["step"], state["train_seconds"], state["base"]) == (2, 12.5, {"accuracy": 0.25})
    assert list(state)[-2:] == ["output_dir", "world_size"]


def test_a_stop_leaves_a_checkpoint_and_the_exit_status(tiny, tmp_path, capsys):
    model, tok, opt = tiny
    config = GRPOConfig(output_dir=str(tmp_path), keep_checkpoints=0, progress=False)
    run = StepRun(tmp_path, model, tok, opt, config, ["step"], plot_columns(config))
    run.completed = 1
    with pytest.raises(StopSignal), run.stoppable():
        raise StopSignal(signal.SIGTERM)
    assert read_trainer_state(tmp_path / "checkpoint-1")["step"] == 1
    assert (tmp_path / STOPPED_FILE).read_text() == "75\n"  # EXIT_STOPPED: requeue
    assert f"continue with --resume {tmp_path}" in capsys.readouterr().out


def test_a_signal_between_decode_loops_stops_at_the_end_of_the_teacher_phase(monkeypatch):
    """`stoppable_before_run` with several processes: a stop signal is recorded, not raised
    where it lands, and one that came outside a decode loop's poll raises as the block ends
    (`stop_if_interrupted`, agreed by every process)."""
    monkeypatch.setattr(run_dir, "world_size", lambda: 2)  # record signals, as N processes do
    monkeypatch.setattr(run_dir, "agreed_stop", lambda flag: None)  # no group: nothing polls
    reached = []
    with pytest.raises(StopSignal) as stop, run_dir.stoppable_before_run("SIGTERM"):
        os.kill(os.getpid(), signal.SIGTERM)
        reached.append("after the signal")  # recorded, the work goes on
    assert reached == ["after the signal"] and stop.value.signum == signal.SIGTERM
