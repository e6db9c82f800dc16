"""GPU check: the training path's GRPO step, decode, data-parallel and the default run, in one.

The one prepared script for a short GPU lease (one H200, minutes of device time in all):
everything on random weights of the published shapes (nothing is downloaded). Its parts, in
the order they run (`--budget-s`, below):

0. compile_check, before any figure is trusted: the compiled paths against eager on the GPU
   (`compile_check.py`, the check every compiled training run makes before its first step):
   `--prompts` rows x `--new-tokens` tokens decoded greedily from the bfloat16 sampler of a
   random float32 Qwen3-0.6B, compiled (CUDA graphs) and eager (equal tokens; every compiled
   token a near-argmax of the eager logits, within 4x what bfloat16 rounding does to them
   against the float32 model), and the update's log-probs of those rows through the compiled
   blocks and eagerly, under bfloat16 autocast. A disagreement is printed in capitals: the
   speed figures after it are then not results.
1. grpo, at `--prompts` x G = `--num-rollouts` x the first of `--grpo-tokens` new tokens
   (16 x 8 x 256) on a random Qwen3-0.6B: steps of the training loop itself, each the two
   calls of a `train_grpo` step (`training.Step`'s stages, then `training.update_stage` with the
   sampler refresh), with the sampler copy and the compiled update's shape that `train_grpo`
   builds (`systems.sampling_replica`, `systems.update_shape`), in three setups:
   `cuda-default`, what a CUDA run gets from the default flags: float32 master weights,
   gradients and AdamW state, rollouts sampled from a bfloat16 copy (`--sampler-dtype auto`),
   the update's forward passes under bfloat16 autocast (`--autocast auto`), the update's
   decoder blocks compiled at one padded shape (`--compile-update`: `compiled_update.FixedShape`,
   `compiled_update.compiled_block`) and the decode step compiled; `eager-update`, the same with
   `--no-compile-update`; `bf16-weights`, the setup measured before: the whole model in
   bfloat16 (`--dtype bfloat16`) sampling itself, no autocast, the update eager. Every group
   enters the update (`skip_zero_advantage` off; the reward, the fraction of even token ids,
   has signal on a random model), so every step trains on the same number of rows. A warm-up
   step (compiles, allocator, AdamW state), then `--grpo-steps` timed steps.
2. decode at Qwen3-0.6B x 128 rows: tokens/s of `generate` eager (`ours_eager`),
   `generate(compile=True)` (`ours_fast`: the static compiled decode step, CUDA graphs) and
   transformers' `generate` with its static cache (`hf_static`, the same weights), greedy, EOS
   disabled, `--prompt-len` prompt and `--new-tokens` new tokens; the compile time apart; host
   syncs per decoded token of the compiled loop (`torch.cuda.set_sync_debug_mode`).
3. data_parallel (docs/data_parallel.md): two steps of `python chapters/ch07_train.py
   --fsdp` (a process group of one: NCCL on CUDA, Gloo on the CPU) beside the same two steps
   without `--fsdp`, on the bundled model (`--dp-args`; decoding eager on both: compiling is
   measured above), their wall times and the largest difference of their per-step loss and
   reward; then the start-up peak memory of a sharded start (`fsdp.load_model_sharded` +
   `fsdp.shard_with_replica`, bfloat16 replica) of a random Qwen3-0.6B against the former
   start (a plain load + deep copy), one process (`bench_fsdp.measure_startup`).
4. the rest: decode at Qwen3-0.6B x 512 rows and Qwen3-1.7B x 128 rows; the `cuda-default`
   GRPO step at the other `--grpo-tokens` (512) and with a reference model (beta 0.04).
5. default_run: `python chapters/ch07_train.py` with its defaults (the bundled tiny-arith
   model): wall time and final held-out accuracy.

Why this order: the GRPO step of today's CUDA path (and what its bfloat16 sampler, autocast
and compiled update buy against the former setup) is the figure docs/speed.md owes first;
decoding is most of a step, and the one shape against transformers says where it stands;
the data-parallel part is the first run of the NCCL path at all; the rest widens shapes
already measured, and the default run's tiny model is measured on the CPU already.

**Budget.** The parts run in that order while `--budget-s` lasts (counted from the first
part's start; importing torch and starting CUDA come before it): each under its own time limit,
`--limit-s` or what is left of the budget if less; a part that would start with less than
`MIN_PART_S` left is skipped and recorded as such. A part over its limit is recorded as timed
out (with the figures it had already measured) and the next one starts; a part that fails is
recorded with its error. The default, 450 s, with the machine's start-up makes about 8 minutes
of device time, compiles included (they count inside the parts); `--quick` keeps part 0, part
1 at cuda-default only and part 2 at one shape, within 170 s (about 3 minutes).

**Results** go to `--out` (docs/gpu_results.json by default on CUDA), written again after every
part, so a lease that ends mid-run leaves what was measured:
- device, torch, dtype (of the decode part), compile, budget_s;
- grpo: {label ("16x8x256 cuda-default", "... +ref"): {setup, step_s, rollout_s, update_s
  (means of the timed steps), rollout_tok_s (generated tokens per rollout second),
  warmup_step_s (the first step, compiles included), tokens (generated per step),
  trained_tokens (attended positions of the update's rows), loss, grad_norm, update_mfu (6 x
  params x trained tokens, plus 2 x params x tokens for the reference, over the update time and
  `--peak-tflops`; padding not counted; CUDA only), peak_gib (peak allocated GPU memory during
  the timed steps; CUDA only), settings (the GRPOConfig fields that make the setup)}};
- decode_tok_s.{ours_eager, ours_fast, hf_static} (each {shape: tokens/s}), compile_s,
  host_syncs_per_token (CUDA only);
- data_parallel: two_steps {plain, fsdp: {wall_s, steps}, max_diff: {loss, reward_mean},
  flags, values: {plain, fsdp: {loss, reward_mean: [per step]}}}; startup {peaks: {before,
  sharded: [bytes]}, params, ratio (sharded / before), shape, replica_dtype};
- default_run {wall_s, final_accuracy, base_accuracy, args};
- part_s {part: seconds}, skipped, timed_out, errors {part: message}, compile_failures {part:
  [the package's warnings that torch.compile failed and the code ran eagerly]}.

`--device cpu` runs every part on a tiny model with small shapes, compiling only the decode
part's `ours_fast` (about a minute on a busy 2-core machine; what the tests run). Without CUDA
and without `--device cpu` it says that it needs CUDA and exits 0.

    python benchmarks/gpu_check.py                          # on a CUDA machine, ~8 minutes
    python benchmarks/gpu_check.py --quick                  # ~3 minutes: check, step, decode
    PYTHONPATH=. python3 benchmarks/gpu_check.py --out $OUT/gpu_results.json  # not installed
    python benchmarks/gpu_check.py --parts grpo --grpo-setups cuda-default --limit-s 200
    python benchmarks/gpu_check.py --device cpu --out /tmp/gpu_results.json
"""

