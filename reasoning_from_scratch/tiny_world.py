"""Build the bundled tiny "base model": a BPE tokenizer and a ~1M-parameter Qwen3 from scratch.

The pretraining corpus is made of arithmetic problems (`arithmetic.py`) rendered with the project's
prompt (`render_prompt`) and followed by a worked solution in one of several formats, the way a real
base model has seen many styles of solutions on the web:

- "think": steps inside <think> ... </think>, then \\boxed{N} (the format RL should reinforce),
- "steps_answer": steps, then "The answer is N." (no box, so the strict reward is 0),
- "steps_boxed": steps without think tags, then \\boxed{N},
- "direct_boxed" / "direct_answer": the answer without any steps (often wrong for several steps).

Which format a document uses depends on the problem (its number of operations, see
`style_distribution`). That matters for greedy decoding: with one global mix, the argmax of the
first completion token would pick the same format for every problem, whereas a per-problem mix
gives the base model a *varied* greedy behaviour in which the think format wins for only some
problems, while every format keeps a clear share of the samples. Reinforcement learning with the
strict (boxed) correctness and think-format rewards then has something to select.

Pretraining is `sft.train_sft`, the project's one next-token loop (AdamW, linear warmup + cosine
decay, gradient clipping; the loss covers only the completion tokens), which chapter 9 also uses
to distil a teacher into a student; `build_tiny_model` runs everything end to end and reports
the held-out figures.
"""

from __future__ import annotations

import json
import random
import tempfile
import time
from pathlib import Path

import torch

from .arithmetic import (
    STYLES,
    classify_completion,
    flawed_solution,
    format_solution,
    is_large_step,
    make_split,
    parse_problem,
)
from .evaluation import evaluate
from .prompts import render_prompt
from .qwen3 import Qwen3Model, tiny_config
from .sft import train_sft
from .tokenizer import END_THINK, ENDOFTEXT, IM_END, IM_START, THINK, Qwen3Tokenizer
from .weights import save_pretrained

SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, THINK, END_THINK)

# The per-problem format mix of the corpus: a document uses the dominant style of its problem's
# level (= number of operations) with probability DOMINANT_WEIGHT and otherwise a style drawn from
# STYLE_BACKGROUND. The number of operations is an easy, local feature for the model (the problem
# starts "Compute 3", "Compute (" or "Compute ((..."), so it learns the conditional mix quickly.
# With these numbers the think format has probability 0.64 for levels 2 and 4 (its greedy choice
# there) and 0.24 for the others, where it is not greedy but never rare when sampling.
STYLE_BACKGROUND = {
    "think": 0.40,
    "steps_answer": 0.30,
    "steps_boxed": 0.10,
    "direct_boxed": 0.10,
    "direct_answer": 0.10,
}
DOMINANT_STYLE = {1: "direct_answer", 2: "think", 3: "steps_answer", 4: "think",
                  5: "steps_answer"}  # by level
DEFAULT_DOMINANT = "steps_answer"
DOMINANT_WEIGHT = 0.4

# Flawed solutions: the corpus is written by learners who forget carries and borrows (see
# arithmetic.slip_result), more often on three-digit work, and now and then copy an operand with
# its digits transposed. Slips are independent of the solution format, so every format is equally
# reliable and the format lesson (chapter 7) stays separate from the reasoning lesson. With a slip
# probability above 1/2, the *most likely* continuation of a three-digit carry is wrong: the
# greedy base model makes those errors systematically, while sampling still finds the right
# carry often enough for reinforcement learning to reward it (calibration: docs/tiny_world.md).
SLIP_PROB_SMALL = 0.15  # the units carry of a step whose numbers all stay below 100
SLIP_PROB_LARGE = 0.6  # the units carry of a step with a three-digit number (operand or result)
OPERAND_SLIP_PROB = 0.04  # a two-digit operand copied with its digits transposed
CORPUS_LEVEL_WEIGHTS = (1, 1, 1, 1, 1)  # level mix of the pretraining corpus (levels 1-5)


def make_slip_prob(small: float = SLIP_PROB_SMALL, large: float = SLIP_PROB_LARGE):
    """slip_prob(a, op, b) for `flawed_solution`: `large` on three-digit steps, else `small`."""
    def slip_prob(a: int, op: str, b: int) -> float:
        return large if is_large_step(a, op, b) else small
    return slip_prob


corpus_slip_prob = make_slip_prob()  # the bundled corpus's slip probabilities

# The think-native base model `tiny-arith-think` (`build_tiny_model(think_native=True)`): every
# document is a think-format solution with a boxed answer, so its answers are always gradable
# and accuracy can rise only through the arithmetic. Its learners forget the units carry of
# *every* step more often than not (THINK_SLIP_PROB_SMALL > 1/2): with slips mostly on
# three-digit steps, as in tiny-arith, the greedy model solved 56% of the problems and sampling
# added little (pass@8 85%), leaving RL little to find (calibration: docs/tiny_world.md). Same
# world, prompts and tokenizer (the bundled tiny-arith one) as tiny-arith.
THINK_SLIP_PROB_SMALL = 0.65


