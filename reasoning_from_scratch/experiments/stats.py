"""Shared pieces of the multi-run experiments (chapter 7's variant table, chapter 8's
outcome-vs-process study): mean +- sd over seeds, table cells, strict JSON, run directories that
are reused when finished with the same settings and resumed when interrupted."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

from ..checkpoints import find_checkpoint
from ..evaluation import evaluate_policy
from ..files import atomic_write_json

SETTINGS_FILE = "settings.json"


def finite_values(xs):
    """The values as floats, without None and NaN."""
    return [float(x) for x in xs if x is not None and not math.isnan(float(x))]


def mean_std(xs):
    """(mean, sample sd) of the values that are not None / NaN; (nan, nan) if none are."""
    xs = finite_values(xs)
    if not xs:
        return math.nan, math.nan
    m = sum(xs) / len(xs)
    s = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    return m, s


def stat(xs):
    """{"mean", "sd"} of `mean_std(xs)`: a table cell, as results.json holds it."""
    m, s = mean_std(xs)
    return {"mean": m, "sd": s}


def format_pm(st, digits=3):
    """A table cell "mean ± sd" ("n/a" without a mean)."""
    m, s = st["mean"], st["sd"]
    return "n/a" if math.isnan(m) else f"{m:.{digits}f} ± {s:.{digits}f}"


def format_value(v, digits=3):
    """A figure with `digits` decimals, or "n/a" for None / NaN."""
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{digits}f}"


def jsonable(obj):
    """NaN -> None and tuples -> lists, recursively (results files stay strict JSON)."""
    if isinstance(obj, float):
        return None if math.isnan(obj) else obj
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    return obj


def settings_diff(a, b):
    """The keys whose values differ, as "key: old -> new" (for error messages)."""
    keys = sorted(set(a) | set(b), key=str)
    return ", ".join(f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in keys if a.get(k) != b.get(k))


def resume_point(run_dir, settings):
    """Where an unfinished run of an experiment starts: its latest intact checkpoint when the
    directory holds a run with the same settings, else None after clearing the directory (a
    run with other settings, or one that never reached a checkpoint, starts afresh)."""
    run_dir = Path(run_dir)
    resume = None
    if run_dir.exists():
        try:
            same = json.loads((run_dir / SETTINGS_FILE).read_text()) == settings
            resume = find_checkpoint(run_dir) if same else None
        except (FileNotFoundError, ValueError):  # no settings, no intact checkpoint
            resume = None
        if resume is None:
            shutil.rmtree(run_dir)
        else:
            print(f"{run_dir}: resuming from {resume}")
    return resume


def cached_base_figures(model, tokenizer, held_out, device, config, identity: dict, out: Path):
    """The base model's held-out figures (step 0 of every curve), evaluated once per setting and
    cached in out/base.json; `identity` names what else the figures depend on (model, split)."""
    settings = {**identity, "eval_examples": config.eval_examples,
                "max_new_tokens": config.eval_max_new_tokens or config.max_new_tokens}
    path = Path(out) / "base.json"
    if path.is_file():
        saved = json.loads(path.read_text())
        if saved.get("settings") == settings:
            return saved["figures"]
    figures = evaluate_policy(model, tokenizer, held_out[:config.eval_examples], device,
                              config.eval_tokens, config.eval_batch_size)
    atomic_write_json(path, {"settings": settings, "figures": jsonable(figures)})
    return figures
