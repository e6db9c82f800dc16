"""The GRPO step's maths and rollouts (book chapters 6-7): stages 1-3 (sample, reward, group
advantages, pack) and the pieces of stages 4-5 (per-token log-probs, the clipped surrogate, the
k3 KL term, entropy, aggregation). `training.py` runs them in order; nothing here knows about
processes, compilation or the run directory.

Read in this order: `collect_rollouts` (stages 1-3) -> `token_logprobs_and_entropy` ->
`policy_loss` (stage 5's loss) -> `grpo_loss_on_batch` (the two together on a packed batch).
The loss variants (sequence-level ratios, GSPO, CISPO, TIS, off-policy masks, the book's
sequence-level KL) live in variants.py, chosen by name; the compiled update's padded shapes in
compiled_update.py, reached through one argument (`fixed_shape`).

References
- GRPO: Shao et al., "DeepSeekMath", arXiv 2402.03300, section 4.1 (eq. 3: clipped surrogate per
  token, averaged over each completion's tokens and over the group; eq. 4: k3 KL estimator;
  section 4.1.2: group-normalised advantages).
- PPO clipping: Schulman et al., "Proximal Policy Optimization", arXiv 1707.06347, eq. 7. The
  pessimistic `min` is, for A >= 0, A x min(r, clip(r)) (no reward for pushing r above
  1 + eps_high) and, for A < 0, A x max(r, clip(r)) (no reward for pushing r below 1 - eps):
  multiplying by a negative A swaps min and max. Taking `max(rA, clip(r)A)` of the *products*
  for A < 0 would be the optimistic bound (tests/test_grpo.py shows the difference).
- k3 KL estimator: J. Schulman, "Approximating KL divergence" (2020), http://joschu.net/blog/kl-approx.html
- DAPO: Yu et al., arXiv 2503.14476: clip-higher (a larger upper clip `epsilon_high`, section 3.1),
  token-level loss (section 3.3), overlong filtering of truncated completions (section 3.4).
- Dr. GRPO: Liu et al., "Understanding R1-Zero-Like Training", arXiv 2503.20783: no division by the
  group std (`scale_rewards="none"`: the group std up-weights too-easy and too-hard questions)
  and no per-sequence length normalisation (`dr_grpo` loss).
- GDPO: Liu et al., arXiv 2601.05242: normalise each reward component within its group before
  summing (`group_advantages_multi`).
- Log-probs at the sampling temperature: TRL's GRPOTrainer divides the logits by T.

`collect_rollouts`' arguments: reward_fn(text, token_ids, prompt_len, example) -> (total,
components) (rewards.py). skip_zero_advantage drops groups without signal (equal rewards; with
an advantage_fn, all-zero token advantages): no policy gradient, only compute. mask_truncated
leaves completions cut off at max_new_tokens out of the loss (DAPO 3.4). advantage_fn, process
supervision's seam: (kept groups [(example, Rollouts, [(reward, components)] * G)], outcome
advantages (N_kept, G), completion_mask (B, Tc)) -> token advantages (B, Tc), row i * G + g for
rollout g of kept group i. record_logprobs keeps the sampler's log-probs (TIS, off-policy
masks). reward_normalization "per_reward": GDPO. generator: one, or one per example
(`generation.row_uniforms`). gather_groups (several processes): x (N, ...) -> (x of every
process's groups, this process's start), for the advantages that look beyond a group. compile:
the compiled decode step (the same rollouts).

Memory: `token_logprobs_and_entropy` applies `model.lm_head` to at most `chunk_size` answer
positions at a time, checkpointed under autograd, so neither pass holds more than one
(chunk_size, V) float32 logits block (Qwen's V is 151,936: all 64 x 512 positions at once would
be 20 GB). Models without `forward_hidden` fall back to full logits (small vocabularies).

Shapes: B rollouts (= N prompts x G rollouts each), L packed sequence length, Tc completion length,
V vocabulary, H hidden size.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .compiled_update import FixedShape, padded_hidden
from .generation import sample_rollouts_batch
from .prompts import render_prompt
from .qwen3 import at_least_float32
from .tokenizer import pad_id_of

LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "sequence", "gspo", "cispo")
TOKEN_LOSS_TYPES = ("grpo", "dapo", "dr_grpo")  # `policy_loss`'s; the others: variants.py
SEQUENCE_LOSS_TYPES = ("sequence", "gspo")  # one ratio per completion; need (B,) advantages
SCALE_REWARDS = ("group", "batch", "none")
REWARD_NORMALIZATIONS = ("sum", "per_reward")  # GRPO's summed reward, GDPO's per-term
KL_ESTIMATORS = ("k3", "sequence")  # per-token k3 (DeepSeekMath), the book's sequence-level


# ----------------------------------------------------------------------------------------------
# Advantages
# ----------------------------------------------------------------------------------------------

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
    """Advantages (N, G) from rewards (N, G): subtract each group's mean, then scale by the
    group's std ("group", GRPO), the whole batch's ("batch") or not at all ("none", Dr. GRPO).
    A group whose rewards are all exactly equal gets exactly zero advantages."""
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    if rewards.dim() == 1:
        rewards = rewards.unsqueeze(0)
    if rewards.dim() != 2 or rewards.shape[1] < 2 or scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"group_advantages: rewards (N, G) with G >= 2 and scale_rewards in "
                         f"{SCALE_REWARDS}, got {tuple(rewards.shape)}, {scale_rewards!r}")
    centred = rewards - rewards.mean(dim=1, keepdim=True)  # (N, G)
    if scale_rewards == "none":
        adv = centred
    elif scale_rewards == "group":
        adv = centred / (rewards.std(dim=1, keepdim=True) + eps)  # (N, 1) group std
    else:
        adv = centred / (rewards.std() + eps)  # numel >= 2 since G >= 2
    equal = (rewards == rewards[:, :1]).all(dim=1, keepdim=True)  # (N, 1): no signal
    return adv.masked_fill(equal, 0.0)


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




def token_logprobs_and_entropy(model, input_ids, attention_mask=None, prompt_len=None,
                               completion_mask=None, chunk_size=1024, with_entropy=True,
                               temperature=1.0, fixed_shape: FixedShape | None = None):
    """Per-token log-probs and entropies (B, Tc) of softmax(logits / T) of the answers in
    input_ids (B, L) (prompts left-padded to `prompt_len`); fixed_shape: compiled_update.py."""
    B, L = input_ids.shape
    if not temperature > 0 or prompt_len is None or not 1 <= prompt_len <= L:
        raise ValueError(f"need temperature > 0, prompt_len in [1, {L}]: {temperature}, "
                         f"{prompt_len}")
    if completion_mask is None:
        completion_mask = torch.ones(B, L - prompt_len, dtype=torch.bool, device=input_ids.device)
    if completion_mask.shape != (B, L - prompt_len):
        raise ValueError(f"completion_mask shape {tuple(completion_mask.shape)} != "
                         f"(B, L - prompt_len) = {(B, L - prompt_len)}")
    head = getattr(model, "lm_head", torch.nn.Identity())
    if fixed_shape is not None:
        hidden = padded_hidden(model, input_ids, attention_mask, prompt_len, fixed_shape)
    elif hasattr(model, "forward_hidden"):
        hidden = model.forward_hidden(input_ids, attention_mask)  # (B, L, H)
    else:  # (B, L, V): the logits are the "hidden" states
        hidden, head = model(input_ids, attention_mask), torch.nn.Identity()
    mask = completion_mask.bool()
    h = hidden[:, prompt_len - 1:-1][mask]  # (n, H): the answer positions, row-major
    targets = input_ids[:, prompt_len:][mask]  # (n,)
    use_ckpt = torch.is_grad_enabled() and h.requires_grad
    logp_parts, ent_parts = [], []
    for s in range(0, h.shape[0], chunk_size):  # one (chunk, V) logits block at a time
        args = (head, h[s:s + chunk_size], targets[s:s + chunk_size], with_entropy, temperature)
        lp, ent = checkpoint(_logprob_entropy_chunk, *args, use_reentrant=False) if use_ckpt \
            else _logprob_entropy_chunk(*args)
        logp_parts.append(lp)
        ent_parts.append(ent)
    dtype = torch.promote_types(hidden.dtype, torch.float32)  # the chunks' (float32 or wider)
    logp = hidden.new_zeros(mask.shape, dtype=dtype)
    entropy = hidden.new_zeros(mask.shape, dtype=dtype)
    if logp_parts:  # masked_scatter fills the True positions row-major, as h = hidden[mask]
        logp = logp.masked_scatter(mask, torch.cat(logp_parts))
        entropy = entropy.masked_scatter(mask, torch.cat(ent_parts))
    elif h.requires_grad:  # no answer token: zeros still connected to the graph (DDP needs
        zero = at_least_float32(head(h).sum()) * 0  # every parameter's gradient)
        logp, entropy = logp + zero, entropy + zero
    return logp, entropy


# ----------------------------------------------------------------------------------------------
# Loss pieces
# ----------------------------------------------------------------------------------------------

def k3_kl(logp, ref_logp):
    """Per-token k3 estimate of KL(pi || pi_ref): exp(ref - logp) - (ref - logp) - 1, always >= 0
    and unbiased (Schulman 2020; DeepSeekMath eq. 4)."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def clipped_surrogate(logp, old_logp, advantages, epsilon=0.2, epsilon_high=None):
    """PPO's objective per element, min(r A, clip(r, 1 - eps, 1 + eps_high) A), r = exp(logp -
    old_logp) (PPO eq. 7; module docstring). epsilon None: no clip (book ch. 6); epsilon_high
    (DAPO clip-higher) defaults to epsilon. Advantages (B, 1) broadcast over (B, T)."""
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
    """(B, T) per-token loss -> scalar over `mask`. grpo: mean per sequence, then over sequences
    (DeepSeekMath eq. 3); dapo: mean over tokens (DAPO 3.3); dr_grpo: sum / (B x max length)
    (Dr. GRPO 3.1); sequence: sum per sequence, mean over them (the book's). Empty mask: 0."""
    if per_token_loss.shape != mask.shape or loss_type not in _AGGREGATION:
        raise ValueError(f"per_token_loss {tuple(per_token_loss.shape)} and mask "
                         f"{tuple(mask.shape)} must match, loss_type in {LOSS_TYPES}, got "
                         f"{loss_type!r}")
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


