"""The GRPO variants wired into the loop: sampler log-probs, log-probs at the sampling
temperature, DAPO dynamic sampling, GDPO, the book's sequence-level KL, micro-batch defects."""

import pytest
import torch

from reasoning_from_scratch import systems, training
from reasoning_from_scratch.grpo import (
    batch_logprobs,
    collect_rollouts,
    concat_rollout_batches,
    group_advantages_multi,
)
from reasoning_from_scratch.rewards import CompositeReward, RewardTerm
from reasoning_from_scratch.run_log import read_metrics
from reasoning_from_scratch.training import GRPOConfig, train_grpo
from reasoning_from_scratch.variants import clipped_policy_loss
from reasoning_from_scratch.weights import load_pretrained

TRAIN = [{"problem": f"{a}+{b}", "answer": str(a + b)} for a, b in [(2, 3), (4, 5), (6, 7), (8, 9)]]
HELD_OUT = [{"problem": "3+4", "answer": "7"}]


@pytest.fixture(scope="module")
def model_tok(tiny_dir):
    return load_pretrained(tiny_dir, device="cpu")


def _rollouts(model, tok, reward, examples=TRAIN[:2], seed=0, **kw):
    return collect_rollouts(model, tok, examples, "cpu", reward, num_rollouts=4,
                            max_new_tokens=6, generator=torch.Generator().manual_seed(seed), **kw)


def test_sampler_logprobs_equal_the_trainers_at_the_sampling_temperature(model_tok, even_reward):
    model, tok = model_tok
    batch = _rollouts(model, tok, even_reward, temperature=0.7, top_p=1.0, record_logprobs=True)
    with torch.no_grad():
        at_t, _ = batch_logprobs(model, batch, with_entropy=False, temperature=0.7)
        at_1, _ = batch_logprobs(model, batch, with_entropy=False)
    m = batch.completion_mask
    torch.testing.assert_close(batch.sampler_logp[m], at_t[m], atol=1e-5, rtol=1e-5)
    assert (batch.sampler_logp[~m] == 0).all()
    assert not torch.allclose(at_1[m], at_t[m])  # T matters: 1.0 would compare other policies


def test_training_old_logprobs_use_the_sampling_temperature(model_tok, even_reward):
    model, tok = model_tok
    batch = _rollouts(model, tok, even_reward, temperature=0.7)
    config = GRPOConfig(temperature=0.7, micro_batch_size=3)
    with torch.no_grad():
        old = systems.general_logprobs(model, batch, config)
        direct, _ = batch_logprobs(model, batch, with_entropy=False, temperature=0.7)
    torch.testing.assert_close(old, direct, atol=1e-6, rtol=1e-6)


def test_concatenated_batches_give_the_same_logprobs(model_tok, even_reward):
    model, tok = model_tok
    a = _rollouts(model, tok, even_reward, examples=[{"problem": "2+3", "answer": "5"}], seed=1)
    b = _rollouts(model, tok, even_reward, seed=2,
                  examples=[{"problem": "Compute (12+7)*3 and more", "answer": "57"}])
    both = concat_rollout_batches([a, b], pad_id=tok.eos_token_id)
    assert both.size == a.size + b.size and both.rewards.shape[0] == 2
    with torch.no_grad():
        la, _ = batch_logprobs(model, a, with_entropy=False)
        lb, _ = batch_logprobs(model, b, with_entropy=False)
        lab, _ = batch_logprobs(model, both, with_entropy=False)
    for part, rows in ((la, slice(0, a.size)), (lb, slice(a.size, None))):
        m = both.completion_mask[rows][:, :part.shape[1]]
        torch.testing.assert_close(lab[rows][:, :part.shape[1]][m], part[m], atol=1e-5,
                                   rtol=1e-5)
    torch.testing.assert_close(both.advantages, torch.cat([a.advantages, b.advantages]))


def _only_some_signal():
    """Signal only for the problem 2+3: every other group's rewards are all 0."""
    def reward(text, ids, prompt_len, example):
        gen = ids[prompt_len:]
        return float((gen % 2 == 0).float().mean()) if example["answer"] == "5" else 0.0
    return CompositeReward([RewardTerm("correct", reward)])


def test_dynamic_sampling_keeps_drawing_until_the_batch_has_signal(model_tok):
    model, tok = model_tok
    config = GRPOConfig(prompts_per_step=2, num_rollouts=4, max_new_tokens=6,
                        dynamic_sampling=True, max_sampling_rounds=4, seed=5)
    batch, cost = systems.general_rollouts(model, tok, TRAIN, "cpu", config,
                                           _only_some_signal(), None, lambda p: p, step=0)
    assert cost["sampling_rounds"] > 1
    assert batch.rewards.shape[0] == 2 * cost["sampling_rounds"]  # every group sampled is logged
    groups = batch.size // 4
    assert 1 <= groups <= 2 and batch.advantages.reshape(groups, 4).abs().sum(1).min() > 0
    plain = GRPOConfig(prompts_per_step=2, num_rollouts=4, max_new_tokens=6, seed=5)
    _, cost = systems.general_rollouts(model, tok, TRAIN, "cpu", plain, _only_some_signal(),
                                       None, lambda p: p, step=0)
    assert cost["sampling_rounds"] == 1


