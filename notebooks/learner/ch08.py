"""The functions of ch08_process_supervision.ipynb that later notebooks import.

Written by the notebook from its cells that start with "# carried over to learner/ch08.py", in
its order: re-run the notebook to rewrite this file, do not edit it.
"""


import re

STEP_TAG = r"(?<![A-Za-z])[Ss]tep[ \t]*\d+[ \t]*:"  # "Step 12:" is one tag, not "Step 1"
BREAKS = {"newlines": r"\r\n|\n|\r", "blank_lines": r"(?:\r\n|\n|\r)(?:[ \t]*(?:\r\n|\n|\r))+"}


def _empty(piece):
    """True if a piece holds nothing but whitespace, <think> and step tags."""
    return not re.sub(STEP_TAG, "", piece.replace("<think>", "")).strip()


def _cuts(body, mode):
    """Where steps after the first start: at each tag, or after each (blank) line break."""
    if mode == "tags":
        cuts = [m.start() for m in re.finditer(STEP_TAG, body)]
    else:  # a line break stays with the step it ends
        cuts = [m.end() for m in re.finditer(BREAKS[mode], body)]
    return sorted({c for c in cuts if 0 < c < len(body)})


def split_steps(text, mode="tags"):
    """(start, end) character spans of the steps of `text`, covering all of it; mode: "tags",
    "newlines" or "blank_lines" (training's step_split). The answer is the last step."""
    if not text:
        return []
    answer = text.rfind("</think>")
    answer = text.rfind("\\boxed{") if answer == -1 else answer
    answer = len(text) if answer == -1 else answer
    body, cuts = text[:answer], _cuts(text[:answer], mode)
    merged, pending = [], None  # pending: the start of empty text waiting for a step
    for i, (s, e) in enumerate(zip([0, *cuts], [*cuts, len(body)])):
        preamble = mode == "tags" and i == 0 and cuts and not re.match(STEP_TAG, body[s:e])
        if preamble or _empty(body[s:e]):  # " <think>\n" before a tag, or "Step 2:" alone
            if merged:
                merged[-1][1] = e  # joins the step before
            elif pending is None:
                pending = s  # or the next one
        else:
            merged.append([s if pending is None else pending, e])
            pending = None
    if answer < len(text):
        merged.append([answer if pending is None else pending, len(text)])
    elif pending is not None:  # nothing but empty pieces: one step
        merged.append([pending, len(text)])
    return [tuple(span) for span in merged]


import bisect


def step_token_ends(offsets, spans):
    """Index of each step's last token, from token character offsets and step spans."""
    starts = [s for s, _ in spans]
    # the step of each token: the last span starting at or before its first character
    owners = [max(0, bisect.bisect_right(starts, s) - 1) for s, _ in offsets]
    return [k for k in range(len(owners))
            if k == len(owners) - 1 or owners[k + 1] != owners[k]]


import os


def token_offsets_from_ids(tokenizer, ids, text):
    """Character offsets of generated token ids in their text: the re-encoding's when it gives
    the same ids, else token k starts where decode(ids[:k]) stops agreeing with the text."""
    encoded, offsets = tokenizer.encode_with_offsets(text)
    if list(encoded) == ids:
        return [tuple(o) for o in offsets]
    starts = [len(os.path.commonprefix([tokenizer.decode(ids[:k]), text]))
              for k in range(len(ids))]
    for k in range(len(starts) - 2, -1, -1):  # a half character must not move a start back
        starts[k] = min(starts[k], starts[k + 1])
    return list(zip(starts, [*starts[1:], len(text)]))


def completion_steps(tokenizer, completion_ids, length, text, truncated, mode="tags"):
    """(step texts, step ends) of a generated completion (text: without the EOS, if any)."""
    ids = [int(i) for i in completion_ids[:length].tolist()]
    if not ids:
        return [], []
    offsets = token_offsets_from_ids(tokenizer, ids if truncated else ids[:-1], text)
    if not truncated:
        offsets.append((len(text), len(text)))  # the EOS: no characters, joins the last step
    spans = split_steps(text, mode) or [(0, len(text))]
    starts = [s for s, _ in spans]
    owned = sorted({max(0, bisect.bisect_right(starts, s) - 1) for s, _ in offsets})
    bounds = [0, *[starts[j] for j in owned[1:]], len(text)]  # the steps that own a token
    return [text[a:b] for a, b in zip(bounds, bounds[1:])], step_token_ends(offsets, spans)


