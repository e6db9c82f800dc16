"""The first-use check of the compiled paths: before a training run trusts `torch.compile`'s
decode step (`generate(compile=True)`, CUDA graphs on a GPU) and the update's compiled decoder
blocks (`compiled_update.compiled_block`), it runs each once beside the eager code on its own
model and prompts and compares the two, at the run's own precision (a bfloat16 sampler against
itself run eagerly, the update's autocast against itself).

What is compared, and within what:
- decoding, as the run decodes: one batch greedily (the evaluation) and one sampled at the
  rollouts' temperature and top-p (`sampled`), compiled and eager from the same per-row random
  streams (one `torch.Generator` per row, seeded `seed + row`: both paths draw the same
  uniforms, `generation.row_uniforms`). The tokens are compared one for one; where they part,
  and at every other token, what decides is whether the compiled step's choice is the choice
  of the eager sampler (`generation.pick_token`) on the eager model's logits of the same prefix
  (read teacher-forced, one row at a time) given that token's uniform, up to rounding: for a
  greedy token the eager max logit minus the chosen token's logit (`max_logit_gap`), for a
  sampled one how far the uniform lies outside the probability mass that picks the token
  (`max_uniform_gap`, a fraction of the total mass). The log-prob the compiled step recorded
  for each token is compared with the eager one of the same token (`max_logprob_diff`).
- the update: the per-token log-probs of the same rows through the compiled blocks and
  eagerly, both under the update's autocast.

The tolerances are what rounding alone does to the same values at the same precision,
measured in the run itself: the eager values computed two correct ways, one token at a time over
a KV cache (as decoding runs) and the whole sequence in one pass (as the update runs), which sum
in other orders as a compiled kernel does (`stepwise_rounding`, `_stepwise_rounding`). A
log-prob is a logit minus the log-sum-exp, so the same figure bounds a difference of two logits
(the greedy gap); log-probs within t move a cumulative mass by at most tanh(t / 2) (the uniform
gap). The update also compares the RMS difference of every logit, steadier than a largest
difference. Margins: ROUNDING_MARGIN, LOGPROB_MARGIN, RMS_MARGIN; at least FLOOR_ULPS units of
float32's roundoff at the values' size. The float32 weights are not the reference: a bfloat16
computation differs from a float32 one by its weights' rounding too, which the compiled and the
eager bfloat16 paths share, and a tolerance of that size let through faults it exists to catch
(a +2 logit, blocks 1% too large). What the check can and cannot see: docs/speed.md.
"""

from __future__ import annotations

import math

import torch

from .compiled_update import FixedShape, compiled_block, pad_to_shape
from .generation import _nucleus_keep, _token_logprob, generate, row_uniforms
from .grpo import token_logprobs_and_entropy
from .qwen3 import KVCache

__all__ = ["rounding_tolerance", "stepwise_rounding", "uniform_gaps", "check_decoding",
           "check_logprobs", "CHECK_ROWS"]

# Rows read teacher-forced (each one forward pass holding a (T, V) float32 logits block).
CHECK_ROWS = 8
# Rounding to allow for, as a multiple of what rounding alone makes (measured: docs/speed.md,
# "The first-use check"). A token's own choice (the greedy and the uniform gaps) is decided
# by the few logits near it: the correct compiled step's gaps stayed within 1x the rounding.
ROUNDING_MARGIN = 4.0
# The largest |log-prob difference| is the tail of a few hundred tokens: the correct compiled
# step reached 2.8x (decoding) and 4.1x (the update) the largest stepwise rounding.
LOGPROB_MARGIN = 8.0
# The RMS difference of every logit is steady: the correct compiled blocks made 1.26-1.50x
# the stepwise rounding's RMS on four batches, blocks 1% too large 4.0-4.5x.
RMS_MARGIN = 3.0
# Units of float32's roundoff at the values' size: a floor where the measured rounding is ~0
# (a fused kernel sums in another order: a few ulps per reduction, over a few dozen of them).
FLOOR_ULPS = 64


