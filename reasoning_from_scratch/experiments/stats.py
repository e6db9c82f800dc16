"""Shared pieces of the multi-run experiments (chapter 7's variant table, chapter 8's
outcome-vs-process study): mean +- sd over seeds, paired bootstrap intervals over problems and
seeds, table cells, strict JSON, run directories that are reused when finished with the same
settings and resumed when interrupted."""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import MISSING, fields
from pathlib import Path

import torch

from ..checkpoints import find_checkpoint
from ..evaluation import evaluate_policy
from ..files import atomic_write_json
from ..training import GRPOConfig

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


def bootstrap_draws(n_seeds: int, n_problems: int, n_boot: int = 2000, seed: int = 0):
    """`n_boot` resamples, with replacement, of the seeds and of the problems: (seed indices
    (B, S), problem indices (B, N)), from a `torch.Generator` seeded with `seed`. Every arm is
    read on the same draws, so a difference between two arms is paired: the same problems
    and the same seeds on both sides."""
    g = torch.Generator().manual_seed(seed)
    seeds = torch.randint(n_seeds, (n_boot, n_seeds), generator=g)
    problems = torch.randint(n_problems, (n_boot, n_problems), generator=g)
    return seeds, problems


def resampled_statistic(values, draws, denominators=None) -> torch.Tensor:
    """(B,): the statistic of each resample of `draws` (`bootstrap_draws`).

    `values` (S, N): one figure per seed and problem. Each resample takes the mean over its
    seeds of each seed's mean over its problems; with `denominators` (S, N), each seed's ratio
    of sums over its problems instead (step correctness: verified steps / all steps), NaN where
    a resample has no denominator.
    """
    seed_idx, prob_idx = draws
    out = []
    for lo in range(0, seed_idx.shape[0], 250):  # chunks of resamples: bounded memory
        rows = (seed_idx[lo:lo + 250, :, None], prob_idx[lo:lo + 250, None, :])
        x = torch.as_tensor(values, dtype=torch.float64)[rows]  # (b, S, N)
        if denominators is None:
            per_seed = x.mean(2)
        else:
            d = torch.as_tensor(denominators, dtype=torch.float64)[rows].sum(2)
            per_seed = torch.where(d > 0, x.sum(2) / d.clamp(min=1e-12), math.nan)
        out.append(per_seed.mean(1))
    return torch.cat(out)


def paired_bootstrap(values, denominators=None, reference=None, reference_denominators=None,
                     n_boot: int = 2000, seed: int = 0, level: float = 0.95) -> dict:
    """{"mean", "lo", "hi"}: the statistic of `values` (S seeds x N problems; see
    `resampled_statistic`) and its `level` percentile interval over `n_boot` resamples of
    problems and seeds together; with `reference` (S, N, same seeds and problems in the same
    order), of the difference values - reference, both read on the same resamples (paired).

    The interval is the bootstrap's percentile interval (Efron and Tibshirani 1993, ch. 13):
    it reflects the variation between problems and between seeds; the budget of an "at
    outcome's tokens" figure is held fixed.
    """
    values = torch.as_tensor(values, dtype=torch.float64)
    if values.ndim != 2 or values.numel() == 0:
        raise ValueError(f"paired_bootstrap: values must be seeds x problems, got shape "
                         f"{tuple(values.shape)}")
    if reference is not None and tuple(torch.as_tensor(reference).shape) != tuple(values.shape):
        raise ValueError(f"paired_bootstrap: reference has shape "
                         f"{tuple(torch.as_tensor(reference).shape)}, values "
                         f"{tuple(values.shape)}: pair the same seeds and problems")
    full = (torch.arange(values.shape[0])[None], torch.arange(values.shape[1])[None])
    draws = bootstrap_draws(*values.shape, n_boot=n_boot, seed=seed)
    point = resampled_statistic(values, full, denominators)  # (1,): the data themselves
    samples = resampled_statistic(values, draws, denominators)  # (B,)
    if reference is not None:
        point = point - resampled_statistic(reference, full, reference_denominators)
        samples = samples - resampled_statistic(reference, draws, reference_denominators)
    samples = samples[~torch.isnan(samples)]
    if samples.numel() == 0:
        return {"mean": float(point[0]), "lo": math.nan, "hi": math.nan}
    q = torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64)
    lo, hi = torch.quantile(samples, q).tolist()
    return {"mean": float(point[0]), "lo": lo, "hi": hi}


def format_interval(st, digits=3):
    """A table cell "mean [lo, hi]" ("n/a" without a mean)."""
    m = st.get("mean") if st else None
    if m is None or math.isnan(m):
        return "n/a"
    lo, hi = st.get("lo"), st.get("hi")
    if lo is None or hi is None or math.isnan(lo) or math.isnan(hi):
        return f"{m:.{digits}f}"
    return f"{m:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


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


def _shown(settings, key):
    """A setting's value for `settings_diff` ("(absent)" when the run lacks the key)."""
    return repr(settings[key]) if key in settings else "(absent)"


def settings_diff(a, b):
    """The keys whose values differ, as "key: old -> new" (for error messages); a key that one
    side lacks shows as "(absent)", so a setting added after a run was made is named too."""
    keys = sorted(set(a) | set(b), key=str)
    return ", ".join(f"{k}: {_shown(a, k)} -> {_shown(b, k)}" for k in keys
                     if k not in a or k not in b or a[k] != b[k])


