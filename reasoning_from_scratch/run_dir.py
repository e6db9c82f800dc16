"""The life cycle of a run directory, shared by the GRPO loop (training.py) and the
distillation loop (distillation_training.py).

A run directory holds config.json, metrics.csv and metrics.png, the trackers' files
(tracking.py), `checkpoint-<k>` directories (checkpoints.py, pruned by `CheckpointPolicy`),
final/, summary.json and, after a stop, the `stopped` file with the exit status a batch script
requeues on. `RunDir` keeps the state a checkpoint captures besides the weights and the
optimizer, and writes these files: every process of a data-parallel run keeps the state, rank 0
alone writes (the weights are the same on every process; under FSDP every process first writes
its own shards, DCP). Its life cycle, the same for both loops:

    run = Loop's RunDir(...); run.restore(resume_from, base_evaluation); run.open_logs(...)
    with run.stoppable() as (interrupted, stops):   # a stop saves a checkpoint and re-raises
        ... the loop: run.log_eval, run.evaluate_step, run.checkpoint when run.checkpoint_due()
        final, summary = run.finish(evaluate_now, interrupted, hook, summarize)
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

from tqdm import tqdm

from .checkpoints import (
    STOPPED_FILE,
    CheckpointPolicy,
    check_new_run_dir,
    clear_run_dir,
    copy_state,
    load_checkpoint,
    prune_checkpoints,
    save_checkpoint,
    state_to_flat,
)
from .distributed import (
    agreed_stop,
    all_reduce_max,
    any_rank,
    barrier,
    check_replicas_agree,
    check_same_on_all_ranks,
    is_main,
    params_checksum,
    run_on_main,
    world_size,
)
from .files import atomic_write_json, remove_stale_temp_files
from .fsdp import refresh_replica, save_sharded
from .interrupts import (
    defer_interrupts,
    exit_status,
    interrupt_exception,
    polling_stops,
    record_interrupts,
    stop_reason,
)
from .plotting import plot_grpo_metrics
from .run_log import EVAL_COLUMNS, MetricsLog, append_samples, eval_cells, truncate_samples
from .tracking import RunTracker, open_tracker


def start_run(config, resume_from, overwrite, phase_hook):
    """(config, output directory, phase hook) of a run about to start, on every process: only
    rank 0 shows progress; a new run refuses (or, with `overwrite`, clears) a directory that
    holds a run; no `phase_hook` is a hook that does nothing."""
    if not is_main():
        config = replace(config, progress=False)  # rank 0 prints for everyone
    out = Path(config.output_dir)
    if resume_from is None:
        run_on_main(prepare_new_run_dir, out, overwrite)
    return config, out, phase_hook or (lambda phase, step: None)


class RunDir:
    """The mutable state of a run that a checkpoint must capture, and its file writer.

    `columns`: metrics.csv's columns; `plot_columns`: those drawn in metrics.png;
    `eval_columns`: evaluation figure -> metrics.csv column (`run_log.eval_cells`).
    `extra_state()` adds a loop's own fields to the checkpoint's bookkeeping. `states`: other
    learners the run updates besides the model (name -> object with `state_dict` /
    `load_state_dict`: process supervision's online PRM, `process_supervision.learned_states`),
    each checkpointed in its own file as it was after step `completed` (`kept_states`).
    """

    def __init__(self, out, model, tokenizer, optimizer, config, columns, plot_columns,
                 eval_columns=EVAL_COLUMNS, replica=None, states=None):
        self.out, self.model, self.tokenizer = out, model, tokenizer
        self.replica = replica  # FSDP: the unsharded copy, current after every update
        self.optimizer, self.config = optimizer, config
        self.states, self.kept_states = dict(states or {}), {}
        self.columns, self.plot_columns, self.eval_columns = columns, plot_columns, eval_columns
        self.main = is_main()
        self.several = world_size() > 1  # several processes agree on what is due
        self.completed = 0  # optimizer steps applied to the weights (skipped ones included)
        self.eval_pending = False  # step `completed` is due an evaluation not yet run
        self.base = self.last_eval = None
        self.saved = None  # (name, completed, eval_pending) of the last checkpoint written
        self.log = None  # rank 0's MetricsLog (`open_logs`)
        self.tracker = RunTracker()  # rank 0's live reporting (`open_logs`); others: nothing
        self.policy = CheckpointPolicy(config.checkpoint_every, config.checkpoint_minutes,
                                       config.keep_checkpoints)

    # -- start ---------------------------------------------------------------------------------

    def restore(self, resume_from, base_evaluation):
        """The base model's figures (`base_evaluation`, None: not known yet) and, resuming, the
        weights, AdamW state, other learners' states and bookkeeping of the checkpoint
        `resume_from` (the replica refreshed from them); returns the checkpoint's state dict
        (None for a new run). Load first: a failed load writes nothing."""
        self.base = self.last_eval = base_evaluation
        if resume_from is None:
            self.keep_states()
            return None
        state = load_checkpoint(resume_from, self.model, self.optimizer, self.states)
        self.keep_states()
        self.completed, self.eval_pending = state["step"], state.get("eval_pending", False)
        self.base = state.get("base") or base_evaluation
        self.last_eval = state.get("last_eval") or self.base
        if self.replica is not None:
            refresh_replica(self.replica, self.model)
        return state

    def open_logs(self, resumed):
        """Rank 0 opens metrics.csv (dropping rows after a resumed step), writes config.json
        for a new run and opens the trackers; an error there stops every process."""
        run_on_main(self._open_logs, resumed)

    def _open_logs(self, resumed):
        """`open_logs` on rank 0."""
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / STOPPED_FILE).unlink(missing_ok=True)  # running again
        remove_stale_temp_files(self.out)  # a kill -9 during a write leaves its temp file
        self.log = MetricsLog(self.out / "metrics.csv", self.columns,
                              keep_upto=self.completed if resumed else None)
        if not resumed:
            write_run_config(self.out, self.config)
        self.tracker = open_tracker(self.config.report_to, self.out, asdict(self.config),
                                    resume_step=self.completed if resumed else None)

    # -- logs ----------------------------------------------------------------------------------

    def log_eval(self, figures):
        """Rank 0: an evaluation's figures into the last metrics row (the base model's, before
        any row, to the trackers alone, at step 0)."""
        if self.main:
            cells = eval_cells(figures, self.eval_columns)
            if self.completed:
                self.log.patch_last_row(cells)
            self.tracker.log_eval(cells, self.completed)

    def plot(self):
        """Rank 0: metrics.png redrawn from metrics.csv (a run stopped early keeps its picture)."""
        if self.main:
            plot_grpo_metrics(self.out / "metrics.csv", self.plot_columns,
                              save_as=self.out / "metrics.png")

    def evaluate_step(self, evaluate_now, hook):
        """The evaluation due after step `completed`, written into that step's metrics row;
        returns its figures."""
        hook("eval", self.completed)
        figures = evaluate_now()
        with defer_interrupts():
            self.last_eval, self.eval_pending = figures, False
            self.log_eval(figures)
        self.plot()
        return figures

    # -- checkpoints ---------------------------------------------------------------------------

    def checkpoint(self, name=None):
        """Save `checkpoint-<completed>` (or `name`), unless this exact state is saved already;
        rank 0 writes it (and prunes the old ones, `CheckpointPolicy`), the other processes only
        note it as saved, or raise rank 0's error (a full disk)."""
        key = (name, self.completed, self.eval_pending)
        path = self.out / (name or f"checkpoint-{self.completed}")
        if key == self.saved:
            return path
        if self.replica is not None:  # every process writes its shards first (DCP)
            tmp = run_on_main(fresh_dir, path.with_name(path.name + ".tmp"))
            save_sharded(tmp, self.model, self.optimizer)
            barrier()
        run_on_main(self._save, path)
        self.policy.saved()
        self.saved = key
        return path

    def checkpoint_due(self):
        """Whether the checkpoint policy asks for one now (the same answer on every process)."""
        due = self.policy.due(self.completed)
        return any_rank(due) if self.several else due

    def keep_states(self):
        """Copies of the other learners' states as they are now, after step `completed`: what
        its checkpoint holds, even when a stop lands in the next step's rollouts after they have
        changed (an online PRM learns while the rollouts are scored). The copies stay on the
        learners' devices: one more state's memory, a device-to-device copy per step."""
        self.kept_states = {name: copy_state(obj.state_dict())
                            for name, obj in self.states.items()}

    def extra_state(self) -> dict:
        """A loop's own bookkeeping saved in every checkpoint (none here)."""
        return {}

    def _save(self, path):
        """`checkpoint` on rank 0: under FSDP the weights from the replica (AdamW in DCP)."""
        sharded = self.replica is not None
        save_checkpoint(
            path, self.replica if sharded else self.model, self.tokenizer,
            None if sharded else self.optimizer, self.completed, self.config,
            {"base": self.base, "last_eval": self.last_eval, "eval_pending": self.eval_pending,
             **self.extra_state(), "output_dir": str(self.out), "world_size": world_size()},
            hf_weights=hf_export_due(path, self.config), states=self.kept_states,
        )
        prune_checkpoints(self.out, self.policy.keep, self.completed)

    # -- stop and finish -----------------------------------------------------------------------

    @contextlib.contextmanager
    def stoppable(self):
        """The loop's body, stoppable: yields (interrupted, stops). Several processes stop only
        where all of them check (`stop_if_interrupted`, and every STOP_CHECK_EVERY tokens of a
        decoding phase run under `polling_stops(stops)`, distributed.AgreedStop); one process
        stops at once (the stop signals then only raise StopSignal; Ctrl-C or any of them raises
        where it lands). A stop checkpoints the completed updates (`save_interrupted`) and
        re-raises; a normal end waits until every process is done, so every file is written
        when any process returns."""
        with record_interrupts(enabled=world_size() > 1,
                               signals=self.config.stop_signals) as interrupted:
            try:
                yield interrupted, agreed_stop(interrupted)
            except KeyboardInterrupt as stop:  # Ctrl-C or a stop signal (SIGTERM, ...)
                self.save_interrupted(stop)
                raise
        barrier()

    def save_interrupted(self, stop):
        """Ctrl-C or a stop signal: checkpoint the completed updates, write the `stopped` file
        and say how to continue (every process)."""
        with defer_interrupts():
            path = self.checkpoint()
            run_on_main(mark_stopped, self.out, exit_status(stop))
        self.tracker.close()  # after the checkpoint: closing may take a moment
        if self.main:  # printed even without progress output
            tqdm.write(f"{stop_reason(stop)}: {path} holds {self.completed} update(s); "
                       f"continue with --resume {self.out}")
        barrier()  # no process exits (and makes torchrun stop the others) before the save

    def finish(self, evaluate_now, interrupted, hook, summarize: Callable[[dict], dict]):
        """The final evaluation, final/ checkpoint and summary.json (`summarize(final figures)`)
        once every step is done; returns (final figures, summary)."""
        stop_if_interrupted(interrupted)
        hook("final_eval", self.completed)
        final = evaluate_now()
        stop_if_interrupted(interrupted)
        with defer_interrupts():
            hook("final_save", self.completed)
            self.last_eval = final
            self.log_eval(final)
            self.checkpoint("final")
            summary = summarize(final)
            run_on_main(self._write_summary, summary)
            self.tracker.close()
        # the replicas must have made identical updates (checked once the files are safe)
        check_replicas_agree(self.model if self.replica is None else self.replica)
        check_states_agree(self.states)
        return final, summary

    def _write_summary(self, summary):
        """summary.json and metrics.png (rank 0)."""
        atomic_write_json(self.out / "summary.json", summary)
        self.plot()


