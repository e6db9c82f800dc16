"""Tests for reasoning_from_scratch.grpo: hand-computed values and equivalence checks."""

import math

import pytest
import torch
from torch import nn

from reasoning_from_scratch import grpo
from reasoning_from_scratch.generation import Rollouts
from reasoning_from_scratch.grpo import (
    LOSS_TYPES,
    RolloutBatch,
    aggregate_loss,
    batch_logprobs,
    clipped_surrogate,
    compute_advantage_stats,
    group_advantages,
    group_advantages_multi,
    k3_kl,
    pack_rollouts,
    sequence_logprob,
    sequence_logprob_and_entropy,
    token_logprobs_and_entropy,
)
from reasoning_from_scratch.qwen3 import Qwen3Model, tiny_config
from reasoning_from_scratch.training import compute_grpo_loss, grpo_loss_on_batch
from reasoning_from_scratch.variants import clipped_policy_loss


class BigramLM(nn.Module):
    """Fake LM whose next-token logits are table[current token]: every number is hand-checkable."""

    def __init__(self, table):
        super().__init__()
        V = table.shape[0]
        self.embed = nn.Embedding(V, V)
        self.embed.weight.data.copy_(table)
        self.lm_head = nn.Linear(V, V, bias=False)
        self.lm_head.weight.data.copy_(torch.eye(V))  # logits = hidden = table row

    def forward_hidden(self, input_ids, attention_mask=None):
        return self.embed(input_ids)

    def forward(self, input_ids, attention_mask=None):
        return self.lm_head(self.forward_hidden(input_ids))


def _bigram():
    # After token 0 the next-token distribution is uniform over 4 tokens; after token 1 it is
    # peaked: logits [ln 8, 0, 0, 0] -> p = [8/11, 1/11, 1/11, 1/11].
    table = torch.zeros(4, 4)
    table[1, 0] = math.log(8.0)
    return BigramLM(table)


def _tiny_model(seed=0, vocab=32):
    torch.manual_seed(seed)
    return Qwen3Model(tiny_config(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=2,
                                  num_key_value_heads=1, head_dim=16))


# ---------------------------------------------------------------- advantages

def test_compute_advantage_stats_book_values():
    adv, avg, std = compute_advantage_stats([1.0, 1.0, 0.0, 0.0])
    # mean 0.5, unbiased std sqrt(1/3) = 0.57735 -> +-0.5 / (0.57735 + 1e-4) = +-0.86588
    torch.testing.assert_close(adv, torch.tensor([0.86588, 0.86588, -0.86588, -0.86588]),
                               atol=1e-5, rtol=0)
    assert abs(avg) < 1e-7
    assert std == pytest.approx(0.9998, abs=1e-4)  # 0.86588 * sqrt(4/3)
    adv, avg, std = compute_advantage_stats([0.0, 0.0, 0.0, 0.0])
    assert adv.tolist() == [0.0] * 4 and avg == 0.0 and std == 0.0


