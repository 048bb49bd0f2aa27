"""Sample text from a trained run, streaming it to stdout.

    python generate.py                                   # the newest run (runs/latest names it)
    python generate.py run=runs/<dir> prompt="ROMEO:" max_new_tokens=500 temperature=0.8 top_k=40
    python generate.py prompts=prompts.txt               # every line of the file, in one batch

Same key=value style as train.py. Everything comes from the run directory alone: config.yaml
(model shape), tokenizer.json and the checkpoint's model.safetensors (no pickle is loaded); a
run directory may come from someone else, so `load_run` checks each file before use
(guard/run_dir.py). The text goes to stdout; stderr says which checkpoint was sampled and, at
the end, the speed. Every mistake ends in one `error:` line.

prompts=FILE samples the prompts of a text file (one a line; write \n for a newline inside
one) together in one batch: left-padded to the longest, with each row's positions counted from
its first real token and its pad keys hidden, through the KV cache. Line i is sampled with
seed + i, and its text is what prompt=<line i> seed=<seed + i> gives alone (docs/sampling.md).
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

import torch

from data.tokenizer import IncrementalDecoder
from safeio.cli import UserError, first_line, parse_key_values, run_cli
from safeio.files import MIB, read_text
from guard.limits import check_sampling, check_top_k, parse_device, prompt_ids
from check_attention.your_layer import NO_CACHE, open_run
from guard.run_dir import resolve_latest
from model.gpt import GPT
from model.sampling import seeded_generator
from training.checkpoint import LATEST
from training.config import Config, TrainConfig
from training.runtime import Speedometer
from guard.weights_choice import choose_weights

USAGE = "usage: python generate.py [run=DIR] [prompt=TEXT] [max_new_tokens=N] [key=value ...]"


@dataclass
class GenerateConfig:
    """The defaults are those of the samples train.py logs."""

    run: str = str(LATEST)         # a run of train.py (runs/latest: the newest) or a model folder
    prompt: str = TrainConfig.sample_prompt  # the text to continue
    prompts: Optional[str] = None  # a file of prompts, one a line (\n: a newline), in one batch
    max_new_tokens: int = 500      # tokens to generate after the prompt, per sample
    temperature: float = TrainConfig.sample_temperature  # below 1 sharper, above 1 more random
    top_k: Optional[int] = None    # sample among the k most likely tokens only (null: all)
    top_p: Optional[float] = None  # sample among the most likely tokens holding this probability
    greedy: bool = False           # always the most likely token (temperature etc. ignored)
    seed: int = Config.seed        # sample i uses seed + i
    num_samples: int = 1           # samples, one after another
    weights: str = "auto"          # auto (best; latest for a leaky run) | best | latest
    device: str = "auto"           # auto (CUDA, else mps, else cpu) | cpu | mps | cuda | cuda:N
    threads: Optional[int] = None  # CPU threads (null: 1; the idle cores for 50M parameters and up)
    use_cache: bool = True         # KV cache; false recomputes the whole context every token
    trust_layer: bool = False      # import the run's copy of a learner's layer (read it first)


def main(argv: list[str]) -> int:
    return run_cli(lambda: sample(argv))


def sample(argv: list[str]) -> int:
    cfg = parse_key_values(argv, GenerateConfig, USAGE, about=__doc__.split("\n\n")[0])
    check_sampling(cfg)  # before anything is read
    device = parse_device(cfg.device)
    run_dir = resolve_latest(Path(cfg.run))
    chosen = choose_weights(run_dir, cfg.weights)
    model, tokenizer, run_cfg = open_run(run_dir, chosen.kind if chosen.kind != "folder"
                                         else "best", device, cfg.trust_layer)
    if run_cfg.your_layer and cfg.use_cache:  # (before a prompt is echoed)
        raise UserError(NO_CACHE)
    check_top_k(cfg.top_k, tokenizer.get_vocab_size())
    texts = read_prompts(cfg) if cfg.prompts is not None else [cfg.prompt]
    block, longer = run_cfg.model.block_size, [] if cfg.prompts is not None else None
    prompts = [prompt_ids(tokenizer, text, block, longer) for text in texts]
    if longer:  # one warning for a file of them
        print(f"warning: {len(longer)} of the {len(texts)} prompts have more tokens than the "
              f"context of {block} (up to {max(longer)}); only their last {block} are used",
              file=sys.stderr)
    threads = decoding_threads(cfg.threads, model, device)
    print(f"sampling {run_dir}: {chosen.describe()}" + (f"; {chosen.note}" if chosen.note else ""),
          file=sys.stderr, flush=True)
    meter = Speedometer()
    try:
        if cfg.prompts is not None:
            sample_batch(model, tokenizer, prompts, cfg, meter=meter)
        for i in range(cfg.num_samples if cfg.prompts is None else 0):
            if i:
                print("\n" + "-" * 40)
            stream(model, tokenizer, prompts[0], replace(cfg, seed=cfg.seed + i), meter=meter)
    except KeyboardInterrupt:  # the sample so far stays on screen
        print(file=sys.stderr)
        report_speed(meter, device, threads)
        return 130
    report_speed(meter, device, threads)
    return 0


# A prompts file is read whole: a few thousand prompts of a context's length at most.
MAX_PROMPTS_FILE = 16 * MIB


def read_prompts(cfg: GenerateConfig) -> list[str]:
    """The prompts of cfg.prompts: one a line, \n standing for a newline inside one; refused
    where it cannot be sampled as asked (an empty line, num_samples, no KV cache)."""
    if cfg.num_samples != 1:
        raise UserError(f"num_samples={cfg.num_samples} repeats prompt=; with prompts= each line "
                        f"is one sample (repeat a line to sample it again)")
    if not cfg.use_cache:
        raise UserError("prompts= samples its lines in one batch through the KV cache: drop "
                        "use_cache=false")
    text = read_text(Path(cfg.prompts), "prompts file", MAX_PROMPTS_FILE)
    lines = [line.replace("\\n", "\n") for line in text.splitlines()]
    for number, line in enumerate(lines, 1):
        if not line:
            raise UserError(f"line {number} of {cfg.prompts} is empty; every line is a prompt "
                            f"(write \\n for a newline inside one)")
    if not lines:
        raise UserError(f"{cfg.prompts} holds no prompt; write one a line")
    check_sampling(replace(cfg, num_samples=len(lines)))  # line i's seed, seed + i
    return lines


# Decoding one sequence runs every op on a single row ([1, n_embd] times [n_embd, 4 n_embd]). For a
# small model each op takes microseconds and a second thread costs more in synchronisation than
# it saves; when another process holds a core, every op also waits for the thread that core runs.
# Measured (docs/sampling.md): one thread decodes the default model 7x faster than torch's two on
# 2 cores that other jobs load, 6x when two more processes spin on them; a 12 x 768 model 5x and
# 4x. Only a model past this many parameters gets more, and only the cores that are idle.
THREADS_FROM_PARAMS = 50_000_000


def decoding_threads(requested: Optional[int], model: GPT, device) -> int:
    """CPU threads for decoding, set for torch: as requested; else 1 below THREADS_FROM_PARAMS
    parameters, and above it the cores no other process is using (the cores this process may
    run on less the 1-minute load average), at least 1. Returns the count."""
    if device.type != "cpu":
        return torch.get_num_threads()
    if requested is None:
        requested = 1
        if model.num_params() >= THREADS_FROM_PARAMS:
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
                else (os.cpu_count() or 1)
            requested = max(1, min(cores, round(cores - os.getloadavg()[0])))
    torch.set_num_threads(requested)
    return torch.get_num_threads()


def report_speed(meter: Speedometer, device, threads: int) -> None:
    """The tokens of every sample and their rate, on stderr (stdout holds the text)."""
    if meter.tokens == 0:
        return
    where = f"{threads} thread{'s' if threads > 1 else ''}" if device.type == "cpu" \
        else str(device)
    print(f"{meter.tokens:,} tokens in {meter.seconds:.2f} s: {meter.rate():,.0f} tokens/s "
          f"({where})", file=sys.stderr)


def stream(model: GPT, tokenizer, prompt_ids: list[int], cfg: GenerateConfig, out=None,
           meter: Optional[Speedometer] = None) -> str:
    """Generate one sample, writing text as it appears (to stdout by default); returns it all,
    and adds its tokens and time to meter.

    Decoding is incremental (data.tokenizer.IncrementalDecoder), so each token costs the same
    however long the sample grows."""
    out = sys.stdout if out is None else out
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    decoder = IncrementalDecoder(tokenizer, prompt_ids)
    pieces = [tokenizer.decode(list(prompt_ids))]
    out.write(pieces[0])
    tokens = model.generate(torch.tensor([prompt_ids], device=device), cfg.max_new_tokens,
                            cfg.temperature, cfg.top_k, cfg.top_p, gen, cfg.greedy, cfg.use_cache)
    started = time.perf_counter()
    try:
        for token in tokens:
            piece = decoder.add(int(token))
            if piece:
                out.write(piece)
                out.flush()
                pieces.append(piece)
    except RuntimeError as exc:  # e.g. probabilities that are not finite: weights that overflow
        out.write("\n")
        out.flush()
        raise UserError(f"sampling failed after {len(decoder.ids) - len(prompt_ids)} tokens: "
                        f"{first_line(exc)} (do the weights overflow?)") from None
    finally:  # interrupted too: the speed so far
        if meter is not None:
            meter.add(len(decoder.ids) - len(prompt_ids), time.perf_counter() - started)
    pieces.append(decoder.finish())
    print(pieces[-1], file=out, flush=True)  # before the speed line on stderr, piped or not
    return "".join(pieces)


def sample_batch(model: GPT, tokenizer, prompts: list[list[int]], cfg: GenerateConfig,
                 out=None, meter: Optional[Speedometer] = None) -> list[str]:
    """Sample every prompt at once and write the texts when all are done; returns them.

    One batch, left-padded to the longest prompt: row i is pad[i] pad tokens (their id is never
    seen) and then prompt i, and its positions count from its first real token (GPT.generate's
    pad). Row i draws from a generator of its own seeded seed + i, so its text is what `stream`
    gives prompt i alone with that seed."""
    out = sys.stdout if out is None else out
    device = next(model.parameters()).device
    longest = max(map(len, prompts))
    pad = [longest - len(ids) for ids in prompts]
    idx = torch.tensor([[0] * n + ids for n, ids in zip(pad, prompts)], device=device)  # [B, longest]
    generators = [seeded_generator(cfg.seed + i, device) for i in range(len(prompts))]
    tokens = model.generate(idx, cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p,
                            generators, cfg.greedy, cfg.use_cache,
                            pad=torch.tensor(pad, device=device))
    started, steps = time.perf_counter(), []
    try:
        steps = [token for token in tokens]  # each [B, 1]
    except RuntimeError as exc:  # e.g. probabilities that are not finite: weights that overflow
        raise UserError(f"sampling failed after {len(steps)} tokens: {first_line(exc)} (do the "
                        f"weights overflow?)") from None
    finally:
        if meter is not None:
            meter.add(len(steps) * len(prompts), time.perf_counter() - started)
    new = torch.cat(steps, dim=1).tolist() if steps else [[] for _ in prompts]  # [B, new]
    texts = [tokenizer.decode(ids + row) for ids, row in zip(prompts, new)]
    out.write(("\n\n" + "-" * 40 + "\n").join(texts) + "\n")  # as num_samples' samples
    return texts


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