import operator
import re

from reasoning_from_scratch.arithmetic import parse_problem

OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
STEP_RE = re.compile(r"^\s*(\d+)\s*([+\-*])\s*(\d+)\s*=\s*(\d+)\s*\.?\s*$")

def verify_steps(problem, step_texts):
    """Exact correctness of each step ('17+5=22' or 'Step 1: 17+5=22') of a chain problem."""
    numbers, ops = parse_problem(problem)  # "Compute (17+5)*3" -> [17, 5, 3], ["+", "*"]
    verdicts, running = [], numbers[0]
    for k, text in enumerate(step_texts):
        m = STEP_RE.match(re.sub(r"^\s*Step\s*\d+\s*:\s*", "", text))
        true_next = OPS[ops[k]](running, numbers[k + 1]) if k < len(ops) else None
        if m is None or k >= len(ops):  # unreadable, or more steps than operations
            verdicts.append(False)
            running = true_next
            continue
        a, op, b, c = int(m.group(1)), m.group(2), int(m.group(3)), int(m.group(4))
        if op == "-":  # order matters for subtraction
            operands_ok = (a, b) == (running, numbers[k + 1])
        else:
            operands_ok = sorted((a, b)) == sorted((running, numbers[k + 1]))
        verdicts.append(op == ops[k] and operands_ok and c == OPS[op](a, b))
        running = c  # continue from what the step wrote
    return verdicts


from learner.ch07 import has_think_format  # chapter 7's, carried over
from reasoning_from_scratch.arithmetic import parse_steps
from reasoning_from_scratch.grading import reward_rlvr
from reasoning_from_scratch.step_scorers import StepScorer


class VerifierStepScorer(StepScorer):  # the interface: score_group calls score, cost is {}
    """Verifier step rewards: 1 for a correct split step, else 0, and 0 after the first wrong
    one; the answer step also needs the right boxed answer. think_only: outside the think
    format every step is wrong."""

    def __init__(self, think_only=False):
        self.think_only = think_only

    def score(self, prompt, steps, example):
        if self.think_only and not has_think_format("".join(steps)):
            return [0.0] * len(steps)  # work outside the think format is not counted
        exprs = [parse_steps(s) for s in steps]  # the 'a op b = c' parts of each split step
        verdicts = verify_steps(example["problem"], [e for es in exprs for e in es])
        rewards, k, ok = [], 0, True
        for j, es in enumerate(exprs):
            good = all(verdicts[k:k + len(es)]) and (bool(es) or j == len(steps) - 1)
            if j == len(steps) - 1:  # the answer step: the boxed answer must be right
                good = good and reward_rlvr("".join(steps), example["answer"]) == 1.0
            k, ok = k + len(es), ok and good  # after the first wrong step, all are wrong
            rewards.append(float(ok))
        return rewards


import torch


def process_advantages(step_rewards, step_ends, completion_lengths):
    """Token advantages (G, max length): suffix sums of group-normalised step rewards."""
    flat = torch.tensor([float(r) for rs in step_rewards for r in rs])
    normed = torch.zeros_like(flat)
    if flat.numel() >= 2 and not bool((flat == flat[0]).all()):
        normed = (flat - flat.mean()) / (flat.std() + 1e-4)
    adv = torch.zeros(len(completion_lengths), max(completion_lengths))  # (G, T)
    k = 0
    for i, ends in enumerate(step_ends):
        r = normed[k:k + len(ends)]  # this completion's normalised step rewards
        k += len(ends)
        previous_end = -1
        for j, end in enumerate(ends):
            adv[i, previous_end + 1:end + 1] = r[j:].sum()  # steps j, j+1, ... to come
            previous_end = end
    return adv


def group_advantages(rewards, eps=1e-4):
    """Advantages (N, G): each group's rewards minus its mean, over its std; 0 if all equal."""
    r = torch.as_tensor(rewards, dtype=torch.float32)
    r = r.unsqueeze(0) if r.dim() == 1 else r  # (N, G)
    adv = (r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + eps)
    return adv.masked_fill((r == r[:, :1]).all(dim=1, keepdim=True), 0.0)


def prefix_correct(step_rewards, threshold=0.5):
    """c_ik: 1 while steps 1..k of completion i are all correct, then 0."""
    return [[float(all(r >= threshold for r in rs[:k + 1])) for k in range(len(rs))]
            for rs in step_rewards]


