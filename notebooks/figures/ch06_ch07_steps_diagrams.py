"""Draw the step-by-step diagrams of the chapter 6 and 7 notebooks (ch06_*.png, ch07_*.png).

One step of an idea per figure, drawn with the numbers the notebooks print (a real group's
rewards, the packed batch's shapes, the ratios of section 6's four updates); where a figure
needs a number the notebook does not print, the comment beside it says how it was obtained.
Boxes and arrows come from the helpers of ch02_ch09_diagrams.py. Redraw after a change:

    python notebooks/figures/ch06_ch07_steps_diagrams.py
"""

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import ListedColormap  # noqa: E402
from matplotlib.patches import FancyBboxPatch, Rectangle  # noqa: E402

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # run as a script or loaded by path: the helpers sit beside us
    sys.path.insert(0, str(HERE))
from ch02_ch09_diagrams import _arrow, _box, _canvas, _save, draw_all  # noqa: E402

RED, BLUE, GREY = "#d93025", "#1a73e8", "#5f6368"
RIGHT, WRONG = "#34a853", "#ea4335"  # bar colours of right and wrong answers


def _advantages(rewards):
    """compute_advantage_stats' advantages: (r - mean) / (sample std + 1e-4); 0 if all equal."""
    n = len(rewards)
    mean = sum(rewards) / n
    if all(r == rewards[0] for r in rewards):
        return [0.0] * n, mean, 0.0
    std = (sum((r - mean) ** 2 for r in rewards) / (n - 1)) ** 0.5
    return [(r - mean) / (std + 1e-4) for r in rewards], mean, std


def _frame(ax, x0, y0, w, h, label, color=GREY):
    """A dashed rounded frame around a stage, its name on top."""
    ax.add_patch(FancyBboxPatch((x0, y0), w, h, boxstyle="round,pad=0.08", fill=False,
                                edgecolor=color, linestyle="--", linewidth=1.1))
    ax.text(x0 + 0.1, y0 + h + 0.12, label, fontsize=9, color=color, weight="bold")


# --- chapter 6 ---------------------------------------------------------------------------------

def prompt_batch_diagram(out_dir):
    """Section 2: four prompts of different lengths left-padded into one (4, 52) batch."""
    lengths = [44, 52, 50, 42]  # printed: "prompt lengths: [44, 52, 50, 42] -> (4, 52)"
    P = max(lengths)
    fig, ax = _canvas(10.4, 3.0)
    x0, scale, h = 1.6, 0.105, 0.5
    for n, length in enumerate(lengths):
        y = 3.0 - n * 0.7
        pad = P - length
        ax.text(x0 - 0.15, y + h / 2, f"prompt {n}", ha="right", va="center", fontsize=8)
        if pad:
            ax.add_patch(Rectangle((x0, y), pad * scale, h, facecolor="#f1f3f4",
                                   edgecolor=GREY, hatch="//"))
            ax.text(x0 + pad * scale / 2, y - 0.1, f"pad {pad}", ha="center", va="top",
                    fontsize=7, color=GREY)
        ax.add_patch(Rectangle((x0 + pad * scale, y), length * scale, h, facecolor="#cfe2f3",
                               edgecolor=GREY))
        ax.text(x0 + (pad + length / 2) * scale, y + h / 2, f"{length} prompt tokens",
                ha="center", va="center", fontsize=8)
    right = x0 + P * scale
    ax.plot([right, right], [0.75, 3.65], color=RED, linewidth=1)
    ax.text(right + 0.15, 0.95, "every prompt ends in column 51;\nthe answers start in "
            "column 52", ha="left", fontsize=8, color=RED)
    ax.text(x0 + P * scale / 2, 0.35, "attention mask: 0 on the hatched padding, so no token "
            "attends to it", ha="center", fontsize=8)
    b = _box(ax, 10.4, 2.2, "one prefill of (4, 52)\nthen KVCache.expand(8):\n32 rows, prompt n"
             " in\nrows 8n .. 8n + 7", "model", w=2.8, h=1.5)
    _arrow(ax, (right + 0.25, 2.2), (b[0] - 1.45, b[1]))
    ax.set_title("Four prompts, one left-padded batch (section 2's check)", fontsize=10)
    _save(fig, out_dir / "ch06_prompt_batch.png")


