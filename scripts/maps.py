"""Attention maps as matplotlib figures, for scripts/attention_map.py, the ablation figure of
scripts/summarize_ablations.py and the lessons (lessons/lesson.py): the colours of
training.attention_maps.colorize, the picture TensorBoard shows, and one line for the diagonal."""
from __future__ import annotations

import math
import textwrap

import numpy as np

from training.attention_maps import GAMMA, colorize


def future_line(ax, n: int, color: str = "tab:red") -> None:
    """A staircase on an [n, n] map between column j = i (row i's own position) and j = i + 1:
    right of it is the future, which a causal layer never reads (a leak's bright line just above
    the diagonal lies right of it)."""
    xs = [x for i in range(n) for x in (i + 0.5, i + 0.5)]
    ys = [y for i in range(n) for y in (i - 0.5, i + 0.5)]
    ax.plot(xs, ys, color=color, linewidth=1.5)


def draw_map(ax, weights: np.ndarray, labels: list[str], title: str = "",
             fontsize: float | None = None) -> None:
    """One head's [n, n] map on a matplotlib Axes, tokens on both axes (keys along x), the
    future's edge (`future_line`) in cyan, which magma has nowhere."""
    n = weights.shape[-1]
    fontsize = fontsize or max(4.0, min(9.0, 300 / n))
    ax.imshow(colorize(weights), interpolation="nearest")
    future_line(ax, n, "cyan")
    ax.set_xticks(range(n), labels, rotation=90, fontsize=fontsize, family="DejaVu Sans Mono")
    ax.set_yticks(range(n), labels, fontsize=fontsize, family="DejaVu Sans Mono")
    ax.tick_params(length=0, pad=1)
    ax.set_xlabel("key", fontsize=fontsize + 1)
    ax.set_ylabel("query", fontsize=fontsize + 1)
    if title:
        ax.set_title(title, fontsize=fontsize + 2)


def colorbar(fig, ax, **kwargs):
    """A colour bar for `draw_map`'s scale (grey: future keys with weight exactly 0)."""
    from matplotlib import colormaps
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import PowerNorm

    mappable = ScalarMappable(PowerNorm(GAMMA, 0.0, 1.0), colormaps["magma"])
    bar = fig.colorbar(mappable, ax=ax, **kwargs)
    bar.set_label("attention weight (sqrt scale; grey: a future key, weight 0)")
    return bar


def map_figure(weights: np.ndarray, labels: list[str], title: str):
    """A layer's [h, n, n] maps as one figure, each head `draw_map`'s picture in a grid (one head:
    larger), one labelled colour bar, the title's lines wrapped to the figure's width."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    h, n = weights.shape[0], weights.shape[-1]
    cols = math.ceil(math.sqrt(h))
    rows = math.ceil(h / cols)
    side = max(5.0, 0.16 * n + 1.5) * (1 if h == 1 else 0.8)
    fig, axes = plt.subplots(rows, cols, figsize=(cols * side + 1.2, rows * side + 0.6), dpi=110,
                             squeeze=False, layout="constrained")
    for i, ax in enumerate(axes.flat):
        if i < h:
            draw_map(ax, weights[i], labels, f"head {i}" if h > 1 else "")
        else:
            ax.axis("off")
    colorbar(fig, axes, fraction=0.04 / cols, pad=0.02, shrink=0.6)
    # about 11 characters of the title's font to an inch
    width = int(11 * (cols * side + 1.2))
    fig.suptitle("\n".join(textwrap.fill(line, width) for line in title.split("\n")), fontsize=10)
    return fig
