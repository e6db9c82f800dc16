"""Benchmark: one GRPO training step, this package's batched path vs the book's chapter 7 style.

Ours: `collect_rollouts` (G rollouts per prompt from one shared prefill, decoded as a batch),
one packed log-prob pass for the reference model, and the update on per-token log-probs from a
single batched forward (old log-probs = the current ones detached, no model copy).
Book style: G sequential `sample_response` calls per prompt, a `copy.deepcopy` of the model as
the old policy every step, and one `sequence_logprob` call per rollout for policy, old policy and
reference. Both use the same random model, prompts, G, token budget (EOS disabled so every
completion runs to max_new_tokens), rewards, optimizer and KL weight. Prints time per step split
into rollout / scoring / log-prob / update, generated tokens/s, peak memory and the speed-up.
Not a test: numbers depend on the machine.

    python benchmarks/bench_grpo_step.py                         # tiny size on the best device
    python benchmarks/bench_grpo_step.py --sizes tiny 0.6b --steps 2
    python benchmarks/bench_grpo_step.py --paths ours compiled --prompts 8 --max-new-tokens 112
    python benchmarks/bench_grpo_step.py --paths ours compiled-update --warmup 2

"compiled-update" is ours with the update's decoder blocks compiled: the reference's log-prob
pass and the update pad the batch to one shape (`compiled_update.FixedShape`: prompts x G rows, the
longest prompt + the token budget) and run the blocks through `compiled_update.compiled_block`; its
warm-up compiles them (with and without gradients). On a shared machine the paths, timed one
after the other, see different loads; `--interleave-update N` instead times the reference's
log-probs + the update on one fixed batch, eager and compiled in turn, N times each, in wall
and CPU time:

    python benchmarks/bench_grpo_step.py --prompts 8 --max-new-tokens 112 --interleave-update 4

With `--vary-lengths B` the interleaved comparison runs on B batches whose rows and completion
lengths vary as the chapter 7 default run's do, and adds the update compiled in length buckets
(`--update-buckets`, `GRPOConfig.update_buckets`) next to the one-shape one:

    python benchmarks/bench_grpo_step.py --prompts 16 --max-new-tokens 112 --beta 0 \\
        --interleave-update 2 --vary-lengths 6 --threads 1
"""

import argparse
import copy
import dataclasses
import resource
import time

import torch
from torch._dynamo.utils import counters

from reasoning_from_scratch.cli.arguments import (
    add_device_argument,
    add_sampling_arguments,
    add_threads_argument,
    set_threads,
)
from reasoning_from_scratch.compiled_update import FixedShape
from reasoning_from_scratch.device import get_device
from reasoning_from_scratch.generation import sample_response
from reasoning_from_scratch.grpo import (
    batch_logprobs,
    collect_rollouts,
    compute_advantage_stats,
    sequence_logprob,
)
from reasoning_from_scratch.prompts import render_prompt
from reasoning_from_scratch.qwen3 import QWEN3_0_6B_CONFIG, Qwen3Model, tiny_config
from reasoning_from_scratch.rewards import (
    CompositeReward,
    RewardTerm,
    TimedReward,
    correctness_reward,
)
from reasoning_from_scratch.tiny_world import TINY_ARITH_ARCH
from reasoning_from_scratch.training import grpo_loss_on_batch
from reasoning_from_scratch.validation import non_negative_int, positive_int

PROBLEMS = [{"problem": f"{a}+{b}*{c}", "answer": str(a + b * c)}
            for a, b, c in [(12, 3, 4), (7, 9, 2), (25, 4, 3), (18, 6, 5), (9, 8, 7), (30, 2, 2),
                            (14, 5, 6), (21, 7, 3)]]


class NoEosTokenizer:
    """Stand-in tokenizer: one id per character and no EOS, so every rollout has full length."""

    eos_token_id = None
    pad_token_id = 0

    def __init__(self, vocab_size):
        self.vocab_size = vocab_size

    def encode(self, text):
        return [1 + ord(c) % (self.vocab_size - 1) for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(48 + i % 10) for i in ids)  # digits: the grader has work to do


def even_fraction(text, ids, prompt_len, example):
    """A reward with signal for a random model: fraction of even generated ids."""
    gen = ids[prompt_len:]
    return float((gen % 2 == 0).float().mean()) if gen.numel() else 0.0


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def make_model(size, device):
    torch.manual_seed(0)
    if size == "tiny":
        cfg = tiny_config(vocab_size=384, **TINY_ARITH_ARCH)
    else:
        cfg = QWEN3_0_6B_CONFIG
    return Qwen3Model(cfg).to(device=device, dtype=torch.float32)


