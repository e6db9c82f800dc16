"""Watching a run live: its metrics, evaluations, reward histograms and sampled completions sent
to TensorBoard and/or Weights & Biases as the training loop writes them (`report_to`).

A loop opens one `RunTracker` (`open_tracker`) and calls it where it writes its logs today:
`log_row` with each metrics.csv row (every column a scalar "train/<column>" at the row's step),
`log_eval` with an evaluation's cells ("eval/<figure>"), `log_rollouts` with a GRPO step's
completions (histograms of their rewards and advantages every step; every `sample_every`-th
step a few completions as text, with their rewards and, under process supervision, each step's
score). With no backend chosen (the default) every call returns at once, so a run without
`report_to` does what it did before.

The backends are the ones TRL's `report_to` and PyTorch offer: `torch.utils.tensorboard`'s
SummaryWriter, writing event files into `<run>/tensorboard/` (`tensorboard --logdir <run>`), and
`wandb`, writing `<run>/wandb/`, offline unless a W&B account is configured and its server
answers (`wandb_mode`). Both are optional dependencies (the `tensorboard` and `wandb` extras);
they are imported when a run asks for them (`load_backend`), not with this module: importing
them takes about 0.5 s and 1.4 s, which every run without `report_to` would otherwise pay.
Only rank 0 of a data-parallel run reports (`open_tracker`).
"""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import netrc
import os
import socket
from collections.abc import Iterable, Sequence
from pathlib import Path
from urllib.parse import urlparse

import torch

from .distributed import is_main

# The backends: the module each imports, and the package it needs (also the name of its extra).
BACKENDS = {"tensorboard": ("torch.utils.tensorboard", "tensorboard"),
            "wandb": ("wandb", "wandb")}
REPORT_CHOICES = ("none", *BACKENDS)
TENSORBOARD_DIR = "tensorboard"  # inside the run directory
WANDB_PROJECT = "reasoning-from-scratch"  # unless WANDB_PROJECT is set
TEXT_GROUPS = 2  # completions shown as text: the best and the worst of this many prompts
# Sample keys that are not reward terms (the terms are shown next to the total reward).
SAMPLE_FIELDS = ("step", "problem", "answer", "text", "reward", "advantage", "length", "truncated",
                 "steps", "step_rewards")


def report_targets(report_to) -> tuple[str, ...]:
    """The chosen backends as a tuple: from a name, comma-separated names or a list of names;
    "none" (or nothing) chooses none."""
    names = report_to.split(",") if isinstance(report_to, str) else list(report_to or ())
    names = [n.strip() for n in names if n.strip()]
    unknown = [n for n in names if n not in REPORT_CHOICES]
    if unknown:
        raise ValueError(f"report_to: unknown {unknown}; choose from {list(REPORT_CHOICES)}")
    return tuple(dict.fromkeys(n for n in names if n != "none"))


def report_problem(report_to) -> str | None:
    """The config rule of `report_to` (validation.py's form): what is wrong with it, or None."""
    try:
        report_targets(report_to)
    except ValueError as err:
        return str(err).removeprefix("report_to: ")
    return None


def missing_backend(name: str) -> str | None:
    """The one-line error for a backend whose package is not installed, else None (the check
    imports nothing, so a command line can refuse early at no cost)."""
    package = BACKENDS[name][1]
    if importlib.util.find_spec(package):
        return None
    return (f"{name} logging needs the {package} package: pip install -e \".[{package}]\" "
            f"(or pip install {package})")


def load_backend(name: str):
    """The backend's module (`torch.utils.tensorboard` or `wandb`), or ImportError whose one
    line names the extra that installs it."""
    problem = missing_backend(name)
    if problem:
        raise ImportError(problem)
    return importlib.import_module(BACKENDS[name][0])