def test_gdpo_normalises_each_reward_term_in_its_group(model_tok):
    model, tok = model_tok
    reward = CompositeReward([
        RewardTerm("correct", lambda t, ids, p, ex: float(int(ids[-1]) % 2 == 0)),
        RewardTerm("format", lambda t, ids, p, ex: float(len(ids) - p > 3), weight=0.5,
                   only_if="correct"),
    ])
    batch = _rollouts(model, tok, reward, examples=TRAIN, reward_normalization="per_reward")
    correct = torch.tensor([s["correct"] for s in batch.samples]).reshape(4, 4)
    fmt = torch.tensor([s["format"] for s in batch.samples]).reshape(4, 4) * correct  # gated
    expected = group_advantages_multi([correct, fmt], [1.0, 0.5])
    logged = torch.tensor([s["advantage"] for s in batch.samples]).reshape(4, 4)
    torch.testing.assert_close(logged, expected)
    with pytest.raises(ValueError, match="reward_normalization"):
        _rollouts(model, tok, reward, reward_normalization="mean")


def test_sequence_kl_is_the_books_summed_log_ratio():
    torch.manual_seed(0)
    logp = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    ref = torch.randn(3, 4, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0, 0.5], dtype=torch.float64)
    out = clipped_policy_loss(logp, logp.detach(), adv, mask, ref_logp=ref, beta=1.0,
                              kl_estimator="sequence")
    direct = ((logp - ref) * mask).sum(-1).mean()
    assert out["kl"] == pytest.approx(direct.item())
    seq_grad = torch.autograd.grad(out["loss"], logp)[0]
    k3 = clipped_policy_loss(logp, logp.detach(), adv, mask, ref_logp=ref, beta=1.0)
    assert k3["kl"] >= 0 and not torch.allclose(torch.autograd.grad(k3["loss"], logp)[0],
                                                seq_grad)


def test_micro_batch_without_loss_tokens_and_token_weighted_statistics(model_tok, even_reward):
    """--mask-truncated with micro-batches: a micro-batch with no loss token must not crash, and
    entropy / ratio statistics are token means whatever the micro-batching."""
    model, tok = model_tok
    batch = _rollouts(model, tok, even_reward, examples=TRAIN[:2])
    batch.completion_mask[:2] = False  # the first micro-batch (2 rows) has no loss token
    stats, grads = [], []
    for mbs in (None, 2):
        model.zero_grad()
        cfg = GRPOConfig(micro_batch_size=mbs, max_grad_norm=1e9, lr=1e-3)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        stats.append(training.update(model, opt, batch, None, None, cfg))
        grads.append([p.grad.clone() for p in model.parameters()])
    assert stats[1]["skipped"] == 0
    for k in ("entropy", "ratio_mean"):
        assert stats[1][k] == pytest.approx(stats[0][k], rel=1e-5)
    for g1, g2 in zip(*grads):
        torch.testing.assert_close(g1, g2, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("variant", [
    dict(loss_type="gspo", epsilon=3e-4, epsilon_high=4e-4, inner_epochs=2),
    dict(loss_type="cispo", epsilon_high=0.28, inner_epochs=2, micro_batch_size=3),
    dict(tis_cap=2.0, off_policy_mask_threshold=0.0, inner_epochs=2),
    dict(dynamic_sampling=True, reward_normalization="per_reward"),
    dict(beta=0.1, kl_estimator="sequence"),
], ids=["gspo", "cispo", "tis+mask", "dynamic+gdpo", "sequence-kl"])
def test_variants_train_end_to_end(tiny_dir, tmp_path, even_reward, variant):
    config = GRPOConfig(steps=2, lr=1e-2, warmup_steps=0, prompts_per_step=2, num_rollouts=4,
                        max_new_tokens=5, eval_every=0, eval_examples=1, sample_every=0,
                        seed=1, output_dir=str(tmp_path / "run"), progress=False, **variant)
    model, tok = load_pretrained(tiny_dir, device="cpu")
    before = [p.detach().clone() for p in model.parameters()]
    train_grpo(model, tok, TRAIN, HELD_OUT, "cpu", config, reward_fn=even_reward)
    rows = read_metrics(tmp_path / "run" / "metrics.csv")
    assert len(rows) == 2 and all(r["skipped"] == 0 for r in rows)
    assert all(r["sampling_rounds"] >= 1 for r in rows)
    if "tis_cap" in variant:
        assert all(r["tis_weight_mean"] == pytest.approx(1.0, abs=1e-3) for r in rows)
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
