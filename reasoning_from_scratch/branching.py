"""Branches at the first error: one-step continuations from the states where a group's
completions first went wrong, graded by the verifier and trained on as extra rows.

The progress credit (`process.anchored_credit`) tells a completion that its first wrong step
lost the value of the correct path, from a baseline of the one to eight completions of its
group that reached the same state. Here the policy is asked again where it erred. From each
group's first-error states (the prompt plus a prefix of verified steps, one state per
distinct prefix, `first_error_states`), `k` short continuations are sampled
(`generation.branch_continuations`: from the rollout's own tokens, its prefix prefilled once),
each is cut after its first step (`branch_step_tokens`) and the verifier grades that step on
its inputs (`grade_branch_step`). The state's samples of its next step are the `k` branches
and the group's own (every completion that reached the state, right or wrong there); their
group-normalised rewards (GRPO's, DeepSeekMath section 4.1.2, on a one-step problem,
`branch_advantages`) are the branch steps' advantages. Each branch becomes a row of the
step's batch: the prefix is context, only the branch step's tokens enter the loss
(`branch_rows`). The rows are counted as the batch's `extra_rows`: each adds its term weighted
as one rollout's (the grpo loss's mean is taken over the rollouts, `grpo.batch_totals`), so the
rollouts' own terms keep the weight they have without branches and the difference between the
two runs' losses is the branches' terms. A branch is one sampled continuation graded by the
verifier, the same kind of evidence as a rollout, hence the same weight per row. (Dividing by
every row instead scales the whole step down by rollouts / all rows, a factor that changes with
the number of branches from step to step.)

Branching from shared prefixes and training on the branches' own credit follows the tree
rollouts of TreeRPO (arXiv 2506.05183) and TreeRL (arXiv 2506.11902, which branches from
uncertain tokens); VinePPO (arXiv 2410.01679) branches from every step to estimate values.
Here the branches start only where an error was made, and one step is enough, since the
verifier can check a step without finishing the solution.

Control: `control="shuffled"` permutes each state's branch advantages among its branches, so
the rows, their tokens, their cost and the sum of their advantages stay, and only which branch
was right is lost (the placebo of the branches' information).

The sampled and read tokens are counted as every scorer's are: decode tokens (the branches'
generated tokens, their overrun included) and forward tokens (the prefixes prefilled); the
update's passes over the rows are counted with the batch (`run_log.forward_tokens`).
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from .generation import branch_continuations, stop_token_ids
from .grpo import RolloutBatch, concat_rollout_batches, group_advantages, pack_rollouts
from .process import ANSWER_PATTERNS, completion_steps, prefix_correct
from .process_supervision import group_digest
from .step_scorers import VerifierStepScorer

BRANCH_CONTROLS = ("none", "shuffled")
BRANCH_MAX_NEW_TOKENS = 24  # one arithmetic step ("Step 3: 112*13=1456\n") is about 14 tokens


@dataclass(frozen=True)
class FirstErrorState:
    """A state where completions of a group first went wrong: `cut` tokens of completion
    `completion` (its verified steps, `step` of them), where `members` completions made their
    first error; `reached` completions start with these tokens, `right` of them went on with a
    right step."""

    completion: int
    cut: int
    step: int
    members: int
    reached: int
    right: int


def first_error_states(step_rewards: Sequence[Sequence[float]],
                       step_ends: Sequence[Sequence[int]], completion_ids: torch.Tensor,
                       threshold: float = 0.5, max_states: int = 2) -> list[FirstErrorState]:
    """The distinct first-error states of one group, most shared first (then earliest).

    Completion i's first wrong step j (`process.prefix_correct`) starts at token
    `cut = step_ends[i][j - 1] + 1` (0 for the first step: the state is the prompt). Completions
    whose first `cut` tokens agree share the state; the first of them represents it. A
    completion with every step correct has no first error. At most `max_states` states.
    Every completion that starts with a state's tokens reached it (`reached`); those whose
    step j is right (`right`) are, with the members, the group's own samples of its next step.
    """
    correct = prefix_correct(step_rewards, threshold)
    found: dict[tuple[int, ...], list] = {}
    for i, (c, ends) in enumerate(zip(correct, step_ends)):
        if all(ck > 0 for ck in c):
            continue
        j = next(k for k, ck in enumerate(c) if ck == 0)
        cut = int(ends[j - 1]) + 1 if j else 0
        key = tuple(int(t) for t in completion_ids[i, :cut].tolist())
        if key in found:
            found[key][3] += 1
        else:
            found[key] = [i, cut, j, 1]
    states = []
    for key, (i, cut, j, members) in found.items():
        rows = [r for r in range(len(correct)) if len(correct[r]) > j
                and tuple(completion_ids[r, :cut].tolist()) == key]
        right = sum(1 for r in rows if correct[r][j] > 0)
        states.append(FirstErrorState(i, cut, j, members, len(rows), right))
    states.sort(key=lambda s: (-s.members, s.step, s.completion))
    return states[:max_states]


def _text(tokenizer, ids: Sequence[int], truncated: bool) -> str:
    """A completion's text as `sample_rollouts` gives it: special tokens kept, the EOS dropped."""
    return tokenizer.decode(list(ids) if truncated else list(ids)[:-1],
                            skip_special_tokens=False)


