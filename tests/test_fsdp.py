"""Sharded GRPO (`--fsdp`, fsdp.py): two Gloo processes make the one-process run while each
holds half of the weights and AdamW state, SIGTERM leaves a sharded checkpoint that one or two
processes resume exactly, final/ is the gathered model, and the memory table's arithmetic."""

import json
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_distributed import REWARD_COLUMNS, _ch07_main, _max_diff, _rows, _torchrun, _weights

from reasoning_from_scratch.fsdp import (
    QWEN3_SIZES,
    SHARDED_DIR,
    count_parameters,
    kv_cache_bytes,
    memory_per_process,
    memory_table,
)
from reasoning_from_scratch.qwen3 import Qwen3Model
from reasoning_from_scratch.run_log import read_metrics
from reasoning_from_scratch.weights import load_pretrained

# test_distributed's recipe, shorter: DAPO's token mean, batch-std advantages, dynamic
# sampling (uneven shares: the processes run different numbers of micro-batches), two inner
# epochs (old log-probs from the replica) and a KL reference.
FLAGS = ["--steps", "3", "--prompts-per-step", "4", "--num-rollouts", "4",
         "--max-new-tokens", "40", "--eval-examples", "2", "--eval-every", "2",
         "--eval-batch-size", "2", "--train-examples", "64", "--train-level-weights",
         "1,1,0,0,0", "--sample-every", "1", "--lr", "1e-3", "--warmup-steps", "0",
         "--loss-type", "dapo", "--scale-rewards", "batch", "--dynamic-sampling",
         "--micro-batch-size", "3", "--inner-epochs", "2", "--beta", "0.04",
         "--threads", "1", "--device", "cpu", "--no-progress"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same 3 steps sharded over two processes and by one plain process."""
    tmp = tmp_path_factory.mktemp("fsdp")
    two, one = tmp / "two", tmp / "one"
    proc, writes = _torchrun(tmp, two, ["--output-dir", str(two), *FLAGS, "--fsdp"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    threads = torch.get_num_threads()
    try:
        _ch07_main()(["--output-dir", str(one), *FLAGS])
    finally:
        torch.set_num_threads(threads)
    return {"tmp": tmp, "two": two, "one": one, "writes": writes}


def test_two_sharded_processes_make_the_one_process_run(runs):
    two, one = runs["two"], runs["one"]
    rows1, rows2 = read_metrics(one / "metrics.csv"), read_metrics(two / "metrics.csv")
    assert [r["step"] for r in rows2] == [1.0, 2.0, 3.0]
    assert [{c: r[c] for c in REWARD_COLUMNS} for r in rows2] == \
        [{c: r[c] for c in REWARD_COLUMNS} for r in rows1]
    assert any(r["sampling_rounds"] > 1 for r in rows2)  # uneven shares happened
    assert (two / "samples.jsonl").read_text() == (one / "samples.jsonl").read_text()
    w2, w1 = _weights(two), _weights(one)
    base = load_pretrained("tiny-arith", device="cpu")[0].state_dict()
    assert _max_diff(w1, base) > 1e-3  # training moved the weights far beyond the tolerance
    assert _max_diff(w2, w1) < 1e-5  # ... and the sharded run moved them alike
    assert runs["writes"][1] == [] or all("sharded" in line for line in runs["writes"][1])


def test_each_process_holds_half_of_the_weights_and_the_adamw_state(runs):
    summary = json.loads((runs["two"] / "summary.json").read_text())
    model = load_pretrained("tiny-arith", device="cpu")[0]
    total = sum(p.numel() for p in model.parameters())
    shards = summary["shards"]
    assert len(shards) == 2
    assert sum(s["param_elements"] for s in shards) == total  # no element held twice
    predicted = memory_per_process(model.cfg, 2, True, reference=False)
    for s in shards:  # measured from each process's local shards
        assert abs(s["param_elements"] / total - 0.5) < 0.05
        assert abs(4 * s["param_elements"] - predicted["policy"]) / predicted["policy"] < 0.05
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
    hf = transformers.AutoModelForCausalLM.from_pretrained(final).eval()  # float32, as saved
    ours = load_pretrained(final, device="cpu")[0]
    ids = torch.randint(0, ours.cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.allclose(hf(ids).logits, ours(ids), atol=1e-4)


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
    assert (ckpt / "model.safetensors").is_file()


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
        assert _max_diff(w, w_straight) < 1e-5
        assert [{c: r[c] for c in REWARD_COLUMNS} for r in rows] == \
            [{c: r[c] for c in REWARD_COLUMNS} for r in rows_straight]


# ----------------------------------------------------------------------------------------------
# The memory table
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(QWEN3_SIZES))
def test_parameter_count_is_the_models(name):
    cfg = QWEN3_SIZES[name]
    with torch.device("meta"):  # the shapes, without the memory
        model = Qwen3Model(cfg)
    assert count_parameters(cfg) == sum(p.numel() for p in model.parameters())


def test_fsdp_divides_what_ddp_replicates():
    cfg = QWEN3_SIZES["Qwen3-8B"]
    n = count_parameters(cfg)
    ddp, fsdp = memory_per_process(cfg, 8, False), memory_per_process(cfg, 8, True)
    assert ddp["policy"] + ddp["grads"] + ddp["adamw"] == 16 * n
    assert fsdp["policy"] + fsdp["grads"] + fsdp["adamw"] == 16 * n // 8
    assert fsdp["rollout_copy"] == fsdp["reference"] == 2 * n
    assert ddp["kv_cache"] == fsdp["kv_cache"] == kv_cache_bytes(cfg, 16, 1024)
    assert ddp["total"] > 80e9 > fsdp["total"]  # 8B trains on 8 x 80 GB only sharded
    assert memory_per_process(cfg, 1, False)["total"] / 1e9 == pytest.approx(166.8, abs=0.1)
    table = memory_table()
    assert table.count("\n") == 2 + 4 * 5 - 1  # header, rule, 4 sizes x 5 process counts
    assert "| Qwen3-8B | 8.19 B | 8 | 149.8 | 51.6 * (16.4 / 32.8 / 2.4) |" in table


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