def group_baseline_diagram(out_dir):
    """Section 4: the mixed group's rewards -> mean and std -> advantages."""
    rewards = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0]  # printed by section 3's cell
    adv, mean, std = _advantages(rewards)
    fig, axes = plt.subplots(1, 3, figsize=(10.4, 2.9),
                             gridspec_kw={"width_ratios": [3, 1.4, 3]})
    xs = range(len(rewards))
    colors = [RIGHT if r else WRONG for r in rewards]
    ax = axes[0]
    ax.bar(xs, rewards, color=colors)
    ax.axhline(mean, color=BLUE, linestyle="--")
    ax.text(7.4, mean + 0.04, f"mean {mean:.2f}", color=BLUE, fontsize=8, ha="right")
    ax.set_ylim(-0.1, 1.25)
    ax.set_xticks(list(xs))
    ax.set_xlabel("answer i")
    ax.set_title("1. rewards r_i of the 8 answers", fontsize=9)
    ax = axes[1]
    ax.axis("off")
    ax.text(0.5, 0.55, f"mean = {mean:.2f}\nstd = {std:.3f}\n\n"
            "$A_i = \\frac{r_i - \\mathrm{mean}}{\\mathrm{std} + 10^{-4}}$",
            ha="center", va="center", fontsize=10)
    ax.annotate("", xy=(1.0, 0.15), xytext=(0.0, 0.15), xycoords="axes fraction",
                arrowprops=dict(arrowstyle="->", color=GREY, linewidth=1.4))
    ax.set_title("2. the group's own baseline", fontsize=9)
    ax = axes[2]
    ax.bar(xs, adv, color=colors)
    ax.axhline(0, color="black", linewidth=0.6)
    for x, a in zip(xs, adv):
        ax.text(x, a + (0.08 if a > 0 else -0.08), f"{a:.2f}", ha="center",
                va="bottom" if a > 0 else "top", fontsize=7)
    ax.set_ylim(-1.0, 2.0)
    ax.set_xticks(list(xs))
    ax.set_xlabel("answer i")
    ax.set_title("3. advantages: mean 0, std 1", fontsize=9)
    fig.tight_layout()
    _save(fig, out_dir / "ch06_group_baseline.png")


def answer_mask_diagram(out_dir):
    """Section 6: the group as one (G, P + T) batch; only answer tokens enter the loss."""
    P = 52  # the problem's prompt length (train_examples[1], printed in section 2's check)
    lengths = [75, 75, 8, 6, 8, 75, 75, 71]  # section 5's table (tokens per answer)
    rewards = [0, 0, 0, 0, 0, 0, 1, 1]
    T = max(lengths)
    grid = [[0] * P + [1 if t < n else 2 for t in range(T)] for n in lengths]
    cmap = ListedColormap(["#cfe2f3", "#b7e1c1", "#f1f3f4"])
    fig, ax = plt.subplots(figsize=(10.4, 3.0))
    ax.imshow(grid, cmap=cmap, aspect="auto", interpolation="nearest", vmin=0, vmax=2)
    ax.axvline(P - 0.5, color=RED, linewidth=1.2)
    ax.set_yticks(range(len(lengths)),
                  [f"{i}: r={r}, {n} tok" for i, (r, n) in enumerate(zip(rewards, lengths))],
                  fontsize=7)
    ax.set_xticks([0, P, P + T - 1], ["0", f"{P}", f"{P + T - 1}"], fontsize=7)
    ax.set_xlabel("column of the (8, P + T) batch: the prompt, then the answer")
    ax.text(P / 2, -0.9, "prompt: mask 0, not in the loss", ha="center", fontsize=8)
    ax.text(P + T / 2, -0.9, "answer tokens: mask 1 (green); right padding: mask 0 (grey)",
            ha="center", fontsize=8)
    ax.text(P + 10, 3.0, "causal attention: a real token never\nsees the padding after it",
            fontsize=8, va="center", color=GREY)
    ax.set_ylim(len(lengths) - 0.5, -1.4)
    ax.set_title("logits[:, P - 1:-1] predict the answer columns; the answer mask keeps the "
                 "real tokens", fontsize=9)
    fig.tight_layout()
    _save(fig, out_dir / "ch06_answer_mask.png")


