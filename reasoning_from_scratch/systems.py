"""The systems layer of the GRPO loop: several processes, compiled paths and precision, and
the general forms of the stages they need.

training.py's step is written for one process, eager, in the model's own dtype. When a run
needs more, `systems_layer` builds a `SystemsLayer` whose `stages` replace the plain stage
functions of the run's `training.Step` (nothing of this module runs in a step otherwise):
- several processes (`torchrun`, distributed.py): each samples a share of every step's prompts
  (whole groups; every prompt with its own generator, so the rollouts do not depend on how many
  processes share a step), statistics are gathered, the loss of each micro-batch is scaled by
  the whole batch's normalisers and the gradients are summed (DDP with a summing hook, during
  the last micro-batch's backward; every process runs as many micro-batches as the busiest, a
  process without rows zero-weighted ones): the update is the one-process update up to float
  summation order;
- FSDP (fsdp.py): weights, gradients and AdamW state sharded; rollouts, scoring and evaluation
  on an unsharded replica refreshed after every update, checkpoints hold the shards;
- the compiled decode step and the compiled update (compiled_update.py, checked against the
  eager code on first use: compile_check.py), the bfloat16 sampler replica and autocast;
- the rollout stage with DAPO's dynamic sampling (more rounds of prompts until
  `prompts_per_step` groups carry signal, DAPO section 3.2) and the branch rows at the first
  error (branching.py);
- a process hook whose step scorer learns as it scores (the online PRM) run on the whole step's
  groups by every process (`WholeStepHook`), so that every process's copy makes the one-process
  updates and the copies stay equal.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from dataclasses import dataclass, field, replace
from functools import partial

import torch

from .branching import BranchConfig, branch_rows, sample_branches, with_branch_rows
from .compile_check import CHECK_ROWS, check_decoding, check_logprobs
from .compiled_update import FixedShape
from .distributed import (
    all_gather_objects,
    all_ranks,
    all_reduce_max,
    all_reduce_sum,
    data_parallel,
    gather_groups,
    gather_lists,
    is_main,
    rank,
    shard,
    shard_range,
    world_size,
)
from .fsdp import (
    dummy_backward,
    empty_replica,
    full_tensor,
    is_sharded,
    local_tensor,
    refresh_replica,
    shard_with_replica,
)
from .generation import (
    Rollouts,
    compile_decoding,
    generate,
    left_pad,
    reserve_decoding,
    stop_token_ids,
    warm_up_decoding,
)
from .grpo import (
    MEAN_STATS,
    add_stats,
    batch_logprobs,
    batch_totals,
    collect_rollouts,
    concat_rollout_batches,
    loss_on_batch,
    micro_batch_weights,
    rollout_generators,
    step_prompts,
    token_logprobs_and_entropy,
)
from .process_supervision import (
    FORWARD_COST_KEYS,
    learned_states,
    process_metrics,
    scorer_tokens,
)
from .run_dir import print_line
from .tokenizer import pad_id_of
from .variants import extra_prompts, loss_function


def check_processes(config) -> None:
    """Refuse a run with more processes than prompts per step (a process would sample none)."""
    if world_size() > config.prompts_per_step:
        raise ValueError(f"{world_size()} processes need at least as many prompts per step, "
                         f"got prompts_per_step={config.prompts_per_step}")


@dataclass
class SystemsLayer:
    """What a run's systems add to its step: the model to train (FSDP: sharded), the policy
    that samples (the model, a bfloat16 replica or FSDP's unsharded one), the config after the
    compile check, and `stages`, the replacements of `training.Step`'s plain stage functions
    (empty for a one-process, eager, full-precision run)."""

    model: torch.nn.Module
    config: object
    trained: torch.nn.Module  # the policy's whole weights (FSDP: the replica)
    policy: torch.nn.Module  # what samples and evaluates
    eval_set: list
    replica: torch.nn.Module | None = None  # FSDP's unsharded copy
    sampler: torch.nn.Module | None = None  # the sampling-dtype copy
    fixed_shape: FixedShape | None = None  # the compiled update's padding
    compile_report: dict | None = None
    warm: tuple = ()  # (tokenizer, train_examples, prompt_fn, device) for the warm-ups
    stages: dict = field(default_factory=dict)

    def refresh_sampler(self):
        """The sampler replica from the (restored) weights."""
        if self.sampler is not None:
            refresh_replica(self.sampler, self.model)

    def warm_up(self, ref_model):
        """Compile before the first step whatever the run compiles (decoding, the update)."""
        tokenizer, train_examples, prompt_fn, device = self.warm
        if compile_decoding(self.config.compile, device):
            _warm_up_decoding(self.policy, tokenizer, train_examples, self.eval_set,
                              self.config, prompt_fn)
        if self.fixed_shape is not None and self.fixed_shape.compile:
            _warm_up_update(self.model, ref_model, self.config, self.fixed_shape, device)


def systems_layer(model, tokenizer, train_examples, eval_examples, device, config,
                  prompt_fn) -> SystemsLayer:
    """The run's systems: FSDP sharding or a sampling replica, the compile check, and the
    general stages the run needs (several processes, compiled update, autocast, sampling
    rounds, branches)."""
    replica = sampler = None
    if config.fsdp:  # shard before the optimizer exists: AdamW then holds shards only
        model, replica = shard_with_replica(model, device, sampler_dtype(config, device))
    else:  # a copy in the sampling dtype (bfloat16 on CUDA), or None: the model samples
        sampler = sampling_replica(model, device, sampler_dtype(config, device))
    trained = model if replica is None else replica
    policy = trained if sampler is None else sampler
    model.activation_checkpointing = config.activation_checkpointing  # the update's passes only
    eval_set = list(eval_examples)[:config.eval_examples]
    config, report = check_compiled_paths(policy, trained, tokenizer, train_examples, eval_set,
                                          device, config, prompt_fn)
    fixed_shape = update_shape(config, tokenizer, train_examples, prompt_fn) \
        if compiles_update(config, device) else None
    layer = SystemsLayer(model, config, trained, policy, eval_set, replica, sampler, fixed_shape,
                         report, (tokenizer, train_examples, prompt_fn, device))
    layer.stages = _general_stages(layer, config, device)
    return layer


def _general_stages(layer, config, device) -> dict:
    """The stage functions of `training.Step` this run replaces, by name."""
    several = world_size() > 1
    stages = {}
    if several or config.dynamic_sampling or config.branch_rollouts:
        stages["rollouts"] = general_rollout_stage
    if several or config.fsdp or layer.fixed_shape or autocast_dtype(config, device):
        stages["update"] = partial(general_update, fixed_shape=layer.fixed_shape)
        stages["logprobs"] = partial(general_logprobs, fixed_shape=layer.fixed_shape)
    if several:
        stages["total"] = all_reduce_sum
    copy_ = layer.replica if layer.replica is not None else layer.sampler
    if copy_ is not None:
        stages["after_update"] = partial(refresh_replica, copy_)
    if layer.replica is not None:  # a sharded forward pass is a collective: pi_old from the copy
        stages["old_policy"] = layer.replica
    return stages


# ----------------------------------------------------------------------------------------------
# Precision and compiling of the sampler and the update
# ----------------------------------------------------------------------------------------------

def sampler_dtype(config, device) -> torch.dtype | None:
    """The dtype rollouts and evaluations sample in (`config.sampler_dtype`); None: the model's
    own. auto is bfloat16 on CUDA: decoding there reads the weights and the KV cache every
    token, half the bytes in bfloat16; on the CPU float32 keeps the tokens exact."""
    if config.sampler_dtype == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else None
    return getattr(torch, config.sampler_dtype)


def sampling_replica(model, device, dtype: torch.dtype | None):
    """A frozen copy of `model` in `dtype` to sample from (`fsdp.empty_replica`, filled by
    `fsdp.refresh_replica` and refreshed after every update), or None when `dtype` is the
    model's own (None included): the model then samples itself."""
    if dtype is None or dtype == next(model.parameters()).dtype:
        return None
    replica = empty_replica(model.cfg, device, dtype)
    refresh_replica(replica, model)
    return replica


def autocast_dtype(config, device) -> torch.dtype | None:
    """The dtype of the update's forward passes under torch.autocast (`config.autocast`), or
    None for none. auto is bfloat16 on CUDA without fsdp (FSDP's mixed-precision policy already
    computes in bfloat16 there) and off elsewhere: a CPU gains nothing from bfloat16 matmuls."""
    if config.autocast == "auto":
        on = torch.device(device).type == "cuda" and not config.fsdp
        return torch.bfloat16 if on else None
    return None if config.autocast == "off" else getattr(torch, config.autocast)


def update_autocast(config, device):
    """The context of the update's forward passes: torch.autocast at `autocast_dtype`, else none.
    The loss arithmetic stays float32 (the log-probs are taken from float32 logits)."""
    dtype = autocast_dtype(config, device)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=dtype)


