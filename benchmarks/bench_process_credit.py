"""Benchmark: the process credit's own cost against an outcome GRPO step, on the same rollouts.

For each of `--steps` batches of training problems, the bundled tiny model samples G rollouts
per prompt (seeded), and one outcome step is timed in its parts: rollouts (sampling, packing,
advantages), rewards, and the update (loss, backward, clip, AdamW). The same rollouts (the same
generators give the same samples) are then collected with the process credit of chapter 8's
`recommended` arm (`--step-scorer verifier-think --variant progress --alpha 1`, groups with all-
zero token advantages skipped), and the credit (`ProcessAdvantageFn`: steps, token offsets,
verifier, credit arithmetic) is timed alone, `--repeats` calls on the same groups, as it comes
and with every token offset found by prefix decoding (a tokenizer without
`encode_with_offsets`: the worst case, where no completion re-encodes to its own tokens).
Prints the credit's share of the outcome step, and apart from it the second difference between
the arms: the groups, completions and tokens each would update on (outcome skips the groups
whose rewards are all equal; process keeps those whose step credit differs) and that update's
seconds. Not a test: numbers depend on the machine and the policy.

    python benchmarks/bench_process_credit.py
    python benchmarks/bench_process_credit.py --steps 5 --prompts 16
"""

import argparse
import copy
import statistics
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
from reasoning_from_scratch.grading import grade_answer
from reasoning_from_scratch.grpo import collect_rollouts
from reasoning_from_scratch.process import VARIANTS
from reasoning_from_scratch.process_supervision import (
    build_step_scorer,
    make_process_advantage_fn,
)
from reasoning_from_scratch.rewards import TimedReward, build_reward
from reasoning_from_scratch.training import grpo_loss_on_batch
from reasoning_from_scratch.validation import non_negative_int, positive_int
from reasoning_from_scratch.weights import load_pretrained


class DecodeOnly:
    """The tokenizer without `encode_with_offsets`: every offset comes from prefix decoding."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def decode(self, ids, skip_special_tokens=False):
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


class CreditProbe:
    """An `advantage_fn` that times the process credit on the groups it is handed: the median of
    `repeats` calls, and the same with prefix-decoded offsets (`DecodeOnly`)."""

    def __init__(self, fn, worst, repeats):
        self.fn, self.worst, self.repeats = fn, worst, repeats
        self.seconds = self.worst_seconds = 0.0
        self.last_infos = []

    def __call__(self, groups, outcome_advantages, completion_mask):
        self.seconds += _median_call(self.fn, self.repeats, groups, outcome_advantages,
                                     completion_mask)
        self.worst_seconds += _median_call(self.worst, self.repeats, groups, outcome_advantages,
                                           completion_mask)
        out = self.fn(groups, outcome_advantages, completion_mask)
        self.last_infos = self.fn.last_infos
        return out


def _median_call(fn, repeats, *args):
    """Median wall seconds of `repeats` calls of fn(*args)."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def collect(model, tokenizer, examples, device, reward, args, seed, advantage_fn=None):
    """One step's rollouts, as the trainer collects them; (batch, seconds)."""
    gens = [torch.Generator(device="cpu").manual_seed(seed * 1000 + i)
            for i in range(len(examples))]  # one per prompt: the same samples for both arms
    t = time.perf_counter()
    batch = collect_rollouts(model, tokenizer, examples, device, reward, args.num_rollouts,
                             args.max_new_tokens, 1.0, 1.0, gens, skip_zero_advantage=True,
                             advantage_fn=advantage_fn)
    return batch, time.perf_counter() - t


def update_seconds(model, batch, args):
    """Seconds of one update on `batch` (loss, backward, clip, AdamW) from a copy of `model`."""
    if batch.size == 0:
        return 0.0
    m = copy.deepcopy(model).train()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-6)
    t = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    out = grpo_loss_on_batch(m, batch, max_completion_length=args.max_new_tokens)
    out["loss"].backward()
    torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
    opt.step()
    return time.perf_counter() - t


def measure_step(model, tokenizer, examples, device, args, seed):
    """Outcome step parts, the credit's seconds and both arms' update sizes for one batch."""
    reward = TimedReward(build_reward(tokenizer, 0.5, True))  # the chapter 8 default reward
    outcome, collect_s = collect(model, tokenizer, examples, device, reward, args, seed)
    scorer = build_step_scorer(args.step_scorer, model, tokenizer, device)  # belief: the policy
    fn = make_process_advantage_fn(tokenizer, scorer, args.variant, alpha=args.alpha)
    worst = make_process_advantage_fn(DecodeOnly(tokenizer), scorer, args.variant,
                                      alpha=args.alpha)
    probe = CreditProbe(fn, worst, args.repeats)
    process, _ = collect(model, tokenizer, examples, device, TimedReward(reward.fn), args, seed,
                         probe)
    G = args.num_rollouts
    return {
        "rollouts": collect_s - reward.seconds, "rewards": reward.seconds,
        "update": update_seconds(model, outcome, args), "credit": probe.seconds,
        "credit_prefix_decoding": probe.worst_seconds,
        "process_update": update_seconds(model, process, args),
        "outcome_rows": outcome.size, "process_rows": process.size,
        "outcome_groups": outcome.size // G, "process_groups": process.size // G,
        "outcome_tokens": int(outcome.completion_mask.sum()),
        "process_tokens": int(process.completion_mask.sum()),
        "generated_tokens": outcome.num_generated_tokens,
    }


