"""GPU check: decode speed, GRPO step figures and the bundled default run, in one script.

Everything on random weights of the published shapes (nothing is downloaded), bfloat16 on CUDA:

- decode: tokens/s of `generate` eager (`ours_eager`), `generate(compile=True)` (`ours_fast`:
  the static, compiled decode step, CUDA graphs) and transformers' `generate` with its static
  cache (`hf_static`, the same weights loaded into `Qwen3ForCausalLM`), greedy, EOS disabled,
  `--prompt-len` prompt tokens and `--new-tokens` new tokens, for Qwen3-0.6B at 128 and 512 rows
  and Qwen3-1.7B at 128 rows; the compile time apart; host syncs per decoded token of the
  compiled loop (`torch.cuda.set_sync_debug_mode`, CUDA only).
- grpo: one timed GRPO step (after a warm-up step) at 16 prompts x G=8 x 256 and x 512 new
  tokens, with and without a reference model (beta 0.04): step seconds, rollout / update split,
  update MFU (6 x params x trained tokens, plus 2 x params x tokens for the reference, over the
  update time and `--peak-tflops`) and peak GPU memory.
- default_run: `python chapters/ch07_train.py` with its defaults (the bundled tiny-arith model):
  wall time and final held-out accuracy.

Every part (each shape, each step configuration) runs under its own time limit
(`--limit-s`), so one slow part cannot use up a short GPU lease; a part over its limit is
recorded as timed out and the next one starts. The figures go to `--out`
(docs/gpu_results.json by default): device, torch, decode_tok_s.{ours_eager, ours_fast,
hf_static} (each {shape: tokens/s}), grpo_step_s, update_mfu, peak_gib (each {configuration:
value}), plus compile_s, host_syncs_per_token, default_run and timed_out.

`--device cpu` runs the same parts on a tiny model with small shapes (seconds; what CI runs).
Without CUDA and without `--device cpu` it says that it needs CUDA and exits 0.

    python benchmarks/gpu_check.py                          # on a CUDA machine, ~10 minutes
    python benchmarks/gpu_check.py --parts decode --limit-s 120
    python benchmarks/gpu_check.py --device cpu --out /tmp/gpu_results.json
"""

import argparse
import contextlib
import copy
import json
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
from bench_generation import sync, timed
from bench_grpo_step import PROBLEMS, NoEosTokenizer, even_fraction

from reasoning_from_scratch.cli.arguments import add_seed_argument
from reasoning_from_scratch.files import atomic_write_json
from reasoning_from_scratch.generation import generate
from reasoning_from_scratch.grpo import batch_logprobs, collect_rollouts, grpo_loss_on_batch
from reasoning_from_scratch.qwen3 import QWEN3_0_6B_CONFIG, Qwen3Config, Qwen3Model, tiny_config
from reasoning_from_scratch.rewards import CompositeReward, RewardTerm
from reasoning_from_scratch.training import micro_batch_weight
from reasoning_from_scratch.validation import choice_list, positive_float, positive_int

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30
PARTS = ("decode", "grpo", "default_run")
# Qwen3-1.7B's published hyper-parameters (huggingface.co/Qwen/Qwen3-1.7B, config.json).
QWEN3_1_7B_CONFIG = Qwen3Config(
    vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128, rope_theta=1_000_000.0,
    max_position_embeddings=40960, tie_word_embeddings=True, torch_dtype="bfloat16")
TINY = tiny_config(vocab_size=512)


class PartTimeout(BaseException):
    """A part ran past its time limit. A BaseException: code that falls back on an Exception
    (the compiled decode step falls back to eager) must not catch it and carry on."""


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise PartTimeout in the main thread after `seconds` (SIGALRM; Unix)."""
    def expired(signum, frame):
        raise PartTimeout(f"over its {seconds:.0f} s limit")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def decode_shapes(args) -> list[tuple[str, Qwen3Config, int]]:
    """(label, config, rows) of the decode measurements."""
    if args.device == "cpu":
        return [("tiny x4", TINY, 4)]
    return [("0.6B x128", QWEN3_0_6B_CONFIG, 128), ("0.6B x512", QWEN3_0_6B_CONFIG, 512),
            ("1.7B x128", QWEN3_1_7B_CONFIG, 128)]


def hf_model(model: Qwen3Model):
    """transformers' Qwen3ForCausalLM holding `model`'s weights (the state-dict keys agree)."""
    from transformers import Qwen3Config as HFConfig
    from transformers import Qwen3ForCausalLM

    hf = Qwen3ForCausalLM(HFConfig(**model.cfg.to_hf_dict())).to(model.device, model.dtype)
    hf.load_state_dict(model.state_dict(), strict=False)
    return hf.eval()


def count_syncs(fn) -> int:
    """Host syncs `fn` makes on CUDA (warnings of `torch.cuda.set_sync_debug_mode`)."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def decode_part(label, cfg, rows, args, dtype, results):
    """Tokens/s of ours eager, ours compiled and transformers' static cache at one shape."""
    dev = torch.device(args.device)
    torch.manual_seed(args.seed)
    model = Qwen3Model(cfg).to(device=dev, dtype=dtype).eval()
    ids = torch.randint(1, cfg.vocab_size, (rows, args.prompt_len), device=dev)
    n = rows * args.new_tokens

    def ours(compile):
        return lambda: generate(model, ids, max_new_tokens=args.new_tokens, compile=compile)

    tps = results["decode_tok_s"]
    tps["ours_eager"][label] = n / timed(ours(False), dev)
    results["compile_s"][label] = timed(ours(True), dev)  # compiles (and runs once)
    tps["ours_fast"][label] = n / timed(ours(True), dev)
    if dev.type == "cuda":
        # the loop's syncs: one per CHECK_EVERY tokens (the all-finished check) and the ends
        results["host_syncs_per_token"][label] = count_syncs(ours(True)) / args.new_tokens
    hf = hf_model(model)

    def theirs():
        hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                    min_new_tokens=args.new_tokens, do_sample=False,
                    cache_implementation="static", pad_token_id=0)

    theirs()  # the first call builds the cache (and compiles, where transformers does)
    tps["hf_static"][label] = n / timed(theirs, dev)


