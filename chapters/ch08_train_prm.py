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

import torch

from reasoning_from_scratch.device import get_device
from reasoning_from_scratch.prm import train_prm_on_arithmetic
from reasoning_from_scratch.weights import load_pretrained


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="tiny-arith",
                   help="policy that writes the completions and initialises the PRM backbone")
    p.add_argument("--labels", default="verifier", choices=("verifier", "mc"),
                   help="training labels: exact verifier, or Math-Shepherd Monte-Carlo (hard)")
    p.add_argument("--train-problems", type=int, default=400, help="training problems")
    p.add_argument("--eval-problems", type=int, default=150, help="held-out (val) problems")
    p.add_argument("--samples", type=int, default=4, help="completions sampled per problem")
    p.add_argument("--max-new-tokens", type=int, default=112, help="tokens per completion")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    p.add_argument("--mc-rollouts", type=int, default=4,
                   help="Monte-Carlo continuations per step prefix (--labels mc)")
    p.add_argument("--epochs", type=int, default=4, help="PRM training epochs")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    p.add_argument("--batch-size", type=int, default=16, help="records per PRM update")
    p.add_argument("--seed", type=int, default=0, help="random seed (sampling, init, order)")
    p.add_argument("--device", default=None, help="cuda, mps or cpu (None: the best available)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (1 is fastest for the tiny model on a busy machine)")
    p.add_argument("--output-dir", default=None,
                   help="where the PRM is saved (None: runs/prm-<timestamp>)")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    device = get_device(args.device)
    out = args.output_dir or time.strftime("runs/prm-%Y%m%d-%H%M%S")
    policy, tokenizer = load_pretrained(args.model, device=device, dtype=torch.float32)
    return train_prm_on_arithmetic(
        policy, tokenizer, out, labels=args.labels, train_problems=args.train_problems,
        eval_problems=args.eval_problems, samples=args.samples,
        max_new_tokens=args.max_new_tokens, temperature=args.temperature,
        mc_rollouts=args.mc_rollouts, epochs=args.epochs, lr=args.lr,
        batch_size=args.batch_size, seed=args.seed, device=device,
        info={"model": args.model})


if __name__ == "__main__":
    main(sys.argv[1:])
