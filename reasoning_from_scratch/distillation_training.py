"""Distillation training (chapter 9): fine-tune a student on a teacher's verified traces.

`train_distillation` is `sft.train_sft` (the loop that also pretrained the bundled model) inside a
run directory like a GRPO run's: config.json, metrics.csv (one row per update: loss, learning
rate, tokens, seconds; plus the held-out evaluation every `eval_every` updates: validation loss on
held-back traces and greedy accuracy on the evaluation problems), metrics.png (redrawn at
every evaluation; rows and evaluations also go to TensorBoard / W&B with `report_to`,
tracking.py), checkpoints in the Hugging Face layout with optimizer and RNG state
(`checkpoints.py`), final/, summary.json.
Ctrl-C or a stop signal (SIGTERM, SIGHUP, SIGUSR1; interrupts.py) saves `checkpoint-<k>`, as
the checkpoint policy does every `checkpoint_minutes` (checkpoints.py), and `resume_from`
continues exactly: the batch schedule and the learning rate are functions of the step, so the
resumed run's weights equal an uninterrupted run's.
Under torchrun the run is data-parallel, replicated or sharded (`fsdp`), as the GRPO loop's
(distributed.py, fsdp.py, docs/data_parallel.md).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, fields

from .distillation import traces_to_documents
from .distributed import (
    all_gather_objects,
    world_size,
)
from .evaluation import EVAL_FIGURES, evaluate_policy
from .fsdp import (
    refresh_replica,
    shard_sizes,
    shard_with_replica,
)
from .generation import compile_decoding
from .interrupts import (
    DEFAULT_STOP_SIGNALS,
    defer_interrupts,
    polling_stops,
    stop_signal_names,
)
from .prompts import render_prompt
from .run_dir import RunDir, start_run, stop_if_interrupted
from .run_log import EVAL_COLUMNS
from .sft import make_sft_optimizer, mean_completion_loss, train_sft
from .tracking import report_problem, report_targets
from .validation import at_least, check_fields, in_range, non_negative, option, positive

DISTILL_COLUMNS = ["step", "loss", "lr", "tokens", "step_s", "train_s", "val_loss",
                   *EVAL_COLUMNS.values()]
DISTILL_PLOT_COLUMNS = ["loss", "val_loss", "eval_accuracy", "eval_step_correctness"]
DISTILL_EVAL_COLUMNS = {**EVAL_COLUMNS, "val_loss": "val_loss"}  # figure -> metrics.csv column

@dataclass
class DistillConfig:
    """Every knob of a distillation run; defaults fit the bundled model and the chapter 7 teacher.
    Each field carries its help and valid range (`validation.option`); cli/distill.py builds the
    flags from them.

    Checked on the arithmetic val split (chapter 7 teacher, 2000 problems x 4 samples, ~1900
    traces): at lr 5e-4 (cosine to a tenth) with 32 traces per update, accuracy was 0.64-0.66
    after 100 updates and stayed there up to 400 while the validation loss still fell slowly;
    300 updates (5 epochs) leave a margin for other seeds and trace sets.
    """

    steps: int = option(300, "SFT updates of the student", rule=at_least(1))
    batch_size: int = option(32, "traces per update", rule=at_least(1))
    lr: float = option(5e-4, "peak AdamW learning rate (linear warmup, cosine decay)",
                       rule=positive)
    warmup: int = option(20, "updates of linear learning-rate warmup", rule=non_negative)
    weight_decay: float = option(0.0, "AdamW weight decay of the weight matrices",
                                 rule=non_negative)
    grad_clip: float = option(1.0, "clip the gradient norm to this value", rule=positive)
    min_lr_ratio: float = option(0.1, "the cosine decay ends at lr x this", rule=in_range(0, 1))
    val_fraction: float = option(
        0.05, "fraction of the traced problems held back for the validation loss",
        rule=in_range(0, 1, high_open=True))
    eval_every: int = option(50, "evaluate every N updates (0: only before and after training)",
                             rule=non_negative)
    eval_examples: int = option(200, "held-out problems evaluated (the first N)", rule=at_least(1))
    eval_max_new_tokens: int = option(112, "maximum generated tokens per evaluation answer",
                                      rule=at_least(1))
    eval_batch_size: int = option(100, "problems per evaluation batch", rule=at_least(1))
    checkpoint_every: int = option(
        0, "save a resumable checkpoint every N updates (0: none by updates; the final one, one "
        "on Ctrl-C or a stop signal and checkpoint-minutes' still)", rule=non_negative)
    checkpoint_minutes: float = option(
        10.0, "save a resumable checkpoint once this many minutes of wall time passed since the "
        "last one (0: off)", rule=non_negative)
    keep_checkpoints: int = option(
        2, "checkpoint-<step> directories kept, the latest (0: all); final/ is always kept",
        rule=non_negative)
    stop_signals: str = option(
        DEFAULT_STOP_SIGNALS, "signals that save a checkpoint and stop the run like Ctrl-C, "
        "exit status 75 (comma-separated; 'none': only Ctrl-C)", rule=stop_signal_names)
    report_to: tuple[str, ...] = option(
        (), "watch the run live: log metrics and evaluations to tensorboard (<run>/tensorboard) "
        "and/or wandb (<run>/wandb, offline without an account); several comma-separated "
        "(tensorboard,wandb); none: off",
        rule=report_problem)
    seed: int = option(0, "seed of the teacher sampling, the trace split and the batch order",
                       rule=non_negative)
    output_dir: str = option(
        "runs/distill", "run directory (traces, metrics, checkpoints, summary; None: "
        "runs/ch09-<time>)")
    fsdp: bool = option(
        False, "shard the student's weights, gradients and AdamW state over the torchrun "
        "processes (FSDP2, fsdp.py); evaluation runs on an unsharded replica; sharded "
        "checkpoints")
    activation_checkpointing: bool = option(
        False, "recompute each decoder block in the backward pass instead of keeping its "
        "activations (torch.utils.checkpoint): an update's activation memory drops to the "
        "blocks' inputs for one more forward pass of compute (docs/data_parallel.md)")
    export_hf_checkpoints: bool = option(
        False, "with --fsdp: also write the whole weights in Hugging Face layout into every "
        "checkpoint-<k> (rank 0 writes a full copy of the model while the other processes "
        "wait). final/ always has them; resuming reads the shards alone")
    compile: bool | None = option(
        None, "evaluate with generation's static, compiled decode step (torch.compile; the "
        "same answers). Default: on for CUDA, off elsewhere (no gain on the CPU, docs/speed.md)")
    progress: bool = option(True, "show progress bars")

    def __post_init__(self):
        check_fields(self)
        self.report_to = report_targets(self.report_to)  # "none", names or a list -> a tuple

    @classmethod
    def from_dict(cls, d: dict) -> DistillConfig:
        """Config from a dict, ignoring unknown keys."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


