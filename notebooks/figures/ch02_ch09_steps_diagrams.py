"""Draw the step-by-step diagrams of the chapter 2 and 9 notebooks (notebooks/figures/chNN_*.png).

One step of an idea per figure, with the numbers the notebooks compute: a prompt's token ids,
a RoPE pair's rotation, grouped-query heads, the causal mask, temperature and top-p on one
distribution, the KV cache per decoding step (chapter 2); a trace's step check, a trace's way
to an SFT pair, the scored share of a real document, the section 4 experiment and the work per
training problem of distillation and GRPO (chapter 9). Token ids come from the bundled
tokenizer, probabilities from the formulas; the chapter 9 counts are those the notebook prints.
Boxes use the helpers of ch02_ch09_diagrams.py. Redraw after a change:

    python notebooks/figures/ch02_ch09_steps_diagrams.py
"""

import math
import re
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the shared helpers, when imported from elsewhere (tests)
from ch02_ch09_diagrams import COLORS, _arrow, _box, _canvas, _cell, _save  # noqa: E402

RIGHT, WRONG, GREY = "#b7e1c1", "#f4c7c3", "#5f6368"
LOGITS = {"a": 2.0, "b": 1.0, "c": 0.5, "d": 0.0, "e": -1.0}  # one made-up next-token logit row


def _tokenizer():
    from reasoning_from_scratch.tokenizer import Qwen3Tokenizer
    from reasoning_from_scratch.weights import resolve_model_dir

    return Qwen3Tokenizer.from_pretrained(resolve_model_dir("tiny-arith"))


def _softmax(values, temperature=1.0):
    exps = [math.exp(v / temperature) for v in values]
    return [e / sum(exps) for e in exps]


# --- chapter 2 ---------------------------------------------------------------------------------


def tokenize_diagram(out_dir):
    """Chapter 2, section 8: a prompt -> BPE pieces -> token ids (the bundled tokenizer)."""
    tok = _tokenizer()
    text = "Compute (17+5)*3"
    ids = tok.encode(text)
    pieces = [tok.decode([i]) for i in ids]
    fig, ax = plt.subplots(figsize=(9.0, 2.3))
    ax.set_xlim(-2.2, len(ids) * 1.15), ax.set_ylim(-0.6, 3.0), ax.axis("off")
    ax.text(len(ids) * 0.55 - 0.6, 2.6, f'text: "{text}"', ha="center", fontsize=11)
    for j, (piece, i) in enumerate(zip(pieces, ids)):
        x = j * 1.15
        _cell(ax, x, 1.6, repr(piece)[1:-1].replace(" ", "\u2423"), COLORS["data"], size=10,
              w=1.0, h=0.55)
        _arrow(ax, (x, 1.3), (x, 0.75))
        _cell(ax, x, 0.45, str(i), COLORS["out"], size=10, w=1.0, h=0.55)
    ax.text(-0.8, 1.6, "pieces", ha="right", va="center", fontsize=9)
    ax.text(-0.8, 0.45, "ids", ha="right", va="center", fontsize=9)
    ax.text(len(ids) * 0.55 - 0.6, -0.35, "\u2423 = a space, part of the piece; every digit is "
            "its own token", ha="center", fontsize=8, color=GREY)
    _save(fig, out_dir / "ch02_tokenize.png")


def _rotate(v, angle):
    c, s = math.cos(angle), math.sin(angle)
    return v[0] * c - v[1] * s, v[0] * s + v[1] * c


