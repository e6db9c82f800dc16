"""The chapter 5 measurement: accuracy against generated tokens for every inference-time method.

For one model and a held-out set, `run_scaling_experiment`:

1. decodes the greedy answers (the N = 1 reference and the drafts of self-refinement);
2. samples N_max completions per problem once (all problems of a batch decoded together, one
   prefill per problem) and evaluates every sampling method at each N by taking the first N
   samples: self-consistency, best-of-N by confidence, by the blind step verifier and by a
   learned PRM (min / prod / last step), PRM-weighted voting, and the oracle pass@N
   (`pass_at_k`, the unbiased estimate from all N_max samples). Taking prefixes is legitimate
   here: each sample and its score are independent of the others. Seconds are the sampling time
   of the samples used (the batch's time shared by tokens) plus their scoring time;
3. runs step-level beam search (one run per N: the search is not prefix-consistent);
4. runs self-refinement once with the largest round limit and reads every smaller limit off its
   history (the rounds before the limit are exactly what a run with that limit does).

`scaling_table` writes the table of docs/inference_scaling.md and `plot_inference_scaling` the
figure (one panel per model, accuracy vs generated tokens per problem, greedy and pass@N as
reference lines).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from ..arithmetic import parse_problem
from ..files import atomic_path
from ..generation import generate_batch, sample_rollouts_batch
from ..grading import grade_answer
from ..inference_scaling import (
    AGGREGATES,
    BlindVerifierScorer,
    ConfidenceStepScorer,
    StepAggregateScorer,
    aggregate_step_scores,
    extract_answers,
    majority_vote,
    mean_logprobs,
    pass_at_k,
    select_best,
    weighted_majority_vote,
)
from ..prm import PRMStepScorer
from ..prompts import render_prompt
from ..search import StepScoreCritic, run_refinement, step_beam_search

SAMPLING_METHODS = ("majority", "logprob", "verifier", "prm", "prm-vote")
SEARCH_METHODS = ("beam-prm", "beam-verifier", "refine-verifier", "refine-prm", "refine-self")
METHODS = SAMPLING_METHODS + SEARCH_METHODS
COLORS = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown",
          "tab:pink", "tab:olive", "tab:cyan", "navy", "darkgoldenrod", "teal", "crimson"]
LABELS = {
    "greedy": "greedy",
    "pass@N": "pass@N (oracle)",
    "majority": "self-consistency (majority vote)",
    "logprob": "best-of-N, mean log-prob",
    "verifier": "best-of-N, step verifier",
    "prm-min": "best-of-N, PRM min",
    "prm-prod": "best-of-N, PRM product",
    "prm-last": "best-of-N, PRM last step",
    "prm-vote": "PRM-weighted vote",
    "beam-prm": "beam search, PRM",
    "beam-verifier": "beam search, step verifier",
    "refine-verifier": "self-refinement, verifier critic",
    "refine-prm": "self-refinement, PRM critic",
    "refine-self": "self-refinement, self critic",
}


def _correct(answer: str | None, example: dict) -> bool:
    """Strict correctness of a selected final answer."""
    return answer is not None and grade_answer(answer, example["answer"])


def is_arithmetic(examples: Sequence[dict]) -> bool:
    """True when every problem is an arithmetic chain (the step verifier applies)."""
    try:
        for ex in examples:
            parse_problem(ex["problem"])
    except ValueError:
        return False
    return True


def beam_shape(n: int, expansions: int = 4) -> tuple[int, int]:
    """(beam_width, expansions) with width * expansions = n candidates per step."""
    k = min(expansions, n)
    if n % k:
        raise ValueError(f"N = {n} is not a multiple of {k} expansions")
    return n // k, k


# ----------------------------------------------------------------------------------------------
# Sampling once, scoring once
# ----------------------------------------------------------------------------------------------


def greedy_answers(model, tokenizer, prompts, device, max_new_tokens, batch_size=64) -> dict:
    """Greedy completions of all prompts, their tokens and the decoding seconds."""
    texts, tokens = [], []
    start = time.perf_counter()
    for b in range(0, len(prompts), batch_size):
        chunk, _, mask = generate_batch(model, tokenizer, list(prompts[b:b + batch_size]),
                                        device, max_new_tokens)
        texts += chunk
        tokens += mask.sum(dim=1).tolist()
    return {"texts": texts, "tokens": tokens, "seconds": time.perf_counter() - start}


def sample_pool(model, tokenizer, prompts, device, num_samples, max_new_tokens,
                temperature=1.0, top_p=1.0, top_k=None, generator=None,
                batch_size=16, log: Callable = print) -> list[dict]:
    """`num_samples` completions of every prompt, `batch_size` prompts decoded as one batch.

    Per prompt: texts, tokens (generated, EOS included), mean log-prob (the sampler's record)
    and seconds (its batch's decoding time, shared among the batch's completions by tokens).
    """
    pool = []
    for b in range(0, len(prompts), batch_size):
        start = time.perf_counter()
        groups = sample_rollouts_batch(model, tokenizer, list(prompts[b:b + batch_size]),
                                       num_samples, device, max_new_tokens=max_new_tokens,
                                       temperature=temperature, top_p=top_p, top_k=top_k,
                                       generator=generator, return_logprobs=True)
        seconds = time.perf_counter() - start
        total = max(1, sum(int(ro.lengths.sum()) for ro in groups))
        for ro in groups:
            lengths = ro.lengths.tolist()
            pool.append({"texts": ro.texts, "tokens": lengths, "logprob": mean_logprobs(ro),
                         "seconds": [seconds * n / total for n in lengths]})
        log(f"  sampled {min(b + batch_size, len(prompts))}/{len(prompts)} problems "
            f"x {num_samples} ({seconds:.1f} s)")
    return pool


def score_pool(pool, prompts, examples, scorer: StepAggregateScorer) -> tuple[list, float]:
    """Step scores of every sampled completion ([problem][sample][step]) and the seconds."""
    start = time.perf_counter()
    scores = scorer.step_scores(prompts, [p["texts"] for p in pool], examples)
    return scores, time.perf_counter() - start


def _prefix_rows(method, ns, pool, examples, choose, extra_seconds=None) -> list[dict]:
    """Accuracy, tokens and seconds at each N of a method that picks from the first N samples.

    `choose(problem index, n) -> selected answer`; `extra_seconds[i][j]`: scoring time of
    sample j of problem i.
    """
    rows = []
    for n in ns:
        correct = tokens = seconds = 0.0
        for i, (p, ex) in enumerate(zip(pool, examples)):
            correct += _correct(choose(i, n), ex)
            tokens += sum(p["tokens"][:n])
            seconds += sum(p["seconds"][:n])
            if extra_seconds is not None:
                seconds += sum(extra_seconds[i][:n])
        rows.append({"method": method, "n": n, "accuracy": correct / len(pool),
                     "tokens": tokens / len(pool), "seconds": seconds})
    return rows


def sampling_rows(pool, examples, ns, verifier_scores=None, prm_scores=None,
                  verifier_seconds=0.0, prm_seconds=0.0, methods=SAMPLING_METHODS,
                  vote_aggregate="min") -> list[dict]:
    """Rows of every sampling method (and pass@N) at every N, from one pool of samples.

    `verifier_scores` / `prm_scores`: step scores [problem][sample][step] (None: skipped);
    their seconds are shared evenly among the scored completions.
    """
    answers = [extract_answers(p["texts"]) for p in pool]
    per = [len(p["texts"]) for p in pool]

    def share(total):
        count = sum(per)
        return [[total / count] * k for k in per]

    def best_by(scores):
        return lambda i, n: answers[i][select_best(scores[i][:n])]

    def aggregated(step_scores, how):
        # a completion with no boxed answer ranks below every scored one (as in best_of_n)
        return [[-1.0 if a is None else aggregate_step_scores(s, how)
                 for a, s in zip(ans, group)] for ans, group in zip(answers, step_scores)]

    rows = []
    n_max = min(per)
    c = [sum(_correct(a, ex) for a in ans) for ans, ex in zip(answers, examples)]
    for n in ns:  # the oracle: unbiased pass@N from all samples
        acc = sum(pass_at_k(n_max, ci, n) for ci in c) / len(pool)
        rows += [{**r, "accuracy": acc} for r in _prefix_rows("pass@N", [n], pool, examples,
                                                               lambda i, n: None)]
    if "majority" in methods:
        rows += _prefix_rows("majority", ns, pool, examples,
                             lambda i, n: majority_vote(answers[i][:n])[0])
    if "logprob" in methods:
        scores = [[-1e9 if a is None else s for a, s in zip(ans, p["logprob"])]
                  for ans, p in zip(answers, pool)]
        rows += _prefix_rows("logprob", ns, pool, examples, best_by(scores))
    if "verifier" in methods and verifier_scores is not None:
        rows += _prefix_rows("verifier", ns, pool, examples,
                             best_by(aggregated(verifier_scores, "min")),
                             share(verifier_seconds))
    if prm_scores is not None:
        if "prm" in methods:
            for how in AGGREGATES:
                rows += _prefix_rows(f"prm-{how}", ns, pool, examples,
                                     best_by(aggregated(prm_scores, how)), share(prm_seconds))
        if "prm-vote" in methods:
            weights = aggregated(prm_scores, vote_aggregate)
            rows += _prefix_rows(
                "prm-vote", ns, pool, examples,
                lambda i, n: weighted_majority_vote(answers[i][:n], weights[i][:n])[0],
                share(prm_seconds))
    return rows


# ----------------------------------------------------------------------------------------------
# Search methods
# ----------------------------------------------------------------------------------------------


def beam_rows(method, model, tokenizer, prompts, examples, device, step_scorer, ns,
              aggregate="last", max_new_tokens=112, temperature=1.0, top_p=1.0, seed=0,
              expansions=4, batch_size=32, log: Callable = print) -> list[dict]:
    """Step-level beam search at each N (= beam width x expansions), one timed run per N."""
    rows = []
    for n in ns:
        width, k = beam_shape(n, expansions)
        generator = torch.Generator().manual_seed(seed)
        start = time.perf_counter()
        results = []
        for b in range(0, len(prompts), batch_size):
            results += step_beam_search(
                model, tokenizer, prompts[b:b + batch_size], device, step_scorer,
                [{"problem": ex["problem"]} for ex in examples[b:b + batch_size]], width, k,
                aggregate, max_new_tokens, temperature=temperature, top_p=top_p,
                generator=generator)
        seconds = time.perf_counter() - start
        acc = sum(_correct(r["final_answer"], ex) for r, ex in zip(results, examples))
        tokens = sum(r["num_generated_tokens"] for r in results)
        rows.append({"method": method, "n": n, "accuracy": acc / len(prompts),
                     "tokens": tokens / len(prompts), "seconds": seconds})
        log(f"  {method} N={n} (width {width} x {k}): accuracy {acc / len(prompts):.3f}, "
            f"{tokens / len(prompts):.0f} tokens/problem, {seconds:.0f} s")
    return rows


class _Timed:
    """Wraps a function and records the wall time of each call."""

    def __init__(self, fn):
        self.fn, self.seconds = fn, []

    def __call__(self, *args):
        start = time.perf_counter()
        out = self.fn(*args)
        self.seconds.append(time.perf_counter() - start)
        return out


def refinement_rows(method, model, tokenizer, prompts, examples, device, critic, ns, greedy,
                    max_new_tokens=112, temperature=1.0, top_p=1.0, seed=0, batch_size=64,
                    log: Callable = print) -> list[dict]:
    """Self-refinement from the greedy drafts with round limits `ns`, from one run of max(ns).

    The answer and tokens at limit R are those after round min(R, rounds done); seconds are the
    greedy drafts' plus the first R rounds' critique and resampling time (a run with limit R
    does exactly those rounds).
    """
    generator = torch.Generator().manual_seed(seed)

    def resample(texts):
        out_texts, out_tokens = [], []
        for b in range(0, len(texts), batch_size):
            chunk, _, mask = generate_batch(model, tokenizer, texts[b:b + batch_size], device,
                                            max_new_tokens, temperature=temperature,
                                            top_p=top_p, generator=generator)
            out_texts += chunk
            out_tokens += mask.sum(dim=1).tolist()
        return out_texts, out_tokens

    timed_critic, timed_resample = _Timed(critic), _Timed(resample)
    results = run_refinement(prompts, greedy["texts"], timed_critic, timed_resample,
                             [{"problem": ex["problem"]} for ex in examples], max(ns),
                             draft_tokens=greedy["tokens"])
    rounds = [c + r for c, r in zip(timed_critic.seconds, timed_resample.seconds)]
    rounds += timed_critic.seconds[len(rounds):]  # a last round where every critique accepted
    rows = []
    for n in ns:
        correct = tokens = 0.0
        for r, ex in zip(results, examples):
            answer, used, _ = r["history"][min(n, len(r["history"]) - 1)]
            correct += _correct(answer, ex)
            tokens += used
        rows.append({"method": method, "n": n, "accuracy": correct / len(prompts),
                     "tokens": tokens / len(prompts),
                     "seconds": greedy["seconds"] + sum(rounds[:n])})
    stops = {}
    for r in results:
        stops[r["stop_reason"]] = stops.get(r["stop_reason"], 0) + 1
    log(f"  {method}: accuracy {rows[-1]['accuracy']:.3f} at {max(ns)} rounds; stops {stops}")
    return rows


# ----------------------------------------------------------------------------------------------
# One model, all methods
# ----------------------------------------------------------------------------------------------


def run_scaling_experiment(model, tokenizer, examples, device, ns=(1, 2, 4, 8, 16, 32),
                           methods=METHODS, prm=None, beam_ns=(4, 8, 16), max_new_tokens=112,
                           temperature=1.0, top_p=1.0, seed=0, batch_size=16,
                           self_threshold=0.3, prompt_fn=render_prompt,
                           log: Callable = print) -> dict:
    """Every method at every N on `examples` for one model; returns {"rows", "greedy", ...}.

    `prm`: (ProcessRewardModel, tokenizer) or None (PRM methods skipped). The blind step
    verifier's methods run only on arithmetic problems. Sampling is at `temperature` / `top_p`
    (1.0 / 1.0: the model's own distribution, so mean log-probs are the model's).
    """
    unknown = set(methods) - set(METHODS)
    if unknown:
        raise ValueError(f"unknown methods {sorted(unknown)}; expected some of {METHODS}")
    arithmetic = is_arithmetic(examples)
    prompts = [prompt_fn(ex["problem"]) for ex in examples]
    seen = [{"problem": ex["problem"]} for ex in examples]  # what scorers may read: no answer
    prm_scorer = PRMStepScorer(*prm) if prm is not None else None
    verifier = BlindVerifierScorer() if arithmetic else None
    t0 = time.perf_counter()

    greedy = greedy_answers(model, tokenizer, prompts, device, max_new_tokens)
    g_answers = extract_answers(greedy["texts"])
    greedy_row = {"method": "greedy", "n": 1,
                  "accuracy": sum(_correct(a, ex) for a, ex in zip(g_answers, examples))
                  / len(examples),
                  "tokens": sum(greedy["tokens"]) / len(examples), "seconds": greedy["seconds"]}
    log(f"  greedy: accuracy {greedy_row['accuracy']:.3f}")

    generator = torch.Generator().manual_seed(seed)
    pool = sample_pool(model, tokenizer, prompts, device, max(ns), max_new_tokens, temperature,
                       top_p, None, generator, batch_size, log)
    v_scores = v_seconds = p_scores = p_seconds = None
    if verifier is not None and "verifier" in methods:
        v_scores, v_seconds = score_pool(pool, prompts, seen, StepAggregateScorer(verifier))
    if prm_scorer is not None and ({"prm", "prm-vote"} & set(methods)):
        p_scores, p_seconds = score_pool(pool, prompts, seen, StepAggregateScorer(prm_scorer))
        log(f"  PRM scored {sum(len(p['texts']) for p in pool)} completions ({p_seconds:.0f} s)")
    rows = sampling_rows(pool, examples, ns, v_scores, p_scores, v_seconds or 0.0,
                         p_seconds or 0.0, methods)

    beam = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
                log=log)
    if "beam-prm" in methods and prm_scorer is not None:
        rows += beam_rows("beam-prm", model, tokenizer, prompts, examples, device, prm_scorer,
                          beam_ns, "last", **beam)
    if "beam-verifier" in methods and verifier is not None:
        rows += beam_rows("beam-verifier", model, tokenizer, prompts, examples, device,
                          verifier, beam_ns, "min", **beam)
    critics = {"refine-verifier": verifier, "refine-prm": prm_scorer,
               "refine-self": ConfidenceStepScorer(model, tokenizer)}
    thresholds = {"refine-self": self_threshold}
    for method, scorer in critics.items():
        if method in methods and scorer is not None:
            critic = StepScoreCritic(scorer, thresholds.get(method, 0.5))
            rows += refinement_rows(method, model, tokenizer, prompts, examples, device, critic,
                                    ns, greedy, **beam)
    return {"rows": rows, "greedy": greedy_row, "num_examples": len(examples),
            "seconds": time.perf_counter() - t0}


# ----------------------------------------------------------------------------------------------
# Table and figure
# ----------------------------------------------------------------------------------------------


def _method_order(results: dict) -> list[str]:
    """Methods in the order of LABELS, then any others, as they appear in the results."""
    present = [r["method"] for res in results.values() for r in res["rows"]]
    return [m for m in LABELS if m in present and m != "greedy"] + sorted(
        set(present) - set(LABELS))


def scaling_table(results: dict, path=None) -> str:
    """Markdown table: method, N, then accuracy / tokens per problem / seconds per model.

    `results`: {model label: `run_scaling_experiment` output}. Written to `path` if given.
    """
    labels = list(results)
    head = "| method | N | " + " | ".join(
        f"{m} accuracy | {m} tokens | {m} s" for m in labels) + " |"
    lines = [head, "|---|---|" + "---|---|---|" * len(labels)]

    def cells(row):
        if row is None:
            return " | |"
        return f" {row['accuracy']:.3f} | {row['tokens']:.0f} | {row['seconds']:.1f}"

    lines.append("| greedy | 1 |" + " |".join(cells(results[m]["greedy"]) for m in labels)
                 + " |")
    for method in _method_order(results):
        ns = sorted({r["n"] for m in labels for r in results[m]["rows"]
                     if r["method"] == method})
        for n in ns:
            found = [next((r for r in results[m]["rows"] if r["method"] == method
                           and r["n"] == n), None) for m in labels]
            lines.append(f"| {LABELS.get(method, method)} | {n} |"
                         + " |".join(cells(r) for r in found) + " |")
    table = "\n".join(lines) + "\n"
    if path is not None:
        with atomic_path(path) as tmp:
            tmp.write_text(table)
    return table


PANELS = (("sample N, pick one", ("majority", "logprob", "verifier", "prm-min", "prm-prod",
                                   "prm-last", "prm-vote")),
          ("search and refine", ("beam-prm", "beam-verifier", "refine-verifier", "refine-prm",
                                 "refine-self")))


def plot_inference_scaling(results: dict, path, title: str | None = None):
    """Accuracy vs generated tokens per problem (log scale): a column per model, a row per
    family of methods (sample-and-pick, search-and-refine); greedy (star, dotted level) and the
    oracle pass@N (dashed) on every panel as the reference lines."""
    labels = list(results)
    fig = Figure(figsize=(6.8 * len(labels) + 2.6, 9.5))
    FigureCanvasAgg(fig)  # drawn without pyplot: leaves a notebook's backend alone
    axes = fig.subplots(len(PANELS), len(labels), squeeze=False, sharey=True)
    colors = {m: COLORS[k % len(COLORS)] for k, m in enumerate(m for _, ms in PANELS for m in ms)}
    for col, label in enumerate(labels):
        res = results[label]
        for row, (family, methods) in enumerate(PANELS):
            ax = axes[row][col]
            for method in ("pass@N", *methods):
                rows = sorted((r for r in res["rows"] if r["method"] == method),
                              key=lambda r: r["n"])
                if not rows:
                    continue
                style = (dict(color="black", linestyle="--") if method == "pass@N" else
                         dict(color=colors[method],
                              linestyle=":" if method.startswith("refine") else "-"))
                ax.plot([r["tokens"] for r in rows], [r["accuracy"] for r in rows], marker="o",
                        markersize=3.5, label=LABELS.get(method, method), **style)
            g = res["greedy"]
            ax.axhline(g["accuracy"], color="grey", linestyle=":", linewidth=1)
            ax.plot([g["tokens"]], [g["accuracy"]], marker="*", markersize=13, color="black",
                    linestyle="none", label="greedy")
            ax.set_xscale("log")
            ax.set_title(f"{label}: {family} ({res['num_examples']} held-out problems)",
                         fontsize=10)
            ax.grid(alpha=0.3)
            if row == len(PANELS) - 1:
                ax.set_xlabel("generated tokens per problem (log scale)")
            if col == 0:
                ax.set_ylabel("accuracy (strict: boxed answer)")
            if col == len(labels) - 1:
                ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    return path
