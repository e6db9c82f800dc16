"""Sharded GRPO (`--fsdp`, fsdp.py): two Gloo processes make the one-process run while each
holds half of the weights and AdamW state, a process without rows keeps pace with one that has
them all, SIGTERM leaves a sharded checkpoint that one or two processes resume exactly, final/
is the gathered model (for load_pretrained and transformers), and each process's shards are
what the memory table (memory.py, tests/test_memory.py) predicts."""

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from test_distributed import FLAGS as DP_FLAGS
from test_distributed import REWARD_COLUMNS, _rows, _run_here, _start, _torchrun, _weights
from tolerance import assert_rounded_alike, assert_trained_alike, forward_terms, training_bound

from reasoning_from_scratch import distributed, fsdp, training
from reasoning_from_scratch.datasets import load_dataset_by_name
from reasoning_from_scratch.fsdp import SHARDED_DIR
from reasoning_from_scratch.grpo import collect_rollouts
from reasoning_from_scratch.memory import memory_per_process
from reasoning_from_scratch.rewards import build_reward
from reasoning_from_scratch.run_log import read_metrics
from reasoning_from_scratch.weights import load_pretrained, save_pretrained

# test_distributed's recipe (DAPO's token mean, batch-std advantages, dynamic sampling: uneven
# shares, so the processes run different numbers of micro-batches; two inner epochs, old
# log-probs from the replica; a KL reference), with shorter answers and evaluation.
pytestmark = pytest.mark.slow  # process groups under torchrun: pyproject.toml's markers

