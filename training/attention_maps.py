"""Seeing attention: how much weight reaches the future, and where each query's weight goes.

- `future_weight`: the per-layer scalar logged with the attention diagnostics.
- `map_window`, `token_labels`: the fixed validation window that every run's maps are drawn on,
  and its tokens as axis labels.
- `attention_weights`: one forward pass over a window, every layer's weights (and future
  weight) on the host.
- `card_image`: one layer as TensorBoard's Images tab shows it, in a card CARD_WIDTH pixels wide:
  the sharpest head at a size whose tokens can be read, and every head as a thumbnail beneath;
  training/tb.py's `log_attention_maps` logs one per layer (tag `weights/attention_layer<i>`)
  at each evaluation.

Every renderer (this one, and scripts/maps.py's matplotlib figures for the command line and the
ablation figure) shares `colorize`, so a map looks the same in TensorBoard, in a PNG and in the
README: weights from 0 to 1 on a square-root colour scale (small weights stay visible), and
future keys that get exactly 0 weight in grey, so a correct map is a coloured lower triangle
on grey and any leak shows as colour in the grey. `card_image` draws with numpy and Pillow
rather than matplotlib because it runs at every evaluation of every run, where matplotlib's
layout and text rendering would cost more than the evaluation itself; nothing here imports
either library until a picture is drawn.
"""
from __future__ import annotations

import math
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from model.attention import causal_pattern
from training.config import CachedEval

FUTURE_RGB = (64, 68, 78)   # future keys with no weight: a bluish grey, unlike any text pixel
GAMMA = 0.5                 # colour = magma(weight ** GAMMA)
VISIBLE = {"\n": "↵", " ": "·", "\t": "→", "\r": "␍"}


# ----------------------------------------------------------------------------- the scalar


def future_weight(weights: torch.Tensor) -> torch.Tensor:
    """Mean over query rows of the softmax mass that did not stay on the keys the query may see.

    weights [..., T, m] (queries right-aligned on the keys, as the layer returns them) -> a
    0-dim tensor, computed where the weights are. It is 1 - (weight on the visible keys): for a
    mask that lets the future in (mask_zero, mask_fill_zero) that is the weight on future keys;
    for mask_after_softmax, whose future weights are zeroed after the softmax, it is the mass
    the future took from the softmax's denominator, which is how that bug leaks. A correct
    softmax row sums to 1 up to rounding (one rounding per weight in the weights' dtype, at most
    its eps in total, plus float32's over the row); a row whose deficit is within that is
    counted as 0, so correct attention gives exactly 0.
    """
    T, m = weights.shape[-2:]
    w = weights.float()
    visible = causal_pattern(T, m, w.device)                    # [T, m]
    missing = 1.0 - (w * visible).sum(-1)                       # [..., T]
    rounding = torch.finfo(weights.dtype).eps + m * torch.finfo(torch.float32).eps
    return torch.where(missing.abs() <= rounding, 0.0, missing).mean()


# ----------------------------------------------------------------------------- the window


def map_window(tokens: np.ndarray, tokenizer, n: int, at: float = 0.5) -> list[int]:
    """n token ids of a split, starting at the first non-empty line at or after fraction `at`
    of it: a fixed place, so every run with the same data and tokenizer is drawn on the same
    text, and a line start, so the window reads naturally."""
    n = max(1, min(n, len(tokens)))
    start = min(int(at * len(tokens)), len(tokens) - n)
    end_of_line = False
    for i in range(start, len(tokens) - n + 1):
        text = tokenizer.decode([int(tokens[i])])
        if end_of_line and text.strip():
            return [int(t) for t in tokens[i:i + n]]
        end_of_line = end_of_line or text.endswith("\n")
    return [int(t) for t in tokens[start:start + n]]  # no line break after `at`: as it comes


def token_labels(tokenizer, ids: list[int]) -> list[str]:
    """Each token decoded on its own, whitespace made visible (· space, ↵ newline, → tab)."""
    labels = []
    for i in ids:
        text = tokenizer.decode([i]) or tokenizer.id_to_token(i) or f"<{i}>"
        labels.append("".join(VISIBLE.get(ch, ch) for ch in text))
    return labels


def map_labels(tokenizer, ids: list[int], cached: bool = False,
               how: CachedEval = CachedEval.tokens) -> list[str]:
    """The axis labels of `attention_weights`' maps of the window `ids`: its tokens, or the
    sequence the served path feeds (`served_ids`, its pads as PAD_LABEL)."""
    if not (cached and CachedEval(how) is CachedEval.served):
        return token_labels(tokenizer, ids)
    fed, pad = served_ids(ids)
    half = len(ids) // 2
    return [PAD_LABEL if half <= i < half + pad else label
            for i, label in enumerate(token_labels(tokenizer, fed))]


# ----------------------------------------------------------------------------- the weights