def ours_step(model, ref, opt, tok, prompts, args, device, gen, reward):
    """This package's step; returns {phase: seconds}."""
    reward.seconds = 0.0
    sync(device)
    t0 = time.perf_counter()
    batch = collect_rollouts(model, tok, prompts, device, reward, args.G, args.max_new_tokens,
                             1.0, 1.0, gen, compile=getattr(args, "compile_rollouts", False))
    sync(device)
    t1 = time.perf_counter()
    shape = getattr(args, "fixed_shape", None)  # the compiled update's padding, or None
    with torch.no_grad():
        ref_logp, _ = batch_logprobs(ref, batch, with_entropy=False, fixed_shape=shape)
    sync(device)
    t2 = time.perf_counter()
    model.train()
    opt.zero_grad(set_to_none=True)
    out = grpo_loss_on_batch(model, batch, None, ref_logp, "grpo", 0.2, None, args.beta,
                             fixed_shape=shape)
    out["loss"].backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    model.eval()
    sync(device)
    t3 = time.perf_counter()
    return {"rollout": t1 - t0 - reward.seconds, "scoring": reward.seconds, "logprob": t2 - t1,
            "update": t3 - t2, "tokens": batch.num_generated_tokens}


def book_step(model, ref, opt, tok, prompts, args, device, gen, reward):
    """The book's chapter 7 step written plainly; returns {phase: seconds}."""
    sync(device)
    t0 = time.perf_counter()
    rollouts, score_s = [], 0.0
    for ex in prompts:
        for _ in range(args.G):  # one rollout at a time
            ids, plen, text = sample_response(model, tok, render_prompt(ex["problem"]), device,
                                              max_new_tokens=args.max_new_tokens,
                                              temperature=1.0, top_p=1.0, generator=gen)
            ts = time.perf_counter()
            r = reward(text, ids, plen, ex)[0]
            score_s += time.perf_counter() - ts
            rollouts.append((ids, plen, r))
    sync(device)
    t1 = time.perf_counter()
    old_model = copy.deepcopy(model)  # the old policy, copied every step
    with torch.no_grad():
        old = [sequence_logprob(old_model, ids, plen) for ids, plen, _ in rollouts]
        refs = [sequence_logprob(ref, ids, plen) for ids, plen, _ in rollouts]
    sync(device)
    t2 = time.perf_counter()
    model.train()
    opt.zero_grad(set_to_none=True)
    G = args.G
    loss = 0.0
    for i in range(len(prompts)):
        group = rollouts[i * G:(i + 1) * G]
        adv = compute_advantage_stats([r for _, _, r in group])[0].to(device)
        logps = torch.stack([sequence_logprob(model, ids, plen) for ids, plen, _ in group])
        ratio = torch.exp(logps - torch.stack(old[i * G:(i + 1) * G]))
        obj = torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
        kl = torch.mean(logps - torch.stack(refs[i * G:(i + 1) * G]))
        loss = loss + (-obj.mean() + args.beta * kl) / len(prompts)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    model.eval()
    sync(device)
    t3 = time.perf_counter()
    del old_model
    tokens = sum(int(ids.numel()) - plen for ids, plen, _ in rollouts)
    return {"rollout": t1 - t0 - score_s, "scoring": score_s, "logprob": t2 - t1,
            "update": t3 - t2, "tokens": tokens}


