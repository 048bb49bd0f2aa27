"""What the lessons share: the project on the import path, one style of picture, and a small text.

A lesson's first cell imports this file (the notebooks run with lessons/ as their folder), which
puts the project's root on `sys.path`, so that the cells below import model/ and check_attention/
as the project's own code does.
"""
from __future__ import annotations

import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from model.config import AttentionConfig  # noqa: E402
from scripts.maps import future_line  # noqa: E402,F401  (the maps' staircase; lesson 02 draws it)

# Pictures for a person: PNG at a modest resolution (the notebooks stay small), a white-to-blue
# scale whose darkness is the weight, so that a map reads the same printed in grey.
plt.rcParams.update({"figure.dpi": 80, "savefig.dpi": 80, "font.size": 10,
                     "axes.titlesize": 10, "figure.constrained_layout.use": True})
WEIGHTS_CMAP = "Blues"


def focus_map(ax, weights: torch.Tensor, title: str, annotate: bool = True,
              labels: list[str] | None = None, future: bool = False) -> None:
    """weights [n, m] as a picture: query rows, key columns, 0 white and 1 dark, each cell
    written out when the map is small; future=True draws a red line around the keys after each
    query (the causal mask hides them)."""
    w = weights.detach().double()
    n, m = w.shape
    image = ax.imshow(w, cmap=WEIGHTS_CMAP, vmin=0, vmax=1)
    ax.set_title(title)
    ax.set_xlabel("key position j (column)")
    ax.set_ylabel("query position i (row)")
    ax.set_xticks(range(m), labels if labels else range(m))
    ax.set_yticks(range(n), labels if labels else range(n))
    if annotate and n * m <= 100:
        for i in range(n):
            for j in range(m):
                ax.text(j, i, f"{w[i, j]:.2f}", ha="center", va="center", fontsize=8,
                        color="white" if w[i, j] > 0.6 else "black")
    if future:
        future_line(ax, n)
    ax.figure.colorbar(image, ax=ax, shrink=0.8, label="attention weight")


def attention_config(name: str) -> AttentionConfig:
    """conf/attention/NAME.yaml merged onto AttentionConfig's defaults, as train.py and the
    checker read it: the correct layer, or one pitfall as its config diff."""
    base = OmegaConf.structured(AttentionConfig)
    diff = OmegaConf.load(ROOT / "conf" / "attention" / f"{name}.yaml")
    return OmegaConf.to_object(OmegaConf.merge(base, diff))


# A made-up play, generated here so that lesson 03 trains without a download and gives the
# same text on every machine (`python train.py` trains on the real Shakespeare).
_PEOPLE = ["ROMEO", "JULIET", "HAMLET", "OPHELIA", "LEAR", "CORDELIA", "MACBETH", "BANQUO"]
_SAYS = ["my lord", "good sir", "sweet lady", "alas", "nay", "o heaven", "hark", "fair cousin"]
_WHO = ["the king", "thy father", "the night", "my heart", "this sword", "the moon", "our love"]
_DOES = ["doth weep", "shall fall", "is gone", "hath spoken", "must wait", "will rise"]
_WHEN = ["tonight.", "at dawn.", "for ever.", "ere long.", "no more.", "in the rain."]


def tiny_play(n_chars: int, seed: int = 0) -> str:
    """About n_chars characters of speeches: `NAME:` then one to three lines, then a blank line."""
    rng, parts, size = random.Random(seed), [], 0
    while size < n_chars:
        lines = [f"{rng.choice(_SAYS).capitalize()}, {rng.choice(_WHO)} {rng.choice(_DOES)} "
                 f"{rng.choice(_WHEN)}" for _ in range(rng.randint(1, 3))]
        speech = f"{rng.choice(_PEOPLE)}:\n" + "\n".join(lines) + "\n\n"
        parts.append(speech)
        size += len(speech)
    return "".join(parts)
