"""Chapter 7: GRPO variants side by side on one task at equal rollouts, several seeds each.

Arms (reasoning_from_scratch/experiments/grpo_variants.py describes each and the table's columns):
the chapter 6 recipe, the chapter 7 default, the dapo and dr_grpo losses, no format reward, the KL
as per-token k3 vs the book's sequence-level estimate, and with 4 inner epochs per batch: clipping,
no clipping, clip-higher, gspo and cispo. Writes <output-dir>/results.md, results.json and
grpo_variants.png; finished runs are reused and interrupted ones resumed, so the same command
continues a stopped comparison. Two processes can share the work (different --arms or --seeds),
then `--report-only` tabulates everything.

Examples:
    python chapters/ch07_compare.py                         # 12 arms x 3 seeds, ~1 h on 2 cores
    python chapters/ch07_compare.py --arms grpo,dapo,dr_grpo --seeds 0
    python chapters/ch07_compare.py --report-only
"""

import argparse
import sys
from dataclasses import fields

import torch

from reasoning_from_scratch.cli.arguments import (
    add_dtype_argument,
    add_model_argument,
    add_runtime_arguments,
    set_threads,
)
from reasoning_from_scratch.cli.train import (
    DATA_FLAGS,
    add_config_arguments,
    add_data_arguments,
    load_grpo_data,
)
from reasoning_from_scratch.device import get_device
from reasoning_from_scratch.distributed import refuse_multiple_processes
from reasoning_from_scratch.experiments.grpo_variants import (
    ARMS,
    COMPARISON_DEFAULTS,
    DEFAULT_ARMS,
    run_comparison,
)
from reasoning_from_scratch.interrupts import exit_on_stop
from reasoning_from_scratch.training import GRPOConfig
from reasoning_from_scratch.validation import choice_list, seed_list
from reasoning_from_scratch.weights import load_pretrained

# Why torchrun is refused (each of its processes would run every arm and write the same files).
ONE_PROCESS_ONLY = ("it trains many small runs, one after another, into shared result files; "
                    "for more cores start one comparison per --seeds value with its own "
                    "--output-dir")


def build_parser():
    """Experiment flags plus every GRPOConfig field (the settings shared by all arms)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_model_argument(p, "base model of every run")
    p.add_argument("--dataset", default="arith", choices=("arith",),
                   help="the task (the comparison is calibrated on the arithmetic world)")
    p.add_argument("--arms", type=choice_list(ARMS), default=DEFAULT_ARMS,
                   help="comma-separated arms: " + ", ".join(ARMS))
    p.add_argument("--seeds", type=seed_list, default="0,1,2",
                   help="comma-separated seeds, one run per arm each")
    p.add_argument("--report-only", action="store_true",
                   help="train nothing: tabulate and plot the runs already finished")
    p.add_argument("--output-dir", default="runs/ch07-compare",
                   help="experiment directory (run directories, base.json, results)")
    add_data_arguments(p)
    add_runtime_arguments(p)
    add_dtype_argument(p, "weights' dtype of every run (float32 keeps small AdamW updates exact)")
    g = p.add_argument_group("GRPO settings shared by every arm (an arm overrides its own)")
    add_config_arguments(g, GRPOConfig(**COMPARISON_DEFAULTS))
    return p


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    refuse_multiple_processes("ch07_compare.py", ONE_PROCESS_ONLY)
    arms, seeds = args.arms, args.seeds
    shared = {f.name: getattr(args, f.name) for f in fields(GRPOConfig) if f.name != "output_dir"}
    try:
        GRPOConfig.from_dict(shared)
    except ValueError as err:
        parser.error(str(err))
    set_threads(args.threads)
    device = get_device(args.device)
    model, tokenizer = load_pretrained(args.model, device=device, dtype=getattr(torch, args.dtype))
    data = {k: getattr(args, k) for k in DATA_FLAGS}
    train, held_out = load_grpo_data(args.dataset, args.train_examples, args.eval_split,
                                     args.eval_examples, args.train_level_weights)
    return run_comparison(model, tokenizer, train, held_out, device, shared,
                          {**data, "model": args.model}, arms, seeds, args.output_dir,
                          report_only=args.report_only)


if __name__ == "__main__":
    exit_on_stop(main, sys.argv[1:])  # Ctrl-C: exit 130, SIGTERM & co.: 75