def test_group_advantages_scalings():
    rewards = torch.tensor([[1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    g = group_advantages(rewards, "group")
    torch.testing.assert_close(g[0], compute_advantage_stats([1.0, 1.0, 0.0, 0.0])[0])
    assert g[1].tolist() == [0.0] * 4  # a group with equal rewards carries no signal
    # batch: group-centred, divided by the std of all 8 rewards: stdev(1,1,0,0,0,0,0,0) = 0.46291
    b = group_advantages(rewards, "batch")
    torch.testing.assert_close(b[0], torch.tensor([1.07989, 1.07989, -1.07989, -1.07989]),
                               atol=1e-4, rtol=0)
    # none (Dr. GRPO): only the group mean is removed
    assert group_advantages(rewards, "none")[0].tolist() == [0.5, 0.5, -0.5, -0.5]
    with pytest.raises(ValueError, match="scale_rewards"):
        group_advantages(rewards, "std")
    with pytest.raises(ValueError, match="G >= 2"):
        group_advantages(torch.ones(3, 1))


# ---------------------------------------------------------------- log-probs and entropy

def test_sequence_logprob_and_entropy_hand_values():
    model = _bigram()
    # prompt [2, 0], answer [3, 1, 0]: predicted after 0 (uniform), after 3 (uniform),
    # after 1 (peaked, token 0 has p = 8/11).
    ids = torch.tensor([2, 0, 3, 1, 0])
    logp, ent = sequence_logprob_and_entropy(model, ids, prompt_len=2)
    expected_logp = 2 * math.log(0.25) + math.log(8 / 11)  # -2.77259 - 0.31845
    # entropies: ln 4 = 1.386294 (twice) and -(8/11 ln 8/11 + 3/11 ln 1/11) = 0.885574
    expected_ent = (2 * math.log(4) + 0.8855741515766717) / 3
    assert logp.item() == pytest.approx(expected_logp, abs=1e-5)
    assert ent.item() == pytest.approx(expected_ent, abs=1e-5)
    assert sequence_logprob(model, ids, 2).item() == pytest.approx(expected_logp, abs=1e-5)
    # an empty answer gives 0 and 0
    logp, ent = sequence_logprob_and_entropy(model, ids[:2], prompt_len=2)
    assert logp.item() == 0.0 and ent.item() == 0.0
    assert sequence_logprob(model, ids[:2], 2).item() == 0.0


def test_token_logprobs_hand_values_and_mask():
    model = _bigram()
    ids = torch.tensor([[2, 0, 3, 1, 0], [2, 1, 0, 2, 2]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    logp, ent = token_logprobs_and_entropy(model, ids, None, 2, mask, chunk_size=2)
    q = math.log(0.25)
    torch.testing.assert_close(logp, torch.tensor([[q, q, math.log(8 / 11)],
                                                   [math.log(8 / 11), 0.0, 0.0]]))
    torch.testing.assert_close(ent, torch.tensor([[math.log(4), math.log(4), 0.885574],
                                                  [0.885574, 0.0, 0.0]]), atol=1e-5, rtol=0)


def test_chunked_token_logprobs_match_full_and_per_sample():
    """Packed, left-padded, chunked + checkpointed == per-sample book functions (values, grads)."""
    model = _tiny_model()
    prompts = [torch.tensor([5, 6, 7]), torch.tensor([8, 9, 10, 11, 12])]
    comps = [torch.tensor([[1, 2, 3, 4], [4, 3, 0, 0]]), torch.tensor([[7, 7, 7, 0]])]
    masks = [torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]]).bool(), torch.tensor([[1, 1, 1, 0]]).bool()]
    ids, attn, P, cmask = pack_rollouts(prompts, comps, masks, pad_id=0)
    assert P == 5 and ids.shape == (3, 9) and attn[0].tolist() == [0, 0] + [1] * 7

    logp_c, ent_c = token_logprobs_and_entropy(model, ids, attn, P, cmask, chunk_size=2)
    logp_f, ent_f = token_logprobs_and_entropy(model, ids, attn, P, cmask, chunk_size=10_000)
    torch.testing.assert_close(logp_c, logp_f)
    torch.testing.assert_close(ent_c, ent_f)

    rows = [(prompts[0], comps[0][0, :4]), (prompts[0], comps[0][1, :2]),
            (prompts[1], comps[1][0, :3])]
    for b, (p, c) in enumerate(rows):
        seq_lp, seq_ent = sequence_logprob_and_entropy(model, torch.cat([p, c]), len(p))
        assert logp_c[b].sum().item() == pytest.approx(seq_lp.item(), abs=1e-4)
        n = int(cmask[b].sum())
        assert ent_c[b, :n].mean().item() == pytest.approx(seq_ent.item(), abs=1e-4)

    # gradients through the checkpointed chunks equal the unchunked ones
    def grads(chunk):
        model.zero_grad()
        lp, ent = token_logprobs_and_entropy(model, ids, attn, P, cmask, chunk_size=chunk)
        (lp.sum() + 0.1 * ent.sum()).backward()
        return [p.grad.clone() for p in model.parameters()]

    for g1, g2 in zip(grads(2), grads(10_000)):
        torch.testing.assert_close(g1, g2, atol=1e-5, rtol=1e-4)


def test_token_logprobs_rejects_bad_shapes():
    model = _bigram()
    with pytest.raises(ValueError, match="completion_mask shape"):
        token_logprobs_and_entropy(model, torch.zeros(2, 5, dtype=torch.long), None, 2,
                                   torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="prompt_len"):
        token_logprobs_and_entropy(model, torch.zeros(2, 5, dtype=torch.long), None, 0)


# ---------------------------------------------------------------- loss pieces

def test_k3_kl_values():
    # ref - logp = -1: e^-1 + 1 - 1 = 0.367879; ref - logp = +1: e - 1 - 1 = 0.718282; equal: 0
    out = k3_kl(torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-2.0, -1.0, -0.5]))
    torch.testing.assert_close(out, torch.tensor([0.367879, 0.718282, 0.0]), atol=1e-6, rtol=0)


def test_clipped_surrogate_hand_values():
    ratio = torch.tensor([1.1, 1.5, 0.5, 0.5, 1.5, 1.5])
    adv = torch.tensor([2.0, 2.0, 2.0, -1.0, -1.0, 0.0])
    logp, old = torch.log(ratio), torch.zeros(6)
    obj = clipped_surrogate(logp, old, adv, epsilon=0.2)
    # A=2 r=1.1 inside: 2.2 | A=2 r=1.5: min(3.0, 1.2*2=2.4) = 2.4 | A=2 r=0.5: min(1.0, 1.6) = 1.0
    # A=-1 r=0.5: min(-0.5, -0.8) = -0.8 | A=-1 r=1.5: min(-1.5, -1.2) = -1.5 | A=0: 0
    torch.testing.assert_close(obj, torch.tensor([2.2, 2.4, 1.0, -0.8, -1.5, 0.0]))
    # DAPO clip-higher: upper bound 1.28 -> 2.56 for A=2, r=1.5; lower side unchanged
    obj_hi = clipped_surrogate(logp, old, adv, epsilon=0.2, epsilon_high=0.28)
    torch.testing.assert_close(obj_hi, torch.tensor([2.2, 2.56, 1.0, -0.8, -1.5, 0.0]))
    # no clipping (book chapter 6): r * A
    torch.testing.assert_close(clipped_surrogate(logp, old, adv, epsilon=None), ratio * adv)
    # DeepSeek-R1's epsilon = 10 never clips these ratios
    torch.testing.assert_close(clipped_surrogate(logp, old, adv, epsilon=10.0), ratio * adv)

    # the `where` form acting on the ratios is identical
    clip = ratio.clamp(0.8, 1.2)
    where_form = torch.where(adv >= 0, adv * torch.minimum(ratio, clip),
                             adv * torch.maximum(ratio, clip))
    torch.testing.assert_close(obj, where_form)
    # ...while max() of the *products* for A < 0 is the optimistic bound: -0.5 instead of -0.8
    products = torch.where(adv >= 0, torch.minimum(ratio * adv, clip * adv),
                           torch.maximum(ratio * adv, clip * adv))
    assert products[3].item() == pytest.approx(-0.5) and obj[3].item() == pytest.approx(-0.8)

    # inside the clipped region the gradient is zero
    lp = logp.clone().requires_grad_(True)
    clipped_surrogate(lp, old, adv, epsilon=0.2).sum().backward()
    # d(rA)/dlogp = rA where active: 2.2, 0, 1.0, 0, -1.5, 0
    torch.testing.assert_close(lp.grad, torch.tensor([2.2, 0.0, 1.0, 0.0, -1.5, 0.0]))