def branch_step_tokens(tokenizer, prefix_ids: Sequence[int], branch_ids: Sequence[int],
                       truncated: bool, step: int, split_mode: str = "tags",
                       pattern: str | None = None) -> tuple[int, list[str], bool]:
    """(tokens of the branch's first step, the step texts up to it, whether it ends the text).

    The prefix and the branch are split into steps together, as a rollout is
    (`process.completion_steps`); the branch's first step is step `step` (the prefix holds
    `step` steps). It ends the text when it is the last step of a finished branch (EOS) or
    holds the answer (`</think>`, a boxed answer): then the verifier grades the answer too.
    A branch that starts no step of its own (its text joins the prefix's last step, or it is
    only an EOS) gets no step texts, and no grade above 0.
    """
    ids = [int(t) for t in prefix_ids] + [int(t) for t in branch_ids]
    text = _text(tokenizer, ids, truncated)
    steps, ends = completion_steps(tokenizer, torch.tensor(ids), len(ids), text, truncated,
                                   split_mode, pattern)
    n = len(branch_ids)
    if len(steps) <= step:  # no step of its own: the prefix's last step would be graded
        return n, [], False
    if len(ends) > step + 1:
        n = int(ends[step]) + 1 - len(prefix_ids)
    n = max(1, min(n, len(branch_ids)))
    texts = steps[: step + 1]
    last = texts[-1] if texts else ""
    final = (not truncated and n == len(branch_ids)) or any(
        re.search(p, last) for p in ANSWER_PATTERNS)
    return n, texts, final


def grade_branch_step(steps: Sequence[str], example: dict, final: bool) -> float:
    """1.0 if the last of `steps` (a branch step after verified ones) is right, else 0.0.

    The verifier (`VerifierStepScorer`) checks it on its inputs. A final step (`final`) must
    also complete the think format and box the right answer, as the rollouts' last step must
    (`think_only`, `final_step_is_outcome`); an intermediate one must sit inside an opened
    `<think>` block, the format the outcome reward pays for.
    """
    if not steps:
        return 0.0
    if final:
        scorer = VerifierStepScorer(final_step_is_outcome=True, think_only=True)
    else:
        if "<think>" not in "".join(steps):
            return 0.0
        scorer = VerifierStepScorer(final_step_is_outcome=False)
    return float(scorer.correct_steps(list(steps), example)[-1])


def branch_advantages(correct: Sequence[float], right: int = 0, wrong: int = 1,
                      control: str = "none", generator: random.Random | None = None,
                      eps: float = 1e-4) -> list[float]:
    """Advantages of a state's k branch steps among all its samples of the next step.

    The samples are the group's own next steps from the state (`right` right ones, reward 1,
    and `wrong` wrong ones, 0: at least the first error that made it a state) and the k
    branches (`correct`, 1 or 0); each branch gets `(q_b - mean q) / (std q + eps)` over all
    of them (GRPO's group normalisation, `grpo.group_advantages`): all 0 when every sample
    is wrong. With `control="shuffled"` the k advantages are permuted among the branches
    (`generator`).
    """
    if control not in BRANCH_CONTROLS:
        raise ValueError(f"branch_advantages: unknown control {control!r}; "
                         f"expected {BRANCH_CONTROLS}")
    own = [1.0] * right + [0.0] * wrong
    q = torch.tensor([*own, *[float(c) for c in correct]])  # (right + wrong + k,)
    adv = group_advantages(q[None], "group", eps)[0, len(own):].tolist()  # (k,)
    if control == "shuffled":
        (generator or random.Random(0)).shuffle(adv)
    return adv


def _group_seed(seed: int, rollouts) -> int:
    """A sampling seed from the run's seed and the group's own tokens
    (`process_supervision.group_digest`): the same branches however the groups are split over
    processes, and after a resume."""
    return int(group_digest(f"branches|{seed}", rollouts)[:15], 16)


@dataclass
class BranchConfig:
    """How the branches are drawn: `k` per state, at most `max_states` states per group, each
    at most `max_new_tokens` tokens (and never past the rollouts' budget `rollout_tokens`),
    sampled at `temperature` / `top_p`; `alpha` weighs their advantages (the step credit's
    weight); `control` is "none" or the "shuffled" placebo."""

    k: int = 4
    max_states: int = 2
    max_new_tokens: int = BRANCH_MAX_NEW_TOKENS
    rollout_tokens: int = 112
    temperature: float = 1.0
    top_p: float = 1.0
    alpha: float = 1.0
    control: str = "none"
    split_mode: str = "tags"
    pattern: str | None = None
    threshold: float = 0.5
    seed: int = 0
    compile: bool = False


@dataclass
class Branch:
    """One branch: its group, the prefix and step tokens, its grade and advantage."""

    group: int
    prefix: list[int]
    step_ids: list[int]
    correct: float
    advantage: float = 0.0


