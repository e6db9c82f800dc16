"""Benchmark: how noisy each credit's policy gradient is, on the same rollouts.

Chapter 8 compares outcome rewards with step credit at one learning rate. Whether a search over
the step size can change that comparison depends on what limits a step: if one batch's gradient
is mostly noise, a larger step scales the noise with the signal and a search buys little; if
it is mostly signal, the step size is the limit and a search can pay. And a credit whose
gradient carries more signal per batch is worth what a larger batch would be.

For K independent batches (`--batches`) of chapter 8's training problems (`--prompts` prompts x
G rollouts each, seeded), the policy samples the rollouts once per batch; every arm then
scores the same rollouts with its own credit (outcome, `recommended`, its `placebo`, ...,
exactly as `experiments/process_vs_outcome.ARMS` configures them, zero-signal groups dropped
as in training) and takes the gradient of its GRPO loss. `stats.gradient_noise` turns the K
gradients of each arm into its signal-to-noise ratio per batch, its noise scale (the batch at
which signal equals noise) and the agreement of two independent halves of the batches. Gradient
norms are before clipping (chapter 8 clips at 1.0). Not a test: the figures depend on the policy
(`--model` takes a run's `final` directory too) and on K.

    python benchmarks/bench_gradient_noise.py --model tiny-arith-think
    python benchmarks/bench_gradient_noise.py --model runs/.../outcome-seed0/final --batches 16
"""

import argparse
import random

import torch

from reasoning_from_scratch.cli.arguments import (
    add_device_argument,
    add_model_argument,
    add_seed_argument,
    add_threads_argument,
    set_threads,
)
from reasoning_from_scratch.cli.train import load_grpo_data
from reasoning_from_scratch.device import get_device
from reasoning_from_scratch.experiments.process_vs_outcome import ARMS
from reasoning_from_scratch.experiments.stats import gradient_noise
from reasoning_from_scratch.grading import grade_answer
from reasoning_from_scratch.grpo import LOSS_TYPES, collect_rollouts
from reasoning_from_scratch.process import LOCAL_STEP_WEIGHT
from reasoning_from_scratch.process_supervision import make_process_advantage_fn
from reasoning_from_scratch.rewards import build_reward
from reasoning_from_scratch.training import DEFAULT_TRAIN_LEVEL_WEIGHTS, grpo_loss_on_batch
from reasoning_from_scratch.validation import arg_type, at_least, choice_list, positive_int
from reasoning_from_scratch.weights import load_pretrained


def advantage_fn_of(arm, tokenizer, seed):
    """The arm's process credit as `collect_rollouts` takes it (None: outcome)."""
    spec = ARMS[arm]
    if spec.scorer is None:
        return None
    if spec.scorer.startswith(("prm", "online-prm", "mc")):
        raise SystemExit(f"{arm}: only arms without a model of their own (verifier scorers) "
                         "are measured here")
    if spec.config.get("branch_rollouts"):
        raise SystemExit(f"{arm}: its branches at the first error are extra rows of the batch, "
                         "which this benchmark does not build (it measures the credit alone)")
    return make_process_advantage_fn(
        tokenizer, spec.scorer, spec.variant, alpha=spec.config.get("process_alpha", 1.0),
        credit_control=spec.config.get("process_credit_control", "none"), seed=seed,
        local_weight=spec.config.get("process_local_weight", LOCAL_STEP_WEIGHT))


def batch_gradient(model, batch, loss_type, max_new_tokens):
    """(P,) the flattened gradient of the GRPO loss on `batch` (zeros for an empty batch: the
    trainer skips such a step)."""
    model.zero_grad(set_to_none=False)
    if batch.size:
        out = grpo_loss_on_batch(model, batch, loss_type=loss_type,
                                 max_completion_length=max_new_tokens)
        out["loss"].backward()
    return torch.cat([torch.zeros(p.numel()) if p.grad is None else p.grad.reshape(-1).cpu()
                      for p in model.parameters()]).detach().clone()