def rope_diagram(out_dir):
    """Chapter 2, section 2: one dimension pair of q and k rotated by position * theta_i."""
    head_dim, base, pair = 16, 10_000.0, 1
    theta = base ** (-2 * pair / head_dim)  # the angle per position of pair 1
    q, k = (0.9, 0.3), (0.6, -0.5)  # (dim j, dim j + D/2) of one query and one key
    fig, axes = plt.subplots(1, 2, figsize=(9.6, 4.0))
    for ax, (m, n) in zip(axes, [(5, 2), (40, 37)]):
        ax.add_patch(plt.Circle((0, 0), 1.0, fill=False, color="#dadce0"))
        for name, v, pos, color in (("q", q, m, "#1a73e8"), ("k", k, n, "#e37400")):
            ax.annotate("", xy=v, xytext=(0, 0), arrowprops=dict(arrowstyle="->", color=color,
                                                                  alpha=0.35, linewidth=1.2))
            r = _rotate(v, pos * theta)
            ax.annotate("", xy=r, xytext=(0, 0), arrowprops=dict(arrowstyle="->", color=color,
                                                                  linewidth=2))
            u = math.hypot(*r)
            ax.text(r[0] / u * 1.3, r[1] / u * 1.3, f"{name} at position {pos}\n(turned {pos} x "
                    f"{theta:.3f} rad)", ha="center", va="center", fontsize=8, color=color)
        score = sum(a * b for a, b in zip(_rotate(q, m * theta), _rotate(k, n * theta)))
        ax.set_title(f"query at {m}, key at {n}: q . k = {score:+.3f}", fontsize=10)
        ax.set_xlim(-1.8, 1.8), ax.set_ylim(-1.6, 1.6), ax.set_aspect("equal"), ax.axis("off")
    fig.suptitle(f"RoPE, one pair (dims {pair} and {pair + head_dim // 2}, head_dim "
                 f"{head_dim}): theta = {base:.0f}^(-2*{pair}/{head_dim}) = {theta:.3f}; "
                 "faint: before rotation", fontsize=9)
    fig.tight_layout()
    _save(fig, out_dir / "ch02_rope_pair.png")


def gqa_diagram(out_dir):
    """Chapter 2, section 3: tiny_config's 4 query heads read 2 key/value heads."""
    from reasoning_from_scratch.qwen3 import tiny_config

    cfg = tiny_config()
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    group = heads // kv_heads
    fig, ax = _canvas(8.0, 3.0)
    ax.text(0.1, 2.75, "query heads", fontsize=9, weight="bold")
    ax.text(0.1, 0.6, "key/value heads\n(in the KV cache)", fontsize=9, weight="bold",
            va="center")
    for h in range(heads):
        x = 2.8 + 1.8 * h
        _box(ax, x, 2.8, f"Q head {h}", "data", w=1.4, h=0.6)
        g = h // group
        kx = 2.8 + 1.8 * (group * g) + 0.9 * (group - 1)
        _arrow(ax, (x, 2.45), (kx + 0.25 * (h % group * 2 - 1), 1.05))
    for g in range(kv_heads):
        kx = 2.8 + 1.8 * (group * g) + 0.9 * (group - 1)
        _box(ax, kx, 0.7, f"K, V head {g}", "model", w=1.8, h=0.6)
    ax.text(5.5, -0.25, f"query head h reads key/value head h // {group}  (group_size = "
            f"{heads} // {kv_heads}): the cache holds {kv_heads} heads, not {heads}",
            ha="center", fontsize=9)
    _save(fig, out_dir / "ch02_gqa_heads.png")


def causal_mask_diagram(out_dir):
    """Chapter 2, section 3: the causal mask of a real prompt's tokens."""
    tok = _tokenizer()
    pieces = [tok.decode([i]) for i in tok.encode("Compute (17+5)*3")]
    n = len(pieces)
    fig, ax = plt.subplots(figsize=(6.2, 5.0))
    ax.set_xlim(-2.4, n * 0.7 + 0.2), ax.set_ylim(-n * 0.6 - 1.1, 1.6), ax.axis("off")
    for i, q in enumerate(pieces):
        ax.text(-0.5, -0.6 * i, repr(q)[1:-1], ha="right", va="center", fontsize=9)
        for j in range(n):
            allowed = j <= i
            _cell(ax, 0.7 * j, -0.6 * i, "1" if allowed else "0",
                  RIGHT if allowed else "white", size=8, w=0.7, h=0.6)
    for j, k in enumerate(pieces):
        ax.text(0.7 * j, 0.4, repr(k)[1:-1], ha="center", va="bottom", fontsize=9, rotation=90)
    ax.text(0.35 * (n - 1), 1.35, "keys (columns)", ha="center", fontsize=9, weight="bold")
    ax.text(-2.3, 0.9, "queries\n(rows)", ha="left", fontsize=9, weight="bold")
    ax.text(0.35 * (n - 1) - 0.8, -0.6 * n - 0.3, "1: may attend (the key is this token or an "
            "earlier one)\n0: score set to -inf before the softmax, weight 0", ha="center",
            va="top", fontsize=8)
    _save(fig, out_dir / "ch02_causal_mask.png")


