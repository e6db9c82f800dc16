"""Supervised fine-tuning: next-token training on completions, the one loop behind two chapters.

The bundled tiny model is pretrained with it (`tiny_world.build_tiny_model`) and a student is
distilled from a teacher's verified solutions with it (`distillation_training.train_distillation`,
chapter 9). A training document is a dict with a "prompt" and a "completion"; the loss covers the
completion and its EOS only (`collate`), never the prompt.

Batches are drawn without replacement from a seeded shuffle, grouped by length
(`length_bucketed_batches`) and right-padded, so no attention mask is needed (padding only
follows the real tokens of a causal model). The schedule is a pure function of the seed
(`batch_schedule`) and the learning rate a pure function of the step (`lr_at`), so a run resumed
at step k with its optimizer state continues exactly as if it had never stopped.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from tqdm import tqdm

from .distributed import all_reduce_sum, data_parallel, shard, world_size
from .fsdp import dummy_backward, is_sharded
from .interrupts import defer_interrupts
from .qwen3 import KVCache, at_least_float32

# ----------------------------------------------------------------------------------------------
# Documents -> padded batches
# ----------------------------------------------------------------------------------------------


def tokenize_documents(docs, tokenizer) -> list[tuple[list[int], list[int]]]:
    """(prompt_ids, completion_ids + [EOS]) per document, encoded separately like at inference."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("tokenizer has no EOS token id (check its tokenizer_config.json)")
    return [
        (tokenizer.encode(d["prompt"]), tokenizer.encode(d["completion"]) + [eos]) for d in docs
    ]


def shared_prefix_len(pairs) -> int:
    """Length of the token prefix all prompts share (the fixed instructions of the template).

    Kept at least one token short of the shortest prompt, so every row still predicts its first
    completion token from a position of its own.
    """
    first = pairs[0][0]
    n = min(len(p) for p, _ in pairs) - 1
    for p, _ in pairs:
        while n > 0 and p[:n] != first[:n]:
            n -= 1
    return max(n, 0)


