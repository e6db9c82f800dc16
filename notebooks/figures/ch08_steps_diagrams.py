"""Draw the step-by-step diagrams of the chapter 8 notebooks (notebooks/figures/ch08_*.png).

One figure per step of process supervision, drawn with the numbers the tutorial works out on its
hand-made group for ((14+20)*2)+8 = 76 (split, verifier, backfill, progress credit, a branch), and
for the experiment notebook the three credits of one completion, the comparison's design, the
format control and the spread of six seeds (read from docs/process_vs_outcome_fixed.json). The
notebooks show the committed images. Redraw after changing a diagram:

    python notebooks/figures/ch08_steps_diagrams.py
"""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the shared helpers, when imported from elsewhere (tests)
from ch02_ch09_diagrams import _arrow, _box, _canvas, _save, draw_all  # noqa: E402

DOCS = HERE.parent.parent / "docs"
# The tutorial's completion with a wrong second step, as split_steps cuts it (tags mode).
WRONG2 = [" <think>\nStep 1: 14+20=34\n", "Step 2: 34*2=64\n", "Step 3: 64+8=72\n",
          "</think>\n\\boxed{72}"]
STEP_COLORS = ["#fbb4ae", "#b3cde3", "#ccebc5", "#decbe4"]  # Pastel1, as the notebook's plot
# The group's numbers (tutorial section 5): pooled verifier rewards 6 of 13 right.
_MEAN, _STD = 6 / 13, (6 * 7 / 13 / 12) ** 0.5  # 6 ones, 7 zeros; unbiased std
GOOD, BAD = (1 - _MEAN) / (_STD + 1e-4), (0 - _MEAN) / (_STD + 1e-4)  # +1.038, -0.889
STEP_ENDS = [16, 29, 42, 51]
A_OUT = -0.833  # the outcome advantage of this completion (rewards [1.5, 0, 0, 1])
CREDIT = [0.660, -0.792, 0.0, 0.0]  # its progress credit per step (alpha 1)
FLAT = 0.018  # its credit spread evenly over its tokens (the placebo)


def _show(text):
    return text.replace("\n", "\u23ce")


def split_diagram(out_dir):
    """Step 1: a completion cut into character spans, one per step."""
    fig, ax = _canvas(10.0, 2.6)
    x, start = 0.3, 0
    notes = ["text before the first tag\njoins step 1", "a step starts\nat its tag",
             "line breaks stay with\nthe step they end", "from </think> on:\nthe answer step"]
    for j, (piece, note) in enumerate(zip(WRONG2, notes)):
        w = 0.135 * len(_show(piece)) + 0.3
        ax.add_patch(plt.Rectangle((x, 1.3), w, 0.9, facecolor=STEP_COLORS[j],
                                   edgecolor="#5f6368"))
        ax.text(x + w / 2, 1.75, _show(piece), ha="center", va="center", fontsize=8.5,
                family="monospace")
        ax.text(x + w / 2, 2.45, f"step {j + 1}: chars [{start}, {start + len(piece)})",
                ha="center", fontsize=8)
        ax.text(x + w / 2, 0.75, note, ha="center", va="center", fontsize=7.5, color="#3c4043")
        x, start = x + w + 0.1, start + len(piece)
    ax.text(0.3, 0.05, "split_steps(text, \"tags\"): the spans cover every character once; "
            "\"newlines\" and \"blank_lines\" cut after line breaks instead", fontsize=8)
    _save(fig, out_dir / "ch08_steps_split.png")