def test_aggregate_loss_types():
    loss = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, 100.0, 100.0, 100.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]]).bool()
    # grpo: per-sequence means (1+2+3)/3 = 2 and 4 -> mean 3
    assert aggregate_loss(loss, mask, "grpo").item() == pytest.approx(3.0)
    # dapo: all 4 real tokens: (1+2+3+4)/4 = 2.5
    assert aggregate_loss(loss, mask, "dapo").item() == pytest.approx(2.5)
    # dr_grpo: 10 / (B=2 x T=4) = 1.25; with a generation budget of 10 tokens: 10 / 20 = 0.5
    assert aggregate_loss(loss, mask, "dr_grpo").item() == pytest.approx(1.25)
    assert aggregate_loss(loss, mask, "dr_grpo", max_completion_length=10).item() == 0.5
    # sequence: per-sequence sums 6 and 4 -> mean 5
    assert aggregate_loss(loss, mask, "sequence").item() == pytest.approx(5.0)
    with pytest.raises(ValueError, match="loss_type"):
        aggregate_loss(loss, mask, "ppo")
    # an empty batch (no rows) gives 0 for every type, not a NaN mean over no sequences
    for loss_type in ("grpo", "dapo", "dr_grpo", "sequence"):
        empty = aggregate_loss(torch.zeros(0, 4), torch.zeros(0, 4, dtype=torch.bool), loss_type)
        assert empty.item() == 0.0, loss_type


def test_entropy_bonus_by_hand():
    """loss = policy term - entropy_coef x entropy, the entropy reduced like the policy term
    ("sequence" like grpo: a per-answer sum would reward long answers for their length); the
    logged entropy is the mean per answer token whatever the loss type."""
    entropy = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]]).bool()
    logp = torch.zeros(2, 3)
    adv = torch.tensor([1.0, -1.0])
    # grpo: answer means 2 and 4 -> 3; dapo: (1 + 2 + 3 + 4) / 4 = 2.5; dr_grpo: 10 / 6
    for loss_type, bonus in (("grpo", 3.0), ("sequence", 3.0), ("dapo", 2.5),
                             ("dr_grpo", 10 / 6)):
        plain = clipped_policy_loss(logp, logp, adv, mask, loss_type, entropy=entropy)
        out = clipped_policy_loss(logp, logp, adv, mask, loss_type, entropy=entropy,
                                  entropy_coef=0.1)
        assert out["entropy"] == plain["entropy"] == pytest.approx(2.5)
        assert out["loss"].item() == pytest.approx(plain["loss"].item() - 0.1 * bonus), loss_type


def test_sequence_level_losses_average_over_every_completion():
    """A completion without answer tokens keeps its place in the mean over completions (as
    grpo's per-token mean does): the sequence losses divide by B, not by the answered rows."""
    logp = torch.tensor([[math.log(1.1), 0.0], [0.0, 0.0]])
    mask = torch.tensor([[1, 0], [0, 0]]).bool()
    adv = torch.tensor([1.0, -1.0])
    for loss_type in ("sequence", "gspo", "grpo"):
        # ratio 1.1 inside the clip range: surrogate 1.1 x 1 on row 0, nothing on row 1
        out = clipped_policy_loss(logp, torch.zeros(2, 2), adv, mask, loss_type)
        assert out["pg_loss"] == pytest.approx(-1.1 / 2), loss_type


def _random_batch(seed=0, B=3, T=5):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g) * 3
    old = logp + 0.3 * torch.randn(B, T, generator=g)
    ref = logp + 0.3 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]]).bool()[:B, :T]
    return logp, old, ref, adv, mask


def test_clipped_policy_loss_matches_deepseekmath_eq3_written_out():
    logp, old, ref, adv, mask = _random_batch()
    eps, beta = 0.2, 0.04
    out = clipped_policy_loss(logp, old, adv, mask, "grpo", eps, None, ref, beta)
    # DeepSeekMath eq. 3 with eq. 4, loop by loop
    total = 0.0
    for i in range(logp.shape[0]):
        terms = []
        for t in range(int(mask[i].sum())):
            r = math.exp(logp[i, t] - old[i, t])
            surr = min(r * adv[i], min(max(r, 1 - eps), 1 + eps) * adv[i])
            d = ref[i, t] - logp[i, t]
            kl = math.exp(d) - d - 1
            terms.append(surr - beta * kl)
        total += sum(terms) / len(terms)
    expected = -total / logp.shape[0]
    assert out["loss"].item() == pytest.approx(float(expected), abs=1e-5)


