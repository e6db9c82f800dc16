"""Compare training runs: their metrics.csv curves on shared axes, one panel per metric.

Runs whose config.json differ only in the seed are drawn as one line, their mean, with a band
of ± one sd (turn off with --no-group-seeds). Works for GRPO runs (chapters 6-8) and
distillation runs (chapter 9) alike; --metric takes any metrics.csv column.

Examples:
    python chapters/compare_runs.py runs/ch07-a runs/ch07-b --out compare.png
    python chapters/compare_runs.py runs/dapo-s1 runs/dapo-s2 runs/grpo-s1 runs/grpo-s2 \\
        --metric eval_accuracy reward_mean entropy len_mean --smooth 0.2 --out arms.png
"""

import argparse
import sys

from reasoning_from_scratch.plotting import plot_runs
from reasoning_from_scratch.validation import probability_float

DEFAULT_METRICS = ["eval_accuracy", "reward_mean"]


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                   help="training run directories (each with its metrics.csv)")
    p.add_argument("--metric", nargs="+", default=DEFAULT_METRICS,
                   help="metrics.csv columns to plot, one panel each")
    p.add_argument("--smooth", type=probability_float, default=None,
                   help="moving-average window as a fraction of each run's points (None: raw)")
    p.add_argument("--no-group-seeds", dest="group_seeds", action="store_false",
                   help="one line per run even where runs are seeds of one setting")
    p.add_argument("--out", required=True, help="figure to write (PNG, or .pdf / .svg)")
    return p


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        plot_runs(args.run_dirs, args.metric, group_seeds=args.group_seeds,
                  smooth=args.smooth or 0.0, save_as=args.out)
    except (ValueError, FileNotFoundError) as err:
        parser.error(str(err))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main(sys.argv[1:])