def policy_loss(logp, old_logp, advantages, mask, loss_type="grpo", epsilon=0.2,
                epsilon_high=None, ref_logp=None, beta=0.0, entropy=None, entropy_coef=0.0,
                max_completion_length=None, sampler_logp=None):
    """GRPO's loss -clipped surrogate + beta x k3 KL - entropy_coef x entropy, and statistics:
    {"loss": tensor, pg_loss, kl, entropy, ratio_mean, ...}. logp, old_logp, ref_logp, entropy
    and mask (B, T); advantages (B,) or (B, T). sampler_logp: unused (needed by variants)."""
    if loss_type not in TOKEN_LOSS_TYPES:
        raise ValueError(f"policy_loss takes loss_type in {TOKEN_LOSS_TYPES}, got {loss_type!r} "
                         "(the others: variants.clipped_policy_loss)")
    adv = _as_column(advantages, logp)
    # Stage 5a: the policy term, the clipped surrogate per token, reduced by the loss type
    per_token = -clipped_surrogate(logp, old_logp, adv, epsilon, epsilon_high)
    pg_loss = aggregate_loss(per_token, mask, loss_type, max_completion_length)
    ratio = torch.exp(logp - old_logp)
    # Stage 5b-c: the KL penalty and the entropy (logged; a bonus with entropy_coef)
    kl = aggregate_loss(k3_kl(logp, ref_logp), mask, loss_type, max_completion_length) \
        if ref_logp is not None and beta else None
    out = loss_terms(pg_loss, kl, beta, entropy, entropy_coef, mask, loss_type,
                     max_completion_length)
    with torch.no_grad():
        high = epsilon if epsilon_high is None else epsilon_high
        out.update(ratio_stats(ratio.detach(), adv.detach().expand_as(ratio), mask.to(logp.dtype),
                               loss_type, epsilon, high))
    return {**out, **ON_POLICY_STATS}


