"""The tolerances of the equivalence tests, derived rather than tuned: one home for them.

Two computations of the same quantity that sum in another order (two processes instead of one,
FSDP's reduce-scatter, a padded or chunked batch, a compiled kernel, another CPU's vector width)
differ by rounding alone; a test that compares them needs a bound that rounding cannot reach on
any machine and that a real difference (a lost row, a wrong mask or normalisation) exceeds.

- One forward or backward pass (`rounding_bound`): Higham & Mary's probabilistic analysis
  (SIAM J. Sci. Comput. 41(5), 2019, Theorem 2.4): a sum of n terms of size up to s computed in
  any order is within lambda * sqrt(n) * u * s of the exact value (u = eps / 2, the unit roundoff)
  with probability at least 1 - 2n exp(-lambda^2 (1 - u)^2 / 2); LAMBDA = 7 makes that 1 - 5e-8
  for the longest sums here (n ~ 1e3). The errors of the reductions along a pass add up as a
  random walk, so n is the number of terms summed along the whole pass (`forward_terms`), and
  each side of the comparison carries its own error (the factor 2).
- A training run (`training_bound`): the rounding of every step is amplified by the steps after
  it (AdamW divides by the root of small second moments), by a factor no formula gives. The runs
  compared are therefore made in float64, and their weights must agree to sqrt(eps) of how far
  training moved them: rounding (eps = 2.2e-16) passes unless amplified 6.7e7-fold, while a
  real difference changes the weights by far more than 1.5e-8 of the distance they moved.
  Measured on tests/test_distill_parallel.py's FSDP run (4 AdamW steps, weights moved 3.1e-2):
  max diff 1.65e-5 in float32 (4.5e3 x eps x moved), 1.6e-14 in float64 (2.3e3 x eps x moved)
  against the bound's 4.6e-10; one training row lost on one process: 2.9e-2.
- Numbers read back from metrics.csv (`printed_close`): written to 6 significant digits
  (`run_log.format_cell`), two values closer than that print at most one unit of the last digit
  apart.
"""

from __future__ import annotations

import math

import torch
from safetensors.torch import load_file

from reasoning_from_scratch.weights import SINGLE_FILE

LAMBDA = 7.0  # Higham & Mary (2019), Theorem 2.4: each bound fails with probability <= 5e-8
CSV_DIGITS = 6  # run_log.format_cell writes f"{v:.6g}"


def unit_roundoff(dtype: torch.dtype) -> float:
    """u = eps / 2: the largest relative error of one rounding to `dtype`."""
    return torch.finfo(dtype).eps / 2


def rounding_bound(scale: float, terms: int, dtype: torch.dtype = torch.float32) -> float:
    """The largest |a - b| of two summation orders of one pass over `terms` summed terms of size
    up to `scale` (module docstring): 2 * LAMBDA * sqrt(terms) * u * scale."""
    return 2 * LAMBDA * math.sqrt(terms) * unit_roundoff(dtype) * scale


def assert_rounded_alike(got, want, terms: int, dtype: torch.dtype | None = None) -> float:
    """`got` and `want` (tensors or dicts of them) are one computation summed in other orders:
    within `rounding_bound` of the size of `want`, in `want`'s dtype unless given. Returns the
    difference."""
    first = want if isinstance(want, torch.Tensor) else next(iter(want.values()))
    dtype = dtype or first.dtype
    diff, bound = max_diff(got, want), rounding_bound(max_abs(want), terms, dtype)
    assert diff <= bound, f"max diff {diff:.2e} > {bound:.2e} ({terms} terms, {dtype})"
    return diff


