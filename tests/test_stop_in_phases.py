"""A stop signal that lands in the middle of a rollout or evaluation phase: the decode loops
(eager and static) look at the run's stop every STOP_CHECK_EVERY tokens, every process of a
data-parallel run agrees on it at the same look (`distributed.AgreedStop`), and the run saves
its last finished update, writes `stopped` and resumes to the uninterrupted run's weights
(tiny random model, CPU, Gloo)."""

import json
import os
import runpy
import signal
from datetime import timedelta
from functools import partial
from pathlib import Path

import pytest
import torch
from tolerance import assert_trained_alike, max_diff, saved_weights

from reasoning_from_scratch import distributed, generation
from reasoning_from_scratch.checkpoints import STOPPED_FILE, read_trainer_state
from reasoning_from_scratch.interrupts import InterruptFlag, StopSignal, polling_stops
from reasoning_from_scratch.qwen3 import Qwen3Model, tiny_config
from reasoning_from_scratch.rewards import CompositeReward, RewardTerm
from reasoning_from_scratch.training import GRPOConfig, train_grpo
from reasoning_from_scratch.weights import load_pretrained

N = generation.STOP_CHECK_EVERY
TRAIN = [{"problem": f"{a}+{b}", "answer": str(a + b)} for a, b in [(2, 3), (4, 5), (6, 7), (8, 9)]]
HELD_OUT = [{"problem": "3+4", "answer": "7"}, {"problem": "5+6", "answer": "11"}]
NEW_TOKENS = 40  # the random tiny model rarely ends early: about 40 decode calls per phase
SIGNAL_AT = 5  # the decode call of step 2's rollouts at which SIGTERM is sent


class CountingPoll:
    """A StopPoll that counts its calls and raises a stop at its `stop_at`-th poll."""

    def __init__(self, stop_at=None):
        self.polls, self.settles, self.stop_at = 0, 0, stop_at

    def poll(self):
        self.polls += 1
        if self.polls == self.stop_at:
            raise StopSignal(signal.SIGTERM)

    def settle(self):
        self.settles += 1


def _model():
    torch.manual_seed(0)
    return Qwen3Model(tiny_config(vocab_size=50, hidden_size=16, intermediate_size=32,
                                  num_attention_heads=2, num_key_value_heads=1,
                                  head_dim=8)).eval()


def _generate(model, static, monkeypatch):
    """40 greedy tokens, no EOS; `static`: the compiled loop's code, run eagerly (the step is
    not compiled here: the loop around it is what polls)."""
    if static:
        monkeypatch.setattr(generation, "_compiled_step",
                            lambda m, device: partial(generation._static_step, m))
    return generation.generate(model, torch.tensor([[1, 2, 3]]), max_new_tokens=NEW_TOKENS,
                               compile=static)


@pytest.mark.parametrize("static", [False, True])
def test_both_decode_loops_poll_every_n_tokens(monkeypatch, static):
    model, poll = _model(), CountingPoll()
    with polling_stops(poll):
        out = _generate(model, static, monkeypatch)
    assert out.completion_ids.shape[1] == NEW_TOKENS
    assert poll.polls == len(range(0, NEW_TOKENS, N)) == 3  # tokens 0, 16, 32
    assert poll.settles == 1  # the block ends by settling
    calls = []
    monkeypatch.setattr(model, "decode_static" if static else "forward",
                        partial(lambda f, *a, **k: calls.append(1) or f(*a, **k),
                                getattr(model, "decode_static" if static else "forward")))
    with pytest.raises(StopSignal), polling_stops(CountingPoll(stop_at=2)):
        _generate(model, static, monkeypatch)
    # stopped at token 16: static steps 1-15; eager: the prefill and a forward after 0-15
    assert len(calls) == (N - 1 if static else N + 1)
    _generate(model, static, monkeypatch)  # outside a block nothing polls


def _poll_worker(rank_, init_file, out_dir):
    """Rank 0 polls 5 times, rank 1 twice; then rank 1's flag is set at its second poll; then
    both flags are set before one poll. Polls that fail to pair up fail in 60 s, not hang."""
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank_,
                                         world_size=2, timeout=timedelta(seconds=60))
    try:
        flag = InterruptFlag()
        with polling_stops(distributed.agreed_stop(flag)):
            for _ in range(5 if rank_ == 0 else 2):
                generation.poll_for_stop()
            summed = distributed.all_reduce_sum([rank_ + 1])  # settles first, then pairs up
        stopped_at = None
        try:
            with polling_stops(distributed.agreed_stop(flag)):
                for i in range(1, 10):
                    if rank_ == 1 and i == 2:
                        flag.set(signal.SIGTERM)
                    generation.poll_for_stop()
        except StopSignal as stop:
            stopped_at = (i, stop.signum)
        both, both_stopped = InterruptFlag(), None  # every process signalled (a scheduler's
        try:  # SIGTERM to all its tasks)
            with polling_stops(distributed.agreed_stop(both)):
                both.set(signal.SIGTERM)
                generation.poll_for_stop()
        except StopSignal as stop:
            both_stopped = stop.signum
        Path(out_dir, f"{rank_}.json").write_text(json.dumps([summed, stopped_at,
                                                              both_stopped]))
    finally:
        distributed.shutdown_distributed()


