"""A training run's logs: metrics.csv (one row per optimizer step) and samples.jsonl; runs that
are seeds of one setting, found by their config.json (`seed_groups`).

Both are kept consistent with the run's checkpoints: on resume from the checkpoint after step k,
rows and samples of later steps (written before the interruption) are dropped, so a resumed run's
logs equal an uninterrupted run's, row for row.
"""

from __future__ import annotations

import csv
import io
import json
import warnings
from pathlib import Path

import torch

from .files import atomic_write_text, read_json

# config.json keys that do not make runs different settings: seeds of one setting differ in these
NOT_SETTINGS = ("seed", "output_dir", "progress", "report_to", "world_size")

# evaluation figure -> metrics.csv column (filled at evaluation steps only; GRPO and distillation)
EVAL_COLUMNS = {"accuracy": "eval_accuracy", "format_rate": "eval_format_rate",
                "think_accuracy": "eval_think_accuracy",
                "step_correctness": "eval_step_correctness"}


# A step's costs (training.step_costs; training.py's module docstring says what counts)

def forward_tokens(batch, config, with_reference: bool, total=list) -> tuple[int, int]:
    """Tokens the policy and its reference read in a step without sampling them, and the right
    padding they also computed (summed over the processes by `total`; module docstring)."""
    prefill = sum(s.get("prompt_tokens", 0) for s in batch.samples)  # the whole step's
    passes = config.inner_epochs + (config.inner_epochs > 1) + with_reference
    real, padding = total([float(n * passes) for n in padding_tokens(batch)])
    return int(prefill + real), int(padding)


def padding_tokens(batch) -> tuple[int, int]:
    """(real, right padding) positions of the rows: real is the prompt without left padding and
    the completion up to its last loss token (all of it in a row without one)."""
    cm = batch.completion_mask  # (B, Tc)
    last = (cm.long() * torch.arange(1, cm.shape[1] + 1, device=cm.device)).amax(-1)  # (B,)
    am = torch.ones_like(batch.input_ids) if batch.attention_mask is None \
        else batch.attention_mask
    completion = int(torch.where(last > 0, last, cm.shape[1]).sum())
    real = int(am[:, :batch.prompt_len].sum()) + completion
    return real, int(am.sum()) - real


def eval_cells(figures: dict, columns: dict = EVAL_COLUMNS) -> dict:
    """The metrics.csv cells of an evaluation's figures ({figure: column}); None stays empty."""
    return {col: figures[k] for k, col in columns.items() if figures.get(k) is not None}


def format_cell(v):
    """CSV cell: floats with 6 significant digits, None empty, the rest as is."""
    if v is None:
        return ""
    return f"{v:.6g}" if isinstance(v, float) else v


class MetricsLog:
    """metrics.csv, one row per step; rows past `keep_upto` (a resumed step) are dropped.

    Every change rewrites the whole file atomically (a temp file renamed over it) instead of
    appending a line: a run killed mid-write then leaves the previous, complete file, never a
    half-written last row. That loses nothing: the row being written belongs to a step that no
    checkpoint holds yet, so a resume runs that step again. Dropping a cut-off row when reading
    would lose no more, but every reader (a plot of a live run, compare_runs.py) would have to
    know to; `_read_rows` does it only for files written before the writes were atomic.
    The rows' CSV lines are kept in memory, so a row costs one write of the file: about 2-8 ms
    at 1000 rows (benchmarks/bench_metrics_log.py), against seconds per training step.
    """

    def __init__(self, path: Path, columns, keep_upto: int | None = None):
        self.path, self.columns = Path(path), list(columns)
        self.rows: list[dict] = []  # the file's rows (cells formatted) ...
        if keep_upto is not None and self.path.exists():
            self.rows = [r for r in _read_rows(self.path) if int(r["step"]) <= keep_upto]
        self._lines = [self._line(r) for r in self.rows]  # ... and their CSV lines
        self._write(self._lines)

    def append(self, row: dict):
        """Add one row (missing columns stay empty)."""
        cells = {k: format_cell(row.get(k, "")) for k in self.columns}
        line = self._line(cells)
        self._write([*self._lines, line])
        self.rows.append(cells)  # only once the file holds it
        self._lines.append(line)

    def patch_last_row(self, cells: dict):
        """Fill cells of the last row (an evaluation that finished after the row was written)."""
        if not self.rows:
            return
        last = {**self.rows[-1], **{k: format_cell(v) for k, v in cells.items()}}
        line = self._line(last)
        self._write([*self._lines[:-1], line])
        self.rows[-1], self._lines[-1] = last, line

    def _line(self, cells: dict) -> str:
        """One row as a CSV line (formatted once: rewriting the file only joins the lines)."""
        buf = io.StringIO()
        csv.DictWriter(buf, fieldnames=self.columns).writerow(cells)
        return buf.getvalue()

    def _write(self, lines):
        """Replace the file with a header and `lines`, atomically."""
        header = self._line({c: c for c in self.columns})
        atomic_write_text(self.path, header + "".join(lines))


