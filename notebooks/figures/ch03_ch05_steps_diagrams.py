"""Draw the step-by-step diagrams of the chapter 3, 4 and 5 notebooks (notebooks/figures/).

One step of an idea per figure, drawn with the numbers the notebooks print (the tiny model's
first-token probabilities, a vote's counts, a refinement history, pass@k of n = 16, c = 2).
The notebooks show the committed images. Redraw after changing a diagram:

    python notebooks/figures/ch03_ch05_steps_diagrams.py
"""

import math
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the shared helpers, when imported from elsewhere (tests)
from ch02_ch09_diagrams import _arrow, _box, _canvas, _save, draw_all  # noqa: E402

GREEN, RED, GREY, BLUE = "#34a853", "#d93025", "#9aa0a6", "#4285f4"


def _chain(ax, xs, y, items, w=1.6, h=1.0, size=8):
    """Boxes at xs joined left to right by arrows."""
    for x, (text, kind) in zip(xs, items):
        _box(ax, x, y, text, kind, w=w, h=h, size=size)
    for a, b in zip(xs, xs[1:]):
        _arrow(ax, (a + w / 2 + 0.02, y), (b - w / 2 - 0.02, y))


# --- chapter 3 ---------------------------------------------------------------------------------


def sampling_loop_diagram(out_dir):
    """Chapter 3: sample_response, one prefill then one token per step."""
    fig, ax = _canvas(10.4, 2.6)
    items = [("prompt ids (1, P)\nprefill: fill the\nKV cache", "data"),
             ("last logits (1, V)", "model"), ("divide by T\n(T = 0: argmax)", "check"),
             ("top-p: keep the\nsmallest top set\nwith mass >= p", "check"),
             ("draw one token\n(seeded generator)", "out")]
    xs = [1.15 + 2.55 * i for i in range(len(items))]
    _chain(ax, xs, 2.2, items, w=2.0, h=1.1)
    ax.annotate("", xy=(xs[1], 1.6), xytext=(xs[4], 1.6),
                arrowprops=dict(arrowstyle="->", color="#5f6368",
                                connectionstyle="arc3,rad=-0.25"))
    ax.text((xs[1] + xs[4]) / 2, 0.45, "not EOS: feed only this token (the cache holds the rest)",
            ha="center", fontsize=9, color="#3c4043")
    ax.text(xs[4], 3.1, "EOS or max_new_tokens: stop", ha="center", fontsize=9, color=RED)
    _save(fig, out_dir / "ch03_sampling_loop.png")


def temperature_top_p_diagram(out_dir):
    """Chapter 3: the tiny model's first token after "Answer:", under three settings."""
    labels = ["'\\n'\nsteps", "' \\\\'\n\\boxed", "' The'\nThe answer", "' '\n<think>"]
    panels = [("T = 1", [0.442, 0.234, 0.226, 0.094]),
              ("T = 0.5: sharper", [0.631, 0.177, 0.164, 0.029]),
              ("T = 1, top-p 0.9: tail cut", [0.490, 0.260, 0.250, 0.000])]
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.0), sharey=True)
    for ax, (title, probs) in zip(axes, panels):
        bars = ax.bar(range(4), probs, color=[BLUE, GREEN, GREY, "#fbbc04"])
        for b, p in zip(bars, probs):
            ax.text(b.get_x() + b.get_width() / 2, p + 0.01, f"{p:.3f}", ha="center", fontsize=8)
        ax.set_xticks(range(4), labels, fontsize=7)
        ax.set_title(title, fontsize=10)
        ax.set_ylim(0, 0.72)
    axes[0].set_ylabel("probability")
    fig.tight_layout()
    _save(fig, out_dir / "ch03_temperature_top_p.png")


