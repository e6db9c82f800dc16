"""The book's chapter 2-7 API over this package's functions.

Sebastian Raschka's "Build a Reasoning Model (From Scratch)" (rasbt/reasoning-from-scratch)
builds its functions one chapter at a time; a reader who has the book calls them by these
names and signatures, exported by the chapter indexes ``ch02`` ... ``ch07`` as the book has
them. Each one is a thin layer over this package's home for the job: tokens are chosen by
``generation.sample_next_token`` (so ``temperature=0`` is greedy), answers are extracted and
graded by ``grading``, votes are pooled by ``inference_scaling``, log-probabilities and
advantages come from ``grpo``, weights are read by ``weights.load_book_checkpoint``. Written
from the book's signatures and documented behaviour; docs/book_compatibility.md lists where the
behaviour differs.

Where the book and this package use one name for two functions (``sample_response``,
``compute_grpo_loss``, ``self_consistency_vote``, ``self_refinement_loop``, ``get_last_boxed``,
``normalize_text``, ``plot_grpo_metrics``), the name here, and in the chapter indexes, is the
book's function; this package's own is imported from its home module (and the top level).

The book defines each chapter's functions in that chapter's module, so its readers replace a
helper there (``monkeypatch.setattr(ch06, "sample_response", fake)``) and expect the chapter's
other functions to call the replacement. The indexes are `BookIndex` modules: a name set on
one is set here too, where the callers look it up.

The streaming generators follow the book's model protocol: ``model(token_ids)`` or
``model(token_ids, cache=KVCache(n_layers=model.cfg["n_layers"]))`` with one row, after
``model.reset_kv_cache()``; they yield each new token, a (1, 1) tensor, as soon as it is
chosen, and stop before an EOS token.
"""

from __future__ import annotations

import json
import math
import re
import time
import types
from collections.abc import Iterator
from itertools import islice
from pathlib import Path

import matplotlib.pyplot as plt
import sympy
import torch

from . import plotting
from .generation import sample_next_token
from .grading import braced_content, extract_final_candidate, grade_answer, reward_rlvr, to_sympy
from .grpo import compute_advantage_stats, sequence_logprob
from .inference_scaling import vote_record
from .prompts import render_prompt
from .qwen3 import KVCache, download_qwen3_small
from .tokenizer import Qwen3Tokenizer
from .weights import load_book_checkpoint, save_book_checkpoint

# which_model -> (weights file, tokenizer file, chat-template flags) of the book's two models
BOOK_MODELS = {
    "base": ("qwen3-0.6B-base.pth", "tokenizer-base.json", {}),
    "reasoning": ("qwen3-0.6B-reasoning.pth", "tokenizer-reasoning.json",
                  {"apply_chat_template": True, "add_generation_prompt": True,
                   "add_thinking": True}),
}
# A longer "expression" is a degenerate generation, not an answer: never parse it.
MAX_PARSE_CHARS = 2000


class BookIndex(types.ModuleType):
    """The module type of the chapter indexes: a book function set on an index is set here too.

    An index re-exports this module's functions; setting one of those names on the index
    (``ch03.generate_text_basic_stream_cache = fake``, or pytest's monkeypatch, which also
    undoes it) sets the name in this module as well, so the book functions that call it get the
    replacement, as they would in the book's own chapter modules. Other names are plain
    attributes of the index.
    """

    def __setattr__(self, name, value):
        home = globals()
        if name in home and home[name] is self.__dict__.get(name):
            home[name] = value
        super().__setattr__(name, value)


# --------------------------------------------------------------------------------------
# Chapter 2: text generation, step by step
# --------------------------------------------------------------------------------------


def _stop(token: torch.Tensor, eos_token_id) -> bool:
    """True when every row's new token is the EOS token."""
    return eos_token_id is not None and bool(torch.all(token == eos_token_id))


@torch.inference_mode()
def generate_text_basic_stream(model, token_ids, max_new_tokens, eos_token_id=None
                               ) -> Iterator[torch.Tensor]:
    """Greedy decoding without a cache: every step runs the whole sequence again (chapter 2)."""
    model.eval()
    for _ in range(max_new_tokens):
        logits = model(token_ids)[:, -1]  # (1, V) of the last position
        token = sample_next_token(logits)[:, None]  # (1, 1)
        if _stop(token, eos_token_id):
            break
        yield token
        token_ids = torch.cat([token_ids, token], dim=1)