def test_clipped_policy_loss_token_level_advantages_and_sequence_type():
    logp, old, ref, adv, mask = _random_batch()
    # (B, T) advantages equal to the broadcast (B,) ones give the same loss
    a = clipped_policy_loss(logp, old, adv, mask, "dapo")["loss"]
    b = clipped_policy_loss(logp, old, adv[:, None].expand_as(logp), mask, "dapo")["loss"]
    torch.testing.assert_close(a, b)
    # "sequence": ratio of summed log-probs, clipped (book chapter 7)
    out = clipped_policy_loss(logp, old, adv, mask, "sequence", epsilon=0.2)
    s_new, s_old = (logp * mask).sum(1), (old * mask).sum(1)
    r = torch.exp(s_new - s_old)
    expected = -torch.minimum(r * adv, r.clamp(0.8, 1.2) * adv).mean()
    assert out["loss"].item() == pytest.approx(expected.item(), abs=1e-6)
    with pytest.raises(ValueError, match="sequence"):
        clipped_policy_loss(logp, old, adv[:, None].expand_as(logp), mask, "sequence")


def test_sequence_loss_gradient_equals_book_chapter6_at_ratio_one():
    logp, _, _, adv, mask = _random_batch()
    lp1 = logp.clone().requires_grad_(True)
    clipped_policy_loss(lp1, lp1.detach(), adv, mask, "sequence", epsilon=None)["loss"].backward()
    lp2 = logp.clone().requires_grad_(True)
    summed = (lp2 * mask).sum(1)
    (-(adv * summed).mean()).backward()  # book chapter 6: pg_loss = -(A * logps).mean()
    torch.testing.assert_close(lp1.grad, lp2.grad)


def test_clip_statistics():
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.0, 1.0]]))
    adv = torch.tensor([[1.0, -1.0, 1.0, 1.0]])
    out = clipped_policy_loss(logp, torch.zeros(1, 4), adv, torch.ones(1, 4, dtype=torch.bool))
    assert out["clip_frac_high"] == 0.25 and out["clip_frac_low"] == 0.25
    assert out["ratio_max"] == pytest.approx(1.5) and out["ratio_mean"] == pytest.approx(1.0)
    # a ratio outside the range on the unclipped side of the min is not counted: 0.5 with
    # A > 0 (r A = 0.5 < clip(r) A = 0.8) and 1.5 with A < 0
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.0, 1.0, 0.5, 1.5]]))
    adv = torch.tensor([[1.0, -1.0, 1.0, 1.0, 1.0, -1.0]])
    out = clipped_policy_loss(logp, torch.zeros(1, 6), adv, torch.ones(1, 6, dtype=torch.bool))
    assert out["clip_frac_high"] == pytest.approx(1 / 6)
    assert out["clip_frac_low"] == pytest.approx(1 / 6)


# ---------------------------------------------------------------- compute_grpo_loss with fakes

class FakeTokenizer:
    eos_token_id = 1
    pad_token_id = 0
    think_token_id = 30
    end_think_token_id = 31


def _fake_rollouts(completions):
    def fake(model, tokenizer, prompts, num_rollouts, device, **kw):
        assert len(prompts) == 1
        return [_one(num_rollouts)]

    def _one(num_rollouts):
        T = max(len(c) for c in completions)
        ids = torch.zeros(len(completions), T, dtype=torch.long)
        mask = torch.zeros(len(completions), T, dtype=torch.bool)
        for i, c in enumerate(completions):
            ids[i, :len(c)] = torch.tensor(c)
            mask[i, :len(c)] = True
        return Rollouts(torch.tensor([5, 6, 7, 8]), ids, mask, [str(c) for c in completions],
                        mask.sum(1), torch.tensor([c[-1] != 1 for c in completions]))
    return fake


def test_compute_grpo_loss_matches_book_loop(monkeypatch):
    completions = [[3, 4, 1], [9, 1], [3, 1], [2, 2, 2, 2, 2]]
    monkeypatch.setattr(grpo, "sample_rollouts_batch", _fake_rollouts(completions))
    rewards = {"[3, 4, 1]": 1.0, "[9, 1]": 0.0, "[3, 1]": 1.0, "[2, 2, 2, 2, 2]": 0.0}

    def reward_fn(text, token_ids, prompt_len, example):
        return rewards[text], {"correct": rewards[text]}

    model = _tiny_model()
    out = compute_grpo_loss(model, FakeTokenizer(), {"problem": "p", "answer": "a"}, "cpu",
                            num_rollouts=4, reward_fn=reward_fn, loss_type="grpo", epsilon=0.2)
    assert out["rewards"] == [1.0, 0.0, 1.0, 0.0]
    adv = compute_advantage_stats(out["rewards"])[0]
    torch.testing.assert_close(torch.tensor(out["advantages"]), adv)
    assert out["policy_ratio"] == pytest.approx(1.0) and out["clip_fraction"] == 0.0
    assert out["loss"] == pytest.approx(0.0, abs=1e-6)  # ratio 1: -mean(A) = 0
    assert len(out["samples"]) == 4 and out["samples"][3]["length"] == 5
    assert {"loss", "pg_loss", "kl_loss", "entropy", "loss_tensor"} <= set(out)
    model.zero_grad()
    out["loss_tensor"].backward()
    ours = [p.grad.clone() for p in model.parameters()]

    # book-style: one sequence_logprob per rollout, loss -(1/G) sum_i A_i / |o_i| log pi(o_i)
    model.zero_grad()
    prompt = torch.tensor([5, 6, 7, 8])
    loss = 0.0
    for a, c in zip(adv, completions):
        loss = loss - a * sequence_logprob(model, torch.cat([prompt, torch.tensor(c)]), 4) / len(c)
    (loss / 4).backward()
    for g1, p in zip(ours, model.parameters()):
        torch.testing.assert_close(g1, p.grad, atol=1e-6, rtol=1e-4)


