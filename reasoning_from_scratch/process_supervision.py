"""Process supervision in the GRPO loop (DeepSeekMath section 4.1.3): step scorers built from a
spec, completions split into steps and scored, the step rewards turned into token advantages.

`make_process_advantage_fn` returns the `advantage_fn` hook of `grpo.collect_rollouts`. It sits
above the pieces it combines, so they never import it: `process.py` (steps, token mapping,
advantage formulas) < `step_scorers.py` (verifier, Monte-Carlo) < `prm.py` (the learned PRM and
its scorer) < `online_prm.py` (the PRM re-fitted during RL) < this module.
"""

from __future__ import annotations

import hashlib
import math
import random

import torch

from .online_prm import OnlinePRMStepScorer, OutcomeStepLabeler
from .prm import PRMStepScorer, load_prm
from .process import (
    ANCHORED_VARIANTS,
    CREDIT_CONTROLS,
    LOCAL_STEP_WEIGHT,
    VARIANTS,
    completion_steps,
    process_advantages,
    step_statistics,
)
from .step_scorers import (
    AnswerBeliefStepScorer,
    FormatStepScorer,
    MonteCarloStepScorer,
    StepScorer,
    VerifierStepScorer,
    as_step_scorer,
)

# Step-scorer cost keys (`scorer.cost()`) of tokens sampled and of tokens only read (prefills,
# probes, a reward model's reads and training forwards): the decode_tokens and forward_tokens
# columns of a GRPO run count every arm in the same two units.
DECODE_COST_KEYS = ("mc_generated_tokens",)
FORWARD_COST_KEYS = ("forward_tokens",)


# Process supervision: `process.step_statistics` figure -> metrics.csv column ("proc_": of the
# reasoning steps, not the optimizer step), pooled over every completion of the step; empty in
# outcome runs, and where a figure has nothing to average (no completion with an error step).
PROCESS_COLUMNS = {"steps_per_completion": "proc_steps_per_completion",
                   "step_reward_mean": "proc_step_reward_mean",
                   "step_correct_rate": "proc_step_correct_rate",
                   "first_error_step": "proc_first_error_step",
                   "error_free_rate": "proc_error_free_rate"}


def process_metrics(samples: list[dict]) -> dict:
    """The PROCESS_COLUMNS cells of a GRPO step: `step_statistics` of the step rewards of all
    its completions together ({} when none has any: outcome supervision). The samples are the
    whole step's (every process, every sampling round), so N processes log what one would."""
    rewards = [s["step_rewards"] for s in samples if "step_rewards" in s]
    if not rewards:
        return {}
    stats = step_statistics(rewards)
    return {col: stats[k] for k, col in PROCESS_COLUMNS.items() if not math.isnan(stats[k])}


def scorer_tokens(advantage_fn, keys=DECODE_COST_KEYS) -> int:
    """Tokens spent so far by a process step scorer, summed over the cost keys `keys`: by default
    the tokens it sampled (Monte-Carlo continuations), with `FORWARD_COST_KEYS` the tokens it
    read without sampling (prefilled prefixes, a reward model's or a probe's forward passes);
    0 without a scorer."""
    scorer = getattr(advantage_fn, "step_scorer", None)
    cost = scorer.cost() if scorer is not None and hasattr(scorer, "cost") else {}
    return int(sum(cost.get(k, 0) for k in keys))


def learned_states(advantage_fn) -> dict:
    """{"step_scorer": the hook's step scorer} when that scorer learns as it scores (it has
    `state_dict`, as `OnlinePRMStepScorer`): what a run's checkpoints keep and its processes
    keep equal. {} for any other hook or scorer, whose checkpoints stay as they were."""
    scorer = getattr(advantage_fn, "step_scorer", None)
    return {"step_scorer": scorer} if callable(getattr(scorer, "state_dict", None)) else {}