# A run stops (with a checkpoint of its last finite weights) after this many steps in a row whose
# loss or gradient was NaN/inf: the updates were skipped, and more of the same will not help.
MAX_BAD_STEPS = 3


class StepRun(RunDir):
    """The GRPO loop's run: `RunDir` with a metrics row and samples.jsonl per step, the first
    evaluations (`start`) and what follows each step (`after_step`): its printed line, the
    stop after non-finite steps, the evaluation and the checkpoint that are due."""

    def __init__(self, out, model, tokenizer, optimizer, config, columns, plot_columns,
                 replica=None, states=None):
        super().__init__(out, model, tokenizer, optimizer, config, columns, plot_columns,
                         replica=replica, states=states)
        self.bad_steps = 0  # consecutive steps with a non-finite loss or gradient

    def _open_logs(self, resumed):
        """`open_logs` on rank 0, samples.jsonl cut back to a resumed step as well."""
        super()._open_logs(resumed)
        truncate_samples(self.out / "samples.jsonl", self.completed)

    def start(self, evaluate_now, interrupted, hook, eval_examples):
        """Before the first step: the base model's evaluation (unless restored), and the one a
        stop interrupted."""
        if self.base is None:
            hook("base_eval", 0)
            self.base = self.last_eval = evaluate_now()
            self.log_eval(self.base)
            print_line(self.config, f"base model: held-out {eval_line(self.base)} "
                                    f"({eval_examples} examples)")
        if self.eval_pending and self.completed < self.config.steps:  # stopped mid-evaluation
            stop_if_interrupted(interrupted)
            self._evaluate(evaluate_now, hook)

    def log_step(self, row, samples):
        """Stage 6: the step's metrics row (rank 0), its completions every `sample_every` steps,
        and the counters that say what is due next."""
        if self.main:
            self.log.append(row)
            every = self.config.sample_every
            sampled = bool(every and row["step"] % every == 0)
            if sampled:
                append_samples(self.out / "samples.jsonl", row["step"], samples)
            self.tracker.log_row(row)
            self.tracker.log_rollouts(row["step"], samples, with_text=sampled)
        config = self.config
        self.completed = row["step"]
        self.eval_pending = bool(config.eval_every and self.completed % config.eval_every == 0
                                 and self.completed < config.steps)
        self.bad_steps = self.bad_steps + 1 if row["skipped"] else 0
        self.keep_states()

    def after_step(self, bar, row, evaluate_now, interrupted, hook):
        """The progress bar and printed line of a finished step, then what is due: a stop after
        MAX_BAD_STEPS non-finite steps, the evaluation, a checkpoint."""
        bar.update(1)
        bar.set_postfix(reward=f"{row['reward_mean']:.2f}",
                        correct=f"{row.get('correct_mean', 0):.2f}",
                        acc=f"{self.last_eval['accuracy']:.2f}")
        print_line(self.config, row_line(row))
        if row["skipped"]:
            print_line(self.config, f"step {row['step']}: non-finite loss or gradient, update "
                                    "skipped")
        if self.bad_steps >= MAX_BAD_STEPS:
            self._stop_after_bad_steps()
        if self.eval_pending:
            stop_if_interrupted(interrupted)
            self._evaluate(evaluate_now, hook)
        if self.checkpoint_due():
            with defer_interrupts():
                hook("checkpoint", self.completed)
                self.checkpoint()

    def _evaluate(self, evaluate_now, hook):
        """The evaluation due after step `completed` (`evaluate_step`), printed."""
        figures = self.evaluate_step(evaluate_now, hook)
        print_line(self.config, f"step {self.completed}: EVAL {eval_line(figures)}")

    def _stop_after_bad_steps(self):
        """Save the (finite) weights and stop: several updates in a row were NaN/inf and
        skipped."""
        with defer_interrupts():
            path = self.checkpoint()
        barrier()  # every process raises: none before rank 0 has saved
        raise FloatingPointError(
            f"{self.bad_steps} steps in a row had a non-finite loss or gradient and were "
            f"skipped; stopping. {path} holds the last finite weights; lower --lr or "
            f"--max-grad-norm, or check the rewards, before resuming")


