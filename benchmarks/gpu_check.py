"""GPU check: one GRPO step at Qwen3-0.6B size (random weights, bfloat16), G = 16 rollouts.

Builds a model with the published Qwen3-0.6B hyper-parameters (`QWEN3_0_6B_CONFIG`, random
weights: nothing is downloaded) in bfloat16 on the GPU and runs GRPO steps through the package's
own pieces: `grpo.collect_rollouts` (G rollouts per prompt from one shared prefill, decoded as
one batch, scored by a reward with signal for a random model: the fraction of even token ids),
then `grpo.grpo_loss_on_batch` on micro-batches weighted by `training.micro_batch_weight`,
gradient-norm clipping and an AdamW step, as `training.train_grpo` does. EOS is disabled, so
every rollout runs to --max-new-tokens. After --warmup untimed steps it prints, per timed
step, the rollout tokens/s, the step time (rollouts + update) and the peak GPU memory
(`torch.cuda.max_memory_allocated`). Without CUDA it says that it needs CUDA and exits 0.

    python benchmarks/gpu_check.py                                # G=16, 4 prompts, 256 tokens
    python benchmarks/gpu_check.py --prompts 2 --max-new-tokens 128 --micro-batch-size 8
"""

import argparse
import sys
import time

import torch
from bench_grpo_step import PROBLEMS, NoEosTokenizer, even_fraction

from reasoning_from_scratch.cli.arguments import add_sampling_arguments, add_seed_argument
from reasoning_from_scratch.grpo import collect_rollouts, grpo_loss_on_batch
from reasoning_from_scratch.qwen3 import QWEN3_0_6B_CONFIG, Qwen3Model
from reasoning_from_scratch.rewards import CompositeReward, RewardTerm
from reasoning_from_scratch.training import micro_batch_weight
from reasoning_from_scratch.validation import non_negative_int, positive_float, positive_int

GIB = 2**30


def sync(device):
    """Wait for the GPU, so that a timer measures finished work."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def grpo_step(model, optimizer, tokenizer, examples, reward, generator, args, device) -> dict:
    """One GRPO step (rollouts, then a micro-batched update); returns its figures."""
    sync(device)
    t0 = time.perf_counter()
    batch = collect_rollouts(model, tokenizer, examples, device, reward, args.num_rollouts,
                             args.max_new_tokens, temperature=1.0, top_p=1.0,
                             generator=generator)
    sync(device)
    t1 = time.perf_counter()
    model.train()
    optimizer.zero_grad(set_to_none=True)
    mbs = args.micro_batch_size or batch.size
    loss = 0.0
    for start in range(0, batch.size, mbs):  # gradients accumulate over the micro-batches
        mb = batch.slice(start, start + mbs)
        out = grpo_loss_on_batch(model, mb, loss_type="grpo",
                                 max_completion_length=args.max_new_tokens)
        weight = micro_batch_weight(mb, batch, "grpo")
        (out["loss"] * weight).backward()
        loss += out["loss"].item() * weight
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
    optimizer.step()
    model.eval()
    sync(device)
    t2 = time.perf_counter()
    return {"rollout_s": t1 - t0, "update_s": t2 - t1, "step_s": t2 - t0, "loss": loss,
            "grad_norm": grad_norm, "tokens": batch.num_generated_tokens, "rows": batch.size}


def report(i, r) -> str:
    """One printed line per timed step."""
    return (f"step {i}: {r['rows']} rollouts, {r['tokens']} tokens in {r['rollout_s']:.2f} s = "
            f"{r['tokens'] / r['rollout_s']:.0f} rollout tokens/s | update {r['update_s']:.2f} s "
            f"| step {r['step_s']:.2f} s | loss {r['loss']:.4f}, grad norm {r['grad_norm']:.3f} "
            f"| peak GPU memory {r['peak_gib']:.1f} GiB")


def main(argv=None) -> int:
    """Parse the flags; without CUDA say so, else run and report the GRPO steps (exit 0)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--num-rollouts", type=positive_int, default=16, help="G, rollouts per prompt")
    p.add_argument("--prompts", type=positive_int, default=4, help="prompts (groups) per step")
    add_sampling_arguments(p, max_new_tokens=256, helps={
        "max_new_tokens": "tokens per rollout (EOS disabled: every rollout runs this long)"})
    p.add_argument("--micro-batch-size", type=non_negative_int, default=16,
                   help="rollouts per forward/backward in the update (0: all at once)")
    p.add_argument("--lr", type=positive_float, default=1e-6, help="AdamW learning rate")
    p.add_argument("--steps", type=positive_int, default=1, help="timed GRPO steps")
    p.add_argument("--warmup", type=non_negative_int, default=1,
                   help="untimed steps first (CUDA kernels, allocator and AdamW state warm up)")
    add_seed_argument(p, help="weights and sampling seed")
    args = p.parse_args(argv)

    if not torch.cuda.is_available():
        print("gpu_check needs CUDA: torch.cuda.is_available() is False on this machine "
              f"(torch {torch.__version__}); nothing to check here.")
        return 0
    torch.manual_seed(args.seed)
    model = Qwen3Model(QWEN3_0_6B_CONFIG).to(device="cuda", dtype=torch.bfloat16).eval()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    tokenizer = NoEosTokenizer(model.cfg.vocab_size)
    reward = CompositeReward([RewardTerm("even", even_fraction)])
    examples = [PROBLEMS[i % len(PROBLEMS)] for i in range(args.prompts)]
    generator = torch.Generator(device="cuda").manual_seed(args.seed)
    params = sum(p.numel() for p in model.parameters()) / 1e9
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | Qwen3-0.6B size "
          f"({params:.2f}B params, random, bfloat16) | {args.prompts} prompts x G="
          f"{args.num_rollouts}, {args.max_new_tokens} new tokens, micro-batch "
          f"{args.micro_batch_size or 'all'}", flush=True)
    for _ in range(args.warmup):
        grpo_step(model, optimizer, tokenizer, examples, reward, generator, args, "cuda")
    for i in range(1, args.steps + 1):
        torch.cuda.reset_peak_memory_stats()
        r = grpo_step(model, optimizer, tokenizer, examples, reward, generator, args, "cuda")
        r["peak_gib"] = torch.cuda.max_memory_allocated() / GIB
        print(report(i, r), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