def build_step_scorer(spec: str, model=None, tokenizer=None, device=None,
                      **mc_kwargs) -> StepScorer:
    """A scorer from a command-line spec: verifier | verifier-signed | verifier-think |
    verifier-think-local | format | belief | mc | mc-hard | mc-branch | prm:PATH |
    online-prm:PATH | online-prm-outcome:PATH
    (`verifier-think`: steps count only in the think format, `VerifierStepScorer(think_only=
    True)`; `verifier-think-local`: the same, each step checked on its own inputs, an earlier
    error not propagated, for the `progress-local` credit; `format`: the think format alone,
    `FormatStepScorer` (a placebo); `belief`: the policy's probability of the gold answer after
    each step, `AnswerBeliefStepScorer` (GRPO-VPS); `mc-branch`: Monte-Carlo values from the
    group's own completions and continuations branched from the rollouts' caches,
    `MonteCarloStepScorer(branch=True)`).

    `mc` samples with `model` (the policy being trained, so it follows the current policy);
    `mc_kwargs` go to `MonteCarloStepScorer`. `prm:PATH` loads a model saved by `prm.save_prm`;
    `online-prm:PATH` starts from it and re-fits it on every group of rollouts with the exact
    verifier's step labels (think-format steps only, as `verifier-think`),
    `online-prm-outcome:PATH` with outcome labels (`online_prm.py`).
    """
    if spec == "verifier":
        return VerifierStepScorer()
    if spec == "verifier-signed":
        return VerifierStepScorer(signed=True)
    if spec == "verifier-think":
        return VerifierStepScorer(think_only=True)
    if spec == "verifier-think-local":
        return VerifierStepScorer(think_only=True, propagate_errors=False)
    if spec == "format":
        return FormatStepScorer()
    if spec == "belief":
        if model is None or tokenizer is None:
            raise ValueError("the belief step scorer needs the policy model and tokenizer")
        return AnswerBeliefStepScorer(model, tokenizer, device)
    if spec in ("mc", "mc-hard", "mc-branch"):
        if model is None or tokenizer is None:
            raise ValueError("the mc step scorer needs the policy model and tokenizer")
        mode = "hard" if spec == "mc-hard" else "soft"
        return MonteCarloStepScorer(model, tokenizer, mode=mode, device=device,
                                    branch=spec == "mc-branch", **mc_kwargs)
    if spec.startswith("prm:"):
        prm, prm_tokenizer = load_prm(spec[4:], device=device)
        return PRMStepScorer(prm, prm_tokenizer)
    labelers = (("online-prm:", VerifierStepScorer(think_only=True)),
                ("online-prm-outcome:", OutcomeStepLabeler()))
    for prefix, labeler in labelers:
        if spec.startswith(prefix):
            prm, prm_tokenizer = load_prm(spec[len(prefix):], device=device)
            return OnlinePRMStepScorer(prm, prm_tokenizer, labeler)
    raise ValueError(f"unknown step scorer {spec!r}; expected verifier, verifier-signed, "
                     "verifier-think, verifier-think-local, format, belief, mc, mc-hard, "
                     "mc-branch, prm:PATH, online-prm:PATH or online-prm-outcome:PATH")


def process_token_advantages(
    rollouts, example: dict, tokenizer, step_scorer, prompt: str | None = None,
    variant: str = "sum", split_mode: str = "tags", pattern: str | None = None,
    outcome_advantages=None, eps: float = 1e-4, alpha: float = 1.0,
    credit_control: str = "none", generator: random.Random | None = None,
    local_weight: float = LOCAL_STEP_WEIGHT,
) -> tuple[torch.Tensor, dict]:
    """Process advantages `(G, T)` for the G rollouts of one prompt (`generation.Rollouts`).

    Splits each completion into steps, maps them onto its generated tokens, scores the steps with
    `step_scorer` (anything `step_scorers.as_step_scorer` accepts) and applies
    `process_advantages` with `variant` (and `alpha`, the weight of the outcome-anchored forms'
    step credit; `credit_control` with `generator`, a placebo of that credit, `control_credit`;
    `local_weight`, progress-local's reward of a locally correct step after the first error).
    T is `rollouts.completion_ids.shape[1]`. Returns the advantages and an info dict: `steps`
    (texts), `step_rewards`, `step_ends`, `stats` (`step_statistics` plus the scorer's cost).
    """
    scorer = as_step_scorer(step_scorer)
    if prompt is None:
        prompt = tokenizer.decode(rollouts.prompt_ids.tolist(), skip_special_tokens=False)
    G, T = rollouts.completion_ids.shape
    lengths = [int(x) for x in rollouts.lengths.tolist()]
    truncated = [bool(x) for x in rollouts.truncated.tolist()]
    steps, ends = [], []
    for g in range(G):
        s, e = completion_steps(tokenizer, rollouts.completion_ids[g], lengths[g],
                                rollouts.texts[g], truncated[g], split_mode, pattern)
        steps.append(s)
        ends.append(e)
    if callable(getattr(scorer, "score_rollouts", None)):
        rewards = scorer.score_rollouts(prompt, rollouts, steps, ends, example)
    else:  # a duck-typed scorer with score / score_group only
        rewards = scorer.score_group(prompt, steps, example)
    for g, (rs, ss) in enumerate(zip(rewards, steps)):
        if len(rs) != len(ss):
            raise ValueError(f"process_token_advantages: the step scorer gave {len(rs)} rewards "
                             f"for the {len(ss)} steps of completion {g}")
    adv = torch.zeros(G, T, dtype=torch.float32)  # (G, T)
    if max(lengths, default=0) > 0:
        a = process_advantages(rewards, ends, lengths, variant, outcome_advantages, eps, alpha,
                               control=credit_control, generator=generator,
                               prompt_value=getattr(scorer, "last_prompt_value", None),
                               local_weight=local_weight)
        adv[:, : a.shape[1]] = a
    stats = step_statistics(rewards, ends)
    stats.update(scorer.cost())
    return adv, {"steps": steps, "step_rewards": rewards, "step_ends": ends, "stats": stats}


