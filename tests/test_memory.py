"""The memory table (memory.py): every term hand-computed on the tiny config, the sum's phases,
the dtypes each layout uses, the activations against autograd's own saved tensors, and the
table's shape."""

from pathlib import Path

import pytest
import torch

from reasoning_from_scratch.memory import (
    GB,
    LOGITS_COPIES,
    QWEN3_SIZES,
    activation_bytes,
    adamw_bytes,
    block_activation_bytes,
    block_parameters,
    count_parameters,
    gradients_bytes,
    kv_cache_bytes,
    logits_bytes,
    memory_per_process,
    memory_table,
    optimizer_step_bytes,
    reference_bytes,
    root_parameters,
    run_dtypes,
    sampler_bytes,
    unsharded_bytes,
    weights_bytes,
)
from reasoning_from_scratch.qwen3 import Qwen3Model, tiny_config

# tiny_config(): H 64, intermediate 128, 2 layers, 4 query heads and 2 key/value heads of 16,
# vocabulary 256, tied embedding.
CFG = tiny_config()
BLOCK = 64 * 16 * (2 * 4 + 2 * 2) + 2 * 16 + 3 * 64 * 128 + 2 * 64  # 12,320 + 24,576 + 128
ROOT = 256 * 64 + 64  # embedding (= the tied head) and the final norm
N = 2 * BLOCK + ROOT  # 90,496


@pytest.mark.parametrize("name", sorted(QWEN3_SIZES))
def test_parameter_count_is_the_models(name):
    cfg = QWEN3_SIZES[name]
    with torch.device("meta"):  # the shapes, without the memory
        model = Qwen3Model(cfg)
    assert count_parameters(cfg) == sum(p.numel() for p in model.parameters())
    root = sum(p.numel() for p in model.model.embed_tokens.parameters()) + \
        sum(p.numel() for p in model.model.norm.parameters()) + \
        (0 if cfg.tie_word_embeddings else model.lm_head.weight.numel())
    assert root_parameters(cfg) == root
    assert block_parameters(cfg) == sum(p.numel() for p in model.model.layers[0].parameters())


def test_sizes_by_hand():
    assert (block_parameters(CFG), root_parameters(CFG), count_parameters(CFG)) == \
        (BLOCK, ROOT, N) == (37_024, 16_448, 90_496)


def test_dtypes_are_the_codes():
    # on the CPU everything is in --dtype (float32 default): the trained weights sample
    cpu = {"master": 4, "sample": 4, "reference": 4, "compute": 4}
    assert run_dtypes(False, "cpu") == run_dtypes(True, "cpu") == cpu
    # CUDA: sampling and the update's compute in bf16; the reference copies the trained
    # weights: fp32 master weights when replicated, the bf16 replica when sharded
    assert run_dtypes(False, "cuda") == {"master": 4, "sample": 2, "reference": 4, "compute": 2}
    assert run_dtypes(True, "cuda") == {"master": 4, "sample": 2, "reference": 2, "compute": 2}
    assert run_dtypes(False, "cuda", master_bytes=2)["reference"] == 2  # --dtype bfloat16


def test_the_state_terms_by_hand():
    assert weights_bytes(CFG, 4, False, 4) == 4 * N  # replicated: whole on each process
    assert weights_bytes(CFG, 4, True, 4) == N  # sharded: a quarter
    assert gradients_bytes(CFG, 4, True, 4) == N
    assert adamw_bytes(CFG, 4, False, 4) == 8 * N  # two float32 moments
    assert adamw_bytes(CFG, 4, True, 4) == 2 * N
    assert sampler_bytes(CFG, False, 4) == 0  # the trained weights sample
    assert sampler_bytes(CFG, False, 2) == 2 * N  # replicated on CUDA: a bf16 copy
    assert sampler_bytes(CFG, True, 2) == 2 * N  # the whole bf16 replica
    assert reference_bytes(CFG, 4) == 4 * N and reference_bytes(CFG, 2, False) == 0


def test_kv_cache_by_hand():
    # keys and values: 2 x 2 layers x 2 heads x 16 = 128 elements per position
    assert kv_cache_bytes(CFG, rows=3, tokens=10, dtype_bytes=4) == 3 * 10 * 128 * 4