def temperature_diagram(out_dir):
    """Chapter 2, section 9: softmax(z / T) of one logit row at three temperatures."""
    names, z = list(LOGITS), list(LOGITS.values())
    temps = (0.5, 1.0, 2.0)
    fig, axes = plt.subplots(1, len(temps), figsize=(10.0, 2.8), sharey=True)
    for ax, t in zip(axes, temps):
        probs = _softmax(z, t)
        bars = ax.bar(names, probs, color="#8ab4f8", edgecolor=GREY)
        for bar, p in zip(bars, probs):
            ax.text(bar.get_x() + bar.get_width() / 2, p + 0.02, f"{p:.2f}", ha="center",
                    fontsize=8)
        ax.set_title(f"T = {t}", fontsize=10)
        ax.set_ylim(0, 1.0), ax.spines[["top", "right"]].set_visible(False)
    axes[0].set_ylabel("probability")
    fig.suptitle("softmax(z / T) for logits z = " + ", ".join(f"{v:g}" for v in z)
                 + " (tokens a to e)", fontsize=10)
    fig.tight_layout()
    _save(fig, out_dir / "ch02_temperature.png")


def top_p_diagram(out_dir):
    """Chapter 2, section 9: the nucleus cut (_nucleus_keep's rule) at top_p = 0.7."""
    top_p = 0.7
    probs = sorted(zip(_softmax(list(LOGITS.values())), LOGITS), reverse=True)
    before = [sum(p for p, _ in probs[:i]) for i in range(len(probs))]
    keep = [b < top_p for b in before]
    kept_mass = sum(p for (p, _), k in zip(probs, keep) if k)
    fig, ax = plt.subplots(figsize=(7.6, 3.4))
    xs = range(len(probs))
    ax.bar(xs, [p for p, _ in probs], color=["#8ab4f8" if k else "#dadce0" for k in keep],
           edgecolor=GREY)
    ax.step([x - 0.5 for x in xs] + [len(probs) - 0.5], before + [1.0], where="post",
            color="#e37400", label="mass of the better tokens (before this one)")
    ax.axhline(top_p, color="#d93025", linestyle="--", label=f"top_p = {top_p}")
    for x, ((p, _name), _b, k) in enumerate(zip(probs, before, keep)):
        label = f"{p:.2f}\n-> {p / kept_mass:.2f}" if k else f"{p:.2f}\ncut"
        ax.text(x, p + 0.03, label, ha="center", fontsize=8)
    ax.set_xticks(list(xs), [f"{name}\nbefore {b:.2f}" for (_, name), b in zip(probs, before)],
                  fontsize=8)
    ax.set_ylim(0, 1.1), ax.set_ylabel("probability (T = 1)")
    ax.spines[["top", "right"]].set_visible(False)
    ax.legend(fontsize=8, loc="upper left")
    ax.set_title(f"kept while the mass before a token is < {top_p}; kept mass {kept_mass:.2f}, "
                 "renormalised (->)", fontsize=9)
    fig.tight_layout()
    _save(fig, out_dir / "ch02_top_p.png")