@torch.no_grad()
def attention_weights(model, ids: list[int], amp, cached: bool = False,
                      how: CachedEval = CachedEval.tokens) -> tuple[np.ndarray, np.ndarray]:
    """Every layer's weights over one window, under whatever attention the model runs now (its
    own, or a variant set by `attention_variant`), and each layer's future weight, both on the
    host: [n_layer, n_head, n, n] and [n_layer] float32. The future weight is computed where the
    weights are, in the dtype they were computed in (autocast's rounding is not a leak).

    cached: the weights of the generation path instead, the window fed one token at a time
    through a KV cache: row t is the step that feeds token t, over the keys 0..t it holds then.
    For a correct layer this is the same map; a cache pitfall shows in it (upper_left_mask puts
    every row's weight on key 0). `how` feeds it as the run's final evaluation does
    (train.cached_eval): in chunks of the model's window, or served (`_served_weights`)."""
    was_training = model.training
    model.eval()
    x = torch.tensor([ids], device=next(model.parameters()).device)  # [1, n]
    size = (model.cfg.window or 8) if CachedEval(how) is CachedEval.chunks else 1
    with amp:
        if not cached:
            weights = model(x, return_weights=True)[2]
        elif CachedEval(how) is CachedEval.served:
            weights = _served_weights(model, x)
        else:
            weights = _cached_weights(model, x, size)
    model.train(was_training)
    maps = torch.stack([w[0].float() for w in weights])           # [L, h, n, n]
    leaks = torch.stack([future_weight(w) for w in weights])      # [L]
    host = torch.cat([leaks, maps.flatten()]).cpu().numpy()       # one host transfer
    return host[len(leaks):].reshape(maps.shape), host[:len(leaks)]


def _cached_weights(model, x: torch.Tensor, size: int = 1) -> list[torch.Tensor]:
    """Each layer's [1, h, n, n] weights of x [1, n] fed `size` tokens at a time through a KV
    cache (row t: the step of token t; the keys after its step do not exist yet, and get 0)."""
    n = x.size(1)
    cache = model.new_cache(1)
    steps = [model(piece, cache=cache, return_weights=True)[2] for piece in x.split(size, 1)]
    return [torch.cat([F.pad(step[layer], (0, n - step[layer].size(-1))) for step in steps], 2)
            for layer in range(len(steps[0]))]


PAD_LABEL = "∅"  # a pad token's label in the served maps


def served_ids(ids: list[int], pad: int = 3) -> tuple[list[int], int]:
    """The sequence the served maps feed, and its pads: the window's second half, then its
    first half behind `pad` pad tokens (id 0), cut to the window's length."""
    half = len(ids) // 2
    pad = min(pad, half - 1)
    return ids[half:] + [0] * pad + ids[:half - pad], pad


def _served_weights(model, x: torch.Tensor) -> list[torch.Tensor]:
    """Each layer's [1, h, n, n] weights of the served path (train.cached_eval=served): the
    window's second half prefilled, then through the same cache, restarted as a Decoder does, its
    first half behind 3 pad tokens one token at a time. Rows and columns are the sequence fed
    (`served_ids`): a key's column is where its token came, whichever cache slot it was written
    to (an emptied cache writes the second prompt from slot 0 again)."""
    ids, pad = served_ids(x[0].tolist())
    fed = torch.tensor([ids], device=x.device)  # [1, n]
    n, half = fed.size(1), x.size(1) // 2
    cache = model.new_cache(1)
    first = model(fed[:, :half], cache=cache, return_weights=True)[2]  # [1, h, half, half]
    cache.new_sequence(torch.tensor([pad], device=x.device))  # as Decoder.restart does
    offset = half - cache.length  # the column of slot 0: half after a reset, 0 if kept
    steps = [model(fed[:, t:t + 1], cache=cache, return_weights=True)[2] for t in range(half, n)]
    return [torch.cat([F.pad(first[layer], (0, n - half))] +
                      [F.pad(step[layer], (offset, n - offset - step[layer].size(-1)))
                       for step in steps], dim=2)
            for layer in range(len(first))]


def sharpest_head(weights: np.ndarray) -> int:
    """The head whose rows put most weight on one key (largest mean row maximum) of a layer's
    [h, n, n] weights: the head that shows the layer's mechanism most plainly, chosen the same
    way in every model."""
    return int(weights.max(-1).mean(-1).argmax())


# ----------------------------------------------------------------------------- pictures


@lru_cache(maxsize=1)
def _lut() -> np.ndarray:
    """[256, 3] uint8: magma, indexed by round(255 * weight ** GAMMA)."""
    from matplotlib import colormaps  # the colormap only: no pyplot, no figure machinery

    return (colormaps["magma"](np.linspace(0.0, 1.0, 256))[:, :3] * 255).round().astype(np.uint8)