def group_digest(key: str, rollouts) -> str:
    """A hex digest of `key` and one group's own tokens (prompt and each completion's real
    tokens, padding excluded): a seed that depends on the group alone, not on its place."""
    h = hashlib.sha256(key.encode())
    h.update(rollouts.prompt_ids.cpu().numpy().astype("int64").tobytes())
    for g, n in enumerate(rollouts.lengths.tolist()):
        h.update(b"|" + rollouts.completion_ids[g, : int(n)].cpu().numpy().astype("int64")
                 .tobytes())
    return h.hexdigest()


def group_generator(seed: int, rollouts) -> random.Random:
    """A `random.Random` for one group's placebo permutations, seeded by the run's `seed` and the
    group's own tokens (`group_digest`).

    The rollouts are themselves seeded by (seed, step, prompt index) (`grpo.rollout_seed`),
    so the permutations are a function of (seed, step, prompt) as well: a resumed run, or the
    same run on N processes, draws the same ones, whatever order the groups are scored in.
    """
    return random.Random(group_digest(str(seed), rollouts))


class ProcessAdvantageFn:
    """The `advantage_fn` hook of `grpo.collect_rollouts`: token-level process advantages.

    Called as `fn(groups, outcome_advantages (N, G), completion_mask (B, Tc)) -> (B, Tc)`, where
    `groups` are `(example, rollouts, scored)` tuples. The outcome advantages are used by the
    `"process+outcome"` variant and the outcome-anchored ones (`process.ANCHORED_VARIANTS`,
    weighted by `alpha`); `"pure"` gets them only on a `verifiable_share` of the groups, spread
    evenly over the batch (PURE, arXiv 2504.15275: verifiable rewards on a small share of
    prompts). After each call `last_stats` holds the mean over groups of `step_statistics` (and
    the scorer's cumulative cost), for metrics.csv, `last_infos` each group's steps and step
    rewards, and `last_groups` the groups themselves (the branches at the first error start
    from them, `branching.sample_branches`).
    """

    def __init__(self, tokenizer, step_scorer, variant: str = "sum", split_mode: str = "tags",
                 pattern: str | None = None, alpha: float = 1.0, verifiable_share: float = 0.1,
                 credit_control: str = "none", seed: int = 0,
                 local_weight: float = LOCAL_STEP_WEIGHT):
        if credit_control not in CREDIT_CONTROLS:
            raise ValueError(f"ProcessAdvantageFn: unknown credit control {credit_control!r}; "
                             f"expected {CREDIT_CONTROLS}")
        if variant not in VARIANTS:
            raise ValueError(f"ProcessAdvantageFn: unknown variant {variant!r}; "
                             f"expected {VARIANTS}")
        if not 0.0 <= verifiable_share <= 1.0:
            raise ValueError(f"ProcessAdvantageFn: verifiable_share must be in [0, 1], "
                             f"got {verifiable_share}")
        self.tokenizer = tokenizer
        self.step_scorer = as_step_scorer(step_scorer)
        self.variant, self.split_mode, self.pattern = variant, split_mode, pattern
        self.alpha, self.verifiable_share = float(alpha), float(verifiable_share)
        self.credit_control = credit_control
        self.local_weight = float(local_weight)  # progress-local's post-error step reward
        self.seed = seed  # of the shuffled control's permutations (`group_generator`)
        self.last_stats: dict[str, float] = {}
        self.last_infos: list[dict] = []
        self.last_groups: list = []  # the groups of the last call (branching.py reads them)

    def __call__(self, groups, outcome_advantages, completion_mask) -> torch.Tensor:
        Tc = completion_mask.shape[1]
        rows, infos = [], []
        for n, group in enumerate(groups):
            example, ro = group[0], group[1]
            adv, info = process_token_advantages(
                ro, example, self.tokenizer, self.step_scorer, variant=self.variant,
                split_mode=self.split_mode, pattern=self.pattern,
                outcome_advantages=self._outcome_of(n, outcome_advantages), alpha=self.alpha,
                credit_control=self.credit_control,
                generator=group_generator(self.seed, ro) if self.credit_control == "shuffled"
                else None, local_weight=self.local_weight,
            )
            T = min(adv.shape[1], Tc)
            padded = torch.zeros(adv.shape[0], Tc, dtype=torch.float32)
            padded[:, :T] = adv[:, :T]
            rows.append(padded)
            infos.append(info)
        self.last_infos, self.last_groups = infos, list(groups)
        keys = {k for info in infos for k in info["stats"]}
        self.last_stats = {}
        for k in sorted(keys):
            vals = [info["stats"][k] for info in infos if k in info["stats"]]
            vals = [v for v in vals if not math.isnan(v)]
            self.last_stats[k] = sum(vals) / len(vals) if vals else float("nan")
        out = torch.cat(rows) if rows else torch.zeros(0, Tc)
        return out.to(completion_mask.device) * completion_mask.to(out.device)

    def _outcome_of(self, n: int, outcome_advantages):
        """Group n's outcome advantages (G,) where the variant uses them, else None."""
        if self.variant == "pure":
            # groups n with floor((n + 1) share) > floor(n share): the share, spread evenly
            share = self.verifiable_share
            return outcome_advantages[n] if math.floor((n + 1) * share) > math.floor(
                n * share) else None
        if self.variant == "process+outcome" or self.variant in ANCHORED_VARIANTS:
            return outcome_advantages[n]
        return None