def grpo_step(model, optimizer, tokenizer, examples, reward, generator, args, device,
              ref=None, beta=0.0, compile=False) -> dict:
    """One GRPO step (rollouts, then a micro-batched update); returns its figures."""
    device = torch.device(device)
    sync(device)
    t0 = time.perf_counter()
    batch = collect_rollouts(model, tokenizer, examples, device, reward, args.num_rollouts,
                             args.max_new_tokens, temperature=1.0, top_p=1.0,
                             generator=generator, compile=compile)
    sync(device)
    t1 = time.perf_counter()
    model.train()
    optimizer.zero_grad(set_to_none=True)
    mbs = args.micro_batch_size or batch.size
    loss = 0.0
    for start in range(0, batch.size, mbs):  # gradients accumulate over the micro-batches
        mb = batch.slice(start, start + mbs)
        ref_logp = None
        if ref is not None:
            with torch.no_grad():
                ref_logp = batch_logprobs(ref, mb, with_entropy=False)[0]
        out = grpo_loss_on_batch(model, mb, ref_logp=ref_logp, loss_type="grpo", beta=beta,
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
            "grad_norm": grad_norm, "tokens": batch.num_generated_tokens, "rows": batch.size,
            "trained_tokens": int(batch.attention_mask.sum())}


def grpo_part(new_tokens, with_ref, args, dtype, results):
    """A warm-up step, then one timed GRPO step at one configuration."""
    dev = args.device
    label = f"{args.prompts}x{args.num_rollouts}x{new_tokens}" + (" +ref" if with_ref else "")
    torch.manual_seed(args.seed)
    cfg = TINY if dev == "cpu" else QWEN3_0_6B_CONFIG
    model = Qwen3Model(cfg).to(device=dev, dtype=dtype).eval()
    ref = copy.deepcopy(model).requires_grad_(False) if with_ref else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    reward = CompositeReward([RewardTerm("even", even_fraction)])
    examples = [PROBLEMS[i % len(PROBLEMS)] for i in range(args.prompts)]
    step_args = argparse.Namespace(num_rollouts=args.num_rollouts, max_new_tokens=new_tokens,
                                   micro_batch_size=args.micro_batch_size)
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    run = dict(model=model, optimizer=optimizer, tokenizer=NoEosTokenizer(cfg.vocab_size),
               examples=examples, reward=reward, generator=gen, args=step_args, device=dev,
               ref=ref, beta=0.04 if with_ref else 0.0, compile=args.compile)
    grpo_step(**run)  # warm-up: compiles, allocator and AdamW state
    if torch.device(dev).type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    r = grpo_step(**run)
    params = sum(p.numel() for p in model.parameters())
    flops = (6 + (2 if with_ref else 0)) * params * r["trained_tokens"]
    results["grpo_step_s"][label] = r["step_s"]
    results["grpo_split_s"][label] = {"rollout": r["rollout_s"], "update": r["update_s"]}
    if torch.device(dev).type == "cuda":
        results["update_mfu"][label] = flops / r["update_s"] / (args.peak_tflops * 1e12)
        results["peak_gib"][label] = torch.cuda.max_memory_allocated() / GIB
    print(f"grpo {label}: step {r['step_s']:.2f} s (rollouts {r['rollout_s']:.2f}, update "
          f"{r['update_s']:.2f}), {r['tokens']} rollout tokens", flush=True)
    del model, ref, optimizer


