"""The GRPO training loop (book chapters 6-7, written out by hand): `GRPOConfig` and `train_grpo`.

One optimizer step = sample G rollouts for each of `prompts_per_step` prompts (one shared
prefill per prompt), score them, turn rewards into group-relative advantages, then run
`inner_epochs` AdamW updates on the clipped GRPO loss of that batch. Everything a run produces
lives in `config.output_dir`: metrics.csv (one row per step), samples.jsonl, checkpoints
(`checkpoint-<step>/`, loadable with `load_pretrained` and resumable exactly), final/,
summary.json (incl. the base model's evaluation) and metrics.png.

Checkpoints hold no pickles: the model via `save_pretrained`, the AdamW state flattened into
optimizer.safetensors plus its structure in trainer_state.json, and the RNG states as uint8
tensors in rng.safetensors.
"""

from __future__ import annotations

import argparse
import copy
import csv
import io
import json
import math
import random
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from safetensors.torch import load_file
from tqdm import tqdm

from .evaluation import evaluate
from .grpo import (
    LOSS_TYPES,
    SCALE_REWARDS,
    RolloutBatch,
    batch_logprobs,
    collect_rollouts,
    grpo_loss_on_batch,
)
from .plotting import plot_grpo_metrics
from .process import VARIANTS, make_process_advantage_fn
from .prompts import render_prompt
from .rewards import build_reward
from .weights import (
    atomic_save_safetensors,
    atomic_write_json,
    atomic_write_text,
    load_hf_state_dict,
    save_pretrained,
)

METRIC_COLUMNS = [
    "step", "loss", "pg_loss", "kl", "reward_mean", "reward_std", "correct_mean", "format_mean",
    "adv_mean", "adv_std", "zero_adv_frac", "entropy", "ratio_mean", "ratio_max",
    "clip_frac_low", "clip_frac_high", "len_mean", "len_max", "truncated_frac", "grad_norm",
    "skipped", "gen_tokens", "scorer_tokens", "tokens_per_s", "rollout_s", "update_s",
    "step_time", "lr", "eval_accuracy", "eval_format_rate", "eval_think_accuracy",
    "eval_step_correctness",
]
# The held-out figures of every evaluation (evaluation.evaluate's summary keys); summary.json has
# base_<name> and final_<name> for each.
EVAL_FIGURES = ("accuracy", "format_rate", "think_accuracy", "step_correctness",
                "right_answer_wrong_step", "carry_step_correctness")
# evaluation figure -> metrics.csv column (filled at evaluation steps only)
EVAL_COLUMNS = {"accuracy": "eval_accuracy", "format_rate": "eval_format_rate",
                "think_accuracy": "eval_think_accuracy",
                "step_correctness": "eval_step_correctness"}
# Columns that measure time: they differ between two otherwise identical runs.
TIMING_COLUMNS = ("tokens_per_s", "rollout_s", "update_s", "step_time")
# Not "loss": with one update per batch it is ~0 by construction (ratio 1, advantages of mean 0).
PLOT_COLUMNS = ["reward_mean", "correct_mean", "format_mean", "eval_accuracy",
                "eval_think_accuracy", "eval_step_correctness", "entropy", "len_mean",
                "zero_adv_frac", "kl"]

# The chapter 7 default mix of difficulty levels 1-5 in the arithmetic training problems: more of
# the levels where the base model still errs, where a group's rollouts disagree and RL has a
# signal (the held-out splits stay uniform). See the README's recipe search.
DEFAULT_TRAIN_LEVEL_WEIGHTS = (1.0, 1.0, 2.0, 2.0, 2.0)