def progress_state_values(correct):
    """V_k, k = 0..K: mean correct steps still to come after k correct ones (0 if none)."""
    values = []
    for k in range(max((len(c) for c in correct), default=0) + 1):
        togo = [sum(c[k:]) for c in correct if k == 0 or (len(c) >= k and c[k - 1] > 0)]
        values.append(sum(togo) / len(togo) if togo else 0.0)
    return values


def anchored_credit(step_rewards, variant="progress", threshold=0.5, eps=1e-4):
    """Per-step progress credit (c_ik (1 + V_k) - V_k-1) / std(M), 0 after the first error;
    after a completion's last step V_k is 0 (its own end)."""
    if variant != "progress":
        raise NotImplementedError("this notebook version has the progress form only")
    correct = prefix_correct(step_rewards, threshold)
    M = torch.tensor([sum(c) for c in correct])
    if len(M) < 2 or bool((M == M[0]).all()):
        return [[0.0] * len(c) for c in correct]  # no completion got further: no credit
    V, scale = progress_state_values(correct), M.std().item() + eps
    credit = []
    for c in correct:
        reached = V[1:len(c)] + [0.0]  # the value of the state each step reaches
        credit.append([(ck * (1 + v) - V[k - 1]) / scale if all(c[:k - 1]) else 0.0
                       for k, (ck, v) in enumerate(zip(c, reached), start=1)])
    return credit


_sum_form = process_advantages  # section 5's version


def process_advantages(step_rewards, step_ends, completion_lengths, variant="sum",
                       outcome_advantages=None, alpha=1.0, control="none", generator=None):
    """Token advantages (G, T): section 5's sum form, or "progress": A_out + alpha x credit;
    control "flat" or "shuffled": a placebo of the credit (`control_credit`, below)."""
    if variant == "sum":
        return _sum_form(step_rewards, step_ends, completion_lengths)
    if variant != "progress":
        raise NotImplementedError("this notebook version has the sum and progress forms")
    credit = anchored_credit(step_rewards)
    if control != "none":
        credit = control_credit(credit, step_ends, control, generator)
    adv = torch.zeros(len(completion_lengths), max(completion_lengths))  # (G, T)
    for i, (cr, ends) in enumerate(zip(credit, step_ends)):
        previous_end = -1
        for c, end in zip(cr, ends):
            adv[i, previous_end + 1:end + 1] = outcome_advantages[i] + alpha * c
            previous_end = end
    return adv


def control_credit(credit, step_ends, control="none", generator=None):
    """A placebo of the step credit: "flat" spreads each completion's credit evenly over its
    tokens; "shuffled" moves each step's credit mass to another of the completion's steps."""
    if control == "none":
        return [list(cr) for cr in credit]
    out = []
    for cr, ends in zip(credit, step_ends):
        sizes = [e - p for p, e in zip([-1] + list(ends[:-1]), ends)]  # tokens per step
        if control == "shuffled":
            perm = list(range(len(cr)))
            generator.shuffle(perm)  # step k receives the mass of step perm[k]
            out.append([cr[j] * sizes[j] / sizes[k] for k, j in enumerate(perm)])
        else:
            mean = sum(c * n for c, n in zip(cr, sizes)) / sum(sizes)  # token-weighted
            out.append([mean] * len(cr))
    return out


import torch.nn.functional as F

from reasoning_from_scratch.process_supervision import group_generator
from reasoning_from_scratch.prompts import render_prompt


def make_process_advantage_fn(tokenizer, step_scorer, variant="progress", alpha=1.0,
                              control="none", split_mode="tags", seed=0):
    """The loop's advantage hook: (groups, outcome advantages (N, G), mask (B, Tc)) -> (B, Tc).
    control: "flat" or "shuffled" for a placebo; split_mode: as split_steps'."""

    def advantage_fn(groups, outcome_advantages, completion_mask):
        rows = []
        for (example, ro, _), oa in zip(groups, outcome_advantages):
            lengths = [int(n) for n in ro.lengths]
            steps, ends = zip(*[  # section 1, on the generated tokens
                completion_steps(tokenizer, ro.completion_ids[g], n, ro.texts[g],
                                 bool(ro.truncated[g]), split_mode) for g, n in enumerate(lengths)])
            rewards = step_scorer.score_group(render_prompt(example["problem"]), steps, example)
            shuffle = group_generator(seed, ro) if control == "shuffled" else None  # as the package
            adv = process_advantages(rewards, ends, lengths, variant, oa, alpha, control, shuffle)
            rows.append(F.pad(adv, (0, completion_mask.shape[1] - adv.shape[1])))
        return torch.cat(rows) * completion_mask  # rollout g of group i is row i * G + g

    return advantage_fn


