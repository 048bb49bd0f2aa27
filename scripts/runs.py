"""List training runs with their final scores, or compare two side by side, without TensorBoard.

    python -m scripts.runs                                    # every run under runs/, newest last
    python -m scripts.runs root=runs/ablations/<date>         # the runs of a study
    python -m scripts.runs a=runs/latest b=runs/<date>_<time> # two runs: config and scores

A run is a directory with the config.yaml and TensorBoard events train.py writes. Runs on different
corpora (lesson 04's made-up play beside Shakespeare) are listed in separate tables: their scores do
not compare. The scores are the last values of its curves: the causal validation loss (nats/token on
the evaluation batches; for a correct model its own loss), the same per character, the whole
validation split per character when the run scored it, and the training loss. A comparison lists the
config values that differ, every score of both runs with their difference, and the causal validation
loss at each evaluation step both runs share. runs/latest is accepted wherever a run is.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from safeio.cli import UserError, parse_key_values, run_cli
from guard.run_dir import resolve_latest

USAGE = "usage: python -m scripts.runs [root=DIR] | a=RUN b=RUN"
LN2 = math.log(2)


@dataclass
class RunsArgs:
    root: str = "runs"              # where to look for runs (every folder below it)
    a: Optional[str] = None         # compare this run ...
    b: Optional[str] = None         # ... with this one
    sort: str = "time"              # time (oldest first) | score (lowest causal nats/char first)


# What a run's scores are read from: (label, unit, tag, older tag and factor as a fallback).
SCORES = [
    ("steps", "", None, None),
    ("causal val", "nats/token", "val/causal_loss", ("val/loss", 1.0)),
    ("causal val", "nats/char", "val/nats_per_char", ("val/bpc", LN2)),
    ("whole split", "nats/char", "val/nats_per_char_full", ("val/bpc_full", LN2)),
    ("train", "nats/token", "train/loss", None),
    ("time", "min", None, None),
]


def find_runs(root: Path) -> list[Path]:
    """Directories under root (root itself included) holding a config.yaml and events."""
    if (root / "config.yaml").is_file() and any(root.glob("events.out.tfevents.*")):
        return [root]
    found = {p.parent for p in root.rglob("events.out.tfevents.*")
             if (p.parent / "config.yaml").is_file()}
    return sorted(found)


def read_scores(run: Path) -> dict:
    """{label: value} of a run's final scores (missing ones left out), its attention variant and
    tokenizer, and its curves: {tag: [(step, value)]}."""
    from omegaconf import OmegaConf

    from guard.run_dir import read_events, saved_config

    acc = read_events(run, {"scalars": 0, "images": 1, "tensors": 1})
    tags = set(acc.Tags()["scalars"])
    curves = {tag: [(e.step, e.value, e.wall_time) for e in acc.Scalars(tag)] for tag in tags}
    cfg = saved_config(run / "config.yaml")
    leaky = not OmegaConf.to_object(cfg.attention).is_causal()
    out = {"attention": cfg.attention.name, "tokenizer": cfg.tokenizer.kind.value,
           "corpus": corpus_name(cfg.data), "curves": curves}
    for label, unit, tag, older in SCORES:
        if tag in curves:
            out[label, unit] = curves[tag][-1][1]
        elif older and older[0] in curves and not leaky:  # before every run logged it
            out[label, unit] = curves[older[0]][-1][1] * older[1]
    if "train/loss" in curves:
        times = [wall for series in curves.values() for _, _, wall in series]
        out["steps", ""] = max(step for step, _, _ in curves["train/loss"])
        out["time", "min"] = (max(times) - min(times)) / 60
    return out


def corpus_name(data) -> str:
    """The text a run trained on, in a few words: the source, or the first training file."""
    if data.source.value == "hub":
        return f"hub {data.hub_name}"
    if data.source.value == "text_files":
        first = Path(data.train_files[0]).resolve()
        name = first.relative_to(Path.cwd()) if first.is_relative_to(Path.cwd()) else first
        return f"{name}" + (f" +{len(data.train_files) - 1}" if len(data.train_files) > 1 else "")
    return data.source.value


def fmt(label: str, value) -> str:
    if value is None:
        return "-"
    if label == "steps":
        return f"{value:,.0f}"
    if label == "time":
        return f"{value:.1f}"
    return f"{value:.4f}"


def render(rows: list[list[str]], header: list[str], left: int = 3) -> str:
    """A table: the first `left` columns (names) left-aligned, the numbers right-aligned."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(c.ljust(w) if i < left else c.rjust(w)  # noqa: E731
                               for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def list_runs(root: Path, sort: str) -> str:
    runs = find_runs(root)
    if not runs:
        raise UserError(f"no runs under {root} (a run holds config.yaml and TensorBoard events)")
    scored = [(run, read_scores(run)) for run in runs]
    if sort == "score":
        # per character, not per token: a char run's token is a BPE run's ~3 characters
        scored.sort(key=lambda rs: rs[1].get(("causal val", "nats/char"), math.inf))
    else:
        scored.sort(key=lambda rs: (rs[0] / "config.yaml").stat().st_mtime)
    header = ["run", "corpus", "attention", "tokenizer"] + [
        f"{label} ({unit})" if unit else label for label, unit, _, _ in SCORES]
    tables: dict[str, list] = {}  # a table per corpus, in the order of their first run
    for run, s in scored:
        tables.setdefault(s["corpus"], []).append(
            [str(run.relative_to(root)) if run != root else str(run), s["corpus"], s["attention"],
             s["tokenizer"]] + [fmt(label, s.get((label, unit))) for label, unit, _, _ in SCORES])
    return "\n\n".join(render(rows, header, 4) for rows in tables.values()) + \
        f"\n{len(scored)} run(s) under {root}" + (
            f", on {len(tables)} corpora (a table each: scores compare within one)"
            if len(tables) > 1 else "")