# The valid range of each DistillConfig field, from its metadata (kept for importers)
DISTILL_RULES = {f.name: f.metadata["rule"] for f in fields(DistillConfig) if f.metadata["rule"]}


def split_traces(records, val_fraction: float, seed: int) -> tuple[list[dict], list[dict]]:
    """(train, validation) traces, split by problem so no validation problem is trained on."""
    problems = sorted({r["problem"] for r in records})
    random.Random(seed).shuffle(problems)
    n_val = round(len(problems) * val_fraction)
    if val_fraction > 0 and len(problems) > 1:
        n_val = min(max(n_val, 1), len(problems) - 1)  # at least one of each
    held = set(problems[:n_val])
    return ([r for r in records if r["problem"] not in held],
            [r for r in records if r["problem"] in held])


class _DistillRun(RunDir):
    """A distillation run's directory (run_dir.py), which also keeps the seconds spent
    training (evaluations and checkpoints left out) and when the update in progress began."""

    def __init__(self, out, model, tokenizer, optimizer, config, replica=None):
        super().__init__(out, model, tokenizer, optimizer, config, DISTILL_COLUMNS,
                         DISTILL_PLOT_COLUMNS, DISTILL_EVAL_COLUMNS, replica)
        self.train_seconds = 0.0
        self.tick = time.time()

    def extra_state(self) -> dict:
        """The training seconds so far, saved in every checkpoint."""
        return {"train_seconds": self.train_seconds}


