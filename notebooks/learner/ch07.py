"""The functions of ch07_improving_grpo.ipynb that later notebooks import.

Written by the notebook from its cells that start with "# carried over to learner/ch07.py", in
its order: re-run the notebook to rewrite this file, do not edit it.
"""


import torch


def clipped_surrogate(logp, old_logp, advantages, epsilon=0.2, epsilon_high=None):
    """PPO objective to maximise: min(r A, clip(r, 1 - eps, 1 + eps_high) A), r = p / p_old."""
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * advantages
    if epsilon is None:  # chapter 6: no clipping
        return unclipped
    high = epsilon if epsilon_high is None else epsilon_high
    clipped = torch.clamp(ratio, 1.0 - epsilon, 1.0 + high) * advantages
    return torch.minimum(unclipped, clipped)


def k3_kl(logp, ref_logp):
    """Per-token k3 estimate of KL(pi || pi_ref): exp(ref - logp) - (ref - logp) - 1 >= 0."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def pack_rollouts(prompts_ids, completion_ids, completion_masks, pad_id=0):
    """N groups as one batch: prompts left-padded, answers right-padded, all from column P."""
    pad = torch.nn.functional.pad
    P = max(p.shape[0] for p in prompts_ids)  # the longest prompt
    T = max(c.shape[1] for c in completion_ids)  # the longest answer
    rows, attention, masks = [], [], []
    for p, c, m in zip(prompts_ids, completion_ids, completion_masks):  # one group each
        G_i, n = c.shape
        prompt = pad(p, (P - p.shape[0], 0), value=pad_id).expand(G_i, P)  # (G_i, P)
        rows.append(torch.cat([prompt, pad(c, (0, T - n), value=pad_id)], dim=1))
        a = torch.ones(G_i, P + T, dtype=torch.long, device=c.device)
        a[:, :P - p.shape[0]] = 0  # the left padding is not attended to
        attention.append(a)
        masks.append(pad(m.bool(), (0, T - n), value=False))  # (G_i, T) real answer tokens
    attention_mask = torch.cat(attention)  # (B, P + T)
    if attention_mask.all():
        attention_mask = None  # no padding anywhere: plain causal attention
    return torch.cat(rows), attention_mask, P, torch.cat(masks)


from reasoning_from_scratch.arithmetic import parse_problem, parse_steps, verify_steps


def has_think_format(text):
    """True if <think> and then </think> appear, before the last boxed answer (if any)."""
    start = text.find("<think>")
    end = -1 if start == -1 else text.find("</think>", start + len("<think>"))
    if end == -1:
        return False
    boxed = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    return boxed == -1 or boxed > end


def step_verdicts(problem, text):
    """The verifier's verdict on each step of an answer, each missing step counted wrong."""
    verdicts = verify_steps(problem, parse_steps(text))
    return verdicts + [False] * (len(parse_problem(problem)[1]) - len(verdicts))


def reasoning_stats(records):
    """Accuracy, step correctness and right-but-wrong-step share of the think answers."""
    think = [r for r in records if has_think_format(r["generated_text"])]
    verdicts = [step_verdicts(r["problem"], r["generated_text"]) for r in think]
    steps = sum(len(v) for v in verdicts)
    right = [v for r, v in zip(think, verdicts) if r["correct"]]
    return {"think_accuracy": len(right) / len(think) if think else None,
            "step_correctness": sum(map(sum, verdicts)) / steps if steps else None,
            "right_answer_wrong_step": sum(not all(v) for v in right) / len(right)
            if right else None}


from reasoning_from_scratch.tokenizer import END_THINK_TOKEN_ID, THINK_TOKEN_ID


def reward_format(token_ids, prompt_len, start_think_id=THINK_TOKEN_ID,
                  end_think_id=END_THINK_TOKEN_ID):
    """1.0 if the answer has the start think token before the end think token, else 0.0."""
    answer = token_ids[prompt_len:].tolist()
    if start_think_id not in answer or end_think_id not in answer:
        return 0.0
    return float(answer.index(start_think_id) < answer.index(end_think_id))


from reasoning_from_scratch.grading import reward_rlvr


def build_reward(tokenizer, format_reward_weight=0.0, format_reward_conditional=False):
    """reward(text, token_ids, prompt_len, example) -> (total, {"correct": c, "format": f})."""
    think_ids = (tokenizer.think_token_id, tokenizer.end_think_token_id)

    def reward(text, token_ids, prompt_len, example):
        correct = reward_rlvr(text, example["answer"])
        fmt = reward_format(token_ids, prompt_len, *think_ids)
        paid = fmt * (correct if format_reward_conditional else 1.0)
        return correct + format_reward_weight * paid, {"correct": correct, "format": fmt}

    return reward


