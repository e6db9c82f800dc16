"""Distillation data (chapter 9): a teacher's solutions, kept only where a verifier accepts them.

DeepSeek-R1 (Guo et al. 2025, section 2.4 and 4.1) made its small models by supervised fine-tuning
on 800k samples from the big reasoning model, keeping only the correct ones ("rejection
sampling": sample several solutions per problem, verify, keep what passes), and found this beat
running RL on the small models themselves. This module is the data half of that recipe:

- `generate_distillation_data` samples `num_samples` teacher solutions per problem (one batched
  decoding loop per group of prompts, each prompt prefilled once), keeps the verified ones
  (`verify_trace`: a boxed answer equal to the reference, a finished completion, and optionally
  every arithmetic step right) and returns them as trace records;
- with `partial_path`, each finished batch of samples is appended to a JSONL file with the
  sampling generator's state after it, so sampling stopped by a signal (or killed) continues
  after its last whole batch and ends with the records an uninterrupted call returns;
- `write_traces` / `read_traces` store traces as JSONL, one record per line with the problem,
  the reference answer, the completion and the teacher and sampling settings; `read_traces` also
  reads traces produced elsewhere (say, another model's solutions to MATH problems), naming the
  file and line of a malformed record;
- `traces_to_documents` turns traces into the prompt/completion documents of `sft.train_sft`.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
from pathlib import Path

import torch
from tqdm import tqdm

from .datasets import read_records
from .evaluation import step_verdicts
from .files import atomic_write_text
from .generation import sample_rollouts_batch
from .grading import extract_final_candidate, grade_answer
from .interrupts import defer_interrupts
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
    partial_path=None,
) -> tuple[list[dict], dict]:
    """Rejection sampling: (verified trace records, statistics) from `num_samples` teacher
    samples per example, at most `max_per_problem` distinct traces kept per problem.

    A truncated completion (no EOS within `max_new_tokens`) is never kept, even if it holds a
    boxed answer: the student would learn to stop mid-sentence. Statistics: problems, samples,
    verified (samples that passed), kept, problems_covered, generated_tokens, seconds.

    `partial_path`: a JSONL file that receives every finished batch (`SampledBatches`); a call
    that finds one written with the same settings continues after its last whole batch, from the
    generator state saved with it, so a stopped sampling loses at most one batch and ends with
    the same records as one that was never stopped.
    """
    if num_samples < 1 or max_per_problem < 1 or prompts_per_batch < 1:
        raise ValueError("num_samples, max_per_problem and prompts_per_batch must be >= 1")
    device = teacher.device
    generator = torch.Generator(device=device).manual_seed(seed)
    settings = {"teacher": teacher_name, "temperature": temperature, "top_p": top_p,
                "max_new_tokens": max_new_tokens, "seed": seed, "check_steps": check_steps}
    done = SampledBatches(partial_path, {
        **settings, "problems": len(examples), "problems_sha256": hashlib.sha256(
            json.dumps([ex["problem"] for ex in examples]).encode()).hexdigest(),
        "num_samples": num_samples,
        "max_per_problem": max_per_problem, "prompts_per_batch": prompts_per_batch})
    if done.generator_state is not None:
        generator.set_state(done.generator_state)
    teacher.eval()
    starts = range(done.next_start, len(examples), prompts_per_batch)
    for start in tqdm(starts, desc="teacher samples", disable=not progress):
        t0 = time.time()
        batch = examples[start : start + prompts_per_batch]
        groups = sample_rollouts_batch(
            teacher, tokenizer, [prompt_fn(ex["problem"]) for ex in batch], num_samples, device,
            max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
            generator=generator,
        )
        records, verified, tokens = [], 0, 0
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
        done.add(start, records, verified, tokens, time.time() - t0, generator.get_state())
    stats = {
        "problems": len(examples), "samples": len(examples) * num_samples,
        "verified": done.verified, "kept": len(done.records),
        "problems_covered": len({r["problem"] for r in done.records}),
        "generated_tokens": done.tokens, "seconds": done.seconds,
    }
    return done.records, stats


class SampledBatches:
    """The finished batches of one rejection-sampling call, kept in memory and, given a path,
    appended to a JSONL file as they finish, so a stopped call can continue.

    The file's first line holds the sampling settings (`header`); each further line one batch:
    its first problem's index `start`, its kept records, its verified and generated-token
    counts, its seconds, and the sampling generator's state after it (base64). A line is
    appended whole (flushed and synced, a stop signal deferred until it is written); a process
    killed mid-write leaves a torn last line, which is dropped when the file is read again.
    """

    def __init__(self, path, header: dict):
        self.path = None if path is None else Path(path)
        self.records, self.verified, self.tokens, self.seconds = [], 0, 0, 0.0
        self.next_start, self.generator_state = 0, None
        lines = self._read(header) if self.path is not None and self.path.is_file() else []
        for batch in lines:
            self._count(batch)
        if lines:
            self.next_start = lines[-1]["start"] + header["prompts_per_batch"]
            self.generator_state = torch.tensor(
                bytearray(base64.b64decode(lines[-1]["generator"])), dtype=torch.uint8)
        if self.path is not None:  # rewritten without a torn line, so appends stay whole
            atomic_write_text(self.path, "".join(json.dumps(x, ensure_ascii=False) + "\n"
                                                 for x in [{"header": header}, *lines]))

    def _read(self, header) -> list[dict]:
        """The batch lines of an existing file; ValueError if its settings differ or a line
        other than the last is malformed."""
        text = self.path.read_text(encoding="utf-8").splitlines()
        rows = []
        for lineno, line in enumerate(text, 1):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                if lineno == len(text):
                    break  # torn by a kill during its write: that batch is sampled again
                raise ValueError(f"{self.path}, line {lineno}: not JSON; remove the file to "
                                 "sample from the start") from None
        saved = rows[0].get("header") if rows and isinstance(rows[0], dict) else None
        if saved != header:
            raise ValueError(f"{self.path} was written with other sampling settings "
                             f"({saved} vs {header}); remove it to sample from the start")
        return rows[1:]

    def _count(self, batch):
        """Add one batch's records and counts to the totals."""
        self.records += batch["records"]
        self.verified += batch["verified"]
        self.tokens += batch["tokens"]
        self.seconds += batch["seconds"]

    def add(self, start, records, verified, tokens, seconds, generator_state):
        """One finished batch: into the totals and, with a path, appended to the file."""
        batch = {"start": start, "records": records, "verified": verified, "tokens": tokens,
                 "seconds": seconds}
        self._count(batch)
        if self.path is None:
            return
        batch["generator"] = base64.b64encode(generator_state.numpy().tobytes()).decode()
        with defer_interrupts(), open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(batch, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())


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
