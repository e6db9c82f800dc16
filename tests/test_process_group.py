"""Joining and leaving the process group (distributed.py, cli/launch.py): the backend follows the
device (NCCL for CUDA, with or without torchrun), --dist-timeout-minutes reaches
init_process_group, `shutdown_distributed` waits for the other process before it leaves (and
gives up on one that never comes), and benchmarks/exit_races.py runs and classifies."""

import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from reasoning_from_scratch import distributed
from reasoning_from_scratch.cli import launch
from reasoning_from_scratch.cli.distill import parse_distill_args
from reasoning_from_scratch.cli.train import parse_train_args
from reasoning_from_scratch.training import GRPOConfig

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def recorded(monkeypatch):
    """Every init_process_group call's (args, kwargs); the real call still happens unless a
    test says otherwise. The group is left afterwards."""
    calls, real = [], dist.init_process_group

    def record(*args, **kwargs):
        calls.append((args, kwargs))
        return real(*args, **kwargs)
    monkeypatch.setattr(dist, "init_process_group", record)
    yield calls
    if dist.is_initialized():
        dist.destroy_process_group()


def test_the_backend_follows_the_device():
    assert distributed.backend_for("cuda") == "nccl"
    assert distributed.backend_for(torch.device("cuda", 1)) == "nccl"
    assert distributed.backend_for("cpu") == "gloo"


def test_a_group_of_one_gets_the_timeout(recorded):
    assert distributed.init_distributed("cpu") == torch.device("cpu")  # no torchrun: no group
    assert recorded == [] and not distributed.is_distributed()
    distributed.init_distributed("cpu", timeout_minutes=7, group_of_one=True)
    (args, kwargs), = recorded
    assert args == ("gloo",) and kwargs["timeout"] == timedelta(minutes=7)
    assert distributed.world_size() == 1
    with pytest.raises(ValueError, match="timeout must be positive"):
        distributed.init_distributed("cpu", timeout_minutes=0, group_of_one=True)


def test_cuda_without_torchrun_joins_nccl(monkeypatch):
    """--fsdp with plain python on a GPU: a group of one over NCCL (not Gloo), on GPU 0."""
    calls = []
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: calls.append((a, k)))
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(d))
    for name in distributed.TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)
    device = distributed.init_distributed("cuda", timeout_minutes=3, group_of_one=True)
    assert device == torch.device("cuda", 0)
    assert calls[0] == device and calls[1][0] == ("nccl",)
    assert calls[1][1]["timeout"] == timedelta(minutes=3) and calls[1][1]["world_size"] == 1


def test_torchrun_on_cuda_joins_nccl_with_the_timeout(monkeypatch):
    calls = []
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: calls.append((a, k)))
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(d))
    for name, value in zip(distributed.TORCHRUN_ENV, ("1", "2", "1", "localhost", "29500")):
        monkeypatch.setenv(name, value)
    assert distributed.init_distributed("cuda", timeout_minutes=45) == torch.device("cuda", 1)
    assert calls[1] == (("nccl",), {"timeout": timedelta(minutes=45)})


@pytest.mark.parametrize("script", ["train", "distill"])
def test_the_timeout_flag_reaches_init_process_group(script, recorded, tmp_path):
    argv = ["--output-dir", str(tmp_path / "run"), "--fsdp", "--dist-timeout-minutes", "12.5",
            "--device", "cpu"]
    run = (parse_train_args(argv, "t", GRPOConfig(), "ch07") if script == "train"
           else parse_distill_args(argv, "d"))
    assert run.dist_timeout_minutes == 12.5
    seen = launch.run_in_process_group(lambda r, device: distributed.world_size(), run, "x.py")
    assert seen == 1  # the work ran inside a group of one (--fsdp without torchrun)
    assert recorded[0][1]["timeout"] == timedelta(minutes=12.5)
    assert not distributed.is_distributed()  # left on the way out


def test_a_bad_timeout_exits_with_argparse_status(tmp_path, capsys):
    run = parse_train_args(["--output-dir", str(tmp_path / "r"), "--dist-timeout-minutes", "0",
                            "--fsdp", "--device", "cpu"], "t", GRPOConfig(), "ch07")
    with pytest.raises(SystemExit) as exit_:
        launch.run_in_process_group(lambda r, d: None, run, "x.py")
    assert exit_.value.code == 2 and "timeout must be positive" in capsys.readouterr().err


def _leaving_worker(rank_, init_file, out_dir, late_s, absent):
    """Rank 1 arrives `late_s` seconds late (or, `absent`, never calls shutdown); each rank
    writes when it called shutdown_distributed and when it returned from it."""
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank_,
                                         world_size=2)
    if rank_ == 1:
        time.sleep(late_s)
        if absent:  # does not come (stuck elsewhere): rank 0 must not wait for it forever
            time.sleep(6.0)
            torch.distributed.destroy_process_group()
            return
    start = time.time()
    distributed.shutdown_distributed(timeout_s=2.0)
    Path(out_dir, f"{rank_}.txt").write_text(f"{start} {time.time()}")


def _times(tmp_path, rank_):
    return [float(x) for x in (tmp_path / f"{rank_}.txt").read_text().split()]


def test_shutdown_waits_for_the_other_process(tmp_path):
    torch.multiprocessing.spawn(_leaving_worker, args=(str(tmp_path / "init"), str(tmp_path),
                                                       1.0, False), nprocs=2)
    (start0, left0), (start1, _) = _times(tmp_path, 0), _times(tmp_path, 1)
    assert left0 >= start1  # rank 0 left only once rank 1 had come to leave too
    assert start1 - start0 > 0.5  # rank 1 was late


def test_shutdown_gives_up_on_a_process_that_never_comes(tmp_path):
    torch.multiprocessing.spawn(_leaving_worker, args=(str(tmp_path / "init"), str(tmp_path),
                                                       0.0, True), nprocs=2)
    start0, left0 = _times(tmp_path, 0)
    assert 1.5 < left0 - start0 < 20  # waited its 2 s, then left alone
    assert not (tmp_path / "1.txt").exists()


def test_exit_races_counts_aborts_and_runs_each_target_once():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import exit_races
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    done = subprocess.CompletedProcess
    assert exit_races.classify(done([], 0, "", "")) == "ok"
    assert exit_races.classify(done([], 1, "", "ValueError: bad flag")) == "failed"
    assert exit_races.classify(done([], -6, "", "")) == "abort"
    assert exit_races.classify(done([], 1, "", "terminate called without an active "
                                               "exception")) == "abort"
    results = exit_races.main(["--runs", "1", "--targets", "helpers-worker", "distill-worker",
                               "ch09-fsdp"])
    assert {name: r["ok"] for name, r in results.items()} == {
        "helpers-worker": 1, "distill-worker": 1, "ch09-fsdp": 1}