def aggregate_loss(per_token_loss, mask, loss_type="grpo", max_completion_length=None):
    """Reduce a (B, T) per-token loss over the real tokens in mask to a scalar."""
    m = mask.to(per_token_loss.dtype)
    masked = per_token_loss * m
    if loss_type == "grpo":  # per-answer token mean, then mean over answers
        return (masked.sum(-1) / m.sum(-1).clamp(min=1)).mean()
    if loss_type == "dapo":  # one token mean over the whole batch
        return masked.sum() / m.sum().clamp(min=1)
    if loss_type == "dr_grpo":  # a constant normaliser
        T = per_token_loss.shape[1] if max_completion_length is None else max_completion_length
        return masked.sum() / (per_token_loss.shape[0] * T)
    if loss_type == "sequence":  # chapter 6: summed per answer
        return masked.sum(-1).mean()
    raise ValueError(f"unknown loss_type {loss_type!r}")


from dataclasses import replace

from reasoning_from_scratch.generation import sample_rollouts
from reasoning_from_scratch.grpo import RolloutBatch, compute_advantage_stats
from reasoning_from_scratch.prompts import render_prompt


def _sample_and_score(model, tokenizer, examples, device, reward_fn, num_rollouts,
                      max_new_tokens, temperature, top_p, generator):
    """[(example, rollouts, [(reward, parts)] x G)], one sampling generator per question."""
    groups = []
    for example, gen in zip(examples, generator):
        ro = sample_rollouts(model, tokenizer, render_prompt(example["problem"]), num_rollouts,
                             device, max_new_tokens, temperature, top_p, generator=gen)
        scored = [reward_fn(ro.texts[i], ro.full_ids(i), ro.prompt_len, example)
                  for i in range(num_rollouts)]
        groups.append((example, ro, scored))
    return groups


def _empty_batch(rewards, samples, zero_frac):
    """A batch without rows: no group of the step carries signal."""
    empty = torch.zeros(0, 1, dtype=torch.long)
    return RolloutBatch(empty, None, 1, empty.bool(), torch.zeros(0), rewards, samples, zero_frac)


def _with_token_advantages(batch, adv, G, skip_zero_advantage):
    """The batch with the hook's token advantages adv (B, T); with skip_zero_advantage, the
    groups whose token advantages are all zero dropped."""
    if not skip_zero_advantage:
        return replace(batch, advantages=adv)
    signal = adv.reshape(-1, G, adv.shape[1]).abs().sum(dim=(1, 2)) > 0  # (N_kept,)
    if not signal.any():
        return _empty_batch(batch.rewards, batch.samples, 1.0)
    rows, attn = signal.repeat_interleave(G), batch.attention_mask  # (B,)
    return replace(batch, input_ids=batch.input_ids[rows], advantages=adv[rows],
                   attention_mask=None if attn is None else attn[rows],
                   completion_mask=batch.completion_mask[rows],
                   zero_adv_frac=(~signal).float().mean().item())


@torch.no_grad()
def collect_rollouts(model, tokenizer, examples, device, reward_fn, num_rollouts=8,
                     max_new_tokens=512, temperature=0.8, top_p=0.9, generator=None,
                     skip_zero_advantage=False, advantage_fn=None):
    """Sample and score a group per example, keep the groups with signal, pack them.
    advantage_fn(groups, advantages (N, G), completion_mask (B, T)) -> token advantages (B, T)
    replaces the outcome advantage of each answer (the hook of chapter 8's process credit)."""
    groups = _sample_and_score(model, tokenizer, examples, device, reward_fn, num_rollouts,
                               max_new_tokens, temperature, top_p, generator)
    rewards = torch.tensor([[total for total, _ in scored] for _, _, scored in groups])  # (N, G)
    advantages = torch.stack([compute_advantage_stats(r.tolist())[0] for r in rewards])
    samples = [{"reward": total, **parts} for _, _, scored in groups for total, parts in scored]
    # equal rewards: no outcome signal; with a hook the group is judged on its token advantages
    zero = (advantages == 0).all(dim=1) & (advantage_fn is None)  # (N,)
    keep = [i for i in range(len(groups)) if not (skip_zero_advantage and zero[i])]
    if not keep:  # nothing to learn from this step
        return _empty_batch(rewards, samples, zero.float().mean().item())
    ids, attn, P, mask = pack_rollouts([groups[i][1].prompt_ids for i in keep],
                                       [groups[i][1].completion_ids for i in keep],
                                       [groups[i][1].completion_mask for i in keep])
    batch = RolloutBatch(ids, attn, P, mask, advantages[keep].reshape(-1), rewards, samples,
                         zero.float().mean().item())  # advantages (B,): one per answer
    if advantage_fn is None:
        return batch
    adv = advantage_fn([groups[i] for i in keep], advantages[keep], mask)  # (B, T)
    return _with_token_advantages(batch, adv, num_rollouts, skip_zero_advantage)


def batch_logprobs(model, batch):
    """Per-token answer log-probs and entropies (B, T) of a packed batch, 0 at padding."""
    P, mask = batch.prompt_len, batch.completion_mask
    logits = model(batch.input_ids, batch.attention_mask).float()  # (B, P + T, V)
    logprobs = torch.log_softmax(logits[:, P - 1:-1], dim=-1)  # (B, T, V): the answer rows
    logp = logprobs.gather(-1, batch.input_ids[:, P:].unsqueeze(-1)).squeeze(-1)
    entropy = -(logprobs.exp() * logprobs).sum(-1)  # (B, T)
    return logp * mask, entropy * mask
