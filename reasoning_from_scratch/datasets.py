"""Math datasets as lists of `{"problem": str, "answer": str, ...}` dicts, with a download cache.

Sources (public, fetched by `downloads.fetch_url`):
- MATH-500 (the 500-problem test subset of MATH from "Let's Verify Step by Step", Lightman et al.
  2023), `HuggingFaceH4/MATH-500` test.jsonl;
- the MATH training data minus the MATH-500 problems (12,000 problems; Hendrycks et al. 2021),
  as prepared in `rasbt/math_full_minus_math500`, a JSON array;
- GSM8K (Cobbe et al. 2021), `openai/grade-school-math` train/test jsonl, answer after `####`;
- the synthetic arithmetic world of `reasoning_from_scratch.arithmetic` (no download).

Files are cached in `~/.cache/reasoning_from_scratch` (or `$RFS_CACHE_DIR`, or `cache_dir=`).
A local file path works too (`path=`), in either JSON-array or JSONL format.
"""

import json
import os
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from .arithmetic import make_split
from .downloads import fetch_url
from .files import atomic_write_json


@dataclass(frozen=True)
class DataSource:
    """Where a dataset file comes from and what a correct download looks like."""

    filename: str
    urls: tuple
    num_rows: int  # row count of the published file: a cheap integrity check on downloads
    sha256: str = None  # checked when known


SOURCES = {
    "math500": DataSource(
        filename="math500_test.jsonl",
        urls=(
            "https://huggingface.co/datasets/HuggingFaceH4/MATH-500/resolve/main/test.jsonl",
            "https://raw.githubusercontent.com/rasbt/reasoning-from-scratch/main/"
            "ch03/01_main-chapter-code/math500_test.json",
        ),
        num_rows=500,
    ),
    "math_train": DataSource(
        filename="math_full_minus_math500.json",
        urls=(
            "https://raw.githubusercontent.com/rasbt/math_full_minus_math500/refs/heads/main/"
            "math_full_minus_math500.json",
            "https://f001.backblazeb2.com/file/reasoning-from-scratch/MATH/"
            "math_full_minus_math500.json",
        ),
        num_rows=12_000,
    ),
    "gsm8k_train": DataSource(
        filename="gsm8k_train.jsonl",
        urls=(
            "https://raw.githubusercontent.com/openai/grade-school-math/master/"
            "grade_school_math/data/train.jsonl",
        ),
        num_rows=7_473,
    ),
    "gsm8k_test": DataSource(
        filename="gsm8k_test.jsonl",
        urls=(
            "https://raw.githubusercontent.com/openai/grade-school-math/master/"
            "grade_school_math/data/test.jsonl",
        ),
        num_rows=1_319,
    ),
}


def default_cache_dir():
    """`$RFS_CACHE_DIR` if set, else `~/.cache/reasoning_from_scratch`."""
    env = os.environ.get("RFS_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "reasoning_from_scratch"


def _resolve_file(name, path=None, cache_dir=None):
    """Return (local file, downloaded_now) for dataset `name`, downloading it if needed."""
    if path is not None:
        path = Path(path).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"dataset file not found: {path}")
        return path, False
    source = SOURCES[name]
    dest = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    dest = dest / source.filename
    if dest.is_file():
        return dest, False
    dest.parent.mkdir(parents=True, exist_ok=True)
    errors = []
    for url in source.urls:
        try:
            return fetch_url(url, dest, sha256=source.sha256), True
        except (OSError, ValueError) as err:  # requests' errors are OSErrors
            errors.append(f"  {url}: {err}")
    raise FileNotFoundError(
        f"could not download the {name} dataset:\n" + "\n".join(errors) + "\n"
        f"Fetch it by hand, e.g.\n  curl -L -o {dest} {source.urls[0]}\n"
        f"(or set RFS_CACHE_DIR / pass cache_dir=, or pass path= to a local copy)."
    )


def read_records(path):
    """Yield (line_number, row) from a JSONL file or a JSON array; ValueError names file:line."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    stripped = text.lstrip()
    if stripped.startswith("["):
        yield from _read_json_array(path, text)
        return
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield lineno, json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}, line {lineno}: invalid JSON ({err.msg})") from None


def _read_json_array(path, text):
    """Yield (line_number, element) of a top-level JSON array, keeping each element's line."""
    decoder = json.JSONDecoder()
    i = text.index("[") + 1
    lineno, counted_to = 1, 0
    expect_value = True
    while True:
        while i < len(text) and text[i] in " \t\r\n":
            i += 1
        if i >= len(text):
            raise ValueError(f"{path}: JSON array is not closed")
        if text[i] == "]":
            return
        if not expect_value:
            if text[i] != ",":
                lineno += text.count("\n", counted_to, i)
                raise ValueError(f"{path}, line {lineno}: expected ',' or ']' in JSON array")
            i += 1
            expect_value = True
            continue
        lineno += text.count("\n", counted_to, i)
        counted_to = i
        try:
            value, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}, line {err.lineno}: invalid JSON ({err.msg})") from None
        expect_value = False
        yield lineno, value


def _require(row, key, path, lineno):
    """row[key] as a string; ValueError naming file and line if it is missing."""
    if not isinstance(row, dict):
        raise ValueError(f"{path}, line {lineno}: expected a JSON object, got {type(row).__name__}")
    value = row.get(key)
    if value is None or (isinstance(value, str) and not value.strip()):
        raise ValueError(f"{path}, line {lineno}: row has no {key!r} field")
    return str(value)


