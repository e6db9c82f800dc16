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
from pathlib import Path

from .files import atomic_write_text, read_json

# config.json keys that do not make runs different settings: seeds of one setting differ in these
NOT_SETTINGS = ("seed", "output_dir", "progress", "report_to", "world_size")

# evaluation figure -> metrics.csv column (filled at evaluation steps only; GRPO and distillation)
EVAL_COLUMNS = {"accuracy": "eval_accuracy", "format_rate": "eval_format_rate",
                "think_accuracy": "eval_think_accuracy",
                "step_correctness": "eval_step_correctness"}


def eval_cells(figures: dict, columns: dict = EVAL_COLUMNS) -> dict:
    """The metrics.csv cells of an evaluation's figures ({figure: column}); None stays empty."""
    return {col: figures[k] for k, col in columns.items() if figures.get(k) is not None}


def format_cell(v):
    """CSV cell: floats with 6 significant digits, None empty, the rest as is."""
    if v is None:
        return ""
    return f"{v:.6g}" if isinstance(v, float) else v


class MetricsLog:
    """metrics.csv, one row per step; rows past `keep_upto` (a resumed step) are dropped."""

    def __init__(self, path: Path, columns, keep_upto: int | None = None):
        self.path, self.columns = Path(path), list(columns)
        rows = []
        if keep_upto is not None and self.path.exists():
            with open(self.path, newline="") as f:
                rows = [r for r in csv.DictReader(f) if int(r["step"]) <= keep_upto]
        self._write(rows)

    def append(self, row: dict):
        """Add one row (missing columns stay empty)."""
        with open(self.path, "a", newline="") as f:
            csv.DictWriter(f, fieldnames=self.columns).writerow(
                {k: format_cell(row.get(k, "")) for k in self.columns})

    def patch_last_row(self, cells: dict):
        """Fill cells of the last row (an evaluation that finished after the row was written)."""
        with open(self.path, newline="") as f:
            rows = list(csv.DictReader(f))
        if rows:
            rows[-1].update({k: format_cell(v) for k, v in cells.items()})
        self._write(rows)

    def _write(self, rows):
        """Replace the file with a header and `rows`, atomically."""
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=self.columns)
        writer.writeheader()
        writer.writerows(rows)
        atomic_write_text(self.path, buf.getvalue())


def read_metrics(path) -> list[dict]:
    """Rows of a metrics.csv as dicts of floats (empty cells become None)."""
    with open(path, newline="") as f:
        return [{k: (float(v) if v not in ("", None) else None) for k, v in row.items()}
                for row in csv.DictReader(f)]


def append_samples(path, step: int, samples: list[dict]):
    """Append a step's completions to samples.jsonl, one JSON object per line."""
    with open(path, "a", encoding="utf-8") as f:
        for s in samples:
            f.write(json.dumps({"step": step, **s}, ensure_ascii=False) + "\n")


def truncate_samples(path, last_step: int):
    """Keep only samples.jsonl lines of steps <= `last_step` (create the file if missing)."""
    path = Path(path)
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True) if path.exists() else []
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