def compiles_update(config, device) -> bool:
    """Whether the update runs its decoder blocks compiled: `compile_update`, by default as
    `compile` (`generation.compile_decoding`); never with fsdp."""
    if config.fsdp:
        return False
    if config.compile_update is None:
        return compile_decoding(config.compile, device)
    return bool(config.compile_update)


def prompt_lengths(tokenizer, examples, prompt_fn) -> list[int]:
    """Tokens of each example's rendered prompt."""
    return [len(tokenizer.encode(prompt_fn(ex["problem"]))) for ex in examples]


def update_shape(config, tokenizer, train_examples, prompt_fn) -> FixedShape:
    """The shapes the compiled update pads its micro-batches to: at most rows = the micro-batch
    size (at most this process's rollouts of a step and their branches) and columns = the
    longest training prompt + the token budget, in `update_buckets` row and completion-length
    buckets each (`compiled_update.FixedShape`), so every step of a run, whatever its prompts' and
    completions' lengths, uses one of at most update_buckets**2 shapes, each compiled when
    first met."""
    start, stop = shard_range(config.prompts_per_step)
    rows = (stop - start) * config.num_rollouts  # this process's rollouts of one step
    rows += (stop - start) * config.branch_states * config.branch_rollouts  # and its branches
    if config.micro_batch_size:
        rows = min(rows, config.micro_batch_size)
    rows = max(1, rows)  # 0: a process whose share has no prompt (it never pads)
    return FixedShape(rows, max(prompt_lengths(tokenizer, train_examples, prompt_fn)),
                      config.max_new_tokens, buckets=config.update_buckets)