# The statistics of the variants' corrections when none is on: TIS weight 1, nothing masked.
ON_POLICY_STATS = {"tis_weight_mean": 1.0, "off_policy_mask_frac": 0.0}


def loss_terms(pg_loss, kl, beta, entropy, entropy_coef, mask, loss_type, max_completion_length):
    """{"loss": pg_loss + beta x kl - entropy_coef x entropy bonus, pg_loss, kl (None: no KL
    term), entropy (logged: the mean per answer token; the bonus reduces like the loss)}."""
    loss = pg_loss if kl is None else pg_loss + beta * kl
    ent = torch.zeros((), device=pg_loss.device)
    if entropy is not None:
        ent = aggregate_loss(entropy.detach(), mask, "dapo")
        if entropy_coef:
            bonus_type = "grpo" if loss_type == "sequence" else loss_type
            loss = loss - entropy_coef * aggregate_loss(entropy, mask, bonus_type,
                                                        max_completion_length)
    return {"loss": loss, "pg_loss": pg_loss.item(), "kl": 0.0 if kl is None else kl.item(),
            "entropy": ent.item()}


def ratio_stats(ratio, adv, count, loss_type, epsilon, high):
    """Mean and max ratio, fractions clipped low and high, over the counted tokens (or rows)."""
    zero = torch.zeros_like(ratio)
    if epsilon is None:
        low, hi = zero, zero
    elif loss_type == "cispo":  # only the IS weight's top is capped, whatever the sign of A
        low, hi = zero, (ratio > 1 + high).to(ratio.dtype)
    else:  # where the clipped side of PPO's pessimistic min is active
        low = ((ratio < 1 - epsilon) & (adv < 0)).to(ratio.dtype)
        hi = ((ratio > 1 + high) & (adv > 0)).to(ratio.dtype)
    n = count.sum()  # nothing counted: ratio statistics None
    return {"ratio_mean": ((ratio * count).sum() / n).item() if n > 0 else None,
            "ratio_max": ratio[count > 0].max().item() if n > 0 else None,
            "clip_frac_low": ((low * count).sum() / n.clamp(min=1)).item(),
            "clip_frac_high": ((hi * count).sum() / n.clamp(min=1)).item()}


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
    extra_rows: int = 0  # rows below the rollouts' that add loss terms (branching.py's branches)

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
    """N groups -> input_ids (B, L), attention_mask (B, L) or None, prompt_len, completion_mask
    (B, Tc): prompts (1-D each) left-padded, completions (G_i, T_i) right-padded."""
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
    """Outcome advantages (N, G): the rewards normalised in their group (GRPO), else (GDPO,
    batch scaling over processes) `_wide_advantages`."""
    if reward_normalization != "sum" or (gather_groups and scale_rewards == "batch"):
        return _wide_advantages(groups, rewards, reward_fn, scale_rewards, reward_normalization,
                                gather_groups)
    return group_advantages(rewards.float(), scale_rewards)


