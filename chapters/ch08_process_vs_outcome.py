"""Chapter 8 experiment: outcome vs process supervision in GRPO, at equal steps and equal tokens.

Trains the same base model with the same GRPO settings several ways (arms: outcome, the process
forms, and controls such as a placebo of the step credit; --arms lists them), several seeds
each, evaluates checkpoints along the way and
writes a table (results.md, results.json) and a figure (process_vs_outcome.png) comparing them at
equal training steps and at equal generated tokens. The experiment, its arms and the table's
columns are described in reasoning_from_scratch/experiments/process_vs_outcome.py; this
script parses the flags and calls its `run_experiment`.

Examples:
    python chapters/ch08_process_vs_outcome.py                     # the full experiment
    python chapters/ch08_process_vs_outcome.py --seeds 0 --steps 10 --arms outcome,verifier
    python chapters/ch08_process_vs_outcome.py --arms outcome,prm --prm runs/prm-<timestamp>
    python chapters/ch08_process_vs_outcome.py --report-only       # table and figure again
    # every arm given the same step-size search on val (one experiment per point, staged)
    python chapters/ch08_process_vs_outcome.py --model tiny-arith-think --arms outcome,recommended \
        --search-lr 1e-4,3e-4,1e-3 --search-inner-epochs 1,2,4 --search-loss-types grpo,dr_grpo
    # where the format cannot decide: the think-native base model, 16 runs at once, reported
    # on the test split (the default, val, is for choosing among arms)
    python chapters/ch08_process_vs_outcome.py --model tiny-arith-think --eval-split test \
        --arms outcome,recommended-a2,placebo-a2 --seeds 3,4,5 --steps 60 --prompts-per-step 8 \
        --eval-points 12 --jobs 16

Simplified: one CPU thread per run; --jobs N trains N runs at once in worker processes (the
table is the same as one at a time, the seconds are each run's own).
"""

import argparse
import json
import sys
from dataclasses import fields
from pathlib import Path

from reasoning_from_scratch.cli.arguments import (
    add_model_argument,
    add_runtime_arguments,
    set_threads,
)
from reasoning_from_scratch.cli.train import add_config_arguments, add_data_arguments
from reasoning_from_scratch.distributed import refuse_multiple_processes
from reasoning_from_scratch.experiments.process_vs_outcome import (
    ARMS,
    DEFAULT_ARMS,
    PER_RUN,
    ExperimentSettings,
    add_pairs_to_file,
    plot_tuned_comparison,
    run_experiment,
)
from reasoning_from_scratch.experiments.tuning import SearchGrid, run_search
from reasoning_from_scratch.grpo import LOSS_TYPES
from reasoning_from_scratch.interrupts import exit_on_stop
from reasoning_from_scratch.training import GRPOConfig
from reasoning_from_scratch.validation import (
    choice_list,
    optional_positive_int,
    positive_float,
    positive_int,
    seed_list,
    value_list,
)

# Every problem of the held-out split (val and test have 500 each), for intervals over problems.
EVAL_EXAMPLES = 500
# Why torchrun is refused (each of its processes would run every arm and write the same files).
ONE_PROCESS_ONLY = ("it trains many small runs (arms x seeds), one after another, into shared "
                    "result files; for more cores start one experiment per --seeds value with "
                    "its own --output-dir, or train one arm data-parallel with "
                    "`torchrun ... chapters/ch07_train.py --supervision process`")