# ----------------------------------------------------------------------------------------------
# The general update: several processes, FSDP, the compiled update, autocast
# ----------------------------------------------------------------------------------------------

def general_update(model, optimizer, batch, old_logp, ref_logp, config, loss_fn=None,
                   totals=None, fixed_shape=None):
    """`training.update` for every system: micro-batches padded to `fixed_shape` (compiled
    blocks), under `update_autocast`, and with several processes `batch` is this process's
    share: each micro-batch's loss is scaled by its share of the *whole* batch (`totals`,
    `global_totals`) and the gradients summed over the processes (FSDP, or DDP during the last
    pass's backward), which is exactly the one-process gradient. Every process then clips and
    steps identically; a non-finite loss or clipped gradient on any process skips the update
    everywhere."""
    loss_fn = loss_fn or loss_function(config)
    optimizer.zero_grad(set_to_none=True)
    totals = global_totals(batch) if totals is None else totals
    mbs = config.micro_batch_size or max(1, batch.size)
    sums, finite_ = {"ratio_max": None}, True
    sharded = is_sharded(model)
    replicated = not sharded and world_size() > 1
    net = model if sharded else data_parallel(model)  # replicas: the DDP view
    starts = list(range(0, batch.size, mbs))
    # FSDP and DDP: every process runs as many forward/backward passes as the busiest one (their
    # collectives must pair up; DDP's only in the last one); the extra ones are zero-weighted
    parallel = sharded or replicated
    passes = int(all_reduce_max([len(starts)])[0]) if parallel else len(starts)
    for i in range(passes):
        if replicated:  # gradients summed over the processes in the last backward only
            net.sync_next_backward(i == passes - 1)
        if i >= len(starts):
            dummy_backward(net)
            continue
        mb, part = batch.slice(starts[i], starts[i] + mbs), slice(starts[i], starts[i] + mbs)
        with update_autocast(config, mb.input_ids.device):  # the backward runs outside it
            out = loss_on_batch(net, mb, None if old_logp is None else old_logp[part],
                                None if ref_logp is None else ref_logp[part], loss_fn,
                                config.chunk_size, config.temperature, fixed_shape)
        loss = out.pop("loss")
        if not torch.isfinite(loss):
            finite_ = False
            if not parallel:
                break
            loss = loss * 0.0  # FSDP/DDP: the backward still runs everywhere; no update
        w, w_stat = micro_batch_weights(mb, totals, config.loss_type)
        if loss.requires_grad:  # a micro-batch without loss tokens (all masked) has no graph
            (loss * w).backward()
        elif replicated:  # DDP's reduction needs every parameter's gradient
            dummy_backward(net)
        if finite_:
            add_stats(sums, out, loss, w, w_stat)
    return _step_if_finite(model, optimizer, config, all_ranks(finite_), _reduce_loss_stats(sums))