def _wide_advantages(groups, rewards, reward_fn, scale_rewards, reward_normalization,
                     gather_groups):
    """Advantages that look beyond one group: GDPO's per-term normalisation and batch scaling
    over every process's groups (`gather_groups`: x (N, ...) -> (x of all N_all groups, this
    process's start)), as one process holding every group would compute them."""
    if reward_normalization not in REWARD_NORMALIZATIONS:
        raise ValueError(f"reward_normalization must be one of {REWARD_NORMALIZATIONS}, "
                         f"got {reward_normalization!r}")
    per_reward = reward_normalization == "per_reward"
    if per_reward:  # GDPO: each (gated) term normalised in its group
        paid = [[reward_fn.paid(s[1]) for s in scored] for _, _, scored in groups]  # N x G x K
        values = torch.tensor(paid, dtype=torch.float32).permute(0, 2, 1)  # (N, K, G)
    else:
        values = rewards.float()  # (N, G)
    start, n = 0, values.shape[0]
    if gather_groups is not None:
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
    """Stages 1-3 for N prompts: sample G rollouts each, reward them, turn the rewards into
    group-relative advantages, pack the groups with signal into one batch (its arguments: the
    module docstring)."""
    # Stage 1: sample G rollouts per prompt (one prefill each, all N x G decoded together)
    was_training = model.training
    model.eval()
    rollouts = sample_rollouts_batch(
        model, tokenizer, [prompt_fn(ex["problem"]) for ex in examples], num_rollouts, device,
        max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, generator=generator,
        return_logprobs=record_logprobs, compile=compile)
    model.train(was_training)
    # Stage 2: rewards, one per rollout: (total, components)
    groups = [(ex, ro, [reward_fn(ro.texts[i], ro.full_ids(i), ro.prompt_ids.shape[0], ex)
                        for i in range(num_rollouts)]) for ex, ro in zip(examples, rollouts)]
    rewards = torch.tensor([[s[0] for s in scored] for _, _, scored in groups])  # (N, G)
    # Stage 3: group-relative advantages; groups without signal are left out
    advantages = _batch_advantages(groups, rewards, reward_fn, scale_rewards,
                                   reward_normalization, gather_groups)  # (N, G)
    zero = (advantages == 0).all(dim=1)  # (N,) groups without signal (exact zeros)
    if advantage_fn is not None:  # equal outcomes can still differ step by step: judged later
        zero = torch.zeros_like(zero)
    keep = [i for i in range(len(groups)) if not (skip_zero_advantage and zero[i])]
    stats = dict(rewards=rewards, samples=_samples(groups, advantages),
                 zero_adv_frac=zero.float().mean().item(),
                 num_generated_tokens=int(sum(int(ro.lengths.sum()) for ro in rollouts)))
    if not keep:
        return _empty_batch(device, **stats)
    batch = _pack_groups([groups[i][1] for i in keep], mask_truncated, record_logprobs,
                         pad_id_of(tokenizer), device, advantages[keep].reshape(-1), stats)
    if advantage_fn is None:
        return batch
    return _process_advantages(batch, [groups[i] for i in keep], keep, advantages[keep],
                               advantage_fn, skip_zero_advantage)