def kv_cache_diagram(out_dir):
    """Chapter 2, section 10: the cache grows one key/value column per decoded token."""
    prompt, steps = 4, 3
    fig, ax = plt.subplots(figsize=(10.0, 3.4))
    ax.set_xlim(-3.0, 12.4), ax.set_ylim(-0.9, 4.2), ax.axis("off")
    ax.text(2.6, 3.85, "keys and values in the cache (one column per token)", ha="center",
            fontsize=9, weight="bold")
    ax.text(9.4, 3.85, "positions run through the model", ha="center", fontsize=9,
            weight="bold")
    ax.text(8.6, 3.45, "with cache", ha="center", fontsize=8)
    ax.text(10.4, 3.45, "without", ha="center", fontsize=8)
    totals = [0, 0]
    for r in range(steps + 1):
        y = 2.9 - 0.85 * r
        length = prompt + r
        new = range(prompt) if r == 0 else [length - 1]
        ax.text(-0.6, y, "prefill" if r == 0 else f"decode step {r}", ha="right", va="center",
                fontsize=9)
        for j in range(length):
            name = f"p{j + 1}" if j < prompt else f"t{j - prompt + 1}"
            _cell(ax, 0.8 * j, y, name, COLORS["model"] if j in new else COLORS["none"], w=0.75)
        fed, naive = len(new), length
        totals[0] += fed
        totals[1] += naive
        ax.text(8.6, y, str(fed), ha="center", va="center", fontsize=10)
        ax.text(10.4, y, str(naive), ha="center", va="center", fontsize=10)
    ax.text(8.6, -0.55, f"sum {totals[0]}", ha="center", fontsize=9, weight="bold")
    ax.text(10.4, -0.55, f"sum {totals[1]}", ha="center", fontsize=9, weight="bold")
    ax.text(2.6, -0.55, "orange: computed this step; grey: read from the cache", ha="center",
            fontsize=8, color=GREY)
    _save(fig, out_dir / "ch02_kv_cache_steps.png")


# --- chapter 9 ---------------------------------------------------------------------------------


def step_check_diagram(out_dir):
    """Chapter 9, section 2: the notebook's trace with the right answer and wrong steps."""
    from reasoning_from_scratch.evaluation import step_verdicts

    problem, reference = "Compute (((78+87)+3)-89)+74", "153"
    steps = ["78+87=165", "165+3=168", "168-89=89", "89+74=153"]
    completion = (" <think>\n" + "".join(f"Step {i + 1}: {s}\n" for i, s in enumerate(steps))
                  + "</think>\n\\boxed{153}")
    verdicts = step_verdicts(problem, completion)
    fig, ax = _canvas(9.8, 2.8)
    ax.text(0.2, 3.25, f"{problem}   (reference {reference})", fontsize=10, weight="bold")
    for i, (s, ok) in enumerate(zip(steps, verdicts)):
        y = 2.6 - 0.55 * i
        _cell(ax, 1.9, y, f"Step {i + 1}: {s}", RIGHT if ok else WRONG, size=9, w=3.0, h=0.45)
        lhs, rhs = s.split("=")
        x, op, y2 = re.fullmatch(r"(\d+)([+-])(\d+)", lhs).groups()
        true = int(x) + int(y2) if op == "+" else int(x) - int(y2)
        ax.text(3.6, y, "right" if ok else f"wrong: {lhs} = {true}, not {rhs}", va="center",
                fontsize=9)
    _cell(ax, 1.9, 0.35, "\\boxed{153}", RIGHT, size=9, w=3.0, h=0.45)
    ax.text(3.6, 0.35, "= reference", va="center", fontsize=9)
    k1 = _box(ax, 10.2, 2.45, "answer check:\nkept", "check", w=2.6, h=0.8)
    k2 = _box(ax, 10.2, 0.95, "answer + every step\n(check_steps=True): dropped", "none", w=3.4,
              h=0.8)
    _arrow(ax, (7.5, 1.9), (k1[0] - 1.35, k1[1]))
    _arrow(ax, (7.5, 1.3), (k2[0] - 1.75, k2[1]))
    ax.text(10.2, 0.2, "the two slips cancel: the answer alone cannot tell", ha="center",
            fontsize=8, color=GREY)
    _save(fig, out_dir / "ch09_step_check.png")