@torch.inference_mode()
def _cached_tokens(model, token_ids, temperature=0.0, top_p=None) -> Iterator[torch.Tensor]:
    """KV-cache decoding of one row, without end: the prompt once, then each chosen token
    (1, 1) is yielded and fed back only when the next one is asked for (so a caller that stops
    after the last token it needs never pays for one more forward pass)."""
    cache = KVCache(n_layers=model.cfg["n_layers"])
    model.reset_kv_cache()
    logits = model(token_ids, cache=cache)[:, -1]  # (1, V)
    while True:
        token = sample_next_token(logits, temperature, 1.0 if top_p is None else top_p)
        token = token[:, None].to(token_ids.device)  # (1, 1)
        yield token
        logits = model(token, cache=cache)[:, -1]


def generate_text_top_p_stream_cache(model, token_ids, max_new_tokens, eos_token_id=None,
                                     temperature=0.0, top_p=None) -> Iterator[torch.Tensor]:
    """KV-cache decoding: greedy at `temperature` 0, else sampled, nucleus-filtered by `top_p`.

    The prompt is run once; every later step runs only the newest token (chapters 2 and 4).
    """
    model.eval()
    for token in islice(_cached_tokens(model, token_ids, temperature, top_p), max_new_tokens):
        if _stop(token, eos_token_id):
            break
        yield token


def generate_text_temp_stream_cache(model, token_ids, max_new_tokens, eos_token_id=None,
                                    temperature=0.0) -> Iterator[torch.Tensor]:
    """KV-cache decoding with temperature sampling, no top-p (chapter 4)."""
    return generate_text_top_p_stream_cache(model, token_ids, max_new_tokens, eos_token_id,
                                            temperature, None)


def generate_text_basic_stream_cache(model, token_ids, max_new_tokens, eos_token_id=None
                                     ) -> Iterator[torch.Tensor]:
    """Greedy KV-cache decoding (chapter 2)."""
    return generate_text_top_p_stream_cache(model, token_ids, max_new_tokens, eos_token_id)


def _collect(tokens: Iterator[torch.Tensor], token_ids: torch.Tensor) -> torch.Tensor:
    """The streamed (1, 1) tokens as one (1, n) tensor (n may be 0)."""
    tokens = list(tokens)
    if not tokens:
        return token_ids[:, :0]
    return torch.cat(tokens, dim=1)


def generate_text_basic(model, token_ids, max_new_tokens, eos_token_id=None) -> torch.Tensor:
    """The new token ids (1, n) of greedy decoding without a cache; EOS is not included."""
    return _collect(generate_text_basic_stream(model, token_ids, max_new_tokens, eos_token_id),
                    token_ids)


def generate_text_basic_cache(model, token_ids, max_new_tokens, eos_token_id=None
                              ) -> torch.Tensor:
    """The new token ids (1, n) of greedy KV-cache decoding; EOS is not included."""
    return _collect(
        generate_text_basic_stream_cache(model, token_ids, max_new_tokens, eos_token_id),
        token_ids)


def generate_stats(output_token_ids, tokenizer, start_time, end_time) -> None:
    """Print the time taken, tokens per second and, on a GPU, the peak memory."""
    seconds = end_time - start_time
    print(f"\n\nTime: {seconds:.2f} sec")
    print(f"{int(output_token_ids.numel() / seconds)} tokens/sec")
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        print(f"Max CUDA memory allocated: {torch.cuda.max_memory_allocated() / 1024**3:.2f} GB")
        torch.cuda.reset_peak_memory_stats()


# --------------------------------------------------------------------------------------
# Chapter 3: the book's models, streamed answers, its grader's parts, MATH-500
# --------------------------------------------------------------------------------------


def load_tokenizer_only(which_model, local_dir="qwen3") -> Qwen3Tokenizer:
    """The book's tokenizer for 'base' or 'reasoning' (downloaded into `local_dir` if needed)."""
    if which_model not in BOOK_MODELS:
        raise ValueError(f"which_model must be 'base' or 'reasoning', got {which_model!r}")
    download_qwen3_small(kind=which_model, tokenizer_only=True, out_dir=local_dir)
    _, tokenizer_file, flags = BOOK_MODELS[which_model]
    return Qwen3Tokenizer(tokenizer_file_path=Path(local_dir) / tokenizer_file, **flags)


