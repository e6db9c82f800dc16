"""A learned process reward model (PRM): a Qwen3 backbone with a scalar head read at step ends.

The PRM reads `prompt + step_1 + ... + step_n` once and outputs a logit at every token; the
logit at the *last token of step j* is its estimate of "step j is correct" (Lightman et al. 2023,
"Let's Verify Step by Step", arXiv 2305.20050; Math-Shepherd, arXiv 2312.08935). It is trained
with binary cross-entropy on step labels in the stepwise format used by PRM800K / Math-Shepherd
style datasets:

    {"prompt": str, "completions": [step texts], "labels": [bool, ...]}

The step texts are concatenated as they are (pieces from `process.split_steps` keep their own
line breaks), and each step's last token is found with the tokenizer's character offsets, the
same mapping the training path uses (`process.step_token_ends`).

Files: `save_prm(prm, tokenizer, dir)` writes the backbone in the Hugging Face layout
(`weights.save_pretrained`: config.json, model.safetensors, tokenizer files) plus
`prm_head.safetensors` and `prm_config.json`; `load_prm(dir)` reads them back.
`make_prm_dataset` builds stepwise records by sampling completions from a policy and labelling
their steps with a step scorer (the exact verifier or Monte-Carlo rollouts);
`train_prm_on_arithmetic` runs the whole recipe on the tiny arithmetic world (sample, label, train,
evaluate on held-out steps, save), for `chapters/ch08_train_prm.py` and the chapter 8 experiment.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from .arithmetic import make_split
from .files import atomic_save_safetensors, atomic_write_json, read_json
from .interrupts import defer_interrupts, stop_signals_raise
from .process import split_steps, step_texts, token_step_owners
from .prompts import render_prompt
from .qwen3 import Qwen3Config, Qwen3Model
from .step_scorers import (
    MonteCarloStepScorer,
    StepScorer,
    VerifierStepScorer,
    as_step_scorer,
    sample_continuations,
)
from .tokenizer import pad_id_of
from .tracking import RunTracker, open_tracker
from .weights import load_pretrained, read_safetensors, save_pretrained

HEAD_FILE = "prm_head.safetensors"
CONFIG_FILE = "prm_config.json"


class ProcessRewardModel(nn.Module):
    """Qwen3 backbone + linear head: a correctness logit at every position (B, T)."""

    def __init__(self, cfg: Qwen3Config | None = None, backbone: Qwen3Model | None = None):
        super().__init__()
        if backbone is None:
            if cfg is None:
                raise ValueError("ProcessRewardModel needs a Qwen3Config or a backbone")
            backbone = Qwen3Model(cfg)
        self.backbone = backbone
        self.cfg = backbone.cfg
        # The head is float32 whatever the backbone's dtype: a single logit per position, where
        # bfloat16 rounding would be visible in the probabilities.
        self.score_head = nn.Linear(self.cfg.hidden_size, 1, dtype=torch.float32)
        nn.init.normal_(self.score_head.weight, std=0.02)
        nn.init.zeros_(self.score_head.bias)

    @classmethod
    def from_pretrained_backbone(cls, model: Qwen3Model) -> ProcessRewardModel:
        """A PRM whose backbone starts from a (copy of a) language model's weights."""
        import copy

        return cls(backbone=copy.deepcopy(model))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
        """Step-correctness logits (B, T), float32, for every token of `input_ids` (B, T)."""
        h = self.backbone.forward_hidden(input_ids, attention_mask)  # (B, T, C)
        return self.score_head(h.float()).squeeze(-1)  # (B, T)


# ----------------------------------------------------------------------------------------------
# Encoding stepwise records
# ----------------------------------------------------------------------------------------------


