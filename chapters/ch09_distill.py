"""Chapter 9: distil a reasoning teacher into a student (rejection sampling, then SFT).

The teacher (by default the chapter 7 GRPO-trained model, trained and cached in runs/ch07-teacher
on the first run) solves the training problems several times; only verified solutions are kept;
the student (by default the bundled base model) is fine-tuned on them with the loss on the
completion tokens only. Writes traces.jsonl, metrics.csv/.png, checkpoints and summary.json
(and, with --record FILE, adds the run's figures to FILE, a results file of several runs).

Examples:
    python chapters/ch09_distill.py                              # chapter 7 teacher -> base model
    python chapters/ch09_distill.py --resume runs/ch09-<timestamp>   # continue exactly
    python chapters/ch09_distill.py --traces my_traces.jsonl     # traces made elsewhere
    python chapters/ch09_distill.py --seed 1 --no-check-steps --record docs/distill_step_check.json
    python chapters/ch09_distill.py --teacher Qwen/Qwen3-1.7B --student Qwen/Qwen3-0.6B-Base \\
        --dataset math --max-new-tokens 1024 --lr 1e-5 --batch-size 8 --eval-examples 500
"""

import sys

from reasoning_from_scratch.cli.distill import parse_distill_args, run_distillation


def main(argv=None):
    """Parse and check the flags, then sample the teacher and distil; returns the summary."""
    run = parse_distill_args(argv, __doc__.splitlines()[0])
    return run_distillation(run)


if __name__ == "__main__":
    main(sys.argv[1:])
