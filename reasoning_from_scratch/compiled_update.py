"""The compiled update's padded shapes (a systems layer of the training step).

The update's log-prob pass can run its decoder blocks through `torch.compile`. To compile each
shape once, every micro-batch is padded to one of a few shapes known before the run
(`FixedShape`, `pad_to_shape`), and the blocks run through `compiled_block`.
`grpo.token_logprobs_and_entropy(..., fixed_shape=...)` is the one place the core calls this
module (`padded_hidden`); with `fixed_shape=None` (the default run) none of it runs.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

COLUMN_MULTIPLE = 8  # completion buckets are whole multiples of this (vector/tensor-core width)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _even_sizes(full: int, buckets: int, multiple: int = 1) -> tuple[int, ...]:
    """`buckets` evenly spaced sizes up to `full`: ceil(full * k / buckets) for k = 1..buckets,
    each rounded up to a multiple of `multiple` but never past `full`; ascending, distinct."""
    sizes = {min(full, _ceil_div(_ceil_div(full * k, buckets), multiple) * multiple)
             for k in range(1, buckets + 1)}
    return tuple(sorted(sizes))


def _smallest_holding(sizes: tuple[int, ...], n: int) -> int:
    """The smallest of `sizes` that is >= n; n itself when none is."""
    return next((size for size in sizes if size >= n), n)


@dataclass(frozen=True)
class FixedShape:
    """The shapes the micro-batches of the log-prob pass are padded to, so that the decoder blocks
    see only a few shapes, known before the run starts (`compiled_block` compiles them with
    symbolic batch and length sizes, a few graphs for all of them, and the training loop runs
    every one before its first step: `systems._warm_up_update`): at most `rows` rollouts,
    `prompt_cols` prompt columns (more left padding) and at most `completion_cols` completion
    columns (more right padding). A batch larger than that (never in a GRPO run, whose bounds
    are its largest micro-batch, longest training prompt and token budget) is padded to its own
    size instead.
    compile: run the blocks through `compiled_block`; False pads only (what the equivalence
    tests compare with).

    buckets: sizes per dimension (length buckets). Rows and completion columns each get
    `buckets` evenly spaced sizes up to their bound (`row_sizes`, `completion_sizes`; the
    completion sizes rounded up to a multiple of COLUMN_MULTIPLE), and a micro-batch is padded
    to the smallest size of each that holds it (`bucket`), so the padding is at most about
    1/buckets of each bound while the graphs stay at most buckets**2 shapes. Evenly spaced
    rather than halving (bound / 2**k): a step's batch is as wide as its longest completion,
    which for dozens of rollouts lies near the token budget (75-103 of 112 tokens in the
    chapter 7 default run) and as tall as its groups with signal (40-104 of 128 rows there),
    so halves would leave nearly every batch in the top bucket. The prompt columns stay at
    their one bound: a batch's prompt width, its longest prompt, varies little (53-56 of 56
    tokens for 16 prompts of the default run's data), so their padding is cheap, and
    bucketing them too would multiply the graphs."""

    rows: int
    prompt_cols: int
    completion_cols: int
    compile: bool = True
    buckets: int = 1

    def __post_init__(self):
        for name in ("rows", "prompt_cols", "completion_cols", "buckets"):
            if not getattr(self, name) >= 1:
                raise ValueError(f"FixedShape.{name} must be >= 1, got {getattr(self, name)}")

    def row_sizes(self) -> tuple[int, ...]:
        """The row buckets, ascending; the last is `rows`."""
        return _even_sizes(self.rows, self.buckets)

    def completion_sizes(self) -> tuple[int, ...]:
        """The completion-column buckets, ascending; the last is `completion_cols`."""
        return _even_sizes(self.completion_cols, self.buckets, COLUMN_MULTIPLE)

    def shape_count(self) -> int:
        """Distinct padded shapes a run can make (each one graph per grad/autocast setting)."""
        return len(self.row_sizes()) * len(self.completion_sizes())

    def bucket(self, rows: int, prompt_cols: int, completion_cols: int) -> tuple[int, int, int]:
        """The padded (rows, prompt columns, completion columns) of a batch of these sizes: the
        smallest bucket holding it, its own size where it exceeds every bucket."""
        return (_smallest_holding(self.row_sizes(), rows), max(self.prompt_cols, prompt_cols),
                _smallest_holding(self.completion_sizes(), completion_cols))


def pad_to_shape(input_ids, attention_mask, prompt_len, shape: FixedShape, pad_id=0):
    """A packed batch (B, L) (prompts left-padded to `prompt_len`, then completions) padded to
    its bucket of `shape` (`FixedShape.bucket`): (ids (R, P' + T'), attention mask (R, P' + T')
    long, left offset). Real tokens keep their rotary positions (positions count real tokens
    only) and see the same keys (padding is masked; causal attention hides the right padding),
    so their hidden states are the unpadded ones up to float rounding. Rows B.. are all padding;
    their outputs are never read."""
    B, L = input_ids.shape
    rows, prompt_cols, completion_cols = shape.bucket(B, prompt_len, L - prompt_len)
    cols = prompt_cols + completion_cols
    left = prompt_cols - prompt_len
    ids = input_ids.new_full((rows, cols), pad_id)
    ids[:B, left:left + L] = input_ids
    mask = torch.zeros(rows, cols, dtype=torch.long, device=input_ids.device)
    mask[:B, left:] = 1  # right padding counts as real, as in `pack_rollouts` (causal: unseen)
    if attention_mask is not None:
        mask[:B, left:left + L] = attention_mask.long()
    return ids, mask, left


def _run_block(block, x, cos, sin, attn_mask):
    """One decoder block, the function `compiled_block` compiles."""
    return block(x, cos, sin, attn_mask)


def _symbolic_sizes(x, cos, sin, attn_mask) -> None:
    """Mark the batch and length dimensions of a block's inputs as symbolic, so that one graph
    serves every padded shape of a run (x, cos, sin (B, T, .); attn_mask (B, 1, T, T)) instead
    of one graph per shape. `maybe_`: where the compiler still has to specialise a size (the
    CPU backend, for one, picks its reduction code by B x T), it makes another graph rather
    than fail; the run's warm-up meets every padded shape, so such graphs too are made before
    the first step."""
    for t in (x, cos, sin):
        torch._dynamo.maybe_mark_dynamic(t, 0)
        torch._dynamo.maybe_mark_dynamic(t, 1)
    for dim in (0, 2, 3):
        torch._dynamo.maybe_mark_dynamic(attn_mask, dim)


# torch.compile of `_run_block`, made on first use (building it imports the compiler). The
# blocks' parameters are graph inputs, so one graph serves every block of every model of one
# architecture; each grad mode, train/eval mode, autocast setting and frozen model (its
# parameters' requires_grad) adds one, and a size range the backend specialises on another.
_COMPILED_BLOCK: dict = {}
# model -> why compiling its training block failed; its later passes run eagerly.
_BLOCK_COMPILE_FAILURES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
BLOCK_RECOMPILE_LIMIT = 16  # graphs kept for the block per padded shape (torch's default: 8)


def compiled_block(model, shapes: int = 1) -> Callable:
    """`forward_hidden`'s block_fn for the training path: each decoder block through
    `torch.compile(fullgraph=True)` with symbolic batch and length sizes (`_symbolic_sizes`),
    or eagerly, with one warning per model, if compiling fails (with fullgraph a failure is
    raised while tracing the forward, before the block ran). Without any padding
    `forward_hidden` passes no mask; the causal one is built here, so that such a batch uses
    the same graph as the padded ones. shapes: the padded shapes it will see
    (`FixedShape.shape_count`); torch's recompile limits are raised to BLOCK_RECOMPILE_LIMIT
    graphs per shape, so no bucket ever falls back to eager."""

    def run(block, x, cos, sin, attn_mask):
        if attn_mask is None:
            B, T = x.shape[:2]
            causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            attn_mask = causal.expand(B, T, T).contiguous()[:, None]  # (B, 1, T, T)
        if model not in _BLOCK_COMPILE_FAILURES:
            try:
                if "block" not in _COMPILED_BLOCK:
                    _COMPILED_BLOCK["block"] = torch.compile(_run_block, fullgraph=True)
                _symbolic_sizes(x, cos, sin, attn_mask)
                limit = max(torch._dynamo.config.recompile_limit,
                            BLOCK_RECOMPILE_LIMIT * shapes)
                total = max(torch._dynamo.config.accumulated_recompile_limit, limit)
                with torch._dynamo.config.patch(recompile_limit=limit,
                                                accumulated_recompile_limit=total):
                    return _COMPILED_BLOCK["block"](block, x, cos, sin, attn_mask)
            except Exception as e:  # compiler missing, unsupported op, recompile limit hit
                why = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
                _BLOCK_COMPILE_FAILURES[model] = why
                warnings.warn(f"torch.compile of the training block failed ({why}); running "
                              "it eagerly", RuntimeWarning, stacklevel=2)
        return block(x, cos, sin, attn_mask)

    return run


def padded_hidden(model, input_ids, attention_mask, prompt_len, shape: FixedShape):
    """`model.forward_hidden` of a batch padded to its bucket of `shape` (compiled blocks when
    `shape.compile`): (B, L, H), the batch's own positions only."""
    B, L = input_ids.shape
    ids, padded_mask, left = pad_to_shape(input_ids, attention_mask, prompt_len, shape)
    block_fn = compiled_block(model, shape.shape_count()) if shape.compile else None
    hidden = model.forward_hidden(ids, padded_mask, block_fn=block_fn)  # (R, L', H)
    return hidden[:B, left:left + L]