def _load_rows(name, path, cache_dir, convert):
    """Read and convert every row; check the row count of files we downloaded ourselves."""
    file, downloaded = _resolve_file(name, path, cache_dir)
    examples = [convert(row, file, lineno) for lineno, row in read_records(file)]
    expected = SOURCES[name].num_rows if name in SOURCES else None
    if downloaded and expected is not None and len(examples) != expected:
        os.remove(file)
        raise ValueError(
            f"{file}: downloaded {len(examples)} rows, expected {expected}; file removed, "
            "try again or fetch it by hand"
        )
    return examples


def _math_row(row, path, lineno):
    """MATH / MATH-500 row: problem and answer, other fields (solution, level, ...) kept."""
    problem = _require(row, "problem", path, lineno)
    answer = _require(row, "answer", path, lineno)
    return {**row, "problem": problem, "answer": answer}


def parse_gsm8k_answer(answer_field):
    """Final answer of a GSM8K solution: the text after `####`, commas removed."""
    if "####" not in answer_field:
        return None
    return answer_field.rsplit("####", 1)[1].strip().replace(",", "")


def _gsm8k_row(row, path, lineno):
    """GSM8K row {question, answer: 'reasoning #### 42'} -> {problem, answer, solution}."""
    problem = _require(row, "question" if "question" in row else "problem", path, lineno)
    raw = _require(row, "answer", path, lineno)
    final = parse_gsm8k_answer(raw)
    if final is None:
        if "question" in row:
            raise ValueError(f"{path}, line {lineno}: GSM8K answer has no '####' final answer")
        final = raw.strip()  # already converted: {"problem", "answer"}
    solution = raw.rsplit("####", 1)[0].strip() if "####" in raw else row.get("solution", "")
    return {"problem": problem, "answer": final, "solution": solution}


def load_math500(path=None, cache_dir=None):
    """The MATH-500 test set (500 problems)."""
    return _load_rows("math500", path, cache_dir, _math_row)


def _with_local_copy(load, local_path, save_copy):
    """The book's loaders: read `local_path` if it is there, else load (downloading into the
    cache) and, with `save_copy`, write the rows to `local_path` as a JSON array."""
    local_path = Path(local_path)
    if local_path.exists():
        return load(path=local_path)
    rows = load()
    if save_copy:
        atomic_write_json(local_path, rows)
    return rows


def load_math500_test(local_path="math500_test.json", save_copy=True):
    """The book's MATH-500 loader (chapter 3): `local_path` if there, else downloaded (and saved
    there with `save_copy`)."""
    return _with_local_copy(load_math500, local_path, save_copy)


def load_math_train(path=None, cache_dir=None, local_path=None, save_copy=True):
    """The MATH training problems without the MATH-500 ones (12,000 problems).

    `local_path` is the book's form (chapter 6): that file if it is there, else downloaded and
    (with `save_copy`) saved there.
    """
    if local_path is not None:
        return _with_local_copy(partial(load_math_train, cache_dir=cache_dir), local_path,
                                save_copy)
    return _load_rows("math_train", path, cache_dir, _math_row)


def load_gsm8k(split="train", path=None, cache_dir=None):
    """GSM8K train (7,473) or test (1,319) problems; `answer` is the number after `####`."""
    if split not in ("train", "test"):
        raise ValueError(f"GSM8K split must be 'train' or 'test', got {split!r}")
    return _load_rows(f"gsm8k_{split}", path, cache_dir, _gsm8k_row)


ARITH_DEFAULT_SIZES = {"train": 10_000, "val": 500, "test": 500}


def load_arith(split="test", n=None, seed=None, level_weights=None):
    """`n` problems of the arithmetic world's fixed split (see `arithmetic.make_split`); levels
    1-5 drawn uniformly, or by `level_weights` (five numbers)."""

    if n is None:
        if split not in ARITH_DEFAULT_SIZES:
            raise ValueError(f"unknown arith split {split!r}; expected train, val or test")
        n = ARITH_DEFAULT_SIZES[split]
    return make_split(split, n, seed=seed, level_weights=level_weights)


DATASET_NAMES = ("math500", "math", "gsm8k", "arith")


def load_dataset_by_name(name, split=None, path=None, cache_dir=None, n=None, seed=None,
                         level_weights=None):
    """Load "math500" | "math" | "gsm8k" | "arith"; `n` keeps the first n examples.

    `level_weights` (arith only): the mix of difficulty levels 1-5 of the generated problems.
    """
    if level_weights is not None and (name != "arith" or path is not None):
        raise ValueError("level_weights applies to the generated arith dataset only")
    if name == "math500":
        if split not in (None, "test"):
            raise ValueError(f"math500 only has a 'test' split, got {split!r}")
        examples = load_math500(path=path, cache_dir=cache_dir)
    elif name in ("math", "math_train"):
        if split not in (None, "train"):
            raise ValueError(f"math only has a 'train' split, got {split!r}")
        examples = load_math_train(path=path, cache_dir=cache_dir)
    elif name == "gsm8k":
        examples = load_gsm8k(split or "test", path=path, cache_dir=cache_dir)
    elif name == "arith":
        if path is not None:
            examples = [_math_row(row, path, lineno) for lineno, row in read_records(path)]
        else:
            return load_arith(split or "test", n=n, seed=seed, level_weights=level_weights)
    else:
        raise ValueError(f"unknown dataset {name!r}; choose from {DATASET_NAMES}")
    if not examples:  # an empty file would "evaluate" to 0/0
        raise ValueError(f"{path or name}: the dataset holds no examples")
    if n is not None and n < 1:
        raise ValueError(f"n must be >= 1 (or None for all examples), got {n}")
    return examples if n is None else examples[:n]
