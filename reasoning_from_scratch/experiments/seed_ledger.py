"""The seed ledger of chapter 8's experiments: which seeds each search and each design's val
and test runs used (docs/seed_ledger.md shows it as a table; tests check it against the
stored summaries' own seeds).

Each entry is one decision's runs, in the order they were made. A new design is tested on
seeds no entry used (`fresh_seeds`, `check_fresh`); `RESERVED` (31-40) stays unused by this
project: it is kept for an outside replication. The settings of each design were fixed before
its runs; the choice of which design to try next was not: the designs tested on seeds 15-20
were chosen one after another, each after the previous one's test results were seen.
"""

from __future__ import annotations

from dataclasses import dataclass

RESERVED = tuple(range(31, 41))  # kept for an outside replication: never used here


@dataclass(frozen=True)
class Entry:
    """One decision's runs: what was decided, on which model, split and seeds, and where its
    summary is stored ("file.json:key" under docs/; "" where no summary is stored)."""

    decision: str
    model: str
    split: str
    seeds: tuple
    summary: str = ""
    declared: tuple = ()  # declared before the first run, cut before any of their runs: used


LEDGER = (
    Entry("first measurement: five arms (sum form)", "tiny-arith", "test", (0, 1, 2)),
    Entry("recommended form and its controls (before the fixes)", "tiny-arith", "test",
          (0, 1, 2), "process_vs_outcome_results.json:controls"),
    Entry("search: recommended's alpha and the forms (before the fixes)", "tiny-arith-think",
          "val", (0, 1, 2), "process_vs_outcome_results.json:think_val"),
    Entry("test: every form (before the fixes)", "tiny-arith-think", "test", (3, 4, 5),
          "process_vs_outcome_results.json:think_test"),
    Entry("test: recommended-a2 and its placebo (before the fixes)", "tiny-arith-think", "test",
          (3, 4, 5, 6, 7, 8), "process_vs_outcome_results.json:think_test6"),
    Entry("search: alpha of the fixed credit", "tiny-arith-think", "val", (0, 1, 2),
          "process_vs_outcome_fixed.json:think_val"),
    Entry("test: recommended (fixed credit) and its controls", "tiny-arith-think", "test",
          (9, 10, 11, 12, 13, 14), "process_vs_outcome_fixed.json:think_test"),
    Entry("test: every form (fixed credit)", "tiny-arith-think", "test", (9, 10, 11),
          "process_vs_outcome_fixed.json:think_forms"),
    Entry("test: the format controls (fixed credit)", "tiny-arith", "test",
          (9, 10, 11, 12, 13, 14), "process_vs_outcome_fixed.json:arith_test"),
    Entry("search: update size of outcome and recommended", "tiny-arith-think", "val",
          (0, 1, 2), "process_vs_outcome_tuned.json:search"),
    Entry("val: the lr stage re-checked at two updates per batch", "tiny-arith-think", "val",
          (0, 1, 2)),
    Entry("test: the tuned arms", "tiny-arith-think", "test", (15, 16, 17, 18, 19, 20),
          "process_vs_outcome_tuned.json:test_vs_tuned"),
    Entry("val: credit past the first error", "tiny-arith-think", "val", (0, 1, 2),
          "process_vs_outcome_tuned.json:val_local"),
    Entry("test: credit past the first error", "tiny-arith-think", "test",
          (15, 16, 17, 18, 19, 20), "process_vs_outcome_tuned.json:test_local"),
    Entry("val: branches at the first error", "tiny-arith-think", "val", (0, 1, 2),
          "process_vs_outcome_tuned.json:val_branch"),
    Entry("test: branches at the first error", "tiny-arith-think", "test",
          (15, 16, 17, 18, 19, 20), "process_vs_outcome_tuned.json:test_branch"),
    Entry("val: branch rows weighted as rollouts, padding left out (fresh seeds)",
          "tiny-arith-think", "val", (21, 22), "process_vs_outcome_branch_rows.json:val", (23,)),
    Entry("test: branch rows weighted as rollouts, padding left out (fresh seeds)",
          "tiny-arith-think", "test", (24, 25), "process_vs_outcome_branch_rows.json:test",
          (26,)),
)


def seeds_used(split: str | None = None) -> set[int]:
    """The seeds any ledger entry used (on `split` only, if given)."""
    return {s for e in LEDGER if split in (None, e.split) for s in (*e.seeds, *e.declared)}


def fresh_seeds(n: int) -> list[int]:
    """The `n` lowest seeds that no entry used, on either split, and that are not reserved."""
    used, out, seed = seeds_used() | set(RESERVED), [], 0
    while len(out) < n:
        if seed not in used:
            out.append(seed)
        seed += 1
    return out


def check_fresh(seeds) -> None:
    """Raise ValueError if any of `seeds` was used by an earlier decision or is reserved."""
    seen = sorted(set(seeds) & seeds_used())
    reserved = sorted(set(seeds) & set(RESERVED))
    if seen or reserved:
        raise ValueError(f"seeds {seen} were used by earlier decisions and {reserved} are "
                         "reserved for an outside replication; pick fresh ones (fresh_seeds)")


def ledger_table() -> list[str]:
    """docs/seed_ledger.md's table: one line per entry, in the order the runs were made."""
    lines = ["| # | decision | model | split | seeds | summary |", "|---|---|---|---|---|---|"]
    for i, e in enumerate(LEDGER, 1):
        seeds = (f"{e.seeds[0]}-{e.seeds[-1]}" if e.seeds == tuple(range(e.seeds[0],
                                                                         e.seeds[-1] + 1))
                 else ", ".join(map(str, e.seeds)))
        where = f"`{e.summary}`" if e.summary else "none stored"
        if e.declared:
            seeds += f" ({', '.join(map(str, e.declared))} declared, not run)"
        lines.append(f"| {i} | {e.decision} | `{e.model}` | {e.split} | {seeds} | {where} |")
    return lines