def test_compute_grpo_loss_kl_needs_reference(monkeypatch):
    monkeypatch.setattr(grpo, "sample_rollouts_batch", _fake_rollouts([[3, 1], [4, 1]]))
    model = _tiny_model()
    with pytest.raises(ValueError, match="ref_model"):
        compute_grpo_loss(model, FakeTokenizer(), {"problem": "p", "answer": "a"}, "cpu",
                          num_rollouts=2, beta=0.1)
    out = compute_grpo_loss(model, FakeTokenizer(), {"problem": "p", "answer": "a"}, "cpu",
                            num_rollouts=2, beta=0.1, ref_model=_tiny_model(seed=1),
                            reward_fn=lambda *a: (0.0, {}))
    assert out["kl_loss"] > 0


def test_token_level_advantage_hook(monkeypatch):
    """advantage_fn returning (B, Tc) advantages: broadcast outcome ones reproduce the default."""
    monkeypatch.setattr(grpo, "sample_rollouts_batch", _fake_rollouts([[3, 4, 1], [9, 1], [3, 1]]))
    seen = {}

    def reward_fn(text, token_ids, prompt_len, example):
        return float(len(text)), {}

    def advantage_fn(groups, advantages, completion_mask):
        seen["shapes"] = (len(groups), tuple(advantages.shape), tuple(completion_mask.shape))
        return advantages.reshape(-1, 1) * completion_mask.float()

    model, ex = _tiny_model(), {"problem": "p", "answer": "a"}
    kw = dict(num_rollouts=3, reward_fn=reward_fn, loss_type="dapo")
    torch.manual_seed(0)
    plain = compute_grpo_loss(model, FakeTokenizer(), ex, "cpu", **kw)
    hooked = compute_grpo_loss(model, FakeTokenizer(), ex, "cpu", advantage_fn=advantage_fn, **kw)
    assert seen["shapes"] == (1, (1, 3), (3, 3))
    assert len(hooked["advantages"]) == 3 and len(hooked["advantages"][0]) == 3
    model.zero_grad()
    plain["loss_tensor"].backward()
    g1 = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    hooked["loss_tensor"].backward()
    for a, p in zip(g1, model.parameters()):
        torch.testing.assert_close(a, p.grad)


# ---------------------------------------------------------------- GSPO, CISPO, TIS, off-policy mask
# Each test checks clipped_policy_loss against an independent few-line implementation written
# from the paper's formula, on tiny float64 tensors: the loss value AND its gradient wrt logp.

def _off_policy_batch():
    """4 completions (float64) with hand-chosen mean log-ratios: 1.5x, 0.5x, ~1x and 1.5x."""
    g = torch.Generator().manual_seed(3)
    logp = -torch.rand(4, 3, generator=g, dtype=torch.float64) * 2
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 0, 0]]).bool()
    # per-token log-ratios whose mean over each completion's real tokens is the target
    target = torch.tensor([math.log(1.5), math.log(0.5), 0.01, math.log(1.5)], dtype=torch.float64)
    jitter = torch.tensor([[0.3, -0.1, -0.2], [0.2, -0.2, 0.7], [0.1, 0.0, -0.1], [0.0, 0.4, 0.4]],
                          dtype=torch.float64)
    old = logp - (target[:, None] + jitter)
    adv = torch.tensor([1.0, -1.0, 0.5, -2.0], dtype=torch.float64)
    ref = logp + 0.2 * torch.randn(4, 3, generator=g, dtype=torch.float64)
    return logp, old, ref, adv, mask


def _value_and_grad(fn, logp):
    """fn(logp with grad) -> scalar; returns (value, d value / d logp)."""
    lp = logp.clone().requires_grad_(True)
    out = fn(lp)
    out = out["loss"] if isinstance(out, dict) else out
    out.backward()
    return out.detach(), lp.grad


def _gspo_token_form(lp, old, adv, mask, eps, eps_high, ref=None, beta=0.0):
    """GSPO-token (Zheng et al. 2025): s_it = sg(s_i) pi(y_t) / sg(pi(y_t)), same gradient."""
    m = mask.double()
    n = m.sum(1)
    s = torch.exp(((lp - old) * m).sum(1) / n)  # (B,) length-normalised sequence ratio
    s_tok = s.detach()[:, None] * torch.exp(lp - lp.detach())  # value s_i, grad wrt token t
    A = adv[:, None]
    obj = torch.minimum(s_tok * A, s_tok.clamp(1 - eps, 1 + eps_high) * A)
    if ref is not None:
        obj = obj - beta * (torch.exp(ref - lp) - (ref - lp) - 1)  # k3 per token
    return -((obj * m).sum(1) / n).mean()


