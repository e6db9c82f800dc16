"""Chapter 4: inference-time scaling by sampling: chain-of-thought prompts, temperature, top-p,
top-k, pass@k and self-consistency (majority voting), on the bundled model or a real one.

Three parts, all on the same held-out problems:
1. plain prompt vs the chain-of-thought ("think") prompt, greedy decoding;
2. one row per sampling setting (temperature, top-p, top-k): per-sample accuracy (pass@1),
   unbiased pass@k, self-consistency accuracy over the same samples, distinct answers per
   problem and tokens; all samples of a batch of problems are decoded together;
3. self-consistency with early stopping: the same final answers, fewer samples.

Examples:
    python chapters/ch04_inference_scaling.py                  # bundled tiny model, 50 problems
    python chapters/ch04_inference_scaling.py --limit 100 --num-samples 16 --temperatures 0.7,1
    python chapters/ch04_inference_scaling.py --model Qwen/Qwen3-0.6B-Base --dataset math500 \
        --limit 20 --max-new-tokens 1024 --num-samples 4
"""

import argparse
import json
import time

import torch

from reasoning_from_scratch.cli.arguments import (
    SHORT_THREADS_HELP,
    add_dataset_arguments,
    add_model_argument,
    add_runtime_arguments,
    add_sampling_arguments,
    add_seed_argument,
    load_examples_or_exit,
    set_threads,
)
from reasoning_from_scratch.device import get_device
from reasoning_from_scratch.evaluation import evaluate
from reasoning_from_scratch.grading import grade_answer
from reasoning_from_scratch.inference_scaling import (
    pass_at_k,
    pool_answers,
    self_consistency_vote,
    self_consistency_vote_batch,
)
from reasoning_from_scratch.prompts import render_prompt, render_prompt_with_think_tokens
from reasoning_from_scratch.validation import arg_type, non_negative, non_negative_int, positive_int
from reasoning_from_scratch.weights import load_pretrained

PROMPTS = {"standard": render_prompt, "think": render_prompt_with_think_tokens}


def _temperature_list(text):
    """argparse type: comma-separated temperatures, each >= 0 (0 = greedy)."""
    parse = arg_type(float, non_negative)
    values = [parse(t) for t in text.split(",") if t.strip()]
    if not values:
        raise argparse.ArgumentTypeError("expected at least one temperature")
    return values


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_model_argument(p)
    add_dataset_arguments(p, limit=50, limit_help="number of problems")
    p.add_argument("--num-samples", type=positive_int, default=8,
                   help="samples per problem for each sampling setting (pass@k for k up to it)")
    p.add_argument("--temperatures", type=_temperature_list, default=[0.5, 1.0, 1.5],
                   help="comma-separated temperatures, each sampled with top-p 1 and top-k off")
    add_sampling_arguments(p, top_p=0.9, top_k=3, max_new_tokens=512, helps={
        "top_p": "nucleus threshold of the extra top-p row (at temperature 1)",
        "top_k": "k of the extra top-k row (at temperature 1)"})
    p.add_argument("--batch-size", type=positive_int, default=16,
                   help="problems whose samples are decoded together")
    p.add_argument("--early-stop-problems", type=non_negative_int, default=10,
                   help="problems for the early-stopping demonstration (0: skip it)")
    p.add_argument("--chunk-size", type=positive_int, default=4,
                   help="samples per chunk in the early-stopping demonstration")
    add_seed_argument(p, 123)
    p.add_argument("--output", default=None, help="JSON file for the results (None: not written)")
    add_runtime_arguments(p, threads_help=SHORT_THREADS_HELP)
    return p.parse_args(argv)


def compare_prompts(model, tokenizer, examples, device, args) -> dict:
    """Greedy accuracy and think-format rate with the plain and the chain-of-thought prompt."""
    out = {}
    for name, prompt_fn in PROMPTS.items():
        s = evaluate(model, tokenizer, examples, device, max_new_tokens=args.max_new_tokens,
                     batch_size=args.batch_size, prompt_fn=prompt_fn, progress=False)
        out[name] = {"accuracy": s["accuracy"], "format_rate": s["format_rate"],
                     "mean_length": s["mean_length"]}
        print(f"  {name:8s} prompt: accuracy {s['accuracy']:.3f}, think format "
              f"{s['format_rate']:.2f}, {s['mean_length']:.0f} tokens")
    return out