def _samples(groups, advantages):
    """One dict per rollout (samples.jsonl, the metrics): text, rewards, advantage, length."""
    return [{"problem": ex["problem"], "answer": ex["answer"], "text": ro.texts[g],
             "reward": scored[g][0], **scored[g][1], "advantage": advantages[i, g].item(),
             "length": int(ro.lengths[g]), "prompt_tokens": ro.prompt_len,
             "truncated": bool(ro.truncated[g])}
            for i, (ex, ro, scored) in enumerate(groups) for g in range(len(scored))]


def _empty_batch(device, **stats) -> RolloutBatch:
    """A batch with no rows (no group had signal), carrying the step's statistics."""
    empty = torch.zeros(0, 1, dtype=torch.long, device=device)
    return RolloutBatch(empty, None, 1, empty.bool(), torch.zeros(0, device=device), **stats)


def _pack_groups(rollouts, mask_truncated, record_logprobs, pad_id, device, advantages, stats):
    """The kept groups packed, with their advantages (B,) and the sampler's log-probs."""
    masks = [ro.completion_mask.bool() & ~ro.truncated.bool().to(ro.completion_mask.device)[:, None]
             if mask_truncated else ro.completion_mask.bool() for ro in rollouts]
    input_ids, attention_mask, prompt_len, completion_mask = pack_rollouts(
        [ro.prompt_ids for ro in rollouts], [ro.completion_ids for ro in rollouts], masks,
        pad_id=pad_id)
    sampler_logp = _sampler_logprobs(rollouts, completion_mask.shape[1], device) \
        if record_logprobs else None
    return RolloutBatch(input_ids, attention_mask, prompt_len, completion_mask,
                        advantages.to(device), sampler_logp=sampler_logp, **stats)


