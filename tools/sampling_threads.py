"""How many CPU threads should sampling use? Decoding tokens/s at one thread and at several, on
idle cores and on cores that other processes keep busy.

    python -m tools.sampling_threads                 # default model, 1 vs all cores, 0 and 2 busy
    python -m tools.sampling_threads busy=2 threads=2 model.n_layer=12 model.n_embd=768
    python -m tools.sampling_threads quick=true

generate.py decodes one sequence: every op works on a single row, so a small model's ops take
microseconds. A second thread then costs more in synchronisation than it saves, and when another
process holds a core, every op waits for the thread that core runs. This bench measures that, as
generate.py samples (`GPT.generate` with the KV cache, temperature 0.8, random weights of the
configured model): for each repetition, with no busy process and then with `busy=` spinning Python
processes (nice 0, like a user's other jobs), it times one sample at each thread count, alternating.
Headline: tokens/s at one thread over tokens/s at `threads=` (all cores by default) on the busy
cores: what generate.py's `threads=null` (1 for a small model) gains over torch's default.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Optional

import torch

from bench.common import (BenchArgs, bench_main, compose_config, fmt, print_header, print_headline,
                          print_table, resolve_repetitions)
from model.gpt import GPT

N_TOKENS, QUICK_N_TOKENS = 300, 30
REPS, QUICK_REPS = 3, 1
PROMPT_LEN = 5


def spinners(n: int) -> list[subprocess.Popen]:
    """n processes that keep a core busy each, as other jobs on the machine would."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    time.sleep(0.5 if n else 0)  # let them start spinning
    return procs


def stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        proc.kill()
        proc.wait()


def tokens_per_second(model: GPT, prompt: torch.Tensor, n_tokens: int, threads: int) -> float:
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    for _ in model.generate(prompt, 5, 0.8, generator=gen):  # warm-up at this thread count
        pass
    start = time.perf_counter()
    for _ in model.generate(prompt, n_tokens, 0.8, generator=gen):
        pass
    return n_tokens / (time.perf_counter() - start)


@dataclass
class ThreadsArgs(BenchArgs):
    busy: int = 2                  # processes kept spinning during the busy measurements
    tokens: Optional[int] = None   # new tokens per sample (null: 300, 30 with quick=true)


def main(argv: list[str]) -> int:
    return bench_main(argv, ThreadsArgs, "tools.sampling_threads", __doc__, measure_all)


def measure_all(args: ThreadsArgs, overrides: list[str]) -> int:
    many = args.threads or torch.get_num_threads()  # threads=: the count compared with 1
    reps, _ = resolve_repetitions(args, reps=REPS, quick_reps=QUICK_REPS)
    n_tokens = args.tokens or (QUICK_N_TOKENS if args.quick else N_TOKENS)
    busy_counts = (0, max(args.busy, 1 if args.quick else 0)) if args.busy or args.quick else (0,)

    cfg = compose_config(overrides)
    torch.manual_seed(0)
    model = GPT(cfg.model, cfg.tokenizer.planned_vocab_size, cfg.attention).eval()
    prompt = torch.randint(0, model.vocab_size, (1, PROMPT_LEN))
    threads = sorted({1, many})
    print_header(
        "sampling one sequence on the CPU: tokens/s by thread count, idle and busy cores",
        torch.device("cpu"),
        f"model {' '.join(overrides) or 'default'} (n_layer {cfg.model.n_layer}, n_embd "
        f"{cfg.model.n_embd}, {model.num_params() / 1e6:.2f}M parameters), random weights, "
        f"KV cache, temperature 0.8, {n_tokens} new tokens",
        f"{os.cpu_count()} cores, 1-minute load average {os.getloadavg()[0]:.1f} at the start; "
        f"median of {reps} repetitions, the conditions alternating within each",
    )
    samples: dict[tuple[int, int], list[float]] = {(b, t): [] for b in busy_counts for t in threads}
    for _ in range(reps):
        for busy in busy_counts:
            procs = spinners(busy)
            try:
                for t in threads:
                    samples[busy, t].append(tokens_per_second(model, prompt, n_tokens, t))
            finally:
                stop(procs)
    median = {key: sorted(v)[len(v) // 2] for key, v in samples.items()}
    print_table(["busy processes", "threads", "tokens/s (median)", "min", "max",
                 "x at 1 thread"],
                [[busy, t, fmt(median[busy, t], ",.1f"), fmt(min(samples[busy, t]), ",.1f"),
                  fmt(max(samples[busy, t]), ",.1f"),
                  fmt(median[busy, 1] / median[busy, t], ".2f")]
                 for busy in busy_counts for t in threads])
    last = busy_counts[-1]
    print(f"headline: tokens/s at 1 thread over {many} threads, {last} busy process(es)")
    print_headline(median[last, 1] / median[last, many])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
