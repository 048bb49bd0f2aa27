"""Turn an ablation sweep into a Markdown table, a PNG of curves, a PNG of attention maps and
the measured cost of each pitfall as JSON.

    python -m scripts.summarize_ablations sweep=runs/ablations/<date> [out=DIR] [layer=N]
    python scripts/summarize_ablations.py sweep=runs/ablations/<date>   # the same, as a file
    python -m scripts.summarize_ablations sweep=runs/bookkeeping/<date> costs=docs/pitfall_costs.json

Each run directory is named `<regime>-<variant>_seed<N>` (see conf/experiment/ablations.yaml),
directly in the sweep directory or one level down (the study puts each seed in `seed<N>/`).
For every arm: final train loss, validation loss under its own attention, and the *causal*
validation loss (same weights, correct mask) as mean ± std over seeds. The effect of a pitfall is
its causal validation loss minus that of the correct layer of the same regime, with the standard
error of that difference and a 95% interval.

The arms of a regime share their seeds, and a seed fixes the initial weights, the order of the
training batches and the validation batches: the pitfall and the correct layer of one seed differ
only by the pitfall. So the effect is estimated from the per-seed differences (a paired
comparison), whose spread leaves out what the two runs of a seed have in common; that is far
less than the spread of either arm's own losses over seeds. Without common seeds the two arms
are compared as independent samples (Welch).

The maps figure draws, from each run's last checkpoint, the correct model's attention beside each
pitfall's: the same validation window, the same layer, the same seed.

The costs file (`pitfall_costs.json`; `costs=` another, e.g. docs/pitfall_costs.json, which holds
every study's and which the attention checker quotes) lists each pitfall's effects as the
tables give them, with the regime's setting read from a run's config.yaml: written from the runs,
never copied by hand. A study's entries replace those of the same study (the sweep's parent
+experiment=, or its parent folder: runs/<study>/<date>) and leave the other studies' alone.
"""
from __future__ import annotations

import json
import math
import re
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # run as a file: the repository's packages still import

from omegaconf import MISSING  # noqa: E402

from safeio.cli import UserError, parse_key_values, run_cli  # noqa: E402
from safeio.files import check_output_file  # noqa: E402
from safeio.files import MIB, check_outputs, load_run_config, read_json  # noqa: E402

RUN_NAME = re.compile(r"^(?P<regime>[^-]+)-(?P<variant>.+)_seed(?P<seed>\d+)$")
METRICS = {"train": "train/loss", "val": "val/loss", "causal": "val/causal_loss",
           "cached": "val/cached_loss",
           "max_weight": "weights/max_weight/layer0",
           "future_weight": "weights/future_weight/layer0"}
# what runs of earlier versions logged the same series as
OLD_TAGS = {"max_weight": "attn/max_weight/layer0", "future_weight": "attn/future_weight/layer0"}
# Two-sided 95% quantiles of Student's t for 1..30 degrees of freedom.
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
        2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
        2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t975(df: float) -> float:
    """The 97.5% quantile of Student's t: the table above, or its expansion around the normal
    (Cornish-Fisher, exact to 1e-4 beyond 30 degrees of freedom)."""
    if df <= len(T975):
        return T975[max(int(df), 1) - 1]
    z = 1.959964
    return z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)


def read_run(run_dir: Path) -> dict:
    """Scalar series of one run: {short name: (steps, values)}."""
    from guard.run_dir import read_events

    acc = read_events(run_dir, {"scalars": 0, "images": 1})
    tags = set(acc.Tags()["scalars"])
    out = {}
    for short, tag in METRICS.items():
        if tag not in tags and short == "causal":
            tag = METRICS["val"]  # before every run logged it: a causal run's own loss
        tag = tag if tag in tags else OLD_TAGS.get(short, tag)
        if tag in tags:
            events = acc.Scalars(tag)
            out[short] = (np.array([e.step for e in events]), np.array([e.value for e in events]))
    return out


def run_dirs(sweep_dir: Path) -> list[Path]:
    """The sweep's run directories: named <regime>-<variant>_seed<N>, in the sweep directory or
    in a folder of it (the study's seed<N>/)."""
    found = []
    for path in sorted(p for p in sweep_dir.iterdir() if p.is_dir()):
        inner = [path] if RUN_NAME.match(path.name) else \
            sorted(p for p in path.iterdir() if p.is_dir())
        found += [p for p in inner if RUN_NAME.match(p.name)]
    return found