def _whole_lines(path, text: str) -> str:
    """`text` (a log file's) without a last line that lacks its line end, with a warning: an
    append cut short by a kill. That line belongs to a step no checkpoint holds yet (its row
    and samples are written before the step's checkpoint), so a resume runs the step again."""
    if text and not text.endswith("\n"):
        cut = text.rfind("\n") + 1
        warnings.warn(f"{path}: dropped a truncated last line (a write cut short by a kill): "
                      f"{text[cut:][:80]!r}", stacklevel=3)
        text = text[:cut]
    return text


def _read_rows(path) -> list[dict]:
    """A metrics.csv's rows as dicts of strings, a truncated last line dropped (`_whole_lines`;
    files written before MetricsLog wrote atomically can hold one): its cut-off cells would
    read as wrong numbers, or a cut-off step as an earlier step."""
    with open(path, newline="", encoding="utf-8") as f:
        text = _whole_lines(path, f.read())
    return list(csv.DictReader(io.StringIO(text, newline="")))


def read_metrics(path) -> list[dict]:
    """Rows of a metrics.csv as dicts of floats (empty cells become None)."""
    return [{k: (float(v) if v not in ("", None) else None) for k, v in row.items()}
            for row in _read_rows(path)]


def append_samples(path, step: int, samples: list[dict]):
    """Append a step's completions to samples.jsonl, one JSON object per line."""
    with open(path, "a", encoding="utf-8") as f:
        for s in samples:
            f.write(json.dumps({"step": step, **s}, ensure_ascii=False) + "\n")


def truncate_samples(path, last_step: int):
    """Keep only samples.jsonl lines of steps <= `last_step` (create the file if missing); a
    truncated last line (`append_samples` cut short by a kill) is dropped."""
    path = Path(path)
    text = _whole_lines(path, path.read_text(encoding="utf-8")) if path.exists() else ""
    lines = text.splitlines(keepends=True)
    atomic_write_text(path, "".join(ln for ln in lines if json.loads(ln)["step"] <= last_step))


def seed_groups(run_dirs) -> list[tuple[str, list[Path]]]:
    """Run directories grouped by their setting: runs whose config.json agree on everything but
    `NOT_SETTINGS` (the seed, where they are written) form one group, in order of appearance.
    A run without config.json is a group of its own. Labels: a lone run's directory name; with
    several settings, what differs between them ("lr=0.0001, beta=0.05", at most three keys);
    "(N seeds)" is added where a group holds N > 1 runs."""
    dirs = [Path(d) for d in run_dirs]
    for d in dirs:
        if not (d / "metrics.csv").is_file():
            raise FileNotFoundError(f"{d / 'metrics.csv'} not found: {d} is not a training run "
                                    "directory")
    settings = {d: ({k: v for k, v in read_json(d / "config.json").items()
                     if k not in NOT_SETTINGS} if (d / "config.json").is_file() else None)
                for d in dirs}
    groups: list[list[Path]] = []
    for d in dirs:
        same = [g for g in groups if settings[d] is not None and settings[g[0]] == settings[d]]
        if same:
            same[0].append(d)
        else:
            groups.append([d])
    known = [settings[g[0]] for g in groups if settings[g[0]] is not None]
    varying = sorted({k for s in known for k in s if any(t.get(k) != s.get(k) for t in known)})
    out = []
    for g in groups:
        s = settings[g[0]]
        label = g[0].name
        if s is not None and len(groups) > 1 and 0 < len(varying) <= 3:
            label = ", ".join(f"{k}={s.get(k)}" for k in varying)
        out.append((label + (f" ({len(g)} seeds)" if len(g) > 1 else ""), g))
    return out
