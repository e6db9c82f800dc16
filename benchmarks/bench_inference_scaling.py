"""Benchmark: self-consistency at N samples over many problems, batched vs a per-sample loop.

Three ways to get the same kind of result (N sampled answers per problem, majority vote), timed
side by side in one run on the same problems:
1. per-sample loop: one `sample_response` call per sample (N x problems decodes of one row);
2. per problem: `self_consistency_vote` (one prefill per problem, its N samples decoded together);
3. batched: `self_consistency_vote_batch` (--batch-size problems x N samples as one batch).
Prints seconds, generated tokens per second, majority-vote accuracy and the speed-up ratios.
The samples differ between the ways (the random numbers are drawn in another order), so the
accuracies agree only within sampling noise. Not a test: numbers depend on the machine.

    python benchmarks/bench_inference_scaling.py                  # N = 16, 100 problems, 1 thread
    python benchmarks/bench_inference_scaling.py --problems 20 --loop-problems 10
"""

import argparse
import time

import torch

from reasoning_from_scratch.cli.arguments import (
    add_model_argument,
    add_runtime_arguments,
    add_sampling_arguments,
    add_seed_argument,
    set_threads,
)
from reasoning_from_scratch.datasets import load_arith
from reasoning_from_scratch.device import get_device
from reasoning_from_scratch.generation import sample_response
from reasoning_from_scratch.grading import grade_answer
from reasoning_from_scratch.inference_scaling import (
    extract_answers,
    majority_vote,
    self_consistency_vote,
    self_consistency_vote_batch,
)
from reasoning_from_scratch.prompts import render_prompt
from reasoning_from_scratch.validation import (
    optional_positive_int,
    positive_int,
)
from reasoning_from_scratch.weights import load_pretrained


def _accuracy(answers, examples):
    return sum(a is not None and grade_answer(a, ex["answer"])
               for a, ex in zip(answers, examples)) / len(examples)


def per_sample_loop(model, tok, prompts, device, n, max_new_tokens, gen):
    """N separate `sample_response` calls per problem, then a vote: (answers, tokens)."""
    answers, tokens = [], 0
    for prompt in prompts:
        texts = []
        for _ in range(n):
            ids, prompt_len, text = sample_response(model, tok, prompt, device, max_new_tokens,
                                                    temperature=1.0, top_p=1.0, generator=gen)
            texts.append(text)
            tokens += ids.numel() - prompt_len
        answers.append(majority_vote(extract_answers(texts))[0])
    return answers, tokens


def per_problem(model, tok, prompts, device, n, max_new_tokens, gen):
    """`self_consistency_vote` problem by problem: (answers, tokens)."""
    votes = [self_consistency_vote(model, tok, p, device, n, max_new_tokens=max_new_tokens,
                                   generator=gen) for p in prompts]
    return [v["final_answer"] for v in votes], sum(v["num_generated_tokens"] for v in votes)


def batched(model, tok, prompts, device, n, max_new_tokens, gen, batch_size):
    """`self_consistency_vote_batch`: (answers, tokens)."""
    votes = self_consistency_vote_batch(model, tok, prompts, device, n, batch_size=batch_size,
                                        max_new_tokens=max_new_tokens, generator=gen)
    return [v["final_answer"] for v in votes], sum(v["num_generated_tokens"] for v in votes)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_model_argument(p)
    p.add_argument("--num-samples", type=positive_int, default=16, help="N, samples per problem")
    p.add_argument("--problems", type=positive_int, default=100,
                   help="arith test problems for the batched and per-problem ways")
    p.add_argument("--loop-problems", type=optional_positive_int, default=None,
                   help="problems for the per-sample loop (None: --problems); fewer are timed "
                        "and the rate per problem compared")
    p.add_argument("--batch-size", type=positive_int, default=25,
                   help="problems decoded together in the batched way")
    add_sampling_arguments(p, max_new_tokens=112, helps={
        "max_new_tokens": "tokens per sample (the tiny model's answers fit in 112)"})
    add_seed_argument(p, help="random seed")
    add_runtime_arguments(p, threads_help="torch CPU threads ('none': torch's default)")
    args = p.parse_args(argv)
    set_threads(args.threads)
    device = get_device(args.device)
    model, tok = load_pretrained(args.model, device=device, dtype=torch.float32)
    examples = load_arith("test", n=args.problems)
    prompts = [render_prompt(ex["problem"]) for ex in examples]
    n_loop = min(args.loop_problems or args.problems, args.problems)
    print(f"{args.model} on {device}, {torch.get_num_threads()} thread(s): self-consistency, "
          f"N = {args.num_samples}, {args.problems} problems (per-sample loop: {n_loop})")
    batched(model, tok, prompts[:2], device, 2, 8, torch.Generator().manual_seed(0), 2)  # warm

    ways = [
        ("per-sample loop (sample_response)", n_loop,
         lambda g: per_sample_loop(model, tok, prompts[:n_loop], device, args.num_samples,
                                   args.max_new_tokens, g)),
        ("per problem (self_consistency_vote)", args.problems,
         lambda g: per_problem(model, tok, prompts, device, args.num_samples,
                               args.max_new_tokens, g)),
        (f"batched, {args.batch_size} problems (self_consistency_vote_batch)", args.problems,
         lambda g: batched(model, tok, prompts, device, args.num_samples, args.max_new_tokens,
                           g, args.batch_size)),
    ]
    per_problem_s = []
    for name, count, run in ways:
        start = time.perf_counter()
        answers, tokens = run(torch.Generator().manual_seed(args.seed))
        seconds = time.perf_counter() - start
        per_problem_s.append(seconds / count)
        print(f"  {name:55s} {seconds:8.1f} s for {count} problems, "
              f"{tokens / seconds:8.0f} tokens/s, majority-vote accuracy "
              f"{_accuracy(answers, examples[:count]):.3f}", flush=True)
    loop, one, batch = per_problem_s
    print(f"  speed-up per problem: per problem vs loop {loop / one:.1f}x; batched vs loop "
          f"{loop / batch:.1f}x; batched vs per problem {one / batch:.1f}x")
    return {"loop_s": loop, "per_problem_s": one, "batched_s": batch}


if __name__ == "__main__":
    main()
