"""GRPO maths: group-relative advantages, (chunked) per-token log-probs and entropies, the clipped
surrogate, the k3 KL estimate, loss aggregation, and `compute_grpo_loss` for one prompt.

References
- GRPO: Shao et al., "DeepSeekMath", arXiv 2402.03300, section 4.1 (eq. 3: clipped surrogate per
  token, averaged over each completion's tokens and over the group; eq. 4: k3 KL estimator).
- PPO clipping: Schulman et al., "Proximal Policy Optimization", arXiv 1707.06347, eq. 7.
- k3 KL estimator: J. Schulman, "Approximating KL divergence" (2020), http://joschu.net/blog/kl-approx.html
- DAPO: Yu et al., arXiv 2503.14476: clip-higher (a larger upper clip `epsilon_high`, section 3.1),
  token-level loss (section 3.3), overlong filtering of truncated completions (section 3.4).
- Dr. GRPO: Liu et al., "Understanding R1-Zero-Like Training", arXiv 2503.20783: no division by the
  group std (`scale_rewards="none"`) and no per-sequence length normalisation (`dr_grpo` loss).
- DeepSeek-R1 (arXiv 2501.12948) trained with epsilon = 10, i.e. clipping almost never active.
- GSPO: Zheng et al., "Group Sequence Policy Optimization", arXiv 2507.18071 (`gspo` loss: one
  length-normalised importance ratio per completion, clipped at the sequence level).
- CISPO: MiniMax, "MiniMax-M1", arXiv 2506.13585, section 3.1 (`cispo` loss: clip the stop-
  gradient importance weight, never drop a token's gradient).
- TIS: Yao, Liu et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL
  Training" (truncated importance sampling between the sampler's and the trainer's log-probs).
- DeepSeek-V3.2 (arXiv 2512.02556), "Off-Policy Sequence Masking" of far-off-policy negatives.
- GDPO: Liu et al., arXiv 2601.05242: normalise each reward component within its group before
  summing (`group_advantages_multi`).
- Log-probs at the sampling temperature: TRL's GRPOTrainer divides the logits by T.

Shapes: B rollouts (= N prompts x G rollouts each), L packed sequence length, Tc completion length,
V vocabulary, H hidden size.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .generation import sample_rollouts_batch
from .prompts import render_prompt
from .qwen3 import at_least_float32
from .rewards import build_reward
from .tokenizer import pad_id_of

LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "sequence", "gspo", "cispo")
SEQUENCE_LOSS_TYPES = ("sequence", "gspo")  # one ratio per completion; need (B,) advantages
SCALE_REWARDS = ("group", "batch", "none")
REWARD_NORMALIZATIONS = ("sum", "per_reward")  # GRPO's summed reward, GDPO's per-term
KL_ESTIMATORS = ("k3", "sequence")  # per-token k3 (DeepSeekMath), the book's sequence-level


# ----------------------------------------------------------------------------------------------
# Advantages
# ----------------------------------------------------------------------------------------------

def _equal_rows(x):
    """(N, 1) bool: rows whose values are all exactly equal (no signal; as `normalize_pool`)."""
    return (x == x[:, :1]).all(dim=1, keepdim=True)


def compute_advantage_stats(rewards_list):
    """Book chapter 7: group-normalised advantages (r - mean) / (std + 1e-4), their mean and std.

    A group whose rewards are all equal, or that has a single rollout (its std is undefined: NaN),
    carries no learning signal and gets exactly zero advantages, mean 0 and std 0 (the rule of
    `process.normalize_pool`; otherwise equal non-binary rewards such as 0.1 leave float rounding
    noise of ~1e-4 after the division).
    """
    rewards = torch.tensor(rewards_list, dtype=torch.float32)
    if rewards.numel() < 2 or bool((rewards == rewards[0]).all()):
        return torch.zeros_like(rewards), 0.0, 0.0
    advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-4)

    adv_avg = advantages.mean().item()  # always ~0: a property of the normalisation
    adv_std = advantages.std().item()  # ~1 with mixed rewards
    return advantages, adv_avg, adv_std


def group_advantages(rewards, scale_rewards="group", eps=1e-4):
    """Advantages (N, G) from rewards (N, G): subtract each group's mean, then scale.

    scale_rewards: "group" divides by each group's std (GRPO, DeepSeekMath section 4.1.2);
    "batch" divides by the std of all N x G rewards (less noisy with small groups); "none" keeps
    the centred rewards (Dr. GRPO, arXiv 2503.20783: the group std up-weights too-easy and too-hard
    questions). Std is torch's default (unbiased), matching `compute_advantage_stats`. A group
    whose rewards are all exactly equal gets exactly zero advantages in every mode (its float mean
    need not equal the rewards, e.g. seven rewards of 0.1, which left ~7e-5 after the division).
    """
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    if rewards.dim() == 1:
        rewards = rewards.unsqueeze(0)
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(
            f"group_advantages: rewards must be (N, G) with G >= 2, got {tuple(rewards.shape)}"
        )
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, got {scale_rewards!r}")
    centred = rewards - rewards.mean(dim=1, keepdim=True)  # (N, G)
    if scale_rewards == "none":
        adv = centred
    elif scale_rewards == "group":
        adv = centred / (rewards.std(dim=1, keepdim=True) + eps)  # (N, 1) group std
    else:
        adv = centred / (rewards.std() + eps)  # numel >= 2 since G >= 2
    return adv.masked_fill(_equal_rows(rewards), 0.0)


def group_advantages_multi(reward_components, weights=None, scale_rewards="group",
                           batch_normalize=True, eps=1e-4):
    """GDPO advantages (N, G): normalise each reward component in its group, weight, sum, rescale.

    GDPO (Liu et al., "Group reward-Decoupled Normalization Policy Optimization", arXiv
    2601.05242): GRPO on the *summed* reward maps different reward combinations to the same
    advantage (correct-but-unformatted vs formatted-but-wrong), so each component k gets its own
    group normalisation A_k = group_advantages(r_k, scale_rewards) (equal groups -> exact 0), then
    A = sum_k w_k A_k, then (batch_normalize, GDPO's default) A / std(A over all N x G), so the
    scale does not grow with the number of components. GDPO also subtracts the batch mean; here
    it is skipped because every group of A already has zero mean (each A_k is group-centred), and
    subtracting the float mean would turn zero-signal groups into tiny non-zero ones. The weights
    are applied after the per-component normalisation (our choice: a weight then means "share of
    the advantage", not "reward units"). reward_components: K tensors (N, G) (or one (K, N, G)).
    """
    comps = [torch.as_tensor(c, dtype=torch.float32) for c in reward_components]
    if not comps or any(c.shape != comps[0].shape for c in comps):
        raise ValueError("group_advantages_multi: needs >= 1 reward components of one shape (N, G)")
    weights = [1.0] * len(comps) if weights is None else [float(w) for w in weights]
    if len(weights) != len(comps):
        raise ValueError(f"{len(weights)} weights for {len(comps)} reward components")
    total = sum(w * group_advantages(c, scale_rewards, eps) for w, c in zip(weights, comps))
    if not batch_normalize or total.numel() < 2 or bool((total == total.flatten()[0]).all()):
        return total  # (N, G); all-equal (all zero) advantages stay exactly zero
    return total / (total.std() + eps)


# ----------------------------------------------------------------------------------------------
# Log-probabilities and entropies
# ----------------------------------------------------------------------------------------------

def _answer_log_softmax(model, token_ids, prompt_len):
    """Log-softmax rows (n, V) predicting the n answer tokens, and those tokens (n,)."""
    if token_ids.dim() != 1:
        raise ValueError(f"token_ids must be 1-D (prompt + answer), got {tuple(token_ids.shape)}")
    if prompt_len < 1:  # at or past the end: no answer tokens (0 log-prob, as in the book)
        raise ValueError(f"prompt_len must be >= 1, got {prompt_len}")
    logits = model(token_ids.unsqueeze(0)).squeeze(0).float()  # (T, V)
    logprobs = torch.log_softmax(logits, dim=-1)
    # Row t predicts token t+1, so the answer tokens token_ids[prompt_len:] come from rows
    # prompt_len-1 .. T-2.
    return logprobs[prompt_len - 1:-1], token_ids[prompt_len:]


def sequence_logprob(model, token_ids, prompt_len):
    """Book chapter 6: summed float32 log-probability of the answer tokens (0 if empty)."""
    rows, targets = _answer_log_softmax(model, token_ids, prompt_len)
    return rows.gather(1, targets.unsqueeze(-1)).squeeze(-1).sum()


def sequence_logprob_and_entropy(model, token_ids, prompt_len):
    """Book chapter 7: (summed answer log-prob, mean per-token entropy); 0 and 0 if empty."""
    rows, targets = _answer_log_softmax(model, token_ids, prompt_len)
    logp_all_steps = rows.gather(1, targets.unsqueeze(-1)).squeeze(-1).sum()
    if targets.numel() == 0:
        return logp_all_steps, rows.new_zeros(())
    step_entropy = -(rows.exp() * rows).sum(dim=-1)  # (n,) H = -sum_v p log p
    return logp_all_steps, step_entropy.mean()


def _logprob_entropy_chunk(head, h, targets, with_entropy, temperature=1.0):
    """log p(target) (n,) and entropy (n,) for hidden states h (n, H); logits live only here."""
    logits = at_least_float32(head(h))  # (n, V) float32 (float64 for a float64 model)
    if temperature != 1.0:
        logits = logits / temperature  # the distribution the sampler drew from (see caller)
    logprobs = torch.log_softmax(logits, dim=-1)
    logp = logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return logp, torch.zeros_like(logp)
    return logp, -(logprobs.exp() * logprobs).sum(dim=-1)


# ----------------------------------------------------------------------------------------------
# The compiled training block: micro-batches padded to a few fixed shapes
# ----------------------------------------------------------------------------------------------

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
    every one before its first step: `training._warm_up_update`): at most `rows` rollouts,
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



def warm_up_compiled_blocks(model, shape: FixedShape, backward: bool, chunk_size: int = 1024,
                            temperature: float = 1.0) -> int:
    """Run `token_logprobs_and_entropy` once at every padded shape of `shape` (each row bucket x
    completion bucket, `prompt_cols` prompt columns), so that the compiled blocks' graphs for
    the model's current mode, grad mode and autocast are all made now, not in a training step
    that first meets a bucket. A dummy batch of token 0 with one left-padding position (a real
    packed batch's masked path). backward: with gradients, and a backward pass taken with
    `torch.autograd.grad` (the backward graph compiles too, no `.grad` is written, no
    data-parallel hook fires); else without gradients. Returns the shapes run."""
    dev = model.device
    rows_list, cols_list = shape.row_sizes(), shape.completion_sizes()
    params = [p for p in model.parameters() if p.requires_grad]
    for rows in rows_list:
        for cols in cols_list:
            L = shape.prompt_cols + cols
            ids = torch.zeros(rows, L, dtype=torch.long, device=dev)
            mask = torch.ones(rows, L, dtype=torch.long, device=dev)
            mask[0, 0] = 0 if shape.prompt_cols > 1 else 1
            with torch.set_grad_enabled(backward):
                logp, _ = token_logprobs_and_entropy(model, ids, mask, shape.prompt_cols,
                                                     chunk_size=chunk_size, with_entropy=True,
                                                     temperature=temperature,
                                                     fixed_shape=shape)
                if backward and params:
                    torch.autograd.grad(logp.sum(), params, allow_unused=True)
    return len(rows_list) * len(cols_list)


def token_logprobs_and_entropy(model, input_ids, attention_mask=None, prompt_len=None,
                               completion_mask=None, chunk_size=1024, with_entropy=True,
                               temperature=1.0, fixed_shape: FixedShape | None = None):
    """Per-token answer log-probs and entropies (B, Tc), float32, 0 where not `completion_mask`.

    input_ids (B, L) = (left-padded) prompts followed by completions that all start at column
    `prompt_len`; attention_mask (B, L) marks real tokens (left padding 0). The final hidden states
    come from `model.forward_hidden`; `model.lm_head` is applied to at most `chunk_size` answer
    positions at a time, and under autograd each chunk is checkpointed, so neither the forward nor
    the backward pass ever holds more than one (chunk_size, V) float32 logits block (Qwen's V is
    151,936: all 64 x 512 positions at once would be 20 GB). Models without `forward_hidden` fall
    back to full logits (fine for small vocabularies).
    temperature: log-probs and entropies of softmax(logits / temperature), the distribution a
    sampler at that temperature draws from (before top-p), as TRL's GRPOTrainer computes them;
    1.0 (default) is the model's own distribution. With no answer token at all (an all-False
    mask) the zeros returned stay connected to the graph, so a loss built on them can backward.
    fixed_shape: pad the batch to its bucket of these shapes for the model's forward pass
    (`pad_to_shape`), and with its `compile` run the decoder blocks compiled
    (`compiled_block`); the log-probs are those of the unpadded batch (the lm_head and the loss
    see only its answer positions)."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (B, L), got {tuple(input_ids.shape)}")
    B, L = input_ids.shape
    if prompt_len is None or not 1 <= prompt_len <= L:
        raise ValueError(f"prompt_len (first completion column) must be in [1, {L}], "
                         f"got {prompt_len}")
    Tc = L - prompt_len
    if completion_mask is None:
        completion_mask = torch.ones(B, Tc, dtype=torch.bool, device=input_ids.device)
    if completion_mask.shape != (B, Tc):
        raise ValueError(
            f"completion_mask shape {tuple(completion_mask.shape)} != "
            f"(B, L - prompt_len) = {(B, Tc)}"
        )
    if hasattr(model, "forward_hidden") and fixed_shape is not None:
        ids, padded_mask, left = pad_to_shape(input_ids, attention_mask, prompt_len, fixed_shape)
        block_fn = compiled_block(model, fixed_shape.shape_count()) \
            if fixed_shape.compile else None
        hidden = model.forward_hidden(ids, padded_mask, block_fn=block_fn)  # (R, L', H)
        hidden = hidden[:B, left:left + L]  # (B, L, H): the batch's own positions
        head = model.lm_head
    elif hasattr(model, "forward_hidden"):
        hidden = model.forward_hidden(input_ids, attention_mask)  # (B, L, H)
        head = model.lm_head
    else:
        hidden = model(input_ids, attention_mask)  # (B, L, V): logits are the "hidden" states
        head = torch.nn.Identity()
    mask = completion_mask.bool()
    h = hidden[:, prompt_len - 1:-1][mask]  # (n, H): only real answer positions, row-major
    targets = input_ids[:, prompt_len:][mask]  # (n,)

    use_ckpt = torch.is_grad_enabled() and h.requires_grad
    logp_parts, ent_parts = [], []
    for s in range(0, h.shape[0], chunk_size):
        args = (head, h[s:s + chunk_size], targets[s:s + chunk_size], with_entropy, temperature)
        if use_ckpt:
            lp, ent = checkpoint(_logprob_entropy_chunk, *args, use_reentrant=False)
        else:
            lp, ent = _logprob_entropy_chunk(*args)
        logp_parts.append(lp)
        ent_parts.append(ent)

    dtype = torch.promote_types(hidden.dtype, torch.float32)  # the chunks' (float32 or wider)
    logp = hidden.new_zeros((B, Tc), dtype=dtype)
    entropy = hidden.new_zeros((B, Tc), dtype=dtype)
    if logp_parts:
        # masked_scatter fills the True positions in row-major order, matching h = hidden[mask].
        logp = logp.masked_scatter(mask, torch.cat(logp_parts))
        entropy = entropy.masked_scatter(mask, torch.cat(ent_parts))
    elif h.requires_grad:
        # No answer token: h is (0, H) and the sum of its (0, V) logits an exact 0 that still
        # has a grad_fn through the head too, so a loss on these zeros can call .backward() (all
        # gradients 0) and every parameter gets one (DDP reduces only once all of them have).
        zero = at_least_float32(head(h).sum()) * 0
        logp, entropy = logp + zero, entropy + zero
    return logp, entropy


# ----------------------------------------------------------------------------------------------
# Loss pieces
# ----------------------------------------------------------------------------------------------

def k3_kl(logp, ref_logp):
    """Per-token k3 estimate of KL(pi || pi_ref): exp(ref - logp) - (ref - logp) - 1.

    Always >= 0 and unbiased (Schulman 2020); DeepSeekMath eq. 4.
    """
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def clipped_surrogate(logp, old_logp, advantages, epsilon=0.2, epsilon_high=None):
    """PPO objective to maximise, per element: min(r A, clip(r, 1 - eps, 1 + eps_high) A).

    r = exp(logp - old_logp). The pessimistic `min` (Schulman et al. 2017, eq. 7) is, written with
    `where`: A x min(r, clip(r)) for A >= 0 (no reward for pushing r above 1 + eps_high) and
    A x max(r, clip(r)) for A < 0 (no reward for pushing r below 1 - eps), since multiplying by a
    negative A swaps min and max. Note the min/max act on the ratios: taking `max(rA, clip(r)A)`
    of the *products* for A < 0 would be the optimistic bound (tests/test_grpo.py shows the
    difference). `epsilon=None` disables clipping (book chapter 6); `epsilon_high` (DAPO
    clip-higher, section 3.1) defaults to `epsilon`. Advantages (B, 1) broadcast over (B, T).
    """
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * advantages
    if epsilon is None:
        return unclipped
    high = epsilon if epsilon_high is None else epsilon_high
    clipped = torch.clamp(ratio, 1.0 - epsilon, 1.0 + high) * advantages
    return torch.minimum(unclipped, clipped)


# How each loss type reduces a per-token quantity (its KL term, entropy bonus): the token-level
# types by themselves; GSPO like GRPO (per-sequence token mean, its 1/|y_i| length
# normalisation, then mean over sequences); CISPO like DAPO (all tokens of the batch).
_AGGREGATION = {"grpo": "grpo", "dapo": "dapo", "dr_grpo": "dr_grpo", "sequence": "sequence",
                "gspo": "grpo", "cispo": "dapo"}


def aggregate_loss(per_token_loss, mask, loss_type="grpo", max_completion_length=None):
    """Reduce a (B, T) per-token loss over the real tokens in `mask` to a scalar.

    grpo: mean over each sequence's tokens, then over sequences (DeepSeekMath eq. 3; long answers
    get less weight per token). dapo: mean over all tokens of the batch (DAPO section 3.3).
    dr_grpo: sum / (B x max_completion_length), a constant normaliser (Dr. GRPO section 3.1).
    sequence: sum over each sequence's tokens, mean over sequences (the book's chapter 6/7
    `-(advantages * summed_logps).mean()`). gspo reduces like grpo and cispo like dapo. Every
    normaliser is clamped to >= 1, so an empty batch or mask gives 0, not NaN.
    """
    if per_token_loss.shape != mask.shape:
        raise ValueError(
            f"per_token_loss {tuple(per_token_loss.shape)} and mask {tuple(mask.shape)} differ"
        )
    if loss_type not in _AGGREGATION:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    how = _AGGREGATION[loss_type]
    m = mask.to(per_token_loss.dtype)
    masked = per_token_loss * m
    B = max(per_token_loss.shape[0], 1)
    if how == "grpo":
        return (masked.sum(-1) / m.sum(-1).clamp(min=1)).sum() / B
    if how == "dapo":
        return masked.sum() / m.sum().clamp(min=1)
    if how == "dr_grpo":
        T = per_token_loss.shape[1] if max_completion_length is None else max_completion_length
        return masked.sum() / (B * max(T, 1))
    return masked.sum(-1).sum() / B  # sequence


def _as_column(advantages, logp):
    """Advantages (B,) -> (B, 1) to broadcast over tokens; (B, T) per-token ones pass through."""
    if advantages.dim() == 1 and advantages.shape[0] == logp.shape[0]:
        return advantages.unsqueeze(-1)
    if advantages.shape == logp.shape:
        return advantages
    raise ValueError(
        f"advantages must be (B,) or (B, T) = {tuple(logp.shape)}, got {tuple(advantages.shape)}"
    )


def _seq_reduce(x, maskf, loss_type):
    """Per-sequence (B,) sum ("sequence") or token mean ("gspo") of x (B, T) over the mask."""
    total = (x * maskf).sum(-1)
    return total if loss_type == "sequence" else total / maskf.sum(-1).clamp(min=1)


def truncated_is_weight(old_logp, sampler_logp, cap, maskf=None, loss_type="grpo"):
    """TIS weight min(pi_old / pi_sampler, C), detached: (B, T), or (B,) for sequence types.

    Yao, Liu et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL
    Training" (Truncated Importance Sampling): the sampler (vLLM, or a KV-cache loop in another
    precision) is not exactly the trainer's pi_old, so each token's loss is re-weighted by
    pi_old(y_t) / pi_sampler(y_t) = exp(old_logp - sampler_logp), truncated at C (they use C = 2)
    to bound the variance. For "sequence"/"gspo" the weight uses the same sequence-level log-ratio
    as the loss (summed / token-mean), with `maskf` (B, T) the answer tokens.
    """
    log_w = (old_logp - sampler_logp).detach()
    if loss_type in SEQUENCE_LOSS_TYPES:
        log_w = _seq_reduce(log_w, maskf, loss_type)  # (B,)
    return torch.exp(log_w).clamp(max=cap)


def off_policy_sequence_mask(logp, behaviour_logp, advantages, maskf, threshold):
    """DeepSeek-V3.2 off-policy sequence mask: 0 where A < 0 and the sequence KL > delta, else 1.

    DeepSeek-AI, "DeepSeek-V3.2" (arXiv 2512.02556), Off-Policy Sequence Masking: M_{i,t} = 0 if
    A_{i,t} < 0 and (1/|o_i|) sum_t log(pi_old(o_{i,t}) / pi_theta(o_{i,t})) > delta, else 1,
    where pi_old is the *sampling* probability returned by the inference engine (so the k1 KL
    estimate covers both staleness and train/inference mismatch). The model learns mostly from
    its own mistakes; negative samples that drifted far off-policy mislead more than they teach.
    Returns a detached mask shaped like `advantages` (B,) or (B, T); sequences without answer
    tokens have KL 0 and are kept.
    """
    kl = _seq_reduce((behaviour_logp - logp).detach(), maskf, "gspo")  # (B,) mean k1 per token
    far = kl > threshold
    if advantages.dim() == 2:
        far = far.unsqueeze(-1)  # (B, 1) against per-token advantages (B, T)
    return (~((advantages < 0) & far)).to(logp.dtype)


def _token_policy_loss(logp, old_logp, adv, loss_type, epsilon, high):
    """Per-token policy loss (B, T): the clipped surrogate, or CISPO's IS-weighted log-prob."""
    if loss_type != "cispo":
        return -clipped_surrogate(logp, old_logp, adv, epsilon, high)
    # CISPO (MiniMax-M1, arXiv 2506.13585, eq. 4): sg(clip(r, 1 - eps_low, 1 + eps_high)) A logp.
    # The paper sets no lower bound and tunes only eps_high, so only the top is clipped here;
    # unlike PPO's min, a token outside the range keeps its gradient, only its weight is capped.
    ratio = torch.exp(logp - old_logp).detach()
    weight = ratio if epsilon is None else ratio.clamp(max=1.0 + high)
    return -(weight * adv * logp)


def _clip_stats(ratio, adv, count, loss_type, epsilon, high):
    """Fractions (low, high) of counted tokens (or sequences) whose ratio is clipped."""
    zero = torch.zeros_like(ratio)
    if epsilon is None:
        low, hi = zero, zero
    elif loss_type == "cispo":  # only the IS weight's top is capped, whatever the sign of A
        low, hi = zero, (ratio > 1 + high).to(ratio.dtype)
    else:  # where the clipped side of PPO's pessimistic min is active
        low = ((ratio < 1 - epsilon) & (adv < 0)).to(ratio.dtype)
        hi = ((ratio > 1 + high) & (adv > 0)).to(ratio.dtype)
    n = count.sum().clamp(min=1)
    return ((low * count).sum() / n).item(), ((hi * count).sum() / n).item()


def clipped_policy_loss(logp, old_logp, advantages, mask, loss_type="grpo", epsilon=0.2,
                        epsilon_high=None, ref_logp=None, beta=0.0, entropy=None,
                        entropy_coef=0.0, max_completion_length=None, sampler_logp=None,
                        tis_cap=None, off_policy_mask_threshold=None, kl_estimator="k3"):
    """GRPO loss = -surrogate + beta x KL - entropy_coef x entropy, and detached statistics.

    logp/old_logp/ref_logp/entropy/sampler_logp (B, T) per token, mask (B, T) answer tokens,
    advantages (B,) per completion (outcome) or (B, T) per token (process supervision; not for
    the sequence-level losses "sequence" and "gspo"). Returns {"loss": tensor (connected to the
    graph whenever logp requires grad), pg_loss, kl, entropy, ratio_mean, ratio_max,
    clip_frac_low, clip_frac_high, tis_weight_mean, off_policy_mask_frac} (detached floats;
    ratio statistics are None when no answer token counts).
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {kl_estimator!r}")
    if tis_cap is not None and sampler_logp is None:
        raise ValueError("tis_cap (truncated importance sampling) needs sampler_logp")
    maskf = mask.to(logp.dtype)
    has_tokens = (maskf.sum(-1) > 0).to(logp.dtype)  # (B,) completions that enter the loss
    high = epsilon if epsilon_high is None else epsilon_high
    sequence_level = loss_type in SEQUENCE_LOSS_TYPES
    if sequence_level and advantages.dim() != 1:
        raise ValueError(f"loss_type={loss_type!r} needs per-completion advantages of shape (B,)")
    adv = advantages if sequence_level else _as_column(advantages, logp)

    weight = torch.ones_like(adv if sequence_level else logp)  # (B,) or (B, T), no grad
    tis_weight = None
    if tis_cap is not None:
        tis_weight = truncated_is_weight(old_logp, sampler_logp, tis_cap, maskf, loss_type)
        weight = weight * tis_weight
    opsm = None
    if off_policy_mask_threshold is not None:
        behaviour = old_logp if sampler_logp is None else sampler_logp
        opsm = off_policy_sequence_mask(logp, behaviour, advantages, maskf,
                                        off_policy_mask_threshold)
        weight = weight * (opsm if sequence_level else _as_column(opsm, logp))

    # Policy term. Token level (grpo / dapo / dr_grpo, DeepSeekMath eq. 3; cispo, MiniMax-M1
    # eq. 4: -sg(min(r, 1 + eps_high)) A logp, where `epsilon` only sets the default eps_high):
    # the clipped surrogate per token, reduced by `aggregate_loss`. Sequence level ("sequence":
    # the book's summed log-prob ratio; gspo, arXiv 2507.18071: s_i = exp(mean_t(logp -
    # old_logp)), clipped like PPO's ratio): one ratio per completion. TIS and off-policy masking
    # (`weight`) touch the policy term only; masked terms keep their place in the normalisers,
    # as in DeepSeek-V3.2's equation.
    if sequence_level:
        seq_logp = _seq_reduce(logp, maskf, loss_type)  # (B,) summed or token-mean log-probs
        seq_old = _seq_reduce(old_logp, maskf, loss_type)
        per_seq = -clipped_surrogate(seq_logp, seq_old, adv, epsilon, epsilon_high)
        pg_loss = (per_seq * weight * has_tokens).sum() / max(logp.shape[0], 1)
        ratio, count = torch.exp(seq_logp - seq_old), has_tokens
    else:
        per_token = _token_policy_loss(logp, old_logp, adv, loss_type, epsilon, high) * weight
        pg_loss = aggregate_loss(per_token, mask, loss_type, max_completion_length)
        ratio, count = torch.exp(logp - old_logp), maskf
    loss = pg_loss

    # KL to the frozen reference: k3 per token (always >= 0), or the book's chapter 7 summed
    # logp - ref_logp per answer ("sequence": zero gradient on average, kept to show why it fails)
    kl = torch.zeros((), device=logp.device)
    if ref_logp is not None and beta:
        if kl_estimator == "sequence":  # the book's chapter 7: summed logp - ref_logp per answer
            kl = aggregate_loss(logp - ref_logp, mask, "sequence")
        else:
            kl = aggregate_loss(k3_kl(logp, ref_logp), mask, loss_type, max_completion_length)
        loss = loss + beta * kl
    ent = torch.zeros((), device=logp.device)
    if entropy is not None:
        ent = aggregate_loss(entropy.detach(), mask, "dapo")  # logged: mean per answer token
        if entropy_coef:
            bonus_type = "grpo" if loss_type == "sequence" else loss_type
            bonus = aggregate_loss(entropy, mask, bonus_type, max_completion_length)
            loss = loss - entropy_coef * bonus  # higher entropy lowers the loss

    with torch.no_grad():
        stats = _loss_stats(ratio.detach(), adv.detach().expand_as(ratio), count, loss_type,
                            epsilon, high, tis_weight, opsm, has_tokens)
    return {"loss": loss, "pg_loss": pg_loss.item(), "kl": kl.item(), "entropy": ent.item(),
            **stats}


def _loss_stats(ratio, adv, count, loss_type, epsilon, high, tis_weight, opsm, has_tokens):
    """Detached ratio / clipping / off-policy statistics of `clipped_policy_loss` (floats)."""
    n = count.sum()
    nothing = not bool(n > 0)  # no answer token counts: ratio statistics are undefined -> None
    low_frac, high_frac = _clip_stats(ratio, adv, count, loss_type, epsilon, high)
    tis_mean = 1.0
    if tis_weight is not None:
        tis_mean = None if nothing else ((tis_weight * count).sum() / n).item()
    mask_frac = 0.0
    if opsm is not None:
        dropped = opsm < 1 if opsm.dim() == 1 else (opsm < 1).any(dim=-1)  # (B,)
        mask_frac = ((dropped.to(has_tokens.dtype) * has_tokens).sum()
                     / has_tokens.sum().clamp(min=1)).item()
    return {
        "ratio_mean": None if nothing else ((ratio * count).sum() / n).item(),
        "ratio_max": None if nothing else ratio[count > 0].max().item(),
        "clip_frac_low": low_frac,
        "clip_frac_high": high_frac,
        "tis_weight_mean": tis_mean,
        "off_policy_mask_frac": mask_frac,
    }


# ----------------------------------------------------------------------------------------------
# Rollouts -> a packed batch
# ----------------------------------------------------------------------------------------------

@dataclass
class RolloutBatch:
    """G rollouts for each of N prompts, scored and packed into one padded tensor batch."""

    input_ids: torch.Tensor  # (B, L): left-padded prompt | completion padded on the right
    attention_mask: torch.Tensor | None  # (B, L) 1 real, 0 left padding; None when no padding
    prompt_len: int  # first completion column (the padded prompt length)
    completion_mask: torch.Tensor  # (B, Tc) bool: tokens that enter the loss
    advantages: torch.Tensor  # (B,) or (B, Tc)
    rewards: torch.Tensor  # (N, G) all groups, including skipped ones
    samples: list = field(default_factory=list)  # one dict per rollout of every group
    zero_adv_frac: float = 0.0  # fraction of groups whose rewards were all equal
    num_generated_tokens: int = 0  # generated tokens of all rollouts (for tokens/s)
    sampler_logp: torch.Tensor | None = None  # (B, Tc) the sampler's token log-probs, if recorded

    @property
    def size(self) -> int:
        """Number of rollouts B that enter the loss."""
        return self.input_ids.shape[0]

    def slice(self, start, stop) -> RolloutBatch:
        """Rows start:stop (a micro-batch); statistics fields are shared, not sliced."""
        am = None if self.attention_mask is None else self.attention_mask[start:stop]
        sl = None if self.sampler_logp is None else self.sampler_logp[start:stop]
        return RolloutBatch(
            self.input_ids[start:stop], am, self.prompt_len,
            self.completion_mask[start:stop], self.advantages[start:stop], self.rewards,
            self.samples, self.zero_adv_frac, self.num_generated_tokens, sl,
        )

    def cut(self, rows: int, completion_cols: int) -> RolloutBatch:
        """The first `rows` rollouts with only their first `completion_cols` completion columns
        (longer completions cut short); a batch of other sizes for benchmarks and tests."""
        cols = self.prompt_len + completion_cols
        part = self.slice(0, rows)
        adv = part.advantages[:, :completion_cols] if part.advantages.dim() == 2 \
            else part.advantages
        am = None if part.attention_mask is None else part.attention_mask[:, :cols]
        sl = None if part.sampler_logp is None else part.sampler_logp[:, :completion_cols]
        return RolloutBatch(
            part.input_ids[:, :cols], am, self.prompt_len,
            part.completion_mask[:, :completion_cols], adv, self.rewards, self.samples,
            self.zero_adv_frac, self.num_generated_tokens, sl,
        )

    def rows(self, keep: torch.Tensor) -> RolloutBatch:
        """The rollouts where `keep` (B,) bool is True; statistics fields are shared."""
        am = None if self.attention_mask is None else self.attention_mask[keep]
        sl = None if self.sampler_logp is None else self.sampler_logp[keep]
        return RolloutBatch(
            self.input_ids[keep], am, self.prompt_len, self.completion_mask[keep],
            self.advantages[keep], self.rewards, self.samples, self.zero_adv_frac,
            self.num_generated_tokens, sl,
        )


def pack_rollouts(prompts_ids, completion_ids, completion_masks, pad_id=0):
    """Left-pad prompts and right-pad completions so all completions start at the same column.

    prompts_ids: N 1-D prompt tensors; completion_ids/completion_masks: N (G_i, T_i) tensors.
    Returns input_ids (B, L), attention_mask (B, L) or None, prompt_len, completion_mask (B, Tc).
    """
    P = max(p.shape[0] for p in prompts_ids)
    Tc = max(c.shape[1] for c in completion_ids)
    rows, attn, cmask = [], [], []
    for p, c, m in zip(prompts_ids, completion_ids, completion_masks):
        G, T = c.shape
        pad_p = P - p.shape[0]
        prompt = torch.cat([p.new_full((pad_p,), pad_id), p]).expand(G, P)
        comp = torch.cat([c, c.new_full((G, Tc - T), pad_id)], dim=1)
        rows.append(torch.cat([prompt, comp], dim=1))
        a = torch.ones(G, P + Tc, dtype=torch.long, device=c.device)
        a[:, :pad_p] = 0
        attn.append(a)
        cmask.append(torch.cat([m.bool(), m.new_zeros((G, Tc - T), dtype=torch.bool)], dim=1))
    attention_mask = torch.cat(attn)
    if bool(attention_mask.all()):
        attention_mask = None  # no padding: lets the model use plain causal attention
    return torch.cat(rows), attention_mask, P, torch.cat(cmask)


def _batch_advantages(groups, rewards, reward_fn, scale_rewards, reward_normalization,
                      gather_groups):
    """Outcome advantages (N, G) of `collect_rollouts`' groups: GRPO's or GDPO's."""
    per_reward = reward_normalization == "per_reward"
    if per_reward:  # GDPO: each (gated) term normalised in its group
        paid = [[reward_fn.paid(s[1]) for s in scored] for _, _, scored in groups]  # N x G x K
        values = torch.tensor(paid, dtype=torch.float32).permute(0, 2, 1)  # (N, K, G)
    else:
        values = rewards.float()  # (N, G)
    start, n = 0, values.shape[0]
    if gather_groups is not None and (per_reward or scale_rewards == "batch"):
        values, start = gather_groups(values)  # every process's groups: (N_all, ...)
    if per_reward:
        weights = [t.weight for t in reward_fn.terms]
        adv = group_advantages_multi(values.permute(1, 0, 2), weights, scale_rewards)
    else:
        adv = group_advantages(values, scale_rewards)
    return adv[start:start + n]  # (N, G): this process's groups


@torch.no_grad()
def collect_rollouts(model, tokenizer, examples, device, reward_fn, num_rollouts=8,
                     max_new_tokens=512, temperature=0.8, top_p=0.9, generator=None,
                     scale_rewards="group", skip_zero_advantage=False, mask_truncated=False,
                     prompt_fn: Callable[[str], str] = render_prompt,
                     advantage_fn=None, record_logprobs=False,
                     reward_normalization="sum", gather_groups=None,
                     compile=False) -> RolloutBatch:
    """Sample G rollouts per example (one prefill each, all decoded together), score, pack.

    reward_fn(text, token_ids, prompt_len, example) -> (total, components) (a `CompositeReward`).
    skip_zero_advantage drops groups whose rewards are all equal (zero advantage: no policy
    gradient, only compute); with an advantage_fn it keeps them for the hook and drops, after
    it, the groups whose token advantages are all exactly zero (equal outcomes and no step
    credit: an equal-outcome group whose steps differ is kept). mask_truncated removes
    completions that hit max_new_tokens without EOS from the loss (DAPO section 3.4 overlong
    filtering).
    advantage_fn (process supervision hook): called as advantage_fn(groups, advantages,
    completion_mask) with groups = [(example, Rollouts, [(reward, components), ...G]), ...] for
    the kept groups, advantages (N_kept, G) the outcome advantages, completion_mask (B, Tc) the
    packed mask (rows: group after group, G each, columns: completion tokens); it returns the
    (B, Tc) per-token advantages (rollout g of kept group i is row i * G + g). Default: the
    outcome advantages `group_advantages`, one per completion.
    record_logprobs: keep the sampler's token log-probs as `sampler_logp` (for truncated
    importance sampling and off-policy masking). reward_normalization: "sum" normalises the
    weighted sum of the reward terms in each group (GRPO); "per_reward" normalises each term of
    a `CompositeReward` in its group before the weighted sum (GDPO, `group_advantages_multi`).
    generator: one torch.Generator, or one per example (its G rows; `generation.row_uniforms`).
    gather_groups (data-parallel runs, `distributed.gather_groups`): x (N, ...) ->
    (x of every process's groups (N_all, ...), where this process's start); the advantages that
    look beyond a group (scale_rewards "batch", GDPO's batch normalisation) are then computed
    over the whole batch, as one process holding every group would. compile: decode with
    `generation.generate`'s compiled step (the same rollouts).
    """
    if reward_normalization not in REWARD_NORMALIZATIONS:
        raise ValueError(f"reward_normalization must be one of {REWARD_NORMALIZATIONS}, "
                         f"got {reward_normalization!r}")
    was_training = model.training
    model.eval()
    # All N prompts in one decoding loop: one prefill per prompt, its cache row repeated G times.
    all_rollouts = sample_rollouts_batch(
        model, tokenizer, [prompt_fn(ex["problem"]) for ex in examples], num_rollouts, device,
        max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, generator=generator,
        return_logprobs=record_logprobs, compile=compile,
    )
    model.train(was_training)
    groups = []
    for example, ro in zip(examples, all_rollouts):
        P = ro.prompt_ids.shape[0]
        scored = [reward_fn(ro.texts[i], ro.full_ids(i), P, example) for i in range(num_rollouts)]
        groups.append((example, ro, scored))

    rewards = torch.tensor([[s[0] for s in scored] for _, _, scored in groups])  # (N, G)
    advantages = _batch_advantages(groups, rewards, reward_fn, scale_rewards,
                                   reward_normalization, gather_groups)  # (N, G)
    zero = (advantages == 0).all(dim=1)  # (N,) groups without signal (exact zeros)
    if advantage_fn is not None:
        # Process supervision: a group whose outcomes are all equal can still hold step-level
        # signal (step 1 right in some completions, wrong in others), so it is kept here and
        # judged on its token advantages below.
        zero = torch.zeros_like(zero)
    keep = [i for i in range(len(groups)) if not (skip_zero_advantage and zero[i])]

    samples = []
    for i, (example, ro, scored) in enumerate(groups):
        for g in range(num_rollouts):
            samples.append({
                "problem": example["problem"], "answer": example["answer"],
                "text": ro.texts[g], "reward": scored[g][0], **scored[g][1],
                "advantage": advantages[i, g].item(), "length": int(ro.lengths[g]),
                "prompt_tokens": ro.prompt_len, "truncated": bool(ro.truncated[g]),
            })
    num_tokens = int(sum(int(ro.lengths.sum()) for _, ro, _ in groups))

    if not keep:
        empty = torch.zeros(0, 1, dtype=torch.long, device=device)
        return RolloutBatch(empty, None, 1, empty.bool(), torch.zeros(0, device=device), rewards,
                            samples, zero.float().mean().item(), num_tokens)

    masks = []
    for i in keep:
        ro = groups[i][1]
        m = ro.completion_mask.bool()
        if mask_truncated:
            m = m & ~ro.truncated.bool().to(m.device)[:, None]
        masks.append(m)
    input_ids, attention_mask, prompt_len, completion_mask = pack_rollouts(
        [groups[i][1].prompt_ids for i in keep], [groups[i][1].completion_ids for i in keep],
        masks, pad_id=pad_id_of(tokenizer),
    )
    sampler_logp = None
    if record_logprobs:  # (B, Tc), right-padded with 0 like the completions
        Tc = completion_mask.shape[1]
        sampler_logp = torch.cat([
            F.pad(groups[i][1].logprobs, (0, Tc - groups[i][1].logprobs.shape[1]))
            for i in keep]).to(device)
    if advantage_fn is not None:
        adv = advantage_fn([groups[i] for i in keep], advantages[keep], completion_mask)  # (B, Tc)
        _add_step_scores(samples, keep, num_rollouts, getattr(advantage_fn, "last_infos", None))
        if skip_zero_advantage:  # drop groups whose token advantages are all exactly zero
            G = num_rollouts
            signal = adv.reshape(len(keep), G, -1).abs().sum(dim=(1, 2)) > 0  # (N,)
            zero = ~signal
            rows = signal.repeat_interleave(G)  # (B,)
            input_ids, completion_mask, adv = input_ids[rows], completion_mask[rows], adv[rows]
            attention_mask = None if attention_mask is None else attention_mask[rows]
            sampler_logp = None if sampler_logp is None else sampler_logp[rows]
            if not bool(signal.any()):
                empty = torch.zeros(0, 1, dtype=torch.long, device=device)
                return RolloutBatch(empty, None, 1, empty.bool(), torch.zeros(0, device=device),
                                    rewards, samples, 1.0, num_tokens)
    else:
        adv = advantages[keep].reshape(-1)  # (B,)
    return RolloutBatch(input_ids, attention_mask, prompt_len, completion_mask,
                        adv.to(device), rewards, samples, zero.float().mean().item(), num_tokens,
                        sampler_logp)


def _add_step_scores(samples, keep, num_rollouts, infos):
    """Each completion's steps and their scores into its sample (samples.jsonl, the trackers),
    when the advantage function reports them (`ProcessAdvantageFn.last_infos`, one per kept
    group)."""
    for i, info in zip(keep, infos or []):
        for g in range(num_rollouts):
            samples[i * num_rollouts + g].update(
                steps=list(info["steps"][g]),
                step_rewards=[float(r) for r in info["step_rewards"][g]])


def concat_rollout_batches(batches: list[RolloutBatch], pad_id=0) -> RolloutBatch:
    """One batch from several (DAPO dynamic sampling's rounds), re-padded to a common layout.

    Prompts are left-padded to the longest padded prompt and completions right-padded, as
    `pack_rollouts` does; rewards, samples and token counts cover every batch, kept or not.
    """
    rewards = torch.cat([b.rewards for b in batches])  # (N_all, G)
    samples = [s for b in batches for s in b.samples]
    tokens = sum(b.num_generated_tokens for b in batches)
    zero_frac = sum(b.zero_adv_frac * b.rewards.shape[0] for b in batches) / rewards.shape[0]
    kept = [b for b in batches if b.size]
    if not kept:
        first = batches[0]
        return RolloutBatch(first.input_ids, None, first.prompt_len, first.completion_mask,
                            first.advantages, rewards, samples, zero_frac, tokens)
    P = max(b.prompt_len for b in kept)
    Tc = max(b.completion_mask.shape[1] for b in kept)
    ids, attn, cmask, adv, slp = [], [], [], [], []
    for b in kept:
        left, right = P - b.prompt_len, Tc - b.completion_mask.shape[1]
        ids.append(F.pad(b.input_ids, (left, right), value=pad_id))
        am = b.attention_mask if b.attention_mask is not None else torch.ones_like(b.input_ids)
        attn.append(F.pad(F.pad(am.long(), (left, 0), value=0), (0, right), value=1))
        cmask.append(F.pad(b.completion_mask, (0, right), value=False))
        adv.append(b.advantages if b.advantages.dim() == 1 else F.pad(b.advantages, (0, right)))
        if b.sampler_logp is not None:
            slp.append(F.pad(b.sampler_logp, (0, right)))
    attention_mask = torch.cat(attn)
    if bool(attention_mask.all()):
        attention_mask = None  # no padding: plain causal attention
    return RolloutBatch(torch.cat(ids), attention_mask, P, torch.cat(cmask), torch.cat(adv),
                        rewards, samples, zero_frac, tokens,
                        torch.cat(slp) if len(slp) == len(kept) else None)


def batch_logprobs(model, batch: RolloutBatch, chunk_size=1024, with_entropy=True,
                   temperature=1.0, fixed_shape: FixedShape | None = None):
    """Per-token (log-probs, entropies) (B, Tc) of a packed batch under `model` at `temperature`
    (`fixed_shape`: see `token_logprobs_and_entropy`)."""
    return token_logprobs_and_entropy(model, batch.input_ids, batch.attention_mask,
                                      batch.prompt_len, batch.completion_mask, chunk_size,
                                      with_entropy, temperature, fixed_shape)


def grpo_loss_on_batch(model, batch: RolloutBatch, old_logp=None, ref_logp=None, loss_type="grpo",
                       epsilon=0.2, epsilon_high=None, beta=0.0, entropy_coef=0.0,
                       max_completion_length=None, chunk_size=1024, temperature=1.0,
                       sampler_logp=None, tis_cap=None, off_policy_mask_threshold=None,
                       kl_estimator="k3", fixed_shape: FixedShape | None = None):
    """Loss dict of `clipped_policy_loss` for a packed batch (log-probs with grad).

    old_logp None means "the policy that sampled the batch is the current one": the old log-probs
    are the current ones detached (ratio exactly 1), which saves a forward pass when each batch
    gets a single update; pass precomputed old log-probs for PPO-style inner epochs.
    temperature: log-probs of softmax(logits / T) (see `token_logprobs_and_entropy`); old_logp,
    ref_logp and sampler_logp (B, Tc) should be taken at the same T.
    sampler_logp/tis_cap/off_policy_mask_threshold: see `clipped_policy_loss`. fixed_shape: the
    padded (and compiled) forward pass of `token_logprobs_and_entropy`.
    """
    logp, entropy = batch_logprobs(model, batch, chunk_size, True, temperature, fixed_shape)
    if not entropy_coef:
        entropy = entropy.detach()
    old = logp.detach() if old_logp is None else old_logp
    out = clipped_policy_loss(
        logp, old, batch.advantages, batch.completion_mask, loss_type=loss_type,
        epsilon=epsilon, epsilon_high=epsilon_high, ref_logp=ref_logp, beta=beta,
        entropy=entropy, entropy_coef=entropy_coef, max_completion_length=max_completion_length,
        sampler_logp=sampler_logp, tis_cap=tis_cap,
        off_policy_mask_threshold=off_policy_mask_threshold, kl_estimator=kl_estimator)
    out["num_tokens"] = int(batch.completion_mask.sum())
    return out


def compute_grpo_loss(model, tokenizer, example, device, num_rollouts=8, max_new_tokens=512,
                      temperature=0.8, top_p=0.9, *, reward_fn=None, format_reward_weight=0.0,
                      format_reward_conditional=False, loss_type="grpo", epsilon=0.2,
                      epsilon_high=None, beta=0.0, ref_model=None, scale_rewards="group",
                      entropy_coef=0.0, mask_truncated=False, chunk_size=1024, generator=None,
                      prompt_fn=render_prompt, advantage_fn=None, supervision="outcome",
                      logprob_temperature=1.0):
    """GRPO loss for one example (book chapters 6-7 contract), batched over its G rollouts.

    Samples `num_rollouts` completions with one shared prefill, scores them with `reward_fn`
    (default: correctness + `format_reward_weight` x think format, optionally only when correct),
    normalises the rewards within the group, and returns a dict with loss, pg_loss, kl_loss,
    rewards, advantages, samples, loss_tensor (backpropagate this), policy_ratio, clip_fraction,
    entropy. A KL term needs `beta > 0` and a frozen `ref_model`. See `clipped_policy_loss` and
    `aggregate_loss` for loss_type/epsilon/epsilon_high, `group_advantages` for scale_rewards,
    `collect_rollouts` for advantage_fn (token-level advantages). supervision="process" needs
    that advantage_fn, built by `process_supervision.make_process_advantage_fn` (DeepSeekMath
    section 4.1.3). logprob_temperature: the T of the policy's and reference's log-probs (1.0:
    the book's; TRL uses the sampling `temperature`).
    """
    if supervision not in ("outcome", "process"):
        raise ValueError(f"supervision must be 'outcome' or 'process', got {supervision!r}")
    if supervision == "process" and advantage_fn is None:
        raise ValueError("supervision='process' needs advantage_fn=make_process_advantage_fn("
                         "tokenizer, step_scorer, ...) from process_supervision.py")
    if beta and ref_model is None:
        raise ValueError("compute_grpo_loss: beta > 0 needs a frozen ref_model")
    if reward_fn is None:
        reward_fn = build_reward(tokenizer, format_reward_weight, format_reward_conditional)
    batch = collect_rollouts(model, tokenizer, [example], device, reward_fn,
                             num_rollouts=num_rollouts, max_new_tokens=max_new_tokens,
                             temperature=temperature, top_p=top_p, generator=generator,
                             scale_rewards=scale_rewards, mask_truncated=mask_truncated,
                             prompt_fn=prompt_fn, advantage_fn=advantage_fn)
    ref_logp = None
    if beta:
        with torch.no_grad():
            ref_logp, _ = batch_logprobs(ref_model, batch, chunk_size, False, logprob_temperature)
    out = grpo_loss_on_batch(model, batch, ref_logp=ref_logp, loss_type=loss_type,
                             epsilon=epsilon, epsilon_high=epsilon_high, beta=beta,
                             entropy_coef=entropy_coef, max_completion_length=max_new_tokens,
                             chunk_size=chunk_size, temperature=logprob_temperature)
    loss_tensor = out["loss"]
    return {
        "loss": loss_tensor.item(),
        "pg_loss": out["pg_loss"],
        "kl_loss": out["kl"],
        "rewards": batch.rewards[0].tolist(),
        "advantages": batch.advantages.tolist(),
        "samples": batch.samples,
        "loss_tensor": loss_tensor,
        "policy_ratio": out["ratio_mean"],
        "clip_fraction": out["clip_frac_low"] + out["clip_frac_high"],
        "entropy": out["entropy"],
    }


__all__: Sequence[str] = [
    "LOSS_TYPES", "SEQUENCE_LOSS_TYPES", "SCALE_REWARDS", "compute_advantage_stats",
    "group_advantages", "group_advantages_multi", "truncated_is_weight",
    "off_policy_sequence_mask",
    "sequence_logprob", "sequence_logprob_and_entropy", "token_logprobs_and_entropy", "k3_kl",
    "clipped_surrogate", "aggregate_loss", "clipped_policy_loss", "RolloutBatch", "pack_rollouts",
    "collect_rollouts", "batch_logprobs", "grpo_loss_on_batch", "compute_grpo_loss",
    "FixedShape", "pad_to_shape", "compiled_block",
]