def test_two_processes_pair_their_polls_and_stop_at_the_same_one(tmp_path):
    torch.multiprocessing.spawn(_poll_worker, args=(str(tmp_path / "init"), str(tmp_path)),
                                nprocs=2)
    for r in (0, 1):
        summed, stopped_at, both_stopped = json.loads((tmp_path / f"{r}.json").read_text())
        assert summed == [3.0]  # the sum met its partner after rank 1's settling polls
        assert stopped_at == [2, int(signal.SIGTERM)]  # both ranks, at the same poll
        assert both_stopped == int(signal.SIGTERM)  # two SIGTERMs agree on SIGTERM


def _config(out, steps=3):
    return GRPOConfig(steps=steps, lr=1e-2, warmup_steps=1, prompts_per_step=2, num_rollouts=2,
                      max_new_tokens=NEW_TOKENS, eval_every=0, eval_examples=2,
                      eval_batch_size=2, sample_every=1, checkpoint_every=0,
                      checkpoint_minutes=0, seed=3, output_dir=str(out), progress=False)


def _even(text, ids, prompt_len, example):
    gen = ids[prompt_len:]
    return float((gen % 2 == 0).float().mean()) if gen.numel() else 0.0


REWARD = CompositeReward([RewardTerm("correct", _even)])


def _train_counting(tiny_dir, out, signal_me: bool, resume_from=None) -> dict:
    """A run whose step 2 rollouts send this process SIGTERM at decode call SIGNAL_AT (if
    `signal_me`); returns how it ended and the decode calls of that phase."""
    seen = {"phase": None, "calls": 0, "sent": None}
    real = generation._decode_logits

    def counted(*args, **kwargs):
        if seen["phase"] == ("rollouts", 2):
            seen["calls"] += 1
            if signal_me and seen["calls"] == SIGNAL_AT:
                seen["sent"] = seen["calls"]
                os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    def hook(phase, step):
        seen["phase"] = (phase, step)

    generation._decode_logits = counted
    # float64: two processes then make the one-process run far beyond rounding (tolerance.py)
    model, tok = load_pretrained(tiny_dir, device="cpu", dtype=torch.float64)
    try:
        train_grpo(model, tok, TRAIN, HELD_OUT, "cpu", _config(out), resume_from=resume_from,
                   reward_fn=REWARD, phase_hook=hook)
        seen["end"] = "finished"
    except StopSignal as stop:
        seen["end"] = str(stop)
    finally:
        generation._decode_logits = real
    return seen


def _run_worker(rank_, init_file, tiny_dir, out, result_dir):
    """One of two Gloo processes training together; rank 1 alone gets the SIGTERM."""
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank_,
                                         world_size=2)
    try:
        seen = _train_counting(tiny_dir, Path(out), signal_me=rank_ == 1)
        Path(result_dir, f"{rank_}.json").write_text(json.dumps(seen))
    finally:
        distributed.shutdown_distributed()


def _weights(run_dir):
    return saved_weights(run_dir / "final")  # as saved: float64


@pytest.fixture(scope="module")
def straight(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("straight") / "run"
    assert _train_counting(tiny_dir, out, signal_me=False)["end"] == "finished"
    return _weights(out)


def _check_stopped_and_resume(tiny_dir, out, straight, exact: bool):
    assert (out / STOPPED_FILE).read_text() == "75\n"
    assert read_trainer_state(out / "checkpoint-1")["step"] == 1  # the last finished update
    load_pretrained(out / "checkpoint-1", device="cpu")  # loadable
    assert _train_counting(tiny_dir, out, signal_me=False, resume_from=out)["end"] == "finished"
    resumed = _weights(out)
    if exact:
        assert max_diff(resumed, straight) == 0.0
    else:  # up to float summation order
        assert_trained_alike(resumed, straight, saved_weights(tiny_dir, torch.float64))


def test_one_process_stops_inside_its_rollouts_and_resumes_exactly(tiny_dir, tmp_path,
                                                                    straight):
    out = tmp_path / "run"
    seen = _train_counting(tiny_dir, out, signal_me=True)
    assert seen["end"] == "stopped by SIGTERM"
    assert seen["calls"] == seen["sent"]  # one process raises where the signal lands
    _check_stopped_and_resume(tiny_dir, out, straight, exact=True)


def test_two_processes_stop_inside_their_rollouts_when_one_is_signalled(tiny_dir, tmp_path,
                                                                       straight):
    out = tmp_path / "run"
    torch.multiprocessing.spawn(_run_worker, args=(str(tmp_path / "init"), str(tiny_dir),
                                                   str(out), str(tmp_path)), nprocs=2)
    seen = [json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1)]
    assert [s["end"] for s in seen] == ["stopped by SIGTERM"] * 2  # rank 0 was never signalled
    assert seen[1]["sent"] == SIGNAL_AT
    # rank 1 decoded on to its next look at the stop (token 16), rank 0 to the same look
    assert [s["calls"] for s in seen] == [N, N]  # a decode call after each of tokens 0-15
    assert N < NEW_TOKENS - 1  # the phase was abandoned, not finished
    # 2 processes make the 1-process run up to float summation order
    _check_stopped_and_resume(tiny_dir, out, straight, exact=False)


def test_bench_stop_tiny_run(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "benchmarks"))  # bench_fsdp
    main = runpy.run_path(str(Path(__file__).parents[1] / "benchmarks" / "bench_stop.py"),
                          run_name="bench_stop")["main"]
    out = main(["--model", "tiny", "--delay", "0", "--max-new-tokens", "64",
                "--num-rollouts", "2"])
    for r in out["results"]:
        assert 0 <= r["abandoned_s"] <= r["saved_s"]
        assert (r["exit_status_file"], r["checkpoint_step"]) == ("75", 0)
    assert [r["processes"] for r in out["results"]] == [1, 2]