def _step_if_finite(model, optimizer, config, finite_, sums):
    """Clip and step when the loss and the clipped gradient are finite on every process, else
    drop the gradient (weights and AdamW moments untouched)."""
    grad_norm = float("nan")
    if finite_:
        # on DTensor shards the norm is the whole gradient's (FSDP: clipping the shards)
        grad_norm = float(full_tensor(torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                                     config.max_grad_norm)))
        finite_ = math.isfinite(grad_norm) and all_ranks(_grads_finite(model))
    if finite_:
        optimizer.step()
        if not all_ranks(_params_finite(model)):  # impossible with finite gradients and lr
            raise FloatingPointError("the optimizer step made weights non-finite; nothing was "
                                     "saved from this step (lower --lr or --max-grad-norm)")
    else:  # never let a NaN/inf reach the weights or the AdamW moments
        optimizer.zero_grad(set_to_none=True)
        sums.setdefault("loss", float("nan"))
    return {**sums, "grad_norm": grad_norm, "skipped": int(not finite_)}


def global_totals(batch) -> tuple[int, float, int, float]:
    """`grpo.batch_totals` summed over every process of the run: the
    normalisers that make N processes' update equal the one-process update."""
    rows, tokens, own, own_tokens = all_reduce_sum(list(batch_totals(batch)))
    return int(rows), tokens, int(own), own_tokens


# Loss statistics of `general_update` that are sums of shares of the whole batch.
_SUMMED_STATS = ("loss", "pg_loss", "kl", *MEAN_STATS)


def _reduce_loss_stats(sums):
    """`_update`'s statistics of the whole batch: each process's weighted sums added up (a
    statistic no process measured stays absent), ratio_max the maximum over processes."""
    flat = [x for k in _SUMMED_STATS for x in (sums.get(k, 0.0), float(k in sums))]
    total = all_reduce_sum(flat)  # (value, present) pairs
    out = {k: total[2 * i] for i, k in enumerate(_SUMMED_STATS) if total[2 * i + 1]}
    top = all_reduce_max([-math.inf if sums["ratio_max"] is None else sums["ratio_max"]])[0]
    out["ratio_max"] = None if top == -math.inf else top
    return out


def _grads_finite(model) -> bool:
    """Every gradient finite (after clipping: a NaN max norm would make them NaN)."""
    return all(bool(torch.isfinite(local_tensor(p.grad)).all()) for p in model.parameters()
               if p.grad is not None)


def _params_finite(model) -> bool:
    """Every parameter finite."""
    return all(bool(torch.isfinite(local_tensor(p)).all()) for p in model.parameters())


def general_logprobs(model, batch, config, fixed_shape=None):
    """`training.logprobs` under the update's autocast and padding (`fixed_shape`); zeros for a
    process whose share kept no group."""
    if not batch.size:
        return torch.zeros(batch.completion_mask.shape, device=batch.input_ids.device)
    mbs = config.micro_batch_size or batch.size
    with update_autocast(config, batch.input_ids.device):
        parts = [batch_logprobs(model, batch.slice(s, s + mbs), config.chunk_size, False,
                                config.temperature, fixed_shape)[0]
                 for s in range(0, batch.size, mbs)]
    return torch.cat(parts)


# ----------------------------------------------------------------------------------------------
# The general rollout stage: several processes, sampling rounds, branch rows
# ----------------------------------------------------------------------------------------------

def general_rollout_stage(s, step):
    """`training.rollout_stage` for several processes, dynamic sampling and branches."""
    return general_rollouts(s.policy, s.tokenizer, s.examples, s.device, s.config, s.reward_fn,
                            s.advantage_fn, s.prompt_fn, step)