import argparse
import contextlib
import copy
import gc
import json
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from bench_fsdp import measure_startup
from bench_generation import sync, timed
from bench_grpo_step import PROBLEMS, NoEosTokenizer, even_fraction

from reasoning_from_scratch.cli.arguments import add_seed_argument
from reasoning_from_scratch.compile_check import check_decoding, check_logprobs
from reasoning_from_scratch.compiled_update import FixedShape
from reasoning_from_scratch.files import atomic_write_json
from reasoning_from_scratch.fsdp import refresh_replica
from reasoning_from_scratch.generation import compile_decoding, generate
from reasoning_from_scratch.prompts import render_prompt
from reasoning_from_scratch.qwen3 import QWEN3_0_6B_CONFIG, Qwen3Config, Qwen3Model, tiny_config
from reasoning_from_scratch.rewards import CompositeReward, RewardTerm
from reasoning_from_scratch.run_log import read_metrics
from reasoning_from_scratch.systems import (
    compiles_update,
    general_logprobs,
    general_rollout_stage,
    general_update,
    sampler_dtype,
    sampling_replica,
    update_autocast,
    update_shape,
)
from reasoning_from_scratch.training import GRPOConfig, Step, update_stage
from reasoning_from_scratch.validation import choice_list, positive_float, positive_int
from reasoning_from_scratch.variants import loss_function

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30
PARTS = ("compile_check", "grpo", "decode", "data_parallel", "default_run")
# --quick: the compiled path's check, the cuda-default GRPO step and one decode shape
QUICK = {"parts": ["compile_check", "grpo", "decode"], "grpo_setups": ["cuda-default"],
         "budget_s": 170.0}
