"""Draw the diagrams of the chapter 7 notebook (notebooks/figures/ch07_*.png).

Boxes and arrows (the helpers of ch02_ch09_diagrams.py) and a few curves computed from their
formulas; the notebook shows the committed images. Redraw after changing a diagram:

    python notebooks/figures/ch07_diagrams.py
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


def policies_diagram(out_dir):
    """The three policies of a step and where each log-probability comes from."""
    fig, ax = _canvas(9.6, 3.6)
    old = _box(ax, 1.6, 3.6, "pi_old: the weights\nat the start of the step", "model", w=2.6,
               h=0.9)
    ref = _box(ax, 1.6, 1.0, "pi_ref: the frozen\nstarting model (a copy)", "none", w=2.6,
               h=0.9)
    ro = _box(ax, 5.0, 3.6, "rollouts: G answers\nper question, rewards,\nadvantages A", "data",
              w=2.6, h=1.0)
    lo = _box(ax, 5.0, 2.3, "old log-probs (B, T)\nno_grad, once", "data", w=2.6, h=0.8)
    lr = _box(ax, 5.0, 1.0, "reference log-probs (B, T)\nno_grad, once", "data", w=2.6, h=0.8)
    new = _box(ax, 8.9, 3.6, "pi_theta: the weights\nbeing updated", "model", w=2.6, h=0.9)
    loss = _box(ax, 8.9, 1.65, "per token: -min(rA, clip(r)A)\n+ beta k3(logp, ref)\n"
                "r = exp(logp - old)", "check", w=3.2, h=1.2, size=8)
    _arrow(ax, (old[0] + 1.35, old[1]), (ro[0] - 1.35, ro[1]), "sample")
    _arrow(ax, (old[0] + 1.35, old[1] - 0.3), (lo[0] - 1.35, lo[1]), "forward")
    _arrow(ax, (ref[0] + 1.35, ref[1]), (lr[0] - 1.35, lr[1]), "forward")
    _arrow(ax, (new[0], new[1] - 0.5), (loss[0], loss[1] + 0.65), "logp, with grad")
    for src in (lo, lr):
        _arrow(ax, (src[0] + 1.35, src[1]), (loss[0] - 1.65, loss[1]))
    ax.annotate("", xy=(new[0] + 1.0, new[1] - 0.5), xytext=(loss[0] + 1.0, loss[1] + 0.65),
                arrowprops=dict(arrowstyle="->", color="#d93025", linewidth=1.2))
    ax.text(10.55, 2.75, "AdamW step,\ninner_epochs\ntimes", fontsize=8, color="#d93025",
            va="center")
    ax.text(5.0, 4.45, "pi_theta = pi_old at the first update: r = 1; later updates move it",
            ha="center", fontsize=8, color="#3c4043")
    _save(fig, out_dir / "ch07_policies.png")


def training_step_diagram(out_dir):
    """One step of the chapter 7 loop, as the notebook writes it."""
    fig, ax = _canvas(10.4, 2.4)
    steps = [("step_prompts\n+ one generator\nper question", "data"),
             ("collect_rollouts:\nsample, reward,\nadvantages, skip\nequal groups", "model"),
             ("batch_logprobs\n(no_grad): old\nand reference", "data"),
             ("grpo_loss_on_batch\n-> backward -> clip\nnorm -> AdamW", "check"),
             ("log row: rewards,\nentropy, KL, clip\nfractions; eval", "out")]
    xs = [1.2 + 2.6 * i for i in range(len(steps))]
    for x, (text, kind) in zip(xs, steps):
        _box(ax, x, 1.6, text, kind, w=2.1, h=1.25, size=8)
    for a, b in zip(xs, xs[1:]):
        _arrow(ax, (a + 1.1, 1.6), (b - 1.1, 1.6))
    ax.annotate("", xy=(xs[3] - 0.6, 0.95), xytext=(xs[3] + 0.6, 0.95),
                arrowprops=dict(arrowstyle="->", color="#d93025",
                                connectionstyle="arc3,rad=-0.9"))
    ax.text(xs[3], 0.25, "inner_epochs updates on the same batch", ha="center", fontsize=8,
            color="#d93025")
    _save(fig, out_dir / "ch07_training_step.png")


def kl_diagram(out_dir):
    """The KL term per token: the naive log-ratio against k3, and what each does."""
    fig, axes = plt.subplots(1, 2, figsize=(9.4, 3.3))
    d = [i / 100 for i in range(-250, 251)]  # log pi_theta - log pi_ref of one sampled token
    ax = axes[0]
    ax.plot(d, d, color="gray", linestyle=":", label="naive: logp - ref_logp")
    ax.plot(d, [math.exp(-x) + x - 1 for x in d], label="k3: e^(ref-logp) - (ref-logp) - 1")
    ax.axhline(0, color="black", linewidth=0.5)
    ax.axvspan(-2.5, 0, color="tab:red", alpha=0.08)
    ax.text(-1.45, 0.9, "naive < 0 here:\nthe loss pays for\nmaking the sample\nless likely",
            ha="center", va="center", fontsize=8, color="tab:red")
    ax.set_xlabel("log pi_theta - log pi_ref of a sampled token")
    ax.set_ylabel("penalty per token")
    ax.set_ylim(-2.6, 5)
    ax.legend(fontsize=8, loc="upper right")
    ax.set_title("one token's estimate")
    ax = axes[1]
    ax.axis("off")
    ax.set_xlim(0, 10)
    ax.set_ylim(0, 6)
    _box(ax, 1.3, 4.6, "pi_ref\n(frozen start)", "none", w=2.2, h=1.0)
    _box(ax, 8.7, 4.6, "pi_theta\n(after\nmany steps)", "model", w=2.2, h=1.0)
    _arrow(ax, (2.5, 4.85), (7.5, 4.85), "reward gradient pulls away")
    ax.annotate("", xy=(2.5, 4.3), xytext=(7.5, 4.3),
                arrowprops=dict(arrowstyle="->", color="tab:blue", linewidth=1.4))
    ax.text(5.0, 3.85, "beta x k3 pulls back", ha="center", fontsize=8, color="tab:blue")
    ax.text(5.0, 2.3, "without a working KL (none, or the naive term, whose\n"
            "gradient is zero on average) nothing holds the policy:\n"
            "it can collapse onto one answer (entropy -> 0)\n"
            "or drift into text the reward cannot judge", ha="center", va="center",
            fontsize=8)
    ax.set_title("the KL's role")
    fig.tight_layout()
    _save(fig, out_dir / "ch07_kl.png")


def aggregation_diagram(out_dir):
    """Weight of one token in the loss: a short right answer and a long wrong one."""
    short, long_, max_len = 2, 4, 4  # the notebook's example batch of section 5
    weights = {"grpo": (1 / (2 * short), 1 / (2 * long_)),
               "dapo": (1 / (short + long_), 1 / (short + long_)),
               "dr_grpo": (1 / (2 * max_len), 1 / (2 * max_len)),
               "sequence": (1 / 2, 1 / 2)}
    fig, ax = plt.subplots(figsize=(7.2, 3.0))
    names = list(weights)
    xs = range(len(names))
    ax.bar([x - 0.18 for x in xs], [w[0] for w in weights.values()], width=0.36,
           label=f"a token of the short right answer ({short} tokens, A = +1)")
    ax.bar([x + 0.18 for x in xs], [w[1] for w in weights.values()], width=0.36,
           label=f"a token of the long wrong answer ({long_} tokens, A = -1)")
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("weight of one token")
    ax.set_title("loss aggregation: who weighs what (section 5's batch)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    _save(fig, out_dir / "ch07_loss_aggregation.png")


def settings_diagram(out_dir):
    """Reported GRPO settings of DeepSeekMath and DeepSeek-R1-Zero beside the notebook's run."""
    rows = [("", "DeepSeekMath GRPO\narXiv 2402.03300, sec. 4.2",
             "DeepSeek-R1-Zero\narXiv 2501.12948", "this notebook's run\n(tiny-arith)"),
            ("answers per question G", "64", "16", "8"),
            ("training batch", "1024", "512 answers (32 questions)", "32 answers (4 questions)"),
            ("learning rate", "1e-6", "3e-6", "3e-4"),
            ("KL coefficient beta", "0.04", "0.001", "0.04"),
            ("updates per batch", "1", "-", "2 (clip 0.2)")]
    fig, ax = plt.subplots(figsize=(9.6, 2.9))
    ax.axis("off")
    table = ax.table(cellText=[list(r) for r in rows[1:]], colLabels=list(rows[0]),
                     loc="center", cellLoc="center")
    table.auto_set_font_size(False)
    table.set_fontsize(8)
    table.scale(1, 1.9)
    for (r, _c), cell in table.get_celld().items():
        cell.set_edgecolor("#9aa0a6")
        if r == 0:
            cell.set_facecolor("#e8f0fe")
            cell.set_height(cell.get_height() * 1.5)
    ax.set_title("GRPO settings as reported, and ours", fontsize=10)
    _save(fig, out_dir / "ch07_grpo_settings.png")


DIAGRAMS = {"ch07_policies.png": policies_diagram,
            "ch07_training_step.png": training_step_diagram,
            "ch07_kl.png": kl_diagram,
            "ch07_loss_aggregation.png": aggregation_diagram,
            "ch07_grpo_settings.png": settings_diagram}


def main(out_dir: Path = HERE) -> None:
    """Draw every diagram into `out_dir`."""
    draw_all(DIAGRAMS, out_dir)


if __name__ == "__main__":
    main()