@dataclass
class GRPOConfig:
    """Every knob of a GRPO run; defaults are the chapter 7 recipe for the bundled tiny model.

    Searched on the arithmetic val split (200 problems, greedy strict accuracy 0.255 before
    training; the table is in the README): 16 prompts x 8 rollouts per step beat 8 x 16 and 8 x 8,
    lr 1e-4 matched 2e-4 with less drift, and training problems weighted towards levels 3-5
    (DEFAULT_TRAIN_LEVEL_WEIGHTS) raised accuracy among think answers and step correctness where
    uniform levels left them flat. 112 new tokens fit the longest (level 5) solutions. For
    Qwen3-0.6B on MATH use the flags in chapters/ch07_train.py's docstring (lr ~1e-6, longer
    completions, micro-batches).
    """

    # optimisation (AdamW, linear warmup then constant learning rate, grad-norm clipping)
    steps: int = 150
    lr: float = 1e-4
    warmup_steps: int = 5
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    # rollouts
    prompts_per_step: int = 16
    num_rollouts: int = 8  # G: completions per prompt, one group
    max_new_tokens: int = 112
    temperature: float = 1.0
    top_p: float = 1.0
    # rewards: correctness + format_reward_weight x think format (only if correct when
    # format_reward_conditional)
    format_reward_weight: float = 0.5
    format_reward_conditional: bool = True
    # advantages
    scale_rewards: str = "group"  # "group" | "batch" | "none" (Dr. GRPO)
    skip_zero_advantage: bool = True  # drop groups whose rewards are all equal
    supervision: str = "outcome"  # "outcome" | "process" (DeepSeekMath 4.1.3, see process.py)
    step_scorer: str = "verifier"  # process: verifier | verifier-signed | mc | mc-hard | prm:PATH
    process_variant: str = "sum"  # process: sum | process+outcome | min (PURE) | position
    step_split: str = "tags"  # process: how completions split into steps
    mc_rollouts: int = 4  # process, step_scorer mc: continuations sampled per step prefix
    # loss
    loss_type: str = "grpo"  # "grpo" | "dapo" | "dr_grpo" | "sequence"
    epsilon: float | None = 0.2  # None: no clipping (chapter 6)
    epsilon_high: float | None = None  # DAPO clip-higher; None = epsilon
    beta: float = 0.0  # KL weight; 0 keeps no reference model in memory
    entropy_coef: float = 0.0
    mask_truncated: bool = False  # DAPO overlong filtering
    inner_epochs: int = 1  # PPO-style updates per batch of rollouts
    micro_batch_size: int | None = None  # rollouts per forward/backward (None = all at once)
    chunk_size: int = 1024  # answer positions per lm_head chunk
    # evaluation, logging, checkpoints
    eval_every: int = 25  # 0: only before and after training
    eval_examples: int = 200  # held-out examples used (the first N of eval_examples)
    eval_max_new_tokens: int | None = None  # None = max_new_tokens
    eval_batch_size: int = 50
    sample_every: int = 10  # write the step's completions to samples.jsonl every N steps
    checkpoint_every: int = 0  # 0: only the final checkpoint (and on Ctrl-C)
    seed: int = 123
    output_dir: str = "runs/grpo"
    progress: bool = True

    def __post_init__(self):
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}")
        if self.scale_rewards not in SCALE_REWARDS:
            raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, "
                             f"got {self.scale_rewards!r}")
        if self.supervision not in ("outcome", "process"):
            raise ValueError(f"supervision must be 'outcome' or 'process', "
                             f"got {self.supervision!r}")
        if self.num_rollouts < 2:
            raise ValueError("num_rollouts must be >= 2: advantages compare rollouts of a group")
        for name in ("steps", "prompts_per_step", "inner_epochs", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @classmethod
    def from_dict(cls, d: dict) -> GRPOConfig:
        """Config from a dict, ignoring unknown keys (e.g. a trainer_state.json of a newer run)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


# ----------------------------------------------------------------------------------------------
# Small pieces
# ----------------------------------------------------------------------------------------------

def lr_at_step(step, config):
    """Linear warmup over `warmup_steps` (step 0 gets lr / warmup), then constant."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    return config.lr


def step_prompts(examples, step, config):
    """The prompts of a step: a seeded reshuffle every epoch, so a step's prompts never depend on
    how the run got there (resume needs no data-loader state)."""
    n, k = len(examples), config.prompts_per_step
    first = step * k
    out = []
    for pos in range(first, first + k):
        epoch, idx = divmod(pos, n)
        g = torch.Generator().manual_seed(config.seed * 1_000_003 + epoch)
        out.append(examples[int(torch.randperm(n, generator=g)[idx])])
    return out


def rollout_generator(device, seed, step):
    """Per-step sampling generator: step s samples the same rollouts however the run got there."""
    dev = torch.device(device)
    gen = torch.Generator(device=dev if dev.type == "cuda" else "cpu")
    return gen.manual_seed(seed * 1_000_003 + 7_919 * step + 1)


def micro_batch_weight(mb, batch, loss_type):
    """Scale of a micro-batch's loss so the accumulated gradient equals the full batch's."""
    if loss_type == "dapo":  # token mean over the whole batch
        return float(mb.completion_mask.sum()) / max(1, float(batch.completion_mask.sum()))
    return mb.size / batch.size  # per-sequence means and dr_grpo's constant divisor


def rollout_metrics(batch: RolloutBatch, reward_names):
    """Reward, advantage and length statistics of a step's rollouts (all groups)."""
    r = batch.rewards.flatten()
    adv = torch.tensor([s["advantage"] for s in batch.samples])
    lengths = torch.tensor([s["length"] for s in batch.samples], dtype=torch.float32)
    out = {
        "reward_mean": r.mean().item(), "reward_std": r.std().item() if r.numel() > 1 else 0.0,
        "adv_mean": adv.mean().item(), "adv_std": adv.std().item() if adv.numel() > 1 else 0.0,
        "zero_adv_frac": batch.zero_adv_frac,
        "len_mean": lengths.mean().item(), "len_max": lengths.max().item(),
        "truncated_frac": sum(s["truncated"] for s in batch.samples) / len(batch.samples),
    }
    for name in reward_names:
        out[f"{name}_mean"] = sum(s.get(name, 0.0) for s in batch.samples) / len(batch.samples)
    return out


class MetricsLog:
    """metrics.csv, one row per step; rows past a resumed step are dropped on resume."""

    def __init__(self, path: Path, columns, keep_upto: int | None = None):
        self.path, self.columns = path, list(columns)
        rows = []
        if keep_upto is not None and path.exists():
            with open(path, newline="") as f:
                rows = [r for r in csv.DictReader(f) if int(r["step"]) <= keep_upto]
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self.columns)
            writer.writeheader()
            writer.writerows(rows)

    def append(self, row: dict):
        with open(self.path, "a", newline="") as f:
            csv.DictWriter(f, fieldnames=self.columns).writerow(
                {k: _fmt(row.get(k, "")) for k in self.columns})


