"""Draw the second diagram of the chapter 3, 4, 5 and 9 notebooks (notebooks/figures/chNN_*.png).

Each explains the chapter's central idea on a small worked case: grading cases (chapter 3),
pass@k against majority voting (chapter 4), beam search guided by step scores (chapter 5) and
which positions the distillation loss scores (chapter 9). Boxes and grids use the helpers of
ch02_ch09_diagrams.py; the notebooks show the committed images. Redraw after a change:

    python notebooks/figures/ch03_ch09_ideas_diagrams.py
"""

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the shared helpers, when imported from elsewhere (tests)
from ch02_ch09_diagrams import COLORS, _arrow, _box, _canvas, _cell, _save  # noqa: E402

RIGHT, WRONG = "#b7e1c1", "#f4c7c3"


def grading_cases_diagram(out_dir):
    """Chapter 3: four completions, what is extracted, normalised and graded (reference 1/2)."""
    fig, ax = _canvas(10.0, 3.4)
    cases = [("... so \\boxed{\\frac{1}{2}}", "\\frac{1}{2}", "1/2", "equal (exact)", 1),
             ("... \\boxed{0.5}", "0.5", "0.5", "equal (sympy: 0.5 = 1/2)", 1),
             ("The answer is 1/2.", "none (no box)", "-", "strict: no answer", 0),
             ("\\boxed{2} ... \\boxed{1/3}", "1/3 (the last box)", "1/3", "not equal", 0)]
    heads = ["completion", "extracted", "normalised", "graded against 1/2", "reward"]
    xs, widths = [1.6, 4.6, 7.0, 9.3, 11.6], [3.0, 2.6, 1.8, 2.6, 1.0]
    for x, head in zip(xs, heads):
        ax.text(x, 3.95, head, ha="center", fontsize=9, weight="bold")
    for i, row in enumerate(cases):
        y = 3.3 - 0.85 * i
        for j, (x, w, text) in enumerate(zip(xs, widths, row[:4] + (str(row[4]),))):
            kind = "data" if j == 0 else "check"
            if j == 4:
                kind = "out" if row[4] else "none"
            _box(ax, x, y, text, kind, w=w, h=0.6, size=8)
        for a, b, wa, wb in zip(xs, xs[1:], widths, widths[1:]):
            _arrow(ax, (a + wa / 2 + 0.05, y), (b - wb / 2 - 0.05, y))
    _save(fig, out_dir / "ch03_grading_cases.png")


def pass_vs_majority_diagram(out_dir):
    """Chapter 4: the same 8 samples of three problems scored by pass@8 and by majority@8."""
    fig, ax = plt.subplots(figsize=(10.0, 3.0))
    ax.set_xlim(-3.2, 14.0), ax.set_ylim(-0.9, 3.4), ax.axis("off")
    problems = [("problem 1 (ref 12)", ["12", "12", "9", "12", "12", "7", "12", "12"]),
                ("problem 2 (ref 40)", ["36", "40", "36", "36", "-", "38", "36", "36"]),
                ("problem 3 (ref 5)", ["6", "8", "-", "6", "3", "6", "4", "6"])]
    for i, (name, answers) in enumerate(problems):
        y = 2.4 - 1.0 * i
        ref = name.split("ref ")[1].rstrip(")")
        ax.text(-0.7, y, name, ha="right", va="center", fontsize=9)
        for j, a in enumerate(answers):
            _cell(ax, j, y, a, RIGHT if a == ref else WRONG if a != "-" else COLORS["none"])
        top = max(set(answers) - {"-"}, key=answers.count)
        passed, voted = ref in answers, top == ref
        ax.text(8.6, y, "1" if passed else "0", ha="center", va="center", fontsize=10)
        ax.text(10.9, y, f"{top} -> {int(voted)}", ha="center", va="center", fontsize=10)
    ax.text(3.5, 3.15, "8 sampled answers (green: right, -: no box)", ha="center", fontsize=9,
            weight="bold")
    ax.text(8.6, 3.15, "pass@8", ha="center", fontsize=9, weight="bold")
    ax.text(10.9, 3.15, "majority@8", ha="center", fontsize=9, weight="bold")
    ax.text(5.4, -0.65, "pass@8 = 2/3: is any sample right?  majority@8 = 1/3: is the most "
            "common answer right?", ha="center", fontsize=9)
    _save(fig, out_dir / "ch04_pass_vs_majority.png")


