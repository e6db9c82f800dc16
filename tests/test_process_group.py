"""Joining and leaving the process group (distributed.py, cli/launch.py): the backend follows the
device (NCCL for CUDA, with or without torchrun), --dist-timeout-minutes reaches
init_process_group, `shutdown_distributed` waits for the other process before it leaves (and
gives up on one that never comes), and benchmarks/exit_races.py runs and classifies. And what
every run checks: a torch without FSDP2 trains without --fsdp and refuses it; the replicas'
agreement is a float64 sum (no whole float64 copies), checked after the final save."""

import gc
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from reasoning_from_scratch import distributed, fsdp, run_dir, training
from reasoning_from_scratch.cli import launch
from reasoning_from_scratch.cli.distill import parse_distill_args
from reasoning_from_scratch.cli.train import parse_train_args
from reasoning_from_scratch.datasets import load_dataset_by_name
from reasoning_from_scratch.training import GRPOConfig
from reasoning_from_scratch.weights import load_pretrained

pytestmark = pytest.mark.slow  # process groups under torchrun: pyproject.toml's markers

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


class _Holder:
    """Something that refers to the process group in a reference cycle, as a sharded model's
    FSDP state and its hooks do."""

    def __init__(self):
        self.group, self.me = dist.group.WORLD, self


def _threads():
    return len(os.listdir("/proc/self/task"))


@pytest.mark.parametrize("held", [False, True], ids=["garbage", "still-held"])
def test_shutdown_stops_the_groups_threads_or_gives_them_a_grace(monkeypatch, held):
    slept = []
    monkeypatch.setattr(distributed.time, "sleep", slept.append)
    before = _threads()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    dist.all_reduce(torch.ones(3))  # the backend's worker threads are running
    assert _threads() > before
    holder = _Holder()
    if not held:
        del holder  # garbage, but a cycle: only a collection frees it
    distributed.shutdown_distributed()
    assert not dist.is_initialized()
    if held:  # the group lives on: its threads get the grace to finish with the GIL released
        assert slept == [distributed.LEAVE_GRACE_S] and _threads() > before
        del holder
        gc.collect()
    else:  # collected inside shutdown_distributed: the threads stopped before it returned
        assert slept == [] and _threads() == before
    assert _threads() == before


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

    def stuck(tmp):
        raise subprocess.TimeoutExpired(["torchrun"], 300, stderr=b"still decoding")
    exit_races.TARGETS["stuck"] = stuck
    try:
        kind, stderr = exit_races._run_once("stuck", Path("/nonexistent/exit-races-test"))
    finally:
        del exit_races.TARGETS["stuck"]
    assert kind == "hung" and "still decoding" in stderr and "after 300 s" in stderr
    results = exit_races.main(["--runs", "1", "--targets", "helpers-worker", "distill-worker",
                               "ch09-fsdp"])
    assert {name: r["ok"] for name, r in results.items()} == {
        "helpers-worker": 1, "distill-worker": 1, "ch09-fsdp": 1}



# A torch without FSDP2 (before 2.6): torch.distributed.fsdp holds FSDP1 only, so importing
# fully_shard & co. from it fails. The package still imports, a plain training run still trains,
# and --fsdp is refused with the reason (exit 2).
NO_FSDP2 = r'''
import runpy, sys
import torch
import torch.distributed.fsdp as fsdp_module
for name in ("fully_shard", "FSDPModule", "MixedPrecisionPolicy", "register_fsdp_forward_method"):
    delattr(fsdp_module, name)
from reasoning_from_scratch import fsdp
assert "lacks" in fsdp.fsdp2_problem() and not fsdp.is_sharded(torch.nn.Linear(1, 1))
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
'''

TINY_CH07 = ["--steps", "1", "--prompts-per-step", "2", "--num-rollouts", "2",
             "--max-new-tokens", "8", "--eval-examples", "1", "--eval-every", "0",
             "--train-examples", "8", "--checkpoint-minutes", "0", "--threads", "1",
             "--device", "cpu", "--no-progress"]