def _fmt(v):
    """CSV cell: floats with 6 significant digits, the rest as is."""
    return f"{v:.6g}" if isinstance(v, float) else v


def read_metrics(path) -> list[dict]:
    """Rows of a metrics.csv as dicts of floats (empty cells become None)."""
    with open(path, newline="") as f:
        return [{k: (float(v) if v not in ("", None) else None) for k, v in row.items()}
                for row in csv.DictReader(f)]


# ----------------------------------------------------------------------------------------------
# Checkpoints (safetensors + JSON, no pickles)
# ----------------------------------------------------------------------------------------------

def _optimizer_to_flat(optimizer):
    """AdamW state -> ({"state.<param>.<key>": tensor}, JSON-able structure)."""
    sd = optimizer.state_dict()
    tensors, structure = {}, {"param_groups": sd["param_groups"], "state": {}}
    for pid, state in sd["state"].items():
        entry = {}
        for key, value in state.items():
            if torch.is_tensor(value):
                tensors[f"state.{pid}.{key}"] = value
                entry[key] = {"tensor": f"state.{pid}.{key}"}
            else:
                entry[key] = {"value": value}
        structure["state"][str(pid)] = entry
    return tensors, structure


def _optimizer_from_flat(tensors, structure):
    """Inverse of `_optimizer_to_flat`: a state dict for `optimizer.load_state_dict`."""
    state = {
        int(pid): {k: (tensors[v["tensor"]] if "tensor" in v else v["value"])
                   for k, v in entry.items()}
        for pid, entry in structure["state"].items()
    }
    return {"state": state, "param_groups": structure["param_groups"]}


def _rng_tensors():
    """Global RNG states (torch CPU, CUDA, Python) as uint8 tensors."""
    out = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            out[f"torch_cuda_{i}"] = s
    py = json.dumps(random.getstate()).encode()
    out["python"] = torch.frombuffer(bytearray(py), dtype=torch.uint8)
    return out


def _restore_rng(tensors):
    torch.set_rng_state(tensors["torch_cpu"])
    cuda = [tensors[k] for k in sorted(tensors) if k.startswith("torch_cuda_")]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    state = json.loads(bytes(tensors["python"].tolist()).decode())
    random.setstate((state[0], tuple(state[1]), state[2]))


