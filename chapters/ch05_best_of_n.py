"""Chapter 5: best-of-N, PRM-guided beam search and self-refinement: accuracy vs generated tokens.

For each --model (give it twice to compare the base model with the chapter 7 trained one), on
the same held-out problems: greedy; N samples per problem with self-consistency, best-of-N by the
model's confidence (mean log-prob), by the blind step verifier and by a learned PRM (min,
product, last step), PRM-weighted voting, and the oracle pass@N; step-level beam search against
the PRM (and the verifier); self-refinement with the verifier, the PRM or the model itself as the
critic. Writes results.json, a markdown table and the figure. The measurement is in
reasoning_from_scratch/experiments/inference_scaling.py; this script parses the flags.

The learned PRM (--prm auto): the one cached in <output-dir>/prm, else trained there first from
the first --model (`prm.train_prm_on_arithmetic`, verifier labels, about 2 minutes on a CPU).

Examples:
    python chapters/ch05_best_of_n.py                        # bundled tiny model, 200 problems
    python chapters/ch05_best_of_n.py --model tiny-arith --label base \
        --model runs/ch07-trained/final --label "GRPO (ch07)" --figure docs/inference_scaling.png
    python chapters/ch05_best_of_n.py --limit 20 --ns 1,2,4 --beam-ns 4 --methods majority,logprob
    python chapters/ch05_best_of_n.py --model Qwen/Qwen3-0.6B-Base --dataset math500 --limit 20 \
        --max-new-tokens 1024 --ns 1,2,4 --prm none --methods majority,logprob,refine-self
"""

import argparse
import sys
import time
from pathlib import Path

import torch

from reasoning_from_scratch.cli.arguments import (
    SHORT_THREADS_HELP,
    add_dataset_arguments,
    add_runtime_arguments,
    add_sampling_arguments,
    add_seed_argument,
    load_examples_or_exit,
    set_threads,
)
from reasoning_from_scratch.device import get_device
from reasoning_from_scratch.experiments.inference_scaling import (
    METHODS,
    beam_shape,
    is_arithmetic,
    plot_inference_scaling,
    run_scaling_experiment,
    scaling_table,
)
from reasoning_from_scratch.experiments.stats import jsonable
from reasoning_from_scratch.files import atomic_write_json
from reasoning_from_scratch.prm import CONFIG_FILE as PRM_CONFIG_FILE
from reasoning_from_scratch.prm import load_prm, train_prm_on_arithmetic
from reasoning_from_scratch.validation import arg_type, at_least, positive_int, unit_float
from reasoning_from_scratch.weights import load_pretrained


def _int_list(text):
    """argparse type: comma-separated positive integers, sorted, without repeats."""
    parse = arg_type(int, at_least(1))
    values = sorted({parse(t) for t in text.split(",") if t.strip()})
    if not values:
        raise argparse.ArgumentTypeError("expected at least one number")
    return values


def _methods(text):
    """argparse type: comma-separated method names (or 'all')."""
    if text == "all":
        return list(METHODS)
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [n for n in names if n not in METHODS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown methods {unknown}; choose from "
                                         f"{', '.join(METHODS)} or 'all'")
    return names


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", action="append", default=None,
                   help="model to measure (repeatable; None: tiny-arith): bundled name, local "
                        "Hugging Face-layout directory or hub repo id")
    p.add_argument("--label", action="append", default=None,
                   help="label of each --model in the table and figure, in the same order "
                        "(None: 'base' for tiny-arith, else the directory's name)")
    add_dataset_arguments(p, limit=200, limit_help="number of held-out problems",
                          dataset_help="evaluation set; the step verifier's methods need arith")
    p.add_argument("--ns", type=_int_list, default=[1, 2, 4, 8, 16, 32],
                   help="N values (samples; rounds for self-refinement); the largest is sampled "
                        "once and smaller N take the first N samples")
    p.add_argument("--beam-ns", type=_int_list, default=[4, 8, 16],
                   help="N values (beam width x 4 expansions) for beam search, one run each")
    p.add_argument("--methods", type=_methods, default=list(METHODS),
                   help="comma-separated methods or 'all': " + ", ".join(METHODS)
                   + " (greedy and the oracle pass@N always run)")
    p.add_argument("--prm", default="auto",
                   help="learned PRM: a directory saved by chapters/ch08_train_prm.py, 'auto' "
                        "(<output-dir>/prm, trained there if missing; arith only) or 'none'")
    p.add_argument("--prm-train-problems", type=positive_int, default=400,
                   help="train-split problems for an auto-trained PRM")
    add_sampling_arguments(p, max_new_tokens=112, temperature=1.0, top_p=1.0, helps={
        "max_new_tokens": "tokens per completion (the tiny model's answers fit in 112)",
        "temperature": "sampling temperature (1: the model's own distribution)",
        "top_p": "nucleus threshold"})
    p.add_argument("--self-threshold", type=unit_float, default=0.3,
                   help="self critic: a step whose least likely token has a lower probability "
                        "is rejected")
    p.add_argument("--batch-size", type=positive_int, default=16,
                   help="problems whose N samples are decoded together")
    add_seed_argument(p)
    p.add_argument("--output-dir", default="runs/inference-scaling",
                   help="where results.json, results.md, the figure and the auto PRM go")
    p.add_argument("--figure", default=None,
                   help="figure path (None: <output-dir>/inference_scaling.png)")
    p.add_argument("--table", default=None,
                   help="markdown table path (None: <output-dir>/results.md)")
    add_runtime_arguments(p, threads_help=SHORT_THREADS_HELP)
    return p


