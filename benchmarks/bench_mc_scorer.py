"""Benchmark: the cost of Monte-Carlo step values, text continuations vs group + branched caches.

Both scorers value every non-final step prefix of the same sampled groups with k continuations
of the bundled tiny model (the policy chapter 8 trains):
- `mc` (`MonteCarloStepScorer`): each distinct prefix is re-encoded from its text, prefilled
  once and continued k times;
- `mc-branch` (`MonteCarloStepScorer(branch=True)`): the group's own completions through a
  prefix count as its samples, only the missing ones are sampled, and they continue from a copy
  of the completion's cache (one prefill per completion).
Prints generated and prefilled tokens, continuations and seconds of each, the branch scorer's
share of the text scorer's cost, and both against the tokens of the rollouts themselves (the
outcome reward's whole cost). Not a test: numbers depend on the machine and the policy.

    python benchmarks/bench_mc_scorer.py
    python benchmarks/bench_mc_scorer.py --prompts 32 --k 2 4 8
"""

import argparse
import time

import torch

from reasoning_from_scratch.cli.arguments import (
    add_device_argument,
    add_model_argument,
    add_seed_argument,
    add_threads_argument,
    set_threads,
)
from reasoning_from_scratch.datasets import load_dataset_by_name
from reasoning_from_scratch.device import get_device
from reasoning_from_scratch.generation import sample_rollouts_batch
from reasoning_from_scratch.process_supervision import build_step_scorer, process_token_advantages
from reasoning_from_scratch.prompts import render_prompt
from reasoning_from_scratch.validation import positive_int
from reasoning_from_scratch.weights import load_pretrained


def sample_groups(model, tokenizer, examples, num_rollouts, max_new_tokens, device, seed):
    """(example, Rollouts) of every example, sampled at temperature 1 as the trainer does."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    rollouts = sample_rollouts_batch(model, tokenizer, [render_prompt(e["problem"]) for e in
                                                        examples], num_rollouts, device,
                                     max_new_tokens, temperature=1.0, top_p=1.0, generator=gen)
    return list(zip(examples, rollouts))


def measure(spec, k, groups, model, tokenizer, max_new_tokens, seed):
    """Score every group with one scorer; its cost dict plus wall seconds."""
    scorer = build_step_scorer(spec, model, tokenizer, num_continuations=k,
                               max_new_tokens=max_new_tokens, temperature=1.0,
                               generator=torch.Generator().manual_seed(seed))
    t0 = time.perf_counter()
    for example, ro in groups:
        G = len(ro)
        process_token_advantages(ro, example, tokenizer, scorer, variant="value-delta",
                                 outcome_advantages=torch.zeros(G))
    cost = scorer.cost()
    cost["seconds"] = time.perf_counter() - t0
    return cost


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_model_argument(p, default="tiny-arith", help="policy model (name or directory)")
    p.add_argument("--prompts", type=positive_int, default=16,
                   help="training problems (one group of rollouts each)")
    p.add_argument("--num-rollouts", type=positive_int, default=8, help="G: rollouts per prompt")
    p.add_argument("--max-new-tokens", type=positive_int, default=112,
                   help="rollout budget (continuations get what their completion had left)")
    p.add_argument("--k", type=positive_int, nargs="+", default=[2, 4],
                   help="Monte-Carlo continuations per step prefix")
    add_seed_argument(p, help="seed of the problems, rollouts and continuations")
    add_device_argument(p)
    add_threads_argument(p, default=1)
    args = p.parse_args(argv)
    set_threads(args.threads)
    device = get_device(args.device)
    model, tokenizer = load_pretrained(args.model, device=device, dtype=torch.float32)
    examples = load_dataset_by_name("arith", "train", n=args.prompts, seed=args.seed)
    groups = sample_groups(model, tokenizer, examples, args.num_rollouts, args.max_new_tokens,
                           device, args.seed)
    rollout_tokens = sum(int(ro.lengths.sum()) for _, ro in groups)
    print(f"{args.prompts} groups x {args.num_rollouts} rollouts: {rollout_tokens} rollout "
          f"tokens (the outcome reward's whole cost)")
    print("| k | scorer | continuations | generated tokens | x rollout tokens | prefilled tokens "
          "| group samples used | seconds |")
    print("|---|---|---|---|---|---|---|---|")
    results = {}
    for k in args.k:
        for spec in ("mc", "mc-branch"):
            c = measure(spec, k, groups, model, tokenizer, args.max_new_tokens, args.seed)
            results[(k, spec)] = c
            prefill = c.get("mc_prefill_tokens")
            print(f"| {k} | {spec} | {c['mc_rollouts']:.0f} | {c['mc_generated_tokens']:.0f} | "
                  f"{c['mc_generated_tokens'] / rollout_tokens:.2f} | "
                  f"{'-' if prefill is None else f'{prefill:.0f}'} | "
                  f"{c.get('mc_reused', 0):.0f} | {c['seconds']:.2f} |")
    for k in args.k:
        text, branch = results[(k, "mc")], results[(k, "mc-branch")]
        tokens = branch["mc_generated_tokens"] / max(text["mc_generated_tokens"], 1)
        seconds = branch["seconds"] / max(text["seconds"], 1e-9)
        print(f"k={k}: mc-branch generates {tokens:.2f}x the tokens of mc in {seconds:.2f}x "
              "the time")
    return {"rollout_tokens": rollout_tokens,
            "results": {f"{spec}-k{k}": c for (k, spec), c in results.items()}}


if __name__ == "__main__":
    main()