def collect(sweep_dir: Path) -> dict:
    """{(regime, variant): {seed: series}} for every run directory in the sweep."""
    arms: dict = defaultdict(dict)
    for run_dir in run_dirs(sweep_dir):
        match = RUN_NAME.match(run_dir.name)
        series = read_run(run_dir)
        train = load_run_config(run_dir / "config.yaml").train
        if "causal" in series and series["causal"][0][-1] < train.max_steps \
                and not train.get("fewer_steps"):  # stopped: its last losses are no result
            raise UserError(f"{run_dir} did not finish (step {series['causal'][0][-1]} of "
                            f"{train.max_steps}): continue the study first, python train.py "
                            f"resume={sweep_dir}")
        if "causal" in series:
            arms[(match["regime"], match["variant"])][int(match["seed"])] = series
    if not arms:
        raise UserError(f"no runs named <regime>-<variant>_seed<N> with events in {sweep_dir}")
    return arms


def final(series_by_seed: dict, key: str) -> np.ndarray:
    return np.array([s[key][1][-1] for s in series_by_seed.values() if key in s])


@dataclass
class Effect:
    """A pitfall's causal validation loss minus its regime's correct one."""

    mean: float
    se: float       # standard error of the mean difference
    low: float      # 95% interval
    high: float
    n: int          # seeds (pairs when paired)
    paired: bool

    @property
    def in_se(self) -> float:
        return self.mean / self.se if self.se > 0 else math.nan


def effect(pitfall: dict, correct: dict, key: str = "causal") -> Effect:
    """From the final losses `key` (causal, or cached: through the KV cache) {seed: series} of
    two arms: paired over their common seeds when there are at least two, else Welch's
    comparison of independent means."""
    common = sorted(set(pitfall) & set(correct))
    if len(common) >= 2:
        d = np.array([pitfall[s][key][1][-1] - correct[s][key][1][-1] for s in common])
        se = d.std(ddof=1) / math.sqrt(d.size)
        half = t975(d.size - 1) * se
        return Effect(d.mean(), se, d.mean() - half, d.mean() + half, d.size, True)
    a, b = final(pitfall, key), final(correct, key)
    if min(a.size, b.size) < 2:
        return Effect(a.mean() - b.mean(), math.nan, math.nan, math.nan, min(a.size, b.size), False)
    va, vb = a.var(ddof=1) / a.size, b.var(ddof=1) / b.size
    se = math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va ** 2 / (a.size - 1) + vb ** 2 / (b.size - 1)) if se > 0 else 1
    half = t975(df) * se
    diff = a.mean() - b.mean()
    return Effect(diff, se, diff - half, diff + half, min(a.size, b.size), False)


def fmt(values: np.ndarray, digits: int = 3) -> str:
    if values.size == 0:
        return "n/a"
    std = values.std(ddof=1) if values.size > 1 else 0.0
    return f"{values.mean():.{digits}f} ± {std:.{digits}f}"


def ordered(arms: dict) -> list:
    """Regimes in order of their names, each with its correct arm first."""
    return sorted(arms.items(), key=lambda kv: (kv[0][0], kv[0][1] != "correct", kv[0][1]))


LEGEND = """\
Losses are cross-entropies in nats per token (per character for the study's char-level models),
at each run's last evaluation on its 20 fixed validation batches. "a ± b" is the mean ± the
standard deviation over the seeds. "causal val loss" is the same weights scored with the correct
mask, as when generating. "effect vs correct" is the causal val loss minus that of the regime's
`correct` arm: the mean of the per-seed differences (paired) where the arms share seeds, else
the difference of the means (Welch); SE is its standard error, the 95% interval is effect ±
t(0.975, n - 1) × SE, and "effect / SE" counts standard errors from zero. The attention weight columns
are fractions of each query row's softmax mass: its largest weight, and the mass not on the keys
the query may see (0 for a causal mask)."""


