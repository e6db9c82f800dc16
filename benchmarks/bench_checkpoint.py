"""Benchmark: what a resumable checkpoint costs, and what periodic checkpoints cost a run.

Part 1 times `checkpoints.save_checkpoint` (weights in the Hugging Face layout, the AdamW
moments, the RNG states; temp dir, then rename) for the bundled tiny model and, with
`--sizes 0.6b`, a randomly initialised model of Qwen3-0.6B's shape, its AdamW state filled by
one step; `save_pretrained` (the weights alone) is timed too. The files go to --dir (default:
a temp dir), so the figure is that filesystem's: writes land in the page cache first, and a
slow or network disk takes longer. Part 2 (`--run-steps N`) trains the chapter 7 default
recipe on the bundled model for N steps twice, without periodic checkpoints and with one after
every step (the worst case: the default is one per 10 minutes), and prints the seconds per
step of each. Not a test: the numbers depend on the machine.

    python benchmarks/bench_checkpoint.py                                # tiny model
    python benchmarks/bench_checkpoint.py --sizes tiny 0.6b --dtype bfloat16
    python benchmarks/bench_checkpoint.py --run-steps 10
"""

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from reasoning_from_scratch.arithmetic import make_split
from reasoning_from_scratch.checkpoints import save_checkpoint
from reasoning_from_scratch.cli.arguments import (
    add_sampling_arguments,
    add_threads_argument,
    set_threads,
)
from reasoning_from_scratch.qwen3 import QWEN3_0_6B_CONFIG, Qwen3Model
from reasoning_from_scratch.training import GRPOConfig, train_grpo
from reasoning_from_scratch.validation import positive_int
from reasoning_from_scratch.weights import load_pretrained, save_pretrained


def model_of_size(size, dtype):
    """(model, tokenizer): the bundled tiny model, or a random one of Qwen3-0.6B's shape (with
    the bundled tokenizer, whose files are a few kB either way)."""
    model, tokenizer = load_pretrained("tiny-arith", device="cpu", dtype=dtype)
    if size == "0.6b":
        torch.manual_seed(0)
        model = Qwen3Model(QWEN3_0_6B_CONFIG).to(dtype)
    return model, tokenizer


def filled_optimizer(model):
    """AdamW after one step on zero gradients: both moments allocated, as in training."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return opt


def disk_bytes(path):
    """Bytes of the files under `path`."""
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def time_saves(size, dtype, repeats, root):
    """Median seconds of save_pretrained and of save_checkpoint, and the checkpoint's bytes."""
    model, tokenizer = model_of_size(size, dtype)
    opt = filled_optimizer(model)
    weights_s, ckpt_s = [], []
    for i in range(repeats):
        t0 = time.perf_counter()
        save_pretrained(model, tokenizer, root / f"{size}-weights")
        weights_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        save_checkpoint(root / f"{size}-checkpoint-{i}", model, tokenizer, opt, i, {"size": size})
        ckpt_s.append(time.perf_counter() - t0)
        size_bytes = disk_bytes(root / f"{size}-checkpoint-{i}")
        shutil.rmtree(root / f"{size}-checkpoint-{i}")
    shutil.rmtree(root / f"{size}-weights")
    params = sum(p.numel() for p in model.parameters())
    return {"size": size, "params": params, "weights_s": statistics.median(weights_s),
            "checkpoint_s": statistics.median(ckpt_s), "checkpoint_bytes": size_bytes}


def run_seconds_per_step(steps, root, prompts_per_step, max_new_tokens, **policy):
    """Seconds per step of a chapter 7 default run (no evaluation) on the bundled model."""
    model, tokenizer = load_pretrained("tiny-arith", device="cpu")
    config = GRPOConfig(steps=steps, eval_every=0, eval_examples=1, sample_every=0,
                        prompts_per_step=prompts_per_step, max_new_tokens=max_new_tokens,
                        progress=False, output_dir=str(root / f"run-{len(policy)}"),
                        checkpoint_minutes=0.0, **policy)
    train = make_split("train", 2000, seed=1)
    base = {"accuracy": 0.0}  # the base evaluation is not what is measured here
    t0 = time.perf_counter()
    train_grpo(model, tokenizer, train, train[:1], "cpu", config, base_evaluation=base,
               overwrite=True)
    return (time.perf_counter() - t0) / steps


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--sizes", nargs="+", default=["tiny"], choices=("tiny", "0.6b"),
                   help="models to checkpoint: the bundled tiny one, a random Qwen3-0.6B shape")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="dtype of the weights (and so of the AdamW moments)")
    p.add_argument("--repeats", type=positive_int, default=3,
                   help="saves timed per size (the median is printed)")
    p.add_argument("--run-steps", type=int, default=0,
                   help="also time N steps of the chapter 7 default run with and without a "
                        "checkpoint after every step (0: skip)")
    p.add_argument("--prompts-per-step", type=positive_int, default=16,
                   help="--run-steps: prompts per step (16: the chapter 7 default)")
    add_sampling_arguments(p, max_new_tokens=112, helps={
        "max_new_tokens": "--run-steps: tokens per rollout (112: the chapter 7 default)"})
    p.add_argument("--dir", default=None, help="where to write (None: a temp dir)")
    add_threads_argument(p, help="torch CPU threads")
    args = p.parse_args(argv)
    set_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    root = Path(tempfile.mkdtemp(prefix="bench-ckpt-", dir=args.dir))
    results = {"saves": [], "run": None}
    try:
        for size in args.sizes:
            r = time_saves(size, dtype, args.repeats, root)
            results["saves"].append(r)
            print(f"{size:>5} ({r['params'] / 1e6:.1f}M params, {args.dtype}): save_pretrained "
                  f"{r['weights_s'] * 1e3:.1f} ms, save_checkpoint {r['checkpoint_s'] * 1e3:.1f} "
                  f"ms for {r['checkpoint_bytes'] / 1e6:.1f} MB "
                  f"({r['checkpoint_bytes'] / 1e9 / r['checkpoint_s']:.2f} GB/s)")
        if args.run_steps:
            shape = (args.prompts_per_step, args.max_new_tokens)
            off = run_seconds_per_step(args.run_steps, root, *shape)
            every = run_seconds_per_step(args.run_steps, root, *shape, checkpoint_every=1)
            results["run"] = {"off_s_per_step": off, "every_step_s_per_step": every}
            print(f"chapter 7 default run, {args.run_steps} steps: {off:.3f} s/step without "
                  f"periodic checkpoints, {every:.3f} s/step with one after every step "
                  f"({(every - off) / off:+.1%})")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return results


if __name__ == "__main__":
    main()