def trace_to_pair_diagram(out_dir):
    """Chapter 9, section 3: a stored trace -> an SFT document -> a (prompt, completion) pair."""
    from reasoning_from_scratch.prompts import render_prompt

    tok = _tokenizer()
    problem, completion = "Compute 45+32", " <think>\nStep 1: 45+32=77\n</think>\n\\boxed{77}"
    prompt_ids = tok.encode(render_prompt(problem))
    completion_ids = tok.encode(completion) + [tok.eos_token_id]
    fig, ax = _canvas(10.0, 2.4)
    r = _box(ax, 1.6, 1.5, f'trace (JSONL)\nproblem: "{problem}"\nanswer: "77"\n'
             'completion: the teacher\'s text', "data", w=3.0, h=1.5, size=8)
    d = _box(ax, 5.6, 1.5, "document\nprompt = render_prompt(problem)\n"
             "completion = the trace's completion", "data", w=3.4, h=1.3, size=8)
    p = _box(ax, 10.0, 2.2, f"prompt ids: {len(prompt_ids)} tokens\n(input only, target -100)",
             "none", w=3.4, h=0.8, size=8)
    c = _box(ax, 10.0, 0.8, f"completion ids + EOS: {len(completion_ids)} tokens\n"
             "(the loss is on these)", "out", w=3.4, h=0.8, size=8)
    _arrow(ax, (r[0] + 1.55, r[1]), (d[0] - 1.75, d[1]), "traces_to_\ndocuments", size=7)
    _arrow(ax, (d[0] + 1.75, d[1] + 0.2), (p[0] - 1.75, p[1]))
    _arrow(ax, (d[0] + 1.75, d[1] - 0.2), (c[0] - 1.75, c[1]))
    ax.text(7.85, 1.5, "tokenize_\ndocuments", ha="center", va="center", fontsize=7)
    _save(fig, out_dir / "ch09_trace_to_pair.png")


def scored_share_diagram(out_dir):
    """Chapter 9, section 1: which tokens of section 1's real document the loss scores."""
    from reasoning_from_scratch.prompts import render_prompt

    tok = _tokenizer()
    completion = " <think>\nStep 1: 2+3=5\nStep 2: 5*4=20\n</think>\n\\boxed{20}"
    n_prompt = len(tok.encode(render_prompt("Compute (2+3)*4")))
    n_completion = len(tok.encode(completion)) + 1  # with EOS
    n = n_prompt + n_completion
    fig, ax = plt.subplots(figsize=(10.0, 1.8))
    ax.set_xlim(-1, n + 1), ax.set_ylim(-1.2, 1.6), ax.axis("off")
    for j in range(n):
        scored = j >= n_prompt
        ax.add_patch(plt.Rectangle((j, 0), 0.9, 0.8, facecolor=RIGHT if scored else
                                   COLORS["none"], edgecolor=GREY, linewidth=0.4))
    ax.text(n_prompt / 2, 1.05, f"prompt: {n_prompt} tokens, target -100", ha="center",
            fontsize=9)
    ax.text(n_prompt + n_completion / 2, 1.05, f"completion + EOS: {n_completion} tokens, "
            "scored", ha="center", fontsize=9)
    ax.text(n / 2, -0.55, f"the loss is the mean cross-entropy over the {n_completion} green "
            f"tokens ({100 * n_completion / n:.0f}% of the document)", ha="center", fontsize=9)
    _save(fig, out_dir / "ch09_scored_share.png")


# The counts chapter 9's notebook prints in sections 2 to 4 (one seed, 600 training problems).
SECTION4 = {"samples": 2400, "student": (281, 233, 178, 166, 0.54),
            "teacher": (808, 384, 292, 279, 0.57), "base": 0.22, "teacher_acc": 0.51}