def test_gspo_matches_gspo_token_form_values_grads_and_stats():
    logp, old, ref, adv, mask = _off_policy_batch()
    grads = []
    for beta, r in ((0.0, None), (0.1, ref)):  # without and with the k3 KL term
        ours = _value_and_grad(lambda lp, r=r, beta=beta: clipped_policy_loss(
            lp, old, adv, mask, "gspo", 0.2, 0.28, r, beta), logp)
        theirs = _value_and_grad(lambda lp, r=r, beta=beta: _gspo_token_form(
            lp, old, adv, mask, 0.2, 0.28, r, beta), logp)
        torch.testing.assert_close(ours[0], theirs[0])
        torch.testing.assert_close(ours[1], theirs[1])
        grads.append(ours[1])
    # completion 0 (s = 1.5 > 1.28, A > 0) and 1 (s = 0.5 < 0.8, A < 0) are clipped: zero grads
    assert grads[0][:2].abs().max() == 0 and grads[0][2:].abs().max() > 0
    out = clipped_policy_loss(logp, old, adv, mask, "gspo", 0.2, 0.28)
    assert out["clip_frac_high"] == 0.25 and out["clip_frac_low"] == 0.25  # of 4 completions
    assert out["ratio_max"] == pytest.approx(1.5)
    assert out["ratio_mean"] == pytest.approx((1.5 + 0.5 + math.exp(0.01) + 1.5) / 4)
    with pytest.raises(ValueError, match="gspo"):
        clipped_policy_loss(logp, old, adv[:, None].expand_as(logp), mask, "gspo")


def test_cispo_matches_written_out_formula_values_grads_and_stats():
    logp, old, ref, adv, mask = _off_policy_batch()
    eps_high, beta = 0.28, 0.05

    def written_out(lp):
        # MiniMax-M1 eq. 4 (no lower bound on the IS weight), KL per token over all tokens
        n_tokens, total = int(mask.sum()), 0.0
        for i, t in mask.nonzero().tolist():
            w = min(math.exp(lp[i, t].item() - old[i, t].item()), 1 + eps_high)  # sg(...)
            d = ref[i, t] - lp[i, t]
            total = total - w * adv[i] * lp[i, t] + beta * (torch.exp(d) - d - 1)
        return total / n_tokens

    ours = _value_and_grad(lambda lp: clipped_policy_loss(lp, old, adv, mask, "cispo", 0.2,
                                                          eps_high, ref, beta), logp)
    theirs = _value_and_grad(written_out, logp)
    torch.testing.assert_close(ours[0], theirs[0])
    torch.testing.assert_close(ours[1], theirs[1])
    assert (ours[1][mask] != 0).all()  # unlike PPO clipping, no token loses its gradient
    out = clipped_policy_loss(logp, old, adv, mask, "cispo", 0.2, eps_high)
    r = torch.exp(logp - old)[mask]
    assert out["clip_frac_high"] == pytest.approx(float((r > 1 + eps_high).double().mean()))
    assert out["clip_frac_low"] == 0.0 and out["ratio_max"] == pytest.approx(r.max().item())


def test_truncated_importance_sampling_token_and_sequence_level():
    logp, old, _, adv, mask = _off_policy_batch()
    g = torch.Generator().manual_seed(5)
    sampler = old + 0.5 * torch.randn(old.shape, generator=g, dtype=torch.float64)
    cap, eps = 2.0, 0.2
    w_tok = torch.exp(old - sampler).clamp(max=cap)  # Yao et al. 2025: min(pi_old / pi_vllm, C)
    assert (w_tok[mask] == cap).any() and (w_tok[mask] < 1).any()  # both regimes are exercised

    def grpo_written_out(lp):  # DeepSeekMath eq. 3, each token's term times its TIS weight
        total = 0.0
        for i in range(lp.shape[0]):
            toks = mask[i].nonzero().flatten().tolist()
            terms = [w_tok[i, t] * torch.minimum(torch.exp(lp[i, t] - old[i, t]) * adv[i],
                                                 torch.exp(lp[i, t] - old[i, t])
                                                 .clamp(1 - eps, 1 + eps) * adv[i]) for t in toks]
            total = total + sum(terms) / len(terms)
        return -total / lp.shape[0]

    ours = _value_and_grad(lambda lp: clipped_policy_loss(
        lp, old, adv, mask, "grpo", eps, sampler_logp=sampler, tis_cap=cap), logp)
    theirs = _value_and_grad(grpo_written_out, logp)
    torch.testing.assert_close(ours[0], theirs[0])
    torch.testing.assert_close(ours[1], theirs[1])

    # gspo: one weight per completion from the same token-mean log-ratio as its ratio
    m = mask.double()
    w_seq = torch.exp(((old - sampler) * m).sum(1) / m.sum(1)).clamp(max=cap)
    ours = _value_and_grad(lambda lp: clipped_policy_loss(
        lp, old, adv, mask, "gspo", eps, sampler_logp=sampler, tis_cap=cap), logp)
    theirs = _value_and_grad(lambda lp: _gspo_token_form(lp, old, adv * w_seq, mask, eps, eps),
                             logp)  # w_seq >= 0 factors out of the min like a scaled advantage
    torch.testing.assert_close(ours[0], theirs[0])
    torch.testing.assert_close(ours[1], theirs[1])
    out = clipped_policy_loss(logp, old, adv, mask, "dapo", sampler_logp=sampler, tis_cap=cap)
    assert out["tis_weight_mean"] == pytest.approx(w_tok[mask].mean().item())
    assert clipped_policy_loss(logp, old, adv, mask)["tis_weight_mean"] == 1.0
    with pytest.raises(ValueError, match="sampler_logp"):
        clipped_policy_loss(logp, old, adv, mask, tis_cap=cap)


