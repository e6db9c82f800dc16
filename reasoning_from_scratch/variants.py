"""GRPO's variants, each chosen by name, around the core loss (grpo.policy_loss).

- Loss types beyond grpo / dapo / dr_grpo: "sequence" (the book's summed log-prob ratio),
  "gspo" (GSPO, Zheng et al., arXiv 2507.18071: one length-normalised importance ratio per
  completion, clipped at the sequence level) and "cispo" (MiniMax-M1, arXiv 2506.13585,
  section 3.1: clip the stop-gradient importance weight, never drop a token's gradient).
- Off-policy corrections of the policy term: TIS (Yao, Liu et al. 2025, "Your Efficient RL
  Framework Secretly Brings You Off-Policy RL Training": weight each token by
  min(pi_old / pi_sampler, C)) and DeepSeek-V3.2's off-policy sequence masking (arXiv
  2512.02556). They touch the policy term only; masked terms keep their place in the
  normalisers, as in DeepSeek-V3.2's equation.
- The book's chapter 7 sequence-level KL (summed logp - ref_logp per answer: zero gradient on
  average, kept to show why it fails).

- DAPO's dynamic sampling (section 3.2): the further prompts of a step's sampling rounds
  (`extra_prompts`; the rounds themselves are systems.general_rollouts').

`clipped_policy_loss` takes every one of them by keyword and hands the plain token-level loss to
`grpo.policy_loss`; `loss_function(config)` picks the loss of a run once, before its first step.
"""

from __future__ import annotations

from functools import partial

import torch

from .grpo import (
    KL_ESTIMATORS,
    LOSS_TYPES,
    SEQUENCE_LOSS_TYPES,
    TOKEN_LOSS_TYPES,
    _as_column,
    aggregate_loss,
    clipped_surrogate,
    k3_kl,
    loss_terms,
    policy_loss,
    ratio_stats,
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



def clipped_policy_loss(logp, old_logp, advantages, mask, loss_type="grpo", epsilon=0.2,
                        epsilon_high=None, ref_logp=None, beta=0.0, entropy=None,
                        entropy_coef=0.0, max_completion_length=None, sampler_logp=None,
                        tis_cap=None, off_policy_mask_threshold=None, kl_estimator="k3"):
    """The GRPO loss with every variant: `grpo.policy_loss` when none is on, else
    `variant_policy_loss`. logp/old_logp/ref_logp/entropy/sampler_logp (B, T), mask (B, T),
    advantages (B,) or (B, T) (not for "sequence"/"gspo"). Returns {"loss": tensor, pg_loss, kl,
    entropy, ratio_mean, ratio_max, clip_frac_low, clip_frac_high, tis_weight_mean,
    off_policy_mask_frac}."""
    plain = (loss_type in TOKEN_LOSS_TYPES and tis_cap is None
             and off_policy_mask_threshold is None and kl_estimator == "k3")
    if plain:
        return policy_loss(logp, old_logp, advantages, mask, loss_type, epsilon, epsilon_high,
                           ref_logp, beta, entropy, entropy_coef, max_completion_length)
    return variant_policy_loss(logp, old_logp, advantages, mask, loss_type, epsilon,
                               epsilon_high, ref_logp, beta, entropy, entropy_coef,
                               max_completion_length, sampler_logp, tis_cap,
                               off_policy_mask_threshold, kl_estimator)


def variant_policy_loss(logp, old_logp, advantages, mask, loss_type, epsilon, epsilon_high,
                        ref_logp, beta, entropy, entropy_coef, max_completion_length,
                        sampler_logp, tis_cap, off_policy_mask_threshold, kl_estimator):
    """`clipped_policy_loss` for the loss types, corrections and KL estimators of this module."""
    if loss_type not in LOSS_TYPES or kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES} and kl_estimator one of "
                         f"{KL_ESTIMATORS}, got {loss_type!r}, {kl_estimator!r}")
    if tis_cap is not None and sampler_logp is None:
        raise ValueError("tis_cap (truncated importance sampling) needs sampler_logp")
    maskf = mask.to(logp.dtype)
    has_tokens = (maskf.sum(-1) > 0).to(logp.dtype)  # (B,) completions that enter the loss
    high = epsilon if epsilon_high is None else epsilon_high
    sequence_level = loss_type in SEQUENCE_LOSS_TYPES
    if sequence_level and advantages.dim() != 1:
        raise ValueError(f"loss_type={loss_type!r} needs per-completion advantages of shape (B,)")
    adv = advantages if sequence_level else _as_column(advantages, logp)
    weight, tis_weight, opsm = _off_policy_weight(logp, old_logp, advantages, adv, maskf,
                                                  loss_type, sampler_logp, tis_cap,
                                                  off_policy_mask_threshold)
    if sequence_level:  # one ratio per completion: summed or token-mean log-probs
        seq_logp = _seq_reduce(logp, maskf, loss_type)  # (B,)
        seq_old = _seq_reduce(old_logp, maskf, loss_type)
        per_seq = -clipped_surrogate(seq_logp, seq_old, adv, epsilon, epsilon_high)
        pg_loss = (per_seq * weight * has_tokens).sum() / max(logp.shape[0], 1)
        ratio, count = torch.exp(seq_logp - seq_old), has_tokens
    else:
        per_token = _token_policy_loss(logp, old_logp, adv, loss_type, epsilon, high) * weight
        pg_loss = aggregate_loss(per_token, mask, loss_type, max_completion_length)
        ratio, count = torch.exp(logp - old_logp), maskf
    kl = _kl(logp, ref_logp, beta, mask, loss_type, max_completion_length, kl_estimator)
    out = loss_terms(pg_loss, kl, beta, entropy, entropy_coef, mask, loss_type,
                     max_completion_length)
    with torch.no_grad():
        out.update(ratio_stats(ratio.detach(), adv.detach().expand_as(ratio), count, loss_type,
                               epsilon, high))
        out.update(_correction_stats(count, tis_weight, opsm, has_tokens))
    return out


