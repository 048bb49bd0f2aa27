"""Turn an ablation sweep's TensorBoard event files into a Markdown table and a PNG of curves.

    python scripts/summarize_ablations.py runs/ablations/<date> [--out DIR]

Each run directory is named `<regime>-<variant>_seed<N>` (see conf/experiment/ablations.yaml).
For every arm: final train loss, validation loss under its own attention, and the *causal*
validation loss (same weights, correct mask) as mean +- std over seeds; the effect is the
difference of causal validation loss to the correct layer of the same regime, also in units of
the seeds' standard deviation.
"""
from __future__ import annotations

import argparse
import math
import re
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

RUN_NAME = re.compile(r"^(?P<regime>[^-]+)-(?P<variant>.+)_seed(?P<seed>\d+)$")
METRICS = {"train": "train/loss", "val": "val/loss", "causal": "val/causal_loss",
           "max_weight": "attn/max_weight/layer0"}


def read_run(run_dir: Path) -> dict:
    """Scalar series of one run: {short name: (steps, values)}."""
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    out = {}
    for short, tag in METRICS.items():
        if tag not in tags and short == "causal":
            tag = METRICS["val"]  # a causal run's own loss is its causal loss
        if tag in tags:
            events = acc.Scalars(tag)
            out[short] = (np.array([e.step for e in events]), np.array([e.value for e in events]))
    return out


def collect(sweep_dir: Path) -> dict:
    """{(regime, variant): {seed: series}} for every run directory in the sweep."""
    arms: dict = defaultdict(dict)
    for run_dir in sorted(p for p in sweep_dir.iterdir() if p.is_dir()):
        match = RUN_NAME.match(run_dir.name)
        if not match:
            continue
        series = read_run(run_dir)
        if "causal" in series:
            arms[(match["regime"], match["variant"])][int(match["seed"])] = series
    if not arms:
        raise SystemExit(f"error: no runs named <regime>-<variant>_seed<N> with events in {sweep_dir}")
    return arms


def final(series_by_seed: dict, key: str) -> np.ndarray:
    return np.array([s[key][1][-1] for s in series_by_seed.values() if key in s])


def fmt(values: np.ndarray) -> str:
    if values.size == 0:
        return "n/a"
    std = values.std(ddof=1) if values.size > 1 else 0.0
    return f"{values.mean():.3f} ± {std:.3f}"


def table(arms: dict) -> str:
    lines = ["| regime | variant | seeds | train loss | val loss (own attention) | causal val loss "
             "| effect vs correct | effect / seed std | attn max weight (layer 0) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for (regime, variant), runs in sorted(arms.items(), key=lambda kv: (kv[0][0], kv[0][1] != "correct", kv[0][1])):
        causal = final(runs, "causal")
        base = arms.get((regime, "correct"))
        effect, in_std = "", ""
        if base is not None and variant != "correct":
            base_causal = final(base, "causal")
            diff = causal.mean() - base_causal.mean()
            # pooled seed spread of the two arms: the yardstick for "is this effect real?"
            spread = math.sqrt((np.var(causal, ddof=1) + np.var(base_causal, ddof=1)) / 2) \
                if min(causal.size, base_causal.size) > 1 else float("nan")
            effect = f"{diff:+.3f}"
            in_std = f"{diff / spread:+.1f}" if spread > 0 else "n/a"
        lines.append(f"| {regime} | {variant} | {len(runs)} | {fmt(final(runs, 'train'))} | "
                     f"{fmt(final(runs, 'val'))} | {fmt(causal)} | {effect} | {in_std} | "
                     f"{fmt(final(runs, 'max_weight'))} |")
    return "\n".join(lines)


def plot(arms: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    regimes = sorted({r for r, _ in arms})
    fig, axes = plt.subplots(2, len(regimes), figsize=(5 * len(regimes), 7), squeeze=False)
    for col, regime in enumerate(regimes):
        for (r, variant), runs in sorted(arms.items()):
            if r != regime:
                continue
            for row, key, title in ((0, "train", "train loss (own attention)"),
                                    (1, "causal", "causal validation loss")):
                curves = [s[key] for s in runs.values() if key in s]
                if not curves:
                    continue
                n = min(len(c[0]) for c in curves)
                steps = curves[0][0][:n]
                values = np.stack([c[1][:n] for c in curves])
                ax = axes[row][col]
                line, = ax.plot(steps, values.mean(0), label=variant)
                ax.fill_between(steps, values.min(0), values.max(0), alpha=0.2, color=line.get_color())
                ax.set_title(f"{regime}: {title}")
                ax.set_xlabel("step")
        for row in range(2):
            axes[row][col].legend(fontsize=8)
            axes[row][col].grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dir", type=Path)
    parser.add_argument("--out", type=Path, default=None, help="where to write ablations.md/.png "
                        "(default: the sweep directory)")
    args = parser.parse_args(argv)
    if not args.sweep_dir.is_dir():
        print(f"error: {args.sweep_dir} is not a directory", file=sys.stderr)
        return 2
    out = args.out or args.sweep_dir
    out.mkdir(parents=True, exist_ok=True)
    arms = collect(args.sweep_dir)
    md = table(arms)
    (out / "ablations.md").write_text(md + "\n")
    plot(arms, out / "ablations.png")
    print(md)
    print(f"\nwrote {out / 'ablations.md'} and {out / 'ablations.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