def sampling_row(model, tokenizer, examples, device, args, temperature, top_p=1.0,
                 top_k=None) -> dict:
    """pass@1, pass@k, majority-vote accuracy and answer diversity of one sampling setting."""
    gen = torch.Generator().manual_seed(args.seed)
    start = time.perf_counter()
    votes = self_consistency_vote_batch(
        model, tokenizer, [render_prompt(ex["problem"]) for ex in examples], device,
        num_samples=args.num_samples, batch_size=args.batch_size, temperature=temperature,
        top_p=top_p, top_k=top_k, max_new_tokens=args.max_new_tokens, generator=gen)
    seconds = time.perf_counter() - start
    n, ks = args.num_samples, sorted({1, 2, 4, 8, 16, args.num_samples} & set(
        range(1, args.num_samples + 1)))
    correct = [sum(a is not None and grade_answer(a, ex["answer"]) for a in v["short_answers"])
               for v, ex in zip(votes, examples)]
    return {
        "temperature": temperature, "top_p": top_p, "top_k": top_k,
        "pass_at_k": {k: sum(pass_at_k(n, c, k) for c in correct) / len(examples) for k in ks},
        "majority_accuracy": sum(v["final_answer"] is not None
                                 and grade_answer(v["final_answer"], ex["answer"])
                                 for v, ex in zip(votes, examples)) / len(examples),
        "distinct_answers": sum(len(pool_answers(v["short_answers"])) for v in votes)
        / len(examples),
        "tokens_per_sample": sum(v["num_generated_tokens"] for v in votes) / (n * len(examples)),
        "seconds": seconds,
    }


def early_stopping(model, tokenizer, examples, device, args) -> dict:
    """Self-consistency with and without early stopping: same answers, samples saved."""
    same = drawn = 0
    for i, ex in enumerate(examples):
        runs = [self_consistency_vote(model, tokenizer, render_prompt(ex["problem"]), device,
                                      num_samples=args.num_samples, chunk_size=args.chunk_size,
                                      max_new_tokens=args.max_new_tokens, early_stop=early,
                                      generator=torch.Generator().manual_seed(args.seed + i))
                for early in (False, True)]
        same += runs[0]["final_answer"] == runs[1]["final_answer"]
        drawn += runs[1]["num_samples"]
    total = args.num_samples * len(examples)
    print(f"  early stopping: same final answer on {same}/{len(examples)} problems, "
          f"{drawn}/{total} samples drawn ({1 - drawn / total:.0%} saved)")
    return {"same_answer": same, "problems": len(examples), "samples_drawn": drawn,
            "samples_without_early_stop": total}


def main(argv=None):
    args = parse_args(argv)
    set_threads(args.threads)
    examples = load_examples_or_exit(args.dataset, args.split, args.data_path,
                                     args.cache_dir, args.limit)
    device = get_device(args.device)
    model, tokenizer = load_pretrained(args.model, device=device)
    print(f"model: {args.model} on {device}; {args.dataset}: {len(examples)} problems")

    print("1. plain vs chain-of-thought prompt (greedy)")
    results = {"prompts": compare_prompts(model, tokenizer, examples, device, args)}
    print(f"2. sampling settings, {args.num_samples} samples per problem")
    settings = [dict(temperature=t) for t in args.temperatures]
    settings += [dict(temperature=1.0, top_p=args.top_p), dict(temperature=1.0, top_k=args.top_k)]
    rows = []
    for s in settings:
        row = sampling_row(model, tokenizer, examples, device, args, **s)
        rows.append(row)
        passes = ", ".join(f"pass@{k} {v:.3f}" for k, v in row["pass_at_k"].items())
        print(f"  T={row['temperature']:<4} top-p={row['top_p']:<4} top-k={row['top_k']}: "
              f"{passes}; majority vote {row['majority_accuracy']:.3f}; "
              f"{row['distinct_answers']:.1f} distinct answers; "
              f"{row['tokens_per_sample']:.0f} tokens/sample; {row['seconds']:.1f} s")
    results["sampling"] = rows
    if args.early_stop_problems:
        print(f"3. self-consistency with early stopping (chunks of {args.chunk_size})")
        results["early_stopping"] = early_stopping(
            model, tokenizer, examples[:args.early_stop_problems], device, args)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2)
        print(f"results written to {args.output}")
    return results


if __name__ == "__main__":
    main()