def last_boxed_diagram(out_dir):
    """Chapter 3: get_last_boxed counts braces from the last \\boxed{."""
    text = "first \\boxed{1}, then \\boxed{\\frac{1}{2}}"
    start = text.rfind("\\boxed{") + len("\\boxed{")
    fig, ax = plt.subplots(figsize=(10, 2.2))
    ax.set_xlim(-0.5, len(text) + 0.5)
    ax.set_ylim(-1.6, 1.5)
    ax.axis("off")
    depth = 1
    for j, ch in enumerate(text):
        inside = j >= start
        if inside and ch == "{":
            depth += 1
        elif inside and ch == "}":
            depth -= 1
        color = "#e6f4ea" if start <= j and (depth > 0 or ch != "}") else "#f1f3f4"
        if inside and ch == "}" and depth == 0:
            color = "#fde8d7"
        ax.add_patch(plt.Rectangle((j - 0.45, -0.4), 0.9, 0.8, facecolor=color,
                                   edgecolor="#dadce0"))
        ax.text(j, 0, ch, ha="center", va="center", fontsize=9, family="monospace")
        if inside:
            ax.text(j, -0.75, str(depth), ha="center", fontsize=7, color="#3c4043")
    ax.text(start - 0.5, -0.75, "depth:", ha="right", fontsize=7, color="#3c4043")
    ax.annotate("rfind: the last \\boxed{", xy=(start - 4, 0.45), xytext=(start - 10, 1.2),
                fontsize=8, arrowprops=dict(arrowstyle="->", color="#5f6368"))
    ax.annotate("depth 0: stop -> \\frac{1}{2}", xy=(len(text) - 1, 0.45),
                xytext=(len(text) - 9, 1.2), fontsize=8,
                arrowprops=dict(arrowstyle="->", color="#5f6368"))
    ax.text(3, -1.35, "the earlier \\boxed{1} is an intermediate result: ignored", fontsize=8,
            color=GREY)
    _save(fig, out_dir / "ch03_last_boxed.png")


def grading_steps_diagram(out_dir):
    """Chapter 3: grade_answer's two tests on five of the notebook's cases."""
    rows = [("0.5", "\\frac{1}{2}", "0.5 | \\frac{1}{2}", "no", "1/2 = 1/2", True),
            ("\\dfrac{1}{2}", "1/2", "\\frac{1}{2} | 1/2", "no", "1/2 = 1/2", True),
            ("90^\\circ", "90", "90 | 90", "yes", "-", True),
            ("-7", "7", "-7 | 7", "no", "-7 != 7", False),
            ("''", "42", "'' | 42", "empty", "-", False)]
    heads = ["prediction", "reference", "normalize_text", "same text?", "as Fractions",
             "verdict"]
    xs = [0.9, 2.6, 4.7, 6.9, 8.7, 10.4]
    fig, ax = _canvas(9.6, 2.9)
    for x, h in zip(xs, heads):
        ax.text(x, 3.3, h, ha="center", fontsize=9, weight="bold")
    for i, row in enumerate(rows):
        y = 2.7 - 0.55 * i
        for x, value in zip(xs[:5], row[:5]):
            ax.text(x, y, value, ha="center", va="center", fontsize=9, family="monospace")
        ax.text(xs[5], y, "True" if row[5] else "False", ha="center", va="center", fontsize=9,
                color=GREEN if row[5] else RED, weight="bold")
    _save(fig, out_dir / "ch03_grading_steps.png")


# --- chapter 4 ---------------------------------------------------------------------------------


def batched_sampling_diagram(out_dir):
    """Chapter 4: self_consistency_vote_batch, one batch of 20 prompts x 16 samples."""
    fig, ax = _canvas(10.4, 2.2)
    items = [("20 prompts,\nleft-padded\n(20, P)", "data"), ("one prefill:\nKV cache\n20 rows",
                                                               "model"),
             ("cache rows\nrepeated 16x:\n320 rows", "model"),
             ("decode 320 rows\ntogether, each\nto its EOS", "model"),
             ("extract boxed\nanswers (None:\nno box)", "check"),
             ("vote per prompt\nover its 16", "out")]
    xs = [0.95 + 2.12 * i for i in range(len(items))]
    _chain(ax, xs, 1.4, items, w=1.75, h=1.15)
    ax.text(xs[3], 0.35, "rows n*16 .. n*16 + 15 belong to prompt n", ha="center", fontsize=8,
            color="#3c4043")
    _save(fig, out_dir / "ch04_batched_sampling.png")


def pass_at_k_diagram(out_dir):
    """Chapter 4: pass@k of n = 16 samples with c = 2 right, against k."""
    n, c = 16, 2
    ks = list(range(1, n + 1))
    ys = [1 - math.comb(n - c, k) / math.comb(n, k) for k in ks]
    fig, ax = plt.subplots(figsize=(6.2, 3.0))
    ax.plot(ks, ys, marker="o", color=BLUE, markersize=4)
    for k in (1, 4, 16):
        y = ys[k - 1]
        ax.annotate(f"pass@{k} = {y:.3f}", (k, y), xytext=(k + 0.6, y - 0.1), fontsize=8)
    ax.set_xlabel("k: samples we may look at")
    ax.set_ylabel("pass@k")
    ax.set_title("n = 16 samples, c = 2 right: 1 - C(14, k) / C(16, k)", fontsize=10)
    ax.set_ylim(0, 1.08)
    fig.tight_layout()
    _save(fig, out_dir / "ch04_pass_at_k.png")


