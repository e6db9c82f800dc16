"""Activation checkpointing (`--activation-checkpointing`, `Qwen3Model.activation_checkpointing`):
the same loss, gradients and update as without it, with each block's forward run again in the
backward pass; plain and sharded (FSDP2, a group of one); inference untouched. In float64
(`test_fsdp.fixed_batch`), compared within derived bounds (tests/tolerance.py)."""

import torch
from test_distillation import HELD_OUT, TRACES
from test_fsdp import fixed_batch
from tolerance import assert_rounded_alike, assert_trained_alike, backward_terms
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from reasoning_from_scratch import distributed, fsdp, qwen3, training
from reasoning_from_scratch.datasets import load_dataset_by_name
from reasoning_from_scratch.distillation_training import DistillConfig, train_distillation
from reasoning_from_scratch.qwen3 import KVCache
from reasoning_from_scratch.sft import batch_logits
from reasoning_from_scratch.training import grpo_loss_on_batch
from reasoning_from_scratch.weights import load_pretrained


def _block_calls(model) -> list[int]:
    """A counter of the decoder blocks' forward calls (each block's `forward` wrapped: torch
    runs no forward hooks while it recomputes a checkpointed block)."""
    calls = [0]

    def counting(forward):
        def wrapped(*args, **kwargs):
            calls[0] += 1
            return forward(*args, **kwargs)
        return wrapped

    for block in model.model.layers:
        block.forward = counting(block.forward)
    return calls


def _loss_and_grads(model, batch, config):
    """(loss, {name: gradient}) of one GRPO loss on `batch`, and the blocks' forward calls."""
    calls = _block_calls(model)
    model.zero_grad(set_to_none=True)
    loss = grpo_loss_on_batch(model, batch, loss_type=config.loss_type,
                              epsilon=config.epsilon, chunk_size=7)["loss"]
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, calls[0]


def test_checkpointing_gives_the_same_loss_and_gradients_and_reruns_each_block():
    model, batch, config = fixed_batch()
    loss, grads, calls = _loss_and_grads(model, batch, config)
    model, batch, config = fixed_batch()
    model.activation_checkpointing = True
    loss_ckpt, grads_ckpt, calls_ckpt = _loss_and_grads(model, batch, config)
    blocks = model.cfg.num_hidden_layers
    assert calls == blocks and calls_ckpt == 2 * blocks  # each block once more, in the backward
    terms = backward_terms(model.cfg, batch.input_ids.shape[1], batch.input_ids.numel())
    assert_rounded_alike(loss_ckpt, loss, terms)
    assert set(grads_ckpt) == set(grads)
    assert_rounded_alike(grads_ckpt, grads, terms)
    assert max(g.abs().max().item() for g in grads.values()) > 1e-3  # gradients to compare


def test_inference_and_the_kv_cache_are_left_alone():
    model, batch, _ = fixed_batch()
    model.activation_checkpointing = True
    calls = _block_calls(model)
    with torch.no_grad():
        model(batch.input_ids[:2])
    assert calls[0] == model.cfg.num_hidden_layers  # nothing recorded, nothing to recompute


def test_a_forward_that_writes_the_kv_cache_with_gradients_is_not_checkpointed():
    """Training through a growing KV cache (`tiny_world.batch_logits`): a block that writes the
    cache is never rerun (a rerun would append its keys again), so the backward pass calls no
    block and the gradients are those without checkpointing."""
    results = []
    for checkpointing in (False, True):
        model, batch, _ = fixed_batch()
        model.activation_checkpointing = checkpointing
        ids = batch.input_ids[:2]
        calls = _block_calls(model)
        cache = KVCache(model.cfg.num_hidden_layers)
        model(ids[:, :5], cache=cache)
        logits = model(ids[:, 5:], cache=cache)  # (2, L - 5, V), the prefix's keys attended
        before = calls[0]
        logits.logsumexp(-1).sum().backward()
        assert before == 2 * model.cfg.num_hidden_layers and calls[0] == before
        assert cache.seq_len == ids.shape[1]
        results.append({n: p.grad.clone() for n, p in model.named_parameters()})
    terms = backward_terms(model.cfg, ids.shape[1], ids.numel())
    assert_rounded_alike(results[1], results[0], terms)


def _one_update(shard: bool, checkpointing: bool) -> dict[str, torch.Tensor]:
    """The weights after `training.update` on the fixed batch (micro-batches of 3)."""
    model, batch, config = fixed_batch()
    if shard:
        fsdp.shard_model(model)
    model.activation_checkpointing = checkpointing
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
    stats = training.update(model, optimizer, batch, None, None, config)
    assert stats["skipped"] == 0
    return fsdp.full_state(model) if shard else {
        k: v.detach().clone() for k, v in model.state_dict().items()}