COLUMNS = ("regime", "variant", "seeds", "train loss", "val loss (own attention)",
           "causal val loss", "effect vs correct", "SE", "95% interval", "effect / SE",
           "max weight (layer 0)", "future weight (layer 0)")
SHORT = (0, 1, 5, 6, 7, 8, 9, 10, 11)  # the README's columns


def table(arms: dict, columns=range(len(COLUMNS))) -> str:
    lines = ["| " + " | ".join(COLUMNS[i] for i in columns) + " |", "|---" * len(columns) + "|"]
    for (regime, variant), runs in ordered(arms):
        base = arms.get((regime, "correct"))
        cells = ["", "", "", ""]
        if base is not None and variant != "correct":
            cells = effect_cells(effect(runs, base))
        row = [regime, variant, str(len(runs)), fmt(final(runs, "train")), fmt(final(runs, "val")),
               fmt(final(runs, "causal")), *cells, fmt(final(runs, "max_weight"), 2),
               fmt(final(runs, "future_weight"), 2)]
        lines.append("| " + " | ".join(row[i] for i in columns) + " |")
    return "\n".join(lines)


DECODING_LEGEND = """\
The second table is for the runs that also scored their evaluation batches through the KV cache
(train.cached_eval_batches: one token at a time, teacher forced, as when generating): "cached
val loss" is that loss, and each effect is the paired difference from the regime's `correct`
arm, of the causal loss (what training and the usual validation see) and of the cached loss
(what decoding sees), with the same statistics as above. "identical" marks a pitfall whose runs
are the correct layer's to the bit (every per-seed difference exactly 0): a mistake only the
cache can show."""


def effect_cells(e: Effect) -> list[str]:
    """effect, SE, 95% interval, effect / SE, as table cells."""
    if e.paired and e.se == 0 and e.mean == 0:
        return ["0", "0", "[0, 0]", "identical"]
    digits = 3 if abs(e.mean) >= 0.1 else 4
    cells = [f"{e.mean:+.{digits}f}", f"{e.se:.{digits}f}",
             f"[{e.low:+.{digits}f}, {e.high:+.{digits}f}]", f"{e.in_se:+.1f}"]
    if math.isnan(e.se):  # a single seed: no spread to measure
        cells[1:] = ["n/a", "n/a", "n/a"]
    return cells


def decoding_arms(arms: dict) -> dict:
    """The arms whose every run logged the loss through the KV cache."""
    return {arm: runs for arm, runs in arms.items()
            if runs and all("cached" in s for s in runs.values())}