def test_activations_by_hand():
    # per token and block, float32 always: norm inputs 2H + qd + kd = 224, 1 / rms of the two
    # block norms and of 4 + 2 heads (8), SDPA's log-sum-exp per head (4): 236 elements
    # compute dtype: 4H + 3qd + 3kd + 4I = 256 + 192 + 96 + 512 = 1,056 elements
    assert block_activation_bytes(CFG, 4) == 236 * 4 + 1_056 * 4
    # in bf16 also the rotary tables cast for q and k (4 x 16); a mask of 12 keys: 12 more
    assert block_activation_bytes(CFG, 2, seq_len=12) == 236 * 4 + (1_056 + 64 + 12) * 2
    # outside the blocks: rotary tables (2 x 16) and the final norm's input and 1 / rms in
    # float32, its normalised input and the answer hidden states (2 x 64)
    root = 4 * (32 + 64 + 1) + 2 * 64 * 4
    assert activation_bytes(CFG, 10, 4) == 10 * (2 * 5_168 + root)
    # checkpointed: each block's input (H) plus one block recomputed
    assert activation_bytes(CFG, 10, 4, checkpointing=True) == 10 * (2 * 64 * 4 + 5_168 + root)


def test_logits_by_hand():
    assert logits_bytes(CFG, 10, chunk_size=4) == LOGITS_COPIES * 4 * 256 * 4  # one chunk
    assert logits_bytes(CFG, 3, chunk_size=4) == LOGITS_COPIES * 3 * 256 * 4


def test_unsharded_by_hand():
    assert unsharded_bytes(CFG, False, 4) == 0
    # float32: the root's gathered weights and whole gradient, two blocks gathered
    assert unsharded_bytes(CFG, True, 4) == 2 * 4 * ROOT + 2 * 4 * BLOCK
    # bf16 compute: the same in bf16, plus the float32 copy of the root gradient reduced
    assert unsharded_bytes(CFG, True, 2) == 2 * 2 * ROOT + 4 * ROOT + 2 * 2 * BLOCK


def test_optimizer_step_by_hand():
    assert optimizer_step_bytes(CFG, 2, False, 4, "cuda") == 4 * N  # foreach: a whole copy
    assert optimizer_step_bytes(CFG, 2, True, 4, "cuda") == 4 * N // 2  # of the shards
    assert optimizer_step_bytes(CFG, 2, False, 4, "cpu") == 2 * 4 * 256 * 64  # 2 x embedding
    assert optimizer_step_bytes(CFG, 2, True, 4, "cpu") == 4 * 256 * 64  # of its shard


def test_the_total_adds_the_state_and_the_largest_phase():
    kw = {"rollout_rows": 8, "rollout_tokens": 2000, "micro_batch_rows": 2,
          "sequence_tokens": 30, "answer_tokens": 20, "chunk_size": 16}
    m = memory_per_process(CFG, 2, True, device="cuda", **kw)
    assert m["kv_cache"] == kv_cache_bytes(CFG, 4, 2000, 2)  # this process's 4 rows, bf16
    assert m["activations"] == activation_bytes(CFG, 60, 2, seq_len=30)  # padded rows
    assert m["logits"] == logits_bytes(CFG, 20, 16)
    state = m["weights"] + m["gradients"] + m["adamw"] + m["sampler"] + m["reference"]
    update = m["activations"] + m["logits"] + m["unsharded"]
    assert m["kv_cache"] > max(update, m["optimizer_step"])  # here the rollouts are larger
    assert m["total"] == state + m["kv_cache"]
    m = memory_per_process(CFG, 2, True, device="cuda", **{**kw, "rollout_tokens": 1})
    assert update > m["optimizer_step"] and m["total"] == state + update
    m = memory_per_process(CFG, 2, False, device="cpu", **{**kw, "rollout_tokens": 1,
                                                           "sequence_tokens": 1})
    state = m["weights"] + m["gradients"] + m["adamw"] + m["reference"]  # no sampler
    assert m["optimizer_step"] > m["activations"] + m["logits"]  # the largest phase here
    assert m["total"] == state + m["optimizer_step"]