# The bundled model's architecture: 834,816 parameters with the 367-token vocabulary that the
# default corpus yields (the BPE runs out of merges below its 384-token cap); 3.3 MB in float32.
TINY_ARITH_ARCH = dict(
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=512,
)


# ----------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------


def train_bpe_tokenizer(texts, vocab_size: int = 384, out_dir=None) -> Qwen3Tokenizer:
    """Train a byte-level BPE on `texts`, digits split one by one as in Qwen, Qwen3 special tokens.

    <|endoftext|> (EOS and padding, as in a Qwen3 base model), <|im_start|> and <|im_end|> are
    special tokens; <think> and </think> are added, non-special tokens as in Qwen3 (so decoding
    with skip_special_tokens keeps them visible). Each is a single id, never split or merged.
    The files are written into `out_dir` (a temporary directory if None) and loaded back.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    added = [AddedToken(t, special=t not in (THINK, END_THINK), normalized=False)
             for t in SPECIAL_TOKENS]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=added,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte stays encodable
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)

    out_dir = Path(out_dir or tempfile.mkdtemp(prefix="tiny-tokenizer-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    tok_cfg = {"eos_token": ENDOFTEXT, "pad_token": ENDOFTEXT, "model_max_length": 512}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    return Qwen3Tokenizer(out_dir / "tokenizer.json", out_dir / "tokenizer_config.json")


# ----------------------------------------------------------------------------------------------
# Corpus
# ----------------------------------------------------------------------------------------------


def style_distribution(example: dict, think_native: bool = False) -> dict[str, float]:
    """Probability of each solution style for this problem in the pretraining corpus
    (`think_native`: the think format always)."""
    if think_native:
        return {"think": 1.0}
    _, ops = parse_problem(example["problem"])
    dominant = DOMINANT_STYLE.get(len(ops), DEFAULT_DOMINANT)
    probs = {s: (1 - DOMINANT_WEIGHT) * STYLE_BACKGROUND[s] for s in STYLES}
    probs[dominant] += DOMINANT_WEIGHT
    return probs


def build_corpus(
    n: int,
    seed: int = 0,
    level_weights=CORPUS_LEVEL_WEIGHTS,
    slip_prob=corpus_slip_prob,
    operand_slip_prob: float = OPERAND_SLIP_PROB,
    think_native: bool = False,
    **knobs,
) -> list[dict]:
    """`n` pretraining documents: dicts with "prompt", "completion", "style", "slips" (+ the
    example keys; "answer" stays the true answer, the completion may give a wrong one).

    The document text is prompt + completion + "<|endoftext|>" (base-model style, no chat
    template). Problems come from the "train" split, so held-out problems are never seen. Each
    solution is written with slips (`arithmetic.flawed_solution`; `slip_prob=None` for a clean
    corpus), then rendered in a style drawn from `style_distribution`.
    """
    rng = random.Random(seed)
    docs = []
    split_knobs = knobs if knobs else {"level_weights": level_weights}
    for ex in make_split("train", n, seed=seed, **split_knobs):
        probs = style_distribution(ex, think_native)
        style = rng.choices(list(probs), weights=list(probs.values()))[0]
        written = ex
        if slip_prob is not None:
            written = flawed_solution(ex, rng, slip_prob, operand_slip_prob)
        docs.append(
            {
                **ex,
                "prompt": render_prompt(ex["problem"]),
                "completion": format_solution(written, style),
                "style": style,
                "slips": written.get("slips", []),
            }
        )
    return docs


def document_text(doc: dict) -> str:
    """Full training text of a corpus document."""
    return doc["prompt"] + doc["completion"] + ENDOFTEXT


# ----------------------------------------------------------------------------------------------
# Measuring the base model
# ----------------------------------------------------------------------------------------------


@torch.no_grad()
def measure_base_model(
    model,
    tokenizer,
    examples,
    max_new_tokens: int = 112,
    batch_size: int = 100,
    sample_temperature: float = 1.0,
    num_samples: int = 8,
    seed: int = 0,
) -> dict:
    """Held-out figures of a base model, greedy and sampled (`num_samples` per problem).

    Per decoding mode: strict accuracy (a boxed answer equal to the reference, the RL reward),
    think-format rate, accuracy among think-format answers, verifier step correctness over the
    think-format answers, accuracy per level, mean length and the mix of styles; sampled also
    pass@1 (= its strict accuracy) and pass@k (a correct answer among the k samples).
    """
    n = len(examples)
    figures = {"n": n, "num_samples": num_samples}
    for mode, temperature, reps in (("greedy", 0.0, 1),
                                    ("sampled", sample_temperature, num_samples)):
        res = evaluate(model, tokenizer, list(examples) * reps, model.device,
                       max_new_tokens=max_new_tokens, batch_size=batch_size,
                       temperature=temperature, seed=seed, progress=False)
        records = res["records"]
        styles = [classify_completion(r["generated_text"]) for r in records]
        figures[mode] = {
            "strict_accuracy": res["accuracy"],
            "think_format_rate": res["format_rate"],
            "accuracy_in_think_format": res["think_accuracy"],
            "step_correctness": res["step_correctness"],
            "per_level": res["per_level"],
            "mean_completion_tokens": res["mean_length"],
            "styles": {s: styles.count(s) / len(styles) for s in (*STYLES, "other")
                       if s in styles},
        }
        if reps > 1:  # record j is sample j // n of problem j % n
            solved = [any(records[i + r * n]["correct"] for r in range(reps)) for i in range(n)]
            figures[mode][f"pass@{reps}"] = sum(solved) / n
    return figures


def format_figures(figures: dict) -> str:
    """Human-readable table of `measure_base_model` figures."""
    def pct(v):
        return "n/a" if v is None else f"{v:.1%}"

    lines = [f"held-out test problems: {figures['n']}"]
    for mode in ("greedy", "sampled"):
        f = figures[mode]
        styles = ", ".join(f"{s} {v:.0%}" for s, v in f["styles"].items())
        levels = ", ".join(f"L{k} {v:.0%}" for k, v in f["per_level"].items())
        extra = "".join(f" | {k} {v:.1%}" for k, v in f.items() if k.startswith("pass@"))
        lines.append(
            f"{mode:>8}: strict accuracy {pct(f['strict_accuracy'])}{extra} | think-format rate "
            f"{pct(f['think_format_rate'])} | accuracy in think format "
            f"{pct(f['accuracy_in_think_format'])} | step correctness (think) "
            f"{pct(f['step_correctness'])} | mean completion "
            f"{f['mean_completion_tokens']:.1f} tokens\n          per level: {levels}"
            f"\n          styles: {styles}"
        )
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# End to end
# ----------------------------------------------------------------------------------------------


def build_tiny_model(
    out_dir,
    seed: int = 0,
    steps: int = 4000,
    batch_size: int = 32,
    lr: float = 3e-3,
    warmup: int = 100,
    vocab_size: int = 384,
    tokenizer_docs: int = 5000,
    n_test: int = 200,
    progress: bool = True,
    slip_prob_small: float = SLIP_PROB_SMALL,
    slip_prob_large: float = SLIP_PROB_LARGE,
    operand_slip_prob: float = OPERAND_SLIP_PROB,
    think_native: bool = False,
    tokenizer_dir=None,
) -> dict:
    """Train tokenizer and model from `seed`, save them to `out_dir` (HF layout), return figures.

    The corpus holds one fresh document per training sequence (steps * batch_size documents),
    written with the given slip probabilities (see `build_corpus`; `think_native`: every document
    in the think format). `tokenizer_dir`: reuse the tokenizer files there (e.g. the bundled
    tiny-arith's) instead of training a BPE on the corpus.
    """

    t0 = time.time()
    random.seed(seed)
    torch.manual_seed(seed)
    docs = build_corpus(steps * batch_size, seed=seed,
                        slip_prob=make_slip_prob(slip_prob_small, slip_prob_large),
                        operand_slip_prob=operand_slip_prob, think_native=think_native)
    with tempfile.TemporaryDirectory() as tmp:
        if tokenizer_dir is not None:
            tokenizer = Qwen3Tokenizer.from_pretrained(tokenizer_dir)
        else:
            tokenizer = train_bpe_tokenizer(
                (document_text(d) for d in docs[:tokenizer_docs]), vocab_size=vocab_size,
                out_dir=tmp)
        eos = tokenizer.eos_token_id
        cfg = tiny_config(
            vocab_size=tokenizer.vocab_size, bos_token_id=eos, eos_token_id=eos, **TINY_ARITH_ARCH
        )
        model = Qwen3Model(cfg)
        # weight_decay 0.1, grad_clip 1.0: train_sft's defaults, the shipped build's settings
        losses = train_sft(
            model, tokenizer, docs, steps=steps, batch_size=batch_size, lr=lr, warmup=warmup,
            seed=seed, progress=progress,
        )
        save_pretrained(model, tokenizer, out_dir)
    train_seconds = time.time() - t0
    figures = measure_base_model(model, tokenizer, make_split("test", n_test), seed=seed)
    figures.update(
        {
            "parameters": sum(p.numel() for p in model.parameters()),
            "final_loss": sum(losses[-50:]) / len(losses[-50:]),
            "train_seconds": train_seconds,
            "total_seconds": time.time() - t0,
            "corpus_styles": {s: sum(d["style"] == s for d in docs) / len(docs) for s in STYLES},
        }
    )
    return figures
