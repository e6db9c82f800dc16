"""Rebuild the bundled tiny base model (tokenizer + ~0.8M-parameter Qwen3) from a seed.

With the default arguments this writes exactly the files shipped in
reasoning_from_scratch/assets/tiny-arith/ and prints the held-out figures of the base model.
The corpus is the five-level arithmetic world with flawed worked solutions (a forgotten carry,
a transposed operand; see tiny_world.build_corpus), so the model makes real, level-dependent
step errors. The calibration (what was tried, what it gave, and why) is in docs/tiny_world.md.
Pretraining runs 4000 steps at about 5 steps/s on 2 otherwise idle CPU cores: 13.3 minutes in
all for the shipped build. Figures of the bundled model on the 200 held-out test problems:

    greedy:  strict accuracy 26.0%, think-format rate 44.5%, accuracy in think format 58.4%,
             step correctness (think) 73.5%; per level L1 0%, L2 92%, L3 0%, L4 15%, L5 2%
    sampled (T=1, 8 per problem): pass@1 16.2%, pass@8 56.5%, accuracy in think format 48.8%,
             step correctness (think) 65.1%

    python chapters/build_tiny_model.py
    python chapters/build_tiny_model.py --out-dir /tmp/tiny --steps 300   # a quick try

`--think-native` builds the second bundled model, tiny-arith-think (assets/tiny-arith-think/):
the same world, prompts and tokenizer, but every corpus document is a think-format solution with a
boxed answer, and every step's carry slips more often than not (--slip-prob-small 0.65 with the
flag), so accuracy can rise only through the arithmetic:

    python chapters/build_tiny_model.py --think-native
"""

import argparse
import json
from pathlib import Path

from reasoning_from_scratch.cli.arguments import (
    add_seed_argument,
    add_threads_argument,
    set_threads,
)
from reasoning_from_scratch.tiny_world import (
    OPERAND_SLIP_PROB,
    SLIP_PROB_LARGE,
    SLIP_PROB_SMALL,
    THINK_SLIP_PROB_SMALL,
    build_tiny_model,
    format_figures,
)
from reasoning_from_scratch.validation import (
    non_negative_int,
    positive_float,
    positive_int,
    unit_float,
)
from reasoning_from_scratch.weights import BUNDLED_MODELS

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO / "reasoning_from_scratch" / "assets"


def main():
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--out-dir", type=Path, default=None,
                        help="where to write the Hugging Face-layout model files (default: "
                             "assets/tiny-arith, or assets/tiny-arith-think with --think-native)")
    parser.add_argument("--think-native", action="store_true",
                        help="build tiny-arith-think: every corpus document in the think format "
                             "with a boxed answer, the bundled tiny-arith tokenizer")
    add_seed_argument(parser, help="seed of the corpus, the tokenizer and the model initialisation")
    parser.add_argument("--steps", type=positive_int, default=4000, help="pretraining steps")
    parser.add_argument("--batch-size", type=positive_int, default=32, help="sequences per step")
    parser.add_argument("--lr", type=positive_float, default=3e-3, help="peak AdamW learning rate")
    parser.add_argument("--warmup", type=non_negative_int, default=100, help="linear warmup steps")
    parser.add_argument("--vocab-size", type=positive_int, default=384,
                        help="maximum BPE vocabulary size (special tokens included)")
    parser.add_argument("--n-test", type=positive_int, default=200,
                        help="held-out test problems for the final figures")
    parser.add_argument("--slip-prob-small", type=unit_float, default=None,
                        help="corpus: probability of forgetting the units carry of a two-digit "
                             f"step (default: {SLIP_PROB_SMALL}; {THINK_SLIP_PROB_SMALL} with "
                             "--think-native)")
    parser.add_argument("--slip-prob-large", type=unit_float, default=SLIP_PROB_LARGE,
                        help="corpus: probability of forgetting the units carry of a three-digit "
                             "step")
    parser.add_argument("--operand-slip-prob", type=unit_float, default=OPERAND_SLIP_PROB,
                        help="corpus: probability of copying an operand with its digits swapped")
    add_threads_argument(parser, 2, "torch CPU threads")
    parser.add_argument("--json", type=Path, default=None,
                        help="also write the figures to this JSON file")
    args = parser.parse_args()

    set_threads(args.threads)
    name = "tiny-arith-think" if args.think_native else "tiny-arith"
    args.out_dir = args.out_dir or ASSETS / name
    if args.slip_prob_small is None:
        args.slip_prob_small = THINK_SLIP_PROB_SMALL if args.think_native else SLIP_PROB_SMALL
    figures = build_tiny_model(
        args.out_dir,
        seed=args.seed,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        warmup=args.warmup,
        vocab_size=args.vocab_size,
        n_test=args.n_test,
        slip_prob_small=args.slip_prob_small,
        slip_prob_large=args.slip_prob_large,
        operand_slip_prob=args.operand_slip_prob,
        think_native=args.think_native,
        tokenizer_dir=BUNDLED_MODELS["tiny-arith"] if args.think_native else None,
    )
    print(f"saved to {args.out_dir}")
    print(f"parameters: {figures['parameters']:,} | final training loss {figures['final_loss']:.3f}"
          f" | pretraining {figures['train_seconds'] / 60:.1f} min"
          f" | total {figures['total_seconds'] / 60:.1f} min")
    print(format_figures(figures))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
