"""Draw the diagrams of the chapter 8 notebook (notebooks/figures/ch08_*.png).

Boxes and arrows (the helpers of ch02_ch09_diagrams.py) and one completion's tokens coloured by
their advantage, with the numbers the notebook works out by hand in section 5; the notebook
shows the committed images. Redraw after changing a diagram:

    python notebooks/figures/ch08_diagrams.py
"""

import re
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import TwoSlopeNorm  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the shared helpers, when imported from elsewhere (tests)
from ch02_ch09_diagrams import _arrow, _box, _canvas, _save  # noqa: E402

# The hand-made group's answer whose second step is wrong (notebook section 5), step by step.
STEPS = [" <think>\nStep 1: 14+20=34\n", "Step 2: 34*2=64\n", "Step 3: 64+8=72\n",
         "</think>\n\\boxed{72}<|endoftext|>"]
# The tiny tokenizer's pieces: its special and word tokens, else one character per token.
TOKEN = re.compile(r"<\|endoftext\|>|</?think>|Step|boxed|.", re.S)
# Its outcome advantage: reward 0 in the group's rewards [1.5, 0, 0, 1] (mean 0.625, std 0.75).
OUTCOME = (0.0 - 0.625) / (0.75 + 1e-4)
# Its progress credit per step (alpha 1): (c_k (1 + V_k) - V_k-1) / std(M), with the group's
# verified steps M = [4, 1, 0, 0] (std 1.893) and values V = [1.25, 1.5, 2, 1]; 0 after the slip.
STD_M = (10.75 / 3) ** 0.5 + 1e-4
CREDIT = [(1 + 1.5 - 1.25) / STD_M, (0 - 1.5) / STD_M, 0.0, 0.0]


def _token_row(ax, y, values, title):
    """One row of token boxes at height y, each coloured by its step's value."""
    norm, cmap = TwoSlopeNorm(vmin=-2.0, vcenter=0.0, vmax=2.0), plt.get_cmap("RdBu")
    k = 0
    for step, value in zip(STEPS, values):
        tokens = TOKEN.findall(step)
        for t in tokens:
            ax.add_patch(plt.Rectangle((k, y), 0.95, 1, facecolor=cmap(norm(value)),
                                       edgecolor="none"))
            label = t.replace("\n", "\u23ce").replace("<|endoftext|>", "EOS")
            ax.text(k + 0.47, y + 0.5, label, ha="center", va="center", fontsize=6.5,
                    rotation=90)
            k += 1
        ax.text(k - len(tokens) / 2, y + 1.12, f"{value:+.3f}", ha="center", fontsize=8)
    ax.text(-1.0, y + 0.5, title, ha="right", va="center", fontsize=8.5)
    return k


def credit_diagram(out_dir):
    """Outcome credit vs step credit on the same completion: flat, or step by step."""
    fig, ax = plt.subplots(figsize=(12.5, 3.4))
    rows = [([OUTCOME] * 4, "outcome advantage\n(chapters 6-7): flat"),
            (CREDIT, "progress credit\nper step"),
            ([OUTCOME + c for c in CREDIT], "outcome + progress\n(the recommended form)")]
    for r, (values, title) in enumerate(rows):
        n = _token_row(ax, 2.0 * (len(rows) - 1 - r), values, title)
    k = 0
    for j, step in enumerate(STEPS):
        size = len(TOKEN.findall(step))
        ax.text(k + size / 2, -0.55, f"step {j + 1}" + (" (wrong: 34*2=64)" if j == 1 else ""),
                ha="center", fontsize=8)
        k += size
    ax.set_xlim(-9.5, n + 0.5)
    ax.set_ylim(-0.9, 2.0 * len(rows) - 0.6)
    ax.axis("off")
    ax.set_title("one wrong answer whose first step is right: every token pays the same "
                 "(top), or each step pays its own part (middle, bottom); red < 0 < blue",
                 fontsize=9)
    _save(fig, out_dir / "ch08_outcome_vs_step_credit.png")


def hook_diagram(out_dir):
    """Where the advantage hook sits in chapter 7's collect_rollouts and loss."""
    fig, ax = _canvas(11.0, 3.0)
    steps = [("sample G answers\nper prompt", "model"),
             ("score: reward_fn\nrewards (N, G)", "check"),
             ("outcome advantages\nA (N, G), per group", "data"),
             ("pack: ids (B, L),\nmask (B, T)", "data"),
             ("clipped surrogate\nper token -> loss", "out")]
    xs = [1.3 + 2.75 * i for i in range(len(steps))]
    y = 2.9
    for x, (text, kind) in zip(xs, steps):
        _box(ax, x, y, text, kind, w=2.3, h=1.0, size=8)
    for a, b in zip(xs[:3], xs[1:4]):
        _arrow(ax, (a + 1.2, y), (b - 1.2, y))
    _arrow(ax, (xs[3] + 1.2, y), (xs[4] - 1.2, y))
    ax.text(xs[4], y + 0.65, "no hook: A_i on every token of answer i", ha="center",
            fontsize=7.5, color="#3c4043")
    hook = _box(ax, xs[3], 0.85, "advantage_fn(groups, A, mask) -> (B, T):\nsplit each answer "
                "into steps, score them,\nA_i + alpha x credit of step k(t)", "check", w=4.4,
                h=1.1, size=8)
    _arrow(ax, (xs[2], y - 0.55), (hook[0] - 1.4, hook[1] + 0.6), "A")
    _arrow(ax, (xs[3], y - 0.55), (xs[3], hook[1] + 0.6), "mask")
    _arrow(ax, (hook[0] + 2.25, hook[1]), (xs[4], y - 0.55))
    ax.text(xs[4] + 0.1, 1.2, "(B, T) token advantages;\na group whose token\n"
            "advantages are all 0\nis dropped", fontsize=7.5, color="#3c4043")
    ax.text(xs[0] - 1.1, 1.0, "collect_rollouts\n(chapter 7);\nchapter 8 plugs\nits credit into\n"
            "the hook", fontsize=8, color="#d93025", va="center")
    _save(fig, out_dir / "ch08_advantage_hook.png")


DIAGRAMS = {"ch08_outcome_vs_step_credit.png": credit_diagram,
            "ch08_advantage_hook.png": hook_diagram}


def main(out_dir: Path = HERE) -> None:
    """Draw every diagram into `out_dir`."""
    for name, draw in DIAGRAMS.items():
        draw(Path(out_dir))
        print("drawn:", name)


if __name__ == "__main__":
    main()