def scalar_tag(column: str, evaluation: bool = False) -> str:
    """The scalar's name of a metrics.csv column: "train/<column>", or "eval/<figure>" for an
    evaluation column (eval_accuracy -> eval/accuracy)."""
    return f"eval/{column.removeprefix('eval_')}" if evaluation else f"train/{column}"


def wandb_mode() -> str:
    """WANDB_MODE when set; else "online" when an API key is configured (WANDB_API_KEY or
    `wandb login`'s ~/.netrc entry) and the W&B server answers within 3 s, else "offline"
    (the run is written to disk; `wandb sync` uploads it later)."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    if not (os.environ.get("WANDB_API_KEY") or _netrc_has(host)):
        return "offline"
    try:
        socket.create_connection((host, 443), timeout=3).close()
    except OSError:
        return "offline"
    return "online"


def _netrc_has(host: str) -> bool:
    """Whether ~/.netrc holds credentials for `host` (where `wandb login` keeps the key)."""
    try:
        return netrc.netrc().authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


# ----------------------------------------------------------------------------------------------
# Backends: scalars, histograms, text
# ----------------------------------------------------------------------------------------------

class TensorBoardBackend:
    """Event files in `<run>/tensorboard/`, flushed after every step (readable while running)."""

    def __init__(self, run_dir: Path, resume_step: int | None):
        tb = load_backend("tensorboard")
        # purge_step: a resumed run hides the events an interrupted session wrote after its
        # checkpoint, as metrics.csv drops those rows (TensorBoard's "purge" of orphaned data)
        self.writer = tb.SummaryWriter(
            log_dir=str(Path(run_dir) / TENSORBOARD_DIR),
            purge_step=None if resume_step is None else resume_step + 1)

    def scalars(self, values: dict, step: int):
        for tag, v in values.items():
            self.writer.add_scalar(tag, v, step)

    def histograms(self, values: dict, step: int):
        for tag, xs in values.items():
            self.writer.add_histogram(tag, torch.tensor(xs, dtype=torch.float32), step)

    def samples(self, tag: str, rows: list[dict], step: int):
        self.writer.add_text(tag, samples_markdown(rows), step)

    def flush(self):
        self.writer.flush()

    def close(self):
        self.writer.close()


class WandbBackend:
    """A W&B run in `<run>/wandb/` (offline unless `wandb_mode` finds an account online)."""

    def __init__(self, run_dir: Path, config: dict):
        self.wandb = load_backend("wandb")
        mode = wandb_mode()
        self.run = self.wandb.init(
            project=os.environ.get("WANDB_PROJECT", WANDB_PROJECT), name=Path(run_dir).name,
            dir=str(run_dir), config=config, mode=mode)
        if mode == "offline":
            print(f"W&B offline: upload later with `wandb sync {Path(self.run.dir).parent}`")

    def scalars(self, values: dict, step: int):
        self.run.log(values, step=step)

    def histograms(self, values: dict, step: int):
        self.run.log({tag: self.wandb.Histogram(xs) for tag, xs in values.items()}, step=step)

    def samples(self, tag: str, rows: list[dict], step: int):
        table = self.wandb.Table(columns=["problem", "answer", "completion", "reward",
                                          "advantage", "step scores"])
        for s in rows:
            table.add_data(s["problem"], s["answer"], s["text"], s["reward"], s["advantage"],
                           " | ".join(f"{r:.2f}" for r in s.get("step_rewards") or []))
        self.run.log({tag: table}, step=step)

    def flush(self):
        pass  # W&B's own process writes (and uploads) as the run goes

    def close(self):
        self.run.finish()


# ----------------------------------------------------------------------------------------------
# What the loops call
# ----------------------------------------------------------------------------------------------

class RunTracker:
    """What a training loop reports as it runs, sent to every chosen backend (none: nothing)."""

    def __init__(self, backends: Sequence = ()):
        self.backends = list(backends)

    def log_row(self, row: dict):
        """A metrics.csv row: each numeric cell as the scalar "train/<column>" at row["step"]."""
        self._scalars({scalar_tag(k): v for k, v in row.items() if k != "step"}, row["step"])

    def log_eval(self, cells: dict, step: int):
        """An evaluation's metrics.csv cells ({column: value}) as "eval/<figure>" scalars."""
        self._scalars({scalar_tag(k, evaluation=True): v for k, v in cells.items()}, step)

    def log_rollouts(self, step: int, samples: list[dict], with_text: bool):
        """Histograms of a GRPO step's rewards and advantages; with_text: also a few of its
        completions (`pick_samples`) as text."""
        if not self.backends or not samples:
            return
        hist = {"rollouts/reward": [s["reward"] for s in samples],
                "rollouts/advantage": [s["advantage"] for s in samples]}
        shown = pick_samples(samples) if with_text else []
        for b in self.backends:
            b.histograms(hist, step)
            if shown:
                b.samples("samples", shown, step)
            b.flush()

    def close(self):
        """Flush and close every backend (a later call logs nothing)."""
        for b in self.backends:
            b.close()
        self.backends = []

    def _scalars(self, values: dict, step: int):
        if not self.backends:
            return
        values = {k: float(v) for k, v in values.items() if isinstance(v, (int, float))}
        for b in self.backends:
            b.scalars(values, step)
            b.flush()


