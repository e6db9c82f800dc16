"""The figures of docs/process_vs_outcome.md and of the README's chapter 8 row against the
stored summaries they come from (docs/process_vs_outcome_*.json), and the seed ledger against
the seeds those summaries record.

- Every interval `m [lo, hi]` of the page and the README is one that a stored summary holds
  (an arm's own, its difference from the reference arm or its placebo, a pair of arms, a
  seed-mean crossing), in either orientation ("a is x below b"), looked up in the summaries of
  its section only.
- Every other figure with two or three decimals of section 00 (the tuned comparison), of the
  "In short" bullets that report it and of the README's chapter 8 row is a figure of
  process_vs_outcome_tuned.json: a stored number, a pair's difference (`summary_pairs`) or a
  level's mean over seeds, rounded as printed.
- The stored pairs are what `summary_pairs` recomputes from each summary's rows and levels.
"""

import json
import math
import re
from pathlib import Path

import pytest

from reasoning_from_scratch.experiments.levels import mean_levels
from reasoning_from_scratch.experiments.process_vs_outcome import summary_pairs
from reasoning_from_scratch.experiments.seed_ledger import (
    LEDGER,
    RESERVED,
    check_fresh,
    fresh_seeds,
    ledger_table,
    seeds_used,
)

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
FILES = ("process_vs_outcome_tuned.json", "process_vs_outcome_fixed.json",
         "process_vs_outcome_results.json", "process_vs_outcome_branch_rows.json")
# each section of the page (its heading's start) -> the files its figures come from
SECTION_FILES = {"## In short": FILES, "## 00.": (FILES[0], FILES[3]), "## 0.": FILES[1:2],
                 "## 1.": FILES[1:3], "## 2.": FILES[2:3], "## 3.": FILES[2:3]}
NUMBER = r"(?:> 1\.5|[+-]?\d+\.\d+)"
INTERVAL = re.compile(rf"({NUMBER})\s+\[({NUMBER}),\s+({NUMBER})\]")
FIGURE = re.compile(r"(?<![\w.\[/-])([+-]?\d\.\d{2,3})(?![\d.]|x\b|e-)")


def _load(name):
    return json.loads((DOCS / name).read_text())


def _summaries(names):
    """Every results.json summary (a dict with rows) of the files `names`."""
    return [s for name in names for s in _load(name).values()
            if isinstance(s, dict) and "rows" in s]


def _norm(text):
    """A printed figure without its '+', and '-0.000' as '0.000'."""
    text = text.lstrip("+")
    return text.lstrip("-") if text[0] != ">" and float(text) == 0 else text


def _cell(v, digits):
    """A figure as the page prints it ('> 1.5' past the crossing grid; no '-0.000')."""
    if v is None or math.isinf(v):
        return "> 1.5"
    return _norm(f"{v:.{digits}f}")


