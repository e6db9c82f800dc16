"""Benchmark: the generation speed knobs, each timed side by side with its baseline in one run.

- rollouts: one batched `sample_rollouts(G)` vs G sequential `sample_response` calls.
- prealloc: `generate` with the preallocated KV cache (written in place, the default) vs the
  cache that grows by `torch.cat` every step (`preallocate=False`).
- compile: `generate(compile=True)` (one static decode step, sampler inside, through
  torch.compile) vs eager; the compilation itself happens in an untimed warm-up and is
  reported separately.
- train-rollouts: the training path's decoding (`sample_rollouts_batch`, as `collect_rollouts`
  calls it) of the bundled `tiny-arith` model on arithmetic training prompts, compiled vs
  eager: `--prompts` prompts x G rollouts x `--train-tokens` new tokens, EOS on (rows stop
  when the model stops), a different batch of prompts every repeat (prompt lengths vary).

prealloc and compile time `generate` with `num_return_sequences=G` (the decoding loop of
`sample_rollouts`, without the text encoding/decoding). Every path decodes the same number of
tokens from the same random model (EOS disabled, so every completion runs to the token budget),
at a tiny size and at Qwen3-0.6B size (random weights, nothing downloaded), in each dtype asked
for. Timings are the best of `--repeats` interleaved runs; the table gives tokens/s and the
ratio knob / baseline (> 1: the knob is faster). Not a test: numbers depend on the machine.

    python benchmarks/bench_generation.py --threads 1              # everything, tiny + 0.6B
    python benchmarks/bench_generation.py --sizes tiny --dtypes float32 --knobs rollouts
    python benchmarks/bench_generation.py --threads 1 --knobs train-rollouts
"""

import argparse
import time

import torch

from reasoning_from_scratch.cli.arguments import add_runtime_arguments, set_threads
from reasoning_from_scratch.datasets import load_dataset_by_name
from reasoning_from_scratch.device import get_device
from reasoning_from_scratch.generation import (
    generate,
    sample_response,
    sample_rollouts,
    sample_rollouts_batch,
)
from reasoning_from_scratch.prompts import render_prompt
from reasoning_from_scratch.qwen3 import QWEN3_0_6B_CONFIG, Qwen3Model, tiny_config
from reasoning_from_scratch.validation import choice_list, positive_int
from reasoning_from_scratch.weights import load_pretrained

SIZES = ("tiny", "0.6b")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KNOBS = ("rollouts", "prealloc", "compile", "train-rollouts")
SIZE_KNOBS = ("rollouts", "prealloc", "compile")  # timed per size and dtype on random weights
SAMPLING = dict(temperature=0.8, top_p=0.9)


class NoEosTokenizer:
    """Stand-in tokenizer: one id per character, no EOS, so decoding never stops early."""

    eos_token_id = None
    pad_token_id = 0

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def encode(self, text):
        return [1 + ord(c) % (self.vocab_size - 1) for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return ""


def sync(device):
    """Wait for the device, so that a timer measures finished work."""
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device) -> float:
    """Seconds `fn()` takes on `device`."""
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def best_of(baseline, knob, device, repeats) -> tuple[float, float]:
    """Best seconds of each of two functions, run alternately: robust to other load."""
    base_s = knob_s = float("inf")
    for _ in range(repeats):
        base_s = min(base_s, timed(baseline, device))
        knob_s = min(knob_s, timed(knob, device))
    return base_s, knob_s


def knob_paths(knob, model, tok, prompt, device, G, new_tokens, seed):
    """(baseline name, baseline fn, knob name, knob fn) of one knob; each fn decodes G x tokens."""
    gen = torch.Generator(device=device).manual_seed(seed)
    ids = torch.tensor([tok.encode(prompt)], device=device)  # (1, P)

    def run_generate(**kw):
        return lambda: generate(model, ids, max_new_tokens=new_tokens, num_return_sequences=G,
                                generator=gen, **SAMPLING, **kw)

    if knob == "rollouts":
        def sequential():
            for _ in range(G):
                sample_response(model, tok, prompt, device, max_new_tokens=new_tokens,
                                generator=gen, **SAMPLING)

        def batched():
            sample_rollouts(model, tok, prompt, G, device, max_new_tokens=new_tokens,
                            generator=gen, **SAMPLING)

        return f"{G} x sample_response", sequential, f"sample_rollouts(G={G})", batched
    if knob == "prealloc":
        return ("torch.cat cache", run_generate(preallocate=False),
                "preallocated cache", run_generate(preallocate=True))
    return ("eager decode", run_generate(compile=False),
            "compiled decode", run_generate(compile=True))