def make_process_advantage_fn(
    tokenizer, step_scorer="verifier", variant: str = "sum", split_mode: str = "tags",
    pattern: str | None = None, model=None, device=None, mc_rollouts: int = 4,
    mc_max_new_tokens: int = 64, mc_temperature: float = 1.0, mc_generator=None,
    alpha: float = 1.0, verifiable_share: float = 0.1, credit_control: str = "none",
    seed: int = 0, mc_compile: bool = False, local_weight: float = LOCAL_STEP_WEIGHT,
) -> ProcessAdvantageFn:
    """A `ProcessAdvantageFn` from a scorer object or a spec string (verifier | verifier-signed |
    mc | mc-hard | prm:PATH | online-prm:PATH, see `build_step_scorer`); `mc` samples with
    `model`, the policy being trained, so its values follow the current policy. `alpha`: weight
    of the outcome-anchored variants' step credit; `verifiable_share`: PURE's share of groups
    with the outcome term; `credit_control`: "none", or a placebo of that credit ("flat",
    "shuffled", seeded by `seed`; `process.control_credit`); `mc_compile`: the Monte-Carlo
    scorers decode with `generate`'s compiled step; `local_weight`: progress-local's reward of
    a locally correct step after the first error."""
    if isinstance(step_scorer, str):
        mc_kwargs = {}
        if step_scorer.startswith("mc"):
            mc_kwargs = dict(num_continuations=mc_rollouts, max_new_tokens=mc_max_new_tokens,
                             temperature=mc_temperature, generator=mc_generator,
                             compile=mc_compile)
        step_scorer = build_step_scorer(step_scorer, model, tokenizer, device, **mc_kwargs)
    return ProcessAdvantageFn(tokenizer, step_scorer, variant, split_mode, pattern, alpha,
                              verifiable_share, credit_control, seed, local_weight)
