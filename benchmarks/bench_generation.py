"""Benchmark: G sequential `sample_response` calls vs one batched `sample_rollouts(G)`.

Both paths decode the same number of tokens from the same random model (EOS disabled, so every
completion runs to max_new_tokens) and the script prints tokens/s and the speed-up ratio, at a
tiny size and at Qwen3-0.6B size. Not a test: numbers depend on the machine.

    python benchmarks/bench_generation.py                    # tiny + 0.6B on the best device
    python benchmarks/bench_generation.py --sizes tiny --device cpu
"""

import argparse
import time

import torch

from reasoning_from_scratch.device import default_dtype, get_device
from reasoning_from_scratch.generation import sample_response, sample_rollouts
from reasoning_from_scratch.qwen3 import QWEN3_0_6B_CONFIG, Qwen3Model, tiny_config


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
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def bench(name, cfg, device, dtype, G, new_tokens, prompt_len, repeats=3, seed=0):
    torch.manual_seed(seed)
    model = Qwen3Model(cfg).to(device=device, dtype=dtype).eval()
    tok = NoEosTokenizer(cfg.vocab_size)
    prompt = "".join(chr(97 + i % 26) for i in range(prompt_len))
    gen = torch.Generator(device=device).manual_seed(seed)
    kw = dict(temperature=0.8, top_p=0.9, generator=gen)

    sample_rollouts(model, tok, prompt, G, device, max_new_tokens=2, **kw)  # warm-up

    def sequential():
        for _ in range(G):
            sample_response(model, tok, prompt, device, max_new_tokens=new_tokens, **kw)

    def batched():
        sample_rollouts(model, tok, prompt, G, device, max_new_tokens=new_tokens, **kw)

    seq_s = batch_s = float("inf")
    for _ in range(repeats):  # best of N, interleaved: robust to other load on the machine
        seq_s = min(seq_s, timed(sequential, device))
        batch_s = min(batch_s, timed(batched, device))
    n = G * new_tokens
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(
        f"{name:>5} ({params:.1f}M params, {dtype}, {device}): G={G}, prompt={prompt_len}, "
        f"new tokens={new_tokens} each, best of {repeats}\n"
        f"      sequential sample_response x{G}: {n / seq_s:9.1f} tokens/s ({seq_s:.2f} s)\n"
        f"      one sample_rollouts(G={G}):      {n / batch_s:9.1f} tokens/s ({batch_s:.2f} s)\n"
        f"      ratio: {seq_s / batch_s:.2f}x",
        flush=True,
    )


def main():
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--sizes", default="tiny,0.6b", help="comma-separated: tiny, 0.6b")
    p.add_argument("--num-rollouts", type=int, default=8, help="G, completions per prompt")
    p.add_argument("--new-tokens", type=int, default=128, help="new tokens per completion (tiny)")
    p.add_argument("--new-tokens-large", type=int, default=16,
                   help="new tokens per completion at 0.6B size on CPU (short run)")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt length in tokens")
    p.add_argument("--repeats", type=int, default=3, help="timing repeats (best is reported)")
    p.add_argument("--device", default=None, help="cuda, mps or cpu (None: the best available)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (None: torch's default)")
    args = p.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    device = get_device(args.device)
    dtype = default_dtype(device)
    print(f"device={device} dtype={dtype} torch threads={torch.get_num_threads()}")
    for size in args.sizes.split(","):
        if size == "tiny":
            bench("tiny", tiny_config(vocab_size=512), device, dtype, args.num_rollouts,
                  args.new_tokens, args.prompt_len, args.repeats)
        elif size == "0.6b":
            n = args.new_tokens if device.type == "cuda" else args.new_tokens_large
            repeats = args.repeats if device.type == "cuda" else 1
            bench("0.6B", QWEN3_0_6B_CONFIG, device, dtype, args.num_rollouts, n,
                  args.prompt_len, repeats)
        else:
            raise SystemExit(f"unknown size {size!r}; use tiny or 0.6b")


if __name__ == "__main__":
    main()