def one_step_diagram(out_dir):
    """Section 7: how one AdamW step moved each answer's log-probability, at two lrs."""
    adv = [-0.54] * 6 + [1.62] * 2
    before = [-4.398, -16.187, -7.603, -6.333, -6.801, -11.038, -7.651, -4.586]  # printed
    after = [-4.715, -19.530, -7.626, -6.439, -6.860, -13.069, -5.955, -4.319]  # lr 1e-4
    big = [-13.54, -25.44, -0.29, -1.13, -0.67, -22.95, 1.07, -6.79]  # lr 1e-3, printed
    small = [a - b for a, b in zip(after, before)]
    colors = [RIGHT if a > 0 else WRONG for a in adv]
    fig, axes = plt.subplots(1, 2, figsize=(10.4, 2.9))
    for ax, change, title in ((axes[0], small, "lr 1e-4: A > 0 up, A < 0 down"),
                              (axes[1], big, "lr 1e-3: right answer 7 falls too")):
        ax.bar(range(8), change, color=colors)
        ax.axhline(0, color="black", linewidth=0.6)
        for x, c in enumerate(change):
            ax.text(x, c + (0.1 if c >= 0 else -0.1) * (max(map(abs, change)) / 3),
                    f"{c:+.2f}", ha="center", va="bottom" if c >= 0 else "top", fontsize=7)
        ax.set_xticks(range(8), [f"{i}\nA={a:+.2f}" for i, a in enumerate(adv)], fontsize=7)
        ax.set_ylabel("change of log p")
        ax.set_title(title, fontsize=9)
        lo = min(change)
        ax.set_ylim(lo * 1.35, max(max(change) * 1.6, -lo * 0.3))
    fig.tight_layout()
    _save(fig, out_dir / "ch06_one_step.png")


def accumulation_diagram(out_dir):
    """Section 8: a step's gradient summed over questions (ours) or micro-batches (package)."""
    fig, ax = _canvas(10.4, 3.8)
    ax.text(0.1, 4.55, "our loop: one backward per question", fontsize=9, weight="bold")
    qs = [_box(ax, 1.3, 4.0 - 0.62 * k, f"question {k + 1}: loss / 4", "data", w=2.3, h=0.48,
               size=8) for k in range(4)]
    grad = _box(ax, 5.2, 3.05, ".grad\n(backward adds\ninto it)", "model", w=1.9, h=1.2)
    for q in qs:
        _arrow(ax, (q[0] + 1.2, q[1]), (grad[0] - 1.0, grad[1]))
    ax.text(1.3, 1.35, "an all-equal group: loss 0, adds 0\n(step 1: zero_adv_frac 0.50, "
            "2 of 4)", ha="center", fontsize=7.5, color=RED)
    clip = _box(ax, 8.0, 3.05, "clip the norm\nat 1.0", "check", w=1.7, h=0.8)
    step = _box(ax, 10.6, 3.05, "one AdamW\nstep", "out", w=1.6, h=0.8)
    _arrow(ax, (grad[0] + 1.0, grad[1]), (clip[0] - 0.9, clip[1]))
    _arrow(ax, (clip[0] + 0.9, clip[1]), (step[0] - 0.85, step[1]))
    ax.plot([0.1, 12.9], [0.95, 0.95], color="#dadce0", linewidth=1)
    ax.text(0.1, 0.65, "the package's update(): the packed batch in micro-batches "
            "(here 16 rows, micro_batch_size 4)", fontsize=9, weight="bold")
    mbs = [_box(ax, 1.0 + 1.45 * k, -0.05, f"rows {4 * k}-{4 * k + 3}\nx w", "data", w=1.25,
                h=0.6, size=7.5) for k in range(4)]
    g2 = _box(ax, 8.0, -0.05, "backward each: the\nsum is the whole\nbatch's gradient", "model",
              w=2.2, h=0.9, size=8)
    _arrow(ax, (mbs[-1][0] + 0.65, -0.05), (g2[0] - 1.15, -0.05))
    ax.text(11.3, -0.05, "w: the micro-batch's\nshare of rows (grpo,\nsequence) or of answer"
            "\ntokens (dapo)", fontsize=7.5, va="center", color=GREY)
    ax.set_ylim(-0.6, 4.8)
    _save(fig, out_dir / "ch06_accumulation.png")