def verifier_diagram(out_dir):
    """Step 2: the verifier grades each step, then the first error zeroes what follows."""
    fig, ax = _canvas(10.0, 3.0)
    rows = [("14+20=34", "running 14, next 20, +", "right", True),
            ("34*2=64", "34 * 2 is 68", "wrong", False),
            ("64+8=72", "right on what step 2 wrote", "right", True),
            ("\\boxed{72}", "the answer is 76", "wrong", False)]
    rewards = [1, 0, 0, 0]
    for j, ((expr, why, verdict, ok), r) in enumerate(zip(rows, rewards)):
        x = 1.55 + 3.0 * j
        _box(ax, x, 3.05, f"step {j + 1}\n{expr}", "data", w=2.6, h=0.75)
        _box(ax, x, 1.85, f"verify: {verdict}\n({why})", "check" if ok else "model", w=2.8,
             h=0.8, size=8)
        _box(ax, x, 0.6, f"step reward {r}", "out" if r else "none", w=2.2, h=0.55)
        _arrow(ax, (x, 2.65), (x, 2.28))
        _arrow(ax, (x, 1.43), (x, 0.9))
    ax.text(6.1, 0.05, "after the first wrong step every later step earns 0 (first-error "
            "labels): step 3 is right but unpaid", ha="center", fontsize=8, color="#d93025")
    _save(fig, out_dir / "ch08_step_verifier.png")


def backfill_diagram(out_dir):
    """Step 3: step rewards become token advantages, each token summing the steps to come."""
    fig, ax = _canvas(10.0, 2.9)
    normed = [GOOD, BAD, BAD, BAD]
    starts = [0] + [e + 1 for e in STEP_ENDS[:-1]]
    scale = 11.5 / (STEP_ENDS[-1] + 1)
    for j, (s, e) in enumerate(zip(starts, STEP_ENDS)):
        x0, w = 0.3 + s * scale, (e - s + 1) * scale
        ax.add_patch(plt.Rectangle((x0, 1.6), w - 0.05, 0.7, facecolor=STEP_COLORS[j],
                                   edgecolor="#5f6368"))
        ax.text(x0 + w / 2, 1.95, f"step {j + 1}: tokens {s}-{e}", ha="center", fontsize=8)
        ax.text(x0 + w / 2, 2.75, f"normalised reward {normed[j]:+.3f}", ha="center",
                fontsize=8)
        ax.text(x0 + w - 0.1, 1.4, f"{e}", ha="right", fontsize=7, color="#3c4043")
        total = sum(normed[j:])
        _box(ax, x0 + w / 2, 0.65, f"{total:+.3f} per token", "out" if total > 0 else "model",
             w=min(w - 0.1, 2.4), h=0.5, size=8)
        _arrow(ax, (x0 + w / 2, 1.55), (x0 + w / 2, 0.93))
    ax.text(0.3, 0.05, "sum form: each token gets the normalised rewards of its step and "
            "every later step (+1.038 - 3 x 0.889 = -1.630 on step 1)", fontsize=8)
    _save(fig, out_dir / "ch08_backfill.png")


def progress_diagram(out_dir):
    """Step 4: the progress credit, from the values of 'k correct steps done'."""
    fig, ax = _canvas(10.0, 3.4)
    values = [1.25, 1.5, 2.0, 1.0, 0.0]
    xs = [0.9 + 2.6 * k for k in range(5)]
    for k, (x, v) in enumerate(zip(xs, values)):
        _box(ax, x, 3.2, f"{k} correct\nV_{k} = {v:g}", "check", w=1.6, h=0.75, size=8)
    deltas = [(1.25, 0.660), (1.5, 0.792), (0.0, 0.0), (0.0, 0.0)]
    for k, (d, c) in enumerate(deltas):
        _arrow(ax, (xs[k] + 0.82, 3.2), (xs[k + 1] - 0.82, 3.2))
        ax.text((xs[k] + xs[k + 1]) / 2, 3.95, f"right: {d:g}\n-> {c:+.3f}", ha="center",
                fontsize=7.5)
    ax.text(6.1, 2.5, "correct answer: credit +0.660, +0.792, 0, 0 (everyone who got that far "
            "went on right)", ha="center", fontsize=8)
    _box(ax, 5.2, 1.35, "step 2 wrong: from V_1 = 1.5 to 0\ndelta -1.5 -> credit -0.792",
         "model", w=3.4, h=0.75, size=8)
    _arrow(ax, (xs[1], 2.8), (5.0, 1.75))
    _box(ax, 1.3, 1.35, "step 1 wrong\n-1.25 -> -0.660", "model", w=2.2, h=0.75, size=8)
    _arrow(ax, (xs[0], 2.8), (1.3, 1.75))
    ax.text(6.1, 0.35, "delta_k = c_k (1 + V_k) - V_k-1, divided by std(M) = 1.893; "
            "each token of step k gets A_out + alpha x credit", ha="center", fontsize=8)
    _save(fig, out_dir / "ch08_progress_credit.png")


