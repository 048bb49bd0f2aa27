"""Attention maps as matplotlib figures, for scripts/attention_map.py and the ablation figure of
scripts/summarize_ablations.py: the colours of training.attention_maps.colorize, the picture
TensorBoard shows."""
from __future__ import annotations

import numpy as np

from training.attention_maps import GAMMA, colorize


def draw_map(ax, weights: np.ndarray, labels: list[str], title: str = "",
             fontsize: float | None = None) -> None:
    """One head's [n, n] map on a matplotlib Axes, tokens on both axes (keys along x)."""
    n = weights.shape[-1]
    fontsize = fontsize or max(4.0, min(9.0, 300 / n))
    ax.imshow(colorize(weights), interpolation="nearest")
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
    bar.set_label("attention weight (sqrt scale)")
    return bar