def arm_gradients(model, tokenizer, examples, device, arms, args):
    """{arm: (K, P) gradients}, {arm: rows updated}: the same rollouts for every arm, batch by
    batch (the generators are re-seeded per arm, so every arm samples the same tokens)."""
    reward = build_reward(tokenizer, 0.5, True)  # chapter 8's reward: answer + conditional format
    grads, rows = {arm: [] for arm in arms}, {arm: 0 for arm in arms}
    for k in range(args.batches):
        batch_examples = examples[k * args.prompts:(k + 1) * args.prompts]
        for arm in arms:
            gens = [torch.Generator(device="cpu").manual_seed(args.seed * 100_003 + k * 101 + i)
                    for i in range(len(batch_examples))]
            model.eval()
            batch = collect_rollouts(model, tokenizer, batch_examples, device, reward,
                                     args.num_rollouts, args.max_new_tokens, 1.0, 1.0, gens,
                                     skip_zero_advantage=True,
                                     advantage_fn=advantage_fn_of(arm, tokenizer, args.seed))
            model.train()
            grads[arm].append(batch_gradient(model, batch, args.loss_type, args.max_new_tokens))
            rows[arm] += batch.size
    return {arm: torch.stack(g) for arm, g in grads.items()}, rows


def report(stats, rows, args):
    """Print one row per arm; the cosine of each arm's mean gradient with outcome's."""
    n = args.prompts * args.num_rollouts
    print(f"{args.batches} batches x {n} completions ({args.prompts} prompts x "
          f"{args.num_rollouts}), {args.model}, loss {args.loss_type}")
    print("| arm | rows updated per batch | batch grad norm | mean grad norm | SNR per batch "
          "| noise scale (completions) | half-half cosine | cosine with outcome |")
    print("|---|---|---|---|---|---|---|---|")
    for arm, s in stats.items():
        print(f"| {arm} | {rows[arm] / args.batches:.1f} | {s['batch_norm']:.3f} | "
              f"{s['mean_norm']:.3f} | {s['snr']:.3f} | {s['noise_scale']:.0f} | "
              f"{s['half_cosine']:.3f} | {s.get('cosine_outcome', float('nan')):.3f} |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_model_argument(p, default="tiny-arith-think",
                       help="policy model (a name, or a directory such as a run's final/)")
    p.add_argument("--arms", type=choice_list(ARMS), default="outcome,recommended,placebo,shuffled",
                   help="comma-separated chapter 8 arms (outcome and the verifier arms)")
    p.add_argument("--batches", type=arg_type(int, at_least(2)), default=8,
                   help="K: independent batches per arm (at least 2)")
    p.add_argument("--prompts", type=positive_int, default=8, help="prompts per batch")
    p.add_argument("--num-rollouts", type=positive_int, default=8, help="G: rollouts per prompt")
    p.add_argument("--max-new-tokens", type=positive_int, default=112,
                   help="rollout budget (chapter 8's default)")
    p.add_argument("--loss-type", default="grpo", choices=LOSS_TYPES,
                   help="the loss whose gradient is measured")
    add_seed_argument(p, help="seed of the problems and rollouts")
    add_device_argument(p)
    add_threads_argument(p, default=1)
    args = p.parse_args(argv)
    arms = args.arms
    set_threads(args.threads)
    device = get_device(args.device)
    model, tokenizer = load_pretrained(args.model, device=device, dtype=torch.float32)
    train, _ = load_grpo_data("arith", None, "val", 1, DEFAULT_TRAIN_LEVEL_WEIGHTS)  # ch08's
    examples = random.Random(args.seed).sample(train, args.batches * args.prompts)
    grade_answer(r"\frac{\sqrt8}{2}", r"\sqrt2")  # starts the grader's sympy worker (one-off)
    grads, rows = arm_gradients(model, tokenizer, examples, device, arms, args)
    stats = {arm: gradient_noise(g, args.prompts * args.num_rollouts) for arm, g in grads.items()}
    if "outcome" in grads:
        ref = grads["outcome"].double().mean(0)
        for arm, g in grads.items():
            m = g.double().mean(0)
            stats[arm]["cosine_outcome"] = float(torch.dot(m, ref) / (m.norm() * ref.norm()))
    report(stats, rows, args)
    return {"stats": stats, "rows": rows}


if __name__ == "__main__":
    main()