def package_stages_diagram(out_dir):
    """The package's step: training.py's rollout_stage and update_stage, then the log."""
    fig, ax = _canvas(10.4, 3.2)
    _frame(ax, 0.1, 1.45, 6.35, 1.55, "rollout_stage (stages 1-3): grpo.collect_rollouts",
           BLUE)
    xs = [0.85, 2.4, 3.95, 5.5]
    items = [("step_prompts\n+ generators", "data"), ("sample G\nanswers each", "model"),
             ("reward, then\nadvantages", "check"), ("drop equal\ngroups, pack", "data")]
    for x, (t, k) in zip(xs, items):
        _box(ax, x, 2.2, t, k, w=1.35, h=0.9, size=7.5)
    for a, b in zip(xs, xs[1:]):
        _arrow(ax, (a + 0.7, 2.2), (b - 0.7, 2.2))
    _frame(ax, 6.85, 1.45, 4.6, 1.55, "update_stage (stages 4-5)", RED)
    s4 = _box(ax, 7.95, 2.2, "4: old and ref\nlog-probs,\nno_grad, once", "data", w=1.85,
              h=0.95, size=7.5)
    s5 = _box(ax, 10.35, 2.2, "5: update() x\ninner_epochs:\nmicro-batches,\nclip, AdamW",
              "out", w=1.85, h=1.1, size=7.5)
    _arrow(ax, (xs[-1] + 0.7, 2.2), (s4[0] - 0.95, 2.2), "batch")
    _arrow(ax, (s4[0] + 0.95, 2.2), (s5[0] - 0.95, 2.2))
    log = _box(ax, 10.35, 0.45, "6: log_step: a metrics.csv row;\nevaluation, checkpoint "
               "when due", "none", w=3.2, h=0.7, size=7.5)
    _arrow(ax, (s5[0], 1.6), (log[0], 0.85))
    ax.text(3.2, 0.6, "train_grpo calls these stage functions once per step;\n"
            "a larger system (several processes, FSDP) swaps them, not the loop",
            ha="center", fontsize=8, color=GREY)
    _save(fig, out_dir / "ch06_package_stages.png")


# --- chapter 7 ---------------------------------------------------------------------------------

