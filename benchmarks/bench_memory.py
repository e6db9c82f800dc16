"""Benchmark: peak memory of GRPO at the Qwen3-0.6B shape (CPU) against memory.py's formula.

Measured with and without activation checkpointing, with the update's time beside it.

Each case runs in a fresh process (its peak resident set size is its own): a random
Qwen3-0.6B-shaped model in float32 (the CPU's dtypes), the reference a deep copy of what samples
(beta > 0), AdamW; then, as a run goes, `training.update` on a fixed batch, a rollout phase
(a KV cache of the rollout rows prefilled by the sampler, no gradients), and a second update
(now beside the first one's gradients and AdamW moments). The peak is the maximum resident set
size above what the process held after its imports; "predicted" is
`memory.memory_per_process(..., device="cpu")` for the same shapes. Sharded cases run `--fsdp`'s
code (`fsdp.shard_with_replica`) in a process group of one, or of `--processes` Gloo processes
under torchrun (each its share of the rollout rows; the largest process's peak is reported:
two processes of the 0.6B shape hold ~20 GB together). Not a test: the seconds depend on the
machine and what else runs on it; the update's CPU seconds (one thread) are less sensitive to
other jobs than its wall seconds, and the ratio of the two, measured in one invocation, is the
figure.

    python benchmarks/bench_memory.py                       # both layouts, ckpt off and on
    python benchmarks/bench_memory.py --cases replicated    # one layout
    python benchmarks/bench_memory.py --cases sharded --processes 2   # 2 Gloo processes
    python benchmarks/bench_memory.py --shape tiny          # the bundled model's shape (seconds)
"""

import argparse
import copy
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

from reasoning_from_scratch import distributed, fsdp, systems, training
from reasoning_from_scratch.grpo import RolloutBatch
from reasoning_from_scratch.memory import GB, memory_per_process
from reasoning_from_scratch.qwen3 import QWEN3_0_6B_CONFIG, KVCache, Qwen3Model, tiny_config
from reasoning_from_scratch.validation import positive_int

SHAPES = {"0.6B": QWEN3_0_6B_CONFIG, "tiny": tiny_config()}
LAYOUTS = ("replicated", "sharded")
CASE_LINE = "BENCH_MEMORY_CASE "  # a worker's result line (torchrun mixes the processes' output)


def _max_rss_bytes() -> int:
    """This process's peak resident set size so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def fixed_batch(cfg, rows, prompt, answer) -> RolloutBatch:
    """`rows` random sequences of `prompt` + `answer` tokens, every answer token in the loss;
    the first row's prompt one token shorter (left padding: an attention mask, as in a run)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (rows, prompt + answer), generator=g)
    mask = torch.ones_like(ids)
    mask[0, 0] = 0
    return RolloutBatch(ids, mask, prompt, torch.ones(rows, answer, dtype=torch.bool),
                        torch.linspace(-1.0, 1.0, rows), torch.zeros(1, rows))


def predicted(spec) -> dict[str, int]:
    """memory_per_process for a case (the CPU's dtypes; kv_rows rollout rows per process)."""
    processes = spec.get("processes", 1)
    return memory_per_process(
        SHAPES[spec["shape"]], processes, spec["layout"] == "sharded", device="cpu",
        reference=spec["reference"], rollout_rows=spec["kv_rows"] * processes,
        rollout_tokens=spec["kv_tokens"], micro_batch_rows=spec["rows"],
        sequence_tokens=spec["prompt"] + spec["answer"],
        answer_tokens=spec["rows"] * spec["answer"], chunk_size=spec["chunk_size"],
        activation_checkpointing=spec["checkpointing"])


def worker(spec) -> dict:
    """One case, in this process (one of torchrun's, when sharded over several): build,
    update, roll out, update; peak and update seconds."""
    torch.set_num_threads(1)
    sharded = spec["layout"] == "sharded"
    if sharded:  # under torchrun: the launched group; else a group of this process alone
        distributed.init_distributed(torch.device("cpu"), group_of_one=True)
    cfg = SHAPES[spec["shape"]]
    base = _max_rss_bytes()
    torch.manual_seed(0)
    model = Qwen3Model(cfg)  # float32, random
    policy = model
    if sharded:
        model, policy = fsdp.shard_with_replica(model, torch.device("cpu"))
    model.activation_checkpointing = spec["checkpointing"]
    ref = copy.deepcopy(policy).eval().requires_grad_(False) if spec["reference"] else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    batch = fixed_batch(cfg, spec["rows"], spec["prompt"], spec["answer"])
    config = training.GRPOConfig(micro_batch_size=spec["rows"], chunk_size=spec["chunk_size"],
                                 beta=0.04 if ref is not None else 0.0, progress=False)
    ref_logp = None if ref is None else systems.general_logprobs(ref, batch, config)
    kv_ids = torch.randint(0, cfg.vocab_size, (spec["kv_rows"], spec["kv_tokens"]),
                           generator=torch.Generator().manual_seed(1))
    seconds, cpu_seconds = [], []
    for phase in ("update", "rollouts", "update"):
        if phase == "update":
            start, cpu_start = time.perf_counter(), time.process_time()
            stats = systems.general_update(model, optimizer, batch, None, ref_logp, config)
            seconds.append(time.perf_counter() - start)
            cpu_seconds.append(time.process_time() - cpu_start)
            assert not stats["skipped"]
            if sharded:
                fsdp.refresh_replica(policy, model)
        else:  # the rollout phase's cache, filled by one prefill (as `generate` starts)
            with torch.no_grad():
                cache = KVCache(cfg.num_hidden_layers)
                policy(kv_ids, cache=cache, last_only=True)
                del cache
    out = {"rank": distributed.rank(), "peak_bytes": _max_rss_bytes() - base,
           "update_s": seconds, "update_cpu_s": cpu_seconds}
    distributed.shutdown_distributed()
    return out