import copy

from learner.ch07 import (aggregate_loss, batch_logprobs, build_reward, clipped_surrogate,
                          collect_rollouts, k3_kl)
from reasoning_from_scratch.training import lr_at_step, rollout_generators, step_prompts


def _step_batch(model, tokenizer, examples, device, config, step, advantage_fn):
    """One step's groups: sampled, scored, advantages from the hook (or outcome), packed."""
    prompts = step_prompts(examples, step, config)
    reward_fn = build_reward(tokenizer, config.format_reward_weight,
                             config.format_reward_conditional)
    return collect_rollouts(
        model, tokenizer, prompts, device, reward_fn, config.num_rollouts,
        config.max_new_tokens, config.temperature, config.top_p,
        generator=rollout_generators(device, config.seed, step, range(len(prompts))),
        skip_zero_advantage=config.skip_zero_advantage, advantage_fn=advantage_fn)


from reasoning_from_scratch.evaluation import evaluate_policy
from reasoning_from_scratch.run_log import eval_cells


def _update(model, optimizer, batch, old_logp, ref_logp, config):
    """One step: clipped surrogate + beta x k3 KL to the reference; returns loss and KL."""
    logp = batch_logprobs(model, batch)[0]  # (B, Tc), chapter 7's
    adv = batch.advantages if batch.advantages.dim() == 2 else batch.advantages[:, None]
    mask, T = batch.completion_mask, config.max_new_tokens
    loss = aggregate_loss(-clipped_surrogate(logp, old_logp, adv, config.epsilon,
                                             config.epsilon_high), mask, config.loss_type, T)
    kl = (aggregate_loss(k3_kl(logp, ref_logp), mask, config.loss_type, T) if config.beta
          else torch.zeros(()))
    loss = loss + config.beta * kl
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
    optimizer.step()
    return loss.item(), kl.item()


def _log_row(step, batch, updates):
    """The step's metrics: rewards of all groups, the share without signal, loss and KL."""
    samples, n = batch.samples, max(len(updates), 1)
    return {"step": step + 1, "reward_mean": batch.rewards.mean().item(),
            "correct_mean": sum(s["correct"] for s in samples) / len(samples),
            "format_mean": sum(s["format"] for s in samples) / len(samples),
            "zero_adv_frac": batch.zero_adv_frac,
            "loss": sum(u[0] for u in updates) / n, "kl": sum(u[1] for u in updates) / n}


def train_grpo(model, tokenizer, train_examples, eval_examples, device, config,
               advantage_fn=None):
    """Chapter 7's GRPO loop (KL to a frozen start if beta > 0) with an advantage hook."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr,
                                  weight_decay=config.weight_decay)
    ref_model = copy.deepcopy(model).requires_grad_(False) if config.beta else None

    def evaluate():
        return evaluate_policy(model, tokenizer, eval_examples[:config.eval_examples], device,
                               config.max_new_tokens, config.eval_batch_size)

    base, rows = evaluate(), []
    for step in range(config.steps):
        batch = _step_batch(model, tokenizer, train_examples, device, config, step,
                            advantage_fn)
        for group in optimizer.param_groups:
            group["lr"] = lr_at_step(step, config)  # linear warmup, then constant
        updates = []
        if batch.size:  # some group carries a signal
            with torch.no_grad():  # both once, before the first update
                old_logp = batch_logprobs(model, batch)[0]  # the sampling policy's
                ref_logp = batch_logprobs(ref_model, batch)[0] if ref_model else None
            updates = [_update(model, optimizer, batch, old_logp, ref_logp, config)
                       for _ in range(config.inner_epochs)]
        rows.append(_log_row(step, batch, updates))
        if (config.eval_every and (step + 1) % config.eval_every == 0) or step + 1 == config.steps:
            final = evaluate()
            rows[-1].update(eval_cells(final))
    return {"base": base, "final": final, "rows": rows}


SETTINGS = dict(prompts_per_step=4, num_rollouts=8, max_new_tokens=112, lr=3e-4, warmup_steps=2,
                inner_epochs=2, beta=0.04, supervision="process", step_scorer="verifier-think",
                process_variant="progress", eval_examples=100, seed=123, progress=False)