# Qwen3-1.7B's published hyper-parameters (huggingface.co/Qwen/Qwen3-1.7B, config.json).
QWEN3_1_7B_CONFIG = Qwen3Config(
    vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128, rope_theta=1_000_000.0,
    max_position_embeddings=40960, tie_word_embeddings=True, torch_dtype="bfloat16")
TINY = tiny_config(vocab_size=512)
# The GRPO setups: the weights' dtype and the GRPOConfig fields that make each. cuda-default's
# sampler and autocast dtypes are what "auto" picks on CUDA (systems.sampler_dtype,
# systems.autocast_dtype), written out so that the CPU run takes the same code path.
GRPO_SETUPS = {
    "cuda-default": {"dtype": "float32", "sampler_dtype": "bfloat16", "autocast": "bfloat16",
                     "compile_update": True},
    "eager-update": {"dtype": "float32", "sampler_dtype": "bfloat16", "autocast": "bfloat16",
                     "compile_update": False},
    "bf16-weights": {"dtype": "bfloat16", "sampler_dtype": "bfloat16", "autocast": "off",
                     "compile_update": False},
}
REF_BETA = 0.04  # the KL weight of the GRPO step with a reference model
MIN_PART_S = 5.0  # a part that would start with less of the budget left is skipped
COMPARED = ("loss", "reward_mean")  # the metrics the fsdp and plain two-step runs compare


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


# ----------------------------------------------------------------------------------------------
# decode
# ----------------------------------------------------------------------------------------------

def random_model(cfg: Qwen3Config, device, dtype: torch.dtype) -> Qwen3Model:
    """A randomly initialised Qwen3Model in `dtype`, made on `device` directly (initialising
    a 1.7B model on the host first would cost the lease many seconds)."""
    with torch.device(device):
        model = Qwen3Model(cfg)
    return model.to(device=device, dtype=dtype).eval()  # anything made on the host moves too


def decode_shapes(args) -> list[tuple[str, Qwen3Config, int]]:
    """(label, config, rows) of the decode measurements, the first one the most wanted."""
    if args.device == "cpu":
        return [("tiny x4", TINY, 4)]
    return [("0.6B x128", QWEN3_0_6B_CONFIG, 128), ("0.6B x512", QWEN3_0_6B_CONFIG, 512),
            ("1.7B x128", QWEN3_1_7B_CONFIG, 128)]


def hf_model(model: Qwen3Model):
    """transformers' Qwen3ForCausalLM holding `model`'s weights (the state-dict keys agree)."""
    from transformers import Qwen3Config as HFConfig
    from transformers import Qwen3ForCausalLM

    with torch.device(model.device):  # initialised where it runs, as `random_model`
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


def decode_part(label, cfg, rows, args, results):
    """Tokens/s of ours eager, ours compiled and transformers' static cache at one shape."""
    dev = torch.device(args.device)
    torch.manual_seed(args.seed)
    model = random_model(cfg, dev, decode_dtype(dev))
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