def run_case(spec) -> dict:
    """`worker(spec)` in fresh processes (their own peaks; torchrun when `spec["processes"]` >
    1): the process with the largest peak, and every process's peak. Refuses when the machine's
    free memory is below the predictions plus 2 GB (the case would push others out)."""
    processes = spec.get("processes", 1)
    need = processes * predicted(spec)["total"] + 2 * GB
    free = _available_bytes()
    if free is not None and free < need:
        raise SystemExit(f"{spec['layout']}: needs ~{need / GB:.1f} GB, {free / GB:.1f} GB "
                         "available; free memory or pick --cases / --processes / smaller --rows")
    launch = [sys.executable] if processes == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
        str(processes)]
    res = subprocess.run([*launch, __file__, "--worker", json.dumps(spec)],
                         capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    rows = [json.loads(line[len(CASE_LINE):]) for line in res.stdout.splitlines()
            if line.startswith(CASE_LINE)]
    if res.returncode or len(rows) != processes:
        raise RuntimeError(f"case {spec} failed:\n{res.stderr[-3000:]}")
    largest = max(rows, key=lambda r: r["peak_bytes"])
    return {**largest, "peaks_bytes": [r["peak_bytes"] for r in sorted(rows,
                                                                        key=lambda r: r["rank"])]}


def _available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:  # one case, in a process run_case started
        # one write of the whole line: torchrun's processes share the pipe, and a print's
        # separate write of its newline let two result lines run together
        sys.stdout.write(CASE_LINE + json.dumps(worker(json.loads(argv[1]))) + "\n")
        sys.stdout.flush()
        return None
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="0.6B",
                   help="a random model of Qwen3-0.6B's shape, or the bundled model's")
    p.add_argument("--cases", nargs="+", choices=LAYOUTS, default=list(LAYOUTS),
                   help="layouts measured, each with checkpointing off and on")
    p.add_argument("--rows", type=positive_int, default=2, help="rows of the update's batch")
    p.add_argument("--prompt", type=positive_int, default=64, help="prompt tokens per row")
    p.add_argument("--answer", type=positive_int, default=128, help="answer tokens per row")
    p.add_argument("--kv-rows", type=positive_int, default=4, help="rollout rows (KV cache)")
    p.add_argument("--kv-tokens", type=positive_int, default=256, help="rollout positions")
    p.add_argument("--chunk-size", type=positive_int, default=1024, help="lm_head chunk")
    p.add_argument("--no-reference", action="store_true", help="beta = 0: no reference model")
    p.add_argument("--processes", type=positive_int, default=1,
                   help="Gloo processes of the sharded cases (torchrun when more than 1; a "
                        "replicated process holds the same whatever their number)")
    args = p.parse_args(argv)
    if args.processes > 1 and "replicated" in args.cases:
        p.error("--processes applies to the sharded cases: pass --cases sharded")
    results = []
    for layout in args.cases:
        for ckpt in (False, True):
            spec = {"shape": args.shape, "layout": layout, "checkpointing": ckpt,
                    "reference": not args.no_reference, "rows": args.rows,
                    "prompt": args.prompt, "answer": args.answer, "kv_rows": args.kv_rows,
                    "kv_tokens": args.kv_tokens, "chunk_size": args.chunk_size,
                    "processes": args.processes}
            got, want = run_case(spec), predicted(spec)
            results.append({**spec, **got, "predicted": want})
    print(f"{args.shape} shape, float32 on the CPU, {args.processes} process(es), the largest "
          f"peak shown; update of {args.rows} x ({args.prompt} + {args.answer}) tokens, "
          f"rollouts {args.kv_rows} x {args.kv_tokens} per process, "
          f"reference: {not args.no_reference}")
    print(f"{'case':28}{'predicted GB':>14}{'measured GB':>13}{'meas / pred':>13}"
          f"{'update s':>10}{'update CPU s':>14}")
    for r in results:
        name = f"{r['layout']}, ckpt {'on' if r['checkpointing'] else 'off'}"
        pred = r["predicted"]["total"]
        print(f"{name:28}{pred / GB:14.2f}{r['peak_bytes'] / GB:13.2f}"
              f"{r['peak_bytes'] / pred:13.2f}{sum(r['update_s']) / 2:10.1f}"
              f"{sum(r['update_cpu_s']) / 2:14.1f}")
    terms = {k: round(v / GB, 3) for k, v in results[0]["predicted"].items()}
    print(f"predicted terms (GB) of {results[0]['layout']}, ckpt off: {terms}")
    return results


if __name__ == "__main__":
    main()