def forward_terms(cfg, seq_len: int) -> int:
    """Terms summed along one forward pass of a Qwen3 model (`qwen3.Qwen3Config`) over
    `seq_len` positions: per block the two RMSNorms' means (hidden), the q/k/v projections
    (hidden), the scores (head_dim), the weighted values (seq_len), the output projection
    (heads x head_dim), gate and up (hidden) and down (intermediate); then the final norm and
    lm_head (hidden). A backward pass sums as many again plus the positions of each weight
    gradient (`backward_terms`)."""
    heads_dim = cfg.num_attention_heads * cfg.head_dim
    per_block = (2 * cfg.hidden_size + cfg.hidden_size + cfg.head_dim + seq_len + heads_dim
                 + cfg.hidden_size + cfg.intermediate_size)
    return cfg.num_hidden_layers * per_block + 2 * cfg.hidden_size


def backward_terms(cfg, seq_len: int, positions: int) -> int:
    """Terms summed along a forward and backward pass: the forward's twice (the backward of each
    reduction is one of the same length) plus the `positions` (batch x length) that every weight
    gradient sums over."""
    return 2 * forward_terms(cfg, seq_len) + positions


def max_abs(tensors) -> float:
    """The largest |x| of a tensor or of the values of a dict or list of tensors."""
    if isinstance(tensors, torch.Tensor):
        return tensors.detach().abs().max().item()
    values = tensors.values() if isinstance(tensors, dict) else tensors
    return max(max_abs(t) for t in values)


def max_diff(a, b) -> float:
    """The largest |a - b| of two tensors or of two dicts of tensors (the same keys)."""
    if isinstance(a, torch.Tensor):
        return (a.detach() - b.detach()).abs().max().item()
    assert a.keys() == b.keys(), f"other tensors: {sorted(a.keys() ^ b.keys())}"
    return max(max_diff(a[k], b[k]) for k in a)


def saved_weights(model_dir, dtype: torch.dtype | None = None) -> dict:
    """The tensors of a saved model (Hugging Face layout) in the dtype they were saved in, or
    cast to `dtype` (a float32 start point of a float64 run, say: exact)."""
    state = load_file(f"{model_dir}/{SINGLE_FILE}")
    return state if dtype is None else {k: v.to(dtype) for k, v in state.items()}


def training_bound(moved: float, dtype: torch.dtype = torch.float64) -> float:
    """The largest max |w_a - w_b| of two runs of one training that differ in summation order
    alone: sqrt(eps(dtype)) x `moved` (max |w - w_0|, how far training moved the weights);
    meant for float64 runs (module docstring)."""
    return math.sqrt(torch.finfo(dtype).eps) * moved


def assert_trained_alike(a: dict, b: dict, start: dict, dtype: torch.dtype = torch.float64,
                         min_moved: float = 1e-3) -> float:
    """Weights `a` and `b` (state dicts) of two runs from the weights `start` moved alike:
    training moved them (by more than `min_moved`: real updates), and they differ by at most
    `training_bound`. Returns the difference."""
    for name, w in (("a", a), ("b", b)):
        dtypes = {t.dtype for t in w.values()}
        assert dtypes == {dtype}, f"run {name}'s weights are {dtypes}, not {dtype}"
    moved = max_diff(a, start)
    diff, bound = max_diff(a, b), training_bound(moved, dtype)
    assert moved > min_moved, f"training barely moved the weights ({moved:.2e})"
    assert diff <= bound, f"max weight diff {diff:.2e} > {bound:.2e} (moved {moved:.2e})"
    return diff


def printed_close(a: float, b: float, digits: int = CSV_DIGITS) -> bool:
    """a and b, read back from values written with `digits` significant digits, may be the same
    value: at most one unit of the last printed digit apart."""
    size = max(abs(a), abs(b))
    if size == 0:
        return True
    unit = 10.0 ** (math.floor(math.log10(size)) - digits + 1)
    return abs(a - b) <= unit * (1 + 1e-9)  # 1e-9: the binary representation of the decimals


def all_printed_close(xs, ys, digits: int = CSV_DIGITS) -> bool:
    """`printed_close` for every pair of two equally long sequences."""
    return len(xs) == len(ys) and all(printed_close(x, y, digits) for x, y in zip(xs, ys))
