"""What does keeping freed memory (training/cpu_memory.py) save in a CPU training step? The
step's time and page faults with glibc's own malloc settings and with the kept ones.

    python -m tools.freed_memory                      # default model, fp32 and bf16
    python -m tools.freed_memory dtypes=fp32 reps=20 model=baby
    python -m tools.freed_memory quick=true

glibc's settings cannot be put back once changed, so the step is built and warmed once, here, and
every measurement is a forked child (the same heap and glibc state; a 'kept' child first changes the
settings), the two kinds alternating so that both see the same host. The parent stays on one thread
(a forked child cannot reuse the parent's OpenMP threads); each child takes `threads=` (all cores by
default). Headline: the kept step's time over glibc's, for the first dtype.
"""
from __future__ import annotations

import os
import resource
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field

import torch

from bench.common import (BenchArgs, bench_main, compose_config, fmt, print_header, print_headline,
                          print_table, resolve_repetitions)
from bench.train_step import DTYPES, build_step
from safeio.cli import UserError
from training.cpu_memory import keep_freed_memory

STEPS, QUICK_STEPS = 5, 1   # timed steps per child, after 2 untimed ones
REPS, QUICK_REPS = 10, 1    # children of each condition, alternating


@dataclass
class FreedArgs(BenchArgs):
    dtypes: list[str] = field(default_factory=lambda: ["fp32", "bf16"])  # fp32 | bf16


def child_measurement(step, threads: int, keep: bool, steps: int) -> tuple[float, float]:
    """(seconds, page faults) per step, measured in a forked child."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: measure, write, exit without running the parent's code after
        status = 1
        try:
            os.close(read)
            torch.set_num_threads(threads)
            if keep:
                keep_freed_memory()
            for _ in range(2):
                step()
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start = time.perf_counter()
            for _ in range(steps):
                step()
            seconds = (time.perf_counter() - start) / steps
            faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / steps
            os.write(write, f"{seconds} {faults}".encode())
            status = 0
        except BaseException:
            traceback.print_exc()
        finally:  # the child never returns into the parent's code
            os._exit(status)
    os.close(write)
    with os.fdopen(read) as pipe:
        measured = pipe.read().split()
    os.waitpid(pid, 0)
    if len(measured) != 2:
        raise UserError("a measuring child failed (its error is above)")
    seconds, faults = map(float, measured)
    return seconds, faults


def main(argv: list[str]) -> int:
    return bench_main(argv, FreedArgs, "tools.freed_memory", __doc__, measure_all)


def measure_all(args: FreedArgs, overrides: list[str]) -> int:
    if not hasattr(os, "fork"):
        raise UserError("tools.freed_memory forks its measurements: it needs a POSIX system")
    unknown = [d for d in args.dtypes if d not in DTYPES]
    if unknown:
        raise UserError(f"dtypes must be among {', '.join(DTYPES)}, got {unknown[0]!r}")
    threads = args.threads or torch.get_num_threads()
    reps, _ = resolve_repetitions(args, reps=REPS, quick_reps=QUICK_REPS)
    steps = QUICK_STEPS if args.quick else STEPS
    cfg = compose_config([*overrides, "train.batch_size=2"] if args.quick else overrides)
    device = torch.device("cpu")
    print_header(
        "a CPU training step with glibc's malloc settings and with freed memory kept",
        device, f"model {' '.join(overrides) or 'default'}, batch {cfg.train.batch_size}",
        f"{threads} threads in each forked child, {steps} timed steps a child, median of "
        f"{reps} children per condition, alternating")
    torch.set_num_threads(1)
    rows, ratios = [], []
    for name in args.dtypes:
        step = build_step(cfg, DTYPES[name], None, device)
        for _ in range(2):  # warm: the parent's heap as a training run's would be
            step()
        runs = {False: [], True: []}
        for _ in range(reps):
            for keep in (False, True):
                runs[keep].append(child_measurement(step, threads, keep, steps))
        ms = {k: statistics.median(s for s, _ in v) * 1e3 for k, v in runs.items()}
        faults = {k: statistics.median(f for _, f in v) for k, v in runs.items()}
        ratios.append(ms[True] / ms[False])
        rows.append([name, fmt(ms[False], ".1f"), fmt(faults[False], ",.0f"), fmt(ms[True], ".1f"),
                     fmt(faults[True], ",.0f"), fmt(ratios[-1], ".3f")])
    print_table(["dtype", "glibc's: ms/step", "page faults/step", "kept: ms/step",
                 "page faults/step", "kept/glibc's"], rows)
    print(f"headline: the kept step's time over glibc's, {args.dtypes[0]}")
    print_headline(ratios[0])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