def check_states_agree(states: dict) -> None:
    """Raise RuntimeError on every process if a learner's state (name -> object with
    `state_dict`; the checksum of its tensors) differs between the processes; nothing for one
    process. Like `distributed.check_replicas_agree` for the model."""
    for name, learner in states.items() if world_size() > 1 else ():
        tensors = state_to_flat(learner.state_dict())[0].values()
        check_same_on_all_ranks(params_checksum(tensors), f"the {name}'s state")


def row_line(row):
    """One printed line per step."""
    keys = [("reward_mean", "reward"), ("correct_mean", "correct"), ("format_mean", "format"),
            ("loss", "loss"), ("kl", "kl"), ("entropy", "entropy"), ("len_mean", "len"),
            ("zero_adv_frac", "zero_adv"), ("proc_step_correct_rate", "steps_ok"),
            ("step_time", "s")]
    parts = [f"step {row['step']}"] + [f"{name} {row[k]:.3f}" for k, name in keys
                                       if isinstance(row.get(k), float)]
    return " | ".join(parts)


def eval_line(figures):
    """One line of evaluation figures (accuracy, format, think accuracy, step correctness)."""
    def f(v):
        return "n/a" if v is None else f"{v:.3f}"
    return (f"accuracy {f(figures.get('accuracy'))}, format rate "
            f"{f(figures.get('format_rate'))}, accuracy in think format "
            f"{f(figures.get('think_accuracy'))}, step correctness "
            f"{f(figures.get('step_correctness'))}")