def collate(pairs, pad_id: int, prefix_len: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded inputs (B, T) and targets (B, T), -100 on prompt and padding positions.

    The first `prefix_len` tokens (shared by every row) are left out of the inputs; position j
    of a row holds token prefix_len + j and is trained to predict token prefix_len + j + 1.
    """
    seqs = [p + c for p, c in pairs]
    T = max(len(s) for s in seqs) - 1 - prefix_len
    inputs = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    targets = torch.full((len(seqs), T), -100, dtype=torch.long)
    for i, ((p, c), s) in enumerate(zip(pairs, seqs)):
        inputs[i, : len(s) - 1 - prefix_len] = torch.tensor(s[prefix_len:-1])
        # Only completion tokens (incl. EOS) are scored: the first is predicted at len(p) - 1.
        start = len(p) - 1 - prefix_len
        targets[i, start : start + len(c)] = torch.tensor(c)
    return inputs, targets


def batch_logits(model, prefix: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    """Logits (B, T, V) of `inputs` that all continue the same `prefix` (P,) of token ids.

    The shared prefix (the prompt's fixed instructions, about a third of every sequence) is run
    once with batch size 1 and its keys/values are repeated for the B rows (KVCache.expand);
    gradients flow through the cache, so this equals running the full sequences, only cheaper.
    Padding is on the right, after every real token, so the causal mask alone suffices.

    With `model.activation_checkpointing` the rows run whole instead (prefix then inputs, the
    same logits): a block that writes a KV cache is never recomputed (`Qwen3Model._block`), so
    through the shared prefix's cache nothing would be checkpointed. The prefix's compute is
    then paid B times, for the memory of one block input per block.
    """
    if model.activation_checkpointing and prefix.numel() > 0:
        full = torch.cat([prefix.expand(inputs.shape[0], -1), inputs], dim=1)  # (B, P + T)
        return model.lm_head(model.forward_hidden(full)[:, prefix.numel():])  # (B, T, V)
    if prefix.numel() == 0:  # `forward` spelled out: a sharded model (fsdp.shard_model) runs
        return model.lm_head(model.forward_hidden(inputs))  # forward_hidden as its forward
    cache = KVCache(model.cfg.num_hidden_layers)
    model(prefix[None], cache=cache)  # (1, P) fills the cache; its logits are not needed
    cache.expand(inputs.shape[0])
    return model(inputs, cache=cache)  # (B, T, V)


def length_bucketed_batches(lengths, batch_size: int, rng, window: int = 8) -> list[list[int]]:
    """One epoch of batches: shuffle, sort each window of `window` batches by length, cut, shuffle.

    Sequences of similar length share a batch, so little compute goes to padding, while the
    window keeps the batches (and their mix of solution formats) close to random.
    """
    order = list(range(len(lengths)))
    rng.shuffle(order)
    batches = []
    for start in range(0, len(order), batch_size * window):
        chunk = sorted(order[start : start + batch_size * window], key=lengths.__getitem__)
        batches += [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return batches


def batch_schedule(lengths, batch_size: int, seed: int) -> Iterator[list[int]]:
    """Endless stream of batches (lists of document indices), epoch after epoch, from `seed`.

    A pure function of its arguments: skipping the first k batches reproduces a run's position
    after k steps, which is how a resumed run sees the same data as an uninterrupted one.
    """
    rng = random.Random(seed)
    while True:
        queue = length_bucketed_batches(lengths, batch_size, rng)
        while queue:
            yield queue.pop()


def lr_at(step: int, total: int, peak: float, warmup: int, min_ratio: float = 0.1) -> float:
    """Linear warmup to `peak`, then cosine decay to `min_ratio * peak` (Loshchilov & Hutter)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


# ----------------------------------------------------------------------------------------------
# Loss, optimizer, one step
# ----------------------------------------------------------------------------------------------


def completion_loss(model, prefix: torch.Tensor, inputs: torch.Tensor, targets: torch.Tensor,
                    reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of the completion tokens of a collated batch (prompt and padding are -100)."""
    logits = at_least_float32(batch_logits(model, prefix, inputs))  # (B, T, V)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100,
                           reduction=reduction)


def soft_distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                           targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """KL(teacher || student) of the next-token distributions, averaged over the scored
    positions of a collated batch (targets != -100), times temperature**2.

    Soft distillation (Hinton et al., 2015): the student matches the teacher's whole
    distribution at each completion position, not only the sampled token. Both (B, T, V) logit
    tensors are divided by `temperature` before the softmax; the factor temperature**2 keeps the
    gradient's scale comparable across temperatures.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    scored = targets != -100  # (B, T)
    student_logp = F.log_softmax(at_least_float32(student_logits)[scored] / temperature, dim=-1)
    teacher_logp = F.log_softmax(at_least_float32(teacher_logits)[scored] / temperature, dim=-1)
    kl = (teacher_logp.exp() * (teacher_logp - student_logp)).sum(-1)  # (scored positions,)
    return kl.mean() * temperature**2


def make_sft_optimizer(model, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW with weight decay on the matrices only (norm scales are not decayed)."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=lr,
        betas=(0.9, 0.95),
    )


def sft_step(model, optimizer, batch, pad_id: int, prefix: torch.Tensor, lr: float,
             grad_clip: float) -> tuple[float, int]:
    """One update on `batch` (list of (prompt_ids, completion_ids)); returns (loss, tokens).

    Data-parallel (distributed.py): every process gets the whole batch and trains on its
    contiguous share (`distributed.shard`); its summed loss is divided by the *whole* batch's
    completion tokens, so the gradients summed over the processes (by torch's DDP during the
    backward, `distributed.data_parallel`, or FSDP's reduce-scatter for a sharded model) are the
    one-process gradient of the mean loss. A process without rows runs a zero-weighted pass, so
    the others' collectives find a partner.
    """
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    total = sum(len(c) for _, c in batch)  # completion tokens (with EOS): the scored positions
    sharded = is_sharded(model)
    if world_size() == 1 and not sharded:  # the one-process loop, unchanged
        inputs, targets = collate(batch, pad_id, prefix.numel())
        inputs, targets = inputs.to(model.device), targets.to(model.device)
        loss = completion_loss(model, prefix, inputs, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        return loss.item(), total
    mine, local = shard(batch), 0.0
    net = model if sharded else data_parallel(model)  # replicas: the DDP view
    if mine:
        inputs, targets = collate(mine, pad_id, prefix.numel())
        inputs, targets = inputs.to(model.device), targets.to(model.device)
        loss = completion_loss(net, prefix, inputs, targets, reduction="sum") / total
        loss.backward()  # FSDP or DDP: summed over the processes during the backward
        local = loss.item()
    else:
        dummy_backward(net)  # the collectives need a partner on every process
    # on DTensor shards the norm is the whole gradient's, so clipping the shards is exact
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    return all_reduce_sum([local])[0], total


@torch.no_grad()
def mean_completion_loss(model, tokenizer, docs, batch_size: int = 64) -> float:
    """Token-weighted mean completion loss of `docs` (validation loss), in eval mode."""
    pairs = tokenize_documents(docs, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    empty = torch.empty(0, dtype=torch.long, device=model.device)
    for start in range(0, len(pairs), batch_size):
        inputs, targets = collate(pairs[start : start + batch_size], pad_id)
        inputs, targets = inputs.to(model.device), targets.to(model.device)
        total += completion_loss(model, empty, inputs, targets, reduction="sum").item()
        count += int((targets != -100).sum())
    model.train(was_training)
    return total / max(count, 1)


# ----------------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------------


def train_sft(
    model,
    tokenizer,
    docs,
    steps: int,
    batch_size: int = 64,
    lr: float = 2e-3,
    warmup: int = 100,
    weight_decay: float = 0.1,
    grad_clip: float = 1.0,
    min_lr_ratio: float = 0.1,
    seed: int = 0,
    share_prefix: bool = True,
    progress: bool = True,
    optimizer=None,
    start_step: int = 0,
    on_update: Callable[[int, dict], None] | None = None,
    after_update: Callable[[int], None] | None = None,
) -> list[float]:
    """Next-token training on the completions of `docs`; returns the loss of every step run.

    The loss covers only the completion (and its EOS), not the prompt: for the arithmetic world
    the prompt is a fixed template plus random problem numbers, i.e. either learned within a few
    steps or irreducible noise, and scoring it would spend a small model's capacity on predicting
    random operands; for distillation the prompt is the student's input, not its output. With
    `share_prefix` the prompt tokens every document shares are computed once per batch
    (`batch_logits`).

    Resuming: pass the restored `optimizer` and `start_step` = updates already made; the batch
    schedule and learning rate continue where they were. on_update(k, row) runs with update k
    (1-based) inside the same Ctrl-C-safe block (`defer_interrupts`), so whatever it records
    (a metrics row) always matches the weights; after_update(k) runs after it, interruptible
    (evaluations, checkpoints that guard themselves).
    """
    pairs = tokenize_documents(docs, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    P = shared_prefix_len(pairs) if share_prefix else 0
    prefix = torch.tensor(pairs[0][0][:P], dtype=torch.long, device=model.device)  # (P,)
    schedule = batch_schedule([len(p) + len(c) for p, c in pairs], batch_size, seed)
    for _ in range(start_step):  # the batches a resumed run has trained on already
        next(schedule)
    opt = optimizer if optimizer is not None else make_sft_optimizer(model, lr, weight_decay)
    model.train()
    losses = []
    bar = tqdm(range(start_step, steps), desc="sft", disable=not progress)
    for step in bar:
        batch = [pairs[i] for i in next(schedule)]
        step_lr = lr_at(step, steps, lr, warmup, min_lr_ratio)
        with defer_interrupts():
            loss, tokens = sft_step(model, opt, batch, pad_id, prefix, step_lr, grad_clip)
            losses.append(loss)
            if on_update is not None:
                on_update(step + 1, {"loss": loss, "lr": step_lr, "tokens": tokens})
        if after_update is not None:
            after_update(step + 1)
        if step % 10 == 0 or step == steps - 1:
            bar.set_postfix(loss=f"{sum(losses[-10:]) / len(losses[-10:]):.3f}")
    model.eval()
    return losses