def test_each_term_of_the_sum_by_hand():
    """memory_per_process hands each term its layout's dtype and this process's share."""
    kw = {"rollout_rows": 5, "rollout_tokens": 10, "micro_batch_rows": 1, "sequence_tokens": 3,
          "answer_tokens": 2, "chunk_size": 16}
    # replicated on CUDA: fp32 master state, a bf16 sampling copy, the fp32 reference; the KV
    # cache of ceil(5 / 2) = 3 rows x 10 positions x 128 elements in bf16
    m = memory_per_process(CFG, 2, False, device="cuda", **kw)
    assert [m[k] for k in ("weights", "gradients", "adamw", "sampler", "reference")] == \
        [4 * N, 4 * N, 8 * N, 2 * N, 4 * N]
    assert m["kv_cache"] == 3 * 10 * 128 * 2 and m["unsharded"] == 0
    assert m["logits"] == LOGITS_COPIES * 2 * 256 * 4 and m["optimizer_step"] == 4 * N
    # 1 row x 3 positions in bf16 with a mask of 3 keys: a block saves 236 x 4 + (1,056 + 64
    # + 3) x 2 = 3,190 bytes per token, outside the blocks 4 x 97 + 2 x 64 x 2 = 644
    assert m["activations"] == 3 * (2 * 3_190 + 644)
    ckpt = memory_per_process(CFG, 2, False, device="cuda", activation_checkpointing=True, **kw)
    assert ckpt["activations"] == 3 * (2 * 64 * 2 + 3_190 + 644)  # block inputs + one block
    # sharded over 2: half of the master state, the whole bf16 replica and its bf16 reference
    m = memory_per_process(CFG, 2, True, device="cuda", **kw)
    assert [m[k] for k in ("weights", "gradients", "adamw", "sampler", "reference")] == \
        [2 * N, 2 * N, 4 * N, 2 * N, 2 * N]
    # --dtype bfloat16, replicated: the bf16 weights sample themselves (no copy)
    m = memory_per_process(CFG, 2, False, device="cuda", master_bytes=2, **kw)
    assert [m[k] for k in ("weights", "gradients", "adamw", "sampler", "reference")] == \
        [2 * N, 2 * N, 4 * N, 0, 2 * N]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activations_match_autograds_saved_tensors(dtype):
    """block_activation_bytes is what autograd saves for one block's backward pass (distinct
    storages of the saved tensors other than the weights), with a padding mask."""
    torch.manual_seed(0)
    model = Qwen3Model(CFG).to(dtype)
    T = 12
    x = torch.randn(1, T, 64, dtype=dtype, requires_grad=True)
    cos, sin = (t[:T].clone()[None] for t in model._rope_tables(T))  # (1, T, 16) float32
    mask = torch.ones(1, 1, T, T, dtype=torch.bool).tril()
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.model.layers[0](x, cos, sin, mask)
    got = sum(n for ptr, n in saved.items() if ptr not in params)
    shared = 2 * 16 * 4 if dtype == torch.float32 else 0  # the tables themselves (float32)
    assert got == T * (block_activation_bytes(CFG, 4 if dtype == torch.float32 else 2,
                                              seq_len=T) + shared)


def test_the_table():
    table = memory_table()
    assert table.count("\n") == 2 + 4 * 5 - 1  # header, rule, 4 sizes x 5 process counts
    m8 = memory_per_process(QWEN3_SIZES["Qwen3-8B"], 8, True)
    assert "| Qwen3-8B | 8 | " in table and f"{m8['total'] / GB:.1f}" in table
    # replicated 8B holds 16 bytes per parameter plus its fp32 reference: never fits 80 GB
    ddp = memory_per_process(QWEN3_SIZES["Qwen3-8B"], 8, False)
    assert ddp["total"] > 20 * count_parameters(QWEN3_SIZES["Qwen3-8B"]) > 80 * GB


def test_bench_memory_measures_and_predicts_each_case(monkeypatch):
    """benchmarks/bench_memory.py on the bundled model's shape, one layout (two processes)."""
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "benchmarks"))
    import bench_memory
    out = bench_memory.main(["--shape", "tiny", "--cases", "replicated", "--rows", "2",
                             "--prompt", "8", "--answer", "8", "--kv-rows", "2",
                             "--kv-tokens", "16"])
    assert [r["checkpointing"] for r in out] == [False, True]
    for r in out:
        # the tiny model may not lift the peak above the imports' own: >= 0
        assert r["peak_bytes"] >= 0 and len(r["update_s"]) == len(r["update_cpu_s"]) == 2
        assert r["predicted"]["total"] == bench_memory.predicted(r)["total"] > 0


def test_bench_memory_runs_the_sharded_case_in_two_processes(monkeypatch):
    """`--processes 2`: torchrun's two Gloo processes each report a peak; the prediction is the
    formula's for a group of two with their rollout rows together."""
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "benchmarks"))
    import bench_memory
    args = ["--shape", "tiny", "--cases", "sharded", "--rows", "2", "--prompt", "8",
            "--answer", "8", "--kv-rows", "2", "--kv-tokens", "16", "--no-reference"]
    out = bench_memory.main([*args, "--processes", "2"])
    assert [r["checkpointing"] for r in out] == [False, True]
    for r in out:
        assert r["processes"] == 2 and len(r["peaks_bytes"]) == 2
        assert r["peak_bytes"] == max(r["peaks_bytes"])
        want = memory_per_process(tiny_config(), 2, True, device="cpu", reference=False,
                                  rollout_rows=4, rollout_tokens=16, micro_batch_rows=2,
                                  sequence_tokens=16, answer_tokens=16, chunk_size=1024,
                                  activation_checkpointing=r["checkpointing"])
        assert r["predicted"] == want
    # a replicated process holds the whole model whatever the count: refused, not mislabelled
    with pytest.raises(SystemExit):
        bench_memory.main(["--shape", "tiny", "--processes", "2"])
