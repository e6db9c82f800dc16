"""Benchmark: what writing metrics.csv costs a training step.

`run_log.MetricsLog` rewrites the whole file atomically at every row (temp file, fsync, rename)
so that a killed run never leaves a half-written row. That makes a row's cost grow with the rows
before it; this times `append` (and `patch_last_row`, an evaluation's cells) with a GRPO run's
columns as the file grows to --rows rows, and prints the milliseconds per row at a few sizes
next to a plain line append's. The file goes to --dir (default: a temp dir), so the figure is
that filesystem's (fsync on a network disk costs more). Not a test: the numbers depend on the
machine.

    python benchmarks/bench_metrics_log.py                  # 1000 rows
    python benchmarks/bench_metrics_log.py --rows 5000
"""

import argparse
import csv
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from reasoning_from_scratch.run_log import MetricsLog, format_cell
from reasoning_from_scratch.training import METRIC_COLUMNS
from reasoning_from_scratch.validation import positive_int


def grpo_row(step):
    """A metrics row with every GRPO column filled by a float of 6 significant digits."""
    return {c: (step if c == "step" else 1.0 / (step + len(c) + 7)) for c in METRIC_COLUMNS}


def time_appends(path, rows, marks):
    """Seconds of each `MetricsLog.append` (and of a `patch_last_row` at each mark)."""
    log = MetricsLog(path, METRIC_COLUMNS)
    appends, patches = [], {}
    for step in range(1, rows + 1):
        t0 = time.perf_counter()
        log.append(grpo_row(step))
        appends.append(time.perf_counter() - t0)
        if step in marks:
            t0 = time.perf_counter()
            log.patch_last_row({"eval_accuracy": 0.5})
            patches[step] = time.perf_counter() - t0
    return appends, patches


def time_plain_appends(path, rows):
    """Seconds of each plain `open(path, "a")` line append of the same rows (not crash-safe)."""
    out = []
    for step in range(1, rows + 1):
        t0 = time.perf_counter()
        with open(path, "a", newline="") as f:
            csv.DictWriter(f, fieldnames=METRIC_COLUMNS).writerow(
                {k: format_cell(v) for k, v in grpo_row(step).items()})
        out.append(time.perf_counter() - t0)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--rows", type=positive_int, default=1000, help="rows written (steps)")
    p.add_argument("--window", type=positive_int, default=20,
                   help="appends around each size whose median is printed")
    p.add_argument("--dir", default=None, help="where to write (None: a temp dir)")
    args = p.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="bench-metrics-", dir=args.dir))
    marks = sorted({max(1, args.rows // 10), max(1, args.rows // 2), args.rows})
    try:
        appends, patches = time_appends(root / "metrics.csv", args.rows, marks)
        plain = time_plain_appends(root / "plain.csv", args.rows)
        size = (root / "metrics.csv").stat().st_size
    finally:
        shutil.rmtree(root, ignore_errors=True)
    results = {"rows": args.rows, "bytes": size, "total_s": sum(appends),
               "plain_total_s": sum(plain), "at": {}}
    print(f"{args.rows} rows x {len(METRIC_COLUMNS)} columns ({size / 1e3:.0f} kB): "
          f"{sum(appends):.2f} s of atomic rewrites in all, {sum(plain):.3f} s of plain appends")
    for m in marks:
        window = appends[max(0, m - args.window):m]
        results["at"][m] = {"append_ms": 1e3 * statistics.median(window),
                            "patch_ms": 1e3 * patches[m],
                            "plain_ms": 1e3 * statistics.median(plain[max(0, m - args.window):m])}
        r = results["at"][m]
        print(f"row {m:>6}: append {r['append_ms']:.2f} ms, patch_last_row "
              f"{r['patch_ms']:.2f} ms (plain append {r['plain_ms']:.3f} ms)")
    return results


if __name__ == "__main__":
    main()