def flat(cfg, prefix: str = "") -> dict:
    """A config as {dotted key: value}."""
    out = {}
    for key, value in cfg.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def compare(a: Path, b: Path) -> str:
    from omegaconf import OmegaConf

    from guard.run_dir import saved_config

    for run in (a, b):
        if not (run / "config.yaml").is_file():
            raise UserError(f"{run} is not a run directory of train.py (no config.yaml)")
    ca, cb = (flat(OmegaConf.to_container(saved_config(r / "config.yaml"), resolve=False))
              for r in (a, b))
    differ = [[key, str(ca.get(key, "-")), str(cb.get(key, "-"))]
              for key in sorted(set(ca) | set(cb)) if ca.get(key) != cb.get(key)]
    sa, sb = read_scores(a), read_scores(b)
    scores = []
    for label, unit, _, _ in SCORES:
        va, vb = sa.get((label, unit)), sb.get((label, unit))
        digits = {"steps": 0, "time": 1}.get(label, 4)
        diff = "-" if va is None or vb is None else f"{vb - va:+,.{digits}f}"
        scores.append([f"{label} ({unit})" if unit else label, fmt(label, va), fmt(label, vb), diff])
    tag = "val/causal_loss" if "val/causal_loss" in sa["curves"] else "val/loss"
    along_a = {s: v for s, v, _ in sa["curves"].get(tag, [])}
    along_b = {s: v for s, v, _ in sb["curves"].get(tag, [])}
    steps = [[str(s), f"{along_a[s]:.4f}", f"{along_b[s]:.4f}", f"{along_b[s] - along_a[s]:+.4f}"]
             for s in sorted(set(along_a) & set(along_b))]
    parts = [f"a: {a}\nb: {b}", "config values that differ:\n" + (
        render(differ, ["key", "a", "b"]) if differ else "  none")]
    parts.append("final scores:\n" + render(scores, ["score", "a", "b", "b - a"]))
    if steps:
        parts.append(f"causal validation loss along training (nats/token):\n"
                     + render(steps, ["step", "a", "b", "b - a"]))
    return "\n\n".join(parts)


def main(argv: list[str]) -> int:
    def body() -> None:
        args = parse_key_values(argv, RunsArgs, USAGE, about=__doc__.split("\n\n")[0])
        if args.sort not in ("time", "score"):
            raise UserError(f"sort must be time or score, got {args.sort!r}")
        if (args.a is None) != (args.b is None):
            raise UserError("give both a= and b= to compare two runs")
        if args.a is not None:
            a, b = (resolve_latest(Path(p)) for p in (args.a, args.b))
            for run in (a, b):
                if not run.is_dir():
                    raise UserError(f"run directory {run} does not exist")
            print(compare(a, b))
            return
        root = resolve_latest(Path(args.root))
        if not root.is_dir():
            raise UserError(f"root={root} is not a directory")
        print(list_runs(root, args.sort))
    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
