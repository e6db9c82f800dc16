"""Draw the diagrams of the chapter 2, 3, 4, 5 and 9 notebooks (notebooks/figures/chNN_*.png).

Boxes and arrows drawn with matplotlib; the notebooks show the committed images, so a reader
needs nothing but a browser. Redraw after changing a diagram:

    python notebooks/figures/ch02_ch09_diagrams.py
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyBboxPatch, Rectangle  # noqa: E402

HERE = Path(__file__).resolve().parent
COLORS = {"data": "#e8f0fe", "model": "#fde8d7", "check": "#e6f4ea", "out": "#f3e8fd",
          "none": "#f1f3f4"}


def _box(ax, x, y, text, kind="data", w=2.2, h=0.8, size=9):
    """A rounded box centred at (x, y); returns its centre."""
    ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0.05",
                                facecolor=COLORS[kind], edgecolor="#5f6368", linewidth=1))
    ax.text(x, y, text, ha="center", va="center", fontsize=size)
    return x, y


def _arrow(ax, start, end, text=None, size=8):
    ax.annotate("", xy=end, xytext=start,
                arrowprops=dict(arrowstyle="->", color="#5f6368", linewidth=1.2))
    if text:
        ax.text((start[0] + end[0]) / 2, (start[1] + end[1]) / 2 + 0.12, text, ha="center",
                va="bottom", fontsize=size, color="#3c4043")


def _canvas(width, height):
    fig, ax = plt.subplots(figsize=(width, height))
    ax.set_xlim(0, width * 1.25)
    ax.set_ylim(0, height * 1.25)
    ax.axis("off")
    return fig, ax


def draw_all(diagrams, out_dir) -> None:
    """Draw a script's `DIAGRAMS` (a {file name: function} dict) into `out_dir`."""
    out_dir = Path(out_dir)
    for draw in diagrams.values():
        draw(out_dir)
    print("drawn:", ", ".join(diagrams))


def _save(fig, path):
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def model_diagram(out_dir):
    """Chapter 2: the Qwen3 model, bottom to top."""
    fig, ax = _canvas(6.4, 6.4)
    x = 4.0
    ys = [0.5, 1.5, 2.5, 3.4, 4.3, 5.2, 6.2, 7.2]
    labels = [("token ids (B, T)", "data"), ("embedding  (V x C)", "model"),
              ("RMSNorm -> grouped-query attention\n(QK-norm, RoPE; KV cache) -> + residual",
               "model"),
              ("RMSNorm -> SwiGLU feed-forward\n-> + residual", "model"),
              ("final RMSNorm", "model"), ("output head (tied to the embedding)", "model"),
              ("logits (B, T, V): scores of the next token", "out"),
              ("sample: greedy, temperature, top-p", "check")]
    centres = [_box(ax, x, y, t, k, w=4.6, h=0.7 if "\n" not in t else 0.8)
               for y, (t, k) in zip(ys, labels)]
    for a, b in zip(centres, centres[1:]):
        _arrow(ax, (a[0], a[1] + 0.4), (b[0], b[1] - 0.4))
    ax.add_patch(FancyBboxPatch((x - 2.6, 2.0), 5.2, 1.85, boxstyle="round,pad=0.05",
                                fill=False, edgecolor="#d93025", linestyle="--"))
    ax.text(x + 2.75, 2.95, "transformer block\nx num_hidden_layers", fontsize=8,
            color="#d93025", va="center")
    _save(fig, out_dir / "ch02_qwen3_model.png")


def evaluation_diagram(out_dir):
    """Chapter 3: from a problem to a reward."""
    fig, ax = _canvas(10.4, 1.6)
    steps = [("problem", "data"), ("prompt\n(render_prompt)", "data"),
             ("model: greedy,\nbatched", "model"), ("last \\boxed{...}\n(no fallback)", "check"),
             ("normalise\n(LaTeX, units)", "check"), ("grade: exact,\nthen sandboxed\nsympy",
                                                      "check"), ("reward\n1 or 0", "out")]
    xs = [0.9 + 1.85 * i for i in range(len(steps))]
    for x, (text, kind) in zip(xs, steps):
        _box(ax, x, 1.0, text, kind, w=1.5, h=1.0, size=8)
    for a, b in zip(xs, xs[1:]):
        _arrow(ax, (a + 0.77, 1.0), (b - 0.77, 1.0))
    _save(fig, out_dir / "ch03_evaluation_pipeline.png")


