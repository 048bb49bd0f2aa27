"""Draw where each query's attention goes, for a trained run and any text, to a PNG.

    python -m scripts.attention_map run=runs/<dir>                       # layer 0, every head
    python -m scripts.attention_map run=runs/<dir> prompt="ROMEO:" layer=1 head=2 out=map.png
    python -m scripts.attention_map run=runs/<dir> mask=causal           # a leaky run, masked
    python -m scripts.attention_map run=runs/<dir> mask=cached           # as when decoding

Rows are queries, columns keys, the tokens on both axes (whitespace shown as · and ↵). Without a
prompt the map is drawn on the run's fixed validation window, the text of its TensorBoard Images
(from the default cache nearest the run, .cache/ beside runs/, so the command works from any
directory; never the data.cache_dir the run's config names: a run directory is data).
`mask=cached` draws the generation path itself, the window fed one token at a time through the
KV cache (row t: the step of token t), where a cache pitfall shows (upper_left_mask). The title
says which weights and mask; a cyan staircase marks the diagonal's edge, the future to its
right. Any mistake is one `error:` line on stderr and exit status 2.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from safeio.cli import UserError, parse_key_values, run_cli
from safeio.files import check_output_file
from guard.limits import prompt_ids
from guard.run_dir import load_run, resolve_latest, validation_window
from scripts.maps import map_figure
from safeio.files import check_outputs
from training.attention_maps import attention_weights, future_weight, token_labels
from training.checkpoint import LATEST
from guard.weights_choice import choose_weights

USAGE = ("usage: python -m scripts.attention_map [run=RUN_DIR] [prompt=TEXT] [layer=N] "
         "[head=all|N] [out=PNG] [weights=auto|best|latest] [mask=own|causal|cached] [tokens=N] "
         "[overwrite=true]")


@dataclass
class MapArgs:
    run: str = str(LATEST)          # a run directory of train.py (runs/latest: the newest)
    prompt: Optional[str] = None    # the text to draw (null: the run's fixed validation window)
    layer: int = 0                  # which layer, from 0
    head: str = "all"               # all (every head, in a grid) | N (one head, larger)
    out: str = "attention_map.png"  # the picture to write (.png)
    # auto: best for a causal run, latest for a leaky one (as generate.py) | best | latest
    weights: str = "auto"
    # own (the run's attention, any leak included) | causal | cached (through the KV cache)
    mask: str = "own"
    # the validation window's length, 2 to the run's context (null: the run's own setting,
    # train.attention_map_tokens, as in its TensorBoard images)
    tokens: Optional[int] = None
    overwrite: bool = False         # replace out= if it exists (as every script: safeio/files.py)


# What each mask= draws, in the picture's title.
MASKS = {"own": "as it trained (mask=own)",
         "causal": "under the correct mask, as when generating (mask=causal)",
         "cached": "through the KV cache, a token at a time (mask=cached)"}


def check(args: MapArgs) -> None:
    if args.mask not in MASKS:
        raise UserError(f"mask must be own, causal or cached, got {args.mask!r}")
    if args.head != "all" and not args.head.isdigit():
        raise UserError(f"head must be a non-negative integer or all, got {args.head!r}")
    if args.layer < 0:
        raise UserError(f"layer must be a non-negative integer, got {args.layer}")
    if args.tokens is not None and args.tokens < 2:
        raise UserError(f"tokens must be at least 2 (a map of one token shows nothing), got "
                        f"{args.tokens}")
    if args.tokens is not None and args.prompt is not None:
        raise UserError("tokens= sets the length of the validation window; with prompt= the "
                        "prompt is drawn, all of it: give one or the other")
    if Path(args.out).suffix.lower() != ".png":
        raise UserError(f"out must name a .png file, got {args.out!r}")
    check_outputs([Path(args.out)], args.overwrite)


def window_ids(args: MapArgs, tokenizer, run_cfg, run_dir: Path) -> list[int]:
    """The prompt's tokens (its last block_size), or the run's fixed validation window."""
    block = run_cfg.model.block_size
    if args.prompt is not None:
        return prompt_ids(tokenizer, args.prompt, block)
    if args.tokens is not None and args.tokens > block:
        raise UserError(f"tokens must be at most the run's context of {block} tokens, got "
                        f"{args.tokens}")
    tokens = args.tokens or min(run_cfg.train.attention_map_tokens, block)
    return validation_window(run_dir, run_cfg, tokenizer, tokens)


def draw(args: MapArgs) -> Path:
    check(args)
    run_dir = resolve_latest(Path(args.run))
    chosen = choose_weights(run_dir, args.weights)
    model, tokenizer, run_cfg = load_run(run_dir, chosen.kind if chosen.kind != "folder" else
                                         "best", torch.device("cpu"))
    layer, n_layer, n_head = args.layer, run_cfg.model.n_layer, run_cfg.model.n_head
    if layer >= n_layer:
        raise UserError(f"layer must be below the run's {n_layer} layers, got {layer}")
    if args.head != "all" and int(args.head) >= n_head:
        raise UserError(f"head must be all or below the run's {n_head} heads, got {args.head}")
    ids = window_ids(args, tokenizer, run_cfg, run_dir)
    print(f"drawing {run_dir}: {chosen.describe()}" + (f"; note: {chosen.note}" if chosen.note
                                                         else ""), file=sys.stderr)
    off = torch.autocast("cpu", enabled=False)
    variant = run_cfg.attention.causal_variant() if args.mask == "causal" else run_cfg.attention
    with model.attention_variant(variant):
        weights, leaks = attention_weights(model, ids, off, cached=args.mask == "cached")
    weights, leak = weights[layer], leaks[layer]  # [h, n, n], the layer's future weight
    labels = token_labels(tokenizer, ids)
    out = Path(args.out)
    check_output_file(out, "out=")
    out.absolute().parent.mkdir(parents=True, exist_ok=True)
    where = f"layer {layer}"
    if args.head != "all":
        head = int(args.head)
        weights, where = weights[head:head + 1], f"layer {layer}, head {head}"
        leak = future_weight(torch.from_numpy(weights[0])).item()
    fig = map_figure(weights, labels, f"{run_dir.name}: attention={run_cfg.attention.name} "
                     f"{MASKS[args.mask]}, {chosen.describe()}\n{where}: future weight "
                     f"{leak:.3f} (the weight right of the cyan line: on keys after the query)")
    fig.savefig(out)
    import matplotlib.pyplot as plt
    plt.close(fig)
    return out


def main(argv: list[str]) -> int:
    def body() -> None:
        args = parse_key_values(argv, MapArgs, USAGE, about=__doc__.split("\n\n")[0])
        print(f"wrote {draw(args)}")
    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
