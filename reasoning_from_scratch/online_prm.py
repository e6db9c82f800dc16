"""An online process reward model: a learned PRM re-fitted on the policy's own rollouts during RL.

A PRM trained once, before RL, is a fixed proxy; the policy drifts to completions it has never
seen and finds the ones it scores wrongly (reward hacking, Gao et al. 2022, arXiv 2210.10760;
chapter 8 measured it). PRIME (Cui et al. 2025, arXiv 2502.01456) keeps the reward model on the
policy's distribution by updating it *online*, on every batch of rollouts, with labels that
cannot be gamed: the outcome verifier's. `OnlinePRMStepScorer` does that with the step PRM of
`prm.py` (a re-fitted step PRM rather than PRIME's implicit `beta * log pi_phi / pi_ref` one):

1. score the steps of a group of rollouts with the current PRM (the rewards the policy gets);
2. label the same steps with a `labeler` (the exact step verifier, or every step with its
   completion's outcome, PRIME's outcome labels) and take one AdamW step of the PRM's binary
   cross-entropy on them (`prm.prm_loss`).

The scores are always predictions on rollouts the PRM has not been trained on. Its cost is
counted: `cost()` reports the tokens the PRM read (scoring and training forward passes) as
`forward_tokens` (read, not sampled), its seconds, updates, and its agreement with the labels
before each update (a falling agreement is the sign that the policy has found the PRM's blind
spots).

Unlike the other step scorers it changes as it scores, so a run keeps its state: `state_dict()`
(the PRM's weights, its AdamW state, the counters) goes into every checkpoint and
`load_state_dict` restores it on resume (run_dir.py, `process_supervision.learned_states`), and
a data-parallel run has every process replay the whole step's groups so that their PRMs stay
equal (`systems.WholeStepHook`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from .grading import reward_rlvr
from .prm import ProcessRewardModel, prm_loss, read_tokens, score_steps_batch
from .step_scorers import StepScorer, VerifierStepScorer


class OutcomeStepLabeler(StepScorer):
    """Outcome labels for every step: 1 if the completion's boxed answer is right, else 0.

    With these labels the PRM learns P(the completion succeeds | the prefix up to this step), a
    value estimate, from nothing but outcomes (PRIME's setting; Math-Shepherd's soft labels).
    """

    name = "outcome-labels"

    def score(self, prompt, steps, example):
        ok = reward_rlvr("".join(steps), example["answer"])
        return [ok] * len(steps)


class OnlinePRMStepScorer(StepScorer):
    """Scores steps with a PRM, then updates the PRM on those steps' labels (one step per group).

    `labeler`: a step scorer giving 0/1 labels (default: the exact verifier,
    `VerifierStepScorer()`; `OutcomeStepLabeler()` for outcome labels). `lr`: the PRM's AdamW
    learning rate; `updates`: AdamW steps per group.
    """

    name = "online-prm"
    # what `cost()` reads besides the PRM and its optimizer: part of the state a checkpoint keeps
    COUNTERS = ("tokens", "seconds", "num_updates", "agree", "labelled", "last_loss")

    def __init__(self, prm: ProcessRewardModel, tokenizer, labeler: StepScorer | None = None,
                 lr: float = 3e-4, updates: int = 1, batch_size: int = 32,
                 max_grad_norm: float = 1.0):
        self.prm, self.tokenizer = prm, tokenizer
        self.labeler = labeler if labeler is not None else VerifierStepScorer()
        self.updates, self.batch_size, self.max_grad_norm = int(updates), batch_size, max_grad_norm
        self.optimizer = torch.optim.AdamW(
            [p for p in prm.parameters() if p.requires_grad], lr=lr)
        self.tokens = 0
        self.seconds = 0.0
        self.num_updates = 0
        self.agree, self.labelled = 0, 0
        self.last_loss = float("nan")

    def cost(self):
        agreement = self.agree / self.labelled if self.labelled else float("nan")
        return {"forward_tokens": float(self.tokens), "prm_seconds": self.seconds,
                "prm_updates": float(self.num_updates), "prm_agreement": agreement,
                "prm_loss": self.last_loss}

    def state_dict(self) -> dict:
        """The PRM's weights, its AdamW state and the counters (references, not copies)."""
        return {"prm": self.prm.state_dict(), "optimizer": self.optimizer.state_dict(),
                "counters": {k: getattr(self, k) for k in self.COUNTERS}}

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` returned: the scorer then scores and learns as the one that
        saved it would have."""
        self.prm.load_state_dict(state["prm"])
        self.optimizer.load_state_dict(state["optimizer"])
        for k in self.COUNTERS:
            setattr(self, k, state["counters"][k])

    def update(self, prompt: str, steps_per_completion: Sequence[Sequence[str]],
               labels: Sequence[Sequence[float]]) -> float:
        """`updates` AdamW steps of BCE on these steps' labels; returns the last loss."""
        records = [{"prompt": prompt, "completions": list(s), "labels": [x >= 0.5 for x in ls]}
                   for s, ls in zip(steps_per_completion, labels) if s]
        if not records:
            return float("nan")
        was_training = self.prm.training
        self.prm.train()
        loss = float("nan")
        try:
            with torch.enable_grad():  # the GRPO rollout hook runs under no_grad
                for _ in range(self.updates):
                    loss = self._step(records)
                    self.num_updates += 1
        finally:
            self.prm.train(was_training)
        return loss

    def _step(self, records) -> float:
        """One AdamW step of the PRM's BCE on stepwise records; returns the loss."""
        out = prm_loss(self.prm, self.tokenizer, records)
        self.optimizer.zero_grad(set_to_none=True)
        out.backward()
        torch.nn.utils.clip_grad_norm_(self.prm.parameters(), self.max_grad_norm)
        self.optimizer.step()
        return out.item()

    def score_group(self, prompt, steps_per_completion, example):
        t0 = time.perf_counter()
        rows = [i for i, s in enumerate(steps_per_completion) if s]  # completions with steps
        got = score_steps_batch(self.prm, self.tokenizer,
                                [(prompt, list(steps_per_completion[i])) for i in rows],
                                self.batch_size)
        scores: list[list[float]] = [[] for _ in steps_per_completion]
        for i, sc in zip(rows, got):
            scores[i] = sc
        labels = self.labeler.score_group(prompt, steps_per_completion, example)
        for sc, lb in zip(scores, labels):
            self.agree += sum((a >= 0.5) == (b >= 0.5) for a, b in zip(sc, lb))
            self.labelled += len(lb)
        self.last_loss = self.update(prompt, steps_per_completion, labels)
        # read once to score, once per update to train
        self.tokens += read_tokens(self.tokenizer, prompt, steps_per_completion) * (
            1 + self.updates)
        self.seconds += time.perf_counter() - t0
        return scores

    def score(self, prompt, steps, example):
        return self.score_group(prompt, [steps], example)[0]