def print_line(config, msg):
    """A line above the progress bar, when the run shows progress."""
    if config.progress:
        tqdm.write(msg)


def stop_if_interrupted(interrupted):
    """Raise KeyboardInterrupt (StopSignal for SIGTERM & co.) on every process if Ctrl-C or a
    stop signal reached any of them: every process passes these points in the same order, so
    they all stop at the same one."""
    signum = interrupted.signum  # one process: 0 (a stop raises where it lands)
    if interrupted.agreed:
        signum = int(all_reduce_max([signum])[0])
    if signum:
        raise interrupt_exception(signum)


def hf_export_due(path, config) -> bool:
    """Whether the checkpoint at `path` gets the whole weights in HF layout beside an FSDP run's
    shards: final/ always, checkpoint-<k> when `config.export_hf_checkpoints`."""
    return path.name == "final" or config.export_hf_checkpoints


@contextlib.contextmanager
def stoppable_before_run(stop_signals: str):
    """Work a run does before it has anything to checkpoint (chapter 9's teacher: evaluated by
    every process, then sampled by rank 0), stoppable as the run's own phases are. One process:
    the stop signals raise StopSignal where they land. Several: each records them, the decode
    loops agree every STOP_CHECK_EVERY tokens (`distributed.AgreedStop`; a process waiting for
    rank 0's work answers its polls), so every process raises at the same poll; a signal
    recorded outside a decode loop raises at the end of the block, on every process."""
    with record_interrupts(enabled=world_size() > 1, signals=stop_signals) as interrupted:
        with polling_stops(agreed_stop(interrupted)):
            yield
        stop_if_interrupted(interrupted)


def write_run_config(out, config):
    """`out`/config.json: the run's settings and process count (rank 0). A directory holding it
    and no checkpoint is resumed by starting over in place with these settings."""
    atomic_write_json(Path(out) / "config.json", {**asdict(config), "world_size": world_size()})


def mark_stopped(out, status):
    """`out`/stopped holding the exit status of a stopped run (rank 0; see STOPPED_FILE)."""
    (out / STOPPED_FILE).write_text(f"{status}\n")


def fresh_dir(path):
    """An empty directory at `path` (rank 0), for the shards of a checkpoint being written."""
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def prepare_new_run_dir(out, overwrite):
    """Refuse (or, with `overwrite`, clear) a directory that holds a run; rank 0 does this."""
    if overwrite:
        clear_run_dir(out)
    check_new_run_dir(out)