def entropy_diagram(out_dir):
    """Section 1: the mean token entropy of each answer of the group."""
    entropy = [0.042, 0.042, 1.019, 0.828, 0.753, 0.042, 0.042, 0.060]  # printed
    rewards = [1, 1, 0, 0, 0, 1, 0, 1]
    kinds = ["think", "think", "\\boxed{185}", "\\boxed{99}", "The answer\nis 68.", "think",
             "think", "steps,\nno tags"]
    fig, ax = plt.subplots(figsize=(8.4, 2.8))
    ax.bar(range(8), entropy, color=[RIGHT if r else WRONG for r in rewards])
    for x, e in enumerate(entropy):
        ax.text(x, e + 0.02, f"{e:.3f}", ha="center", fontsize=7)
    ax.set_xticks(range(8), [f"{i}: {k}" for i, k in enumerate(kinds)], fontsize=7)
    ax.set_ylabel("mean entropy (nats)")
    ax.set_ylim(0, 1.2)
    ax.bar([0], [0], color=RIGHT, label="reward 1")
    ax.bar([0], [0], color=WRONG, label="reward 0")
    ax.legend(fontsize=8, loc="upper right")
    ax.set_title("Entropy per answer of section 1's group: guesses are unsure, worked "
                 "solutions are not", fontsize=9)
    fig.tight_layout()
    _save(fig, out_dir / "ch07_entropy_per_answer.png")


def format_gate_diagram(out_dir):
    """Section 4: the format reward, paid always or only with a right answer, and the
    advantages each gives the group."""
    correct = [1, 1, 0, 0, 0, 1, 0, 1]  # section 4's table (correct, format)
    fmt = [1, 1, 0, 0, 0, 1, 1, 0]
    gated = [c + 0.5 * f * c for c, f in zip(correct, fmt)]
    always = [c + 0.5 * f for c, f in zip(correct, fmt)]
    fig, axes = plt.subplots(1, 2, figsize=(10.4, 2.9))
    xs = list(range(8))
    labels = [f"{i}\nc{c} f{f}" for i, (c, f) in enumerate(zip(correct, fmt))]
    for ax, values, title in ((axes[0], (gated, always), "reward = correct + 0.5 x format"),
                              (axes[1], (_advantages(gated)[0], _advantages(always)[0]),
                               "advantage")):
        ax.bar([x - 0.2 for x in xs], values[0], width=0.4, color=BLUE,
               label="format paid only when correct")
        ax.bar([x + 0.2 for x in xs], values[1], width=0.4, color="#fbbc04",
               label="format paid always")
        ax.axhline(0, color="black", linewidth=0.6)
        ax.set_xticks(xs, labels, fontsize=7)
        ax.set_title(title, fontsize=9)
    axes[0].legend(fontsize=7, loc="upper left", bbox_to_anchor=(0.22, 1.0))
    axes[0].set_ylim(0, 2.0)
    axes[1].annotate("answer 6: wrong,\nin think tags", xy=(6.2, _advantages(always)[0][6]),
                     xytext=(3.6, 0.9), fontsize=7, arrowprops=dict(arrowstyle="->"))
    fig.tight_layout()
    _save(fig, out_dir / "ch07_format_gate.png")


def pack_masks_diagram(out_dir):
    """Section 3: two groups of 3 packed by pack_rollouts into one (6, 79) batch."""
    P, T = 55, 24  # printed: prompt lengths [44, 55] -> batch (6, 79), answers from column 55
    prompt_lens = [44, 44, 44, 55, 55, 55]
    answer_lens = [8, 24, 8, 24, 24, 8]  # completion_mask.sum(1) of that cell's batch
    grid = []
    for p, n in zip(prompt_lens, answer_lens):
        grid.append([0] * (P - p) + [1] * p + [2 if t < n else 3 for t in range(T)])
    cmap = ListedColormap(["#ffffff", "#cfe2f3", "#b7e1c1", "#f1f3f4"])
    fig, ax = plt.subplots(figsize=(10.4, 2.9))
    ax.imshow(grid, cmap=cmap, aspect="auto", interpolation="nearest", vmin=0, vmax=3)
    for y in range(3):
        ax.add_patch(Rectangle((-0.5, y - 0.5), P - 44, 1, fill=False, hatch="//",
                               edgecolor="#9aa0a6", linewidth=0))
    ax.axvline(P - 0.5, color=RED, linewidth=1.2)
    ax.axhline(2.5, color="black", linewidth=0.8)
    ax.set_yticks(range(6), [f"group {g}, answer {k}" for g in (0, 1) for k in range(3)],
                  fontsize=7)
    ax.set_xticks([0, 11, P, P + T - 1], ["0", "11", "55", "78"], fontsize=7)
    ax.text(5, -0.9, "left padding 11:\nattention mask 0", ha="center", fontsize=7.5)
    ax.text(33, -0.9, "prompt (blue): attended to, not in the loss", ha="center", fontsize=7.5)
    ax.text(P + T / 2, -0.9, "answer: completion mask 1 (green),\nright padding 0 (grey)",
            ha="center", fontsize=7.5)
    ax.set_ylim(5.5, -1.6)
    ax.set_xlabel("column; one slice logits[:, 54:78] predicts every answer column 55..78")
    fig.tight_layout()
    _save(fig, out_dir / "ch07_pack_masks.png")


