"""Chapter 3: evaluate a model on MATH-500, GSM8K or the arithmetic world (batched, strict grading).

Examples:
    python chapters/ch03_evaluate.py                      # bundled tiny model, arithmetic test set
    python chapters/ch03_evaluate.py --limit 50 --output runs/arith_eval.jsonl
    python chapters/ch03_evaluate.py --model Qwen/Qwen3-0.6B --dataset math500 --limit 10
"""

import argparse
import json

from reasoning_from_scratch.cli.arguments import (
    add_dataset_arguments,
    add_device_argument,
    add_model_argument,
    add_sampling_arguments,
    add_seed_argument,
    load_examples_or_exit,
)
from reasoning_from_scratch.device import get_device
from reasoning_from_scratch.evaluation import evaluate
from reasoning_from_scratch.prompts import render_prompt, render_prompt_with_think_tokens
from reasoning_from_scratch.validation import positive_int
from reasoning_from_scratch.weights import load_pretrained

PROMPTS = {"standard": render_prompt, "think": render_prompt_with_think_tokens}


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_model_argument(p)
    add_dataset_arguments(p)
    p.add_argument("--batch-size", type=positive_int, default=16,
                   help="number of prompts generated together")
    add_sampling_arguments(p, max_new_tokens=512, temperature=0.0, top_p=1.0)
    p.add_argument("--prompt", default="standard", choices=sorted(PROMPTS),
                   help="prompt template: standard render_prompt or the <think> variant")
    add_seed_argument(p, 123)
    p.add_argument("--output", default=None,
                   help="JSONL file for the per-example records (None: not written)")
    add_device_argument(p)
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    examples = load_examples_or_exit(args.dataset, args.split, args.data_path,
                                     args.cache_dir, args.limit)
    device = get_device(args.device)
    model, tokenizer = load_pretrained(args.model, device=device)
    print(f"model: {args.model} on {device}; dataset: {args.dataset} ({len(examples)} examples)")
    summary = evaluate(
        model, tokenizer, examples, device,
        max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
        temperature=args.temperature, top_p=args.top_p, prompt_fn=PROMPTS[args.prompt],
        jsonl_path=args.output, seed=args.seed, progress=not args.no_progress,
    )
    summary.pop("records")
    print(json.dumps(summary, indent=2))
    print(f"accuracy: {summary['accuracy'] * 100:.1f}% "
          f"({summary['num_correct']}/{summary['num_examples']})")
    if args.output:
        print(f"records written to {args.output}")
    return summary


if __name__ == "__main__":
    main()
