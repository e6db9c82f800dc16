"""Chapter 9: distillation vs RL on the same student at equal wall-clock, several seeds.

Both arms start from the student (default: the bundled base model). distill: the teacher (default:
the chapter 7 trained model, trained and cached in runs/ch07-teacher on the first run) samples
solutions to the training problems, the verified ones are kept and the student is fine-tuned on
them; self_distill: the same with the student as its own teacher (rejection-sampling fine-tuning);
grpo: the chapter 7 recipe on the student itself. Writes <output-dir>/results.md,
results.json and the accuracy-vs-seconds figure; finished runs are reused and interrupted ones
resumed. Two processes can share the work (--arms distill / --arms grpo), then `--report-only`.
reasoning_from_scratch/experiments/distill_vs_rl.py explains what is charged to each arm.

Examples:
    python chapters/ch09_distill_vs_rl.py                     # 3 arms x 3 seeds, ~40 min on 2 cores
    python chapters/ch09_distill_vs_rl.py --arms grpo --seeds 0
    python chapters/ch09_distill_vs_rl.py --report-only --figure docs/distill_vs_rl.png
"""

import argparse
import sys

import torch

from reasoning_from_scratch.cli.arguments import add_runtime_arguments, set_threads
from reasoning_from_scratch.cli.distill import (
    add_teacher_arguments,
    chapter7_teacher,
)
from reasoning_from_scratch.cli.train import load_grpo_data
from reasoning_from_scratch.device import get_device
from reasoning_from_scratch.distributed import refuse_multiple_processes
from reasoning_from_scratch.experiments.distill_vs_rl import (
    EXPERIMENT_ARMS,
    EXPERIMENT_DEFAULTS,
    run_distill_vs_rl,
)
from reasoning_from_scratch.interrupts import exit_on_stop
from reasoning_from_scratch.training import DEFAULT_TRAIN_LEVEL_WEIGHTS
from reasoning_from_scratch.validation import (
    choice_list,
    non_negative_float,
    positive_int,
    seed_list,
)
from reasoning_from_scratch.weights import load_pretrained

HELP = {
    "train_examples": "training problems the teacher solves (and GRPO samples from: the first N)",
    "num_samples": "teacher samples per training problem",
    "max_per_problem": "distinct verified traces kept per problem at most",
    "teacher_temperature": "teacher sampling temperature",
    "max_new_tokens": "maximum tokens of a teacher sample, a rollout and an evaluation answer",
    "distill_steps": "SFT updates of the distillation arm",
    "distill_eval_every": "distillation arm: evaluate every N updates",
    "grpo_steps": "GRPO steps of the RL arm (longer than the distillation budget, so the "
                  "curves can be read at equal seconds)",
    "grpo_eval_every": "RL arm: evaluate every N steps",
    "eval_examples": "held-out test problems of every evaluation",
}


def build_parser():
    """The experiment's flags (defaults: EXPERIMENT_DEFAULTS)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_teacher_arguments(p)
    p.add_argument("--arms", type=choice_list(EXPERIMENT_ARMS), default=",".join(EXPERIMENT_ARMS),
                   help="comma-separated arms: distill (teacher -> student), self_distill (the "
                        "student's own verified samples), grpo (RL on the student)")
    p.add_argument("--seeds", type=seed_list, default="0,1,2",
                   help="comma-separated seeds, one run per arm each")
    for name, default in EXPERIMENT_DEFAULTS.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(default, bool):
            p.add_argument("--no-" + name.replace("_", "-"), dest=name, action="store_false",
                           help="distillation: keep traces with a right answer even if a step "
                                "is wrong (default: every step verified)")
        elif isinstance(default, float):  # teacher_temperature (0: greedy)
            p.add_argument(flag, type=non_negative_float, default=default, help=HELP[name])
        else:
            p.add_argument(flag, type=positive_int, default=default, help=HELP[name])
    p.add_argument("--report-only", action="store_true",
                   help="train nothing: tabulate and plot the runs already finished")
    p.add_argument("--output-dir", default="runs/ch09-compare",
                   help="experiment directory (run directories, base.json, results)")
    p.add_argument("--figure", default=None,
                   help="where to save the figure (None: <output-dir>/distill_vs_rl.png)")
    add_runtime_arguments(p)
    return p


# Why this comparison runs in one process (refuse_multiple_processes says it at start).
ONE_PROCESS_ONLY = ("it trains several small runs (arms x seeds), one after another, into shared "
                    "result files; chapters/ch09_distill.py itself runs under torchrun")


def main(argv=None):
    refuse_multiple_processes("ch09_distill_vs_rl.py", ONE_PROCESS_ONLY)
    args = build_parser().parse_args(argv)
    set_threads(args.threads)
    device = get_device(args.device)
    settings = {k: getattr(args, k) for k in EXPERIMENT_DEFAULTS}
    teacher = args.teacher
    if teacher is None and not args.report_only and "distill" in args.arms:
        teacher = str(chapter7_teacher(args.teacher_run_dir, args.threads, args.device))
    teacher = teacher or f"{args.teacher_run_dir}/final"
    student, tokenizer = load_pretrained(args.student, device=device, dtype=torch.float32)
    train, held_out = load_grpo_data("arith", args.train_examples, "test", args.eval_examples,
                                     DEFAULT_TRAIN_LEVEL_WEIGHTS)
    return run_distill_vs_rl(student, tokenizer, train, held_out, device, teacher,
                             {**settings, "student": args.student}, args.arms, args.seeds,
                             args.output_dir, report_only=args.report_only, figure=args.figure)


if __name__ == "__main__":
    exit_on_stop(main, sys.argv[1:])  # Ctrl-C: exit 130, SIGTERM & co.: 75