def test_off_policy_sequence_mask_deepseek_v32():
    logp, old, _, adv, mask = _off_policy_batch()
    old = logp + 0.1 * (old - logp).clamp(-1, 1)  # ratios within the clip range: grads flow
    # sampler log-probs: completions 0 and 1 drifted (mean log pi_sampler / pi_theta = 0.5),
    # completions 2 and 3 did not (0.05)
    drift = torch.tensor([0.5, 0.5, 0.05, 0.05], dtype=torch.float64)[:, None]
    sampler = logp + drift
    delta, eps = 0.1, 0.2

    def grpo_written_out(lp):  # DeepSeekMath eq. 3 times M_i (DeepSeek-V3.2)
        total = 0.0
        for i in range(lp.shape[0]):
            toks = mask[i].nonzero().flatten().tolist()
            kl = sum(sampler[i, t].item() - lp[i, t].item() for t in toks) / len(toks)
            keep = 0.0 if (adv[i] < 0 and kl > delta) else 1.0
            terms = [torch.minimum(torch.exp(lp[i, t] - old[i, t]) * adv[i],
                                   torch.exp(lp[i, t] - old[i, t]).clamp(1 - eps, 1 + eps)
                                   * adv[i]) for t in toks]
            total = total + keep * sum(terms) / len(terms)
        return -total / lp.shape[0]

    kw = dict(sampler_logp=sampler, off_policy_mask_threshold=delta)
    ours = _value_and_grad(lambda lp: clipped_policy_loss(lp, old, adv, mask, "grpo", eps, **kw),
                           logp)
    theirs = _value_and_grad(grpo_written_out, logp)
    torch.testing.assert_close(ours[0], theirs[0])
    torch.testing.assert_close(ours[1], theirs[1])
    # only completion 1 is dropped: negative advantage and drifted (0 is drifted but positive)
    assert ours[1][1].abs().max() == 0 and ours[1][0].abs().max() > 0
    out = clipped_policy_loss(logp, old, adv, mask, "grpo", eps, **kw)
    assert out["off_policy_mask_frac"] == 0.25
    # per-token advantages (process supervision) broadcast from (B,) give the same loss
    tok = clipped_policy_loss(logp, old, adv[:, None].expand_as(logp), mask, "grpo", eps, **kw)
    torch.testing.assert_close(tok["loss"], out["loss"])
    # without sampler log-probs the KL is taken against old_logp
    no_sampler = clipped_policy_loss(logp, sampler, adv, mask, "grpo", eps,
                                     off_policy_mask_threshold=delta)
    assert no_sampler["off_policy_mask_frac"] == 0.25
    # sequence-level types: the dropped completion adds nothing
    seq = _value_and_grad(lambda lp: clipped_policy_loss(lp, old, adv, mask, "gspo", eps, **kw),
                          logp)
    keep = torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=torch.float64)
    ref_seq = _value_and_grad(lambda lp: _gspo_token_form(lp, old, adv * keep, mask, eps, eps),
                              logp)
    torch.testing.assert_close(seq[0], ref_seq[0])
    torch.testing.assert_close(seq[1], ref_seq[1])


def test_new_loss_types_keep_the_kl_aggregation_of_their_policy_term():
    logp, old, ref, adv, mask = _off_policy_batch()
    k3 = k3_kl(logp, ref)
    for loss_type, like in (("gspo", "grpo"), ("cispo", "dapo")):
        with_kl = clipped_policy_loss(logp, old, adv, mask, loss_type, ref_logp=ref, beta=0.5)
        assert with_kl["kl"] == pytest.approx(aggregate_loss(k3, mask, like).item())
        without = clipped_policy_loss(logp, old, adv, mask, loss_type)
        assert with_kl["loss"].item() == pytest.approx(without["loss"].item() + 0.5 * with_kl["kl"])


# ---------------------------------------------------------------- GDPO multi-reward advantages