def rounding_tolerance(size: float, rounding: float | None,
                       margin: float = ROUNDING_MARGIN, dtype=torch.float32) -> float:
    """How far a second correct computation of some values may land from them: `margin` x
    `rounding` (the difference between the same values computed two correct ways at the run's
    precision; None when not measured), at least FLOOR_ULPS x eps(float32) x max(1, `size`)
    (`size`: the largest |value|) and one unit of roundoff of the model's `dtype` at that size
    (a fused bfloat16 kernel rounds the logits differently from the eager one by about that:
    the stepwise rounding, same kernels both ways, can miss it)."""
    eps = max(FLOOR_ULPS * torch.finfo(torch.float32).eps, torch.finfo(dtype).eps)
    floor = eps * max(1.0, size)
    return floor if rounding is None else max(floor, margin * rounding)


def _first_difference(a, b) -> list[int] | None:
    """[row, column] of the first position where two (B, T) token tensors differ (a shorter
    one counts as differing where it ends), None if equal."""
    T = min(a.shape[1], b.shape[1])
    diff = (a[:, :T] != b[:, :T]).nonzero()
    if diff.numel():
        return [int(diff[0, 0]), int(diff[0, 1])]
    return None if a.shape == b.shape else [0, T]


def _teacher_forced_logits(model, sequence, mask, prompt_len) -> torch.Tensor:
    """Float32 next-token logits (T, V) of one row's completion positions, in one pass."""
    return model(sequence[None], mask[None])[0, prompt_len - 1:-1].float()


def _row_generators(rows: int, seed: int, device) -> list[torch.Generator]:
    """One generator per row, row b's seeded `seed + b`: the random streams of one check."""
    return [torch.Generator(device).manual_seed(seed + b) for b in range(rows)]


def _drawn_uniforms(rows: int, steps: int, seed: int, device) -> torch.Tensor:
    """(rows, steps) the uniforms `generate` draws with `_row_generators(rows, seed)`: token t
    of row b gets the t-th draw of row b's stream (one `row_uniforms` call per token)."""
    gens = _row_generators(rows, seed, device)
    draws = [row_uniforms(rows, gens, device) for _ in range(steps)]  # each (rows, 1)
    return torch.cat(draws, dim=1) if draws else torch.zeros(rows, 0, device=device)


def uniform_gaps(logits, tokens, r, temperature: float, top_p: float) -> torch.Tensor:
    """How far each row's uniform lies from the probability mass that makes
    `generation.pick_token` choose `tokens` (n,) from logits (n, V) given uniforms r (n,):
    0 where it chooses them, else the distance to that token's interval of the (top-p
    filtered) cumulative mass, as a fraction of the total mass (n,). The same arithmetic as
    pick_token (inverse-transform sampling: the first token whose cumulative mass reaches
    u = (1 - r) x total)."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)  # (n, V)
    rank = tokens[:, None]  # (n, 1) the token's place in sampling order
    if top_p is not None and top_p < 1.0:
        probs, order = torch.sort(probs, dim=-1, descending=True)
        probs = probs * _nucleus_keep(probs, top_p)
        rank = order.argsort(dim=-1).gather(-1, rank)
    cdf = probs.cumsum(dim=-1)  # (n, V)
    total = cdf[:, -1]  # (n,)
    hi = cdf.gather(-1, rank)[:, 0]  # (n,) mass up to and including the token
    lo = hi - probs.gather(-1, rank)[:, 0]  # (n,) mass before it
    u = (1.0 - r) * total  # (n,)
    return ((lo - u).clamp(min=0) + (u - hi).clamp(min=0)) / total


def stepwise_rounding(logprobs, model, sequences, attention_mask, completion_mask,
                      temperature: float) -> float:
    """The largest |difference| between `logprobs` (B, T) of the completion tokens computed one
    token at a time (a KV-cache decode, or `_stepwise_logprobs`) and the same log-probs from
    one teacher-forced pass per row (B <= CHECK_ROWS rows): what rounding alone does to them
    at the model's precision. sequences (B, P + T), attention_mask (B, P) of the prompts."""
    P, worst = attention_mask.shape[1], 0.0
    for i in range(sequences.shape[0]):
        real = completion_mask[i]
        if not real.any():
            continue
        mask = torch.cat([attention_mask[i].bool(), real])
        logits = _teacher_forced_logits(model, sequences[i], mask, P)[real]  # (n, V)
        exact = _token_logprob(logits, sequences[i, P:][real], temperature)  # (n,)
        worst = max(worst, float((logprobs[i][real] - exact).abs().max()))
    return worst


