"""The update's fast path: micro-batches padded to a few fixed shapes (length buckets) and
decoder blocks compiled (`compiled_update.FixedShape`, `compiled_update.compiled_block`), the
bfloat16 sampling
replica (`sampler_dtype`) and bfloat16 autocast of the update (`autocast`), all on the CPU.

Each CPU compile costs seconds (a minute on a busy machine), so the compiled tests are few:
one step against eager, one short training run.
"""

import argparse
import copy
import runpy
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from reasoning_from_scratch import compiled_update, grpo, systems, training
from reasoning_from_scratch.compiled_update import FixedShape
from reasoning_from_scratch.grpo import collect_rollouts
from reasoning_from_scratch.systems import (
    autocast_dtype,
    compiles_update,
    sampler_dtype,
    sampling_replica,
)
from reasoning_from_scratch.training import GRPOConfig, grpo_loss_on_batch, train_grpo
from reasoning_from_scratch.variants import loss_function
from reasoning_from_scratch.weights import load_pretrained

TRAIN = [{"problem": p, "answer": "0"}
         for p in ("2+3", "14+27*3", "4+5", "6+7+8+9+10", "(1+2)*(3+4)", "9")]
HELD_OUT = [{"problem": "3+4", "answer": "7"}]

compiler = pytest.mark.skipif(
    not (callable(getattr(torch, "compile", None)) and torch._dynamo.is_dynamo_supported()),
    reason="torch.compile is not supported on this Python/platform")


@pytest.fixture(scope="module")
def model_tok(tiny_dir):
    return load_pretrained(tiny_dir, device="cpu")


def _batch(model, tok, reward, examples, seed, max_new_tokens=8):
    return collect_rollouts(model, tok, examples, "cpu", reward, num_rollouts=3,
                            max_new_tokens=max_new_tokens, temperature=1.0, top_p=1.0,
                            generator=torch.Generator().manual_seed(seed))


def _loss_and_grads(model, batch, fixed_shape=None):
    """The clipped GRPO loss with a reference model's KL (old log-probs off by a fixed
    perturbation, so some ratios clip) and its gradients."""
    model.zero_grad(set_to_none=True)
    g = torch.Generator().manual_seed(7)
    old = 0.3 * torch.randn(batch.completion_mask.shape, generator=g)
    with torch.no_grad():
        ref, _ = grpo.batch_logprobs(model, batch, with_entropy=False, fixed_shape=fixed_shape)
    out = grpo_loss_on_batch(model, batch, old_logp=ref + old, ref_logp=ref, beta=0.1,
                             chunk_size=5, fixed_shape=fixed_shape)
    out["loss"].backward()
    return out["loss"].detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_close(a, b, atol=1e-5):
    torch.testing.assert_close(a[0], b[0], atol=atol, rtol=0)
    for name in a[1]:
        torch.testing.assert_close(a[1][name], b[1][name], atol=atol, rtol=0, msg=name)


def test_padding_to_a_fixed_shape_leaves_loss_and_gradients_unchanged(model_tok, even_reward):
    model, tok = model_tok
    batch = _batch(model, tok, even_reward, TRAIN[:2], seed=0)
    shape = FixedShape(rows=8, prompt_cols=batch.prompt_len + 5,
                       completion_cols=batch.completion_mask.shape[1] + 4, compile=False)
    assert batch.size < 8  # empty rows, left and right padding: all three kinds
    _assert_close(_loss_and_grads(model, batch, shape), _loss_and_grads(model, batch))
    ids, mask, left = compiled_update.pad_to_shape(batch.input_ids, batch.attention_mask,
                                        batch.prompt_len, shape)
    L = batch.input_ids.shape[1]
    assert ids.shape == mask.shape == (8, shape.prompt_cols + shape.completion_cols)
    assert left == 5 and torch.equal(ids[:batch.size, left:left + L], batch.input_ids)
    assert not mask[batch.size:].any() and not mask[:, :left].any()