def save_checkpoint(out_dir, model, tokenizer, optimizer, step, config, extra=None) -> Path:
    """Write a resumable checkpoint directory atomically (temp dir, then rename)."""
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_pretrained(model, tokenizer, tmp)  # HF layout: load_pretrained(out_dir) works
    tensors, structure = _optimizer_to_flat(optimizer)
    atomic_save_safetensors(tensors, tmp / "optimizer.safetensors")
    atomic_save_safetensors(_rng_tensors(), tmp / "rng.safetensors")
    atomic_write_json(tmp / "trainer_state.json", {
        "step": step, "config": asdict(config), "optimizer": structure, **(extra or {}),
    })
    if out_dir.exists():
        old = out_dir.with_name(out_dir.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        out_dir.rename(old)
        tmp.rename(out_dir)
        shutil.rmtree(old)
    else:
        tmp.rename(out_dir)
    return out_dir


def find_checkpoint(path) -> Path:
    """`path` if it is a checkpoint, else the one with the most steps inside run dir `path`."""
    path = Path(path)
    if (path / "trainer_state.json").is_file():
        return path
    found = [p for p in [*path.glob("checkpoint-*"), path / "final"]
             if (p / "trainer_state.json").is_file()]
    if not found:
        raise FileNotFoundError(f"no checkpoint (trainer_state.json) in {path} "
                                f"or in its checkpoint-*/final dirs")
    return max(found, key=lambda p: json.loads((p / "trainer_state.json").read_text())["step"])


def load_checkpoint(path, model, optimizer) -> dict:
    """Load weights, optimizer and RNG states of a checkpoint in place; returns trainer_state."""
    path = find_checkpoint(path)
    state = json.loads((path / "trainer_state.json").read_text())
    _load_weights(model, path)
    opt_tensors = load_file(str(path / "optimizer.safetensors"), device=str(model.device))
    optimizer.load_state_dict(_optimizer_from_flat(opt_tensors, state["optimizer"]))
    _restore_rng(load_file(str(path / "rng.safetensors")))
    return state


def _load_weights(model, model_dir):
    """Copy a HF-layout checkpoint's tensors into `model` (tied lm_head may be absent)."""
    sd = load_hf_state_dict(model_dir, device=model.device, dtype=model.dtype)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    missing = [k for k in missing if not (tied and k == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"{model_dir}: missing tensors {missing}, unexpected {unexpected}")


# ----------------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------------

def _evaluate(model, tokenizer, examples, device, config, prompt_fn):
    """Greedy held-out figures: strict accuracy, think-format rate, accuracy among think answers,
    verifier step correctness, right answer with a wrong step, accuracy per level."""
    res = evaluate(model, tokenizer, examples, device,
                   max_new_tokens=config.eval_max_new_tokens or config.max_new_tokens,
                   batch_size=config.eval_batch_size, prompt_fn=prompt_fn, progress=False)
    # str keys: the same dict before and after a JSON round trip (checkpoints, summary.json)
    return {**{k: res[k] for k in EVAL_FIGURES},
            "per_level": {str(k): v for k, v in res["per_level"].items()}}


def _eval_row(figures):
    """The metrics.csv cells of an evaluation (None figures stay empty)."""
    return {col: figures[k] for k, col in EVAL_COLUMNS.items() if figures.get(k) is not None}


def _update(model, optimizer, batch, old_logp, ref_logp, config):
    """One optimizer step on a batch (micro-batched); returns loss stats; skips non-finite ones."""
    optimizer.zero_grad(set_to_none=True)
    mbs = config.micro_batch_size or batch.size
    sums, finite = {}, True
    for start in range(0, batch.size, mbs):
        mb = batch.slice(start, start + mbs)
        w = micro_batch_weight(mb, batch, config.loss_type)
        sl = slice(start, start + mbs)
        out = grpo_loss_on_batch(
            model, mb, None if old_logp is None else old_logp[sl],
            None if ref_logp is None else ref_logp[sl], config.loss_type, config.epsilon,
            config.epsilon_high, config.beta, config.entropy_coef, config.max_new_tokens,
            config.chunk_size,
        )
        loss = out.pop("loss")
        if not torch.isfinite(loss):
            finite = False
            break
        (loss * w).backward()
        sums["loss"] = sums.get("loss", 0.0) + loss.item() * w
        for k in ("pg_loss", "kl", "entropy", "ratio_mean", "clip_frac_low", "clip_frac_high"):
            sums[k] = sums.get(k, 0.0) + out[k] * w
        sums["ratio_max"] = max(sums.get("ratio_max", -math.inf), out["ratio_max"])
    grad_norm = float("nan")
    if finite:
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                         config.max_grad_norm))
        finite = math.isfinite(grad_norm)
    if finite:
        optimizer.step()
    else:  # never let a NaN/inf reach the weights or the AdamW moments
        optimizer.zero_grad(set_to_none=True)
        sums.setdefault("loss", float("nan"))
    return {**sums, "grad_norm": grad_norm, "skipped": int(not finite)}