def _sampler_logprobs(rollouts, Tc, device):
    """The sampler's token log-probs (B, Tc), right-padded with 0 like the completions."""
    return torch.cat([F.pad(ro.logprobs, (0, Tc - ro.logprobs.shape[1]))
                      for ro in rollouts]).to(device)


def _process_advantages(batch, groups, keep, advantages, advantage_fn, skip_zero_advantage):
    """Process supervision's seam: the token advantages (B, Tc) of `advantage_fn` replace the
    outcome ones, each completion's steps and step rewards go into its sample, and (with
    skip_zero_advantage) groups whose token advantages are all exactly zero are dropped."""
    adv = advantage_fn(groups, advantages, batch.completion_mask)  # (B, Tc)
    _add_step_scores(batch.samples, keep, len(groups[0][2]), getattr(advantage_fn, "last_infos",
                                                                     None))
    batch = replace(batch, advantages=adv.to(batch.input_ids.device))
    if not skip_zero_advantage:
        return batch
    G = len(groups[0][2])
    signal = adv.reshape(len(keep), G, -1).abs().sum(dim=(1, 2)) > 0  # (N,)
    if not bool(signal.any()):
        return _empty_batch(batch.input_ids.device, rewards=batch.rewards, samples=batch.samples,
                            zero_adv_frac=1.0, num_generated_tokens=batch.num_generated_tokens)
    return replace(batch.rows(signal.repeat_interleave(G)),
                   zero_adv_frac=(~signal).float().mean().item())


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


# ----------------------------------------------------------------------------------------------
# A step's prompts and random streams
# ----------------------------------------------------------------------------------------------

def step_prompts(examples, step, config):
    """A step's prompts: a seeded reshuffle per epoch (a resume needs no loader state)."""
    n, k = len(examples), config.prompts_per_step
    out = []
    for pos in range(step * k, step * k + k):
        epoch, idx = divmod(pos, n)
        g = torch.Generator().manual_seed(config.seed * 1_000_003 + epoch)
        out.append(examples[int(torch.randperm(n, generator=g)[idx])])
    return out


def rollout_seed(seed, step, index):
    """Prompt `index` of step `step`'s seed: no two (step, index) below 10**6 share one."""
    return ((seed * 1_000_003 + step) * 1_000_033 + index) % 2**63


def rollout_generators(device, seed, step, indices):
    """A generator per prompt: its rollouts are the same whoever samples it, with whatever."""
    dev = torch.device(device)
    gen_device = dev if dev.type == "cuda" else torch.device("cpu")
    return [torch.Generator(device=gen_device).manual_seed(rollout_seed(seed, step, i))
            for i in indices]


# ----------------------------------------------------------------------------------------------
# Micro-batches: their weights and statistics
# ----------------------------------------------------------------------------------------------

def batch_totals(batch) -> tuple[int, float, int, float]:
    """(rows, answer tokens) of the batch, then of its rollouts: the loss's normalisers (rows
    below them, `extra_rows`, add terms weighted as rollouts'; process_supervision_forms.md)."""
    own, mask = batch.size - batch.extra_rows, batch.completion_mask
    return batch.size, float(mask.sum()), own, float(mask[:own].sum())