def train_distillation(student, tokenizer, records, eval_examples, device, config: DistillConfig,
                       resume_from=None, overwrite=False, base_evaluation: dict | None = None,
                       prompt_fn=render_prompt,
                       phase_hook: Callable[[str, int], None] | None = None) -> dict:
    """SFT of `student` on trace `records` (see distillation.py); returns the summary dict.

    The loss covers the completion tokens only (`sft.collate`). Evaluations (base, every
    `eval_every` updates, final) measure the validation loss on the held-back traces and the
    greedy figures of `evaluation.evaluate_policy` on `eval_examples`. resume_from: a run or
    checkpoint directory to continue exactly; a new run refuses a used output_dir unless
    `overwrite`. phase_hook(phase, step) as in `train_grpo` ("base_eval", "update", "eval",
    "checkpoint", "final_eval", "final_save").

    Data-parallel (distributed.py, as `train_grpo`): every process of a torchrun group calls
    this with the same arguments; each trains on its share of every batch (`sft.sft_step`) and
    evaluates its share of the problems, so N processes give the one-process run (up to float
    summation order). Rank 0 alone writes. Ctrl-C or a stop signal on any process stops them all
    after the update in progress (and after an evaluation), with a checkpoint. config.fsdp
    shards the student (fsdp.py); evaluation then runs on an unsharded replica refreshed after
    every update, and checkpoints hold the shards beside the HF weights, so a run resumes with
    any number of processes.
    """
    config, out, hook = start_run(config, resume_from, overwrite, phase_hook)
    if not records:
        raise ValueError("no traces to train on: the list of records is empty (did the "
                         "teacher's sampling keep no verified trace?)")
    train_recs, val_recs = split_traces(records, config.val_fraction, config.seed)
    if not train_recs:
        raise ValueError(f"no traces to train on: all {len(records)} were held back for "
                         f"validation (val_fraction {config.val_fraction})")
    train_docs = traces_to_documents(train_recs, prompt_fn)
    val_docs = traces_to_documents(val_recs, prompt_fn)
    eval_set = list(eval_examples)[:config.eval_examples]
    replica = None
    if config.fsdp:  # shard before the optimizer exists: AdamW then holds shards only
        student, replica = shard_with_replica(student, device)
    policy = student if replica is None else replica  # what evaluates
    student.activation_checkpointing = config.activation_checkpointing  # the updates' passes only

    def evaluate_now():  # its decoding polls for an agreed stop (`stops`, below)
        with polling_stops(stops):
            figures = evaluate_policy(policy, tokenizer, eval_set, device,
                                      config.eval_max_new_tokens, config.eval_batch_size,
                                      prompt_fn, compile=compile_decoding(config.compile, device))
            figures["val_loss"] = (mean_completion_loss(policy, tokenizer, val_docs)
                                   if val_docs else None)
        return figures

    t_start = time.time()
    optimizer = make_sft_optimizer(student, config.lr, config.weight_decay)
    run = _DistillRun(out, student, tokenizer, optimizer, config, replica)
    state = run.restore(resume_from, base_evaluation)
    if state is not None:
        run.train_seconds = state.get("train_seconds", 0.0)
    run.open_logs(resumed=resume_from is not None)

    def on_update(k, stats):
        hook("update", k)
        if replica is not None:  # the same all-gathers on every process, after each update
            refresh_replica(replica, student)
        now = time.time()
        run.train_seconds += now - run.tick
        row = {"step": k, **stats, "step_s": now - run.tick, "train_s": run.train_seconds}
        if run.log is not None:
            run.log.append(row)
        run.tracker.log_row(row)
        run.completed = k
        run.eval_pending = bool(config.eval_every and k % config.eval_every == 0
                                and k < config.steps)

    def after_update(k):
        stop_if_interrupted(interrupted)
        if run.eval_pending:
            run.evaluate_step(evaluate_now, hook)
            stop_if_interrupted(interrupted)
        if run.checkpoint_due():
            with defer_interrupts():
                hook("checkpoint", k)
                run.checkpoint()
        run.tick = time.time()  # evaluations and checkpoints are not training time

    # Several processes stop only where all of them check (`stop_if_interrupted`, and every
    # STOP_CHECK_EVERY tokens of an evaluation's decoding: `stops`); a stop checkpoints
    # (`RunDir.stoppable`).
    with run.stoppable() as (interrupted, stops):
        if run.base is None:
            hook("base_eval", 0)
            run.base = run.last_eval = evaluate_now()
            run.log_eval(run.base)
        stop_if_interrupted(interrupted)
        if run.eval_pending and run.completed < config.steps:  # interrupted mid-evaluation
            run.evaluate_step(evaluate_now, hook)
            stop_if_interrupted(interrupted)
        run.tick = time.time()
        train_sft(student, tokenizer, train_docs, steps=config.steps,
                  batch_size=config.batch_size, lr=config.lr, warmup=config.warmup,
                  weight_decay=config.weight_decay, grad_clip=config.grad_clip,
                  min_lr_ratio=config.min_lr_ratio, seed=config.seed,
                  # FSDP: one forward per update (a shared-prefix cache would keep
                  # gathered weights alive past FSDP's reshard)
                  share_prefix=replica is None,
                  progress=config.progress, optimizer=optimizer, start_step=run.completed,
                  on_update=on_update, after_update=after_update)
        _, summary = run.finish(evaluate_now, interrupted, hook, lambda final: _summary(
            run, final, len(train_recs), len(val_recs), len(eval_set), time.time() - t_start))
    return summary


def _summary(run, final, n_train, n_val, n_eval, wall_seconds):
    """summary.json of a distillation run: base and final figures and run facts."""
    figures = (*EVAL_FIGURES, "val_loss")
    return {
        **{f"{when}_{k}": f.get(k) for k in figures
           for when, f in (("base", run.base), ("final", final))},
        "per_level": {lv: {"base": run.base.get("per_level", {}).get(lv), "final": acc}
                      for lv, acc in final["per_level"].items()},
        "steps": run.config.steps, "train_traces": n_train, "val_traces": n_val,
        "eval_examples": n_eval, "train_seconds": run.train_seconds,
        "wall_seconds": wall_seconds, "output_dir": str(run.out),
        "world_size": world_size(),
        # FSDP: what each process holds of the weights and the AdamW state (`fsdp.shard_sizes`)
        **({"shards": all_gather_objects(shard_sizes(run.model, run.optimizer))}
           if run.replica is not None else {}),
    }