def vote_diagram(out_dir):
    """Chapter 4: self-consistency."""
    fig, ax = _canvas(8.8, 3.2)
    p = _box(ax, 1.2, 2.0, "prompt", "data", w=1.6)
    samples = [("Step 1 ...\n\\boxed{12}", "12"), ("\\boxed{9}", "9"),
               ("Step 1 ...\nThe answer is 12.", "no box:\nno vote"),
               ("<think> ...\n\\boxed{12}", "12")]
    for i, (text, answer) in enumerate(samples):
        y = 3.4 - 0.95 * i
        s = _box(ax, 4.0, y, text, "model", w=2.4, h=0.75, size=8)
        _arrow(ax, (p[0] + 0.85, p[1]), (s[0] - 1.25, s[1]))
        a = _box(ax, 6.7, y, answer, "none" if "no" in answer else "check", w=1.4, h=0.75,
                 size=8)
        _arrow(ax, (s[0] + 1.25, s[1]), (a[0] - 0.75, a[1]))
        if "no" not in answer:
            _arrow(ax, (a[0] + 0.75, a[1]), (9.3, 2.0))
    _box(ax, 10.0, 2.0, "vote\n12: 2, 9: 1\n-> 12", "out", w=1.4, h=1.1)
    ax.text(4.0, 4.05, "N samples (temperature > 0)", ha="center", fontsize=9)
    ax.text(6.7, 4.05, "boxed answer,\npooled by the grader", ha="center", fontsize=9)
    _save(fig, out_dir / "ch04_self_consistency.png")


def scorer_diagram(out_dir):
    """Chapter 5: best-of-N and refinement, both driven by a scorer."""
    fig, ax = _canvas(9.2, 3.4)
    ax.text(0.2, 3.95, "best-of-N", fontsize=11, weight="bold")
    _box(ax, 1.2, 2.9, "prompt", "data", w=1.4)
    _box(ax, 3.7, 2.9, "N complete\nsamples", "model", w=2.0)
    _box(ax, 6.6, 2.9, "score each: confidence,\nverifier or PRM", "check", w=2.8)
    _box(ax, 9.9, 2.9, "keep the\nbest-scored one", "out", w=2.0)
    for x0, x1 in ((1.95, 2.65), (4.75, 5.15), (8.05, 8.85)):
        _arrow(ax, (x0, 2.9), (x1, 2.9))
    ax.text(0.2, 1.75, "refinement", fontsize=11, weight="bold")
    d = _box(ax, 1.6, 0.8, "draft (greedy)", "model", w=2.0)
    k = _box(ax, 4.6, 0.8, "critic: first\nwrong step?", "check", w=2.2)
    r = _box(ax, 7.8, 0.8, "keep the steps before it,\nresample from there", "model", w=2.8)
    f = _box(ax, 10.6, 0.8, "none: accept", "out", w=1.6)
    _arrow(ax, (d[0] + 1.05, d[1]), (k[0] - 1.15, k[1]))
    _arrow(ax, (k[0] + 1.15, k[1]), (r[0] - 1.45, r[1]), "step k")
    ax.annotate("", xy=(k[0], k[1] - 0.45), xytext=(r[0], r[1] - 0.45),
                arrowprops=dict(arrowstyle="->", color="#5f6368",
                                connectionstyle="arc3,rad=-0.3"))
    ax.text(6.2, -0.05, "next round (up to a limit)", ha="center", fontsize=8)
    ax.annotate("", xy=(f[0], f[1] + 0.45), xytext=(k[0] + 0.6, k[1] + 0.45),
                arrowprops=dict(arrowstyle="->", color="#5f6368",
                                connectionstyle="arc3,rad=-0.25"))
    _save(fig, out_dir / "ch05_best_of_n_and_refinement.png")


def distillation_diagram(out_dir):
    """Chapter 9: rejection sampling and SFT."""
    fig, ax = _canvas(9.6, 2.6)
    t = _box(ax, 1.3, 2.2, "teacher\n(e.g. the chapter 7\nGRPO model)", "model", w=2.2, h=1.1)
    s = _box(ax, 4.2, 2.2, "k samples\nper training problem", "data", w=2.2)
    v = _box(ax, 7.2, 2.2, "keep if: finished,\nboxed answer right,\nevery step right",
             "check", w=2.4, h=1.1)
    f = _box(ax, 10.3, 2.2, "traces (JSONL):\nprompt + completion", "data", w=2.4)
    st = _box(ax, 10.3, 0.55, "student: SFT, loss on\ncompletion tokens only", "out", w=2.8)
    for a, b in ((t, s), (s, v), (v, f)):
        _arrow(ax, (a[0] + 1.15, a[1]), (b[0] - 1.25, b[1]))
    _arrow(ax, (f[0], f[1] - 0.45), (st[0], st[1] + 0.45))
    ax.text(7.2, 1.35, "rejected samples are dropped", ha="center", fontsize=8,
            color="#5f6368")
    _save(fig, out_dir / "ch09_distillation.png")


def _cell(ax, x, y, text, color, size=8, w=0.9, h=0.6):
    """A square grid cell centred at (x, y)."""
    ax.add_patch(Rectangle((x - w / 2, y - h / 2), w, h, facecolor=color, edgecolor="#5f6368",
                           linewidth=0.8))
    if text:
        ax.text(x, y, text, ha="center", va="center", fontsize=size)