def experiment_diagram(out_dir):
    """Chapter 9, section 4: the data flow of the notebook's teacher-vs-self experiment."""
    s = SECTION4
    fig, ax = _canvas(10.8, 3.4)
    base = _box(ax, 1.4, 2.2, f"base model\n(tiny-arith)\naccuracy {s['base']:.2f}", "model",
                w=2.2, h=1.1, size=8)
    rows = [("teacher: 20 GRPO\nsteps", s["teacher"], 3.55, f"{s['teacher_acc']:.2f}",
             "distilled"), ("student as its\nown teacher", s["student"], 0.85, None,
                            "self-distilled")]
    for name, (right, distinct, checked, train, acc), y, t_acc, who in rows:
        label = name + (f"\naccuracy {t_acc}" if t_acc else "")
        t = _box(ax, 4.3, y, label, "model", w=2.2, h=1.0, size=8)
        _arrow(ax, (base[0] + 1.15, base[1] + (0.3 if y > 2 else -0.3)), (t[0] - 1.15, t[1]))
        f = _box(ax, 7.9, y, f"{s['samples']} samples (600 x 4)\n{right} right answers\n"
                 f"{distinct} distinct, {checked} step-checked\n{train} for training",
                 "check", w=3.2, h=1.2, size=8)
        _arrow(ax, (t[0] + 1.15, t[1]), (f[0] - 1.65, f[1]))
        o = _box(ax, 11.9, y, f"{who} student\n40 SFT updates\naccuracy {acc:.2f}", "out",
                 w=2.4, h=1.0, size=8)
        _arrow(ax, (f[0] + 1.65, f[1]), (o[0] - 1.25, o[1]))
    ax.text(11.9, 2.2, "each student starts\nfrom a fresh copy of\nthe base model", ha="center",
            va="center", fontsize=8, color=GREY)
    _save(fig, out_dir / "ch09_experiment_flow.png")


def compute_diagram(out_dir):
    """Chapter 9, section 5: the student's work per training problem, distillation vs GRPO."""
    fig, ax = _canvas(10.4, 3.0)
    ax.text(0.2, 3.45, "distillation (per training problem)", fontsize=10, weight="bold")
    t = _box(ax, 1.9, 2.6, "teacher decodes 4\nsamples, once", "model", w=2.6, h=0.8, size=8)
    v = _box(ax, 5.1, 2.6, "verifier keeps\nthe right ones", "check", w=2.2, h=0.8, size=8)
    s = _box(ax, 8.6, 2.6, "student: forward + backward\non a kept trace (no decoding)", "out",
             w=3.4, h=0.8, size=8)
    _arrow(ax, (t[0] + 1.35, t[1]), (v[0] - 1.15, v[1]))
    _arrow(ax, (v[0] + 1.15, v[1]), (s[0] - 1.75, s[1]))
    ax.text(0.2, 1.45, "GRPO (per prompt, every step)", fontsize=10, weight="bold")
    d = _box(ax, 1.9, 0.6, "student decodes 8\nrollouts, token by token", "model", w=2.6,
             h=0.8, size=8)
    r = _box(ax, 5.1, 0.6, "rewards, group\nadvantages", "check", w=2.2, h=0.8, size=8)
    u = _box(ax, 8.6, 0.6, "forward + backward on all 8\n(updates, then sample again)", "out",
             w=3.4, h=0.8, size=8)
    _arrow(ax, (d[0] + 1.35, d[1]), (r[0] - 1.15, r[1]))
    _arrow(ax, (r[0] + 1.15, r[1]), (u[0] - 1.75, u[1]))
    ax.text(10.5, 2.6, "script: 2000 problems x 4 samples\n+ 300 updates = 135 s\n"
            "(docs/distill_vs_rl.md)", fontsize=8, color=GREY, va="center")
    ax.text(10.5, 0.6, "script: 150 steps x 16 prompts\nx 8 rollouts = 382 s\n"
            "(decoding repeats every step)", fontsize=8, color=GREY, va="center")
    _save(fig, out_dir / "ch09_compute_per_problem.png")


DIAGRAMS = (tokenize_diagram, rope_diagram, gqa_diagram, causal_mask_diagram,
            temperature_diagram, top_p_diagram, kv_cache_diagram, step_check_diagram,
            trace_to_pair_diagram, scored_share_diagram, experiment_diagram, compute_diagram)


def main(out_dir: Path = HERE) -> None:
    """Draw every diagram into `out_dir`."""
    out_dir = Path(out_dir)
    for draw in DIAGRAMS:
        draw(out_dir)
    print("drawn:", ", ".join(d.__name__ for d in DIAGRAMS))


if __name__ == "__main__":
    main()