def general_rollouts(model, tokenizer, examples, device, config, reward_fn, advantage_fn,
                     prompt_fn, step):
    """Sample, score and pack step `step`'s rollouts; returns (batch, cost) where cost has the
    start time, the rollout seconds, the process scorer's generated tokens and the sampling
    rounds (DAPO dynamic sampling draws more prompts until `prompts_per_step` groups carry a
    learning signal, at most `max_sampling_rounds` batches of prompts; DAPO section 3.2).

    Each prompt samples with its own generator (`rollout_generators`). In a data-parallel run
    every process takes a contiguous share of each batch of prompts (whole groups), so the
    rollouts, and dynamic sampling's decisions, are those of one process: `batch` holds this
    process's rows, its statistics fields (rewards, samples, zero_adv_frac,
    num_generated_tokens) the whole step's, in prompt order, round after round.
    """
    t0 = time.time()
    advantage_fn = whole_step_hook(advantage_fn)
    scorer_before = scorer_tokens(advantage_fn)
    forward_before = scorer_tokens(advantage_fn, FORWARD_COST_KEYS)
    P, G = config.prompts_per_step, config.num_rollouts
    start, stop = shard_range(P)  # this process's prompts of each batch
    rounds = config.max_sampling_rounds if config.dynamic_sampling else 1
    batches, shares = [], []  # per round: this process's batch, every process's summary
    for r in range(rounds):
        prompts = step_prompts(examples, step, config) if r == 0 else \
            extra_prompts(examples, step, r, config)
        batch = collect_rollouts(
            model, tokenizer, prompts[start:stop], device, reward_fn, num_rollouts=G,
            max_new_tokens=config.max_new_tokens, temperature=config.temperature,
            top_p=config.top_p,
            generator=rollout_generators(device, config.seed, step,
                                         range(r * P + start, r * P + stop)),
            scale_rewards=config.scale_rewards,
            skip_zero_advantage=config.skip_zero_advantage or config.dynamic_sampling,
            mask_truncated=config.mask_truncated, prompt_fn=prompt_fn, advantage_fn=advantage_fn,
            record_logprobs=config.tis_cap is not None
            or config.off_policy_mask_threshold is not None,
            reward_normalization=config.reward_normalization, gather_groups=gather_groups,
            compile=compile_decoding(config.compile, device),
        )
        batches.append(batch)
        shares.append(all_gather_objects(_share_summary(batch, G)))
        if sum(share["kept"] for rnd in shares for share in rnd) >= P:
            break
    kept = [[share["kept"] for share in rnd] for rnd in shares]
    batch = _first_groups(batches, kept, P, G, pad_id_of(tokenizer))
    counts = [0.0] * 5
    if config.branch_rollouts:  # rows below the rollouts': the step's branches at first errors
        batch, counts = _branches(model, tokenizer, batch, advantage_fn, config, device,
                                  prompts[start:stop])
    scorer, scorer_forward, drawn, right, rows = all_reduce_sum([
        scorer_tokens(advantage_fn) - scorer_before + counts[0],
        scorer_tokens(advantage_fn, FORWARD_COST_KEYS) - forward_before + counts[1],
        *counts[2:]])
    branch = {"branch_rows": int(rows), "branch_correct_rate": right / drawn if drawn else None} \
        if config.branch_rollouts else {}
    batch = _with_step_statistics(batch, shares)
    return batch, {
        "t0": t0, "rollout_s": time.time() - t0, "sampling_rounds": len(batches),
        "scorer_tokens": int(scorer), "scorer_forward_tokens": int(scorer_forward),
        "metrics": {**process_metrics(batch.samples), **branch}}


def whole_step_hook(advantage_fn):
    """`advantage_fn`, or with several processes and a step scorer that learns as it scores
    (`process_supervision.learned_states`: the online PRM) its `WholeStepHook`."""
    if world_size() > 1 and learned_states(advantage_fn):
        return WholeStepHook(advantage_fn)
    return advantage_fn