def decode_dtype(device) -> torch.dtype:
    """The decode part's weights: bfloat16 on CUDA (as the rollouts' sampler), else float32."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


# ----------------------------------------------------------------------------------------------
# grpo: steps of the training loop
# ----------------------------------------------------------------------------------------------

def compile_check_part(args, results):
    """The compiled paths against eager on the GPU, before any figure is trusted
    (`compile_check`): greedy decoding of `--prompts` rows x `--new-tokens` tokens from the
    bfloat16 sampler of a random float32 Qwen3-0.6B (cuda-default's setup), compiled vs eager
    (equal tokens; every compiled token a near-argmax of the eager logits, the float32 model
    setting the rounding tolerance), and the update's log-probs of those rows through the
    compiled blocks vs eager under bfloat16 autocast."""
    dev = torch.device(args.device)
    config = grpo_config("cuda-default", args.new_tokens, args)
    torch.manual_seed(args.seed)
    model = random_model(TINY if dev.type == "cpu" else QWEN3_0_6B_CONFIG, dev, torch.float32)
    sampler = sampling_replica(model, dev, torch.bfloat16)
    ids = torch.randint(1, model.cfg.vocab_size, (args.prompts, args.prompt_len), device=dev)
    mask = torch.ones_like(ids, dtype=torch.bool)
    found = check_decoding(sampler, ids, mask, args.new_tokens, None, reference=model)
    out = found.pop("output")
    shape = FixedShape(rows=args.prompts, prompt_cols=args.prompt_len,
                       completion_cols=out.completion_ids.shape[1], compile=True)
    seq = torch.cat([ids, out.completion_ids], dim=1)
    update = check_logprobs(model, seq, torch.ones_like(seq), args.prompt_len,
                            out.completion_mask, shape, lambda: update_autocast(config, dev),
                            config.chunk_size, config.temperature)
    results["compile_check"] = {"decoding": found, "update": update,
                                "ok": found["ok"] and update["ok"]}
    print(f"compile_check: decoding {'equal' if found['tokens_equal'] else 'NOT equal'} "
          f"(max logit gap {found['max_logit_gap']:.3g}, tolerance "
          f"{found['logit_tolerance']:.3g}); update log-probs within "
          f"{update['max_logprob_diff']:.3g} (tolerance {update['logprob_tolerance']:.3g})"
          + ("" if results["compile_check"]["ok"] else
             "; THE COMPILED PATH DISAGREES WITH EAGER: its speed figures are not a result"),
          flush=True)


def grpo_config(setup: str, new_tokens: int, args, beta: float = 0.0) -> GRPOConfig:
    """The GRPOConfig of one setup (`GRPO_SETUPS`) at `new_tokens` tokens per rollout; with
    --no-compile nothing is compiled (the CPU's default)."""
    s = GRPO_SETUPS[setup]
    return GRPOConfig(
        prompts_per_step=args.prompts, num_rollouts=args.num_rollouts,
        max_new_tokens=new_tokens, micro_batch_size=args.micro_batch_size, lr=1e-6,
        warmup_steps=0, beta=beta, skip_zero_advantage=False, sampler_dtype=s["sampler_dtype"],
        autocast=s["autocast"], compile=args.compile,
        compile_update=args.compile and s["compile_update"], seed=args.seed, progress=False)


def build_step_run(model_cfg: Qwen3Config, setup: str, config: GRPOConfig, device):
    """What `train_grpo` builds before its first step, for a random model: a `training.Step`
    with the trained model in the setup's dtype, its sampling copy, the frozen reference (beta >
    0; kept in memory, where a run also writes it to disk), AdamW, and the systems layer's
    general stages with the compiled update's shape (systems.py)."""
    torch.manual_seed(config.seed)
    model = random_model(model_cfg, device, getattr(torch, GRPO_SETUPS[setup]["dtype"]))
    tokenizer = NoEosTokenizer(model_cfg.vocab_size)
    sampler = sampling_replica(model, device, sampler_dtype(config, device))
    shape = update_shape(config, tokenizer, PROBLEMS, render_prompt) \
        if compiles_update(config, device) else None
    reward = CompositeReward([RewardTerm("even", even_fraction)])
    return Step(
        model, torch.optim.AdamW(model.parameters(), lr=config.lr,
                                 weight_decay=config.weight_decay),
        model if sampler is None else sampler, tokenizer, PROBLEMS, device, config, reward,
        reward.names, render_prompt, loss_function(config),
        ref_model=copy.deepcopy(model).eval().requires_grad_(False) if config.beta else None,
        compiled_decoding=compile_decoding(config.compile, device),
        rollouts=general_rollout_stage, update=partial(general_update, fixed_shape=shape),
        logprobs=partial(general_logprobs, fixed_shape=shape),
        after_update=None if sampler is None else partial(refresh_replica, sampler))


def training_step(run, step: int) -> dict:
    """Step `step` of `train_grpo`'s loop on `run` (`build_step_run`): the rollouts, rewards and
    advantages (`run.rollouts`, from the sampler), then the update with the sampler's refresh
    (`training.update_stage`); no logging, evaluation or checkpoint. Returns the seconds of each
    phase (the device synchronised) and the step's figures."""
    dev = torch.device(run.device)
    sync(dev)
    t0 = time.perf_counter()
    batch, cost = run.rollouts(run, step)
    sync(dev)
    t1 = time.perf_counter()
    row = update_stage(run, batch, step, cost, lambda phase, step: None)
    sync(dev)
    t2 = time.perf_counter()
    mask = batch.attention_mask  # None: no padding anywhere
    return {"rollout_s": t1 - t0, "update_s": t2 - t1, "step_s": t2 - t0, "loss": row["loss"],
            "grad_norm": row["grad_norm"], "tokens": batch.num_generated_tokens,
            "rows": batch.size,
            "trained_tokens": batch.input_ids.numel() if mask is None else int(mask.sum())}


def mean_of(steps: list[dict]) -> dict:
    """The mean of each figure over the timed steps."""
    return {k: sum(s[k] for s in steps) / len(steps) for k in steps[0]}


def grpo_label(setup, new_tokens, with_ref, args) -> str:
    """"16x8x256 cuda-default" (prompts x G x new tokens, the setup; " +ref" with a reference)."""
    return f"{args.prompts}x{args.num_rollouts}x{new_tokens} {setup}" + \
        (" +ref" if with_ref else "")


def grpo_part(setup, new_tokens, with_ref, args, results):
    """A warm-up step, then `--grpo-steps` timed steps of one setup; figures into results."""
    dev = torch.device(args.device)
    label = grpo_label(setup, new_tokens, with_ref, args)
    config = grpo_config(setup, new_tokens, args, REF_BETA if with_ref else 0.0)
    run = build_step_run(TINY if dev.type == "cpu" else QWEN3_0_6B_CONFIG, setup, config, dev)
    out = results["grpo"][label] = {  # filled as it goes: a time-out keeps what was measured
        "setup": setup, "settings": {"dtype": GRPO_SETUPS[setup]["dtype"], **{
            k: getattr(config, k) for k in ("sampler_dtype", "autocast", "compile",
                                            "compile_update", "beta", "micro_batch_size")}}}
    out["warmup_step_s"] = warmup_s = training_step(run, 0)["step_s"]  # compiles, AdamW state
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    r = mean_of([training_step(run, k) for k in range(1, 1 + args.grpo_steps)])
    out.update({k: r[k] for k in ("step_s", "rollout_s", "update_s", "tokens",
                                  "trained_tokens", "loss", "grad_norm")})
    out["rollout_tok_s"] = r["tokens"] / r["rollout_s"]
    if dev.type == "cuda":
        params = sum(p.numel() for p in run.model.parameters())
        flops = (6 + (2 if with_ref else 0)) * params * r["trained_tokens"]
        out["update_mfu"] = flops / r["update_s"] / (args.peak_tflops * 1e12)
        out["peak_gib"] = torch.cuda.max_memory_allocated() / GIB
    print(f"grpo {label}: step {r['step_s']:.2f} s (rollouts {r['rollout_s']:.2f}, update "
          f"{r['update_s']:.2f}), {r['tokens']:.0f} rollout tokens, warm-up step "
          f"{warmup_s:.1f} s", flush=True)


# ----------------------------------------------------------------------------------------------
# chapters/ch07_train.py runs: data-parallel and the default run
# ----------------------------------------------------------------------------------------------

def ch07_run(args, out: Path, flags: list[str]) -> float:
    """`python chapters/ch07_train.py --device D --output-dir out *flags`; returns its wall
    seconds (raises with its stderr if it fails)."""
    cmd = [sys.executable, str(ROOT / "chapters" / "ch07_train.py"), "--device", args.device,
           "--output-dir", str(out), *flags]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"ch07_train.py {' '.join(flags)} exited {proc.returncode}: "
                           f"{proc.stderr[-500:]}")
    return wall


def max_metric_diff(a: list[dict], b: list[dict], keys=COMPARED) -> dict:
    """The largest absolute difference of each metric between two runs' step rows."""
    if len(a) != len(b):
        raise ValueError(f"the runs logged {len(a)} and {len(b)} steps")
    return {k: max(abs(x[k] - y[k]) for x, y in zip(a, b)) for k in keys}


def dp_two_steps_part(args, results):
    """The same short run with and without --fsdp (world size 1): wall times, metric diffs."""
    flags = args.dp_args.split()
    runs, rows = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode, extra in (("plain", []), ("fsdp", ["--fsdp"])):
            out = Path(tmp) / mode
            wall = ch07_run(args, out, [*flags, *extra])
            rows[mode] = read_metrics(out / "metrics.csv")
            runs[mode] = {"wall_s": wall, "steps": len(rows[mode])}
    results["data_parallel"]["two_steps"] = {
        **runs, "max_diff": max_metric_diff(rows["plain"], rows["fsdp"]), "flags": args.dp_args,
        "values": {mode: {k: [r[k] for r in rows[mode]] for k in COMPARED} for mode in rows}}


def dp_startup_part(args, results):
    """Start-up peak memory, sharded against the former start, in one process: a random
    Qwen3-0.6B with CUDA's bfloat16 replica (on the CPU: the bundled model, float32)."""
    cpu = args.device == "cpu"
    shape, dtype = ("tiny", "float32") if cpu else ("0.6B", "bfloat16")
    out = measure_startup(shape, 1, dtype, args.device)
    results["data_parallel"]["startup"] = {**out, "shape": shape, "replica_dtype": dtype}


def default_run_part(args, results):
    """`python chapters/ch07_train.py` (+ `--run-args`): wall time and final accuracy."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        wall = ch07_run(args, out, args.run_args.split())
        summary = json.loads((out / "summary.json").read_text())
    results["default_run"] = {"wall_s": wall, "final_accuracy": summary.get("final_accuracy"),
                              "base_accuracy": summary.get("base_accuracy"),
                              "args": args.run_args}


# ----------------------------------------------------------------------------------------------
# the plan, the budget and the runner
# ----------------------------------------------------------------------------------------------

def plan(args, results) -> list[tuple[str, Callable, tuple]]:
    """(name, function, arguments) of every part asked for, in priority order (the module
    docstring says why)."""
    first, *more_tokens = args.grpo_tokens

    def grpo(setup, n, with_ref):
        return (f"grpo {grpo_label(setup, n, with_ref, args)}", grpo_part,
                (setup, n, with_ref, args, results))

    shapes = [(f"decode {label}", decode_part, (label, cfg, rows, args, results))
              for label, cfg, rows in decode_shapes(args)]
    wanted = {
        "compile_check": [("compile_check", compile_check_part, (args, results))],
        "grpo": [grpo(setup, first, False) for setup in args.grpo_setups],
        "decode": shapes[:1],
        "data_parallel": [("data_parallel two_steps", dp_two_steps_part, (args, results)),
                          ("data_parallel startup", dp_startup_part, (args, results))],
        "decode more": shapes[1:],
        "grpo more": [grpo("cuda-default", n, False) for n in more_tokens]
        + [grpo("cuda-default", first, True)],
        "default_run": [("default_run", default_run_part, (args, results))],
    }
    return [job for group, jobs in wanted.items() if group.split()[0] in args.parts
            and not (args.quick and group.endswith(" more")) for job in jobs]


def within_budget(jobs, budget_s: float, limit_s: float, skipped: list,
                  clock=time.perf_counter):
    """Yield (job, time limit) while the budget lasts, counted from the first job's start: the
    limit is `limit_s` or what is left, if less; jobs that would start with less than
    MIN_PART_S left go to `skipped` (their names)."""
    start = clock()
    for job in jobs:
        left = budget_s - (clock() - start)
        if left < MIN_PART_S:
            skipped.append(job[0])
            continue
        yield job, min(limit_s, left)


def new_results(args) -> dict:
    """The results dict, every key present before any part runs."""
    dev = torch.device(args.device)
    return {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
            "torch": torch.__version__, "dtype": str(decode_dtype(dev)).removeprefix("torch."),
            "compile": args.compile, "budget_s": args.budget_s, "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens, "grpo": {},
            "decode_tok_s": {"ours_eager": {}, "ours_fast": {}, "hf_static": {}},
            "compile_check": None, "compile_s": {}, "host_syncs_per_token": {},
            "data_parallel": {"two_steps": None, "startup": None}, "default_run": None,
            "part_s": {}, "skipped": [], "timed_out": [], "errors": {},
            "compile_failures": {}}


def run_part(name, fn, fn_args, limit_s, results, device):
    """One part under its time limit; its time, a time-out, an error or a compile fallback
    (the package warns and runs eagerly) go into results."""
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with time_limit(limit_s):
                fn(*fn_args)
        except PartTimeout:
            results["timed_out"].append(name)
        except Exception as e:  # one broken part (e.g. transformers missing) leaves the rest
            results["errors"][name] = f"{type(e).__name__}: {str(e)[:300]}"
    messages = [str(w.message) for w in caught]
    failed = [m[:300] for m in messages if m.startswith("torch.compile of the")]  # fallbacks
    if failed:
        results["compile_failures"][name] = failed
    for m in sorted(set(messages))[:5]:  # recording them kept them off stderr
        print(f"{name}: warning: {m[:200]}", file=sys.stderr)
    results["part_s"][name] = time.perf_counter() - t0
    print(f"{name}: {results['part_s'][name]:.1f} s", flush=True)
    gc.collect()  # the part's models (a time-out's traceback held them)
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def run_parts(args, out: Path | None = None) -> dict:
    """Every part asked for, in priority order, while the budget lasts; the results dict,
    also written to `out` after every part (a lease that ends mid-run leaves the figures
    measured so far)."""
    results = new_results(args)
    for (name, fn, fn_args), limit in within_budget(plan(args, results), args.budget_s,
                                                    args.limit_s, results["skipped"]):
        run_part(name, fn, fn_args, limit, results, args.device)
        if out is not None:
            atomic_write_json(out, results)
    if out is not None:
        atomic_write_json(out, results)  # the skipped parts too
    return results


def parse_args(argv=None):
    """The flags; the shape flags left None take their CUDA or CPU value."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cuda: the real shapes; cpu: a tiny model and small shapes (CI)")
    p.add_argument("--parts", type=choice_list(PARTS), default=list(PARTS),
                   help="comma-separated parts: " + ", ".join(PARTS))
    p.add_argument("--out", type=Path, default=None,
                   help="results JSON (None: docs/gpu_results.json on CUDA; nothing on cpu)")
    p.add_argument("--budget-s", type=positive_float, default=450.0,
                   help="seconds for all parts together: parts run in priority order while it "
                        "lasts, the rest are recorded as skipped (450: with CUDA's start, about "
                        "8 minutes)")
    p.add_argument("--quick", action="store_true",
                   help="a ~3-minute subset: the compile check, the cuda-default GRPO step and "
                        "one decode shape, within 170 s (overrides --parts, --grpo-setups and "
                        "--budget-s)")
    p.add_argument("--limit-s", type=positive_float, default=200.0,
                   help="time limit of each part (each decode shape, each GRPO setup, each "
                        "data-parallel measurement), compiles included")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="compile the decode step (rollouts) and, in the cuda-default GRPO "
                        "setup, the update's blocks (None: on for cuda, off for cpu)")
    p.add_argument("--prompt-len", type=positive_int, default=None,
                   help="decode prompt tokens (None: 64; 8 on cpu)")
    p.add_argument("--new-tokens", type=positive_int, default=None,
                   help="decode new tokens (None: 256; 8 on cpu)")
    p.add_argument("--prompts", type=positive_int, default=None,
                   help="GRPO prompts per step (None: 16; 2 on cpu)")
    p.add_argument("--num-rollouts", type=positive_int, default=None,
                   help="GRPO G (None: 8; 2 on cpu)")
    p.add_argument("--grpo-tokens", type=positive_int, nargs="+", default=None,
                   help="GRPO new tokens per rollout: the first for every setup, the others "
                        "for cuda-default, later (None: 256 512; 4 on cpu)")
    p.add_argument("--grpo-setups", type=choice_list(GRPO_SETUPS), default=list(GRPO_SETUPS),
                   help="comma-separated GRPO setups, in the order they run: "
                        + ", ".join(GRPO_SETUPS))
    p.add_argument("--grpo-steps", type=positive_int, default=None,
                   help="timed GRPO steps per setup, after the warm-up step (None: 2; 1 on cpu)")
    p.add_argument("--micro-batch-size", type=positive_int, default=16,
                   help="rollouts per forward/backward in the update")
    p.add_argument("--peak-tflops", type=positive_float, default=989.0,
                   help="the GPU's dense bf16 peak for MFU (989: H100/H200 SXM)")
    p.add_argument("--dp-args", default=None,
                   help="ch07_train.py flags of the two-step runs with and without --fsdp "
                        "(None: 2 steps, 16 held-out examples, no compiling; smaller on cpu, "
                        "in float64 there: the two runs then agree to the printed digits)")
    p.add_argument("--run-args", default=None,
                   help="extra ch07_train.py flags of the default run (None: none on CUDA; a "
                        "one-step run on cpu)")
    add_seed_argument(p, help="weights and sampling seed")
    args = p.parse_args(argv)
    if args.quick:
        for name, value in QUICK.items():
            setattr(args, name, value)
    fill_defaults(args)
    return args