def answer_weight_diagram(out_dir):
    """Section 5: what a whole answer weighs (per-token weight x its length)."""
    per_token = {"sequence": (0.5, 0.5), "grpo": (0.25, 0.125), "dapo": (1 / 6, 1 / 6),
                 "dr_grpo": (0.125, 0.125)}  # the printed gradient weights
    short, long_ = 2, 4
    fig, ax = plt.subplots(figsize=(7.6, 2.9))
    names = list(per_token)
    xs = range(len(names))
    s = [w[0] * short for w in per_token.values()]
    lg = [w[1] * long_ for w in per_token.values()]
    ax.bar([x - 0.18 for x in xs], s, width=0.36, color=RIGHT,
           label="short right answer: 2 tokens")
    ax.bar([x + 0.18 for x in xs], lg, width=0.36, color=WRONG,
           label="long wrong answer: 4 tokens")
    for x, a, b in zip(xs, s, lg):
        ax.text(x - 0.18, a + 0.03, f"{a:.2f}", ha="center", fontsize=7)
        ax.text(x + 0.18, b + 0.03, f"{b:.2f}", ha="center", fontsize=7)
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("weight of the whole answer")
    ax.set_ylim(0, 2.4)
    ax.legend(fontsize=8, loc="upper right")
    ax.set_title("A sum (chapter 6) weighs an answer by its length; grpo's mean does not",
                 fontsize=9)
    fig.tight_layout()
    _save(fig, out_dir / "ch07_answer_weight.png")


def skip_groups_diagram(out_dir):
    """Section 6: collect_rollouts on step 1's four groups: two dropped, two packed."""
    rewards = [[0.0] * 8, [0.0] * 8, [0, 0, 1.5, 0, 0, 1.5, 0, 0],
               [0, 0, 1.5, 0, 0, 0, 0, 0]]  # printed: "rewards per group"
    fig, ax = _canvas(10.4, 2.9)
    x0, cw, ch = 1.6, 0.55, 0.5
    for g, row in enumerate(rewards):
        y = 2.9 - g * 0.65
        adv = _advantages(row)[0]
        dropped = all(r == row[0] for r in row)
        ax.text(x0 - 0.15, y + ch / 2, f"group {g}", ha="right", va="center", fontsize=8)
        for k, (r, a) in enumerate(zip(row, adv)):
            face = "#f1f3f4" if dropped else (RIGHT if r else "#fce8e6")
            ax.add_patch(Rectangle((x0 + k * cw, y), cw, ch, facecolor=face, edgecolor=GREY))
            ax.text(x0 + (k + 0.5) * cw, y + ch / 2, f"{r:g}" if dropped else f"{a:+.2f}",
                    ha="center", va="center", fontsize=6.5)
        note = "all equal: A = 0, dropped" if dropped else "kept: cells show A"
        ax.text(x0 + 8 * cw + 0.2, y + ch / 2, note, va="center", fontsize=8,
                color=RED if dropped else "black")
    b = _box(ax, 10.6, 1.9, "pack_rollouts:\nbatch (16, 125),\nanswers from\ncolumn 51",
             "data", w=2.2, h=1.3, size=8)
    _arrow(ax, (x0 + 8 * cw + 2.3, 1.55), (b[0] - 1.15, b[1] - 0.2))
    ax.text(x0 + 4 * cw, 0.25, "rewards: correct + 0.5 x format (when correct); "
            "zero_adv_frac 0.5", ha="center", fontsize=8, color=GREY)
    _save(fig, out_dir / "ch07_skip_groups.png")