def colorize(weights: np.ndarray) -> np.ndarray:
    """[..., n, m] weights in [0, 1] -> [..., n, m, 3] uint8 RGB (see the module docstring)."""
    n, m = weights.shape[-2:]
    index = np.rint(np.sqrt(np.clip(weights, 0.0, 1.0)) * 255).astype(np.intp)
    rgb = _lut()[index]
    future = ~causal_pattern(n, m).numpy() & (weights == 0)
    rgb[future] = FUTURE_RGB
    return rgb


@lru_cache(maxsize=4)
def _font(size: int):
    from matplotlib import get_data_path  # DejaVu ships with matplotlib: no system fonts needed
    from PIL import ImageFont

    return ImageFont.truetype(str(Path(get_data_path()) / "fonts/ttf/DejaVuSansMono.ttf"), size)


# TensorBoard's Images tab draws every image 350 pixels wide (its card), scaled and pixelated;
# drawn at that width, text stays as sharp as it was drawn.
CARD_WIDTH = 350
MAX_LABEL_CHARS = 8


def card_image(weights: np.ndarray, labels: list[str], title: str = "",
               width: int = CARD_WIDTH) -> np.ndarray:
    """[h, n, n] weights of one layer -> [H, width, 3] uint8, for a TensorBoard card: the
    sharpest head (`sharpest_head`) with the tokens on both axes, at up to 9 pixels per weight,
    then a thumbnail of every head, the drawn one framed."""
    from PIL import Image, ImageDraw

    h, n, _ = weights.shape
    pad, gap = 4, 6
    shown = [s if len(s) <= MAX_LABEL_CHARS else s[:MAX_LABEL_CHARS - 1] + "…" for s in labels]
    label = 0
    cell = 9
    for _ in range(2):  # the label font follows the cell, the cell the labels' room
        font = _font(max(min(cell, 9), 5))
        label = max(int(font.getlength(s)) for s in shown) + 4
        cell = max(2, min(9, (width - label - 2 * pad) // n))
    font, small = _font(max(min(cell, 9), 5)), _font(8)
    panel = n * cell
    line = 12
    head = sharpest_head(weights)
    thumb = max(1, min(3, (width - 2 * pad) // (4 * n + 3 * gap)))  # at least 4 to a row
    per_row = max(1, (width - 2 * pad + gap) // (n * thumb + gap))
    rows = math.ceil(h / per_row) if h > 1 else 0
    top = pad + 2 * line
    y = top + panel + label + gap  # "every head:", then rows of a number over a thumbnail
    height = y + (line + rows * (line + n * thumb + gap) if rows else 0) + pad
    canvas = np.full((height, width, 3), 255, dtype=np.uint8)
    x0 = label + pad
    canvas[top:top + panel, x0:x0 + panel] = colorize(weights[head]).repeat(cell, 0).repeat(cell, 1)
    bar = colorize(np.linspace(0, 1, 60)[None, None, :])[0].repeat(6, axis=0)
    canvas[pad + line + 3:pad + line + 9, width - pad - 70:width - pad - 10] = bar
    thumbs = []
    for i in range(h if rows else 0):
        r, c = divmod(i, per_row)
        tx, ty = pad + c * (n * thumb + gap), y + line + r * (line + n * thumb + gap) + line
        canvas[ty:ty + n * thumb, tx:tx + n * thumb] = \
            colorize(weights[i]).repeat(thumb, 0).repeat(thumb, 1)
        thumbs.append((tx, ty))

    image = Image.fromarray(canvas)
    draw = ImageDraw.Draw(image)
    draw.text((pad, pad), title, fill=(0, 0, 0), font=small)
    draw.text((pad, pad + line), f"head {head} of {h} (the sharpest)", fill=(0, 0, 0), font=small)
    draw.text((width - pad - 72, pad + line), "0", fill=(0, 0, 0), font=small, anchor="rt")
    draw.text((width - pad - 8, pad + line), "1", fill=(0, 0, 0), font=small, anchor="lt")
    for i, text in enumerate(shown):  # queries down the left
        draw.text((x0 - 2, top + i * cell + cell / 2), text, fill=(0, 0, 0), font=font, anchor="rm")
    strip = Image.new("RGB", (label, panel), (255, 255, 255))  # keys along the bottom, upwards
    strip_draw = ImageDraw.Draw(strip)
    for i, text in enumerate(shown):
        strip_draw.text((label - 2, i * cell + cell / 2), text, fill=(0, 0, 0), font=font,
                        anchor="rm")
    image.paste(strip.rotate(90, expand=True), (x0, top + panel + 2))
    if thumbs:
        draw.text((pad, y), "every head:", fill=(0, 0, 0), font=small)
    for i, (tx, ty) in enumerate(thumbs):
        draw.text((tx, ty - 1), f"{i}", fill=(0, 0, 0), font=small, anchor="lb")
        if i == head:
            draw.rectangle((tx - 2, ty - 2, tx + n * thumb + 1, ty + n * thumb + 1),
                           outline=(0, 120, 255), width=1)
    return np.asarray(image)