def _off_policy_weight(logp, old_logp, advantages, adv, maskf, loss_type, sampler_logp, tis_cap,
                       threshold):
    """The policy term's detached weight (B,) or (B, T): TIS times the off-policy mask (1 where
    off), and each part (None where off)."""
    sequence_level = loss_type in SEQUENCE_LOSS_TYPES
    weight = torch.ones_like(adv if sequence_level else logp)  # (B,) or (B, T), no grad
    tis_weight = opsm = None
    if tis_cap is not None:
        tis_weight = truncated_is_weight(old_logp, sampler_logp, tis_cap, maskf, loss_type)
        weight = weight * tis_weight
    if threshold is not None:
        behaviour = old_logp if sampler_logp is None else sampler_logp
        opsm = off_policy_sequence_mask(logp, behaviour, advantages, maskf, threshold)
        weight = weight * (opsm if sequence_level else _as_column(opsm, logp))
    return weight, tis_weight, opsm


def _kl(logp, ref_logp, beta, mask, loss_type, max_completion_length, kl_estimator):
    """The KL term (None without a reference or beta): k3 per token, or the book's chapter 7
    summed logp - ref_logp per answer ("sequence")."""
    if ref_logp is None or not beta:
        return None
    if kl_estimator == "sequence":
        return aggregate_loss(logp - ref_logp, mask, "sequence")
    return aggregate_loss(k3_kl(logp, ref_logp), mask, loss_type, max_completion_length)


def _correction_stats(count, tis_weight, opsm, has_tokens):
    """The mean TIS weight over the counted tokens (1.0 when off, None when nothing counts) and
    the fraction of completions the off-policy mask dropped (0.0 when off)."""
    n = count.sum()
    tis_mean = 1.0
    if tis_weight is not None:
        tis_mean = None if not bool(n > 0) else ((tis_weight * count).sum() / n).item()
    mask_frac = 0.0
    if opsm is not None:
        dropped = opsm < 1 if opsm.dim() == 1 else (opsm < 1).any(dim=-1)  # (B,)
        mask_frac = ((dropped.to(has_tokens.dtype) * has_tokens).sum()
                     / has_tokens.sum().clamp(min=1)).item()
    return {"tis_weight_mean": tis_mean, "off_policy_mask_frac": mask_frac}


def loss_function(config):
    """The run's loss, chosen once from its config: `grpo.policy_loss` with the config's
    settings, or `clipped_policy_loss` with its variants. Called as fn(logp, old_logp,
    advantages, mask, ref_logp=, entropy=[, sampler_logp= when the rollouts recorded it])."""
    common = dict(loss_type=config.loss_type, epsilon=config.epsilon,
                  epsilon_high=config.epsilon_high, beta=config.beta,
                  entropy_coef=config.entropy_coef, max_completion_length=config.max_new_tokens)
    if (config.loss_type in TOKEN_LOSS_TYPES and config.tis_cap is None
            and config.off_policy_mask_threshold is None and config.kl_estimator == "k3"):
        return partial(policy_loss, **common)
    return partial(clipped_policy_loss, tis_cap=config.tis_cap, kl_estimator=config.kl_estimator,
                   off_policy_mask_threshold=config.off_policy_mask_threshold, **common)


def extra_prompts(examples, step, round_, config):
    """Dynamic sampling's further prompts of a step: `prompts_per_step` drawn without
    replacement, seeded by (seed, step, round) so a resumed run draws the same ones."""
    g = torch.Generator().manual_seed(config.seed * 1_000_003 + 104_729 * step + round_)
    idx = torch.randperm(len(examples), generator=g)[:config.prompts_per_step]
    return [examples[int(i)] for i in idx]