def train_grpo(model, tokenizer, train_examples, eval_examples, device, config: GRPOConfig,
               resume_from=None, reward_fn=None, advantage_fn: Callable | None = None,
               prompt_fn=render_prompt) -> dict:
    """Train `model` with GRPO on `train_examples`; returns the summary dict (also summary.json).

    reward_fn(text, token_ids, prompt_len, example) -> (total, components); default
    `build_reward(tokenizer, format_reward_weight, format_reward_conditional)`.
    advantage_fn: token-level advantages for config.supervision == "process" (see
    `grpo.collect_rollouts`). resume_from: a checkpoint dir or a run dir (latest checkpoint) to
    continue exactly where it stopped. Ctrl-C saves a checkpoint before re-raising.
    """
    if config.supervision == "process" and advantage_fn is None:
        advantage_fn = make_process_advantage_fn(
            tokenizer, config.step_scorer, config.process_variant, config.step_split,
            model=model, device=device, mc_rollouts=config.mc_rollouts,
            mc_max_new_tokens=config.max_new_tokens, mc_temperature=config.temperature,
        )
    t_start = time.time()
    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if reward_fn is None:
        reward_fn = build_reward(tokenizer, config.format_reward_weight,
                                 config.format_reward_conditional)
    reward_names = getattr(reward_fn, "names", ["correct", "format"])
    columns = METRIC_COLUMNS + [f"{n}_mean" for n in reward_names
                                if f"{n}_mean" not in METRIC_COLUMNS]
    eval_set = list(eval_examples)[:config.eval_examples]

    torch.manual_seed(config.seed)
    random.seed(config.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr,
                                  weight_decay=config.weight_decay)
    start_step, state = 0, {}
    if resume_from is not None:
        state = load_checkpoint(resume_from, model, optimizer)
        start_step = state["step"]
    ref_model = _reference_model(model, tokenizer, out, config, resumed=resume_from is not None)

    log = MetricsLog(out / "metrics.csv", columns,
                     keep_upto=start_step if resume_from is not None else None)
    if resume_from is None:
        (out / "samples.jsonl").write_text("")
        atomic_write_json(out / "config.json", asdict(config))
    else:
        _truncate_samples(out / "samples.jsonl", start_step)

    base = state.get("base")
    if base is None:
        base = _evaluate(model, tokenizer, eval_set, device, config, prompt_fn)
        _print(config, f"base model: held-out {_eval_line(base)} ({len(eval_set)} examples)")
    last_eval = state.get("last_eval", base)

    def checkpoint(step, name=None):
        save_checkpoint(out / (name or f"checkpoint-{step}"), model, tokenizer, optimizer, step,
                        config, {"base": base, "last_eval": last_eval})

    step = start_step
    bar = tqdm(range(start_step, config.steps), desc="grpo", disable=not config.progress,
               initial=start_step, total=config.steps)
    try:
        for step in bar:
            row = _train_step(model, tokenizer, train_examples, device, config, optimizer,
                              ref_model, reward_fn, reward_names, advantage_fn, prompt_fn, step,
                              out)
            done = step + 1
            if config.eval_every and done % config.eval_every == 0 and done < config.steps:
                last_eval = _evaluate(model, tokenizer, eval_set, device, config, prompt_fn)
                row.update(_eval_row(last_eval))
            log.append(row)
            bar.set_postfix(reward=f"{row['reward_mean']:.2f}",
                            correct=f"{row.get('correct_mean', 0):.2f}",
                            acc=f"{last_eval['accuracy']:.2f}")
            _print(config, _row_line(row))
            if config.checkpoint_every and done % config.checkpoint_every == 0:
                checkpoint(done)
            step = done
    except KeyboardInterrupt:
        checkpoint(step)
        _print(config, f"interrupted: checkpoint saved to {out / f'checkpoint-{step}'}")
        raise
    bar.close()

    final = last_eval = _evaluate(model, tokenizer, eval_set, device, config, prompt_fn)
    _patch_last_row(out / "metrics.csv", columns, _eval_row(final))
    checkpoint(config.steps, "final")
    summary = {
        **{f"{when}_{k}": figures.get(k)
           for k in EVAL_FIGURES for when, figures in (("base", base), ("final", final))},
        "per_level": {lv: {"base": base.get("per_level", {}).get(lv), "final": acc}
                      for lv, acc in final["per_level"].items()},
        "steps": config.steps, "wall_seconds": time.time() - t_start,
        "eval_examples": len(eval_set), "output_dir": str(out),
    }
    atomic_write_json(out / "summary.json", summary)
    plot_grpo_metrics(out / "metrics.csv", PLOT_COLUMNS, save_as=out / "metrics.png")
    _print(config, f"held-out before: {_eval_line(base)}\nheld-out after:  {_eval_line(final)}\n"
                   f"wrote {out}")
    return summary


def _reference_model(model, tokenizer, out, config, resumed):
    """Frozen copy of the starting policy, only when beta > 0; kept on disk for exact resumes."""
    if not config.beta:
        return None
    ref = copy.deepcopy(model).eval()
    ref.requires_grad_(False)
    if resumed:
        _load_weights(ref, out / "reference")
    else:
        save_pretrained(ref, tokenizer, out / "reference")
    return ref