def decoding_table(arms: dict) -> str:
    """Each arm's causal and cached validation losses, and its effect on each against the
    regime's correct arm ("" when no run logged a cached loss)."""
    arms = decoding_arms(arms)
    if not arms:
        return ""
    lines = ["| regime | variant | seeds | causal val loss | cached val loss (KV cache) "
             "| effect on causal loss | SE | 95% interval | effect / SE "
             "| effect on cached loss | SE | 95% interval | effect / SE |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (regime, variant), runs in ordered(arms):
        base = arms.get((regime, "correct"))
        cells = [""] * 8
        if base is not None and variant != "correct":
            cells = effect_cells(effect(runs, base, "causal")) + \
                effect_cells(effect(runs, base, "cached"))
        lines.append(f"| {regime} | {variant} | {len(runs)} | {fmt(final(runs, 'causal'))} | "
                     f"{fmt(final(runs, 'cached'))} | " + " | ".join(cells) + " |")
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
                ax.set_xlabel("training step")
                ax.set_ylabel("loss (nats per token)")
        for row in range(2):
            axes[row][col].legend(fontsize=8, title="mean, min-max over seeds",
                                  title_fontsize=7)
            axes[row][col].grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


# ----------------------------------------------------------------------------- the maps figure


def load_maps(run_dir: Path, layer: int, cached: bool = False):
    """(weights [h, n, n], token labels) of a run's last checkpoint on its fixed validation
    window (the window of its TensorBoard images), under its own attention (cached: through
    the KV cache as the run's final evaluation fed it, train.cached_eval: one token at a time,
    as when decoding, by default)."""
    import torch

    from guard.run_dir import load_run, validation_window
    from training.attention_maps import attention_weights, map_labels

    model, tokenizer, cfg = load_run(run_dir, "latest", torch.device("cpu"))
    window = validation_window(run_dir, cfg, tokenizer,
                               min(cfg.train.attention_map_tokens, cfg.model.block_size))
    if layer >= cfg.model.n_layer:
        raise UserError(f"layer must be below the {cfg.model.n_layer} layers of {run_dir}, got "
                        f"{layer}")
    how = cfg.train.cached_eval  # the generation path the run's final evaluation took
    weights, _ = attention_weights(model, window, torch.autocast("cpu", enabled=False), cached,
                                   how)
    return weights[layer], map_labels(tokenizer, window, cached, how)


def load_all_maps(sweep_dir: Path, arms: dict, layer: int = 0) -> tuple:
    """(seed, {(regime, cached): [(variant, weights [h, n, n], labels, head)]}) of the maps
    figure: each regime's correct map beside its pitfalls' (one row per regime), all of the
    lowest seed every arm has, each model's sharpest head (the same head in its KV-cache row).
    Every map is loaded before anything is written, so a run that cannot be drawn (no
    checkpoint, fewer layers) is refused first. The rows are empty when the sweep kept no
    checkpoints to draw from."""
    from training.attention_maps import sharpest_head

    seed = min(set.intersection(*(set(runs) for runs in arms.values())), default=None)
    rows = defaultdict(list)  # (regime, cached) -> [(variant, run dir)], correct first
    decoding = decoding_arms(arms)
    decodes_differently = {regime for (regime, _), runs in decoding.items()
                           if any(abs(s["cached"][1][-1] - s["causal"][1][-1]) > 1e-3
                                  for s in runs.values())}
    for (regime, variant), runs in ordered(arms):
        name = f"{regime}-{variant}_seed{seed}"
        run_dir = next((p for p in run_dirs(sweep_dir) if p.name == name), sweep_dir / name)
        if seed in runs and (run_dir / "checkpoints").is_dir():
            rows[(regime, False)].append((variant, run_dir))
            if regime in decodes_differently and (regime, variant) in decoding:
                # a second row: the maps of the generation path (of the arms that decoded)
                rows[(regime, True)].append((variant, run_dir))
    maps = {}
    for key, runs in rows.items():
        maps[key] = []
        for variant, run_dir in runs:
            weights, labels = load_maps(run_dir, layer, key[1])
            head = sharpest_head(load_maps(run_dir, layer)[0] if key[1] else weights)
            maps[key].append((variant, weights, labels, head))
    return seed, maps


def plot_maps(seed: int, maps: dict, path: Path, layer: int = 0) -> None:
    """The maps figure of load_all_maps' maps."""
    import torch

    from scripts.maps import colorbar, draw_map
    from training.attention_maps import future_weight

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = max(len(v) for v in maps.values())
    fig, axes = plt.subplots(len(maps), cols, figsize=(3.6 * cols + 0.8, 3.7 * len(maps)),
                             squeeze=False, layout="constrained")
    for r, ((regime, cached), runs) in enumerate(maps.items()):
        for c in range(cols):
            ax = axes[r][c]
            if c >= len(runs):
                ax.axis("off")
                continue
            variant, weights, labels, head = runs[c]
            leak = future_weight(torch.from_numpy(weights[head])).item()
            how = " (KV cache)" if cached else ""
            draw_map(ax, weights[head], labels, f"{regime}: {variant}{how}\nhead {head}, max "
                     f"weight {weights[head].max(-1).mean():.2f}, future {leak:.2f}", fontsize=6)
            ax.set_xlabel("")
            ax.set_ylabel("")
    colorbar(fig, axes, fraction=0.015, pad=0.01, shrink=0.5)
    fig.suptitle(f"Attention of layer {layer} on the same validation window, seed {seed}, after "
                 f"training (rows: query, columns: key; each model's sharpest head; \"KV cache\": "
                 f"fed as the run's last evaluation fed it: one token at a time, as when "
                 f"decoding, or train.cached_eval's way)", fontsize=10)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


# ----------------------------------------------------------------------------- the costs file

COSTS_ABOUT = ("Each pitfall's measured cost, written by scripts/summarize_ablations.py from a "
               "study's runs (docs/ablations.md); never edited by hand. effect: the arm's final "
               "loss minus its regime's correct arm's, paired by seed, nats per token; se: its "
               "standard error; low, high: the 95% interval; seeds: the pairs; identical: every "
               "pair equal to the bit. causal: val/causal_loss (training and the usual "
               "validation see it); cached: val/cached_loss (decoding through the KV cache, fed "
               "as the setting's cached_eval says). shows_in: the loss whose interval leaves 0 "
               "(the one with more standard errors if both do), or null: neither can see it.")


def setting(run_dir: Path) -> str:
    """The regime's setting in words, from one of its runs' config.yaml."""
    cfg = load_run_config(run_dir / "config.yaml")
    m, t = cfg.model, cfg.train
    heads = f"{m.n_head} heads" + (f" ({m.n_kv_head} key/value)" if m.n_kv_head else "")
    parts = [f"{m.n_layer} layers", f"width {m.n_embd}", heads, f"{m.positions} positions",
             f"window {m.window}" if m.get("window") else "", f"context {m.block_size}",
             f"{cfg.tokenizer.kind}-level", f"batch {t.batch_size}", f"{t.max_steps} steps"]
    if t.get("cached_eval_batches"):
        parts.append(f"cached_eval {t.get('cached_eval', 'tokens')}")
    return ", ".join(p for p in parts if p)


def cost(e: Effect) -> dict:
    """An effect as the costs file holds it."""
    identical = bool(e.paired and e.se == 0 and e.mean == 0)  # (numpy's bool is not JSON's)
    number = lambda x: None if math.isnan(x) else round(float(x), 6)  # noqa: E731
    return {"effect": number(e.mean), "se": number(e.se), "low": number(e.low),
            "high": number(e.high), "seeds": e.n, "identical": identical}


def shows_in(costs: dict) -> Optional[str]:
    """The metric whose 95% interval leaves 0 (the one with more standard errors if both)."""
    seen = {metric: abs(c["effect"]) / c["se"] for metric, c in costs.items()
            if c["se"] and (c["low"] > 0 or c["high"] < 0)}
    return max(seen, key=seen.get) if seen else None


def study_name(sweep: Path) -> str:
    """The study a sweep is: the +experiment= it was started with (its record, sweep.json), else
    the sweep's parent folder (runs/<study>/<date>). A study copied elsewhere keeps its name."""
    record = sweep / "sweep.json"
    lines = read_json(record, "the sweep's record", MIB).get("overrides") if record.is_file() else []
    study = [str(o).split("=", 1)[1] for o in lines or [] if str(o).startswith("+experiment=")]
    return study[-1] if study else sweep.resolve().parent.name


def study_costs(sweep: Path, arms: dict) -> dict:
    """{variant: [entry]} of this study: each pitfall arm's effects against its regime's
    correct arm, with its study, regime and setting."""
    study, entries = study_name(sweep), defaultdict(list)
    dirs = {p.name: p for p in run_dirs(sweep)}
    for (regime, variant), runs in ordered(arms):
        base = arms.get((regime, "correct"))
        if base is None or variant == "correct":
            continue
        effects = {"causal": cost(effect(runs, base, "causal"))}
        if (regime, variant) in decoding_arms(arms) and (regime, "correct") in decoding_arms(arms):
            effects["cached"] = cost(effect(runs, base, "cached"))
        seed = min(runs)
        entries[variant].append({
            "study": study, "regime": regime,
            "setting": setting(dirs[f"{regime}-{variant}_seed{seed}"]),
            "shows_in": shows_in(effects), **effects})
    return {"study": study, "sweep": str(sweep), "costs": dict(entries)}


def merge_costs(path: Path, new: dict) -> dict:
    """The costs file at path (if any) with this study's entries replaced by `new`'s."""
    old = read_json(path, "costs file", 16 * MIB) if path.exists() else {}
    if old and not isinstance(old.get("costs"), dict):
        raise UserError(f"{path} is not a costs file (no \"costs\" object); give costs= another")
    studies = {**old.get("studies", {}), new["study"]: new["sweep"]}
    merged = {name: [e for e in entries if e.get("study") != new["study"]]
              for name, entries in old.get("costs", {}).items()}
    for name, entries in new["costs"].items():
        merged.setdefault(name, []).extend(entries)
    return {"about": COSTS_ABOUT, "studies": dict(sorted(studies.items())),
            "costs": {name: entries for name, entries in sorted(merged.items()) if entries}}


@dataclass
class SummaryArgs:
    sweep: str = MISSING            # the study's directory (runs/ablations/<date>)
    out: Optional[str] = None       # where the files go (null: the study's directory)
    layer: int = 0                  # the layer the maps figure draws
    overwrite: bool = False         # replace files already in out= (other than the study's own)
    # the JSON file this study's measured costs are merged into (null: out's
    # pitfall_costs.json); docs/pitfall_costs.json holds every study's
    costs: Optional[str] = None
    # the repository's copy: this study's tables in README.md and docs/ablations.md (between
    # their `<!-- <study> table|short: ... -->` and `<!-- end -->` lines), its figures
    # (docs/<study>.png, docs/<study>_maps.png) and docs/pitfall_costs.json
    docs: bool = False


def summarize(args: SummaryArgs) -> list[Path]:
    sweep = Path(args.sweep)
    if not sweep.is_dir():
        raise UserError(f"sweep={sweep} is not a directory (give runs/ablations/<date>)")
    if args.layer < 0:
        raise UserError(f"layer must be a non-negative integer, got {args.layer}")
    out, study, docs = Path(args.out) if args.out else sweep, study_name(sweep), REPO / "docs"
    files = [out / "ablations.md", *([docs / f"{study}.png", docs / f"{study}_maps.png"]
                                     if args.docs else [out / "ablations.png",
                                                        out / "ablation_maps.png"])]
    costs_file = Path(args.costs) if args.costs else (docs if args.docs else out) / \
        "pitfall_costs.json"
    check_outputs(files[:1] if args.docs else files, args.overwrite, own=sweep)
    for path in files + [costs_file]:  # (the costs file is merged into, not replaced)
        check_output_file(path, "output")
    # everything read and checked before anything is written (or replaced)
    arms = collect(sweep)
    md = table(arms)
    decoding = decoding_table(arms)
    if decoding:
        md += f"\n\n{DECODING_LEGEND}\n\n{decoding}"
    costs = json.dumps(merge_costs(costs_file, study_costs(sweep, arms)), indent=1,
                       ensure_ascii=False) + "\n"
    seed, maps = load_all_maps(sweep, arms, args.layer)
    out.mkdir(parents=True, exist_ok=True)
    files[0].write_text(f"Summary of {sweep}\n\n{LEGEND}\n\n{md}\n")
    plot(arms, files[1])
    if maps:
        plot_maps(seed, maps, files[2], args.layer)
    costs_file.parent.mkdir(parents=True, exist_ok=True)
    costs_file.write_text(costs)
    written = (files if maps else files[:2]) + [costs_file]
    if args.docs:
        seeds = sorted({seed for runs in arms.values() for seed in runs})
        intro = f"Seeds {seeds[0]}-{seeds[-1]} ({len(seeds)} per arm), the runs of {sweep.name}:"
        written += write_blocks(study, {"table": f"{intro}\n\n{md}",
                                        "short": table(arms, SHORT)})
    print(md)
    print(f"\nwrote {', '.join(map(str, written))}")
    return written


def write_blocks(study: str, blocks: dict) -> list[Path]:
    """The study's blocks of README.md and docs/ablations.md rewritten: what lies between a line
    `<!-- <study> <block>: ... -->` and the next `<!-- end -->`."""
    written = []
    for path in (REPO / "README.md", REPO / "docs" / "ablations.md"):
        text = path.read_text()
        new = re.sub(rf"(<!-- {study} (\w+): [^\n]*-->\n).*?(<!-- end -->)",
                     lambda m: f"{m[1]}{blocks[m[2]]}\n{m[3]}", text, flags=re.S)
        if new != text:
            path.write_text(new)
            written.append(path)
    return written


def main(argv: list[str]) -> int:
    usage = ("usage: python -m scripts.summarize_ablations sweep=DIR [out=DIR] [layer=N] "
             "[overwrite=true] [costs=FILE] [docs=true]")

    def body() -> None:
        summarize(parse_key_values(argv, SummaryArgs, usage, about=__doc__.split("\n\n")[0]))
    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
