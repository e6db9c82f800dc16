"""The first-use check of the compiled paths: before a training run trusts `torch.compile`'s
decode step (`generate(compile=True)`, CUDA graphs on a GPU) and the update's compiled decoder
blocks (`grpo.compiled_block`), it runs each once beside the eager code on its own model and
prompts and compares the two.

What is compared, and within what:
- decoding: one batch greedily, compiled and eager. Equal tokens are reported; what decides is
  whether every token the compiled step chose is an argmax of the eager model's logits on the
  same prefix (read teacher-forced, one row at a time), up to rounding. Greedy sequences may
  part where two logits tie within rounding; a stale weight, an overwritten buffer or a wrong
  mask leaves gaps far larger than that.
- the update: the per-token log-probs of the same rows through the compiled blocks and
  eagerly, under the update's autocast.

The tolerance of each is derived from the run itself (`rounding_tolerance`): four times what
rounding alone does to the same quantity at this precision, measured as the largest difference
between the eager values at the run's precision and in float32 (the trained float32 model
against a bfloat16 sampler, a float32 copy of a bfloat16 model, float32 log-probs against the
autocast ones), and at least `FLOOR_ULPS` units of float32's roundoff at the values' size
(float32 throughout: a fused kernel sums in another order).
"""

from __future__ import annotations

import contextlib
import copy
import math

import torch

from .generation import generate
from .grpo import FixedShape, token_logprobs_and_entropy

__all__ = ["rounding_tolerance", "float32_twin", "check_decoding", "check_logprobs",
           "CHECK_ROWS"]

# Rows read teacher-forced (each one forward pass holding a (T, V) float32 logits block).
CHECK_ROWS = 8
# Rounding to allow for, as a multiple of the largest difference rounding alone makes.
ROUNDING_MARGIN = 4.0
# Units of roundoff of the dtype at the values' size, where no higher precision is compared:
# a fused kernel sums in another order (a few ulps per reduction, over a few dozen of them).
FLOOR_ULPS = 64


def rounding_tolerance(size: float, rounding: float | None) -> float:
    """How far a second correct computation of some values may land from them:
    ROUNDING_MARGIN x `rounding` (the largest difference between the same values computed
    eagerly at the run's precision and in float32: what rounding does at this scale; None when
    the run computes in float32), at least FLOOR_ULPS x eps(float32) x max(1, `size`) (`size`:
    the largest |value|)."""
    floor = FLOOR_ULPS * torch.finfo(torch.float32).eps * max(1.0, size)
    return floor if rounding is None else max(floor, ROUNDING_MARGIN * rounding)


def float32_twin(model):
    """`model` itself if it computes in float32 or wider, else a frozen float32 copy (the
    higher precision the tolerance is measured against)."""
    if torch.finfo(model.dtype).bits >= 32:
        return model
    return copy.deepcopy(model).float().requires_grad_(False)


def _first_difference(a, b) -> list[int] | None:
    """[row, column] of the first position where two (B, T) token tensors differ (a shorter
    one counts as differing where it ends), None if equal."""
    T = min(a.shape[1], b.shape[1])
    diff = (a[:, :T] != b[:, :T]).nonzero()
    if diff.numel():
        return [int(diff[0, 0]), int(diff[0, 1])]
    return None if a.shape == b.shape else [0, T]


def _teacher_forced_logits(model, sequence, mask, prompt_len) -> torch.Tensor:
    """Float32 next-token logits (T, V) of one row's completion positions."""
    return model(sequence[None], mask[None])[0, prompt_len - 1:-1].float()


@torch.no_grad()
def check_decoding(policy, input_ids, attention_mask, max_new_tokens: int, eos_token_id,
                   reference=None) -> dict:
    """Greedy decoding of `input_ids` (B, P) with the compiled step and eagerly -> a report:
    rows, tokens (compiled, real), tokens_equal, first_difference ([row, col] or None),
    max_logit_gap (the largest eager max-logit minus the compiled choice's logit over the
    first CHECK_ROWS rows), logit_tolerance, ok. `reference`: the same weights at a higher
    precision (the trained float32 model behind a bfloat16 sampler), for the tolerance.
    Returns also the compiled output under "output" (not JSON)."""
    kw = dict(max_new_tokens=max_new_tokens, eos_token_id=eos_token_id)
    fast = generate(policy, input_ids, attention_mask, compile=True, **kw)
    eager = generate(policy, input_ids, attention_mask, compile=False, **kw)
    first = _first_difference(fast.completion_ids * fast.completion_mask,
                              eager.completion_ids * eager.completion_mask)
    P = input_ids.shape[1]
    if reference is None and policy.dtype != torch.float32:
        reference = float32_twin(policy)
    gap = size = 0.0
    rounding = None if reference is None else 0.0
    for i in range(min(CHECK_ROWS, input_ids.shape[0])):
        real = fast.completion_mask[i]
        mask = torch.cat([attention_mask[i].bool(), real])
        logits = _teacher_forced_logits(policy, fast.sequences[i], mask, P)[real]  # (n, V)
        if not logits.numel():
            continue
        chosen = fast.completion_ids[i][real]
        gap = max(gap, float((logits.max(-1).values
                              - logits.gather(-1, chosen[:, None])[:, 0]).max()))
        size = max(size, float(logits.abs().max()))
        if reference is not None:
            exact = _teacher_forced_logits(reference, fast.sequences[i], mask, P)[real]
            rounding = max(rounding, float((logits - exact).abs().max()))
    tol = rounding_tolerance(size, rounding)
    return {"rows": int(input_ids.shape[0]), "tokens": int(fast.completion_mask.sum()),
            "tokens_equal": first is None, "first_difference": first,
            "max_logit_gap": gap, "logit_tolerance": tol,
            "ok": math.isfinite(gap) and gap <= tol, "output": fast}


def check_logprobs(model, input_ids, attention_mask, prompt_len: int, completion_mask,
                   shape: FixedShape, autocast, chunk_size: int = 1024,
                   temperature: float = 1.0) -> dict:
    """The update's per-token log-probs of a packed batch (B, L) through the compiled blocks
    (`shape`, its `compile` on) and eagerly, both under `autocast()` (a factory of the update's
    autocast context), in train mode with gradients on (the graph the update runs; nothing is
    backpropagated) -> a report: rows, max_logprob_diff, logprob_tolerance (rounding measured
    against the eager float32 log-probs without autocast), ok."""
    was_training = model.training
    model.train()
    real = completion_mask.bool()

    def logprobs(net, fixed_shape, ctx):
        with ctx():
            logp, _ = token_logprobs_and_entropy(net, input_ids, attention_mask, prompt_len,
                                                 completion_mask, chunk_size, False,
                                                 temperature, fixed_shape)
        return logp.detach()[real]

    try:
        compiled = logprobs(model, shape, autocast)
        eager = logprobs(model, None, autocast)
        with torch.no_grad():  # float32 weights, no autocast
            exact = logprobs(float32_twin(model), None, contextlib.nullcontext)
    finally:
        model.train(was_training)
    rounding = None if torch.equal(eager, exact) else float((eager - exact).abs().max())
    size = float(eager.abs().max()) if eager.numel() else 0.0
    tol = rounding_tolerance(size, rounding)
    diff = float((compiled - eager).abs().max()) if compiled.numel() else 0.0
    return {"rows": int(input_ids.shape[0]), "max_logprob_diff": diff,
            "logprob_tolerance": tol, "ok": math.isfinite(diff) and diff <= tol}