def test_the_length_buckets_are_the_hand_computed_ones():
    """Evenly spaced sizes, completion sizes rounded up to multiples of 8, the smallest bucket
    that holds a batch, its own size beyond the bounds (the chapter 7 default run's bounds)."""
    shape = FixedShape(rows=128, prompt_cols=30, completion_cols=112, buckets=4)
    assert shape.row_sizes() == (32, 64, 96, 128)
    assert shape.completion_sizes() == (32, 56, 88, 112)  # 28 -> 32, 84 -> 88
    assert shape.shape_count() == 16
    assert shape.bucket(72, 20, 90) == (96, 30, 112)
    assert shape.bucket(40, 30, 75) == (64, 30, 88)
    assert shape.bucket(32, 1, 32) == (32, 30, 32)
    assert shape.bucket(33, 30, 33) == (64, 30, 56)
    assert shape.bucket(130, 31, 113) == (130, 31, 113)
    three = FixedShape(rows=128, prompt_cols=30, completion_cols=112, buckets=3)
    assert three.row_sizes() == (43, 86, 128)  # 42.7, 85.3
    assert three.completion_sizes() == (40, 80, 112)  # 37.3 -> 40, 74.7 -> 80
    small = FixedShape(rows=4, prompt_cols=5, completion_cols=8, buckets=4)
    assert small.row_sizes() == (1, 2, 3, 4) and small.completion_sizes() == (8,)
    assert small.shape_count() == 4
    one = FixedShape(rows=128, prompt_cols=30, completion_cols=112)
    assert one.shape_count() == 1 and one.bucket(40, 20, 75) == (128, 30, 112)
    with pytest.raises(ValueError, match="buckets must be >= 1"):
        FixedShape(rows=4, prompt_cols=5, completion_cols=8, buckets=0)


