"""Plumbing shared by the benchmarks: command line, configuration, timing, memory, tables, headline.

Every script prints a small table whose header states what its numbers depend on (device,
threads, torch version) and ends with one line `ratio=<number>`: the single figure that CI
checks for and that people compare between machines and commits.

Timing rules, the same everywhere: warm-up calls are excluded (first calls pay for lazy
initialisation, allocator growth and, with torch.compile, compilation); each candidate is timed
several times and its median reported (robust to the odd slow repetition on a shared machine);
candidates that are compared are timed in the same run, alternating repetition by repetition,
so that a change in machine load hits all of them alike.
"""
from __future__ import annotations

import math
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Optional, Sequence

import torch

from safeio.cli import UserError, parse_key_values, run_cli
from training.cpu_memory import keep_freed_memory

if TYPE_CHECKING:
    from training.config import Config

REPO_ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20
GPU_RECIPE = "+experiment=gpu"  # conf/experiment/gpu.yaml: the model and batch meant for a GPU
# Defaults of the timing loop; each script may choose its own and reps= / warmup= override.
DEFAULT_REPS, QUICK_REPS = 10, 3
DEFAULT_WARMUP, QUICK_WARMUP = 2, 1


# ----------------------------------------------------------------------------- command line


@dataclass
class BenchArgs:
    """The keys every benchmark takes (safeio.cli.parse_key_values); each adds its own in a
    dataclass that extends this one, and passes any other key=value on to train.py's config."""
    quick: bool = False            # a seconds-long smoke run (CI): fewer sizes and repetitions
    device: str = "auto"           # auto | cpu | mps | cuda | cuda:N
    threads: Optional[int] = None  # torch intra-op CPU threads (null: PyTorch's choice)
    # timed repetitions, median reported (null: the bench's own, fewer with quick=true)
    reps: Optional[int] = None
    warmup: Optional[int] = None   # untimed warm-up calls (null: the bench's own)


def usage(module: str, overrides: bool = True) -> str:
    return f"usage: python -m {module} [key=value ...]" + (
        " [train.py overrides, e.g. model=baby train.batch_size=32, for every configuration "
        "benchmarked]" if overrides else "")


def bench_main(argv: list[str], schema: type, module: str, doc: str,
               measure: Callable[[BenchArgs, list[str]], int]) -> int:
    """`python -m module`: argv's keys into schema and the rest as train.py overrides, then
    measure(args, overrides), under run_cli's exit statuses (--help shows doc's first paragraph)."""
    return run_cli(lambda: measure(*parse_key_values(
        argv, schema, usage(module), about=doc.split("\n\n")[0], overrides=True)))


def resolve_repetitions(args: BenchArgs, reps: int = DEFAULT_REPS,
                        quick_reps: int = QUICK_REPS, warmup: int = DEFAULT_WARMUP,
                        quick_warmup: int = QUICK_WARMUP) -> tuple[int, int]:
    """(reps, warmup): the command line's if given, else the script's defaults for the mode."""
    r = args.reps if args.reps is not None else (quick_reps if args.quick else reps)
    w = args.warmup if args.warmup is not None else (quick_warmup if args.quick else warmup)
    if r < 1 or w < 0:
        raise UserError(f"reps must be >= 1 and warmup >= 0, got {r} and {w}")
    return r, w


def setup(args: BenchArgs) -> torch.device:
    """Apply threads= and resolve device= (the same rule as train.py's train.device); on a CPU,
    keep freed memory as train.py does (training/cpu_memory.py)."""
    from guard.limits import parse_device

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = parse_device(args.device)
    if device.type == "cpu":
        keep_freed_memory()
    return device


# ----------------------------------------------------------------------------- configuration


def compose_config(overrides: Sequence[str] = ()) -> Config:
    """The checked config `python train.py <overrides>` runs with (`guard.compose.compose`).

    Composed from conf/, not restated defaults that would drift; a bad override ends the
    benchmark with Hydra's one-line reason.
    """
    from safeio.cli import MISTAKES, one_line
    from guard.compose import compose

    try:
        return compose(list(overrides))
    except MISTAKES as exc:
        where = " ".join(overrides) or "(defaults)"
        raise UserError(f"config `{where}`: {one_line(exc)}") from exc


# ----------------------------------------------------------------------------- timing