def branch_diagram(out_dir):
    """Step 5: a branch at the first error: resample the step where the group slipped."""
    fig, ax = _canvas(10.0, 3.2)
    state = _box(ax, 1.8, 2.0, "state after step 1\nprompt + \"14+20=34\"\nreached by 2 "
                 "completions:\n1 right there, 1 wrong", "data", w=3.0, h=1.4, size=8)
    grades, advs = [1, 1, 0, 1], [0.645, 0.645, -1.291, 0.645]
    for b, (g, a) in enumerate(zip(grades, advs)):
        y = 3.5 - 0.95 * b
        text = "34*2=68" if g else "34*2=72"
        _box(ax, 6.2, y, f"branch {b + 1}: {text}\nverifier: {'right' if g else 'wrong'}",
             "check" if g else "model", w=2.6, h=0.7, size=8)
        _box(ax, 9.9, y, f"advantage {a:+.3f}", "out" if a > 0 else "model", w=2.2, h=0.55,
             size=8)
        _arrow(ax, (state[0] + 1.55, state[1]), (6.2 - 1.35, y))
        _arrow(ax, (6.2 + 1.35, y), (9.9 - 1.15, y))
    ax.text(6.1, 0.05, "each branch's grade normalised over the state's samples: the 2 group "
            "completions and the 4 branches", ha="center", fontsize=8)
    _save(fig, out_dir / "ch08_branch.png")


def three_credits_diagram(out_dir):
    """The experiment's three arms on one completion: where each puts the credit."""
    fig, ax = plt.subplots(figsize=(9.0, 3.0))
    sizes = [STEP_ENDS[0] + 1] + [b - a for a, b in zip(STEP_ENDS, STEP_ENDS[1:])]
    arms = [("outcome", [A_OUT] * 4, "tab:blue", "-"),
            ("recommended (progress)", [A_OUT + c for c in CREDIT], "black", "-"),
            (f"placebo (spread evenly, {A_OUT + FLAT:+.3f})", [A_OUT + FLAT] * 4, "tab:pink",
             "--")]
    left = 0
    for j, n in enumerate(sizes):
        ax.axvspan(left, left + n, color=STEP_COLORS[j], alpha=0.5, linewidth=0)
        ax.text(left + n / 2, 0.45, f"step {j + 1}", ha="center", fontsize=8)
        left += n
    for name, values, color, style in arms:
        xs, ys, left = [], [], 0
        for v, n in zip(values, sizes):
            xs += [left, left + n]
            ys += [v, v]
            left += n
        ax.plot(xs, ys, color=color, linewidth=2, label=name, linestyle=style)
    ax.axhline(0, color="grey", linewidth=0.6)
    ax.set_xlim(0, sum(sizes))
    ax.set_ylim(-1.9, 0.7)
    ax.set_xlabel("token of the completion with a wrong step 2 (tutorial, alpha 1)")
    ax.set_ylabel("token advantage")
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title("same total per completion for recommended and placebo; only the placement "
                 "differs", fontsize=9)
    _save(fig, out_dir / "ch08_three_credits.png")


def design_diagram(out_dir):
    """The comparison: one start, one seed, three advantage hooks, one evaluation."""
    fig, ax = _canvas(10.0, 2.8)
    start = _box(ax, 1.6, 1.75, "tiny-arith-think\n(same weights)\nseed 123: same\nprompts, same "
                 "sampling seeds", "model", w=2.6, h=1.4, size=8)
    hooks = [("outcome: advantage_fn=None", "none"),
             ("recommended: outcome\n+ 4 x progress credit", "check"),
             ("placebo: the same credit,\ncontrol=\"flat\"", "data")]
    for i, (text, kind) in enumerate(hooks):
        y = 3.0 - 1.25 * i
        _box(ax, 5.6, y, text, kind, w=3.2, h=0.85, size=8)
        _arrow(ax, (start[0] + 1.35, start[1]), (5.6 - 1.65, y))
        _arrow(ax, (5.6 + 1.65, y), (9.6, 1.75))
    _box(ax, 10.8, 1.75, "train_grpo\n(our loop) ->\nheld-out accuracy,\nstep correctness",
         "out", w=2.4, h=1.4, size=8)
    _save(fig, out_dir / "ch08_comparison_design.png")