def load_model_and_tokenizer(which_model, device, use_compile, local_dir="qwen3"):
    """(model, tokenizer) of the book's Qwen3-0.6B 'base' or 'reasoning' model, on `device`.

    The book's `.pth` weights are read safely (`weights.read_book_checkpoint`) into this
    package's `Qwen3Model`; `use_compile` wraps the model in `torch.compile`.
    """
    tokenizer = load_tokenizer_only(which_model, local_dir)
    download_qwen3_small(kind=which_model, out_dir=local_dir)
    model = load_book_checkpoint(Path(local_dir) / BOOK_MODELS[which_model][0]).to(device)
    return (torch.compile(model) if use_compile else model), tokenizer


def generate_text_stream_concat_flex(model, tokenizer, prompt, device, max_new_tokens,
                                     verbose=False, generate_func=None, **generate_kwargs) -> str:
    """Generate an answer to `prompt` with a streaming `generate_func` and return its text.

    `generate_func` (default: greedy `generate_text_basic_stream_cache`) gets model, token_ids,
    max_new_tokens, eos_token_id and `generate_kwargs` (e.g. temperature, top_p). `verbose`
    prints each token's text as it comes.
    """
    generate_func = generate_func or generate_text_basic_stream_cache
    token_ids = torch.tensor(tokenizer.encode(prompt), device=device)[None]  # (1, P)
    new_ids = []
    for token in generate_func(model=model, token_ids=token_ids, max_new_tokens=max_new_tokens,
                               eos_token_id=tokenizer.eos_token_id, **generate_kwargs):
        new_ids.append(int(token.squeeze(0)))
        if verbose:
            print(tokenizer.decode([new_ids[-1]]), end="", flush=True)
    return tokenizer.decode(new_ids)


def generate_text_stream_concat(model, tokenizer, prompt, device, max_new_tokens,
                                verbose=False) -> str:
    """The greedy answer to `prompt` as text (chapter 3)."""
    return generate_text_stream_concat_flex(model, tokenizer, prompt, device, max_new_tokens,
                                            verbose=verbose)


def get_last_boxed(text):
    """The book's extraction (chapter 3): the content of the last ``\\boxed{...}`` (spaces
    allowed before the brace, nested braces kept, the content as written), or None when there
    is no ``\\boxed``, no brace after it, or the braces never close.

    The book's rule: ``\\boxed 5`` is None here. This package's grader reads unbraced boxes
    and ``\\fbox`` too (`grading.get_last_boxed`).
    """
    start = text.rfind("\\boxed")
    if start == -1:
        return None
    i = start + len("\\boxed")
    while i < len(text) and text[i].isspace():
        i += 1
    if i == len(text) or text[i] != "{":
        return None
    return braced_content(text, i)