def build_parser():
    """The flags: experiment, learned PRM (arm prm), and the GRPOConfig shared by every arm."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_model_argument(p, "base model of every run (and of the PRM trained for the prm arm)")
    p.add_argument("--arms", type=choice_list(ARMS), default=DEFAULT_ARMS,
                   help="comma-separated arms: " + ", ".join(ARMS)
                   + " (see reasoning_from_scratch/experiments/process_vs_outcome.py)")
    p.add_argument("--seeds", type=seed_list, default="0,1,2",
                   help="comma-separated seeds, one run per arm each")
    p.add_argument("--eval-points", type=positive_int, default=4,
                   help="evaluate a checkpoint every steps // eval-points steps and at --steps "
                        "(about this many per run), besides the base model at step 0")
    add_data_arguments(p, eval_split="val")  # choose on val; report on test
    p.add_argument("--process-skip-zero-advantage", default=False,
                   action=argparse.BooleanOptionalAction,
                   help="in the process arms, drop the groups whose token advantages are all "
                        "exactly zero (equal outcomes and no step credit); a group with equal "
                        "outcomes whose steps differ is kept either way (default: keep all)")
    p.add_argument("--jobs", type=positive_int, default=1,
                   help="runs trained at once, each in its own process with one CPU thread "
                        "(on N cores: --jobs N); then the table as usual")
    p.add_argument("--reference-arm", default="outcome", choices=list(ARMS),
                   help="the arm whose mean final accuracy and totals are the tables' target "
                        "and budgets (e.g. outcome-tuned, the equally tuned outcome)")
    p.add_argument("--report-only", action="store_true",
                   help="train nothing: tabulate and plot the runs already finished")
    p.add_argument("--output-dir", default="runs/ch08-process-vs-outcome",
                   help="experiment directory (run directories, PRM cache, results)")
    add_runtime_arguments(p)
    g = p.add_argument_group("stored summaries (docs/process_vs_outcome_*.json): no training")
    g.add_argument("--add-pairs", metavar="JSON", default=None,
                   help="recompute every pair of arms' differences of each summary in JSON "
                        "from its rows and levels, write them in and exit")
    g.add_argument("--plot-tuned", metavar="JSON", default=None,
                   help="draw the tuned comparison (val_* and test_* summaries of JSON, e.g. "
                        "docs/process_vs_outcome_tuned.json) into the .png beside it and exit")
    g = p.add_argument_group(
        "step-size search (experiments/tuning.py): one experiment per point in "
        "<output-dir>/<point>/, staged lr, then updates per batch, then loss type; per arm the "
        "highest mean final accuracy is kept; a knob given one value or none is not searched")
    g.add_argument("--search-lr", type=value_list(positive_float), default=None,
                   help="candidate peak learning rates, e.g. 1e-4,3e-4,1e-3")
    g.add_argument("--search-inner-epochs", type=value_list(positive_int), default=None,
                   help="candidate updates per batch of rollouts, e.g. 1,2,4")
    g.add_argument("--search-loss-types", type=choice_list(LOSS_TYPES), default=None,
                   help="candidate loss types, e.g. grpo,dr_grpo")
    g = p.add_argument_group("learned PRM (arm prm)")
    g.add_argument("--prm", default=None,
                   help="directory of a PRM saved by chapters/ch08_train_prm.py (None: train one "
                        "from --model with the --prm-* settings, once, cached in "
                        "<output-dir>/prm/ and reused while the settings match)")
    g.add_argument("--prm-labels", default="verifier", choices=("verifier", "mc"),
                   help="labels of the PRM's training steps: exact verifier, or Math-Shepherd "
                        "hard Monte-Carlo values (--mc-rollouts continuations, much slower)")
    g.add_argument("--prm-train-problems", type=positive_int, default=200,
                   help="train-split problems whose sampled completions train the PRM")
    g.add_argument("--prm-eval-problems", type=positive_int, default=100,
                   help="val-split problems for the PRM's held-out step accuracy")
    g.add_argument("--prm-samples", type=positive_int, default=4,
                   help="completions sampled per problem for the PRM data")
    g.add_argument("--prm-max-new-tokens", type=optional_positive_int, default=None,
                   help="tokens per sampled PRM completion (None: --max-new-tokens)")
    g.add_argument("--prm-epochs", type=positive_int, default=3, help="PRM training epochs")
    g.add_argument("--prm-lr", type=positive_float, default=1e-3, help="PRM AdamW learning rate")
    g.add_argument("--prm-batch-size", type=positive_int, default=16, help="PRM records per update")
    helps = {
        "process_variant": "process advantage of the verifier, mc and prm arms: sum "
                           "(DeepSeekMath) | process+outcome | min (PURE) | position (the "
                           "+outcome arms always use process+outcome)",
        "mc_rollouts": "Monte-Carlo continuations per step prefix (arms mc, mc+outcome; and the "
                       "PRM's labels with --prm-labels mc)",
        "eval_examples": "held-out problems evaluated at every checkpoint (default: all "
                         "500 of the val or test split, for intervals over problems)",
        **{name: f"not used here: {why}" for name, why in PER_RUN.items()},
    }
    g = p.add_argument_group("GRPO settings shared by every arm (GRPOConfig)")
    add_config_arguments(g, GRPOConfig(eval_examples=EVAL_EXAMPLES), helps)
    return p


def from_stored_summaries(add_pairs=None, plot_tuned=None):
    """--add-pairs and --plot-tuned: rewrite a stored summary file with its pairs, draw the
    tuned comparison from one; returns the paths written."""
    written = []
    if add_pairs:
        names = add_pairs_to_file(add_pairs)
        print(f"{add_pairs}: pairs of {', '.join(names)}")
        written.append(add_pairs)
    if plot_tuned:
        data = json.loads(Path(plot_tuned).read_text())
        summaries = {split: [v for k, v in data.items() if k.startswith(f"{split}_")
                             and isinstance(v, dict) and v.get("reference") == "outcome-tuned"]
                     for split in ("val", "test")}  # the summaries against the tuned outcome
        png = Path(plot_tuned).with_suffix(".png")
        plot_tuned_comparison(summaries, png)
        print(f"wrote {png}")
        written.append(str(png))
    return written


def main(argv=None):
    """Parse and check the flags, then run the experiment; returns its summary."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.add_pairs or args.plot_tuned:
        return from_stored_summaries(args.add_pairs, args.plot_tuned)
    refuse_multiple_processes("ch08_process_vs_outcome.py", ONE_PROCESS_ONLY)
    defaults = GRPOConfig()
    for name, why in PER_RUN.items():
        if getattr(args, name) != getattr(defaults, name):
            parser.error(f"--{name.replace('_', '-')} is not used here: {why}")
    if args.reference_arm not in args.arms:
        parser.error(f"--reference-arm {args.reference_arm} is not among --arms")
    set_threads(args.threads)
    settings = ExperimentSettings(**{f.name: getattr(args, f.name)
                                     for f in fields(ExperimentSettings)})
    try:
        config = GRPOConfig.from_dict({k: v for k, v in vars(args).items()
                                       if k != "output_dir"})  # the experiment's directory
    except ValueError as err:
        parser.error(str(err))
    grid = SearchGrid(tuple(args.search_lr or ()), tuple(args.search_inner_epochs or ()),
                      tuple(args.search_loss_types or ()))
    if grid.stages():
        return run_search(settings, config, args.arms, args.seeds, grid)
    return run_experiment(settings, config, args.arms, args.seeds)


if __name__ == "__main__":
    exit_on_stop(main, sys.argv[1:])  # Ctrl-C: exit 130, SIGTERM & co.: 75