def _choice_figures(policy, ids, mask, out, uniforms, temperature, top_p, rows) -> dict:
    """The compiled output `out` read against the eager model on its own prefixes, over `rows`:
    max_gap (greedy: eager max logit - chosen logit; sampled: `uniform_gaps`), max_logprob_diff
    (the recorded log-prob against the eager one of the same token), size (the largest
    |log-prob|)."""
    P, greedy = ids.shape[1], not temperature or temperature <= 0
    gap = diff = size = 0.0
    for i in rows:
        real = out.completion_mask[i]
        if not real.any():
            continue
        logits = _teacher_forced_logits(policy, out.sequences[i],
                                        torch.cat([mask[i].bool(), real]), P)[real]  # (n, V)
        chosen = out.completion_ids[i][real]  # (n,)
        if greedy:
            gaps = logits.max(-1).values - logits.gather(-1, chosen[:, None])[:, 0]
        else:
            gaps = uniform_gaps(logits, chosen, uniforms[i, :chosen.numel()], temperature, top_p)
        eager = _token_logprob(logits, chosen, temperature)  # (n,)
        gap = max(gap, float(gaps.max()))
        diff = max(diff, float((out.logprobs[i][real] - eager).abs().max()))
        size = max(size, float(eager.abs().max()))
    return {"max_gap": gap, "max_logprob_diff": diff, "size": size}


def _decode_once(policy, input_ids, attention_mask, max_new_tokens, eos_token_id,
                 temperature, top_p, seed) -> dict:
    """One decoding compiled and eager from the same per-row streams -> a report: rows, tokens
    (compiled, real), tokens_equal, first_difference, max_gap, gap_tolerance,
    max_logprob_diff, logprob_tolerance, logprob_rounding, ok; and "output" (not JSON)."""
    B, dev = input_ids.shape[0], input_ids.device
    outs = [generate(policy, input_ids, attention_mask, max_new_tokens=max_new_tokens,
                     temperature=temperature, top_p=top_p, eos_token_id=eos_token_id,
                     generator=_row_generators(B, seed, dev), return_logprobs=True,
                     compile=compile) for compile in (True, False)]
    fast, eager = outs
    first = _first_difference(fast.completion_ids * fast.completion_mask,
                              eager.completion_ids * eager.completion_mask)
    rows = sorted({*range(min(CHECK_ROWS, B)), *([first[0]] if first else [])})
    greedy = not temperature or temperature <= 0
    uniforms = None if greedy else _drawn_uniforms(B, fast.completion_ids.shape[1], seed, dev)
    found = _choice_figures(policy, input_ids, attention_mask, fast, uniforms, temperature,
                            top_p, rows)
    rounding = stepwise_rounding(eager.logprobs[rows], policy, eager.sequences[rows],
                                 attention_mask[rows], eager.completion_mask[rows], temperature)
    dtype = next(policy.parameters()).dtype
    lp_tol = rounding_tolerance(found["size"], rounding, LOGPROB_MARGIN, dtype)
    gap_tol = rounding_tolerance(found["size"], rounding, dtype=dtype)  # a logit difference
    if not greedy:  # log-probs within t move a cumulative mass by at most tanh(t / 2)
        gap_tol = math.tanh(gap_tol / 2)
    gap, diff = found["max_gap"], found["max_logprob_diff"]
    return {"rows": B, "tokens": int(fast.completion_mask.sum()), "tokens_equal": first is None,
            "first_difference": first, "max_gap": gap, "gap_tolerance": gap_tol,
            "max_logprob_diff": diff, "logprob_tolerance": lp_tol,
            "logprob_rounding": rounding,
            "ok": math.isfinite(gap) and math.isfinite(diff) and gap <= gap_tol
            and diff <= lp_tol, "output": fast}