# The book's normalisation (chapter 3), step by step: LaTeX answers become the text its SymPy
# parser reads. Applied in order after special tokens are removed and the ends stripped.
_SPECIAL_TOKEN = re.compile(r"<\|[^>]+?\|>")  # chat tokens such as <|im_end|>
_SUPERSCRIPT_DIGITS = str.maketrans("⁰¹²³⁴⁵⁶⁷⁸⁹⁺⁻⁽⁾", "0123456789+-()")
_SUPERSCRIPT_POWER = re.compile(r"([0-9A-Za-z)\]}])([⁰¹²³⁴⁵⁶⁷⁸⁹⁺⁻]+)")  # 2² -> 2**2
_NORMALIZE_STEPS = [
    (re.compile(r"^[A-Za-z]\s*[.:]\s*(?=\S)"), ""),  # a multiple-choice label: "c. 3" -> 3
    (re.compile(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|°"), ""),  # degrees
    (re.compile(r"^\\text\{(.+?)\}$"), r"\1"),  # an answer wholly inside \text{...}
    (re.compile(r"\\[()\[\]]"), ""),  # the math wrappers \( \) \[ \]
    (re.compile(r"\\left\s*|\\right\s*|\\[,!;:]"), ""),  # sizing and spacing commands
    (re.compile(r"\\cdot|[·×]"), "*"),
    (re.compile(r"\\[dt]frac"), r"\\frac"),
    (re.compile(r"\\%|%|\$"), ""),
]
_SQRT = re.compile(r"\\sqrt\s*\{([^}]*)\}|\\sqrt\s+([^\\\s{}]+)")  # \sqrt{2}, \sqrt 2
_FRAC = re.compile(r"\\frac\s*\{([^{}]+)\}\s*\{([^{}]+)\}|\\frac\s+([^\s{}]+)\s+([^\s{}]+)")
_MIXED_NUMBER = re.compile(r"(?<=\d)\s+(?=\d+/\d+)")  # "2 1/2" -> "2+1/2"
_THOUSANDS = re.compile(r"(?<=\d),(?=\d\d\d(?:\D|$))")  # 1,234 -> 1234


def normalize_text(text):
    """The book's normalisation (chapter 3): an answer as the text its SymPy parser reads.

    Chat tokens, a multiple-choice label ("c. 3"), degree marks, a wrapping ``\\text{}``,
    ``\\(...\\)``, ``\\left``/``\\right`` and LaTeX spacing, ``$`` and ``%`` go;
    ``\\sqrt{2}`` -> ``sqrt(2)``, ``\\frac{3}{4}`` -> ``(3)/(4)``, ``^`` and superscripts -> ``**``,
    a mixed number "2 1/2" -> "2+1/2", "1,234" -> "1234"; braces are dropped, spaces inside are
    kept ("(1, 2)"), the result is lower case. This package's grader has its own canonical form
    (`grading.normalize_text`, spaces removed, LaTeX kept for its parser).
    """
    if not text:
        return ""
    s = _SPECIAL_TOKEN.sub("", text).strip()
    for pattern, replacement in _NORMALIZE_STEPS:
        s = pattern.sub(replacement, s)
    s = _SUPERSCRIPT_POWER.sub(lambda m: f"{m[1]}**{m[2].translate(_SUPERSCRIPT_DIGITS)}", s)
    s = s.translate(_SUPERSCRIPT_DIGITS)
    s = _SQRT.sub(lambda m: f"sqrt({m[1] if m[1] is not None else m[2]})", s)
    s = _FRAC.sub(lambda m: f"({m[1] or m[3]})/({m[2] or m[4]})", s)
    s = _MIXED_NUMBER.sub("+", s.replace("^", "**"))
    s = _THOUSANDS.sub("", s)
    return s.replace("{", "").replace("}", "").strip().lower()


# The book's normal form in the notation of this package's parser: powers as ^, and a number
# with a trailing point ("4.") as the number
_PARSER_FORM = [(re.compile(r"\*\*"), "^"), (re.compile(r"(?<=\d)\.(?!\d)"), "")]


def sympy_parser(expr):
    """A SymPy expression for a normalised answer string (implicit products like '2x' allowed),
    or None when it does not parse, is None, or is longer than MAX_PARSE_CHARS.

    Parsed by `grading.to_sympy`, never by `sympy.parse_expr`: that one evaluates Python, and
    the strings come from a model's output. Reads the book's form (`normalize_text`: ``x**2``,
    ``(3)/(4)``) and this package's (``\\frac{3}{4}``).
    """
    if expr is None or len(expr) > MAX_PARSE_CHARS:
        return None
    for pattern, replacement in _PARSER_FORM:
        expr = pattern.sub(replacement, expr)
    return to_sympy(expr, sympy)


def equality_check(expr_gtruth, expr_pred) -> bool:
    """The book's comparison of two normalised strings: equal text, or a SymPy difference that
    simplifies to 0 (a tuple is not one expression: compare its parts, `split_into_parts`)."""
    if expr_gtruth == expr_pred:
        return True
    truth, pred = sympy_parser(expr_gtruth), sympy_parser(expr_pred)
    if truth is None or pred is None:
        return False
    try:
        return bool(sympy.simplify(truth - pred) == 0)
    except Exception:  # e.g. tuples cannot be subtracted
        return False


def split_into_parts(text) -> list[str]:
    """'(a, b)' or '[a, b]' -> ['a', 'b']; anything else -> [text]; '' -> []."""
    if not text:
        return []
    inner = text[1:-1]
    if len(text) >= 2 and text[0] in "([" and text[-1] in ")]" and "," in inner:
        parts = [p.strip() for p in inner.split(",")]
        if all(parts):
            return parts
    return [text]


def run_demos_table(tests) -> None:
    """Grade (name, prediction, truth, expected) cases and print a PASS/FAIL table."""
    header = ("Test", "Expect", "Got", "Status")
    rows = []
    for name, pred, truth, expect in tests:
        got = grade_answer(pred, truth)
        rows.append((name, str(expect), str(got), "PASS" if got == expect else "FAIL"))
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print(" | ".join(cell.ljust(w) for cell, w in zip(row, widths)))
    print(f"\nPassed {sum(r[3] == 'PASS' for r in rows)}/{len(rows)}")


def eta_progress_message(processed, total, start_time, show_eta=False, label="Progress") -> str:
    """'label: i/n' and, with `show_eta`, the time left at the average pace so far; padded to
    a fixed width so that a carriage-return progress line overwrites itself cleanly."""
    message = f"{label}: {processed}/{total}"
    width = len(f"{label}: {total}/{total} | ETA: 00h 00m 00s")
    elapsed = time.time() - start_time
    if show_eta and processed > 0 and elapsed > 0:
        left = max(int(round(elapsed / processed * max(total - processed, 0))), 0)
        hours, rest = divmod(left, 3600)
        minutes, seconds = divmod(rest, 60)
        if hours:
            eta = f"{hours}h {minutes:02d}m {seconds:02d}s"
        elif minutes:
            eta = f"{minutes:02d}m {seconds:02d}s"
        else:
            eta = f"{seconds:02d}s"
        message += f" | ETA: {eta}"
    return message.ljust(width)


def evaluate_math500_stream(model, tokenizer, device, math_data, out_path=None,
                            max_new_tokens=512, verbose=False):
    """Answer each problem greedily, grade it, and write one JSON line per problem.

    Returns (num_correct, num_examples, accuracy). Records: index, problem, gtruth_answer,
    generated_text, extracted, correct; `out_path` defaults to math500-<device>.jsonl.
    """
    if out_path is None:
        out_path = Path(f"math500-{str(device).replace(':', '-')}.jsonl")
    num_correct = total_tokens = 0
    start = time.time()
    with open(out_path, "w", encoding="utf-8") as f:
        for i, row in enumerate(math_data, start=1):
            text = generate_text_stream_concat(model, tokenizer, render_prompt(row["problem"]),
                                               device, max_new_tokens, verbose=verbose)
            total_tokens += len(tokenizer.encode(text))
            extracted = extract_final_candidate(text)
            correct = bool(grade_answer(extracted, row["answer"]))
            num_correct += correct
            record = {"index": i, "problem": row["problem"], "gtruth_answer": row["answer"],
                      "generated_text": text, "extracted": extracted, "correct": correct}
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
            print(eta_progress_message(i, len(math_data), start, True, "MATH-500"), end="\r",
                  flush=True)
    n = len(math_data)
    accuracy = num_correct / n if n else 0.0
    print(f"\nAccuracy: {accuracy * 100:.1f}% ({num_correct}/{n})")
    print(f"Total time: {(time.time() - start) / 60:.1f} min")
    print(f"Average response length: {total_tokens / max(n, 1):.2f} tokens")
    print(f"Logs written to: {out_path}")
    return num_correct, n, accuracy


# --------------------------------------------------------------------------------------
# Chapters 4-5: temperature, scoring and refinement prompts
# --------------------------------------------------------------------------------------


def scale_logits_by_temperature(logits, temperature):
    """logits / temperature; ValueError unless temperature > 0 (0 means greedy, no scaling)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to scale logits, got {temperature}")
    return logits / temperature


def self_consistency_vote(model, tokenizer, prompt, device, num_samples=10, temperature=0.8,
                          top_p=0.9, max_new_tokens=2048, show_progress=True,
                          show_long_answer=False, seed=None) -> dict:
    """The book's chapter 4 self-consistency: sample `num_samples` answers one at a time
    (`generate_text_stream_concat_flex` with top-p sampling; `seed` seeds sample i with
    seed + i + 1), extract each final answer, and vote.

    Returns full_answers, short_answers, counts, groups, majority_winners and final_answer
    (None on a tie, as in the book), plus votes and num_samples. The votes are pooled by this
    package's grader (`inference_scaling.vote_record`): "1/2" and "0.5" are one answer. The
    batched version with early stopping is `inference_scaling.self_consistency_vote`.
    """
    answers = []
    for i in range(num_samples):
        if seed is not None:
            torch.manual_seed(seed + i + 1)
        answers.append(generate_text_stream_concat_flex(
            model=model, tokenizer=tokenizer, prompt=prompt, device=device,
            max_new_tokens=max_new_tokens, verbose=show_long_answer,
            generate_func=generate_text_top_p_stream_cache, temperature=temperature,
            top_p=top_p))
        if show_progress:
            short = extract_final_candidate(answers[-1], fallback="number_then_full")
            print(f"[Sample {i + 1}/{num_samples}] -> {short!r}")
    record = vote_record(answers, fallback="number_then_full")
    winners = record["majority_winners"]
    record["final_answer"] = winners[0] if len(winners) == 1 else None
    return record


def heuristic_score(answer, prompt=None, brevity_bonus=500.0, boxed_bonus=2.0,
                    extract_bonus=1.0, fulltext_bonus=0.0) -> float:
    """The book's answer score without a model (chapter 5): a boxed answer earns `boxed_bonus`,
    else a bare number `extract_bonus`, else any text `fulltext_bonus`; plus a brevity bonus
    1.5 * exp(-len(answer) / brevity_bonus). `prompt` is ignored (scorer signature)."""
    if extract_final_candidate(answer, fallback="none"):
        score = boxed_bonus
    elif extract_final_candidate(answer, fallback="number_only"):
        score = extract_bonus
    elif extract_final_candidate(answer, fallback="number_then_full"):
        score = fulltext_bonus
    else:
        score = 0.0
    return score + 1.5 * math.exp(-len(answer) / brevity_bonus)


def make_critique_prompt(raw_prompt, draft) -> str:
    """Prompt asking the model to review `draft` as an answer to `raw_prompt` (chapter 5)."""
    return (
        "You are a meticulous reviewer. Check the draft answer below for wrong steps, "
        "missing steps and arithmetic slips; if it is right, say so in a sentence. Then "
        "give a short plan to fix what is wrong.\n\n"
        f"Question:\n{raw_prompt}\n\n"
        f"Draft answer:\n{draft}\n\n"
        "Keep the critique and the bullet-point plan under about 120 words.\n"
        "Critique:"
    )


def make_refine_prompt(raw_prompt, draft, critique) -> str:
    """Prompt asking the model to rewrite `draft` following `critique` (chapter 5)."""
    return (
        "Rewrite the answer so that it follows the critique. Be concise and end with the "
        "final result in a box: \\boxed{ANSWER}\n\n"
        f"Question:\n{raw_prompt}\n\n"
        f"Previous answer:\n{draft}\n\n"
        f"Critique:\n{critique}\n\n"
        "Revised answer:"
    )


def self_refinement_loop(model, tokenizer, raw_prompt, device, iterations=2,
                         max_response_tokens=2048, max_critique_tokens=256, score_fn=None,
                         prompt_renderer=render_prompt, prompt_suffix="", verbose=False,
                         temperature=0.7, top_p=0.9) -> dict:
    """The book's chapter 5 self-refinement: the model critiques its own draft and rewrites it.

    A draft is sampled for ``prompt_renderer(raw_prompt) + prompt_suffix``; each iteration
    samples a critique (`make_critique_prompt`) and a revision (`make_refine_prompt`), and the
    revision replaces the draft when ``score_fn(answer=..., prompt=...)`` does not drop (no
    `score_fn`: every score is 0, so every revision is kept). Returns final_full,
    final_extracted and steps (iteration, draft_full, draft_extracted, critique, revised_full,
    revised_extracted, score_before, score_after). This package's loop with a step critic
    (`critic`, `max_rounds`) is `search.self_refinement_loop`.
    """
    prompt = prompt_renderer(raw_prompt) + prompt_suffix

    def sample(text, max_new_tokens):
        return generate_text_stream_concat_flex(
            model=model, tokenizer=tokenizer, prompt=text, device=device,
            max_new_tokens=max_new_tokens, generate_func=generate_text_top_p_stream_cache,
            temperature=temperature, top_p=top_p)

    def score(answer):
        return score_fn(answer=answer, prompt=prompt) if score_fn else 0.0

    current = sample(prompt, max_response_tokens)
    current_score = score(current)
    steps = []
    for it in range(1, iterations + 1):
        critique = sample(make_critique_prompt(raw_prompt, current), max_critique_tokens)
        revised = sample(make_refine_prompt(raw_prompt, current, critique), max_response_tokens)
        revised_score = score(revised)  # scored against the original prompt
        steps.append({
            "iteration": it, "draft_full": current,
            "draft_extracted": extract_final_candidate(current), "critique": critique,
            "revised_full": revised, "revised_extracted": extract_final_candidate(revised),
            "score_before": current_score, "score_after": revised_score,
        })
        if verbose:
            print(f"[Refinement {it}/{iterations}]\nCurrent: {steps[-1]['draft_extracted']}"
                  f"\nRevised: {steps[-1]['revised_extracted']}\nScore before: "
                  f"{current_score:.3f}\nScore after: {revised_score:.3f}\n{'=' * 25}")
        if revised_score >= current_score:  # keep a revision that is not worse
            current, current_score = revised, revised_score
    return {"final_full": current, "final_extracted": extract_final_candidate(current),
            "steps": steps}


# --------------------------------------------------------------------------------------
# Chapter 6: the book's GRPO step, checkpoints and metrics
# --------------------------------------------------------------------------------------


def sample_response(model, tokenizer, prompt, device, max_new_tokens=512, temperature=0.8,
                    top_p=0.9):
    """The book's chapter 6 rollout: one sampled completion of `prompt`, decoded with the
    book's model protocol (`_cached_tokens`), so any model that has it works.

    Returns (prompt + completion ids (1-D), prompt length, completion text). The completion
    ends with the EOS token, which is in both the ids and the text, as in the book; at
    `temperature` 0 the choice is greedy. The model is used in the mode it is in. This
    package's batched sampler (text without the EOS) is `generation.sample_response`.
    """
    prompt_ids = torch.tensor(tokenizer.encode(prompt), device=device)  # (P,)
    tokens = _cached_tokens(model, prompt_ids[None], temperature, top_p)
    new_ids = []
    for token in islice(tokens, max_new_tokens):
        new_ids.append(int(token))
        if new_ids[-1] == tokenizer.eos_token_id:
            break
    completion = torch.tensor(new_ids, dtype=prompt_ids.dtype, device=prompt_ids.device)
    return torch.cat([prompt_ids, completion]), prompt_ids.numel(), tokenizer.decode(new_ids)


def compute_grpo_loss(model, tokenizer, example, device, num_rollouts=2, max_new_tokens=256,
                      temperature=0.8, top_p=0.9) -> dict:
    """The book's chapter 6 GRPO loss for one example, one rollout at a time.

    With the model in eval mode, `num_rollouts` completions of the rendered problem are
    sampled (`sample_response`), rewarded for a correct boxed answer (`reward_rlvr`) and
    scored by their summed log-probability (`sequence_logprob`, with gradients); the model's
    training mode is then restored. Advantages are the group-normalised rewards
    (`grpo.compute_advantage_stats`; DeepSeekMath, Shao et al. 2024, section 4.1.2) and the
    loss is -mean(advantage x log-prob). Returns loss, pg_loss (floats, equal: no KL term in
    chapter 6), loss_tensor (backpropagate this), rewards, advantages and samples (text,
    reward, gen_len). This package's batched loss with clipping, KL and the chapter 7 options
    is `training.compute_grpo_loss`.
    """
    if num_rollouts < 2:
        raise ValueError(f"num_rollouts must be >= 2 (advantages compare rollouts), "
                         f"got {num_rollouts}")
    prompt = render_prompt(example["problem"])
    was_training = model.training
    model.eval()
    logps, rewards, samples = [], [], []
    for _ in range(num_rollouts):
        token_ids, prompt_len, text = sample_response(
            model=model, tokenizer=tokenizer, prompt=prompt, device=device,
            max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p)
        rewards.append(reward_rlvr(text, example["answer"]))
        logps.append(sequence_logprob(model, token_ids, prompt_len))
        samples.append({"text": text, "reward": rewards[-1],
                        "gen_len": token_ids.numel() - prompt_len})
    if was_training:
        model.train()
    logps = torch.stack(logps)  # (G,)
    advantages, _, _ = compute_advantage_stats(rewards)  # (G,), zeros when all rewards agree
    loss = -(advantages.to(logps) * logps).mean()
    return {"loss": loss.item(), "pg_loss": loss.item(), "loss_tensor": loss,
            "rewards": rewards, "advantages": advantages.tolist(), "samples": samples}


def save_grpo_checkpoint(model, checkpoint_dir, step, suffix="") -> Path:
    """The book's GRPO checkpoint: <dir>/qwen3-0.6B-rlvr-grpo-step00007[-suffix].pth, in the
    book's parameter names (`weights.save_book_checkpoint`; ch06 exports it as
    `save_checkpoint`)."""
    suffix = f"-{suffix}" if suffix else ""
    path = Path(checkpoint_dir) / f"qwen3-0.6B-rlvr-grpo-step{step:05d}{suffix}.pth"
    return save_book_checkpoint(model, path)


def append_csv_metrics(csv_log_path, step_idx, total_steps, loss, reward_avg,
                       avg_response_len) -> None:
    """Append one row (step, total_steps, loss, reward_avg, avg_response_len) to a CSV log,
    writing the header first when the file is new."""
    csv_log_path = Path(csv_log_path)
    if not csv_log_path.exists():
        csv_log_path.parent.mkdir(parents=True, exist_ok=True)
        csv_log_path.write_text("step,total_steps,loss,reward_avg,avg_response_len\n",
                                encoding="utf-8")
    with csv_log_path.open("a", encoding="utf-8") as f:
        f.write(f"{step_idx},{total_steps},{loss:.6f},{reward_avg:.6f},"
                f"{avg_response_len:.6f}\n")


def train_rlvr_grpo(model, tokenizer, math_data, device, steps=None, num_rollouts=2,
                    max_new_tokens=256, temperature=0.8, top_p=0.9, lr=1e-5,
                    checkpoint_every=50, checkpoint_dir=".", csv_log_path=None):
    """The book's chapter 6 loop: one problem per step, its GRPO loss, one AdamW step.

    The loss is the book's `compute_grpo_loss` (a sequence-level loss, no clipping, correctness
    reward only); gradients are clipped to norm 1, and a step whose rollouts all got the same
    reward (zero advantages: nothing to learn) leaves the weights alone. Every step appends a
    row to `csv_log_path` (default: a time-stamped CSV in the working directory); every
    `checkpoint_every` steps, and on Ctrl-C (then it returns early), a book-format checkpoint
    goes to `checkpoint_dir`. Returns the model. For evaluation, resumable runs, batched
    rollouts and the chapter 7 options, use `training.train_grpo`.
    """
    steps = len(math_data) if steps is None else steps
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    csv_log_path = Path(csv_log_path or
                        f"train_rlvr_grpo_metrics_{time.strftime('%Y%m%d_%H%M%S')}.csv")
    model.train()
    step = 0
    try:
        for step in range(1, steps + 1):
            optimizer.zero_grad()  # 1. fresh gradients
            stats = compute_grpo_loss(  # 2. sample, reward, GRPO loss
                model, tokenizer, math_data[(step - 1) % len(math_data)], device,
                num_rollouts, max_new_tokens, temperature, top_p)
            if any(stats["advantages"]):  # all-equal rewards: nothing to learn
                stats["loss_tensor"].backward()  # 3. gradients
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()  # 4. update
            rewards = stats["rewards"]  # 5. log
            reward_avg = sum(rewards) / len(rewards)
            lengths = [s["gen_len"] for s in stats["samples"]]
            avg_len = sum(lengths) / max(len(lengths), 1)
            append_csv_metrics(csv_log_path, step, steps, stats["loss"], reward_avg, avg_len)
            print(f"[Step {step}/{steps}] loss={stats['loss']:.4f} "
                  f"reward_avg={reward_avg:.3f} avg_resp_len={avg_len:.1f}")
            if checkpoint_every and step % checkpoint_every == 0:  # 6. checkpoint
                print(f"Saved checkpoint to {save_grpo_checkpoint(model, checkpoint_dir, step)}")
    except KeyboardInterrupt:
        path = save_grpo_checkpoint(model, checkpoint_dir, max(1, step), suffix="interrupt")
        print(f"\nKeyboardInterrupt. Saved checkpoint to {path}")
    return model


# --------------------------------------------------------------------------------------
# Chapter 7: the metrics plot
# --------------------------------------------------------------------------------------


def plot_grpo_metrics(csv_path, columns, save_as=None):
    """The book's chapter 7 plot of a training log: one panel per column of the CSV (a column
    the file lacks is skipped, as in the book), drawn by `plotting.plot_grpo_metrics` into a
    pyplot figure, written to `save_as` when given, then shown with ``plt.show()`` as in the
    book (a window in a script, the cell's output in a notebook). Returns the Figure.
    `plotting.plot_grpo_metrics` itself draws without pyplot."""
    fig = plotting.plot_grpo_metrics(csv_path, columns, save_as=save_as, fig=plt.figure(),
                                     skip_missing=True)
    plt.show()
    return fig
