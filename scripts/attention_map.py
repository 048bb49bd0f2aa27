"""Draw where each query's attention goes, for a trained run and any text, to a PNG.

    python -m scripts.attention_map run=runs/<dir>                       # layer 0, every head
    python -m scripts.attention_map run=runs/<dir> prompt="ROMEO:" layer=1 head=2 out=map.png
    python -m scripts.attention_map run=runs/<dir> mask=causal           # a leaky run, masked

Rows are queries, columns keys, the tokens on both axes (whitespace shown as · and ↵). Without
a prompt the map is drawn on the run's fixed validation window, the text of its TensorBoard
Images (which needs the run's token cache, as training made it). `head=all` draws the layer's
heads as one grid, the picture TensorBoard shows; a single head gets a larger map with a colour
bar. `mask=own` (the default) shows the weights under the run's own attention, a leaky
variant's leak included; `mask=causal` shows the same weights under the correct mask, as at
generation time. Any mistake is one `error:` line on stderr and exit status 2.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from data import CorpusError
from data.prepare import prepare_corpus
from data.tokenizer import unknown_characters
from generate import GenerateError, load_run
from model.attention import causal_variant
from training.attention_maps import (attention_weights, colorbar, draw_map, future_weight,
                                     grid_image, map_window, token_labels)
from training.checkpoint import CheckpointError
from training.run_dir import resolve_latest

USAGE = ("usage: python -m scripts.attention_map run=RUN_DIR [prompt=TEXT] [layer=N] "
         "[head=all|N] [out=PNG] [weights=best|latest] [mask=own|causal] [tokens=N]")
KEYS = {"run": "runs/latest", "prompt": None, "layer": "0", "head": "all",
        "out": "attention_map.png", "weights": "best", "mask": "own", "tokens": "48"}


class MapError(RuntimeError):
    pass


def parse_args(argv: list[str]) -> dict:
    """key=value arguments; values are kept verbatim (prompt=ROMEO: is text, not YAML)."""
    args = dict(KEYS)
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep:
            raise MapError(f"arguments must be key=value, got {arg!r}. {USAGE}")
        if key not in KEYS:
            raise MapError(f"unknown key {key!r} (known: {', '.join(KEYS)}). {USAGE}")
        args[key] = value
    if args["mask"] not in ("own", "causal"):
        raise MapError(f"mask must be own or causal, got {args['mask']!r}")
    for key in ("layer", "tokens") + (() if args["head"] == "all" else ("head",)):
        if not args[key].isdigit():
            raise MapError(f"{key} must be a non-negative integer{' or all' if key == 'head' else ''},"
                           f" got {args[key]!r}")
    return args


def window_ids(args: dict, tokenizer, run_cfg) -> list[int]:
    """The prompt's tokens (its last block_size), or the run's fixed validation window."""
    block = run_cfg.model.block_size
    if args["prompt"] is None:
        try:
            corpus = prepare_corpus(run_cfg.data, run_cfg.tokenizer)
        except CorpusError as exc:
            raise MapError(f"the run's validation text is not available ({exc}); "
                           f"give a prompt= instead") from exc
        return map_window(corpus.validation, tokenizer, min(int(args["tokens"]), block))
    unknown = unknown_characters(tokenizer, args["prompt"])
    if unknown:
        raise MapError(f"the prompt contains characters this char tokenizer never saw in "
                       f"training: {''.join(unknown)!r}")
    ids = tokenizer.encode(args["prompt"]).ids
    if not ids:
        raise MapError("the prompt is empty")
    if len(ids) > block:
        print(f"warning: the prompt has {len(ids)} tokens; its last {block} (the context) are "
              f"drawn", file=sys.stderr)
    return ids[-block:]


def draw(args: dict) -> Path:
    run_dir = resolve_latest(Path(args["run"]))
    model, tokenizer, run_cfg = load_run(run_dir, args["weights"], torch.device("cpu"))
    layer, n_layer, n_head = int(args["layer"]), run_cfg.model.n_layer, run_cfg.model.n_head
    if layer >= n_layer:
        raise MapError(f"layer must be below the run's {n_layer} layers, got {layer}")
    if args["head"] != "all" and int(args["head"]) >= n_head:
        raise MapError(f"head must be all or below the run's {n_head} heads, got {args['head']}")
    ids = window_ids(args, tokenizer, run_cfg)
    off = torch.autocast("cpu", enabled=False)
    variant = causal_variant(run_cfg.attention) if args["mask"] == "causal" else run_cfg.attention
    with model.attention_variant(variant):
        weights, leaks = attention_weights(model, ids, off)
    weights, leak = weights[layer], leaks[layer]  # [h, n, n], the layer's future weight
    labels = token_labels(tokenizer, ids)
    name = f"{run_dir.name} ({run_cfg.attention.name}, mask {args['mask']})"
    out = Path(args["out"])
    out.absolute().parent.mkdir(parents=True, exist_ok=True)
    if args["head"] == "all":
        from PIL import Image

        title = f"{name}, layer {layer}: future weight {leak:.3f}"
        Image.fromarray(grid_image(weights, labels, title)).save(out)
        return out

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    head = int(args["head"])
    side = max(5.0, 0.16 * len(ids) + 1.5)
    fig, ax = plt.subplots(figsize=(side + 1.2, side), dpi=110)
    draw_map(ax, weights[head], labels,
             f"{name}\nlayer {layer}, head {head}: future weight "
             f"{future_weight(torch.from_numpy(weights[head])).item():.3f}")
    colorbar(fig, ax, fraction=0.04, pad=0.02)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip() + "\n\n" + USAGE)
        return 0
    try:
        out = draw(parse_args(argv))
    except (MapError, GenerateError, CheckpointError, CorpusError, ValueError, OSError) as exc:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        print(f"error: {lines[0] if lines else type(exc).__name__}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