@torch.no_grad()
def check_decoding(policy, input_ids, attention_mask, max_new_tokens: int, eos_token_id,
                   reference=None, temperature: float = 1.0, top_p: float = 1.0,
                   seed: int = 0) -> dict:
    """Decoding of `input_ids` (B, P) with the compiled step and eagerly, greedily and sampled
    at `temperature` / `top_p` (the rollouts' settings; temperature 0: greedy only), each from
    per-row streams seeded `seed + row` -> a report: the greedy figures (rows, tokens,
    tokens_equal, first_difference ([row, col] or None), max_logit_gap, logit_tolerance,
    max_logprob_diff, logprob_tolerance, logprob_rounding), "sampled" (the same for the sampled
    batch, its gap `max_uniform_gap` within `uniform_tolerance`), and ok (both within their
    tolerances). `reference`: no longer read (the tolerance is measured at the policy's own
    precision); kept for callers. Returns also the greedy compiled output under "output"."""
    del reference
    greedy = _decode_once(policy, input_ids, attention_mask, max_new_tokens, eos_token_id,
                          0.0, 1.0, seed)
    report = _renamed(greedy, "logit")
    ok = greedy["ok"]
    if temperature and temperature > 0:
        sampled = _decode_once(policy, input_ids, attention_mask, max_new_tokens, eos_token_id,
                               temperature, top_p, seed)
        sampled.pop("output")
        report["sampled"] = {"temperature": temperature, "top_p": top_p, "seed": seed,
                             **_renamed(sampled, "uniform")}
        ok = ok and sampled["ok"]
    report["ok"] = ok
    return report


def _renamed(found: dict, what: str) -> dict:
    """`_decode_once`'s report with its gap named for what it measures (max_logit_gap, ...)."""
    names = {"max_gap": f"max_{what}_gap", "gap_tolerance": f"{what}_tolerance"}
    return {names.get(k, k): v for k, v in found.items()}


def _answer_hidden(model, input_ids, attention_mask, prompt_len, shape) -> torch.Tensor:
    """Final hidden states (B, T, C) at the positions that predict the completion tokens of
    input_ids (B, P + T), the batch padded to `shape` and its blocks compiled
    (`compiled_update.pad_to_shape`, `compiled_update.compiled_block`: the update's path), or
    eager for None."""
    B, L = input_ids.shape
    if shape is None:
        return model.forward_hidden(input_ids, attention_mask)[:, prompt_len - 1:-1]
    ids, mask, left = pad_to_shape(input_ids, attention_mask, prompt_len, shape)
    block_fn = compiled_block(model, shape.shape_count()) if shape.compile else None
    hidden = model.forward_hidden(ids, mask, block_fn=block_fn)  # (R, L', C)
    return hidden[:B, left + prompt_len - 1:left + L - 1]


def _sum_sq(a, b, real) -> tuple[float, int]:
    """(sum of (a - b)^2, count) over the float32 logits (n, V) of the `real` (n,) rows."""
    d = (a.float() - b.float())[real]
    return float(d.pow(2).sum()), d.numel()


def _stepwise_rounding(model, input_ids, attention_mask, prompt_len, completion_mask, eager,
                       temperature) -> tuple[float, float]:
    """What rounding alone does to the update's logits: the logits of the completion positions
    computed one token at a time over a KV cache (the prompt prefilled, then each completion
    token fed) against the one-pass ones, `model.lm_head(eager)` (eager: (B, T, C) final hidden
    states) -> (RMS difference of all logits, largest |difference| of the tokens' log-probs)."""
    cache = KVCache(model.cfg.num_hidden_layers)
    mask, L = attention_mask.bool(), input_ids.shape[1]
    sq, n, worst = 0.0, 0, 0.0
    logits = model(input_ids[:, :prompt_len], mask[:, :prompt_len], cache, last_only=True)
    for t in range(prompt_len, L):
        step, once = logits[:, -1], model.lm_head(eager[:, t - prompt_len])  # (B, V)
        real = completion_mask[:, t - prompt_len]  # (B,)
        part = _sum_sq(step, once, real)
        sq, n = sq + part[0], n + part[1]
        lp = [_token_logprob(z, input_ids[:, t], temperature)[real] for z in (step, once)]
        worst = max([worst, *(lp[0] - lp[1]).abs().tolist()])
        if t + 1 < L:
            logits = model(input_ids[:, t:t + 1], mask[:, t:t + 1], cache, last_only=True)
    return math.sqrt(sq / max(n, 1)), worst


