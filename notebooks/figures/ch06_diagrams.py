"""Draw the diagrams of the chapter 6 notebook (notebooks/figures/ch06_*.png).

Boxes and arrows with the helpers of ch02_ch09_diagrams.py; the notebook shows the committed
images. Redraw after changing a diagram:

    python notebooks/figures/ch06_diagrams.py
"""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # run as a script or loaded by path: the helpers sit beside us
    sys.path.insert(0, str(HERE))

from ch02_ch09_diagrams import _arrow, _box, _canvas, _save  # noqa: E402
from matplotlib.patches import FancyBboxPatch, Rectangle  # noqa: E402

RED = "#d93025"
GREY = "#5f6368"


def _title(ax, x, y, text, size=11):
    ax.text(x, y, text, fontsize=size, weight="bold", va="center")


def _note(ax, x, y, text, color=GREY, size=8, ha="center"):
    ax.text(x, y, text, fontsize=size, color=color, ha=ha, va="center")


def _curved(ax, start, end, rad=-0.35, color=RED, ls="--"):
    ax.annotate("", xy=end, xytext=start,
                arrowprops=dict(arrowstyle="->", lw=1.2, ls=ls, color=color,
                                connectionstyle=f"arc3,rad={rad}"))


def objectives_diagram(out_dir):
    """Pre-training's next-token objective next to RL's expected-reward objective."""
    fig, ax = _canvas(10.4, 3.6)
    _title(ax, 0.2, 4.2, "pre-training: every token has a target")
    c = _box(ax, 1.6, 3.1, "text from a corpus\n$x_1\\ x_2 \\dots x_T$", "data", w=2.4)
    m = _box(ax, 4.6, 3.1, "model predicts\n$p_\\theta(x_{t+1} \\mid x_{\\leq t})$", "model",
             w=2.8)
    loss = _box(ax, 9.4, 3.1, "minimise $-\\sum_t \\log p_\\theta(x_{t+1} \\mid x_{\\leq t})$\n"
                "the data says which token is right", "out", w=4.6)
    _arrow(ax, (c[0] + 1.25, c[1]), (m[0] - 1.45, m[1]))
    _arrow(ax, (m[0] + 1.45, m[1]), (loss[0] - 2.35, loss[1]))
    _title(ax, 0.2, 1.95, "reinforcement learning: only the outcome is scored")
    q = _box(ax, 1.2, 0.85, "question q", "data", w=1.6)
    p = _box(ax, 3.6, 0.85, "policy $\\pi_\\theta$ samples\na whole answer o", "model", w=2.4)
    r = _box(ax, 6.3, 0.85, "reward $r(q, o)$\none number", "check", w=2.0)
    j = _box(ax, 10.0, 0.85, "maximise $J(\\theta) = \\mathbb{E}_{o \\sim \\pi_\\theta}"
             "[\\, r(q, o) \\,]$\nno token-level target", "out", w=3.8)
    _arrow(ax, (q[0] + 0.85, q[1]), (p[0] - 1.25, p[1]))
    _arrow(ax, (p[0] + 1.25, p[1]), (r[0] - 1.05, r[1]))
    _arrow(ax, (r[0] + 1.05, r[1]), (j[0] - 1.95, j[1]))
    _save(fig, out_dir / "ch06_objectives.png")


def _chain(ax, y, boxes):
    """Boxes (x, text, kind, width, height) in a row at height y, joined by arrows."""
    drawn = [(_box(ax, x, y, text, kind, w=w, h=h), w) for x, text, kind, w, h in boxes]
    for (a, wa), (b, wb) in zip(drawn, drawn[1:]):
        _arrow(ax, (a[0] + wa / 2 + 0.05, a[1]), (b[0] - wb / 2 - 0.05, b[1]))