class WholeStepHook:
    """A process hook (`process_supervision.ProcessAdvantageFn`) run by every process on the
    whole step's groups: each process's groups are gathered in prompt order (the order of the
    one-process call), every process scores them all, so its step scorer (an online PRM, updated
    after every group) makes the one-process run's updates in the same order and stays equal to
    the other processes' copies; each process keeps its own groups' advantages. The scorer's
    work is repeated on every process; its cost is counted once (rank 0's `step_scorer`)."""

    def __init__(self, hook):
        self.hook = hook
        self.last_infos, self.last_groups = [], []

    @property
    def step_scorer(self):
        """The hook's scorer on rank 0, None elsewhere: summed over the processes, its tokens
        are the one-process run's."""
        return self.hook.step_scorer if is_main() else None

    def __call__(self, groups, outcome_advantages, completion_mask) -> torch.Tensor:
        everyone = gather_lists([_portable(group) for group in groups])
        outcomes, start = gather_groups(outcome_advantages)  # (N_all, G), where mine start
        n, G = len(groups), completion_mask.shape[0] // max(1, len(groups))
        mask = completion_mask.new_zeros(len(everyone) * G, completion_mask.shape[1])
        mine = slice(start * G, (start + n) * G)
        mask[mine] = completion_mask  # the other processes' rows: scored, then dropped
        adv = self.hook(everyone, outcomes, mask)
        self.last_infos = self.hook.last_infos[start:start + n]
        self.last_groups = list(groups)
        return adv[mine]


def _portable(group):
    """A group (example, rollouts, rewards) to send to the other processes: its rollouts' token
    tensors on the CPU, without sampler log-probs."""
    example, ro, scored = group
    return example, Rollouts(ro.prompt_ids.cpu(), ro.completion_ids.cpu(),
                             ro.completion_mask.cpu(), list(ro.texts), ro.lengths.cpu(),
                             ro.truncated.cpu()), scored


def _branches(model, tokenizer, batch, advantage_fn, config, device, prompts):
    """`batch` with the step's branches at the first error as rows below its own
    (`branching`), and their counts: tokens sampled, tokens prefilled, branches drawn, branches
    right, rows kept (a row per branch with an advantage). The branches start from the groups
    the process hook just scored (`ProcessAdvantageFn.last_groups`, this step's `prompts`)."""
    groups = getattr(advantage_fn, "last_groups", None)
    if groups is None or [g[0] for g in groups] != list(prompts):
        raise ValueError("branch_rollouts needs the process advantage hook of this step's "
                         "groups (process_supervision.ProcessAdvantageFn)")
    pad = pad_id_of(tokenizer)
    branches, cost = sample_branches(model, tokenizer, groups, advantage_fn.last_infos,
                                     BranchConfig(
        k=config.branch_rollouts, max_states=config.branch_states,
        max_new_tokens=config.branch_max_new_tokens, rollout_tokens=config.max_new_tokens,
        temperature=config.temperature, top_p=config.top_p, alpha=config.process_alpha,
        control=config.branch_control, split_mode=config.step_split, seed=config.seed,
        compile=compile_decoding(config.compile, device)))
    rows = branch_rows(branches, groups, pad, batch.input_ids.device)
    counts = [cost["branch_generated_tokens"], cost["branch_prefill_tokens"], len(branches),
              sum(b.correct for b in branches), 0 if rows is None else rows.size]
    return with_branch_rows(batch, rows, pad), [float(c) for c in counts]


def _share_summary(batch, G):
    """What the other processes need of this process's batch of one sampling round."""
    groups = batch.rewards.shape[0]
    return {"kept": batch.size // G, "groups": groups, "rewards": batch.rewards.cpu(),
            "zero_groups": round(batch.zero_adv_frac * groups), "samples": batch.samples,
            "tokens": batch.num_generated_tokens}


def _first_groups(batches, kept, limit, G, pad_id):
    """This process's rows among the step's first `limit` kept groups, counted round by round
    and, within a round, process by process (prompt order): dynamic sampling's batch size
    stays fixed, later groups are left out. kept[r][k]: groups process k kept in round r."""
    if len(batches) == 1:  # one round never holds more than `limit` groups
        return batches[0]
    me, before, keep = rank(), 0, []
    for rnd, b in zip(kept, batches):
        mine = min(rnd[me], max(0, limit - before - sum(rnd[:me])))  # groups still in budget
        keep += [True] * (mine * G) + [False] * (b.size - mine * G)
        before += sum(rnd)
    batch = concat_rollout_batches(batches, pad_id)
    if all(keep):
        return batch
    return batch.rows(torch.tensor(keep, dtype=torch.bool, device=batch.input_ids.device))