def open_tracker(report_to: Iterable[str], run_dir, config: dict,
                 resume_step: int | None = None) -> RunTracker:
    """The tracker of a run in `run_dir` reporting to `report_to` (`report_targets`); on ranks
    other than 0 and without backends, one that does nothing. resume_step: the step a resumed
    run continues after (its earlier session's later events are hidden)."""
    names = report_targets(report_to)
    if not names or not is_main():
        return RunTracker()
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    backends = []
    for name in names:
        if name == "tensorboard":
            backends.append(TensorBoardBackend(Path(run_dir), resume_step))
        else:
            backends.append(WandbBackend(Path(run_dir), config))
    return RunTracker(backends)


def pick_samples(samples: list[dict], groups: int = TEXT_GROUPS) -> list[dict]:
    """The completions worth reading from a step: the best and the worst (by reward) of each of
    its first `groups` prompts (a group's rollouts are consecutive samples)."""
    out = []
    for _, group in itertools.islice(itertools.groupby(samples, key=lambda s: s["problem"]),
                                     groups):
        ranked = sorted(group, key=lambda s: -s["reward"])
        out += ranked[:1] + ranked[1:][-1:]  # the best, then the worst (if it is another)
    return out


def samples_markdown(samples: list[dict]) -> str:
    """Completions as Markdown (TensorBoard's text panel): problem, rewards, the text, and a
    table of each step with its score when the sample carries step rewards."""
    parts = []
    for s in samples:
        terms = ", ".join(f"{k} {v:.2f}" for k, v in s.items()
                          if k not in SAMPLE_FIELDS and isinstance(v, (int, float)))
        head = (f"**problem** {s['problem']} · **answer** {s['answer']}  \n"
                f"reward **{s['reward']:.3f}**{f' ({terms})' if terms else ''} · advantage "
                f"{s['advantage']:+.3f} · {s['length']} tokens"
                f"{' (truncated)' if s.get('truncated') else ''}")
        body = "\n".join("    " + line for line in s["text"].splitlines() or [""])
        parts.append(f"{head}\n\n{body}")
        if s.get("step_rewards") is not None:
            rows = [f"| {r:.3f} | {_one_line(t)} |" for t, r in zip(s["steps"], s["step_rewards"])]
            parts.append("| step score | step |\n|---:|---|\n" + "\n".join(rows))
    return "\n\n---\n\n".join(parts)


def _one_line(text: str) -> str:
    """A step's text in one table cell (Markdown tables hold no line breaks or bare pipes)."""
    return " ".join(text.split()).replace("|", "\\|") or " "