def _labels(models, labels, parser):
    """One label per model: given ones, else 'base' for tiny-arith or the directory's name."""
    labels = list(labels or [])
    if len(labels) > len(models):
        parser.error(f"{len(labels)} --label for {len(models)} --model")
    for m in models[len(labels):]:
        labels.append("base" if m == "tiny-arith" else Path(m.rstrip("/")).name or m)
    if len(set(labels)) != len(labels):
        parser.error(f"labels must differ, got {labels}")
    return labels


def get_prm(args, model, tokenizer, device, arithmetic):
    """The learned PRM (model, tokenizer) per --prm, or None."""
    if args.prm == "none" or not ({"prm", "prm-vote", "beam-prm", "refine-prm"}
                                  & set(args.methods)):
        return None
    path = Path(args.output_dir) / "prm" if args.prm == "auto" else Path(args.prm)
    if args.prm == "auto" and not (path / PRM_CONFIG_FILE).exists():
        if not arithmetic:
            print("no PRM: --prm auto trains one on the arithmetic world only; pass --prm PATH")
            return None
        print(f"training a PRM into {path} (prm.train_prm_on_arithmetic, verifier labels)")
        train_prm_on_arithmetic(model, tokenizer, path, train_problems=args.prm_train_problems,
                                max_new_tokens=args.max_new_tokens, seed=args.seed,
                                device=device, info={"model": args.model[0]})
    return load_prm(path, device=device, dtype=torch.float32)


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    args.model = args.model or ["tiny-arith"]
    labels = _labels(args.model, args.label, parser)
    for n in args.beam_ns:
        try:
            beam_shape(n)
        except ValueError as err:
            parser.error(f"--beam-ns: {err}")
    set_threads(args.threads)
    examples = load_examples_or_exit(args.dataset, args.split, args.data_path,
                                     args.cache_dir, args.limit)
    device = get_device(args.device)
    out = Path(args.output_dir)
    start = time.perf_counter()
    results, prm = {}, None
    for i, (name, label) in enumerate(zip(args.model, labels)):
        model, tokenizer = load_pretrained(name, device=device, dtype=torch.float32)
        if i == 0:
            prm = get_prm(args, model, tokenizer, device, is_arithmetic(examples))
        print(f"{label}: {name} on {device}, {len(examples)} {args.dataset} problems")
        results[label] = run_scaling_experiment(
            model, tokenizer, examples, device, ns=args.ns, methods=args.methods, prm=prm,
            beam_ns=args.beam_ns, max_new_tokens=args.max_new_tokens,
            temperature=args.temperature, top_p=args.top_p, seed=args.seed,
            batch_size=args.batch_size, self_threshold=args.self_threshold)
        results[label]["model"] = name
        print(f"{label}: {results[label]['seconds']:.0f} s")
    table = scaling_table(results, args.table or out / "results.md")
    figure = plot_inference_scaling(results, args.figure or out / "inference_scaling.png")
    atomic_write_json(out / "results.json", jsonable({
        "settings": {k: v for k, v in vars(args).items()}, "labels": labels,
        "results": results, "seconds": time.perf_counter() - start}))
    print(table)
    print(f"figure: {figure}; results: {out / 'results.json'}; "
          f"{time.perf_counter() - start:.0f} s in all")
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