def _per_seed(table, arm):
    """Each seed's final accuracy over all levels, from the per-level records."""
    out = []
    for run in table["levels"]["runs"][arm]:
        n = sum(lv["think_answers"] / max(lv["think_rate"], 1e-9) for lv in run.values())
        out.append(sum(lv["accuracy"] * lv["think_answers"] / max(lv["think_rate"], 1e-9)
                       for lv in run.values()) / n)
    return out


def seeds_diagram(out_dir):
    """Six seeds per arm on tiny-arith-think's test split: what one seed could have shown."""
    table = json.loads((DOCS / "process_vs_outcome_fixed.json").read_text())["think_test"]
    fig, ax = plt.subplots(figsize=(8.0, 2.8))
    arms = [("outcome", "tab:blue"), ("recommended-a4", "black"), ("placebo-a4", "tab:pink")]
    for i, (arm, color) in enumerate(arms):
        accs = _per_seed(table, arm)
        ax.scatter(accs, [i] * len(accs), color=color, s=30)
        mean = sum(accs) / len(accs)
        ax.plot([mean, mean], [i - 0.3, i + 0.3], color=color, linewidth=2)
        ax.text(max(accs) + 0.004, i, f"mean {mean:.3f}", va="center", fontsize=8)
    ax.set_yticks(range(len(arms)), [a for a, _ in arms])
    ax.set_ylim(-0.6, len(arms) - 0.4)
    ax.set_xlabel("final accuracy on the 500 test problems, one dot per seed (9-14)")
    ax.set_xlim(ax.get_xlim()[0], ax.get_xlim()[1] + 0.012)
    ax.set_title("one seed is one dot: a single recommended seed can land among the placebo's",
                 fontsize=9)
    _save(fig, out_dir / "ch08_seed_spread.png")


def format_control_diagram(out_dir):
    """On tiny-arith, a format-only credit gains as much as the step credit."""
    table = json.loads((DOCS / "process_vs_outcome_fixed.json").read_text())["arith_test"]
    fig, ax = plt.subplots(figsize=(8.0, 2.9))
    rows = [r for r in table["rows"] if r["arm"] != "outcome"]
    for i, r in enumerate(rows):
        iv = r["intervals"]["vs_outcome"]["final_accuracy"]
        lo, hi, mid = iv["lo"], iv["hi"], iv["mean"]
        color = "black" if r["arm"].startswith("recommended") else (
            "tab:olive" if "format" in r["arm"] else "tab:pink")
        ax.plot([lo, hi], [i, i], color=color, linewidth=2)
        ax.plot([mid], [i], "o", color=color)
    ax.axvline(0, color="grey", linewidth=0.8)
    ax.set_yticks(range(len(rows)), [r["arm"] for r in rows], fontsize=8)
    ax.set_xlabel("final accuracy minus outcome's (95% paired bootstrap interval)")
    ax.set_title("tiny-arith: the format-only credit gains as much as the step credit",
                 fontsize=9)
    _save(fig, out_dir / "ch08_format_control.png")


DIAGRAMS = {"ch08_steps_split.png": split_diagram,
            "ch08_step_verifier.png": verifier_diagram,
            "ch08_backfill.png": backfill_diagram,
            "ch08_progress_credit.png": progress_diagram,
            "ch08_branch.png": branch_diagram,
            "ch08_three_credits.png": three_credits_diagram,
            "ch08_comparison_design.png": design_diagram,
            "ch08_seed_spread.png": seeds_diagram,
            "ch08_format_control.png": format_control_diagram}


def main(out_dir: Path = HERE) -> None:
    """Draw every diagram into `out_dir`."""
    draw_all(DIAGRAMS, out_dir)


if __name__ == "__main__":
    main()