def rlhf_rlvr_diagram(out_dir):
    """RLHF's learned reward model and RLVR's verifier."""
    fig, ax = _canvas(10.4, 3.4)
    _title(ax, 0.2, 4.0, "RLHF: a learned reward model")
    _chain(ax, 3.0, [(1.2, "prompts", "data", 1.6, 0.8),
                     (3.6, "policy samples\nanswers", "model", 2.2, 0.8),
                     (6.7, "reward model: a network\ntrained on human\npreference pairs",
                      "check", 2.8, 1.0),
                     (10.0, "PPO update\n(a score in $\\mathbb{R}$)", "out", 2.2, 0.8)])
    _note(ax, 6.7, 2.2, "can be fooled: the policy learns what the model likes (reward hacking)",
          RED)
    _title(ax, 0.2, 1.55, "RLVR: a verifier")
    _chain(ax, 0.6, [(1.2, "problems with\nreference answers", "data", 2.0, 0.8),
                     (3.8, "policy samples\nanswers", "model", 2.2, 0.8),
                     (6.7, "verifier: a program that\ngrades the final answer", "check", 2.8,
                      0.8),
                     (10.0, "PPO or GRPO update\n(reward 1 or 0)", "out", 2.4, 0.8)])
    _note(ax, 6.7, -0.1, "Tulu 3 (arXiv 2411.15124), DeepSeek-R1 (arXiv 2501.12948): "
          "math with checkable answers, code with tests")
    _save(fig, out_dir / "ch06_rlhf_to_rlvr.png")


def ppo_grpo_diagram(out_dir):
    """PPO's value model (critic) and GRPO's group baseline (after DeepSeekMath's figure 4)."""
    fig, ax = _canvas(10.4, 4.2)
    _title(ax, 0.2, 5.0, "PPO")
    q = _box(ax, 0.9, 4.0, "q", "data", w=0.9)
    pol = _box(ax, 2.9, 4.0, "policy\nmodel", "model", w=1.6)
    o = _box(ax, 4.9, 4.0, "o", "data", w=0.9)
    rw = _box(ax, 6.9, 4.4, "reward\n(verifier or RM)", "check", w=1.9, h=0.7)
    v = _box(ax, 6.9, 3.4, "value model\n(critic, trained)", "model", w=1.9, h=0.7)
    gae = _box(ax, 9.2, 3.9, "GAE: advantage\n$A_t$ per token", "out", w=1.9, h=0.8)
    _arrow(ax, (q[0] + 0.5, q[1]), (pol[0] - 0.85, pol[1]))
    _arrow(ax, (pol[0] + 0.85, pol[1]), (o[0] - 0.5, o[1]))
    _arrow(ax, (o[0] + 0.5, o[1] + 0.1), (rw[0] - 1.0, rw[1]))
    _arrow(ax, (o[0] + 0.5, o[1] - 0.1), (v[0] - 1.0, v[1]))
    _arrow(ax, (rw[0] + 1.0, rw[1]), (gae[0] - 1.0, gae[1] + 0.15), "r")
    _arrow(ax, (v[0] + 1.0, v[1]), (gae[0] - 1.0, gae[1] - 0.15), "$V_t$")
    _curved(ax, (gae[0], gae[1] + 0.45), (pol[0], pol[1] + 0.45), rad=0.25)
    _note(ax, 6.0, 5.55, "update the policy (and the critic)", RED)
    _title(ax, 0.2, 2.3, "GRPO")
    q = _box(ax, 0.9, 1.2, "q", "data", w=0.9)
    pol = _box(ax, 2.9, 1.2, "policy\nmodel", "model", w=1.6)
    outs = [_box(ax, 4.9, 1.2 + dy, f"$o_{k}$", "data", w=0.9, h=0.4, size=8)
            for dy, k in ((0.75, 1), (0.25, 2), (-0.75, "G"))]
    _note(ax, 4.9, 0.7, "$\\vdots$", "black", 10)
    rw = _box(ax, 6.9, 1.2, "reward\n(verifier)\n$r_1 \\dots r_G$", "check", w=1.9, h=1.1)
    grp = _box(ax, 9.2, 1.2, "group baseline\n$A_i = \\frac{r_i - \\mathrm{mean}(r)}"
               "{\\mathrm{std}(r)}$", "out", w=2.0, h=1.1)
    _arrow(ax, (q[0] + 0.5, q[1]), (pol[0] - 0.85, pol[1]))
    for b in outs:
        _arrow(ax, (pol[0] + 0.85, pol[1]), (b[0] - 0.5, b[1]))
        _arrow(ax, (b[0] + 0.5, b[1]), (rw[0] - 1.0, rw[1]))
    _arrow(ax, (rw[0] + 1.0, rw[1]), (grp[0] - 1.05, grp[1]))
    _curved(ax, (grp[0], grp[1] - 0.6), (pol[0], pol[1] - 0.45), rad=-0.25)
    _note(ax, 6.0, -0.35, "no value model: the other answers to the same question are the "
          "baseline", RED)
    _save(fig, out_dir / "ch06_ppo_vs_grpo.png")