def test_training_without_fsdp2_trains_and_refuses_fsdp(tmp_path):
    script = tmp_path / "no_fsdp2.py"
    script.write_text(NO_FSDP2)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    base = [sys.executable, str(script), str(ROOT / "chapters" / "ch07_train.py"), *TINY_CH07]
    plain = subprocess.run([*base, "--output-dir", str(tmp_path / "plain")], env=env,
                           capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert (tmp_path / "plain" / "final" / "model.safetensors").is_file()
    sharded = subprocess.run([*base, "--output-dir", str(tmp_path / "fsdp"), "--fsdp"], env=env,
                             capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert sharded.returncode == 2 and "--fsdp needs FSDP2" in sharded.stderr
    assert not (tmp_path / "fsdp").exists()


def test_a_torch_without_the_setters_is_refused(monkeypatch):
    monkeypatch.delattr(fsdp.FSDPModule, "set_force_sum_reduction_for_comms")
    assert "set_force_sum_reduction_for_comms" in fsdp.fsdp2_problem()
    with pytest.raises(ValueError, match="set_force_sum_reduction_for_comms"):
        fsdp.check_fsdp_run(True)
    fsdp.check_fsdp_run(False)  # a run without --fsdp does not care
    with pytest.raises(RuntimeError, match="set_force_sum_reduction_for_comms"):
        fsdp.shard_model(torch.nn.Linear(1, 1))


def test_the_setter_for_unused_parameters_is_optional(monkeypatch):
    """torch 2.11 (the GPU machines' image) lacks it: --fsdp still runs (tests/test_fsdp.py
    shards two processes without it and gets the one-process update)."""
    monkeypatch.delattr(fsdp.FSDPModule, fsdp.UNUSED_PARAMS_SETTER, raising=False)
    assert fsdp.fsdp2_problem() is None
    fsdp.check_fsdp_run(True)


def test_the_checksum_sums_in_float64_chunk_by_chunk(monkeypatch):
    monkeypatch.setattr(distributed, "CHECKSUM_CHUNK_NUMEL", 3)
    a = torch.tensor([1e8, 1.0, -1e8, 0.5, 0.25], dtype=torch.float32)  # 1.75 in float64
    b = torch.full((2, 2), 0.125)
    summed = []

    class RecordSums(TorchFunctionMode):  # the sizes of the tensors that are summed
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.Tensor.sum:
                summed.append(args[0].numel())
            return func(*args, **(kwargs or {}))

    with RecordSums():
        assert distributed.params_checksum([a, b]) == 1.75 + 0.5
    assert summed == [3, 2, 3, 1]  # a in chunks of 3 and 2, b in chunks of 3 and 1
    assert float(a.sum()) != 1.75  # float32 would have lost the small terms


def _agree_worker(rank_, init_file, out_dir):
    """Two replicas that agree, then differ; each rank writes what the check raised."""
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank_,
                                         world_size=2)
    try:
        model = torch.nn.Linear(2, 2)
        torch.nn.init.constant_(model.weight, 1.0)
        torch.nn.init.constant_(model.bias, 0.0)
        distributed.check_replicas_agree(model)  # the same: nothing happens
        with torch.no_grad():
            model.bias[0] += rank_ * 1e-6  # one element, off by a little on rank 1
        try:
            distributed.check_replicas_agree(model)
            msg = "no error"
        except RuntimeError as err:
            msg = str(err)
        Path(out_dir, f"{rank_}.txt").write_text(msg)
    finally:
        distributed.shutdown_distributed()


def test_diverged_replicas_fail_on_every_rank(tmp_path):
    torch.multiprocessing.spawn(_agree_worker, args=(str(tmp_path / "init"), str(tmp_path)),
                                nprocs=2)
    for r in (0, 1):
        assert (tmp_path / f"{r}.txt").read_text().startswith("model weights differs")


def test_the_rank_check_comes_after_the_final_save(monkeypatch, tmp_path):
    """A failing check still leaves final/ and summary.json."""
    def diverged(model):
        raise RuntimeError("model weights differs between ranks")
    monkeypatch.setattr(run_dir, "check_replicas_agree", diverged)
    config = training.GRPOConfig(**dict(zip(
        ["steps", "prompts_per_step", "num_rollouts", "max_new_tokens", "eval_examples"],
        [1, 2, 2, 8, 1])), eval_every=0, checkpoint_minutes=0, progress=False,
        output_dir=str(tmp_path / "run"))
    model, tok = load_pretrained("tiny-arith", device="cpu")
    examples = load_dataset_by_name("arith", "train", n=4)
    with pytest.raises(RuntimeError, match="differs"):
        training.train_grpo(model, tok, examples, examples[:1], "cpu", config)
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()
    assert (tmp_path / "run" / "summary.json").is_file()