def encode_steps(tokenizer, prompt: str, steps: Sequence[str]) -> tuple[list[int], list[int]]:
    """Token ids of `prompt + "".join(steps)` and the index of each step's last token.

    Tokens are assigned to steps by their first character (see `process.step_token_ends`). A step
    with no token of its own (all inside a token that started earlier) is read at the previous
    step's position.
    """
    text = prompt + "".join(steps)
    ids, offsets = tokenizer.encode_with_offsets(text)
    spans, pos = [(0, len(prompt))], len(prompt)
    for s in steps:
        spans.append((pos, pos + len(s)))
        pos += len(s)
    # Only non-empty spans take part in the mapping (empty ones would own nothing anyway).
    keep = [j for j, (s, e) in enumerate(spans) if e > s or j == 0]
    owners = token_step_owners(offsets, [spans[j] for j in keep]) if ids else []
    last_of = {}
    for k, o in enumerate(owners):
        last_of[keep[o]] = k
    ends, prev = [], last_of.get(0, 0)
    for j in range(1, len(spans)):
        prev = last_of.get(j, prev)
        ends.append(prev)
    return list(ids), ends


def _collate(encoded, pad_id: int):
    """Right-pad (ids, ends) pairs. Right padding needs no attention mask: causal attention never
    looks at the padding after a real token, and positions still count from 0."""
    T = max(len(ids) for ids, _ in encoded)
    input_ids = torch.full((len(encoded), T), pad_id, dtype=torch.long)
    for i, (ids, _) in enumerate(encoded):
        input_ids[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    rows = torch.tensor([i for i, (_, ends) in enumerate(encoded) for _ in ends], dtype=torch.long)
    cols = torch.tensor([e for _, ends in encoded for e in ends], dtype=torch.long)
    return input_ids, rows, cols


def _check_record(i: int, rec: dict) -> None:
    """A stepwise record needs a prompt, step texts and one bool label per step."""
    for key in ("prompt", "completions", "labels"):
        if key not in rec:
            raise ValueError(f"PRM record {i}: missing key {key!r} (have {sorted(rec)})")
    if len(rec["completions"]) != len(rec["labels"]) or not rec["completions"]:
        raise ValueError(f"PRM record {i}: {len(rec['completions'])} steps but "
                         f"{len(rec['labels'])} labels (need >= 1 and equal)")


@torch.no_grad()
def score_steps_batch(prm: ProcessRewardModel, tokenizer, items, batch_size: int = 32,
                      ) -> list[list[float]]:
    """P(step correct) for each step of each `(prompt, steps)` item, batched."""
    was_training = prm.training
    prm.eval()
    device = next(prm.parameters()).device
    out: list[list[float]] = []
    try:
        for b in range(0, len(items), batch_size):
            chunk = items[b : b + batch_size]
            encoded = [encode_steps(tokenizer, p, s) for p, s in chunk]
            input_ids, rows, cols = _collate(encoded, pad_id_of(tokenizer))
            probs = torch.sigmoid(prm(input_ids.to(device))[rows.to(device), cols.to(device)])
            k = 0
            for _, ends in encoded:
                out.append(probs[k : k + len(ends)].tolist())
                k += len(ends)
    finally:
        prm.train(was_training)
    return out


# ----------------------------------------------------------------------------------------------
# Training and evaluation
# ----------------------------------------------------------------------------------------------


def read_tokens(tokenizer, prompt: str, steps_per_completion) -> int:
    """Tokens of one pass of a PRM over a group (prompt + steps, per completion with steps)."""
    return sum(len(encode_steps(tokenizer, prompt, list(s))[0])
               for s in steps_per_completion if s)


class PRMStepScorer(StepScorer):
    """Rewards from a trained `ProcessRewardModel`: P(step correct) in [0, 1] per step; the
    tokens it reads are counted (`cost()["forward_tokens"]`)."""

    name = "prm"

    def __init__(self, prm, tokenizer, batch_size: int = 32):
        self.prm, self.tokenizer, self.batch_size = prm, tokenizer, batch_size
        self.tokens = 0

    def cost(self):
        return {"forward_tokens": float(self.tokens)}

    def score_group(self, prompt, steps_per_completion, example):
        self.tokens += read_tokens(self.tokenizer, prompt, steps_per_completion)
        return score_steps_batch(self.prm, self.tokenizer,
                                 [(prompt, list(s)) for s in steps_per_completion],
                                 batch_size=self.batch_size)

    def score(self, prompt, steps, example):
        return self.score_group(prompt, [steps], example)[0]


def prm_loss(prm: ProcessRewardModel, tokenizer, records, pos_weight: float | None = None):
    """Mean binary cross-entropy over all steps of a batch of stepwise records (a tensor)."""
    device = next(prm.parameters()).device
    encoded = [encode_steps(tokenizer, r["prompt"], r["completions"]) for r in records]
    input_ids, rows, cols = _collate(encoded, pad_id_of(tokenizer))
    logits = prm(input_ids.to(device))[rows.to(device), cols.to(device)]  # (n_steps,)
    labels = torch.tensor([float(bool(x)) for r in records for x in r["labels"]], device=device)
    pw = None if pos_weight is None else torch.tensor(pos_weight, device=device)
    return F.binary_cross_entropy_with_logits(logits, labels, pos_weight=pw)


def evaluate_prm(prm: ProcessRewardModel, tokenizer, records, threshold: float = 0.5,
                 batch_size: int = 32) -> dict[str, float]:
    """Step-level accuracy on stepwise records, with the baselines that make it meaningful.

    Returns `accuracy`, `balanced_accuracy` (mean of the accuracies on correct and on wrong steps),
    `majority_accuracy` (always predicting the more frequent label), `positive_rate` and `n_steps`.
    """
    for i, r in enumerate(records):
        _check_record(i, r)
    probs = score_steps_batch(prm, tokenizer, [(r["prompt"], r["completions"]) for r in records],
                              batch_size)
    pred = [p >= threshold for ps in probs for p in ps]
    gold = [bool(x) for r in records for x in r["labels"]]
    n = len(gold)
    pos = sum(gold)
    tp = sum(p and g for p, g in zip(pred, gold))
    tn = sum((not p) and (not g) for p, g in zip(pred, gold))
    recalls = [x for x in (tp / pos if pos else None, tn / (n - pos) if n - pos else None)
               if x is not None]
    return {
        "accuracy": (tp + tn) / n if n else float("nan"),
        "balanced_accuracy": sum(recalls) / len(recalls) if recalls else float("nan"),
        "majority_accuracy": max(pos, n - pos) / n if n else float("nan"),
        "positive_rate": pos / n if n else float("nan"),
        "n_steps": float(n),
    }


def train_prm(prm: ProcessRewardModel, tokenizer, records, epochs: int = 3, lr: float = 3e-4,
              batch_size: int = 16, weight_decay: float = 0.0, pos_weight: float | None = None,
              seed: int = 0, log_every: int = 0, max_grad_norm: float = 1.0,
              tracker: RunTracker | None = None) -> list[float]:
    """Train `prm` with BCE on stepwise records (AdamW, shuffled mini-batches); returns losses.

    `pos_weight` (as in `F.binary_cross_entropy_with_logits`) up-weights correct steps when they
    are rare; the default leaves the classes as they come. tracker: gets every update's loss
    (`tracking.RunTracker.log_row`).
    """
    for i, r in enumerate(records):
        _check_record(i, r)
    opt = torch.optim.AdamW([p for p in prm.parameters() if p.requires_grad], lr=lr,
                            weight_decay=weight_decay)
    rng = random.Random(seed)
    order = list(range(len(records)))
    losses = []
    prm.train()
    step = 0
    for epoch in range(epochs):
        rng.shuffle(order)
        for b in range(0, len(order), batch_size):
            batch = [records[i] for i in order[b : b + batch_size]]
            loss = prm_loss(prm, tokenizer, batch, pos_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(prm.parameters(), max_grad_norm)
            opt.step()
            losses.append(loss.item())
            step += 1
            if tracker is not None:
                tracker.log_row({"step": step, "loss": losses[-1], "epoch": epoch + 1})
            if log_every and step % log_every == 0:
                print(f"prm step {step}: loss {sum(losses[-log_every:]) / log_every:.4f}")
    prm.eval()
    return losses


# ----------------------------------------------------------------------------------------------
# Saving and loading
# ----------------------------------------------------------------------------------------------


def save_prm(prm: ProcessRewardModel, tokenizer, out_dir) -> Path:
    """Backbone in the HF layout + `prm_head.safetensors` + `prm_config.json` (atomic writes)."""

    out_dir = Path(out_dir)
    save_pretrained(prm.backbone, tokenizer, out_dir)
    head = {k: v.detach().contiguous() for k, v in prm.score_head.state_dict().items()}
    atomic_save_safetensors(head, out_dir / HEAD_FILE)
    atomic_write_json(out_dir / CONFIG_FILE, {
        "architecture": "ProcessRewardModel",
        "head": "linear(hidden_size -> 1), sigmoid = P(step correct), read at each step's last "
                "token",
        "hidden_size": prm.cfg.hidden_size,
        "head_file": HEAD_FILE,
    })
    return out_dir


def load_prm(path, device=None, dtype=None) -> tuple[ProcessRewardModel, object]:
    """(prm, tokenizer) saved by `save_prm`; the PRM is in eval mode."""

    path = Path(path)
    cfg_path = path / CONFIG_FILE
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{cfg_path} not found: not a directory written by save_prm")
    meta = read_json(cfg_path)
    backbone, tokenizer = load_pretrained(path, device=device, dtype=dtype)
    prm = ProcessRewardModel(backbone=backbone)
    head = read_safetensors(path / meta.get("head_file", HEAD_FILE))
    if head["weight"].shape != prm.score_head.weight.shape:
        raise ValueError(f"{path / HEAD_FILE}: head weight shape {tuple(head['weight'].shape)} "
                         f"does not match hidden_size {prm.cfg.hidden_size}")
    prm.score_head.load_state_dict(head)
    prm.score_head.to(backbone.device)
    return prm.eval(), tokenizer


# ----------------------------------------------------------------------------------------------
# Datasets
# ----------------------------------------------------------------------------------------------


def make_prm_dataset(model, tokenizer, examples, step_scorer, num_samples: int = 4,
                     max_new_tokens: int = 96, temperature: float = 1.0, top_p: float = 1.0,
                     threshold: float = 0.5, split_mode: str = "tags",
                     generator: torch.Generator | None = None, device=None,
                     dedupe: bool = True, batch_size: int = 64,
                     stats: dict | None = None) -> list[dict]:
    """Stepwise records from sampled completions labelled by a step scorer.

    For each example, `num_samples` completions of `render_prompt(problem)` are sampled from
    `model` (batched, `batch_size` rows at a time), split into steps
    (`split_steps(text, split_mode)`), scored with `step_scorer` (e.g. `VerifierStepScorer()`
    or a `MonteCarloStepScorer`) and labelled `score >= threshold`.
    Identical completions of a problem are kept once when `dedupe`. When a `stats` dict is given,
    the tokens sampled here are added to its "generated_tokens" entry (the scorer counts its own,
    see `cost()`).
    """

    scorer = as_step_scorer(step_scorer)
    prompts = [render_prompt(ex["problem"]) for ex in examples]
    # All problems' samples in a few left-padded batches (one prefill per problem).
    completions, n_tokens = sample_continuations(model, tokenizer, prompts, num_samples,
                                                 max_new_tokens, temperature, top_p, generator,
                                                 batch_size, device)
    if stats is not None:
        stats["generated_tokens"] = stats.get("generated_tokens", 0) + n_tokens
    records = []
    for ex, prompt, texts in zip(examples, prompts, completions):
        texts = list(dict.fromkeys(texts)) if dedupe else list(texts)
        steps = [step_texts(t, split_steps(t, split_mode) or [(0, len(t))]) for t in texts]
        steps = [s for s in steps if s and "".join(s)]
        scores = scorer.score_group(prompt, steps, ex)
        for s, sc in zip(steps, scores):
            records.append({"prompt": prompt, "completions": s,
                            "labels": [float(x) >= threshold for x in sc],
                            "problem": ex["problem"], "answer": ex["answer"]})
    return records


def make_prm_dataset_from_verifier(model, tokenizer, examples, **kwargs) -> list[dict]:
    """`make_prm_dataset` labelled by the exact arithmetic verifier (`VerifierStepScorer`)."""

    return make_prm_dataset(model, tokenizer, examples, VerifierStepScorer(), **kwargs)


def make_prm_dataset_from_mc(model, tokenizer, examples, num_continuations: int = 4,
                             mode: str = "hard", **kwargs) -> list[dict]:
    """`make_prm_dataset` labelled by Math-Shepherd Monte-Carlo values of `model` itself.

    With `mode="hard"` a step is labelled correct when any of `num_continuations` rollouts from
    it reaches the right answer (Math-Shepherd's hard estimate); with "soft", when at least half do.
    """

    mc = MonteCarloStepScorer(model, tokenizer, num_continuations=num_continuations, mode=mode,
                              max_new_tokens=kwargs.get("max_new_tokens", 96),
                              generator=kwargs.get("generator"), device=kwargs.get("device"))
    return make_prm_dataset(model, tokenizer, examples, mc, **kwargs)


def label_agreement(records, reference_records) -> float:
    """Fraction of steps whose labels agree between two labellings of the same completions."""
    a = [x for r in records for x in r["labels"]]
    b = [x for r in reference_records for x in r["labels"]]
    return sum(x == y for x, y in zip(a, b)) / max(1, len(a))


def train_prm_on_arithmetic(policy, tokenizer, out_dir, labels: str = "verifier",
                            train_problems: int = 400, eval_problems: int = 150,
                            samples: int = 4, max_new_tokens: int = 112,
                            temperature: float = 1.0, mc_rollouts: int = 4, epochs: int = 4,
                            lr: float = 1e-3, batch_size: int = 16, seed: int = 0, device=None,
                            info: dict | None = None, log=print, report_to=()) -> dict:
    """Train a PRM on the arithmetic world from `policy`'s own completions; returns the report.

    Samples `samples` completions per problem from `policy` for `train_problems` train-split
    problems (drawn with seed `seed + 100`) and `eval_problems` val-split problems, splits them into
    steps, labels the training steps with the exact verifier (`labels="verifier"`) or with
    Math-Shepherd hard Monte-Carlo values of the policy (`labels="mc"`, `mc_rollouts`
    continuations per step prefix), and the held-out steps always with the verifier. The PRM's
    backbone starts from a copy of `policy`; it is trained with BCE (`train_prm`) and saved to
    `out_dir` (`save_prm`) with prm_report.json: settings, data sizes, generated tokens, step
    accuracy on train and held-out steps before/after training (with the majority baseline),
    seconds. `info` entries (e.g. the model name) are added to the report. Seeds torch's global
    RNG with `seed` (the head's initialisation). report_to: live logging of the training loss
    and the held-out step accuracies before and after (`tracking.open_tracker`, into out_dir).
    """

    if labels not in ("verifier", "mc"):
        raise ValueError(f"labels must be 'verifier' or 'mc', got {labels!r}")
    settings = dict(labels=labels, train_problems=train_problems, eval_problems=eval_problems,
                    samples=samples, max_new_tokens=max_new_tokens, temperature=temperature,
                    mc_rollouts=mc_rollouts, epochs=epochs, lr=lr, batch_size=batch_size,
                    seed=seed)
    torch.manual_seed(seed)
    out = Path(out_dir)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    train_set = make_split("train", train_problems, seed=seed + 100)
    eval_set = make_split("val", eval_problems)
    common = dict(num_samples=samples, max_new_tokens=max_new_tokens, temperature=temperature,
                  device=device)
    sampled: dict = {}  # tokens sampled for the records (the MC labeller's come on top)

    t0 = time.time()
    report: dict = {"settings": settings, **(info or {})}
    if labels == "mc":
        mc = MonteCarloStepScorer(policy, tokenizer, num_continuations=mc_rollouts, mode="hard",
                                  max_new_tokens=max_new_tokens, temperature=temperature,
                                  generator=gen, device=device)
        train_records = make_prm_dataset(policy, tokenizer, train_set, mc, generator=gen,
                                         stats=sampled, **common)
        verifier = VerifierStepScorer()
        truth = [{**r, "labels": [x == 1.0 for x in verifier.score(r["prompt"], r["completions"],
                                                                    r)]} for r in train_records]
        agree = label_agreement(train_records, truth)
        cost = mc.cost()
        report.update(mc_generated_tokens=cost["mc_generated_tokens"],
                      mc_rollouts=cost["mc_rollouts"], mc_verifier_agreement=agree)
        log(f"MC labels: {cost['mc_generated_tokens']:.0f} generated tokens, "
            f"{cost['mc_rollouts']:.0f} rollouts; agreement with the verifier {agree:.3f}")
    else:
        train_records = make_prm_dataset(policy, tokenizer, train_set, VerifierStepScorer(),
                                         generator=gen, stats=sampled, **common)
    eval_records = make_prm_dataset(policy, tokenizer, eval_set, VerifierStepScorer(),
                                    generator=gen, stats=sampled, **common)
    n_steps = sum(len(r["labels"]) for r in train_records)
    pos = sum(sum(r["labels"]) for r in train_records) / max(1, n_steps)
    data_seconds = time.time() - t0
    log(f"PRM data: {len(train_records)} train completions ({n_steps} steps, {pos:.1%} correct), "
        f"{len(eval_records)} held-out completions; {data_seconds:.0f}s")

    prm = ProcessRewardModel.from_pretrained_backbone(policy).to(device or policy.device)
    before = evaluate_prm(prm, tokenizer, eval_records)
    tracker = open_tracker(report_to, out, settings)
    tracker.log_eval(before, 0)
    t1 = time.time()
    try:
        with stop_signals_raise():  # SIGTERM, SIGHUP, SIGUSR1 save as Ctrl-C does
            losses = train_prm(prm, tokenizer, train_records, epochs=epochs, lr=lr,
                               batch_size=batch_size, seed=seed,
                               log_every=max(1, len(train_records) // batch_size),
                               tracker=tracker)
    except KeyboardInterrupt:  # keep what was trained: a loadable PRM, marked as unfinished
        with defer_interrupts():
            save_prm(prm, tokenizer, out / "interrupted")
            atomic_write_json(out / "interrupted" / "prm_report.json",
                              {**report, "interrupted": True})
        tracker.close()
        log(f"interrupted: the partly trained PRM is in {out / 'interrupted'} (rerun to finish; "
            "the data are regenerated identically from the seed)")
        raise
    train_seconds = time.time() - t1
    held_out = evaluate_prm(prm, tokenizer, eval_records)
    tracker.log_eval(held_out, len(losses))
    tracker.close()
    report.update({
        "train_completions": len(train_records), "train_steps": n_steps,
        "train_positive_rate": pos, "held_out_completions": len(eval_records),
        "sampled_tokens": sampled.get("generated_tokens", 0),
        "held_out_before_training": before,
        "train": evaluate_prm(prm, tokenizer, train_records), "held_out": held_out,
        "final_loss": sum(losses[-10:]) / max(1, len(losses[-10:])),
        "data_seconds": data_seconds, "train_seconds": train_seconds, "output_dir": str(out),
    })
    save_prm(prm, tokenizer, out)
    atomic_write_json(out / "prm_report.json", report)
    log(f"PRM held-out step accuracy {held_out['accuracy']:.3f} (balanced "
        f"{held_out['balanced_accuracy']:.3f}; majority baseline "
        f"{held_out['majority_accuracy']:.3f}; {held_out['n_steps']:.0f} steps); saved to {out}")
    return report