def beam_search_diagram(out_dir):
    """Chapter 5: beam search over steps, width 2, each partial solution scored by a PRM."""
    fig, ax = _canvas(10.0, 3.6)
    root = _box(ax, 1.0, 2.25, "prompt", "data", w=1.4)
    levels = [[("47+38=85", 0.9, 1), ("47+38=75", 0.3, 0), ("38+47=85", 0.8, 1)],
              [("85*2=170", 0.9, 1), ("85*2=160", 0.2, 0), ("85*2=170", 0.85, 1),
               ("85*2=17", 0.1, 0)]]
    parents, x = [root], 4.0
    for depth, nodes in enumerate(levels):
        ys = [4.0 - 1.15 * k for k in range(len(nodes))]
        kept = []
        for k, ((text, score, keep), y) in enumerate(zip(nodes, ys)):
            kind = "check" if keep else "none"
            node = _box(ax, x, y, f"step {depth + 1}: {text}\nPRM {score}", kind, w=2.3, h=0.7,
                        size=8)
            parent = parents[min(k // 2, len(parents) - 1)]
            _arrow(ax, (parent[0] + 0.75 + 0.4 * depth, parent[1]), (node[0] - 1.2, node[1]))
            kept += [node] if keep else []
        parents, x = kept, x + 3.6
    best = _box(ax, 11.3, 2.85, "finish the best\nbeam: \\boxed{170}", "out", w=1.9, h=0.8)
    _arrow(ax, (parents[0][0] + 1.2, parents[0][1]), (best[0] - 1.0, best[1]))
    ax.text(5.8, -0.35, "each round: extend every kept partial solution by sampled next steps, "
            "score them, keep the 2 best (green); grey ones are dropped", ha="center",
            fontsize=8)
    _save(fig, out_dir / "ch05_beam_search.png")


def completion_loss_diagram(out_dir):
    """Chapter 9: which input positions the distillation loss scores, for one document."""
    fig, ax = plt.subplots(figsize=(10.5, 2.6))
    ax.set_xlim(-2.0, 12.6), ax.set_ylim(-0.9, 2.9), ax.axis("off")
    tokens = ["<prompt>", "Compute", "4*5", "<think>", "Step 1:", "4*5=20", "</think>",
              "\\boxed{20}", "EOS"]
    prompt_len = 3
    for j, tok in enumerate(tokens[:-1]):  # inputs: every token but the last
        _cell(ax, j * 1.35, 2.0, tok, COLORS["data"] if j < prompt_len else COLORS["out"],
              size=7, w=1.25)
    for j, tok in enumerate(tokens[1:]):  # target of input position j: token j + 1
        scored = j + 1 >= prompt_len
        _cell(ax, j * 1.35, 0.8, tok if scored else "-100", RIGHT if scored else COLORS["none"],
              size=7, w=1.25)
        _arrow(ax, (j * 1.35, 1.68), (j * 1.35, 1.12))
    ax.text(-0.9, 2.0, "inputs", ha="right", va="center", fontsize=9)
    ax.text(-0.9, 0.8, "targets", ha="right", va="center", fontsize=9)
    ax.text(4.7, -0.3, "position t predicts token t + 1; targets of prompt positions are -100 "
            "(ignored): the loss averages the green ones only", ha="center", fontsize=9)
    ax.text(1.35, 2.6, "prompt (input only)", ha="center", fontsize=9, weight="bold")
    ax.text(6.75, 2.6, "completion (learned, with its EOS)", ha="center", fontsize=9,
            weight="bold")
    _save(fig, out_dir / "ch09_completion_loss.png")


DIAGRAMS = (grading_cases_diagram, pass_vs_majority_diagram, beam_search_diagram,
            completion_loss_diagram)


def main(out_dir: Path = HERE) -> None:
    """Draw every diagram into `out_dir`."""
    for draw in DIAGRAMS:
        draw(out_dir)
    print("drawn:", ", ".join(d.__name__ for d in DIAGRAMS))


if __name__ == "__main__":
    main()