def sample_branches(model, tokenizer, groups, infos, config: BranchConfig
                    ) -> tuple[list[Branch], dict]:
    """The branches of every group, and their cost (`branch_generated_tokens`,
    `branch_prefill_tokens`, `branch_states`).

    `groups`: `(example, Rollouts, ...)` tuples and `infos` their `process_token_advantages`
    infos (`step_rewards`, `step_ends`), as `ProcessAdvantageFn` keeps them.
    """
    out: list[Branch] = []
    cost = {"branch_generated_tokens": 0, "branch_prefill_tokens": 0, "branch_states": 0}
    device = next(model.parameters()).device
    for n, (group, info) in enumerate(zip(groups, infos)):
        example, ro = group[0], group[1]
        states = first_error_states(info["step_rewards"], info["step_ends"], ro.completion_ids,
                                    config.threshold, config.max_states)
        budget = {s: min(config.max_new_tokens, config.rollout_tokens - s.cut) for s in states}
        states = [s for s in states if budget[s] > 0]
        if not states:
            continue
        seqs = [ro.full_ids(g).tolist() for g in range(len(ro))]
        P = ro.prompt_len
        cuts = [(s.completion, P + s.cut) for s in states for _ in range(config.k)]
        gen = torch.Generator(device).manual_seed(_group_seed(config.seed, ro))
        was_training = model.training
        model.eval()
        try:
            br = branch_continuations(
                model, seqs, cuts, [budget[s] for s in states for _ in range(config.k)],
                config.temperature, config.top_p, stop_token_ids(tokenizer), gen,
                compile=config.compile)
        finally:
            model.train(was_training)
        cost["branch_generated_tokens"] += br.generated_tokens
        cost["branch_prefill_tokens"] += br.prefill_tokens
        cost["branch_states"] += len(states)
        shuffle = random.Random(_group_seed(config.seed + 1, ro))
        for s_i, s in enumerate(states):
            prefix = seqs[s.completion][P:P + s.cut]
            mine = []
            for b in range(config.k):
                c = s_i * config.k + b
                ids, trunc = br.ids[c], br.truncated[c]
                size, steps, final = branch_step_tokens(tokenizer, prefix, ids, trunc, s.step,
                                                        config.split_mode, config.pattern)
                mine.append(Branch(n, prefix, ids[:size],
                                   grade_branch_step(steps, example, final)))
            adv = branch_advantages([b.correct for b in mine], s.right, s.reached - s.right,
                                    config.control, shuffle)
            for b, a in zip(mine, adv):
                b.advantage = config.alpha * a
            out += mine
    return out, cost


def branch_rows(branches: Sequence[Branch], groups, pad_id: int = 0,
                device=None) -> RolloutBatch | None:
    """The branches as a batch: prompt | prefix | step, the loss on the step's tokens only
    (advantages (B, Tc) there, 0 elsewhere); None when no branch has an advantage."""
    keep = [b for b in branches if b.advantage != 0.0]
    if not keep:
        return None
    prompts, comps, masks, advs = [], [], [], []
    for b in keep:
        ids = torch.tensor(b.prefix + b.step_ids, dtype=torch.long)[None]  # (1, T)
        m = torch.zeros_like(ids, dtype=torch.bool)
        m[0, len(b.prefix):] = True
        prompts.append(groups[b.group][1].prompt_ids.cpu())
        comps.append(ids)
        masks.append(m)
        advs.append(m[0].float() * b.advantage)
    input_ids, attention_mask, prompt_len, completion_mask = pack_rollouts(
        prompts, comps, masks, pad_id=pad_id)
    Tc = completion_mask.shape[1]
    adv = torch.stack([torch.nn.functional.pad(a, (0, Tc - a.numel())) for a in advs])
    device = device or input_ids.device
    am = None if attention_mask is None else attention_mask.to(device)
    return RolloutBatch(input_ids.to(device), am, prompt_len, completion_mask.to(device),
                        adv.to(device), torch.zeros(0, 1))


def with_branch_rows(batch: RolloutBatch, rows: RolloutBatch | None,
                     pad_id: int = 0) -> RolloutBatch:
    """`batch` with the branch rows appended below its rows (re-padded to one layout); its
    statistics fields (rewards, samples, token counts) stay the rollouts' own."""
    if rows is None:
        return batch
    if batch.sampler_logp is not None:
        raise ValueError("with_branch_rows: branch rows have no sampler log-probs (truncated "
                         "importance sampling and off-policy masking need them)")
    if batch.size and batch.advantages.dim() != 2:
        raise ValueError("with_branch_rows: the batch needs token advantages (B, Tc)")
    merged = concat_rollout_batches([batch, replace(rows, rewards=batch.rewards[:0])], pad_id)
    return replace(merged, rewards=batch.rewards, samples=batch.samples,
                   zero_adv_frac=batch.zero_adv_frac,
                   num_generated_tokens=batch.num_generated_tokens,
                   extra_rows=batch.extra_rows + rows.size)
