"""Tests for reasoning_from_scratch.grpo: hand-computed values and equivalence checks."""

import math

import pytest
import torch
from torch import nn

from reasoning_from_scratch import grpo
from reasoning_from_scratch.generation import Rollouts
from reasoning_from_scratch.grpo import (
    aggregate_loss,
    clipped_policy_loss,
    clipped_surrogate,
    compute_advantage_stats,
    compute_grpo_loss,
    group_advantages,
    k3_kl,
    pack_rollouts,
    sequence_logprob,
    sequence_logprob_and_entropy,
    token_logprobs_and_entropy,
)
from reasoning_from_scratch.qwen3 import Qwen3Model, tiny_config


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