def _intervals(obj):
    """Every {"mean", "lo", "hi"} inside a JSON object."""
    if isinstance(obj, dict):
        if {"mean", "lo", "hi"} <= set(obj) and obj["lo"] is not None:
            yield obj
        for v in obj.values():
            yield from _intervals(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _intervals(v)


def stored_intervals(names):
    """The intervals of the files `names` as printed, both orientations, 2 and 3 decimals."""
    out = set()
    for name in names:
        for iv in _intervals(_load(name)):
            m, lo, hi = iv["mean"], iv["lo"], iv["hi"]
            if m is None:
                continue
            for d in (2, 3):
                out.add((_cell(m, d), _cell(lo, d), _cell(hi, d)))
                if not math.isinf(m):
                    out.add((_cell(-m, d), _cell(-hi, d), _cell(-lo, d)))
    return out


def sections(text):
    """(heading, body) of each '## ' section of a page."""
    parts = re.split(r"(?m)^(?=## )", text)
    return [(p.splitlines()[0], p) for p in parts if p.startswith("## ")]


def unstored_intervals(text, names):
    """The intervals of `text` that no file of `names` holds."""
    stored = stored_intervals(names)
    return [m.group(0) for m in INTERVAL.finditer(text)
            if tuple(_norm(g) for g in m.groups()) not in stored]


def _numbers(obj):
    """Every number inside a JSON object."""
    if isinstance(obj, bool):
        return
    if isinstance(obj, (int, float)):
        yield float(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _numbers(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _numbers(v)


def tuned_figures():
    """The figures of section 00's files (process_vs_outcome_tuned.json and the branch rows
    re-measured) as printed (2 and 3 decimals, unsigned): their numbers, their pairs and the
    level means over seeds of every arm."""
    values = [v for name in SECTION_FILES["## 00."] for v in _numbers(_load(name))]
    for s in _summaries(SECTION_FILES["## 00."]):
        for runs in s["levels"]["runs"].values():
            values += [v for lv in mean_levels(runs).values() for v in lv.values()]
    return {_cell(abs(v), d) for v in values if not math.isnan(v) and not math.isinf(v)
            for d in (2, 3)}


def section_00_text():
    """Section 00 of the page, its first three "In short" bullets and the README's chapter 8
    row: the text whose every figure comes from process_vs_outcome_tuned.json."""
    text = (DOCS / "process_vs_outcome.md").read_text()
    parts = dict(sections(text))
    short = next(v for k, v in parts.items() if k.startswith("## In short"))
    bullets = re.split(r"(?m)^- ", short)[1:4]
    section = next(v for k, v in parts.items() if k.startswith("## 00."))
    row = next(line for line in (ROOT / "README.md").read_text().splitlines()
               if line.startswith("| 8 process vs outcome"))
    row = row.split("On `tiny-arith`")[0]  # the rest is section 1's (fixed.json)
    return "\n".join([*bullets, section, row])


def unsourced_figures(text, figures):
    """The figures of `text` (2-3 decimals, outside code) that are not among `figures`."""
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    prose = re.sub(r"`[^`]*`", "", prose)
    return [m.group(1) for m in FIGURE.finditer(prose)
            if _norm(m.group(1)).lstrip("-") not in figures]


def _rounded(obj):
    """`obj` with every float rounded to 12 digits (JSON's round trip kept apart)."""
    if isinstance(obj, float):
        return round(obj, 12)
    if isinstance(obj, dict):
        return {k: _rounded(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_rounded(v) for v in obj]
    return obj


def _point_estimates(obj):
    """`obj` without the interval ends ("lo", "hi") of its figures."""
    if isinstance(obj, dict):
        return {k: _point_estimates(v) for k, v in obj.items() if k not in ("lo", "hi")}
    return [_point_estimates(v) for v in obj] if isinstance(obj, list) else obj


@pytest.mark.parametrize("name", FILES)
def test_stored_pairs_are_the_recomputed_ones(name):
    for summary in _summaries([name]):  # intervals where the runs kept per-problem records
        assert _rounded(summary_pairs(summary)) == _rounded(_point_estimates(summary["pairs"]))
        assert len(summary["pairs"]) == len(summary["rows"]) * (len(summary["rows"]) - 1) // 2


def test_the_branch_pairs_the_page_reports():
    """Branches against no branches: the figures section 00 quotes, from the stored pairs."""
    tuned = _load(FILES[0])
    pair = {(p["arm"], p["vs"]): p for p in tuned["test_branch"]["pairs"]}[
        ("recommended-branch-tuned", "recommended-tuned")]
    assert round(pair["final_accuracy"]["mean"], 3) == 0.010
    assert round(pair["final_step_correctness"]["mean"], 3) == 0.012
    assert round(pair["accuracy_at_forward_budget"]["mean"], 3) == -0.019
    assert [round(pair["levels"][lv]["accuracy"], 3) for lv in "345"] == [0.042, -0.020, 0.026]
    val = {(p["arm"], p["vs"]): p for p in tuned["val_branch"]["pairs"]}[
        ("recommended-branch-tuned", "recommended-tuned")]
    assert round(val["final_accuracy"]["mean"], 3) == 0.001
    row = {r["arm"]: r for r in tuned["val_branch"]["rows"]}["recommended-branch-tuned"]
    assert [round(s, 2) for s in row["tokens_to_target_share"]] == [0.39, 0.72, 0.64]


def test_the_reweighted_branch_table_is_the_stored_summary():
    """Section 00's table of the branch rows re-measured on fresh seeds: every cell from the
    test summary (final figures, decode / forward / padding tokens, the equal-compute
    readings), and the forward-token pairs the bullets quote."""
    test = _load(FILES[3])["test"]
    text = (DOCS / "process_vs_outcome.md").read_text()
    for r in test["rows"]:
        k = [round(r[key]["mean"] / 1e3) for key in ("tokens", "forward_tokens",
                                                     "forward_pad_tokens")]
        line = (f"| {r['arm']} | {r['final_accuracy']['mean']:.3f} | "
                f"{r['final_step_correctness']['mean']:.3f} | {k[0]} / {k[1]} / {k[2]} | "
                f"{r['accuracy_at_budget']['mean']:.3f} | "
                f"{r['accuracy_at_forward_budget']['mean']:.3f} |")
        assert line in text, line
    for split, arm, vs, figure in [("test", "recommended-branch-tuned", "recommended-tuned",
                                    -0.007), ("val", "recommended-branch-tuned",
                                              "recommended-tuned", -0.030),
                                   ("test", "recommended-tuned", "outcome-tuned", 0.028),
                                   ("val", "recommended-tuned", "outcome-tuned", 0.025)]:
        pair = {(p["arm"], p["vs"]): p for p in _load(FILES[3])[split]["pairs"]}[(arm, vs)]
        assert round(pair["accuracy_at_forward_budget"]["mean"], 3) == figure


@pytest.mark.parametrize("page", ["process_vs_outcome.md", "README.md"])
def test_every_interval_is_stored(page):
    path = ROOT / page if page == "README.md" else DOCS / page
    text = path.read_text()
    found = 0
    if page == "README.md":
        found, missing = len(INTERVAL.findall(text)), unstored_intervals(text, FILES)
    else:
        missing = []
        for heading, body in sections(text):
            names = next((v for k, v in SECTION_FILES.items() if heading.startswith(k)), ())
            found += len(INTERVAL.findall(body))
            missing += [f"{heading}: {iv}" for iv in unstored_intervals(body, names)]
    assert missing == []
    assert found >= (4 if page == "README.md" else 100)


def test_a_wrong_interval_is_caught():
    names = FILES[:1]
    assert unstored_intervals("+0.062 [0.025, 0.100]", names) == []
    assert unstored_intervals("0.003 [-0.023, 0.031] below", names) == []
    assert unstored_intervals("+0.010 [-0.016, 0.038]", names) == ["+0.010 [-0.016, 0.038]"]
    assert unstored_intervals("+0.062 [0.025, 0.101]", names) != []


def test_every_figure_of_the_tuned_comparison_is_stored():
    text = section_00_text()
    figures = tuned_figures()
    assert unsourced_figures(text, figures) == []
    assert len(FIGURE.findall(text)) > 250  # the section is read, not skipped


def test_a_wrong_figure_is_caught():
    """A figure no summary holds is reported; code spans and settings are not figures. (The
    lookup is by value: a wrong figure that equals another stored figure passes, which the
    interval and pair checks above do not allow.)"""
    figures = tuned_figures()
    assert unsourced_figures("ends at 0.582 (+0.062), `0.123` lr 1e-4 x 2.1x", figures) == []
    assert unsourced_figures("ends at 0.587 (+0.163)", figures) == ["0.587", "+0.163"]


def test_the_ledger_matches_the_stored_summaries():
    for entry in LEDGER:
        if not entry.summary:
            continue
        name, key = entry.summary.split(":")
        summary = _load(name)[key]
        args = summary.get("args") or {}
        seeds = args.get("seeds") or summary.get("seeds")
        assert tuple(seeds) == entry.seeds, entry
        assert args.get("eval_split", summary.get("eval_split")) == entry.split, entry
        if "model" in args or "model" in summary:
            assert args.get("model", summary.get("model")) == entry.model, entry
    stored = {f"{name}:{key}" for name in FILES for key, s in _load(name).items()
              if isinstance(s, dict) and ("rows" in s or key == "search")}
    assert stored - {e.summary for e in LEDGER} <= {
        "process_vs_outcome_tuned.json:test_vs_today"}  # the same runs as test_vs_tuned


def test_the_ledger_keeps_the_reserved_seeds_and_gives_fresh_ones():
    assert not seeds_used() & set(RESERVED)
    assert seeds_used("test") >= set(range(15, 21))
    assert fresh_seeds(6) == [27, 28, 29, 30, 41, 42]  # 21-26: the branch rows re-measured
    check_fresh([27, 28, 29])
    for seeds in ([15], [0], [31], [21], [26]):
        with pytest.raises(ValueError):
            check_fresh(seeds)


def test_the_ledger_page_shows_the_ledger():
    text = (DOCS / "seed_ledger.md").read_text()
    assert "\n".join(ledger_table()) in text
    assert "31-40" in text
    assert "fixed before any run" not in (DOCS / "process_vs_outcome.md").read_text()


def test_the_stored_summaries_flags(tmp_path, capsys):
    """--add-pairs rewrites a summary file with the pairs it already holds (nothing else
    changes); --plot-tuned draws the tuned comparison beside it."""
    import runpy
    main = runpy.run_path(str(ROOT / "chapters" / "ch08_process_vs_outcome.py"),
                          run_name="ch08")["main"]
    path = tmp_path / "tuned.json"
    data = _load(FILES[0])
    for summary in data.values():
        if isinstance(summary, dict):
            summary.pop("pairs", None)
    path.write_text(json.dumps(data))
    assert main(["--add-pairs", str(path), "--plot-tuned", str(path)]) == [
        str(path), str(tmp_path / "tuned.png")]
    assert _rounded(json.loads(path.read_text())) == _rounded(_load(FILES[0]))
    assert (tmp_path / "tuned.png").stat().st_size > 10_000