def grpo_step_diagram(out_dir):
    """One GRPO step for one question (was a plotting cell of the chapter 6 notebook)."""
    fig, ax = _canvas(10.0, 3.4)
    q = _box(ax, 1.0, 3.1, "question q\n(a prompt)", "data", w=1.7)
    pol = _box(ax, 3.6, 3.1, "policy $\\pi_\\theta$\nsamples G answers\n$o_1 \\dots o_G$",
               "model", w=2.2, h=1.0)
    gr = _box(ax, 6.7, 3.1, "grader\nreward $r_i \\in \\{0, 1\\}$", "check", w=2.2)
    adv = _box(ax, 10.6, 3.1, "advantage\n$A_i = (r_i - \\mathrm{mean}\\, r)\\,/\\,"
               "\\mathrm{std}\\, r$", "out", w=3.2)
    lp = _box(ax, 3.6, 0.9, "log-probabilities\n$\\log \\pi_\\theta(o_i \\mid q)$", "model",
              w=2.4)
    loss = _box(ax, 8.2, 0.9, "loss $-\\frac{1}{G}\\sum_i A_i \\log \\pi_\\theta(o_i \\mid q)$\n"
                "backward, clip, AdamW step", "out", w=3.6, h=0.9)
    _arrow(ax, (q[0] + 0.9, q[1]), (pol[0] - 1.15, pol[1]))
    _arrow(ax, (pol[0] + 1.15, pol[1]), (gr[0] - 1.15, gr[1]), "texts")
    _arrow(ax, (gr[0] + 1.15, gr[1]), (adv[0] - 1.65, adv[1]), "G rewards")
    _arrow(ax, (pol[0], pol[1] - 0.55), (lp[0], lp[1] + 0.45), "token ids")
    _arrow(ax, (lp[0] + 1.25, lp[1]), (loss[0] - 1.85, loss[1]))
    _arrow(ax, (adv[0], adv[1] - 0.45), (loss[0] + 1.2, loss[1] + 0.5), "G advantages")
    _curved(ax, (loss[0] - 1.85, loss[1] - 0.3), (pol[0] - 0.9, pol[1] - 0.55), rad=-0.6)
    _note(ax, 1.1, 1.3, "updated policy\nsamples the\nnext groups", RED)
    ax.set_title("One GRPO step for one question (a training step averages several questions)")
    _save(fig, out_dir / "ch06_grpo_step.png")


