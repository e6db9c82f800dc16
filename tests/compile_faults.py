"""Faults a compiled path can have, injected on the CPU so that `compile_check` can be shown to
catch them (tests/test_compile_check.py): each replaces the compiled decode step
(`generation._compiled_step`) or the update's compiled block
(`compiled_update._COMPILED_BLOCK`) with the eager code plus one fault, as a broken kernel,
graph or weight refresh would run it.

Decode step faults (`faulty_decode_step(monkeypatch, fault, ...)`):
- "stale_uniforms": every step samples with the uniforms of the first call (a CUDA-graph input
  copied once at recording, not read at its address: `graph_replay` explains the semantics);
- "runner_up": +2.0 on every row's second largest logit;
- "scaled_block": every decoder block's output 1% too large;
- "stale_layer": one layer's weights from before an update (`old_layer`);
- "position": the new token's rotary position one too far.
Update faults (`faulty_update_block(monkeypatch, fault, ...)`): "scaled_block", "stale_layer",
"position" (the completion's rotary positions one on).
"""

from __future__ import annotations

import contextlib
import copy

import torch

from reasoning_from_scratch import compiled_update, generation

DECODE_FAULTS = ("stale_uniforms", "runner_up", "scaled_block", "stale_layer", "position")
UPDATE_FAULTS = ("scaled_block", "stale_layer", "position")
SCALE = 1.01  # "1% too large"
RUNNER_UP = 2.0  # logits added to the runner-up


@contextlib.contextmanager
def _scaled_outputs(layers):
    """Every layer's output x SCALE while inside."""
    hooks = [layer.register_forward_hook(lambda m, args, out: out * SCALE) for layer in layers]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


@contextlib.contextmanager
def _swapped_layer(model, index: int, old_layer):
    """model.model.layers[index] replaced by `old_layer` while inside."""
    new = model.model.layers[index]
    model.model.layers[index] = old_layer
    try:
        yield
    finally:
        model.model.layers[index] = new


def _logits(model, static, state, fault, old_layer, layer_index):
    """The decode step's logits (R, V) with `fault` in the forward pass."""
    if fault == "scaled_block":
        with _scaled_outputs(model.model.layers):
            return model.decode_static(state.token, state.real, static)
    if fault == "stale_layer":
        with _swapped_layer(model, layer_index, old_layer):
            return model.decode_static(state.token, state.real, static)
    if fault == "position":
        static.next_pos.add_(1)  # the rotary position of the fed token, one on
        logits = model.decode_static(state.token, state.real, static)
        static.next_pos.sub_(1)
        return logits
    logits = model.decode_static(state.token, state.real, static)
    if fault == "runner_up":
        second = logits.topk(2, dim=-1).indices[:, 1:]  # (R, 1)
        logits = logits.scatter_add(-1, second, torch.full_like(second, RUNNER_UP,
                                                                dtype=logits.dtype))
    return logits


def faulty_decode_step(monkeypatch, fault: str, old_layer=None, layer_index: int = 0) -> None:
    """`generate(compile=True)` runs `_static_step` eagerly with `fault` (module docstring)."""
    assert fault in DECODE_FAULTS, fault

    def make(model, device):
        first = []

        def step(static, state, r, *setting):
            if fault == "stale_uniforms" and r is not None:
                first.append(first[0] if first else r.clone())  # the recording's copy
                r = first[0]
            logits = _logits(model, static, state, fault, old_layer, layer_index)
            generation._record(state, logits, r, *setting)
        return step

    monkeypatch.setattr(generation, "_compiled_step", make)


def _one_position_on(cos, sin, model):
    """cos/sin (B, T, D) of positions p -> of p + 1 (the angle-sum formulas, with the tables'
    row 1: the angles of one position)."""
    cos1, sin1 = (t[1].to(cos.dtype) for t in model._rope_tables(2))  # (D,)
    return cos * cos1 - sin * sin1, sin * cos1 + cos * sin1


def faulty_update_block(monkeypatch, fault: str, model, old_layer=None, layer_index: int = 0,
                        from_col: int = 0) -> None:
    """The update's compiled block (`compiled_update.compiled_block`) replaced by the eager
    block with `fault` (module docstring); "position" moves the columns from `from_col` on (the
    padded batch's completion: `FixedShape.prompt_cols`) one position on, against the prompt's (a
    shift of every column alike would change nothing: rotary attention sees relative
    positions)."""
    assert fault in UPDATE_FAULTS, fault
    layer = model.model.layers[layer_index]

    def block_fn(block, x, cos, sin, attn_mask):
        if fault == "scaled_block":
            return block(x, cos, sin, attn_mask) * SCALE
        if fault == "stale_layer" and block is layer:
            return old_layer(x, cos, sin, attn_mask)
        if fault == "position":
            later = _one_position_on(cos[:, from_col:], sin[:, from_col:], model)
            cos, sin = (torch.cat([t[:, :from_col], s], dim=1) for t, s in zip((cos, sin), later))
        return block(x, cos, sin, attn_mask)

    monkeypatch.setitem(compiled_update._COMPILED_BLOCK, "block", block_fn)


def eager_update_block(monkeypatch) -> None:
    """The update's compiled block replaced by the eager block: a correct "compiled" path."""
    monkeypatch.setitem(compiled_update._COMPILED_BLOCK, "block", compiled_update._run_block)


def one_update(model, sequences, lr: float):
    """A copy of `model` after one AdamW step at `lr` on the next-token loss of `sequences`
    (B, L): every weight with a gradient moves by about `lr` (Adam's first step is lr x the
    sign of the gradient)."""
    new = copy.deepcopy(model).train()
    logits = new(sequences)[:, :-1]  # (B, L - 1, V)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             sequences[:, 1:].reshape(-1))
    torch.optim.AdamW(new.parameters(), lr=lr).zero_grad()
    loss.backward()
    torch.optim.AdamW(new.parameters(), lr=lr).step()
    return new.eval()