def _logit_rms(model, compiled, eager, completion_mask) -> tuple[float, float]:
    """(RMS difference, largest |logit|) of the logits `model.lm_head` makes of two (B, T, C)
    final hidden states, over the real completion positions, one row at a time."""
    sq, n, size = 0.0, 0, 0.0
    for i in range(compiled.shape[0]):
        real = completion_mask[i]
        a, b = model.lm_head(compiled[i]), model.lm_head(eager[i])  # (T, V)
        part = _sum_sq(a, b, real)
        sq, n = sq + part[0], n + part[1]
        size = max(size, float(b[real].float().abs().max())) if real.any() else size
    return math.sqrt(sq / max(n, 1)), size


def check_logprobs(model, input_ids, attention_mask, prompt_len: int, completion_mask,
                   shape: FixedShape, autocast, chunk_size: int = 1024,
                   temperature: float = 1.0) -> dict:
    """The update's logits of a packed batch (B, L) through the compiled blocks (`shape`, its
    `compile` on) and eagerly, both under `autocast()` (a factory of the update's autocast
    context), in train mode -> a report: rows; max_logprob_diff (the per-token log-probs with
    gradients on, the graph the update runs; nothing is backpropagated) within
    logprob_tolerance (LOGPROB_MARGIN x logprob_rounding); logit_rms (the RMS difference of
    every logit of the first CHECK_ROWS rows' completion positions, no gradients: the
    reference model's graph) within logit_rms_tolerance (RMS_MARGIN x logit_rms_rounding); ok.
    The roundings: the eager values against themselves computed one token at a time over a KV
    cache under the same autocast (`_stepwise_rounding`)."""
    was_training = model.training
    model.train()
    real = completion_mask.bool()

    def logprobs(fixed_shape):
        with autocast():
            logp, _ = token_logprobs_and_entropy(model, input_ids, attention_mask, prompt_len,
                                                 completion_mask, chunk_size, False,
                                                 temperature, fixed_shape)
        return logp.detach()

    rows = slice(0, CHECK_ROWS)
    args = (model, input_ids[rows], attention_mask[rows], prompt_len)
    try:
        compiled, eager = logprobs(shape), logprobs(None)
        with torch.no_grad(), autocast():
            hidden = [_answer_hidden(*args, s) for s in (shape, None)]  # 2 x (b, T, C)
            rms, size = _logit_rms(model, *hidden, real[rows])
            rms_rounding, lp_rounding = _stepwise_rounding(*args, real[rows], hidden[1],
                                                           temperature)
    finally:
        model.train(was_training)
    lp_tol = rounding_tolerance(float(eager[real].abs().max()) if real.any() else 0.0,
                                lp_rounding, LOGPROB_MARGIN)
    rms_tol = rounding_tolerance(size, rms_rounding, RMS_MARGIN)
    diff = float((compiled - eager)[real].abs().max()) if real.any() else 0.0
    return {"rows": int(input_ids.shape[0]), "max_logprob_diff": diff,
            "logprob_tolerance": lp_tol, "logprob_rounding": lp_rounding,
            "logit_rms": rms, "logit_rms_tolerance": rms_tol,
            "logit_rms_rounding": rms_rounding,
            "ok": math.isfinite(diff) and math.isfinite(rms) and diff <= lp_tol
            and rms <= rms_tol}