def rollouts_diagram(out_dir):
    """`sample_rollouts`: one prefill, the cache copied to G rows, a masked batch decode."""
    fig, ax = _canvas(10.4, 3.4)
    p = _box(ax, 1.3, 3.4, "prompt ids (1, P)", "data", w=2.2)
    pf = _box(ax, 4.2, 3.4, "one prefill\nlast_only=True", "model", w=2.2)
    ex = _box(ax, 7.4, 3.4, "KV cache: 1 row\nexpand(G): G rows", "model", w=2.6)
    _arrow(ax, (p[0] + 1.15, p[1]), (pf[0] - 1.15, pf[1]))
    _arrow(ax, (pf[0] + 1.15, pf[1]), (ex[0] - 1.35, ex[1]))
    _arrow(ax, (ex[0], ex[1] - 0.45), (ex[0], 2.55))
    # the decoded batch: G rows, one column per step
    lengths, cols, x0, y0, cw, ch = (5, 9, 3, 7), 9, 3.2, 0.35, 0.62, 0.45
    for i, n in enumerate(lengths):
        y = y0 + (len(lengths) - 1 - i) * ch
        ax.text(x0 - 0.15, y + ch / 2, f"row {i + 1}", ha="right", va="center", fontsize=8)
        for t in range(cols):
            real, eos = t < n, t == n - 1
            face = "#d93025" if eos else ("#cfe2f3" if real else "#f1f3f4")
            ax.add_patch(Rectangle((x0 + t * cw, y), cw, ch, facecolor=face, edgecolor=GREY,
                                   hatch=None if real else "//", linewidth=0.8))
            label = "EOS" if eos else ("tok" if real else "pad")
            ax.text(x0 + (t + 0.5) * cw, y + ch / 2, label, ha="center", va="center",
                    fontsize=6.5, color="white" if eos else "black")
    ax.text(x0 + cols * cw / 2, y0 + len(lengths) * ch + 0.12,
            "decode: G rows x one new token per step", ha="center", fontsize=9)
    ax.add_patch(FancyBboxPatch((x0 + cols * cw + 0.3, 0.45), 3.6, 1.6, boxstyle="round,pad=0.05",
                                facecolor="white", edgecolor=GREY))
    ax.text(x0 + cols * cw + 0.45, 1.25,
            "a finished row keeps flowing as\npadding (hatched): its mask is 0,\n"
            "no later token attends to it,\nthe loss ignores it; the batch\n"
            "stops when every row has its EOS", fontsize=8, va="center")
    _save(fig, out_dir / "ch06_group_rollouts.png")


def detach_diagram(out_dir):
    """Where gradients flow in the loss: the advantages and the old log-probs are constants."""
    fig, ax = _canvas(10.0, 2.6)
    lp = _box(ax, 1.6, 2.3, "$\\log \\pi_\\theta(o_i \\mid q)$\ncomputed with gradients",
              "model", w=2.8)
    a = _box(ax, 1.6, 0.7, "$A_i$ from rewards\na constant (no gradient)", "none", w=2.8)
    j = _box(ax, 5.6, 1.5, "objective\n$J = \\frac{1}{G}\\sum_i A_i \\log \\pi_\\theta(o_i "
             "\\mid q)$\nto maximise", "check", w=3.2, h=1.1)
    loss = _box(ax, 10.0, 1.5, "loss $L = -J$\nthe optimizer minimises,\nso we flip the sign",
                "out", w=3.0, h=1.1)
    _arrow(ax, (lp[0] + 1.45, lp[1]), (j[0] - 1.65, j[1] + 0.3))
    _arrow(ax, (a[0] + 1.45, a[1]), (j[0] - 1.65, j[1] - 0.3))
    _arrow(ax, (j[0] + 1.65, j[1]), (loss[0] - 1.55, loss[1]), "x (-1)")
    _curved(ax, (loss[0], loss[1] + 0.6), (lp[0] + 0.3, lp[1] + 0.45), rad=0.15)
    _note(ax, 6.6, 3.7, "backward: the gradient reaches $\\theta$ only through "
          "$\\log \\pi_\\theta$", RED)
    _note(ax, 6.6, -0.15, ".detach() makes a tensor such a constant: the old log-probs of "
          "the ratio form, numbers kept for logging")
    _save(fig, out_dir / "ch06_loss_and_detach.png")


DIAGRAMS = {
    "ch06_objectives.png": objectives_diagram,
    "ch06_rlhf_to_rlvr.png": rlhf_rlvr_diagram,
    "ch06_ppo_vs_grpo.png": ppo_grpo_diagram,
    "ch06_grpo_step.png": grpo_step_diagram,
    "ch06_group_rollouts.png": rollouts_diagram,
    "ch06_loss_and_detach.png": detach_diagram,
}


def main(out_dir: Path = HERE) -> None:
    """Draw every chapter 6 diagram into `out_dir`."""
    out_dir = Path(out_dir)
    for draw in DIAGRAMS.values():
        draw(out_dir)
    print("drawn:", ", ".join(DIAGRAMS))


if __name__ == "__main__":
    main()