def field_defaults(config_cls) -> dict:
    """Each field's default of a config dataclass, as it reads back from JSON."""
    return json.loads(json.dumps({
        f.name: f.default if f.default is not MISSING else f.default_factory()
        for f in fields(config_cls)
        if f.default is not MISSING or f.default_factory is not MISSING}))


# The GRPO settings a run made before a field existed is taken to have had (`with_added_defaults`)
GRPO_DEFAULTS = field_defaults(GRPOConfig)


def with_added_defaults(saved: dict, current: dict, defaults: dict = GRPO_DEFAULTS) -> dict:
    """A finished run's `saved` settings, with each key that `current` has and `saved` lacks set
    to that setting's default: a field is added with a default that does what runs did before
    it existed (`--activation-checkpointing` off, the sampler in the weights' dtype on the CPU),
    so a run made earlier counts as made with it and stays reusable; a run asked for with
    another value does not match."""
    return {**{k: defaults[k] for k in current if k not in saved and k in defaults}, **saved}


def refuse_other_settings(run_dir, saved: dict, settings: dict,
                          defaults: dict = GRPO_DEFAULTS) -> None:
    """Exit (SystemExit) if the finished run in `run_dir` was made with `saved` settings other
    than `settings` (`with_added_defaults` first: a key added since counts as its default)."""
    before = with_added_defaults(saved, settings, defaults)
    if before != settings:
        raise SystemExit(f"{run_dir} was run with other settings "
                         f"({settings_diff(before, settings)}); use another "
                         "--output-dir, or delete that run directory to rerun it")


def resume_point(run_dir, settings):
    """Where an unfinished run of an experiment starts: its latest intact checkpoint when the
    directory holds a run with the same settings, else None after clearing the directory (a
    run with other settings, or one that never reached a checkpoint, starts afresh)."""
    run_dir = Path(run_dir)
    resume = None
    if run_dir.exists():
        try:
            saved = json.loads((run_dir / SETTINGS_FILE).read_text())
            same = with_added_defaults(saved, settings) == settings
            resume = find_checkpoint(run_dir) if same else None
        except (FileNotFoundError, ValueError):  # no settings, no intact checkpoint
            resume = None
        if resume is None:
            shutil.rmtree(run_dir)
        else:
            print(f"{run_dir}: resuming from {resume}")
    return resume


def cached_base_figures(model, tokenizer, held_out, device, config, identity: dict, out: Path,
                        per_problem: bool = False):
    """The base model's held-out figures (step 0 of every curve), evaluated once per setting and
    cached in out/base.json; `identity` names what else the figures depend on (model, split).
    With `per_problem`, also its per-problem outcomes (`evaluation.problem_outcomes`, under
    "per_problem"; a cached file without them is evaluated again)."""
    settings = {**identity, "eval_examples": config.eval_examples,
                "max_new_tokens": config.eval_max_new_tokens or config.max_new_tokens}
    path = Path(out) / "base.json"
    if path.is_file():
        saved = json.loads(path.read_text())
        if saved.get("settings") == settings and (
                not per_problem or "per_problem" in saved["figures"]):
            return saved["figures"]
    figures = evaluate_policy(model, tokenizer, held_out[:config.eval_examples], device,
                              config.eval_tokens, config.eval_batch_size,
                              per_problem=per_problem)
    atomic_write_json(path, {"settings": settings, "figures": jsonable(figures)})
    return figures


def gradient_noise(grads: torch.Tensor, batch_size: int) -> dict:
    """How much of a policy-gradient estimate is signal: figures of K independent batch gradients.

    `grads` (K, P): one flattened gradient per batch of `batch_size` sampled completions, all
    from the same policy. With G the true gradient and S the covariance of one batch's
    gradient, E|mean|^2 = |G|^2 + tr(S) / K, so (McCandlish et al. 2018, "An Empirical Model of
    Large-Batch Training", appendix A):

        trace  = sum_k |g_k - mean|^2 / (K - 1)        # tr(S), unbiased
        signal = |mean|^2 - trace / K                  # |G|^2, unbiased (can come out < 0)
        snr    = signal / trace                        # one batch's signal-to-noise ratio
        noise_scale = batch_size / snr                 # B_simple: the batch at which SNR = 1

    A batch far below the noise scale takes steps that are mostly noise (a larger learning rate
    scales the noise with the signal); far above it, steps are limited by their size.
    `half_cosine`: cosine between the mean gradients of the first and the second half of the
    batches, a direct look at how well two independent halves agree on the direction.
    """
    k = grads.shape[0]
    if k < 2:
        raise ValueError(f"need at least 2 batch gradients, got {k}")
    g = grads.double()
    mean = g.mean(0)  # (P,)
    trace = float(((g - mean) ** 2).sum() / (k - 1))
    signal = float(mean.pow(2).sum()) - trace / k
    snr = signal / trace if trace > 0 else (math.inf if signal > 0 else math.nan)
    half = k // 2
    a, b = g[:half].mean(0), g[half:2 * half].mean(0)
    cos = float(torch.dot(a, b) / (a.norm() * b.norm())) if a.norm() * b.norm() > 0 else math.nan
    return {"batches": k, "batch_norm": float(g.norm(dim=1).mean()),
            "mean_norm": float(mean.norm()), "trace": trace, "signal": signal, "snr": snr,
            "noise_scale": batch_size / snr if snr > 0 else math.inf, "half_cosine": cos}