def test_group_advantages_multi_gdpo_hand_values():
    # two reward components (correct, format), weights 1 and 0.5, three groups of G = 4, eps = 0
    correct = torch.tensor([[1.0, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    fmt = torch.tensor([[1.0, 1, 1, 1], [1, 0, 1, 0], [0.1, 0.1, 0.1, 0.1]])
    # group 1: correct mean .25, centred [.75, -.25 x3], unbiased std .5 -> [1.5, -.5, -.5, -.5];
    #          format all equal -> 0
    # group 2: correct 0; format mean .5, centred +-.5, std sqrt(1/3) -> +-.866025, x .5 weight
    # group 3: both components all equal -> exactly 0
    h = 0.5 * 0.5 / math.sqrt(1 / 3)  # 0.4330127
    summed = torch.tensor([[1.5, -0.5, -0.5, -0.5], [h, -h, h, -h], [0.0] * 4])
    out = group_advantages_multi([correct, fmt], [1.0, 0.5], batch_normalize=False, eps=0.0)
    torch.testing.assert_close(out, summed)
    # GDPO's batch normalisation: divide by the unbiased std of all 12 values (their mean is 0):
    # sum of squares 2.25 + 3 x .25 + 4 x .1875 = 3.75 -> std sqrt(3.75 / 11) = 0.583874
    out = group_advantages_multi([correct, fmt], [1.0, 0.5], eps=0.0)
    torch.testing.assert_close(out, summed / math.sqrt(3.75 / 11))
    assert out[2].tolist() == [0.0] * 4  # zero-signal groups stay exactly zero
    # GRPO on the weighted sum (1.5, .5, .5, .5 in group 1) mixes the components instead
    grpo = group_advantages(correct + 0.5 * fmt, eps=0.0)
    assert not torch.allclose(grpo[1], summed[1])
    # one component, no weights, no batch step: plain group_advantages
    torch.testing.assert_close(group_advantages_multi([correct], batch_normalize=False),
                               group_advantages(correct))
    with pytest.raises(ValueError, match="weights"):
        group_advantages_multi([correct, fmt], [1.0])
    with pytest.raises(ValueError, match="one shape"):
        group_advantages_multi([correct, fmt[:2]])


# ---------------------------------------------------------------- log-probs at temperature T

def test_token_logprobs_at_sampling_temperature():
    model = _tiny_model()
    ids = torch.tensor([[5, 6, 7, 1, 2, 3, 4], [8, 9, 10, 4, 3, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]]).bool()
    T = 0.7
    with torch.no_grad():
        logits = model(ids)  # (B, L, V)
    ls = torch.log_softmax(logits / T, dim=-1)[:, 2:-1]  # rows predicting the answer tokens
    expected = ls.gather(-1, ids[:, 3:].unsqueeze(-1)).squeeze(-1) * mask
    expected_ent = -(ls.exp() * ls).sum(-1) * mask
    logp, ent = token_logprobs_and_entropy(model, ids, None, 3, mask, chunk_size=3, temperature=T)
    torch.testing.assert_close(logp, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, expected_ent, atol=1e-5, rtol=1e-5)
    plain, _ = token_logprobs_and_entropy(model, ids, None, 3, mask)
    assert not torch.allclose(plain, logp)  # T = 1 (default) is a different distribution
    batch = RolloutBatch(ids, None, 3, mask, torch.tensor([1.0, -1.0]), torch.zeros(1, 2))
    torch.testing.assert_close(batch_logprobs(model, batch, temperature=T)[0], logp)
    out = grpo_loss_on_batch(model, batch, temperature=T)
    assert out["entropy"] == pytest.approx((expected_ent.sum() / mask.sum()).item(), abs=1e-5)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs_and_entropy(model, ids, None, 3, mask, temperature=0.0)


# ---------------------------------------------------------------- defects (regression tests)

def test_ratio_statistics_are_none_when_no_token_counts():
    logp = torch.zeros(2, 3)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    for loss_type in LOSS_TYPES:
        out = clipped_policy_loss(logp, logp, torch.tensor([1.0, -1.0]), mask, loss_type)
        assert out["ratio_max"] is None and out["ratio_mean"] is None, loss_type  # was -inf
        assert out["clip_frac_low"] == 0.0 and out["clip_frac_high"] == 0.0
        assert out["loss"].item() == 0.0 and out["pg_loss"] == 0.0


def test_equal_non_binary_rewards_give_exactly_zero_advantages():
    # 7 x 0.1: the float32 mean is not exactly 0.1, which left ~7e-5 after dividing by std + 1e-4
    rewards = torch.tensor([[0.1] * 7, [0.7] * 7, [1.0, 0, 0, 0, 0, 0, 0]])
    for scale in ("group", "batch", "none"):
        adv = group_advantages(rewards, scale)
        assert adv[:2].abs().max().item() == 0.0, scale
        assert adv[2].abs().max().item() > 0.5 or scale == "none"
    assert compute_advantage_stats([0.1] * 7)[0].abs().max().item() == 0.0


def test_compute_advantage_stats_single_rollout_is_zero_not_nan():
    adv, avg, std = compute_advantage_stats([0.7])
    assert adv.tolist() == [0.0] and avg == 0.0 and std == 0.0


def test_all_masked_batch_loss_is_zero_and_backpropagates():
    model = _tiny_model()
    ids = torch.tensor([[5, 6, 7, 1, 2], [5, 6, 7, 3, 4]])
    mask = torch.zeros(2, 2, dtype=torch.bool)  # e.g. every completion truncated and masked
    batch = RolloutBatch(ids, None, 3, mask, torch.tensor([1.0, -1.0]), torch.zeros(1, 2))
    ref = torch.zeros(2, 2)
    for loss_type in LOSS_TYPES:
        model.zero_grad()
        out = grpo_loss_on_batch(model, batch, None, ref, loss_type, beta=0.1, entropy_coef=0.01)
        assert out["loss"].requires_grad and out["loss"].item() == 0.0, loss_type
        out["loss"].backward()  # raised "element 0 of tensors does not require grad"
        assert all(p.grad is None or p.grad.abs().max() == 0 for p in model.parameters())