def test_the_block_recompile_limit_grows_with_the_buckets(model_tok, monkeypatch):
    """The log-prob pass tells `compiled_block` how many padded shapes it will see, so each of
    them may make BLOCK_RECOMPILE_LIMIT graphs before torch falls back to eager (torch's own
    limit, 8 graphs, would be met by 4 x 4 buckets in two grad modes). The compiled function is
    a spy that reads the limits in force, so nothing is compiled here."""
    model, _ = model_tok
    seen = []

    def spy(block, x, cos, sin, attn_mask):
        config = torch._dynamo.config
        seen.append((config.recompile_limit, config.accumulated_recompile_limit))
        return block(x, cos, sin, attn_mask)

    monkeypatch.setitem(compiled_update._COMPILED_BLOCK, "block", spy)
    shape = FixedShape(rows=64, prompt_cols=8, completion_cols=64, buckets=4)
    assert shape.shape_count() == 16  # rows 16, 32, 48, 64 x columns 16, 32, 48, 64
    ids = torch.randint(0, 200, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        grpo.token_logprobs_and_entropy(model, ids, prompt_len=5, fixed_shape=shape)
    limit = compiled_update.BLOCK_RECOMPILE_LIMIT * 16
    assert len(seen) == len(model.model.layers)
    assert model not in compiled_update._BLOCK_COMPILE_FAILURES
    assert all(lim == limit and total >= limit for lim, total in seen), seen


def test_padding_to_each_bucket_leaves_loss_and_gradients_unchanged(model_tok, even_reward):
    model, tok = model_tok
    batch = _batch(model, tok, even_reward, TRAIN[:2], seed=2, max_new_tokens=16)
    assert batch.size == 6 and batch.completion_mask.shape[1] == 16
    shape = FixedShape(rows=6, prompt_cols=batch.prompt_len + 2, completion_cols=16,
                       buckets=2, compile=False)
    assert shape.row_sizes() == (3, 6) and shape.completion_sizes() == (8, 16)
    for rows, cols, bucket in [(2, 5, (3, 8)), (5, 8, (6, 8)), (3, 9, (3, 16)),
                               (6, 16, (6, 16))]:
        part = batch.cut(rows, cols)
        ids, mask, left = compiled_update.pad_to_shape(part.input_ids, part.attention_mask,
                                            part.prompt_len, shape)
        assert (ids.shape[0], ids.shape[1] - shape.prompt_cols) == bucket and left == 2
        assert int(part.completion_mask.sum()) > 0
        _assert_close(_loss_and_grads(model, part, shape), _loss_and_grads(model, part))


@compiler
def test_the_compiled_step_equals_eager_with_one_graph_for_every_batch(model_tok, even_reward):
    """Loss and gradients within 1e-5 of eager; no graph break; a batch of other lengths and
    fewer rows reuses the graphs (an error on recompiling)."""
    model, tok = model_tok
    model.train()
    counters.clear()
    batch = _batch(model, tok, even_reward, TRAIN[:2], seed=0)
    other = _batch(model, tok, even_reward, TRAIN[3:4], seed=1, max_new_tokens=5)
    assert (other.prompt_len, other.size) != (batch.prompt_len, batch.size)
    shape = FixedShape(rows=6, prompt_cols=max(batch.prompt_len, other.prompt_len),
                       completion_cols=8)
    _assert_close(_loss_and_grads(model, batch, shape), _loss_and_grads(model, batch))
    failures = compiled_update._BLOCK_COMPILE_FAILURES
    assert model not in failures, failures.get(model)
    assert not counters["graph_break"]
    graphs = counters["stats"]["unique_graphs"]
    # at most one with gradients (every block of the model) and one without; fewer where an
    # earlier test's run made them for this architecture (symbolic sizes serve these shapes)
    assert graphs <= 2
    with torch._dynamo.config.patch(error_on_recompile=True):
        _assert_close(_loss_and_grads(model, other, shape), _loss_and_grads(model, other))
    # a recompile would have raised inside the compiled block and been run eagerly
    failures = compiled_update._BLOCK_COMPILE_FAILURES
    assert model not in failures, failures.get(model)
    assert counters["stats"]["unique_graphs"] == graphs
    model.eval()


@compiler
def test_a_bucketed_compiled_update_compiles_every_bucket_before_its_first_step(
        tiny_dir, tmp_path, even_reward):
    """Prompts and completions of varying lengths (the completions cut to another length each
    step), micro-batches of 4 and a remainder, the reference model's log-probs, two length
    buckets per dimension: every (bucket, grad mode) is run by the warm-up before the first
    step (`systems._warm_up_update`), every graph is made there, none by a step, and the
    shapes the steps meet are among the buckets'. With symbolic sizes the graphs are far fewer
    than the shapes x modes (one per mode and size range)."""
    model, tok = load_pretrained(tiny_dir, device="cpu")
    config = GRPOConfig(steps=6, prompts_per_step=2, num_rollouts=3, max_new_tokens=16,
                        micro_batch_size=4, beta=0.05, skip_zero_advantage=False,
                        eval_every=0, eval_examples=1, sample_every=0, seed=3,
                        output_dir=str(tmp_path / "run"), progress=False, compile=False,
                        compile_update=True, update_buckets=2)
    shape = systems.update_shape(config, tok, TRAIN, grpo.render_prompt)
    assert (shape.row_sizes(), shape.completion_sizes()) == ((2, 4), (8, 16))
    widths = iter([16, 16, 6, 16, 12, 5])  # step 3 meets the 8-column bucket first
    counters.clear()
    graphs, met, prompt_lens = {}, {}, set()
    step = [0]

    def cut_rollouts(*args, **kwargs):
        batch = collect_rollouts(*args, **kwargs)
        prompt_lens.add(batch.prompt_len)
        return batch.cut(batch.size, min(next(widths), batch.completion_mask.shape[1]))

    def spy_pad(input_ids, attention_mask, prompt_len, shape, pad_id=0):
        out = pad_pristine(input_ids, attention_mask, prompt_len, shape, pad_id)
        met.setdefault((out[0].shape, torch.is_grad_enabled()), []).append(step[0])
        return out

    def hook(phase, s):
        if phase == "rollouts":
            step[0] = s
            graphs[s] = counters["stats"]["unique_graphs"]

    pad_pristine = compiled_update.pad_to_shape
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(training, "collect_rollouts", cut_rollouts)
        mp.setattr(compiled_update, "pad_to_shape", spy_pad)
        train_grpo(model, tok, TRAIN, HELD_OUT, "cpu", config, reward_fn=even_reward,
                   phase_hook=hook)
    graphs[7] = counters["stats"]["unique_graphs"]
    assert not dict(compiled_update._BLOCK_COMPILE_FAILURES)  # the policy's and the reference's
    assert len(prompt_lens) > 1 and not counters["graph_break"]
    buckets = {(r, shape.prompt_cols + c) for r in shape.row_sizes()
               for c in shape.completion_sizes()}
    warmed = {(tuple(k[0]), k[1]) for k, steps in met.items() if steps[0] == 0}
    assert warmed == {(b, grad) for b in buckets for grad in (False, True)}, met
    in_steps = {(tuple(k[0]), k[1]) for k, steps in met.items() if max(steps) > 0}
    assert in_steps and in_steps <= warmed, met  # the steps meet warmed-up buckets only
    assert any(k[0][1] == shape.prompt_cols + 8 and 3 in steps for k, steps in met.items())
    assert len(set(graphs.values())) == 1, graphs  # no graph after the warm-up, none at the end
    assert graphs[1] < len(warmed), graphs  # symbolic sizes: fewer graphs than shapes x modes


def _spy_rollouts(check):
    """`collect_rollouts` that first calls check(model it samples from, its batch)."""
    def spy(model, *args, **kwargs):
        batch = collect_rollouts(model, *args, **kwargs)
        check(model, batch)
        return batch
    return spy


def test_rollouts_sample_from_a_bfloat16_replica_refreshed_after_each_update(
        tiny_dir, tmp_path, even_reward, monkeypatch):
    model, tok = load_pretrained(tiny_dir, device="cpu")
    seen = []

    def check(sampler, batch):
        assert sampler is not model and sampler.dtype == torch.bfloat16
        weights = dict(model.named_parameters())
        for name, p in sampler.named_parameters():  # the trained weights, cast
            assert torch.equal(p, weights[name].detach().to(torch.bfloat16)), name
        seen.append((id(sampler), {n: p.detach().clone() for n, p in model.named_parameters()}))

    monkeypatch.setattr(training, "collect_rollouts", _spy_rollouts(check))
    config = GRPOConfig(steps=3, prompts_per_step=2, num_rollouts=3, max_new_tokens=6,
                        skip_zero_advantage=False, eval_every=0, eval_examples=1,
                        sample_every=0, seed=1, output_dir=str(tmp_path / "run"),
                        progress=False, sampler_dtype="bfloat16", lr=1e-2)
    train_grpo(model, tok, TRAIN, HELD_OUT, "cpu", config, reward_fn=even_reward)
    assert len(seen) == 3 and len({s for s, _ in seen}) == 1  # one replica, refreshed
    assert next(model.parameters()).dtype == torch.float32  # the trained weights stay fp32
    for (_, before), (_, after) in zip(seen, seen[1:]):  # updates happened between the steps
        assert any(not torch.equal(before[n], after[n]) for n in before)


def test_a_resumed_run_samples_from_its_restored_weights(tiny_dir, tmp_path, even_reward,
                                                         monkeypatch):
    """Resuming refreshes the bfloat16 replica from the checkpoint's weights: the first
    rollouts after a restart sample from the trained weights, not the base model's."""
    config = GRPOConfig(steps=1, prompts_per_step=2, num_rollouts=3, max_new_tokens=6,
                        skip_zero_advantage=False, eval_every=0, eval_examples=1,
                        sample_every=0, seed=1, output_dir=str(tmp_path / "run"),
                        progress=False, sampler_dtype="bfloat16", lr=1e-2, checkpoint_every=1)
    model, tok = load_pretrained(tiny_dir, device="cpu")
    train_grpo(model, tok, TRAIN, HELD_OUT, "cpu", config, reward_fn=even_reward)
    trained = {n: p.detach().clone() for n, p in model.named_parameters()}
    base, tok = load_pretrained(tiny_dir, device="cpu")
    assert any(not torch.equal(trained[n], p) for n, p in base.named_parameters())
    seen = []

    def check(sampler, batch):
        for name, p in sampler.named_parameters():
            assert torch.equal(p, trained[name].to(torch.bfloat16)), name
        seen.append(1)

    monkeypatch.setattr(training, "collect_rollouts", _spy_rollouts(check))
    train_grpo(base, tok, TRAIN, HELD_OUT, "cpu", replace(config, steps=2),
               resume_from=tmp_path / "run", reward_fn=even_reward)
    assert seen == [1]  # step 2's rollouts, from the restored weights


def test_the_cpu_default_samples_from_the_trained_model_itself(tiny_dir, tmp_path,
                                                               even_reward, monkeypatch):
    """sampler_dtype auto on the CPU: no copy, today's fp32 tokens."""
    model, tok = load_pretrained(tiny_dir, device="cpu")
    samplers = []
    monkeypatch.setattr(training, "collect_rollouts",
                        _spy_rollouts(lambda sampler, batch: samplers.append(sampler)))
    config = GRPOConfig(steps=1, prompts_per_step=2, num_rollouts=2, max_new_tokens=4,
                        eval_every=0, eval_examples=1, sample_every=0,
                        output_dir=str(tmp_path / "run"), progress=False)
    train_grpo(model, tok, TRAIN, HELD_OUT, "cpu", config, reward_fn=even_reward)
    assert samplers == [model]
    assert sampling_replica(model, "cpu", sampler_dtype(config, "cpu")) is None


def test_the_defaults_per_device():
    config = GRPOConfig()
    assert sampler_dtype(config, "cuda") == torch.bfloat16
    assert sampler_dtype(config, "cpu") is None
    assert sampler_dtype(GRPOConfig(sampler_dtype="float32"), "cuda") == torch.float32
    assert autocast_dtype(config, "cuda") == torch.bfloat16
    assert autocast_dtype(config, "cpu") is None
    assert autocast_dtype(GRPOConfig(autocast="off"), "cuda") is None
    assert autocast_dtype(GRPOConfig(autocast="bfloat16"), "cpu") == torch.bfloat16
    assert compiles_update(config, "cuda") and not compiles_update(config, "cpu")
    assert compiles_update(GRPOConfig(compile=True), "cpu")
    assert not compiles_update(GRPOConfig(compile=True, compile_update=False), "cpu")
    with pytest.raises(ValueError, match="compile_update does not work with fsdp"):
        GRPOConfig(fsdp=True, compile_update=True)
    with pytest.raises(ValueError, match="sampler_dtype must be one of"):
        GRPOConfig(sampler_dtype="float16")
    with pytest.raises(ValueError, match="update_buckets must be >= 1"):
        GRPOConfig(update_buckets=0)
    assert config.update_buckets == 4


def test_bfloat16_autocast_keeps_fp32_weights_and_a_close_loss(model_tok, even_reward):
    """One update under bfloat16 autocast: the matmuls run in bfloat16, the weights (and AdamW
    state) stay float32 and move, and the loss (clipped ratios and a KL term: old and reference
    log-probs given) is within 1e-3 of float32's (measured: <= 7e-5 on three batches; the
    per-token log-probs within 1.2e-3)."""
    model, tok = model_tok
    batch = _batch(model, tok, even_reward, TRAIN[:2], seed=4)
    with torch.no_grad():
        logp, _ = grpo.batch_logprobs(model, batch, with_entropy=False)
    old = logp + 0.3 * torch.randn(logp.shape, generator=torch.Generator().manual_seed(7))
    results = {}
    for mode in ("off", "bfloat16"):
        m = copy.deepcopy(model).train()
        dtypes = []
        m.model.layers[0].mlp.up_proj.register_forward_hook(
            lambda mod, args, out, seen=dtypes: seen.append(out.dtype))
        start = {n: p.detach().clone() for n, p in m.named_parameters()}
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        stats = systems.general_update(m, opt, batch, old, logp - 0.1,
                                       GRPOConfig(autocast=mode, beta=0.1))
        assert stats["skipped"] == 0
        assert all(p.dtype == torch.float32 for p in m.parameters())
        assert all(v.dtype == torch.float32 for s in opt.state.values() for v in s.values()
                   if torch.is_tensor(v) and v.dim())
        assert any(not torch.equal(start[n], p) for n, p in m.named_parameters())
        results[mode] = (stats["loss"], set(dtypes))
    assert results["off"][1] == {torch.float32} and results["bfloat16"][1] == {torch.bfloat16}
    assert abs(results["off"][0]) > 1e-2  # not the ~0 of ratio-1 advantages
    assert abs(results["bfloat16"][0] - results["off"][0]) < 1e-3


def test_reference_logprobs_run_without_grad_and_in_lm_head_chunks(model_tok, even_reward):
    """The reference's pass (`training.update_stage`) is under no_grad, and no lm_head call,
    policy or reference, sees more than chunk_size positions: no (B, T, V) logits tensor."""
    model, tok = model_tok
    batch = _batch(model, tok, even_reward, TRAIN[:2], seed=5)
    policy, ref = copy.deepcopy(model), copy.deepcopy(model).requires_grad_(False)
    calls = []
    for who, m in (("policy", policy), ("ref", ref)):
        m.lm_head.register_forward_hook(
            lambda mod, args, out, who=who: calls.append((who, args[0].shape[0],
                                                          torch.is_grad_enabled())))
    config = GRPOConfig(beta=0.1, chunk_size=4)
    cost = {"t0": 0.0, "rollout_s": 0.0, "sampling_rounds": 1, "scorer_tokens": 0,
            "scorer_forward_tokens": 0}
    parts = training.Step(policy, torch.optim.AdamW(policy.parameters()), policy, tok, TRAIN,
                          "cpu", config, even_reward, ["correct"], grpo.render_prompt,
                          loss_function(config), ref_model=ref, update=training.update,
                          logprobs=training.logprobs)
    training.update_stage(parts, batch, 0, cost, lambda *a: None)
    assert {c[0] for c in calls} == {"policy", "ref"}
    assert all(rows <= 4 for _, rows, _ in calls)
    assert not any(grad for who, _, grad in calls if who == "ref")
    assert int(batch.completion_mask.sum()) > 4  # several chunks


@compiler
def test_the_benchmark_times_the_compiled_update_against_eager(monkeypatch):
    """benchmarks/bench_grpo_step.py --interleave-update on a tiny batch."""
    root = Path(__file__).resolve().parents[1]
    monkeypatch.syspath_prepend(str(root / "benchmarks"))
    main = runpy.run_path(str(root / "benchmarks" / "bench_grpo_step.py"),
                          run_name="bench_grpo_step")["main"]
    out = main(["--prompts", "1", "--G", "2", "--max-new-tokens", "3", "--threads", "1",
                "--interleave-update", "1"])
    assert set(out["tiny"]) == {"eager", "compiled"}
    assert all(wall > 0 and cpu > 0 for wall, cpu in out["tiny"].values())
    out = main(["--prompts", "2", "--G", "2", "--max-new-tokens", "16", "--threads", "1",
                "--interleave-update", "1", "--vary-lengths", "2", "--update-buckets", "2",
                "--beta", "0"])
    assert set(out["tiny"]) == {"eager", "compiled", "bucketed"}
    assert all(wall > 0 and cpu > 0 for wall, cpu in out["tiny"].values())


def test_the_benchmark_cuts_batches_like_a_training_run():
    """--vary-lengths: 30-80% of the groups' rows, the longest completion at 67-92% of the
    budget, every row's mask a prefix no longer than it, one row at full width."""
    root = Path(__file__).resolve().parents[1]
    bench = runpy.run_path(str(root / "benchmarks" / "bench_grpo_step.py"),
                           run_name="bench_grpo_step")
    B, P, T = 16 * 8, 5, 112
    full = grpo.RolloutBatch(torch.arange(B * (P + T)).reshape(B, P + T), None, P,
                             torch.ones(B, T, dtype=torch.bool), torch.zeros(B),
                             torch.zeros(16, 8))
    args = argparse.Namespace(vary_lengths=5, prompts=16, G=8, max_new_tokens=T)
    batches = bench["varied_batches"](full, args)
    assert len(batches) == 5
    for b in batches:
        width = b.completion_mask.shape[1]
        assert b.size % 8 == 0 and 5 * 8 <= b.size <= 13 * 8
        assert 0.67 * T - 1 <= width <= 0.92 * T and b.input_ids.shape[1] == P + width
        assert torch.equal(b.input_ids, full.input_ids[:b.size, :P + width])
        assert b.completion_mask[0].all()
        lengths = b.completion_mask.sum(1)  # each mask a prefix of its row
        assert torch.equal(b.completion_mask, torch.arange(width) < lengths[:, None])
        assert (lengths >= width // 8).all()