def inner_epochs_diagram(out_dir):
    """Section 6: four updates on one batch against log-probs stored once."""
    no_clip = [1.436, 1.808, 2.327, 2.841]  # printed: ratio max after each update
    clip = [1.436, 1.640, 1.964, 2.251]
    past = [0.000, 0.039, 0.047, 0.047]  # share past the clip in each update's loss
    fig, axes = plt.subplots(1, 2, figsize=(10.4, 3.0), gridspec_kw={"width_ratios": [1.1, 1]})
    ax = axes[0]
    ax.axis("off")
    ax.set_xlim(0, 6)
    ax.set_ylim(0, 4)
    _box(ax, 1.1, 3.2, "old log-probs\n(G, T), no_grad,\nonce", "data", w=1.9, h=0.9, size=8)
    for k in range(4):
        x = 0.75 + 1.5 * k
        _box(ax, x, 1.3, f"update {k + 1}\npast clip\n{past[k]:.3f}", "out", w=1.25, h=0.95,
             size=7.5)
        if k:
            _arrow(ax, (x - 0.95, 1.3), (x - 0.65, 1.3))
        ax.annotate("", xy=(x, 1.8), xytext=(1.1, 2.72),
                    arrowprops=dict(arrowstyle="->", color=GREY, linewidth=0.8))
    ax.text(3.0, 0.35, "update 1: r = 1 everywhere; later updates compare\nthe moved weights "
            "with the same stored log-probs", ha="center", fontsize=7.5, color=GREY)
    ax = axes[1]
    ks = [1, 2, 3, 4]
    ax.plot(ks, no_clip, marker="o", color="gray", linestyle=":", label="no clip")
    ax.plot(ks, clip, marker="o", color=BLUE, label="clip 0.2")
    for k, a, b in zip(ks, no_clip, clip):
        ax.text(k, a + 0.06, f"{a:.3f}", ha="center", fontsize=7, color="gray")
        ax.text(k, b - 0.16, f"{b:.3f}", ha="center", fontsize=7, color=BLUE)
    ax.axhline(1.2, color=RED, linewidth=0.8, linestyle="--")
    ax.text(4.2, 1.23, "1 + eps", color=RED, fontsize=7, ha="right")
    ax.set_xticks(ks)
    ax.set_xlabel("update on the same batch")
    ax.set_ylabel("largest token ratio after it")
    ax.set_ylim(1.0, 3.1)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    _save(fig, out_dir / "ch07_inner_epochs.png")


DIAGRAMS = {
    "ch06_prompt_batch.png": prompt_batch_diagram,
    "ch06_group_baseline.png": group_baseline_diagram,
    "ch06_answer_mask.png": answer_mask_diagram,
    "ch06_one_step.png": one_step_diagram,
    "ch06_accumulation.png": accumulation_diagram,
    "ch06_package_stages.png": package_stages_diagram,
    "ch07_entropy_per_answer.png": entropy_diagram,
    "ch07_pack_masks.png": pack_masks_diagram,
    "ch07_format_gate.png": format_gate_diagram,
    "ch07_answer_weight.png": answer_weight_diagram,
    "ch07_skip_groups.png": skip_groups_diagram,
    "ch07_inner_epochs.png": inner_epochs_diagram,
}


def main(out_dir: Path = HERE) -> None:
    """Draw every diagram into `out_dir`."""
    draw_all(DIAGRAMS, out_dir)


if __name__ == "__main__":
    main()
