"""Chapter 8: train a process reward model (PRM) on the tiny arithmetic world.

Samples completions from the policy for training problems, splits them into steps, labels every
step with the exact verifier (or with Math-Shepherd Monte-Carlo rollouts of the policy itself),
trains a PRM whose backbone starts from the same model, and reports step-level accuracy on steps
of held-out (val split) problems, labelled by the exact verifier, next to the majority baseline.

Examples:
    python chapters/ch08_train_prm.py                         # verifier labels, bundled tiny model
    python chapters/ch08_train_prm.py --labels mc --mc-rollouts 4
    python chapters/ch07_train.py --supervision process --step-scorer prm:runs/prm-<timestamp>
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from reasoning_from_scratch.arithmetic import make_split
from reasoning_from_scratch.device import get_device
from reasoning_from_scratch.prm import (
    ProcessRewardModel,
    evaluate_prm,
    make_prm_dataset,
    save_prm,
    train_prm,
)
from reasoning_from_scratch.step_scorers import MonteCarloStepScorer, VerifierStepScorer
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
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens per completion")
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


def label_agreement(records, verifier_records):
    """Fraction of steps whose labels agree between two labellings of the same completions."""
    a = [x for r in records for x in r["labels"]]
    b = [x for r in verifier_records for x in r["labels"]]
    return sum(x == y for x, y in zip(a, b)) / max(1, len(a))


def main(argv=None):
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    device = get_device(args.device)
    out = Path(args.output_dir or time.strftime("runs/prm-%Y%m%d-%H%M%S"))
    policy, tokenizer = load_pretrained(args.model, device=device, dtype=torch.float32)
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    train_problems = make_split("train", args.train_problems, seed=args.seed + 100)
    eval_problems = make_split("val", args.eval_problems)
    common = dict(num_samples=args.samples, max_new_tokens=args.max_new_tokens,
                  temperature=args.temperature, device=device)

    t0 = time.time()
    if args.labels == "mc":
        mc = MonteCarloStepScorer(policy, tokenizer, num_continuations=args.mc_rollouts,
                                  mode="hard", max_new_tokens=args.max_new_tokens,
                                  temperature=args.temperature, generator=gen, device=device)
        train_records = make_prm_dataset(policy, tokenizer, train_problems, mc,
                                         generator=gen, **common)
        verifier = VerifierStepScorer()
        truth = [{**r, "labels": [x == 1.0 for x in verifier.score(r["prompt"], r["completions"],
                                                                    r)]} for r in train_records]
        agree = label_agreement(train_records, truth)
        print(f"MC labels: {mc.cost()['mc_generated_tokens']:.0f} generated tokens, "
              f"{mc.cost()['mc_rollouts']:.0f} rollouts; agreement with the verifier {agree:.3f}")
    else:
        train_records = make_prm_dataset(policy, tokenizer, train_problems, VerifierStepScorer(),
                                         generator=gen, **common)
    eval_records = make_prm_dataset(policy, tokenizer, eval_problems, VerifierStepScorer(),
                                    generator=gen, **common)
    n_steps = sum(len(r["labels"]) for r in train_records)
    pos = sum(sum(r["labels"]) for r in train_records) / max(1, n_steps)
    print(f"data: {len(train_records)} train completions ({n_steps} steps, {pos:.1%} correct), "
          f"{len(eval_records)} held-out completions; {time.time() - t0:.0f}s")

    prm = ProcessRewardModel.from_pretrained_backbone(policy).to(device)
    base = evaluate_prm(prm, tokenizer, eval_records)
    t1 = time.time()
    losses = train_prm(prm, tokenizer, train_records, epochs=args.epochs, lr=args.lr,
                       batch_size=args.batch_size, seed=args.seed,
                       log_every=max(1, len(train_records) // args.batch_size))
    train_metrics = evaluate_prm(prm, tokenizer, train_records)
    held_out = evaluate_prm(prm, tokenizer, eval_records)
    save_prm(prm, tokenizer, out)
    report = {
        "labels": args.labels, "model": args.model, "train_completions": len(train_records),
        "train_steps": n_steps, "train_positive_rate": pos,
        "held_out_before_training": base, "train": train_metrics, "held_out": held_out,
        "final_loss": sum(losses[-10:]) / max(1, len(losses[-10:])),
        "train_seconds": time.time() - t1, "output_dir": str(out),
    }
    (out / "prm_report.json").write_text(json.dumps(report, indent=2))
    print(f"held-out step accuracy {held_out['accuracy']:.3f} (balanced "
          f"{held_out['balanced_accuracy']:.3f}; majority baseline "
          f"{held_out['majority_accuracy']:.3f}; {held_out['n_steps']:.0f} steps); "
          f"saved to {out}")
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
