"""Batched evaluation of a model on math problems: generate, extract, grade, summarise.

Grading is strict (a `\\boxed{}` answer is required, no last-number fallback), so the accuracy
reported here equals the mean `reward_rlvr` the RL chapters train on.
"""

import json
import os
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

from .arithmetic import classify_carry_steps, parse_problem, parse_steps, verify_steps
from .distributed import gather_lists, shard
from .generation import generate_batch
from .grading import extract_final_candidate, grade_answer
from .prompts import render_prompt

# The held-out figures of every evaluation (evaluation.evaluate's summary keys); summary.json has
# base_<name> and final_<name> for each.
EVAL_FIGURES = ("accuracy", "format_rate", "think_accuracy", "step_correctness",
                "right_answer_wrong_step", "carry_step_correctness")


def has_think_format(text):
    """True if `<think>` ... `</think>` appear in order, before the last boxed answer (if any)."""
    start = text.find("<think>")
    if start == -1:
        return False
    end = text.find("</think>", start + len("<think>"))
    if end == -1:
        return False
    boxed = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    return boxed == -1 or boxed > end


def write_jsonl(records, path):
    """Write one JSON object per line, atomically (temp file in the same dir, then os.replace)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for record in records:
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def step_verdicts(problem, text):
    """Verifier verdicts of a completion's steps, a missing step counted as wrong; None if the
    problem is not an arithmetic chain (no step verifier exists for it).

    A completion that skips steps must not look better than one that writes them all, so the
    list has max(written steps, the problem's operations) entries.
    """
    try:
        n_ops = len(parse_problem(problem)[1])
    except ValueError:
        return None
    verdicts = verify_steps(problem, parse_steps(text))
    return verdicts + [False] * (n_ops - len(verdicts))


def reasoning_stats(records):
    """How well the think-format answers reason, judged by the exact step verifier.

    Returns think_accuracy (accuracy among think-format answers), step_correctness (fraction of
    verifier-correct steps over think-format answers of arithmetic problems),
    right_answer_wrong_step (among correct think-format answers, the fraction with a wrong or
    missing step) and carry_step_correctness (over the three-digit steps of think-format answers
    that have a carry to forget, the fraction written correctly; see
    `arithmetic.classify_carry_steps`). A figure is None when nothing counts towards it. Unlike
    the first three, the last does not change with the mix of levels that use the think format.
    """
    think = [r for r in records if has_think_format(r["generated_text"])]
    good = total = lucky = correct = 0
    carry_kinds = []
    for r in think:
        verdicts = step_verdicts(r["problem"], r["generated_text"])
        if verdicts is None:
            continue
        good, total = good + sum(verdicts), total + len(verdicts)
        carry_kinds += classify_carry_steps(r["problem"], parse_steps(r["generated_text"]))
        if r["correct"]:
            correct += 1
            lucky += not all(verdicts)
    return {
        "think_accuracy": sum(r["correct"] for r in think) / len(think) if think else None,
        "step_correctness": good / total if total else None,
        "right_answer_wrong_step": lucky / correct if correct else None,
        "carry_step_correctness": (carry_kinds.count("correct") / len(carry_kinds)
                                   if carry_kinds else None),
    }


def per_level_accuracy(records):
    """Accuracy per difficulty level {level: accuracy} of records that carry a level."""
    levels = sorted({r["level"] for r in records if r.get("level") is not None})
    out = {}
    for level in levels:
        rs = [r for r in records if r.get("level") == level]
        out[level] = sum(r["correct"] for r in rs) / len(rs)
    return out


def per_level_reasoning(records):
    """{level: figures} of records that carry a level: accuracy, think-format rate, the numbers
    of think-format answers and of their verified steps, and `reasoning_stats`, each over that
    level's records only.

    Comparing two policies level by level separates how well they reason from which problems
    they answer in the think format (a policy that uses it on harder levels too has a lower
    overall step correctness with the same steps at every level).
    """
    out = {}
    for level in sorted({r["level"] for r in records if r.get("level") is not None}):
        rs = [r for r in records if r.get("level") == level]
        think = [r for r in rs if has_think_format(r["generated_text"])]
        verdicts = [step_verdicts(r["problem"], r["generated_text"]) for r in think]
        out[level] = {"accuracy": sum(r["correct"] for r in rs) / len(rs),
                      "think_rate": len(think) / len(rs), "think_answers": len(think),
                      # the steps behind step_correctness (its weight in the overall figure)
                      "think_steps": sum(len(v) for v in verdicts if v is not None),
                      **reasoning_stats(rs)}
    return out


def summarize(records, generation_s, elapsed_s=None):
    """Summary numbers of per-example records; tokens/s counts generation time only.

    Besides accuracy and lengths: the think-format rate, `reasoning_stats` and, when the
    examples have difficulty levels, `per_level` accuracy.
    """
    n = len(records)
    total_tokens = sum(r["num_tokens"] for r in records)
    num_correct = sum(r["correct"] for r in records)
    num_think = sum(has_think_format(r["generated_text"]) for r in records)
    return {
        "accuracy": num_correct / n if n else 0.0,
        "num_correct": num_correct,
        "num_examples": n,
        "mean_length": total_tokens / n if n else 0.0,
        "tokens_per_s": total_tokens / generation_s if generation_s > 0 else 0.0,
        "format_rate": num_think / n if n else 0.0,
        "generation_s": generation_s,
        "elapsed_s": generation_s if elapsed_s is None else elapsed_s,
        **reasoning_stats(records),
        "per_level": per_level_accuracy(records),
    }


@torch.no_grad()
def evaluate(
    model,
    tokenizer,
    examples,
    device,
    max_new_tokens=512,
    batch_size=8,
    temperature=0.0,
    top_p=1.0,
    prompt_fn=render_prompt,
    jsonl_path=None,
    seed=123,
    progress=True,
    compile=False,
):
    """Generate an answer for every example and grade it; returns the summary dict.

    The summary holds accuracy, num_correct, num_examples, mean_length (generated tokens,
    EOS included), tokens_per_s (generated tokens per second of generation), format_rate, and
    `records`: one dict per example, in input order, with index, problem, ground_truth,
    generated_text, extracted_answer, correct, num_tokens and level (None if the example has
    none) (also written to `jsonl_path`). `compile`: decode with `generate`'s compiled step
    (the same answers; each batch shape compiles once).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    for i, ex in enumerate(examples):
        if "problem" not in ex or "answer" not in ex:
            raise ValueError(f"examples[{i}] needs 'problem' and 'answer' keys, has {sorted(ex)}")
    t_start = time.perf_counter()
    was_training = model.training
    model.eval()
    prompts = [prompt_fn(ex["problem"]) for ex in examples]
    # Longest prompts first: similar lengths share a batch (less padding), and an out-of-memory
    # error shows up in the first batch rather than hours in.
    order = sorted(range(len(prompts)), key=lambda i: -len(tokenizer.encode(prompts[i])))
    generator = None
    if temperature > 0:
        generator = torch.Generator(device=device).manual_seed(seed)

    records = [None] * len(examples)
    num_correct, num_done, gen_seconds = 0, 0, 0.0
    bar = tqdm(total=len(examples), desc="evaluate", disable=not progress)
    for start in range(0, len(order), batch_size):
        batch = order[start : start + batch_size]
        t0 = time.perf_counter()
        texts, _, completion_mask = generate_batch(
            model,
            tokenizer,
            [prompts[i] for i in batch],
            device,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            generator=generator,
            compile=compile,
        )
        gen_seconds += time.perf_counter() - t0
        lengths = completion_mask.sum(dim=1).tolist()  # (B,) real tokens incl. EOS
        for i, text, num_tokens in zip(batch, texts, lengths):
            extracted = extract_final_candidate(text, fallback="none")
            correct = bool(extracted) and grade_answer(extracted, examples[i]["answer"])
            num_correct += correct
            records[i] = {
                "index": i,
                "problem": examples[i]["problem"],
                "ground_truth": examples[i]["answer"],
                "generated_text": text,
                "extracted_answer": extracted,
                "correct": correct,
                "num_tokens": int(num_tokens),
                "level": examples[i].get("level"),
            }
        num_done += len(batch)
        bar.update(len(batch))
        bar.set_postfix(acc=f"{num_correct / num_done:.3f}")
    bar.close()
    if was_training:
        model.train()

    summary = summarize(records, gen_seconds, time.perf_counter() - t_start)
    summary["records"] = records
    if jsonl_path is not None:
        write_jsonl(records, jsonl_path)
    return summary


def problem_outcomes(records) -> dict[str, list[int]]:
    """Per-problem results, in the records' order, for intervals that resample problems:
    `correct` (0/1) and, over think-format answers of arithmetic problems, `steps_good` and
    `steps_total` (verifier-correct and all steps, a missing step counted as wrong; 0 and 0
    for the other answers), so a resample's step correctness is sum(good) / sum(total)."""
    out = {"correct": [], "steps_good": [], "steps_total": []}
    for r in records:
        verdicts = (step_verdicts(r["problem"], r["generated_text"])
                    if has_think_format(r["generated_text"]) else None) or []
        out["correct"].append(int(bool(r["correct"])))
        out["steps_good"].append(int(sum(verdicts)))
        out["steps_total"].append(len(verdicts))
    return out


def evaluate_policy(model, tokenizer, examples, device, max_new_tokens: int,
                    batch_size: int = 50, prompt_fn=render_prompt, compile: bool = False,
                    per_problem: bool = False) -> dict:
    """Greedy held-out figures (`EVAL_FIGURES`) and accuracy per level, as a training run logs
    them (GRPO, distillation); with `per_problem`, also `problem_outcomes` under "per_problem".

    Data-parallel runs: every process answers a contiguous share of `examples` and the answers
    are gathered (in the examples' order) before the figures are computed, on every process.
    """
    res = evaluate(model, tokenizer, shard(examples), device, max_new_tokens=max_new_tokens,
                   batch_size=batch_size, prompt_fn=prompt_fn, progress=False, compile=compile)
    records = gather_lists(res["records"])
    figures = summarize(records, res["generation_s"])
    # str keys: the same dict before and after a JSON round trip (checkpoints, summary.json)
    out = {**{k: figures[k] for k in EVAL_FIGURES},
           "per_level": {str(k): v for k, v in figures["per_level"].items()}}
    if per_problem:
        out["per_problem"] = problem_outcomes(records)
    return out