def _with_step_statistics(batch, shares):
    """`batch` with the statistics fields of every process's share of every round."""
    parts = [share for rnd in shares for share in rnd]  # round-major, then process order
    groups = sum(p["groups"] for p in parts)
    return replace(
        batch, rewards=torch.cat([p["rewards"] for p in parts]),  # (N_all, G)
        samples=[s for p in parts for s in p["samples"]],
        zero_adv_frac=sum(p["zero_groups"] for p in parts) / max(1, groups),
        num_generated_tokens=sum(p["tokens"] for p in parts))





# ----------------------------------------------------------------------------------------------
# The compile check and the warm-ups
# ----------------------------------------------------------------------------------------------

def check_compiled_paths(policy, trained, tokenizer, train_examples, eval_set, device, config,
                          prompt_fn):
    """The first-use check (compile_check.py) of a run that compiles its decoding or its update
    -> (config, report). Decoding: the evaluation's first batch (the shape it compiles anyway),
    greedy, compiled against eager, `trained` (the float32 weights behind a bfloat16 sampler)
    setting the rounding tolerance. The update: the first CHECK_ROWS of those rows whose prompt
    and completion fit the update's padded shapes. On a mismatch on any process: one warning
    with the figures, and the run goes on eagerly (the returned config has compile and
    compile_update off; it is the one config.json and the checkpoints record); the report goes
    to summary.json either way. None: nothing compiled, no check."""
    decode, update = compile_decoding(config.compile, device), compiles_update(config, device)
    if not (decode or update) or not eval_set:
        return config, None
    t0 = time.time()
    was_training = policy.training
    policy.eval()
    stops = stop_token_ids(tokenizer)
    mine = shard(eval_set) or eval_set[:1]
    prompts = sorted((prompt_fn(ex["problem"]) for ex in mine),
                     key=lambda p: -len(tokenizer.encode(p)))[:config.eval_batch_size]
    encoded = [tokenizer.encode(p) for p in prompts]
    ids, mask = left_pad(encoded, pad_id_of(tokenizer))
    ids, mask = ids.to(device), mask.to(device)
    report = {}
    if decode:
        found = check_decoding(policy, ids, mask, config.eval_tokens, stops,
                               temperature=config.temperature, top_p=config.top_p)
        out = found.pop("output")
        report["decoding"] = found
    else:
        out = generate(policy, ids, mask, config.eval_tokens, eos_token_id=stops)
    policy.train(was_training)
    if update:
        report["update"] = _check_update(trained, tokenizer, train_examples, ids, mask, out,
                                         config, device, prompt_fn)
    ok = all_ranks(all(part.get("ok", True) for part in report.values()))
    report.update(ok=ok, seconds=round(time.time() - t0, 3), fell_back_to_eager=not ok)
    print_line(config, f"compile check ({report['seconds']:.1f} s): {_check_line(report)}")
    if not ok:
        warnings.warn(f"the compiled paths disagree with the eager code ({_check_line(report)});"
                      " this run goes on eagerly (compile and compile_update off). Run with "
                      "--no-compile --no-compile-update to skip compiling, and please report "
                      "the figures with your torch version and GPU", RuntimeWarning,
                      stacklevel=3)
        config = replace(config, compile=False, compile_update=False)
    return config, report


def _check_update(model, tokenizer, train_examples, ids, mask, out, config, device, prompt_fn):
    """`compile_check.check_logprobs` of up to CHECK_ROWS decoded rows within the run's padded
    update shapes (prompt columns cut to the longest of them; completions cut to the widest
    bucket), or a report saying why none fit."""
    shape = update_shape(config, tokenizer, train_examples, prompt_fn)
    rows = min(CHECK_ROWS, shape.rows, ids.shape[0])
    lead = int((~mask[:rows]).all(dim=0).cumprod(0).sum())  # columns of padding only
    P = ids.shape[1] - lead
    if P > shape.prompt_cols or not rows:
        return {"ok": True, "skipped": f"the evaluation prompts ({P} tokens) are longer than "
                                       f"the update's ({shape.prompt_cols})"}
    cols = min(out.completion_ids.shape[1], shape.completion_cols)
    seq = torch.cat([ids[:rows, lead:], out.completion_ids[:rows, :cols]], dim=1)
    full = torch.cat([mask[:rows, lead:], out.completion_mask[:rows, :cols]], dim=1)
    return check_logprobs(model, seq, full.long(), P, out.completion_mask[:rows, :cols], shape,
                          lambda: update_autocast(config, device), config.chunk_size,
                          config.temperature)


