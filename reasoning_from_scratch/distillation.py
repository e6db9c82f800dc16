"""Distillation data (chapter 9): a teacher's solutions, kept only where a verifier accepts them.

DeepSeek-R1 (Guo et al. 2025, section 2.4 and 4.1) made its small models by supervised fine-tuning
on 800k samples from the big reasoning model, keeping only the correct ones ("rejection
sampling": sample several solutions per problem, verify, keep what passes), and found this beat
running RL on the small models themselves. This module is the data half of that recipe:

- `generate_distillation_data` samples `num_samples` teacher solutions per problem (one batched
  decoding loop per group of prompts, each prompt prefilled once), keeps the verified ones
  (`verify_trace`: a boxed answer equal to the reference, a finished completion, and optionally
  every arithmetic step right) and returns them as trace records;
- `write_traces` / `read_traces` store traces as JSONL, one record per line with the problem,
  the reference answer, the completion and the teacher and sampling settings; `read_traces` also
  reads traces produced elsewhere (say, another model's solutions to MATH problems), naming the
  file and line of a malformed record;
- `traces_to_documents` turns traces into the prompt/completion documents of `sft.train_sft`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from tqdm import tqdm

from .datasets import read_records
from .evaluation import step_verdicts
from .files import atomic_write_text
from .generation import sample_rollouts_batch
from .grading import extract_final_candidate, grade_answer
from .prompts import render_prompt

# Field names accepted for a trace's parts, first the project's own (others' files differ).
PROBLEM_KEYS = ("problem", "question")
COMPLETION_KEYS = ("completion", "response", "generation", "output")
ANSWER_KEYS = ("answer", "ground_truth", "reference")


def verify_trace(problem: str, answer: str, completion: str, check_steps: bool = False) -> bool:
    """True if the completion's boxed answer grades equal to `answer` (and, with `check_steps`,
    the verifier accepts every arithmetic step; problems without a step verifier, such as MATH,
    are judged by the answer alone)."""
    extracted = extract_final_candidate(completion, fallback="none")  # strict: the RL reward's rule
    if not extracted or not grade_answer(extracted, answer):
        return False
    if check_steps:
        verdicts = step_verdicts(problem, completion)
        if verdicts is not None and not all(verdicts):
            return False
    return True


@torch.no_grad()
def generate_distillation_data(
    teacher,
    tokenizer,
    examples,
    num_samples: int = 4,
    max_per_problem: int = 1,
    temperature: float = 1.0,
    top_p: float = 1.0,
    max_new_tokens: int = 112,
    prompts_per_batch: int = 32,
    check_steps: bool = False,
    seed: int = 0,
    teacher_name: str | None = None,
    prompt_fn=render_prompt,
    progress: bool = True,
) -> tuple[list[dict], dict]:
    """Rejection sampling: (verified trace records, statistics) from `num_samples` teacher
    samples per example, at most `max_per_problem` distinct traces kept per problem.

    A truncated completion (no EOS within `max_new_tokens`) is never kept, even if it holds a
    boxed answer: the student would learn to stop mid-sentence. Statistics: problems, samples,
    verified (samples that passed), kept, problems_covered, generated_tokens, seconds.
    """
    if num_samples < 1 or max_per_problem < 1 or prompts_per_batch < 1:
        raise ValueError("num_samples, max_per_problem and prompts_per_batch must be >= 1")
    device = teacher.device
    generator = torch.Generator(device=device).manual_seed(seed)
    settings = {"teacher": teacher_name, "temperature": temperature, "top_p": top_p,
                "max_new_tokens": max_new_tokens, "seed": seed, "check_steps": check_steps}
    records, verified, tokens = [], 0, 0
    t0 = time.time()
    teacher.eval()
    for start in tqdm(range(0, len(examples), prompts_per_batch), desc="teacher samples",
                      disable=not progress):
        batch = examples[start : start + prompts_per_batch]
        groups = sample_rollouts_batch(
            teacher, tokenizer, [prompt_fn(ex["problem"]) for ex in batch], num_samples, device,
            max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
            generator=generator,
        )
        for ex, group in zip(batch, groups):
            tokens += int(group.lengths.sum())
            kept = []
            for j, (text, truncated) in enumerate(zip(group.texts, group.truncated.tolist())):
                ok = not truncated and verify_trace(ex["problem"], ex["answer"], text,
                                                    check_steps)
                verified += ok
                if ok and text not in kept and len(kept) < max_per_problem:
                    kept.append(text)
                    records.append({"problem": ex["problem"], "answer": ex["answer"],
                                    "completion": text, "level": ex.get("level"),
                                    "sample": j, **settings})
    stats = {
        "problems": len(examples), "samples": len(examples) * num_samples, "verified": verified,
        "kept": len(records), "problems_covered": len({r["problem"] for r in records}),
        "generated_tokens": tokens, "seconds": time.time() - t0,
    }
    return records, stats


def filter_traces(records, check_steps: bool = False) -> list[dict]:
    """The records whose completion passes `verify_trace` (for traces made elsewhere)."""
    return [r for r in records
            if verify_trace(r["problem"], r["answer"], r["completion"], check_steps)]


# ----------------------------------------------------------------------------------------------
# JSONL files
# ----------------------------------------------------------------------------------------------


def write_traces(records, path) -> Path:
    """Write trace records as JSONL (one JSON object per line), atomically."""
    path = Path(path)
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    return path


def _field(row, keys, path, lineno, required=True):
    """The first of `keys` present in `row` as a non-empty string; ValueError names file:line."""
    for key in keys:
        value = row.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = str(value)  # numeric answers such as 42
        if isinstance(value, str) and value.strip():
            return value
        if value is not None and not isinstance(value, str):
            raise ValueError(f"{path}, line {lineno}: field {key!r} must be a string, got "
                             f"{type(value).__name__}")
    if required:
        raise ValueError(f"{path}, line {lineno}: record has none of the fields "
                         f"{', '.join(map(repr, keys))}")
    return None


def read_traces(path, require_answer: bool = True) -> list[dict]:
    """Trace records from a JSONL file (or JSON array), ours or another provider's.

    Each record needs a problem ('problem' or 'question'), a completion ('completion',
    'response', 'generation' or 'output') and, unless `require_answer` is False, a reference
    answer ('answer', 'ground_truth' or 'reference'); other fields are kept. A malformed line
    raises ValueError naming the file and line.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such trace file (write one with "
                                "chapters/ch09_distill.py, or pass a JSONL of your own)")
    records = []
    for lineno, row in read_records(path):
        if not isinstance(row, dict):
            raise ValueError(f"{path}, line {lineno}: expected a JSON object, got "
                             f"{type(row).__name__}")
        records.append({
            **row,
            "problem": _field(row, PROBLEM_KEYS, path, lineno),
            "completion": _field(row, COMPLETION_KEYS, path, lineno),
            "answer": _field(row, ANSWER_KEYS, path, lineno, required=require_answer),
        })
    if not records:
        raise ValueError(f"{path}: the file holds no traces")
    return records


def traces_to_documents(records, prompt_fn=render_prompt) -> list[dict]:
    """SFT documents ({"prompt", "completion"}) of trace records: the student sees the problem
    in the same prompt template as at evaluation time, and learns the teacher's completion."""
    return [{"prompt": prompt_fn(r["problem"]), "completion": r["completion"]} for r in records]
