"""The flags the chapter scripts and benchmarks share, each defined once: model, evaluation set,
sampling (token budget, temperature, top-p, top-k), seed, device and CPU threads.

A script passes its own defaults, and its own help text where it reads a flag its own way; the
flag's name, type and range come from here. The helpers add flags to a parser (or an argument
group) and nothing else; what a script reads back are plain values, passed on to the library.
"""

from __future__ import annotations

import torch

from ..datasets import DATASET_NAMES, load_dataset_by_name
from ..device import device_arg
from ..validation import (
    arg_type,
    at_least,
    non_negative_float,
    non_negative_int,
    optional,
    optional_positive_int,
    positive_int,
    probability_float,
)

MODEL_HELP = "bundled model name, local Hugging Face-layout directory or hub repo id"
DEVICE_HELP = "cuda, mps or cpu (None: the best available)"
THREADS_HELP = ("torch CPU threads (0: torch's default). One thread is fastest for the tiny "
                "model, whose matrices are too small to split, and it stays fast on a busy "
                "machine, where spinning worker threads of several processes slowed a rollout "
                "batch 90-fold in our measurements")
SHORT_THREADS_HELP = ("torch CPU threads (1 is fastest for the tiny model on a busy machine; "
                      "'none': torch's default)")
SEED_HELP = "random seed for sampling"

# --dtype of a run's weights. float64 is for checks: two runs that sum in another order (other
# process counts, FSDP) then agree to ~1e-14 instead of float32's ~1e-5 (tests/tolerance.py).
RUN_DTYPES = ("float32", "bfloat16", "float64")
DTYPE_HELP_FLOAT64 = ("; float64: to check that two runs agree (other process counts, FSDP, "
                      "a resume): they then differ by ~1e-14, float32's rounding ~1e-5")

# --threads: a count, or 0 / 'none' for torch's default (the scripts' help texts use either)
threads_arg = arg_type(int, optional(at_least(0)), allow_none=True)

# The sampling flags: argparse type and the help a script gets unless it gives its own.
SAMPLING_FLAGS = {
    "max_new_tokens": (positive_int, "maximum number of generated tokens per answer"),
    "temperature": (non_negative_float, "sampling temperature; 0 means greedy decoding"),
    "top_p": (probability_float, "nucleus sampling threshold (only used when temperature > 0)"),
    "top_k": (positive_int, "sample only among the k most likely tokens (None: no limit)"),
}


def add_dtype_argument(parser, help) -> None:
    """--dtype: the weights' dtype of a run (float32 by default, `RUN_DTYPES`)."""
    parser.add_argument("--dtype", default="float32", choices=RUN_DTYPES,
                        help=help + DTYPE_HELP_FLOAT64)


def add_model_argument(parser, help=MODEL_HELP, default="tiny-arith") -> None:
    """--model: a bundled model name, a local Hugging Face-layout directory or a hub repo id."""
    parser.add_argument("--model", default=default, help=help)


def add_dataset_arguments(parser, limit=None,
                          limit_help="evaluate only the first N examples (None: all)",
                          dataset_help="evaluation set (math = the 12k MATH training "
                                       "problems)") -> None:
    """--dataset, --split, --data-path, --cache-dir and --limit: the evaluation set of a chapter
    script (read with `load_examples_or_exit`)."""
    parser.add_argument("--dataset", default="arith", choices=DATASET_NAMES, help=dataset_help)
    parser.add_argument("--split", default=None,
                        help="split: test/val/train for arith, test/train for gsm8k "
                             "(None: the dataset's evaluation split)")
    parser.add_argument("--data-path", default=None,
                        help="local JSON/JSONL file to use instead of downloading the dataset")
    parser.add_argument("--cache-dir", default=None,
                        help="download cache (None: $RFS_CACHE_DIR or "
                             "~/.cache/reasoning_from_scratch)")
    parser.add_argument("--limit", type=optional_positive_int if limit is None else positive_int,
                        default=limit, help=limit_help)


def load_examples_or_exit(dataset, split=None, path=None, cache_dir=None, n=None):
    """The first `n` examples of the set the `add_dataset_arguments` flags name; a bad file or
    split exits with one line (SystemExit), not a traceback."""
    try:
        return load_dataset_by_name(dataset, split=split, path=path, cache_dir=cache_dir, n=n)
    except (ValueError, FileNotFoundError) as err:
        raise SystemExit(f"error: {err}") from None


def add_sampling_arguments(parser, helps: dict | None = None, prefix: str = "",
                           **defaults) -> None:
    """One flag per keyword, in the order given, with that default: max_new_tokens,
    temperature, top_p, top_k; `helps` replaces the help of some, `prefix` starts their names
    (prefix="teacher_": --teacher-temperature, read back as args.teacher_temperature).

    add_sampling_arguments(parser, max_new_tokens=512, temperature=0.0, top_p=1.0)
    """
    helps = helps or {}
    unknown = set(defaults) - set(SAMPLING_FLAGS) or set(helps) - set(defaults)
    if unknown:
        raise TypeError(f"not a sampling flag here: {sorted(unknown)}; "
                        f"choose from {list(SAMPLING_FLAGS)}")
    for name, default in defaults.items():
        kind, help = SAMPLING_FLAGS[name]
        if default is None and kind is positive_int:  # e.g. --top-k none: no limit
            kind = optional_positive_int
        parser.add_argument("--" + (prefix + name).replace("_", "-"), type=kind,
                            default=default, help=helps.get(name, help))


def add_seed_argument(parser, default=0, help=SEED_HELP) -> None:
    """--seed: a non-negative integer."""
    parser.add_argument("--seed", type=non_negative_int, default=default, help=help)


def add_device_argument(parser) -> None:
    """--device, checked against this torch (a device it cannot use exits 2)."""
    parser.add_argument("--device", type=device_arg, default=None, help=DEVICE_HELP)


def add_threads_argument(parser, default=1, help=THREADS_HELP) -> None:
    """--threads: torch CPU threads (0 or 'none': torch's default); see `set_threads`."""
    parser.add_argument("--threads", type=threads_arg, default=default, help=help)


def add_runtime_arguments(parser, threads=1, threads_help=THREADS_HELP) -> None:
    """--device and --threads, shared by the training, evaluation and benchmark scripts."""
    add_device_argument(parser)
    add_threads_argument(parser, threads, threads_help)


def set_threads(threads: int | None) -> None:
    """Use `threads` torch CPU threads; 0 or None keeps torch's default."""
    if threads:
        torch.set_num_threads(threads)