def bench_knob(knob, model, tok, prompt, device, G, new_tokens, repeats, seed=0) -> dict:
    """Warm both paths up (compiling, for `compile`), then time them side by side."""
    base_name, base_fn, knob_name, knob_fn = knob_paths(knob, model, tok, prompt, device, G,
                                                        new_tokens, seed)
    warm_s = timed(knob_fn, device)  # the first call compiles (compile knob)
    base_fn()
    base_s, knob_s = best_of(base_fn, knob_fn, device, repeats)
    n = G * new_tokens
    return {"knob": knob, "baseline": base_name, "with": knob_name, "tokens": n,
            "base_tps": n / base_s, "knob_tps": n / knob_s, "ratio": base_s / knob_s,
            "note": f"compile+first run {warm_s:.1f} s" if knob == "compile" else ""}


def make_model(size, device, dtype, seed=0):
    """A random-weight model of `size` (tiny or Qwen3-0.6B) on `device` in `dtype`."""
    torch.manual_seed(seed)
    cfg = tiny_config(vocab_size=512) if size == "tiny" else QWEN3_0_6B_CONFIG
    return Qwen3Model(cfg).to(device=device, dtype=dtype).eval()


def bench_size(size, dtype_name, args, device) -> list[dict]:
    """Every knob asked for, at one size and dtype; returns one table row per knob."""
    model = make_model(size, device, DTYPES[dtype_name])
    tok = NoEosTokenizer(model.cfg.vocab_size)
    prompt = "".join(chr(97 + i % 26) for i in range(args.prompt_len))
    large_on_cpu = size == "0.6b" and device.type == "cpu"
    # Qwen3-0.6B on a CPU: a short run (one repeat, few tokens) keeps the script minutes long.
    new_tokens = args.new_tokens_large if large_on_cpu else args.new_tokens
    repeats = 1 if large_on_cpu else args.repeats
    params = sum(p.numel() for p in model.parameters()) / 1e6
    rows = []
    for knob in [k for k in args.knobs if k in SIZE_KNOBS]:
        row = bench_knob(knob, model, tok, prompt, device, args.num_rollouts, new_tokens, repeats)
        row.update(size=f"{size} ({params:.1f}M)", dtype=dtype_name, new_tokens=new_tokens,
                   repeats=repeats)
        print(format_row(row), flush=True)
        rows.append(row)
    return rows


def bench_train_rollouts(args, device) -> dict:
    """The training path's rollouts of the bundled tiny-arith model, compiled vs eager.

    Repeat i decodes batch i of the training prompts with each path (the same generators, so
    the same tokens); the first batches compile (every prompt-length bucket the data has), the
    timed ones follow. Returns a table row (tokens: what was generated, EOS included)."""
    model, tok = load_pretrained("tiny-arith", device=device, dtype=torch.float32)
    examples = load_dataset_by_name("arith", split="train", n=args.prompts * (args.repeats + 2))
    batches = [[render_prompt(ex["problem"]) for ex in examples[i:i + args.prompts]]
               for i in range(0, len(examples), args.prompts)]

    def run(prompts, compile):
        gens = [torch.Generator(device=device).manual_seed(i) for i in range(len(prompts))]
        out = sample_rollouts_batch(model, tok, prompts, args.num_rollouts, device,
                                    args.train_tokens, temperature=1.0, top_p=1.0,
                                    generator=gens, compile=compile)
        return sum(int(r.lengths.sum()) for r in out)

    warm_s = sum(timed(lambda b=b: run(b, True), device) for b in batches[:2])
    run(batches[0], False)
    eager_s = fast_s = eager_cpu = fast_cpu = 0.0
    tokens = 0
    for b in batches[2:]:
        c0 = time.thread_time()  # CPU seconds of this thread: robust to other jobs' load
        eager_s += timed(lambda b=b: run(b, False), device)
        c1 = time.thread_time()
        fast_s += timed(lambda b=b: run(b, True), device)
        eager_cpu, fast_cpu = eager_cpu + c1 - c0, fast_cpu + time.thread_time() - c1
        tokens += run(b, False)
    return {"size": "tiny-arith (bundled)", "dtype": "float32", "knob": "train-rollouts",
            "new_tokens": args.train_tokens, "baseline": "eager decode",
            "with": "compiled decode", "tokens": tokens, "base_tps": tokens / eager_s,
            "knob_tps": tokens / fast_s, "ratio": eager_s / fast_s, "repeats": args.repeats,
            "note": f"{args.prompts} prompts x G={args.num_rollouts}, {args.repeats} batches "
                    f"summed; thread CPU time {eager_cpu:.2f} vs {fast_cpu:.2f} s = "
                    f"{eager_cpu / fast_cpu:.2f}x; compile + 2 warm-up batches {warm_s:.1f} s"}