def test_one_update_with_checkpointing_is_the_update_without():
    model, _, config = fixed_batch()
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    plain, ckpt = _one_update(False, False), _one_update(False, True)
    # AdamW's first step moves each weight by about lr (lr x the gradient's sign)
    assert_trained_alike(ckpt, plain, start, min_moved=config.lr / 2)


def test_checkpointing_under_fsdp_is_the_plain_update():
    """`fully_shard` blocks run through `checkpoint`: the rerun all-gathers again."""
    model, _, config = fixed_batch()
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    plain = _one_update(False, False)
    distributed.init_distributed("cpu", group_of_one=True)
    try:
        sharded = _one_update(True, True)
    finally:
        distributed.shutdown_distributed()
    assert_trained_alike(sharded, plain, start, min_moved=config.lr / 2)


def _update_block_calls(tmp_path, checkpointing: bool) -> int:
    """Decoder-block forward calls during the update phase of a one-step `train_grpo` run."""
    model, tok = load_pretrained("tiny-arith", device="cpu")
    examples = load_dataset_by_name("arith", "train", n=8)
    config = training.GRPOConfig(steps=1, prompts_per_step=2, num_rollouts=4, max_new_tokens=8,
                                 eval_examples=1, eval_every=0, progress=False,
                                 checkpoint_minutes=0, activation_checkpointing=checkpointing,
                                 output_dir=str(tmp_path / f"run-{checkpointing}"))
    calls, marks = _block_calls(model), {}
    training.train_grpo(model, tok, examples, examples, "cpu", config,
                        phase_hook=lambda phase, step: marks.setdefault(phase, calls[0]))
    assert model.activation_checkpointing == checkpointing
    return marks["final_eval"] - marks["update"]


def test_the_config_field_checkpoints_the_update_of_a_run(tmp_path):
    """train_grpo switches it on for the policy it trains: its update runs every block twice
    (forward, and again in the backward), the rest of the run as before."""
    plain = _update_block_calls(tmp_path, False)
    assert plain > 0
    assert _update_block_calls(tmp_path, True) == 2 * plain


def test_sft_logits_through_the_shared_prefix_are_those_of_whole_checkpointed_rows():
    """`sft.batch_logits` runs the prefix once into a KV cache; with checkpointing it runs the
    whole rows instead (a block that writes a cache is never recomputed): the same logits and
    gradients, and now every block is rerun in the backward pass."""
    results = []
    for checkpointing in (False, True):
        model, batch, _ = fixed_batch()
        model.activation_checkpointing = checkpointing
        prefix, inputs = batch.input_ids[0, :6], batch.input_ids[:3, 6:]  # (6,), (3, L - 6)
        calls = _block_calls(model)
        logits = batch_logits(model, prefix, inputs)  # (3, L - 6, V)
        forward = calls[0]
        logits.logsumexp(-1).sum().backward()
        blocks = model.cfg.num_hidden_layers
        assert (forward, calls[0]) == ((2 * blocks, 2 * blocks) if not checkpointing
                                       else (blocks, 2 * blocks))
        results.append((logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    terms = backward_terms(model.cfg, batch.input_ids.shape[1], batch.input_ids[:3].numel())
    assert_rounded_alike(results[1][0], results[0][0], terms)
    assert_rounded_alike(results[1][1], results[0][1], terms)


def _sft_checkpointed_blocks(tmp_path, monkeypatch, checkpointing: bool) -> tuple[int, int]:
    """(blocks run through torch.utils.checkpoint, updates x blocks) of a two-update
    distillation run."""
    model, tok = load_pretrained("tiny-arith", device="cpu")
    config = DistillConfig(steps=2, batch_size=4, eval_every=0, eval_examples=1,
                           eval_max_new_tokens=4, val_fraction=0.0, checkpoint_minutes=0,
                           progress=False, activation_checkpointing=checkpointing,
                           output_dir=str(tmp_path / f"sft-{checkpointing}"))
    calls, updates = [0], []

    def counting(*args, **kwargs):
        calls[0] += 1
        return torch_checkpoint(*args, **kwargs)

    monkeypatch.setattr(qwen3, "checkpoint", counting)
    train_distillation(model, tok, TRACES, HELD_OUT, "cpu", config,
                       phase_hook=lambda phase, step: updates.append(step)
                       if phase == "update" else None)
    assert model.activation_checkpointing == checkpointing
    assert len(updates) == 2
    return calls[0], len(updates) * model.cfg.num_hidden_layers


def test_the_distillation_config_field_checkpoints_its_updates(tmp_path, monkeypatch):
    """train_distillation (chapter 9, `--activation-checkpointing`) switches it on for the
    student: every block of every update runs through torch.utils.checkpoint (the prompt's
    shared prefix included: the rows run whole), nothing without it."""
    assert _sft_checkpointed_blocks(tmp_path, monkeypatch, False)[0] == 0
    calls, blocks = _sft_checkpointed_blocks(tmp_path, monkeypatch, True)
    assert calls == blocks