def fill_defaults(args) -> None:
    """The flags left None: the CUDA shapes, or the CPU's small ones."""
    cpu = args.device == "cpu"
    dp = "--steps 2 --eval-every 0 --checkpoint-minutes 0 --no-compile --no-progress"
    small = "--prompts-per-step 2 --num-rollouts 2 --max-new-tokens 4 --threads 1"
    for name, gpu, tiny in (("prompt_len", 64, 8), ("new_tokens", 256, 8), ("prompts", 16, 2),
                            ("num_rollouts", 8, 2), ("grpo_tokens", [256, 512], [4]),
                            ("grpo_steps", 2, 1), ("compile", True, False),
                            ("dp_args", f"{dp} --eval-examples 16",
                             f"{dp} --eval-examples 2 {small} --dtype float64"),
                            ("run_args", "", f"--steps 1 --eval-examples 2 {small}")):
        if getattr(args, name) is None:
            setattr(args, name, tiny if cpu else gpu)


def main(argv=None) -> int:
    """Parse the flags; without CUDA (and without --device cpu) say so, else run and write."""
    args = parse_args(argv)
    if args.device != "cpu" and not torch.cuda.is_available():
        print("gpu_check needs CUDA: torch.cuda.is_available() is False on this machine "
              f"(torch {torch.__version__}); nothing to check here (--device cpu runs the "
              "tiny version).")
        return 0
    out = args.out or (None if args.device == "cpu" else ROOT / "docs" / "gpu_results.json")
    results = run_parts(args, out)
    print(json.dumps(results, indent=1))
    if out is not None:
        print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