def report(totals, args):
    """Print the per-step table and the two differences; returns the shares."""
    n = args.steps
    step = totals["rollouts"] + totals["rewards"] + totals["update"]
    print(f"outcome step: {step / n:.3f} s (rollouts {totals['rollouts'] / n:.3f}, rewards "
          f"{totals['rewards'] / n:.3f}, update {totals['update'] / n:.3f}); "
          f"{totals['generated_tokens'] / n:.0f} generated tokens per step")
    share = totals["credit"] / step
    worst = totals["credit_prefix_decoding"] / step
    print(f"process credit ({args.step_scorer}, {args.variant}): {totals['credit'] / n * 1e3:.1f}"
          f" ms per step = {share:.1%} of the outcome step; with prefix-decoded offsets "
          f"{totals['credit_prefix_decoding'] / n * 1e3:.1f} ms = {worst:.1%}")
    print("| arm | groups updated | completions | completion tokens | update s |")
    print("|---|---|---|---|---|")
    for arm, key in (("outcome", "update"), ("process", "process_update")):
        print(f"| {arm} | {totals[f'{arm}_groups']} | {totals[f'{arm}_rows']} | "
              f"{totals[f'{arm}_tokens']} | {totals[key]:.3f} |")
    extra = totals["process_update"] - totals["update"]
    more = totals["process_rows"] / max(totals["outcome_rows"], 1)
    print(f"more data: process updates on {more:.2f}x outcome's completions "
          f"({totals['process_rows'] - totals['outcome_rows']:+d}), {extra / n:+.3f} s of update "
          f"per step = {extra / step:+.1%} of the outcome step, against the credit's {share:.1%}")
    return {"credit_share": share, "credit_prefix_decoding_share": worst,
            "extra_update_share": extra / step, "rows_ratio": more}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_model_argument(p, default="tiny-arith", help="policy model (name or directory)")
    p.add_argument("--steps", type=positive_int, default=3,
                   help="batches of training problems (one training step each)")
    p.add_argument("--prompts", type=positive_int, default=8, help="prompts per step")
    p.add_argument("--num-rollouts", type=positive_int, default=8, help="G: rollouts per prompt")
    p.add_argument("--max-new-tokens", type=positive_int, default=112,
                   help="rollout budget (chapter 8's default)")
    p.add_argument("--step-scorer", default="verifier-think",
                   help="process step scorer spec, one without state (the credit is called "
                        "--repeats times on the same groups)")
    p.add_argument("--variant", default="progress", choices=VARIANTS,
                   help="process advantage variant")
    p.add_argument("--alpha", type=float, default=1.0, help="weight of the step credit")
    p.add_argument("--warmup", type=non_negative_int, default=1,
                   help="untimed steps first")
    p.add_argument("--repeats", type=positive_int, default=5,
                   help="credit calls per step on the same groups (the median is counted)")
    add_seed_argument(p, help="seed of the problems and rollouts")
    add_device_argument(p)
    add_threads_argument(p, default=1)
    args = p.parse_args(argv)
    set_threads(args.threads)
    device = get_device(args.device)
    model, tokenizer = load_pretrained(args.model, device=device, dtype=torch.float32)
    model.eval()
    examples = load_dataset_by_name("arith", "train", n=args.prompts * args.steps, seed=args.seed)
    grade_answer(r"\frac{\sqrt8}{2}", r"\sqrt2")  # starts the grader's sympy worker (one-off)
    for _ in range(args.warmup):
        measure_step(model, tokenizer, examples[:args.prompts], device, args, args.seed)
    totals = {}
    for s in range(args.steps):
        batch = examples[s * args.prompts:(s + 1) * args.prompts]
        for k, v in measure_step(model, tokenizer, batch, device, args, args.seed + s).items():
            totals[k] = totals.get(k, 0) + v
    print(f"{args.steps} steps x {args.prompts} prompts x {args.num_rollouts} rollouts, "
          f"{args.model}, {args.threads} thread(s)")
    return {**totals, **report(totals, args)}


if __name__ == "__main__":
    main()
