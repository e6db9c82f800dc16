"""Chapter 8: train a process reward model (PRM) on the tiny arithmetic world.

Samples completions from the policy for training problems, splits them into steps, labels every
step with the exact verifier (or with Math-Shepherd Monte-Carlo rollouts of the policy itself),
trains a PRM whose backbone starts from the same model, and reports step-level accuracy on steps
of held-out (val split) problems, labelled by the exact verifier, next to the majority baseline.
The recipe is `prm.train_prm_on_arithmetic`, which chapters/ch08_process_vs_outcome.py also uses
for its learned-PRM arm. Writes the PRM and prm_report.json into --output-dir.

Examples:
    python chapters/ch08_train_prm.py                         # verifier labels, bundled tiny model
    python chapters/ch08_train_prm.py --labels mc --mc-rollouts 4
    python chapters/ch07_train.py --supervision process --step-scorer prm:runs/prm-<timestamp>
"""

import argparse
import sys
import time
from pathlib import Path

import torch

from reasoning_from_scratch.cli.arguments import (
    add_model_argument,
    add_runtime_arguments,
    add_seed_argument,
    set_threads,
)
from reasoning_from_scratch.cli.train import add_report_argument, check_report_backends
from reasoning_from_scratch.device import get_device
from reasoning_from_scratch.distributed import refuse_multiple_processes
from reasoning_from_scratch.interrupts import exit_on_stop
from reasoning_from_scratch.prm import CONFIG_FILE as PRM_CONFIG_FILE
from reasoning_from_scratch.prm import train_prm_on_arithmetic
from reasoning_from_scratch.validation import positive_float, positive_int
from reasoning_from_scratch.weights import load_pretrained


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_model_argument(p, "policy that writes the completions and initialises the PRM backbone")
    p.add_argument("--labels", default="verifier", choices=("verifier", "mc"),
                   help="training labels: exact verifier, or Math-Shepherd Monte-Carlo (hard)")
    count = positive_int
    p.add_argument("--train-problems", type=count, default=400, help="training problems")
    p.add_argument("--eval-problems", type=count, default=150, help="held-out (val) problems")
    p.add_argument("--samples", type=count, default=4, help="completions sampled per problem")
    p.add_argument("--max-new-tokens", type=count, default=112, help="tokens per completion")
    p.add_argument("--temperature", type=positive_float, default=1.0,
                   help="sampling temperature")
    p.add_argument("--mc-rollouts", type=count, default=4,
                   help="Monte-Carlo continuations per step prefix (--labels mc)")
    p.add_argument("--epochs", type=count, default=4, help="PRM training epochs")
    p.add_argument("--lr", type=positive_float, default=1e-3, help="AdamW learning rate")
    p.add_argument("--batch-size", type=count, default=16, help="records per PRM update")
    add_seed_argument(p, help="random seed (sampling, init, order)")
    add_runtime_arguments(
        p, threads_help="torch CPU threads (1 is fastest for the tiny model on a busy machine)")
    p.add_argument("--output-dir", default=None,
                   help="where the PRM is saved (None: runs/prm-<timestamp>); must not hold a "
                        "PRM already, unless --overwrite")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a PRM already saved in --output-dir")
    add_report_argument(p)
    return p


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    refuse_multiple_processes("ch08_train_prm.py", "the PRM's data sampling and training are "
                              "not split between processes")
    out = args.output_dir or time.strftime("runs/prm-%Y%m%d-%H%M%S")
    if (Path(out) / PRM_CONFIG_FILE).exists() and not args.overwrite:
        parser.error(f"{out} already holds a PRM; pass --overwrite to replace it, or choose "
                     "another --output-dir")
    check_report_backends(parser, args.report_to)
    set_threads(args.threads)
    device = get_device(args.device)
    policy, tokenizer = load_pretrained(args.model, device=device, dtype=torch.float32)
    return train_prm_on_arithmetic(
        policy, tokenizer, out, labels=args.labels, train_problems=args.train_problems,
        eval_problems=args.eval_problems, samples=args.samples,
        max_new_tokens=args.max_new_tokens, temperature=args.temperature,
        mc_rollouts=args.mc_rollouts, epochs=args.epochs, lr=args.lr,
        batch_size=args.batch_size, seed=args.seed, device=device,
        info={"model": args.model}, report_to=args.report_to)


if __name__ == "__main__":
    exit_on_stop(main, sys.argv[1:])  # Ctrl-C: exit 130, SIGTERM & co.: 75