def _train_step(model, tokenizer, examples, device, config, optimizer, ref_model, reward_fn,
                reward_names, advantage_fn, prompt_fn, step, out):
    """Rollouts, scoring and `inner_epochs` updates of one step; returns the metrics row."""
    t0 = time.time()
    scorer_tokens_before = _scorer_tokens(advantage_fn)
    batch = collect_rollouts(
        model, tokenizer, step_prompts(examples, step, config), device, reward_fn,
        config.num_rollouts, config.max_new_tokens, config.temperature, config.top_p,
        rollout_generator(device, config.seed, step), config.scale_rewards,
        config.skip_zero_advantage, config.mask_truncated, prompt_fn, advantage_fn,
    )
    t1 = time.time()
    lr = lr_at_step(step, config)
    for group in optimizer.param_groups:
        group["lr"] = lr
    row = {"step": step + 1, "lr": lr, **rollout_metrics(batch, reward_names)}
    if batch.size:
        with torch.no_grad():
            ref_logp = old_logp = None
            if ref_model is not None:
                ref_logp = _logprobs_no_grad(ref_model, batch, config)
            if config.inner_epochs > 1:  # the sampling policy's log-probs, computed once
                old_logp = _logprobs_no_grad(model, batch, config)
        model.train()
        epochs = [_update(model, optimizer, batch, old_logp, ref_logp, config)
                  for _ in range(config.inner_epochs)]
        model.eval()
        for k in epochs[0]:
            vals = [e[k] for e in epochs]
            row[k] = max(vals) if k in ("ratio_max", "skipped") else sum(vals) / len(vals)
        if row["skipped"]:
            _print(config, f"step {step + 1}: non-finite loss or gradient, update skipped")
    else:  # every group had equal rewards: nothing to learn from, no update
        row.update(loss=0.0, pg_loss=0.0, kl=0.0, skipped=0)
    t2 = time.time()
    row.update(rollout_s=t1 - t0, update_s=t2 - t1, step_time=t2 - t0,
               tokens_per_s=batch.num_generated_tokens / max(t2 - t0, 1e-9),
               gen_tokens=batch.num_generated_tokens,
               scorer_tokens=_scorer_tokens(advantage_fn) - scorer_tokens_before)
    if config.sample_every and (step + 1) % config.sample_every == 0:
        with open(out / "samples.jsonl", "a", encoding="utf-8") as f:
            for s in batch.samples:
                f.write(json.dumps({"step": step + 1, **s}, ensure_ascii=False) + "\n")
    return row


def _scorer_tokens(advantage_fn):
    """Tokens generated so far by a process step scorer (Monte-Carlo continuations); 0 if free."""
    scorer = getattr(advantage_fn, "step_scorer", None)
    cost = scorer.cost() if scorer is not None and hasattr(scorer, "cost") else {}
    return int(cost.get("mc_generated_tokens", 0))


def _logprobs_no_grad(model, batch, config):
    """Per-token log-probs (B, Tc) of a whole batch, micro-batched, without gradients."""
    mbs = config.micro_batch_size or batch.size
    parts = [batch_logprobs(model, batch.slice(s, s + mbs), config.chunk_size, False)[0]
             for s in range(0, batch.size, mbs)]
    return torch.cat(parts)