HEADER = ("| size | dtype | knob | new tokens | baseline | tok/s | with the knob | tok/s | ratio "
          "| note |\n|---|---|---|---|---|---|---|---|---|---|")


def format_row(r) -> str:
    """One markdown table row."""
    return (f"| {r['size']} | {r['dtype']} | {r['knob']} | {r['new_tokens']} | {r['baseline']} "
            f"| {r['base_tps']:.1f} | {r['with']} | {r['knob_tps']:.1f} | {r['ratio']:.2f}x "
            f"| {r['note']} |")


def main(argv=None) -> list[dict]:
    """Parse the flags, time every knob asked for, print the table; returns its rows."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--sizes", type=choice_list(SIZES), default=list(SIZES),
                   help="comma-separated model sizes (random weights): tiny, 0.6b")
    p.add_argument("--dtypes", type=choice_list(tuple(DTYPES)), default=["float32", "bfloat16"],
                   help="comma-separated dtypes: float32, bfloat16, float16")
    p.add_argument("--knobs", type=choice_list(KNOBS), default=list(KNOBS),
                   help="comma-separated knobs to time: rollouts, prealloc, compile, "
                        "train-rollouts")
    p.add_argument("--prompts", type=positive_int, default=8,
                   help="train-rollouts: prompts per batch")
    p.add_argument("--train-tokens", type=positive_int, default=112,
                   help="train-rollouts: new-token budget per rollout (the GRPO default)")
    p.add_argument("--num-rollouts", type=positive_int, default=8, help="G, completions per prompt")
    p.add_argument("--new-tokens", type=positive_int, default=128,
                   help="new tokens per completion (tiny size; 0.6B size on a GPU)")
    p.add_argument("--new-tokens-large", type=positive_int, default=16,
                   help="new tokens per completion at 0.6B size on CPU (short run, one repeat)")
    p.add_argument("--prompt-len", type=positive_int, default=32, help="prompt length in tokens")
    p.add_argument("--repeats", type=positive_int, default=3,
                   help="timed repeats per path, interleaved (the best is reported)")
    add_runtime_arguments(p, threads=0, threads_help="torch CPU threads (0: torch's default)")
    args = p.parse_args(argv)

    set_threads(args.threads)
    device = get_device(args.device)
    print(f"device={device} torch {torch.__version__} threads={torch.get_num_threads()} "
          f"G={args.num_rollouts} prompt={args.prompt_len} tokens, temperature 0.8, top-p 0.9, "
          f"best of {args.repeats} (1 at 0.6B on CPU)\n{HEADER}", flush=True)
    rows = []
    if any(k in SIZE_KNOBS for k in args.knobs):
        rows += [row for size in args.sizes for dtype in args.dtypes
                 for row in bench_size(size, dtype, args, device)]
    if "train-rollouts" in args.knobs:
        rows.append(bench_train_rollouts(args, device))
        print(format_row(rows[-1]), flush=True)
    print(f"\nall rows:\n{HEADER}\n" + "\n".join(format_row(r) for r in rows))
    return rows


if __name__ == "__main__":
    main()