def vote_counts_diagram(out_dir):
    """Chapter 4: the vote on (24-15)-7 after 12 samples (early stopping stopped there)."""
    answers = ["2", "3", "5", "17", "no box"]
    counts = [6, 1, 1, 1, 3]
    fig, ax = plt.subplots(figsize=(6.2, 2.8))
    colors = [GREEN, GREY, GREY, GREY, "#dadce0"]
    bars = ax.bar(answers, counts, color=colors)
    for b, v in zip(bars, counts):
        ax.text(b.get_x() + b.get_width() / 2, v + 0.1, str(v), ha="center", fontsize=9)
    ax.set_ylabel("samples")
    ax.set_title("(24-15)-7 = 2: 12 samples; the unboxed 3 cast no vote", fontsize=10)
    ax.set_ylim(0, 7.5)
    fig.tight_layout()
    _save(fig, out_dir / "ch04_vote_counts.png")


def early_stop_diagram(out_dir):
    """Chapter 4: majority_is_decided after the third chunk of 4 on (24-15)-7."""
    fig, ax = plt.subplots(figsize=(6.2, 2.6))
    ax.barh([1], [6], color=GREEN, label="leader '2'")
    ax.barh([0], [1], color=GREY, label="runner-up")
    ax.barh([0], [4], left=[1], color="#fbbc04", label="all 4 samples still to come")
    ax.set_yticks([0, 1], ["runner-up + to come", "leader"])
    ax.text(6.1, 1, "6", va="center")
    ax.text(5.1, 0, "1 + 4 = 5", va="center")
    ax.set_xlim(0, 11)
    ax.set_xlabel("votes")
    ax.set_title("after 12 of 16 samples: 6 > 5, so no draw can change the winner",
                 fontsize=10)
    ax.legend(fontsize=8, loc="center right")
    fig.tight_layout()
    _save(fig, out_dir / "ch04_early_stop.png")


# --- chapter 5 ---------------------------------------------------------------------------------


