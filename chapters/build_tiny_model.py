"""Rebuild the bundled tiny base model (tokenizer + ~0.8M-parameter Qwen3) from a seed.

With the default arguments this writes exactly the files shipped in
reasoning_from_scratch/assets/tiny-arith/ and prints the held-out figures of the base model
(greedy and sampled strict accuracy, think-format rate, completion length). Pretraining runs
3000 steps at 3.5-4.7 steps/s on 2 otherwise idle CPU cores (about 11-14 minutes; slower when
other jobs share the cores). Figures of the bundled model on the 200 held-out test problems:

    greedy:  strict accuracy 40.0%, think-format rate 40.0%, accuracy in think format 100%,
             mean completion 34.1 tokens (think 40%, steps_answer 37%, direct_answer 23%)
    sampled (T=1): strict accuracy 38.0%, think-format rate 33.5%, accuracy in think format 97.0%,
             mean completion 27.5 tokens

    python chapters/build_tiny_model.py
    python chapters/build_tiny_model.py --out-dir /tmp/tiny --steps 300   # a quick try
"""

import argparse
import json
from pathlib import Path

import torch

from reasoning_from_scratch.tiny_world import build_tiny_model, format_figures

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "reasoning_from_scratch" / "assets" / "tiny-arith"


def main():
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT,
                        help="where to write the Hugging Face-layout model files")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the corpus, the tokenizer and the model initialisation")
    parser.add_argument("--steps", type=int, default=3000, help="pretraining steps")
    parser.add_argument("--batch-size", type=int, default=32, help="sequences per step")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate")
    parser.add_argument("--warmup", type=int, default=100, help="linear warmup steps")
    parser.add_argument("--vocab-size", type=int, default=384,
                        help="maximum BPE vocabulary size (special tokens included)")
    parser.add_argument("--n-test", type=int, default=200,
                        help="held-out test problems for the final figures")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--json", type=Path, default=None,
                        help="also write the figures to this JSON file")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    figures = build_tiny_model(
        args.out_dir,
        seed=args.seed,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        warmup=args.warmup,
        vocab_size=args.vocab_size,
        n_test=args.n_test,
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