def sync(device: torch.device) -> None:
    """GPU kernels run asynchronously: wait for them, or the clock stops too early."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def time_once(fn: Callable[[], object], device: torch.device) -> float:
    """Wall-clock seconds of one call, device work included."""
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def interleaved_medians(candidates: dict[str, Callable[[], object]], device: torch.device,
                        reps: int, warmup: int) -> dict[str, float]:
    """Median seconds per call of each candidate, warm-up excluded.

    The candidates take turns within each repetition (a, b, a, b, ...) rather than running one
    after the other, so that other jobs starting or stopping on the machine affect all of them
    alike and their ratio stays meaningful even when the absolute times drift.
    """
    for _ in range(warmup):
        for fn in candidates.values():
            fn()
    sync(device)
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(reps):
        for name, fn in candidates.items():
            samples[name].append(time_once(fn, device))
    return {name: statistics.median(times) for name, times in samples.items()}


# ----------------------------------------------------------------------------- memory


def activation_bytes(forward: Callable[[], torch.Tensor],
                     exclude: Iterable[torch.Tensor] = ()) -> tuple[int, torch.Tensor]:
    """Bytes that autograd keeps alive for the backward pass of `forward()`, and its output.

    Works on any device, CPU included (no peak-memory counter there): every tensor saved for
    backward passes through `saved_tensors_hooks`; each storage is counted once (q, k, v are
    views of one buffer) and those of `exclude` (weights, buffers, inputs) not at all. Buffers
    freed during the forward are not included: this is what grows with batch and context.
    """
    seen = {t.untyped_storage().data_ptr() for t in exclude}
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:  # kept alive by the saved tensor: no address reuse
            seen.add(storage.data_ptr())
            total += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    return total, out


def cuda_peak_bytes(fn: Callable[[], object], device: torch.device) -> Optional[int]:
    """Peak CUDA memory allocated by `fn()` above what was allocated before it; None on CPU."""
    if device.type != "cuda":
        return None
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    sync(device)
    return torch.cuda.max_memory_allocated(device) - before


# ----------------------------------------------------------------------------- reporting


def cpu_bf16_note(device: torch.device) -> str:
    """bf16 on a CPU without bf16 instructions is emulated (slow): say so next to the figures."""
    if device.type != "cpu":
        return ""
    from training.device import cpu_has_native_bf16

    return ("CPU bf16: native" if cpu_has_native_bf16()
            else "CPU bf16: emulated (no AVX512-BF16/AMX), expect bf16 slower than fp32")


def describe_machine(device: torch.device) -> str:
    """One line naming what the timings depend on."""
    if device.type == "cuda":
        where = f"cuda ({torch.cuda.get_device_name(device)})"
    elif device.type == "mps":
        where = f"mps ({getattr(torch.backends.mps, 'get_name', platform.machine)()})"
    else:
        where = f"cpu ({platform.processor() or platform.machine()})"
    parts = [f"device {where}", f"torch.get_num_threads()={torch.get_num_threads()}",
             f"torch {torch.__version__}", cpu_bf16_note(device)]
    return "; ".join(p for p in parts if p)


def print_header(title: str, device: torch.device, *details: str) -> None:
    print(f"== {title}")
    print(f"   {describe_machine(device)}")
    for line in details:
        print(f"   {line}")


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """A plain, aligned text table (numbers right-aligned, text left-aligned)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row: Sequence[str], raw: Sequence[object]) -> str:
        out = []
        for text, value, width in zip(row, raw, widths):
            numeric = isinstance(value, (int, float)) or _looks_numeric(text)
            out.append(text.rjust(width) if numeric else text.ljust(width))
        return "  ".join(out).rstrip()

    print(line(cells[0], headers))
    print("  ".join("-" * w for w in widths))
    for row, raw in zip(cells[1:], rows):
        print(line(row, raw))


def _looks_numeric(text: str) -> bool:
    try:
        float(text.replace(",", "").rstrip("%x"))
        return True
    except ValueError:
        return False


def fmt(value: Optional[float], spec: str = ".3g") -> str:
    """A number for a table cell; None (not measured) and non-finite values read 'n/a'."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    return format(value, spec)


def print_headline(value: float) -> None:
    """The last line of every benchmark, parsed by tests/test_bench.py and by people."""
    sys.stdout.flush()
    print(f"ratio={value:.6g}", flush=True)