def confidence_diagram(out_dir):
    """Chapter 5: mean log-probability of the answer tokens, a right and a wrong box."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 2.8))
    ax = axes[0]
    ax.bar(["right box\n\\boxed{172}", "wrong box\n\\boxed{182}"], [-0.063, -0.233],
           color=[GREEN, RED])
    for x, v in enumerate([-0.063, -0.233]):
        ax.text(x, v - 0.02, f"{v:.3f}", ha="center", va="top", fontsize=9)
    ax.set_ylim(-0.3, 0)
    ax.set_title("the same worked steps, one answer changed", fontsize=9)
    ax.set_ylabel("mean log-prob of the answer")
    ax = axes[1]
    ax.bar(["83 correct\nsamples", "557 wrong\nsamples"], [-0.089, -0.448], color=[GREEN, RED])
    for x, v in enumerate([-0.089, -0.448]):
        ax.text(x, v - 0.02, f"{v:.3f}", ha="center", va="top", fontsize=9)
    ax.set_ylim(-0.55, 0)
    ax.set_title("640 samples at T = 1: mean confidence", fontsize=9)
    fig.tight_layout()
    _save(fig, out_dir / "ch05_confidence.png")


def best_of_n_pick_diagram(out_dir):
    """Chapter 5: best-of-N picks the completion with the highest aggregated step score."""
    fig, ax = _canvas(10.0, 2.8)
    rows = [("Steps 1-3 verified,\n\\boxed{172}", "[1, 1, 1, 1]", "1.0", True),
            ("Steps 1-3 verified,\n\\boxed{182}", "[1, 1, 1, 0]", "0.0", False),
            ("\\boxed{166}\n(no steps)", "[0.0]", "0.0", False)]
    for i, (text, steps, score, picked) in enumerate(rows):
        y = 2.9 - 1.0 * i
        _box(ax, 1.6, y, text, "model", w=2.6, h=0.8, size=8)
        _box(ax, 5.0, y, f"step scores\n{steps}", "check", w=2.4, h=0.8, size=8)
        _box(ax, 8.0, y, f"min = {score}", "out" if picked else "none", w=1.6, h=0.6, size=9)
        _arrow(ax, (2.95, y), (3.75, y), "verifier")
        _arrow(ax, (6.25, y), (7.15, y))
    _arrow(ax, (8.85, 2.9), (10.1, 2.9))
    ax.text(10.2, 2.9, "select_best:\nindex 0, 172\n(ties: earliest)", va="center", fontsize=9,
            color=GREEN)
    _save(fig, out_dir / "ch05_best_of_n_pick.png")


def refinement_history_diagram(out_dir):
    """Chapter 5: the verifier-critic history of ((((13*7)*6)-79)+79)+76 = 622."""
    history = [(None, 85, None), ("661", 173, 0), ("602", 231, 2), ("622", 289, 2),
               ("761", 347, 2)]
    fig, ax = _canvas(11.6, 2.4)
    xs = [1.3 + 2.95 * i for i in range(len(history))]
    for r, (x, (answer, tokens, step)) in enumerate(zip(xs, history)):
        label = "no box" if answer is None else answer
        kind = "check" if answer == "622" else "none"
        head = ("round 0: greedy draft" if r == 0
                else f"round {r}: resampled\nfrom step index {step}")
        _box(ax, x, 1.7, f"{head}\nanswer {label}\n{tokens} tokens so far", kind, w=2.2, h=1.2,
             size=8)
    for a, b in zip(xs, xs[1:]):
        _arrow(ax, (a + 1.12, 1.7), (b - 1.12, 1.7))
    ax.text(xs[2], 2.6, "each arrow: the verifier rejects a step; the model resamples from it",
            ha="center", fontsize=9, color="#3c4043")
    ax.text(xs[3], 0.65, "right, but the verifier rejects a step\n(two slips that cancelled)",
            ha="center", fontsize=8, color=RED)
    ax.text(xs[4], 0.65, "round limit: the last\nanswer is returned", ha="center", fontsize=8,
            color=RED)
    _save(fig, out_dir / "ch05_refinement_history.png")


def token_cost_diagram(out_dir):
    """Chapter 5: accuracy against generated tokens per problem (docs/inference_scaling.md)."""
    points = [("self-consistency, N = 32", 1032, 0.525), ("best-of-32, step verifier", 1032, 0.665),
              ("beam search, step verifier, N = 16", 567, 0.710),
              ("self-refinement, verifier critic,\n32 rounds", 339, 0.710)]
    fig, ax = plt.subplots(figsize=(6.8, 3.2))
    offsets = [(8, -4), (8, -4), (8, 4), (4, -34)]
    for (label, tokens, acc), color, off in zip(points, [GREY, BLUE, "#fbbc04", GREEN], offsets):
        ax.scatter([tokens], [acc], s=60, color=color)
        ax.annotate(f"{label}\n{acc:.3f} at {tokens} tokens", (tokens, acc),
                    xytext=off, textcoords="offset points", fontsize=7)
    ax.set_xlim(200, 1700)
    ax.set_ylim(0.45, 0.78)
    ax.set_xlabel("generated tokens per problem")
    ax.set_ylabel("accuracy")
    ax.set_title("base model, 200 held-out problems (docs/inference_scaling.md)", fontsize=9)
    fig.tight_layout()
    _save(fig, out_dir / "ch05_token_cost.png")


DIAGRAMS = {"ch03_sampling_loop.png": sampling_loop_diagram,
            "ch03_temperature_top_p.png": temperature_top_p_diagram,
            "ch03_last_boxed.png": last_boxed_diagram,
            "ch03_grading_steps.png": grading_steps_diagram,
            "ch04_batched_sampling.png": batched_sampling_diagram,
            "ch04_pass_at_k.png": pass_at_k_diagram,
            "ch04_vote_counts.png": vote_counts_diagram,
            "ch04_early_stop.png": early_stop_diagram,
            "ch05_confidence.png": confidence_diagram,
            "ch05_best_of_n_pick.png": best_of_n_pick_diagram,
            "ch05_refinement_history.png": refinement_history_diagram,
            "ch05_token_cost.png": token_cost_diagram}


def main(out_dir: Path = HERE) -> None:
    """Draw every diagram into `out_dir`."""
    draw_all(DIAGRAMS, out_dir)


if __name__ == "__main__":
    main()