def _patch_last_row(path, columns, cells):
    """Put the final evaluation into the last metrics row (the plot shows it as the last bar)."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if rows:
        rows[-1].update({k: _fmt(v) for k, v in cells.items()})
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns)
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_text(path, buf.getvalue())


def _truncate_samples(path, last_step):
    """Drop samples.jsonl lines of steps after `last_step` (written after the checkpoint)."""
    if path.exists():
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
        atomic_write_text(path, "".join(ln for ln in lines if json.loads(ln)["step"] <= last_step))


def _row_line(row):
    """One printed line per step."""
    keys = [("reward_mean", "reward"), ("correct_mean", "correct"), ("format_mean", "format"),
            ("loss", "loss"), ("kl", "kl"), ("entropy", "entropy"), ("len_mean", "len"),
            ("zero_adv_frac", "zero_adv"), ("step_time", "s")]
    parts = [f"step {row['step']}"] + [f"{name} {row[k]:.3f}" for k, name in keys
                                       if isinstance(row.get(k), float)]
    if "eval_accuracy" in row:
        parts.append(f"EVAL acc {row['eval_accuracy']:.3f} format {row['eval_format_rate']:.3f}")
    return " | ".join(parts)


def _eval_line(figures):
    """One line of evaluation figures (accuracy, format, think accuracy, step correctness)."""
    def f(v):
        return "n/a" if v is None else f"{v:.3f}"
    return (f"accuracy {f(figures.get('accuracy'))}, format rate "
            f"{f(figures.get('format_rate'))}, accuracy in think format "
            f"{f(figures.get('think_accuracy'))}, step correctness "
            f"{f(figures.get('step_correctness'))}")


def _print(config, msg):
    if config.progress:
        tqdm.write(msg)


# ----------------------------------------------------------------------------------------------
# Command line (shared by chapters/ch06_train.py and chapters/ch07_train.py)
# ----------------------------------------------------------------------------------------------

CONFIG_HELP = {
    "steps": "optimizer steps (each: rollouts for prompts-per-step prompts, then the update(s))",
    "lr": "peak AdamW learning rate",
    "warmup_steps": "steps of linear learning-rate warmup from lr/warmup to lr",
    "weight_decay": "AdamW weight decay",
    "max_grad_norm": "clip the gradient norm to this value",
    "prompts_per_step": "training prompts per optimizer step",
    "num_rollouts": "G: sampled completions per prompt (one group)",
    "max_new_tokens": "maximum generated tokens per rollout",
    "temperature": "rollout sampling temperature",
    "top_p": "rollout nucleus-sampling threshold",
    "format_reward_weight": "weight of the <think>...</think> format reward (0: correctness only)",
    "format_reward_conditional": "pay the format reward only for correct answers",
    "scale_rewards": "advantage scaling: group std (GRPO), batch std, or none (Dr. GRPO)",
    "skip_zero_advantage": "drop groups whose rewards are all equal (no learning signal)",
    "supervision": "outcome (one reward per completion) or process (a reward per reasoning "
                   "step, DeepSeekMath-style token advantages)",
    "step_scorer": "process supervision step scorer: verifier | verifier-signed | mc | mc-hard | "
                   "prm:PATH",
    "process_variant": "process advantage: sum (DeepSeekMath) | process+outcome | min (PURE) | "
                       "position",
    "step_split": "how completions are split into steps: tags | newlines | blank_lines",
    "mc_rollouts": "Monte-Carlo continuations per step prefix (step-scorer mc)",
    "loss_type": "grpo: per-sequence token mean; dapo: batch token mean; dr_grpo: sum/(B*max "
                 "tokens); sequence: the book's summed log-prob ratio",
    "epsilon": "PPO clip range: ratio clipped to [1-epsilon, 1+epsilon_high] ('none': no clip)",
    "epsilon_high": "upper clip range (DAPO clip-higher; 'none': same as epsilon)",
    "beta": "weight of the k3 KL penalty to the frozen starting model (0: no reference model)",
    "entropy_coef": "entropy bonus coefficient",
    "mask_truncated": "leave completions cut off at max-new-tokens out of the loss (DAPO)",
    "inner_epochs": "updates per batch of rollouts (PPO-style; >1 makes the ratio leave 1)",
    "micro_batch_size": "rollouts per forward/backward pass ('none': the whole batch)",
    "chunk_size": "answer positions per lm_head chunk in the log-prob pass (memory bound)",
    "eval_every": "evaluate on the held-out set every N steps (0: only before and after)",
    "eval_examples": "number of held-out examples for evaluation",
    "eval_max_new_tokens": "max generated tokens in evaluation ('none': max-new-tokens)",
    "eval_batch_size": "prompts per batch in evaluation",
    "sample_every": "append the step's completions to samples.jsonl every N steps (0: never)",
    "checkpoint_every": "save a resumable checkpoint every N steps (0: only the final one)",
    "seed": "random seed (prompt order, rollout sampling)",
    "output_dir": "run directory for metrics, samples, checkpoints, summary and plot",
    "progress": "show the progress bar and per-step lines",
}


def _optional(kind):
    """argparse type accepting 'none' for None."""
    def parse(text):
        return None if text.lower() == "none" else kind(text)
    parse.__name__ = kind.__name__
    return parse


def add_config_arguments(parser, defaults: GRPOConfig):
    """One `--dashed-flag` per GRPOConfig field, with help text and the given defaults."""
    hints = {"epsilon": float, "epsilon_high": float, "micro_batch_size": int,
             "eval_max_new_tokens": int}
    for f in fields(GRPOConfig):
        if f.name == "output_dir":
            continue  # the scripts add it with a timestamped default
        flag, default = "--" + f.name.replace("_", "-"), getattr(defaults, f.name)
        if isinstance(default, bool):
            parser.add_argument(flag, default=default, action=argparse.BooleanOptionalAction,
                                help=CONFIG_HELP[f.name])
        elif f.name in hints:
            parser.add_argument(flag, type=_optional(hints[f.name]), default=default,
                                help=CONFIG_HELP[f.name])
        else:
            choices = {"loss_type": LOSS_TYPES, "scale_rewards": SCALE_REWARDS,
                       "supervision": ("outcome", "process"), "process_variant": VARIANTS,
                       "step_split": ("tags", "newlines", "blank_lines")}.get(f.name)
            parser.add_argument(flag, type=type(default), default=default, choices=choices,
                                help=CONFIG_HELP[f.name])


def add_data_arguments(parser):
    """--eval-split, --train-examples and --train-level-weights (saved in data.json)."""
    parser.add_argument("--eval-split", default="test",
                        help="held-out split for arith (val for tuning, test for reporting)")
    parser.add_argument("--train-examples", type=int, default=None,
                        help="use the first N training problems (None: the whole split)")
    parser.add_argument("--train-level-weights", type=parse_level_weights,
                        default=DEFAULT_TRAIN_LEVEL_WEIGHTS,
                        help="arith: mix of difficulty levels 1-5 in the training problems, five "
                             "comma-separated weights such as 1,1,2,2,2 ('none': uniform, like "
                             "the held-out splits)")


def build_parser(description, defaults: GRPOConfig, run_prefix):
    """The chapter scripts' parser: model, data, device, resume, and every GRPOConfig field."""
    from .datasets import DATASET_NAMES

    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="tiny-arith",
                   help="bundled model name, local Hugging Face-layout directory or hub repo id")
    p.add_argument("--dataset", default="arith", choices=DATASET_NAMES,
                   help="arith: train on the train split, evaluate on --eval-split; math: MATH "
                        "train / MATH-500; gsm8k: train / test")
    add_data_arguments(p)
    p.add_argument("--output-dir", default=None,
                   help=f"run directory (None: runs/{run_prefix}-<timestamp>)")
    p.add_argument("--resume", default=None,
                   help="checkpoint or run directory to continue exactly (takes its settings and "
                        "data flags; flags given explicitly override them, e.g. --steps)")
    p.add_argument("--device", default=None, help="cuda, mps or cpu (None: the best available)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="model dtype for training (float32 keeps small AdamW updates exact)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (0: torch's default). One thread is fastest for the "
                        "tiny model, whose matrices are too small to split, and it stays fast on "
                        "a busy machine, where spinning worker threads of several processes "
                        "slowed a rollout batch 90-fold in our measurements")
    add_config_arguments(p, defaults)
    return p


def parse_level_weights(text):
    """argparse type: 'none' or five non-negative comma-separated weights, not all zero."""
    if text.lower() == "none":
        return None
    try:
        weights = [float(w) for w in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected five comma-separated numbers, got {text!r}") from None
    if len(weights) != 5 or any(not math.isfinite(w) or w < 0 for w in weights) \
            or not sum(weights):
        raise argparse.ArgumentTypeError(f"expected five non-negative weights (levels 1-5), "
                                         f"not all zero, got {text!r}")
    return weights


def load_grpo_data(dataset, train_examples=None, eval_split="test", eval_examples=None,
                   train_level_weights=None):
    """(train, held-out) example lists for a dataset name."""
    from .datasets import load_dataset_by_name

    if train_level_weights is not None and dataset != "arith":
        raise ValueError("--train-level-weights applies to the arith dataset only")
    if dataset == "arith":
        train = load_dataset_by_name("arith", "train", n=train_examples,
                                     level_weights=train_level_weights)
        held_out = load_dataset_by_name("arith", eval_split, n=eval_examples)
    elif dataset in ("math", "math500"):
        train = load_dataset_by_name("math", n=train_examples)
        held_out = load_dataset_by_name("math500", n=eval_examples)
    else:
        train = load_dataset_by_name(dataset, "train", n=train_examples)
        held_out = load_dataset_by_name(dataset, "test", n=eval_examples)
    return train, held_out


# saved in data.json, reused on resume
DATA_FLAGS = ("dataset", "eval_split", "train_examples", "train_level_weights")


def run_cli(argv, description, defaults: GRPOConfig, run_prefix):
    """Parse flags, load model and data, and run `train_grpo`; returns the summary."""
    from .device import get_device
    from .weights import load_pretrained

    parser = build_parser(description, defaults, run_prefix)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    values = {f.name: getattr(args, f.name) for f in fields(GRPOConfig) if f.name != "output_dir"}
    data = {k: getattr(args, k) for k in DATA_FLAGS}
    model_source, ckpt = args.model, None
    if args.resume:  # the run's own settings, except flags given explicitly now
        ckpt = find_checkpoint(args.resume)
        explicit = _explicit_flags(argv)
        saved = json.loads((ckpt / "trainer_state.json").read_text())["config"]
        values = {**saved, **{k: v for k, v in values.items() if k in explicit}}
        values["output_dir"] = args.output_dir or saved["output_dir"]
        saved_data = ckpt.parent / "data.json"
        if saved_data.is_file():
            data = {**json.loads(saved_data.read_text()),
                    **{k: v for k, v in data.items() if k in explicit}}
        model_source = ckpt
    else:
        values["output_dir"] = args.output_dir or time.strftime(f"runs/{run_prefix}-%Y%m%d-%H%M%S")
    if data["dataset"] != "arith" and "train_level_weights" not in _explicit_flags(argv):
        data["train_level_weights"] = None  # the level mix is the arithmetic world's default
    config = GRPOConfig.from_dict(values)
    Path(config.output_dir).mkdir(parents=True, exist_ok=True)
    atomic_write_json(Path(config.output_dir) / "data.json", data)
    device = get_device(args.device)
    model, tokenizer = load_pretrained(model_source, device=device,
                                       dtype=getattr(torch, args.dtype))
    train, held_out = load_grpo_data(data["dataset"], data["train_examples"], data["eval_split"],
                                     config.eval_examples, data.get("train_level_weights"))
    print(f"model {model_source} on {device}; {len(train)} training problems, {len(held_out)} "
          f"held-out ({data['dataset']}); run dir {config.output_dir}")
    summary = train_grpo(model, tokenizer, train, held_out, device, config, resume_from=ckpt)
    print(json.dumps(summary, indent=2))
    return summary


def _explicit_flags(argv):
    """Config field names whose flags appear on the command line (to override a resumed run)."""
    given = set()
    for arg in (argv if argv is not None else sys.argv[1:]):
        if arg.startswith("--"):
            name = arg[2:].split("=")[0].replace("-", "_")
            given.add(name[3:] if name.startswith("no_") else name)
    return given