def _check_line(report) -> str:
    """One line of the compile check's figures."""
    parts = []
    if "decoding" in report:
        d = report["decoding"]
        parts.append(f"decoding {d['rows']} rows, {d['tokens']} tokens, "
                     f"{'equal to' if d['tokens_equal'] else 'apart from'} eager, max logit gap "
                     f"{d['max_logit_gap']:.3g} (tolerance {d['logit_tolerance']:.3g})")
        if d.get("sampled"):
            sd = d["sampled"]
            parts.append(f"sampled: uniform gap {sd['max_uniform_gap']:.3g} (tolerance "
                         f"{sd['uniform_tolerance']:.3g}), log-probs within "
                         f"{sd['max_logprob_diff']:.3g} ({sd['logprob_tolerance']:.3g})")
    if "update" in report:
        u = report["update"]
        parts.append(u["skipped"] if "skipped" in u else
                     f"update log-probs of {u['rows']} rows within {u['max_logprob_diff']:.3g} "
                     f"(tolerance {u['logprob_tolerance']:.3g})"
                     + (f", logits' RMS {u['logit_rms']:.3g} ({u['logit_rms_tolerance']:.3g})"
                        if "logit_rms" in u else ""))
    return "; ".join(parts)


def _warm_up_decoding(model, tokenizer, train_examples, eval_set, config, prompt_fn):
    """Compile the decode step, before the first step, for every shape the run's rollouts and
    evaluations decode: this process's prompts-per-step x G rows at every prompt-length bucket
    of the training prompts, and the evaluation's batches (in `evaluation.evaluate`'s order,
    longest prompts first). No later step then compiles (the Monte-Carlo scorers' shapes aside).
    """
    was_training = model.training
    model.eval()
    stops = stop_token_ids(tokenizer)
    start, stop = shard_range(config.prompts_per_step)
    lengths = set(prompt_lengths(tokenizer, train_examples, prompt_fn))
    rollouts = [((stop - start) * config.num_rollouts, n) for n in lengths]
    mine = shard(eval_set)
    lengths = sorted(prompt_lengths(tokenizer, mine, prompt_fn), reverse=True)
    batches = [lengths[i:i + config.eval_batch_size]
               for i in range(0, len(lengths), config.eval_batch_size)]
    evaluations = [(len(b), b[0]) for b in batches]
    # each row bucket's KV memory at once at its largest: no later call moves a shape's buffers
    reserve_decoding(model, [(r, n, config.max_new_tokens) for r, n in rollouts]
                     + [(r, n, config.eval_tokens) for r, n in evaluations])
    warm_up_decoding(model, rollouts, config.max_new_tokens, config.temperature, config.top_p,
                     eos_token_id=stops, return_logprobs=config.tis_cap is not None
                     or config.off_policy_mask_threshold is not None)
    warm_up_decoding(model, evaluations, config.eval_tokens, eos_token_id=stops)
    model.train(was_training)


def _warm_up_update(model, ref_model, config, fixed_shape, device):
    """Compile the update's decoder blocks (`compile_update`) before the first step, at every
    padded shape a step can meet (`systems.warm_up_compiled_blocks`), in each setting the steps
    use them: the reference's log-probs and (inner epochs > 1) the old policy's without
    gradients in eval mode, the update's with gradients in train mode, all under the update's
    autocast. No step then compiles. Printed with its time."""
    t0 = time.time()
    with update_autocast(config, device):
        if ref_model is not None:
            warm_up_compiled_blocks(ref_model, fixed_shape, False, config.chunk_size,
                                    config.temperature)
        model.eval()
        if config.inner_epochs > 1:
            warm_up_compiled_blocks(model, fixed_shape, False, config.chunk_size,
                                    config.temperature)
        model.train()
        shapes = warm_up_compiled_blocks(model, fixed_shape, True, config.chunk_size,
                                         config.temperature)
        model.eval()
    print_line(config, f"compiled the update for {shapes} padded shapes in "
                       f"{time.time() - t0:.1f} s")



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