def micro_batch_weights(mb, totals, loss_type):
    """(loss weight, statistics weight) of a micro-batch: its share of the rollouts' and of the
    whole batch's (rows, answer tokens) `totals`, so the accumulated gradient is the batch's."""
    tokens = float(mb.completion_mask.sum())
    rows, all_tokens, own, own_tokens = totals
    w = tokens / max(1.0, own_tokens) if loss_type in ("dapo", "cispo") else mb.size / max(1, own)
    return w, mb.size / rows if loss_type in SEQUENCE_LOSS_TYPES else tokens / max(1.0, all_tokens)


MEAN_STATS = ("entropy", "ratio_mean", "clip_frac_low", "clip_frac_high", "tis_weight_mean",
              "off_policy_mask_frac")


def add_stats(sums, out, loss, w, w_stat):
    """Add a micro-batch's statistics to `sums` (weighted as its loss, or by `w_stat`)."""
    sums["loss"] = sums.get("loss", 0.0) + loss.item() * w
    for k in ("pg_loss", "kl"):
        sums[k] = sums.get(k, 0.0) + out[k] * w
    for k in MEAN_STATS:
        if out.get(k) is not None:  # None: nothing counted in this micro-batch
            sums[k] = sums.get(k, 0.0) + out[k] * w_stat
    top = out.get("ratio_max")
    if w_stat and top is not None and math.isfinite(top):
        sums["ratio_max"] = max(sums.get("ratio_max") or top, top)


def mean_over_epochs(epochs):
    """One row's loss statistics from `inner_epochs` updates: the mean, the max for ratio_max
    and skipped, None where no epoch measured it."""
    row = {}
    for k in epochs[0]:
        vals = [e[k] for e in epochs if e.get(k) is not None]
        if not vals:
            row[k] = None
        elif k in ("ratio_max", "skipped"):
            row[k] = max(vals)
        else:
            row[k] = sum(vals) / len(vals)
    return row


def batch_logprobs(model, batch: RolloutBatch, chunk_size=1024, with_entropy=True,
                   temperature=1.0, fixed_shape: FixedShape | None = None):
    """Per-token (log-probs, entropies) (B, Tc) of a packed batch under `model`."""
    return token_logprobs_and_entropy(model, batch.input_ids, batch.attention_mask,
                                      batch.prompt_len, batch.completion_mask, chunk_size,
                                      with_entropy, temperature, fixed_shape)


def loss_on_batch(model, batch: RolloutBatch, old_logp, ref_logp, loss_fn, chunk_size=1024,
                  temperature=1.0, fixed_shape: FixedShape | None = None) -> dict:
    """Stage 5 on a (micro-)batch: log-probs with gradients, then the run's `loss_fn`. old_logp
    None: sampled by this policy, so pi_old is pi detached (ratio 1, a forward pass saved)."""
    logp, entropy = batch_logprobs(model, batch, chunk_size, True, temperature, fixed_shape)
    old = logp.detach() if old_logp is None else old_logp
    out = loss_fn(logp, old, batch.advantages, batch.completion_mask, ref_logp=ref_logp,
                  entropy=entropy, sampler_logp=batch.sampler_logp)
    out["num_tokens"] = int(batch.completion_mask.sum())
    return out


__all__: Sequence[str] = [
    "LOSS_TYPES", "TOKEN_LOSS_TYPES", "SEQUENCE_LOSS_TYPES", "SCALE_REWARDS",
    "compute_advantage_stats", "group_advantages", "group_advantages_multi", "sequence_logprob",
    "sequence_logprob_and_entropy", "token_logprobs_and_entropy", "k3_kl", "clipped_surrogate",
    "aggregate_loss", "policy_loss", "RolloutBatch", "pack_rollouts", "collect_rollouts",
    "concat_rollout_batches", "batch_logprobs", "step_prompts", "rollout_generators",
    "batch_totals", "micro_batch_weights", "loss_on_batch",
]