def peak_memory_mb(device):
    """Peak memory so far: allocated CUDA memory, or the process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # process peak RSS (Linux)


def run(size, args, device):
    print(f"\n== {size} model, {args.prompts} prompts x G={args.G}, {args.max_new_tokens} new "
          f"tokens, beta={args.beta}, {args.steps} timed steps (+{args.warmup} warm-up) on "
          f"{device} ==")
    results = {}
    for name in args.paths:
        step_fn = book_step if name == "book" else ours_step
        args.compile_rollouts = name == "compiled"
        model = make_model(size, device).eval()
        ref = copy.deepcopy(model).requires_grad_(False)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
        tok = NoEosTokenizer(model.cfg.vocab_size)
        args.fixed_shape = update_shape(tok, args, args.update_buckets) \
            if name == "compiled-update" else None
        reward = TimedReward(CompositeReward([RewardTerm("correct", correctness_reward),
                                        RewardTerm("even", even_fraction)]))
        gen = torch.Generator(device=device).manual_seed(0)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        prompts = prompts_for(args)
        t_warm = time.perf_counter()
        for _ in range(args.warmup):
            step_fn(model, ref, opt, tok, prompts, args, device, gen, reward)
        warm_s = time.perf_counter() - t_warm
        totals = {}
        for _ in range(args.steps):
            for k, v in step_fn(model, ref, opt, tok, prompts, args, device, gen, reward).items():
                totals[k] = totals.get(k, 0.0) + v / args.steps
        totals["step"] = sum(totals[k] for k in ("rollout", "scoring", "logprob", "update"))
        totals["peak_mb"] = peak_memory_mb(device)
        results[name] = totals
        print(f"{name:5s} step {totals['step']:7.2f} s | rollout {totals['rollout']:6.2f} | "
              f"scoring {totals['scoring']:5.2f} | logprob {totals['logprob']:6.2f} | update "
              f"{totals['update']:6.2f} | {totals['tokens'] / totals['step']:8.1f} tok/s | "
              f"peak {totals['peak_mb']:.0f} MB | warm-up {warm_s:.1f} s"
              + {"compiled": " (compiles the decode step)",
                 "compiled-update": " (compiles the update's blocks)"}.get(name, ""))
        del model, ref, opt
    if "book" in results and "ours" in results:
        speedup = results["book"]["step"] / results["ours"]["step"]
        print(f"speed-up per step (book / ours): {speedup:.2f}x")
    if "ours" in results and "compiled" in results:
        ours, fast = results["ours"], results["compiled"]
        print(f"compiled rollouts: step {ours['step'] / fast['step']:.2f}x, rollouts "
              f"{ours['rollout'] / fast['rollout']:.2f}x faster than eager (after the warm-up)")
    if "ours" in results and "compiled-update" in results:
        ours, fast = results["ours"], results["compiled-update"]
        print(f"compiled update: reference log-probs {ours['logprob'] / fast['logprob']:.2f}x, "
              f"update {ours['update'] / fast['update']:.2f}x, step "
              f"{ours['step'] / fast['step']:.2f}x faster than eager (after the warm-up)")
    return results


def interleaved_update(size, args, device):
    """Reference log-probs (with --beta > 0) + update of one fixed batch, eager and compiled to
    one shape, or of `args.vary_lengths` batches of varying rows and lengths (`varied_batches`),
    also compiled in `args.update_buckets` length buckets; the paths in turn,
    `args.interleave_update` rounds each after one untimed round of each (the compiles);
    returns {path: (wall seconds, CPU seconds)} per update."""
    model = make_model(size, device).eval()
    ref = copy.deepcopy(model).requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    tok = NoEosTokenizer(model.cfg.vocab_size)
    reward = CompositeReward([RewardTerm("even", even_fraction)])
    full = collect_rollouts(model, tok, prompts_for(args), device, reward, args.G,
                            args.max_new_tokens, 1.0, 1.0,
                            torch.Generator(device=device).manual_seed(0))
    batches = varied_batches(full, args) if args.vary_lengths else [full]
    shapes = {"eager": None, "compiled": update_shape(tok, args)}
    if args.vary_lengths and args.update_buckets > 1:
        shapes["bucketed"] = update_shape(tok, args, args.update_buckets)

    def step(shape, batch):
        ref_logp = None
        if args.beta:
            with torch.no_grad():
                ref_logp, _ = batch_logprobs(ref, batch, with_entropy=False, fixed_shape=shape)
        model.train()
        opt.zero_grad(set_to_none=True)
        out = grpo_loss_on_batch(model, batch, None, ref_logp, "grpo", 0.2, None, args.beta,
                                 fixed_shape=shape)
        out["loss"].backward()
        opt.step()
        model.eval()
        sync(device)

    print(f"\n== {size}: updates of {', '.join(str(b.size) for b in batches)} rollouts "
          f"(longest completions {', '.join(str(b.completion_mask.shape[1]) for b in batches)}"
          f" of {args.max_new_tokens} tokens), paths in turn ==")
    for name, shape in shapes.items():  # the warm-up: every shape the batches meet compiles
        t0, graphs = time.perf_counter(), counters["stats"]["unique_graphs"]
        for batch in batches:
            step(shape, batch)
        print(f"{name:8s} warm-up {time.perf_counter() - t0:6.1f} s, "
              f"{counters['stats']['unique_graphs'] - graphs} new graphs")
    totals = {name: [0.0, 0.0] for name in shapes}
    n = args.interleave_update * len(batches)
    for _ in range(args.interleave_update):
        for name, shape in shapes.items():
            wall, cpu = time.perf_counter(), time.process_time()
            for batch in batches:
                step(shape, batch)
            totals[name][0] += (time.perf_counter() - wall) / n
            totals[name][1] += (time.process_time() - cpu) / n
    ew, ec = totals["eager"]
    for name, (wall, cpu) in totals.items():
        print(f"{name:8s} {wall:6.2f} s wall | {cpu:6.2f} s CPU per update | "
              f"{ew / wall:.2f}x wall, {ec / cpu:.2f}x CPU time of eager's speed")
    return totals


def varied_batches(full, args):
    """`args.vary_lengths` batches cut from a full-length one, their sizes drawn (seeded) like
    the chapter 7 default run's batches (docs/speed.md): 30-80% of the groups kept (the rest
    had no signal), the longest completion at 80.5% +- 2.8% (normal, within 67-92%) of the
    token budget (the default run's: 90 +- 3 of 112 tokens) and each other completion's
    length uniform between 1/8 of that and it (its tokens past it are masked out of the loss,
    as a finished completion's padding is)."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(args.vary_lengths):
        groups = int(torch.randint(max(1, round(0.3 * args.prompts)),
                                   max(1, round(0.8 * args.prompts)) + 1, (), generator=gen))
        rows = groups * args.G
        share = min(0.92, max(0.67, 0.805 + 0.028 * float(torch.randn((), generator=gen))))
        width = round(args.max_new_tokens * share)
        width = max(1, min(width, full.completion_mask.shape[1]))
        lengths = torch.randint(max(1, width // 8), width + 1, (rows,), generator=gen)
        lengths[0] = width
        keep = torch.arange(width) < lengths[:, None]  # (rows, width)
        part = full.cut(rows, width)
        out.append(dataclasses.replace(
            part, completion_mask=part.completion_mask & keep.to(part.completion_mask.device)))
    return out


def update_shape(tok, args, buckets=1):
    """The compiled update's shapes for this benchmark's batches: at most every rollout of a
    step, the longest prompt, the token budget; in `buckets` length buckets."""
    longest = max(len(tok.encode(render_prompt(ex["problem"]))) for ex in prompts_for(args))
    return FixedShape(args.prompts * args.G, longest, args.max_new_tokens, buckets=buckets)


def prompts_for(args):
    return [PROBLEMS[i % len(PROBLEMS)] for i in range(args.prompts)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--sizes", nargs="+", default=["tiny"], choices=["tiny", "0.6b"],
                   help="model sizes (random weights): tiny-arith architecture, Qwen3-0.6B")
    add_device_argument(p)
    p.add_argument("--prompts", type=int, default=2, help="prompts per step")
    p.add_argument("--G", type=int, default=8, help="rollouts per prompt")
    add_sampling_arguments(p, max_new_tokens=48, helps={"max_new_tokens": "tokens per rollout"})
    p.add_argument("--beta", type=float, default=0.04, help="KL weight (both paths keep a ref)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per path")
    p.add_argument("--warmup", type=int, default=1, help="untimed warm-up steps per path")
    p.add_argument("--paths", nargs="+", default=["book", "ours", "compiled"],
                   choices=["book", "ours", "compiled", "compiled-update"],
                   help="implementations to time: the book's, ours, ours with compiled rollouts "
                        "(`collect_rollouts(compile=True)`; the warm-up compiles), ours with "
                        "the update's blocks compiled (compiled-update) (on CPU the "
                        "peak is the process's peak RSS, so run one path per process for "
                        "separate peaks)")
    p.add_argument("--interleave-update", type=non_negative_int, default=0, metavar="N",
                   help="instead of whole steps: the update of one fixed batch, eager and "
                        "compiled in turn, N rounds each (0: off); see --vary-lengths")
    p.add_argument("--vary-lengths", type=non_negative_int, default=0, metavar="B",
                   help="with --interleave-update: B batches whose rows and completion lengths "
                        "vary as the chapter 7 default run's do, instead of one full-length "
                        "batch, and a third path: compiled in --update-buckets buckets (0: the "
                        "full-length batch)")
    p.add_argument("--update-buckets", type=positive_int, default=4,
                   help="length buckets of the bucketed compiled update "
                        "(GRPOConfig.update_buckets; 1: no bucketed path with --vary-lengths) "
                        "and of the compiled-update path")
    add_threads_argument(p, None, "torch CPU threads (None: default)")
    args = p.parse_args(argv)
    set_threads(args.threads)
    device = get_device(args.device)
    if args.interleave_update:
        return {size: interleaved_update(size, args, device) for size in args.sizes}
    return {size: run(size, args, device) for size in args.sizes}


if __name__ == "__main__":
    main()