def _padded_batch(ax, rows):
    """Left panel of the padding diagram: tokens, mask and RoPE position of each prompt."""
    y = 5.6
    for name, tokens in rows:
        real = [t != "pad" for t in tokens]
        positions = [str(sum(real[:j])) if r else "-" for j, r in enumerate(real)]
        for label, values, kind in ((name, tokens, "tokens"), ("mask", real, "mask"),
                                    ("position", positions, "pos")):
            ax.text(-0.6, y, label, ha="right", va="center", fontsize=9)
            for j, v in enumerate(values):
                if kind == "tokens":
                    _cell(ax, j, y, v, COLORS["none"] if v == "pad" else COLORS["data"])
                else:
                    ax.text(j, y, str(int(v)) if kind == "mask" else v, ha="center",
                            va="center", fontsize=9)
            y -= 0.7
        y -= 0.35
    last = len(rows[0][1]) - 1
    ax.annotate("every row's last token:\nthe next one is\nread here", xy=(last + 0.3, 5.9),
                xytext=(last + 0.9, 6.6), fontsize=8, ha="left",
                arrowprops=dict(arrowstyle="->", color="#5f6368"))


def _mask_grid(ax, tokens, x0, y0):
    """Right panel: the attention mask of one left-padded prompt (causal and key is real)."""
    n = len(tokens)
    for i, q in enumerate(tokens):  # query rows, top to bottom
        ax.text(x0 - 0.6, y0 - 0.6 * i, q, ha="right", va="center", fontsize=8)
        for j, k in enumerate(tokens):
            allowed = j <= i and k != "pad"
            color = "#b7e1c1" if allowed else "white"
            if q == "pad":
                color = COLORS["none"]  # sees every key (no NaN); its output is never used
            _cell(ax, x0 + 0.7 * j, y0 - 0.6 * i, "", color, w=0.7, h=0.6)
    for j, k in enumerate(tokens):
        ax.text(x0 + 0.7 * j, y0 + 0.5, k, ha="center", va="bottom", fontsize=8, rotation=90)
    ax.text(x0 + 0.35 * (n - 1), y0 - 0.6 * n - 0.1,
            "green: may attend (earlier or itself, and real)\n"
            "grey: padding query rows, unused", ha="center", va="top", fontsize=8)


def padding_diagram(out_dir):
    """Chapter 2: a left-padded batch, its attention mask and RoPE positions."""
    fig, ax = plt.subplots(figsize=(11.5, 4.6))
    ax.set_xlim(-2.6, 17.0)
    ax.set_ylim(0.2, 7.6)
    ax.axis("off")
    a = [f"a{i}" for i in range(1, 8)]
    b = ["pad"] * 3 + [f"b{i}" for i in range(1, 5)]
    _padded_batch(ax, [("prompt 0", a), ("prompt 1", b)])
    ax.text(3.0, 7.35, "a left-padded batch (B = 2, T = 7)", ha="center", fontsize=10,
            weight="bold")
    _mask_grid(ax, b, 11.0, 5.6)
    ax.text(13.1, 7.35, "prompt 1: which keys each query sees", ha="center", fontsize=10,
            weight="bold")
    _save(fig, out_dir / "ch02_left_padding.png")


def expand_diagram(out_dir):
    """Chapter 2 (used in chapter 6): prefill one prompt, expand its cache, decode G rows."""
    fig, ax = _canvas(10.4, 2.4)
    p = _box(ax, 1.3, 2.2, "prompt ids\n(1, P)", "data", w=1.9)
    f = _box(ax, 4.1, 2.2, "prefill once:\nmodel(ids, cache=cache,\nlast_only=True)", "model",
             w=2.7, h=1.0)
    e = _box(ax, 7.3, 2.2, "cache.expand(G):\nkeys/values (1, H_kv, P, D)\n"
             "-> (G, H_kv, P, D)", "check", w=2.9, h=1.0)
    d = _box(ax, 10.6, 2.2, "decode G rows together:\nmodel(next (G, 1), is_real,\n"
             "cache, last_only=True)", "model", w=3.0, h=1.0)
    for a, b, wa, wb in ((p, f, 0.95, 1.35), (f, e, 1.35, 1.45), (e, d, 1.45, 1.5)):
        _arrow(ax, (a[0] + wa + 0.05, a[1]), (b[0] - wb - 0.05, b[1]))
    ax.annotate("", xy=(d[0] - 0.8, d[1] - 0.55), xytext=(d[0] + 0.8, d[1] - 0.55),
                arrowprops=dict(arrowstyle="->", color="#5f6368",
                                connectionstyle="arc3,rad=-0.6"))
    ax.text(d[0], 0.75, "one token per row and step; a finished row feeds\n"
            "padding (is_real False), masked out for the others", ha="center", va="top",
            fontsize=8)
    _save(fig, out_dir / "ch02_kv_expand.png")


DIAGRAMS = (model_diagram, padding_diagram, expand_diagram, evaluation_diagram, vote_diagram,
            scorer_diagram, distillation_diagram)


def main(out_dir: Path = HERE) -> None:
    """Draw every diagram into `out_dir`."""
    for draw in DIAGRAMS:
        draw(out_dir)
    print("drawn:", ", ".join(sorted(p.name for p in out_dir.glob("ch0*.png"))))


if __name__ == "__main__":
    main()