SHORTER = {"--max-new-tokens": "40", "--eval-examples": "2"}
FLAGS = [SHORTER.get(prev, flag) for prev, flag in zip([None, *DP_FLAGS], DP_FLAGS)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same 3 steps sharded over two processes and by one plain process."""
    tmp = tmp_path_factory.mktemp("fsdp")
    two, one = tmp / "two", tmp / "one"
    proc, writes = _torchrun(tmp, two, ["--output-dir", str(two), *FLAGS, "--fsdp"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    _run_here(["--output-dir", str(one), *FLAGS])
    return {"tmp": tmp, "two": two, "one": one, "writes": writes}


def test_two_sharded_processes_make_the_one_process_run(runs):
    two, one = runs["two"], runs["one"]
    rows1, rows2 = read_metrics(one / "metrics.csv"), read_metrics(two / "metrics.csv")
    assert [r["step"] for r in rows2] == [1.0, 2.0, 3.0]
    assert [{c: r[c] for c in REWARD_COLUMNS} for r in rows2] == \
        [{c: r[c] for c in REWARD_COLUMNS} for r in rows1]
    assert any(r["sampling_rounds"] > 1 for r in rows2)  # uneven shares happened
    assert (two / "samples.jsonl").read_text() == (one / "samples.jsonl").read_text()
    assert_trained_alike(_weights(two), _weights(one), _start())  # float64 (tests/tolerance.py)
    assert runs["writes"][1] == [] or all("sharded" in line for line in runs["writes"][1])


def test_activation_checkpointing_on_two_sharded_processes_makes_the_same_run(runs):
    """`--activation-checkpointing` under `--fsdp` (each block's backward reruns its forward,
    all-gathering its weights again): the one-process run's rewards and weights."""
    out = runs["tmp"] / "two-ckpt"
    proc, _ = _torchrun(runs["tmp"], out, ["--output-dir", str(out), *FLAGS, "--fsdp",
                                           "--activation-checkpointing"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows, rows1 = read_metrics(out / "metrics.csv"), read_metrics(runs["one"] / "metrics.csv")
    assert [{c: r[c] for c in REWARD_COLUMNS} for r in rows] == \
        [{c: r[c] for c in REWARD_COLUMNS} for r in rows1]
    assert_trained_alike(_weights(out), _weights(runs["one"]), _start())


def test_each_process_holds_half_of_the_weights_and_the_adamw_state(runs):
    summary = json.loads((runs["two"] / "summary.json").read_text())
    model = load_pretrained("tiny-arith", device="cpu")[0]
    total = sum(p.numel() for p in model.parameters())
    shards = summary["shards"]
    assert len(shards) == 2
    assert sum(s["param_elements"] for s in shards) == total  # no element held twice
    master = torch.finfo(torch.float64).bits // 8  # the runs here train in float64
    predicted = memory_per_process(model.cfg, 2, True, master_bytes=master, reference=False)
    for s in shards:  # measured from each process's local shards
        assert abs(s["param_elements"] / total - 0.5) < 0.05
        assert abs(master * s["param_elements"] - predicted["weights"]) / predicted["weights"] \
            < 0.05
        assert abs(s["adamw_bytes"] - predicted["adamw"]) / predicted["adamw"] < 0.05


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP read in one process
def test_final_is_the_gathered_model_in_hugging_face_layout(runs):
    final = runs["two"] / "final"
    loaded = load_pretrained(final, device="cpu")[0]  # what load_pretrained sees
    gathered = load_pretrained("tiny-arith", device="cpu")[0]
    state = {"model": gathered.state_dict()}
    dcp.load(state, checkpoint_id=str(final / SHARDED_DIR))  # the shards, re-assembled
    gathered.load_state_dict(state["model"])
    ids = torch.randint(0, loaded.cfg.vocab_size, (2, 9),
                        generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(ids), gathered(ids))
    assert (final / SHARDED_DIR / "__0_0.distcp").is_file()
    assert (final / SHARDED_DIR / "__1_0.distcp").is_file()


def test_transformers_loads_final(runs):
    transformers = pytest.importorskip("transformers")
    final = runs["two"] / "final"
    # both read final/'s float64 weights in float32 (transformers' RMSNorm computes in float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(final).float().eval()
    ours = load_pretrained(final, device="cpu")[0]
    ids = torch.randint(0, ours.cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_rounded_alike(hf(ids).logits, ours(ids), forward_terms(ours.cfg, 9))


# One update of the bundled model on a fixed batch of 8 rollouts in micro-batches of 3: rank 0
# holds every row (3 passes), rank 1 none (3 zero-weighted passes); rank 0 saves the weights.
# argv[3]: "fsdp" (sharded), "fsdp-without-unused-setter" (sharded on a torch without
# FSDPModule.set_reduce_scatter_unused_params, as torch 2.11) or "replicas" (torch's DDP,
# `distributed.data_parallel`).
UNEVEN_WORKER = r"""
import sys
from dataclasses import replace
import torch, torch.distributed as dist
from safetensors.torch import save_file
from reasoning_from_scratch import distributed, fsdp, systems
sys.path.insert(0, sys.argv[2])
from test_fsdp import fixed_batch
distributed.init_distributed(torch.device("cpu"))
model, batch, config = fixed_batch()
sharded = sys.argv[3].startswith("fsdp")
if sys.argv[3] == "fsdp-without-unused-setter" and hasattr(fsdp.FSDPModule,
                                                            fsdp.UNUSED_PARAMS_SETTER):
    delattr(fsdp.FSDPModule, fsdp.UNUSED_PARAMS_SETTER)  # a torch that has it: as if not
if sharded:
    fsdp.shard_model(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
mine = batch if dist.get_rank() == 0 else batch.rows(torch.zeros(batch.size, dtype=torch.bool))
stats = systems.general_update(model, optimizer, mine, None, None, config)
state = fsdp.full_state(model) if sharded else model.state_dict()
if dist.get_rank() == 0:
    save_file({k: v.clone() for k, v in state.items()}, sys.argv[1])  # tied: one copy each
    print("grad_norm", stats["grad_norm"])
distributed.shutdown_distributed()  # meets the other process before Gloo's threads go
"""


def fixed_batch():
    """(model, batch, config): 8 rollouts of two prompts with set advantages (both processes
    and the one-process reference build the same), in float64 (tests/tolerance.py)."""
    model, tok = load_pretrained("tiny-arith", device="cpu", dtype=torch.float64)
    examples = load_dataset_by_name("arith", "train", n=2)
    batch = collect_rollouts(model, tok, examples, "cpu", build_reward(tok), num_rollouts=4,
                             max_new_tokens=12, temperature=1.0, top_p=1.0,
                             generator=training.rollout_generators("cpu", 0, 0, range(2)))
    batch = replace(batch, advantages=torch.linspace(-1.0, 1.0, batch.size))
    config = training.GRPOConfig(micro_batch_size=3, lr=1e-3, progress=False)
    return model, batch, config


def launch_uneven(tmp_path, how="fsdp"):
    """UNEVEN_WORKER under `torchrun --nproc-per-node 2`; (finished process, weights file)."""
    script = tmp_path / "uneven.py"
    script.write_text(UNEVEN_WORKER)
    out = tmp_path / "weights.safetensors"
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", "2", str(script), str(out),
                          str(Path(__file__).parent), how],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    return res, out


@pytest.mark.parametrize("how", ["fsdp", "fsdp-without-unused-setter", "replicas"])
def test_a_process_without_rows_keeps_the_others_company(tmp_path, how):
    """Uneven micro-batch counts (8 rows against none) meet in every collective, sharded or
    replicated, and the update is the one-process update on the whole batch; sharded also
    where torch lacks the setter for unused parameters (every parameter is used anyway)."""
    res, out = launch_uneven(tmp_path, how)
    assert res.returncode == 0, res.stderr[-3000:]
    model, batch, config = fixed_batch()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
    stats = training.update(model, optimizer, batch, None, None, config)
    assert stats["skipped"] == 0 and stats["grad_norm"] > 0
    printed = float(re.search(r"grad_norm (\S+)", res.stdout)[1])
    assert abs(printed - stats["grad_norm"]) <= training_bound(stats["grad_norm"])
    # one AdamW step moves each weight by about lr (its first step is lr x sign(gradient))
    assert_trained_alike(load_file(out), model.state_dict(), start, min_moved=config.lr / 2)


@pytest.fixture(scope="module")
def stopped(runs):
    """The sharded run stopped by SIGTERM at step 2's rollouts (torchrun exits 1)."""
    out = runs["tmp"] / "sigterm"
    proc, _ = _torchrun(runs["tmp"], out, ["--output-dir", str(out), *FLAGS, "--fsdp"],
                        sigterm_at="1,rollouts,2")
    assert proc.returncode != 0  # torchrun's own status: 1, not the workers' 75
    assert f"stopped by SIGTERM: {out / 'checkpoint-1'} holds 1 update(s)" in proc.stdout, \
        proc.stderr[-3000:]
    return out


def test_sigterm_leaves_a_sharded_checkpoint_and_the_exit_status(stopped):
    assert (stopped / "stopped").read_text() == "75\n"  # what a batch script requeues on
    ckpt = stopped / "checkpoint-1"
    assert json.loads((ckpt / "trainer_state.json").read_text())["step"] == 1
    assert (ckpt / SHARDED_DIR / ".metadata").is_file()
    assert not (ckpt / "model.safetensors").is_file()  # HF weights: final/ (or when asked)


@pytest.mark.parametrize("processes", [2, 1])
def test_a_sharded_checkpoint_resumes_exactly_with_one_or_two_processes(
        runs, stopped, processes):
    out = runs["tmp"] / f"resumed-{processes}"
    shutil.copytree(stopped, out)
    proc, _ = _torchrun(runs["tmp"], out, ["--resume", str(out), "--no-progress",
                                           "--threads", "1"], processes=processes)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (out / "stopped").exists()
    w, w_straight = _weights(out), _weights(runs["two"])
    rows, rows_straight = _rows(out), _rows(runs["two"])
    if processes == 2:  # the same processes doing the same sums: bit for bit
        assert all(torch.equal(w[k], w_straight[k]) for k in w)
        assert rows == rows_straight
    else:  # re-sharded onto one process
        assert_trained_alike(w, w_straight, _start())
        assert [{c: r[c] for c in REWARD_COLUMNS} for r in rows] == \
            [{c: r[c] for c in REWARD_COLUMNS} for r in rows_straight]


def test_ctrl_c_on_one_rank_inside_the_update_stops_both_after_it(runs):
    """Ctrl-C reaches rank 1 as step 2's update starts: the update (collectives included)
    finishes on both, both save their shards, and a plain `python` resume (a group of one)
    continues to the uninterrupted run's weights."""
    out = runs["tmp"] / "ctrl-c"
    proc, _ = _torchrun(runs["tmp"], out, ["--output-dir", str(out), *FLAGS, "--fsdp"],
                        interrupt_at="1,update,2")
    assert proc.returncode != 0
    assert f"interrupted: {out / 'checkpoint-2'} holds 2 update(s)" in proc.stdout, \
        proc.stderr[-3000:]
    assert (out / "stopped").read_text() == "130\n"
    _run_here(["--resume", str(out), "--no-progress"])
    assert_trained_alike(_weights(out), _weights(runs["two"]), _start())


def test_process_supervision_scores_with_the_unsharded_replica(tmp_path):
    """The Monte-Carlo step scorer samples continuations with the policy: the replica, which
    each process decodes on alone."""
    out = tmp_path / "run"
    flags = ["--steps", "2", "--prompts-per-step", "2", "--num-rollouts", "4",
             "--max-new-tokens", "32", "--eval-examples", "2", "--eval-every", "0",
             "--train-examples", "32", "--supervision", "process", "--step-scorer", "mc-branch",
             "--process-variant", "value-delta", "--mc-rollouts", "2", "--threads", "1",
             "--device", "cpu", "--no-progress", "--fsdp"]
    proc, _ = _torchrun(tmp_path, out, ["--output-dir", str(out), *flags])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in read_metrics(out / "metrics.csv")] == [1.0, 2.0]
    assert len(json.loads((out / "summary.json").read_text())["shards"]) == 2


# The sharded start (`fsdp.load_model_sharded`): built on the meta device, sharded, filled by
# broadcasts from rank 0, a group of tensors at a time; then `shard_with_replica` builds the
# replica from the shards. Rank 0 saves the gathered weights, the replica's and its share of
# the elements.
SHARDED_START_WORKER = r"""
import sys
import torch, torch.distributed as dist
from safetensors.torch import save_file
from reasoning_from_scratch import distributed, fsdp
distributed.init_distributed(torch.device("cpu"))
fsdp.LOAD_GROUP_NUMEL = 50_000  # rank 0 reads and broadcasts the weights in many groups
model = fsdp.load_model_sharded("tiny-arith", torch.device("cpu"))
model, replica = fsdp.shard_with_replica(model, torch.device("cpu"))
state = fsdp.full_state(model)
if dist.get_rank() == 0:
    save_file({k: v.contiguous() for k, v in state.items()}, sys.argv[1] + ".model")
    save_file({k: v.clone() for k, v in replica.state_dict().items()}, sys.argv[1] + ".rep")
    print("local", fsdp.local_numel(model.parameters()), "replica", replica.dtype)
distributed.shutdown_distributed()
"""


def test_a_sharded_start_loads_the_model_without_a_whole_copy(tmp_path):
    script = tmp_path / "start.py"
    script.write_text(SHARDED_START_WORKER)
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", "2", str(script), str(tmp_path / "w")],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    whole = load_pretrained("tiny-arith", device="cpu")[0]
    expected = whole.state_dict()
    for suffix in ("model", "rep"):
        got = load_file(tmp_path / f"w.{suffix}")
        assert set(got) == set(expected)
        assert all(torch.equal(got[k], v) for k, v in expected.items())  # bit for bit
    n = sum(p.numel() for p in whole.parameters())
    local = int(res.stdout.split("local ")[1].split()[0])
    assert n / 2 <= local <= n / 2 + 4096  # half of the elements (plus padding of odd rows)
    assert "replica torch.float32" in res.stdout  # the CPU's compute dtype: exact


def test_a_sharded_start_refuses_a_checkpoint_without_a_tensor(tmp_path):
    model, tok = load_pretrained("tiny-arith", device="cpu")
    save_pretrained(model, tok, tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.norm.weight"]
    save_file(weights, tmp_path / "model.safetensors")
    distributed.init_distributed("cpu", group_of_one=True)
    try:
        with pytest.raises(ValueError, match="lacks 1 tensor.*model.norm.weight"):
            fsdp.load_model_sharded(tmp_path, torch.device("cpu"))
    finally:
        distributed.shutdown_distributed()


def test_bench_fsdp_measures_the_start_up_of_both_starts(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "benchmarks"))
    import bench_fsdp
    out = bench_fsdp.main(["--startup", "--startup-model", "tiny", "--processes", "2"])
    assert set(out["peaks"]) == {"before", "sharded"}
    assert all(len(per_rank) == 2 and min(per_rank) >= 0 for per_rank in out["peaks"].values())
    assert out["params"] == 834_816 and out["ratio"] > 0