def default_run_part(args, results):
    """`python chapters/ch07_train.py` (+ `--run-args`): wall time and final accuracy."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, str(ROOT / "chapters" / "ch07_train.py"), "--device",
               args.device, "--output-dir", str(Path(tmp) / "run"), *args.run_args.split()]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                              timeout=args.limit_s)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            raise RuntimeError(f"ch07_train.py exited {proc.returncode}: {proc.stderr[-500:]}")
        summary = json.loads((Path(tmp) / "run" / "summary.json").read_text())
    results["default_run"] = {"wall_s": wall, "final_accuracy": summary.get("final_accuracy"),
                              "base_accuracy": summary.get("base_accuracy"),
                              "args": args.run_args}


def run_parts(args) -> dict:
    """Every part asked for, each under its time limit; returns the results dict."""
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    results = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
               "torch": torch.__version__, "dtype": str(dtype).removeprefix("torch."),
               "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
               "decode_tok_s": {"ours_eager": {}, "ours_fast": {}, "hf_static": {}},
               "compile_s": {}, "host_syncs_per_token": {}, "grpo_step_s": {},
               "grpo_split_s": {}, "update_mfu": {}, "peak_gib": {}, "default_run": None,
               "timed_out": [], "errors": {}}
    jobs = []
    if "decode" in args.parts:
        jobs += [(f"decode {label}", decode_part, (label, cfg, rows, args, dtype, results))
                 for label, cfg, rows in decode_shapes(args)]
    if "grpo" in args.parts:
        jobs += [(f"grpo {n}{' +ref' if ref else ''}", grpo_part, (n, ref, args, dtype, results))
                 for n in args.grpo_tokens for ref in (False, True)]
    if "default_run" in args.parts:
        jobs.append(("default_run", default_run_part, (args, results)))
    for name, fn, fn_args in jobs:
        t0 = time.perf_counter()
        try:
            with time_limit(args.limit_s):
                fn(*fn_args)
        except (PartTimeout, subprocess.TimeoutExpired):
            results["timed_out"].append(name)
        except Exception as e:  # one broken part (e.g. transformers missing) leaves the rest
            results["errors"][name] = f"{type(e).__name__}: {str(e)[:300]}"
        print(f"{name}: {time.perf_counter() - t0:.1f} s", flush=True)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return results


def main(argv=None) -> int:
    """Parse the flags; without CUDA (and without --device cpu) say so, else run and write."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cuda: the real shapes; cpu: a tiny model and small shapes (CI)")
    p.add_argument("--parts", type=choice_list(PARTS), default=list(PARTS),
                   help="comma-separated parts: decode, grpo, default_run")
    p.add_argument("--out", type=Path, default=None,
                   help="results JSON (None: docs/gpu_results.json on CUDA; nothing on cpu)")
    p.add_argument("--limit-s", type=positive_float, default=150.0,
                   help="time limit of each part (each decode shape, each GRPO configuration)")
    p.add_argument("--prompt-len", type=positive_int, default=None,
                   help="decode prompt tokens (None: 64; 8 on cpu)")
    p.add_argument("--new-tokens", type=positive_int, default=None,
                   help="decode new tokens (None: 256; 8 on cpu)")
    p.add_argument("--prompts", type=positive_int, default=None,
                   help="GRPO prompts per step (None: 16; 2 on cpu)")
    p.add_argument("--num-rollouts", type=positive_int, default=None,
                   help="GRPO G (None: 8; 2 on cpu)")
    p.add_argument("--grpo-tokens", type=positive_int, nargs="+", default=None,
                   help="GRPO new tokens per rollout, one configuration each (None: 256 512; "
                        "4 on cpu)")
    p.add_argument("--micro-batch-size", type=positive_int, default=16,
                   help="rollouts per forward/backward in the update")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="GRPO rollouts with the compiled decode step")
    p.add_argument("--peak-tflops", type=positive_float, default=989.0,
                   help="the GPU's dense bf16 peak for MFU (989: H100/H200 SXM)")
    p.add_argument("--run-args", default=None,
                   help="extra ch07_train.py flags of the default run (None: none on CUDA; a "
                        "one-step run on cpu)")
    add_seed_argument(p, help="weights and sampling seed")
    args = p.parse_args(argv)
    cpu = args.device == "cpu"
    if not cpu and not torch.cuda.is_available():
        print("gpu_check needs CUDA: torch.cuda.is_available() is False on this machine "
              f"(torch {torch.__version__}); nothing to check here (--device cpu runs the "
              "tiny version).")
        return 0
    for name, gpu, small in (("prompt_len", 64, 8), ("new_tokens", 256, 8), ("prompts", 16, 2),
                             ("num_rollouts", 8, 2), ("grpo_tokens", [256, 512], [4]),
                             ("run_args", "", "--steps 1 --eval-examples 2 --prompts-per-step 2 "
                              "--num-rollouts 2 --max-new-tokens 4 --threads 1")):
        if getattr(args, name) is None:
            setattr(args, name, small if cpu else gpu)
    results = run_parts(args)
    out = args.out or (None if cpu else ROOT / "docs" / "gpu_results.json")
    print(json.dumps(results, indent=1))
    if out is not None:
        atomic_write_json(out, results)
        print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
