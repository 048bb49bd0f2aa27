"""How much of the machine does a training step use? Tokens/s and model FLOPs utilisation.

    python -m bench.train_step                 # 3 models (4 on CUDA), fp32 + bf16, eager + compiled
    python -m bench.train_step quick=true      # seconds: 2 models, batch 1, eager only
    python -m bench.train_step compile_mode=reduce-overhead   # compiled rows with CUDA graphs
    python -m bench.train_step optim=adamw     # any train.py override, applied to every model

Each model is benchmarked with the config `python train.py <overrides>` would run with
(`training.config.compose`): its model, attention, tokenizer's vocabulary, optimizer and batch
size. The models: the default; nanoGPT's baby GPT (`model=baby`); a bigger one; and on CUDA the
GPU recipe (`+experiment=gpu`). One step is what train.py does per batch: forward under
autocast, backward, gradient clipping, optimizer step; the tokens are random.

MFU is the model's useful FLOPs per second over the machine's peak, and the peak is *measured in the
same run*, per dtype: square matmuls of growing n until a larger n gains no more than a few
percent (or would not fit); the fastest is the peak, its n printed and timed again after the
steps. One fixed size would not do: a matmul too small to fill a big GPU reads far below it, and
every MFU divided by it is flattered. fp32 on CUDA means TF32 matmuls, as train.py sets.

Model FLOPs per token: 6 N + 12 n_layer n_embd T (nanoGPT's estimate, after PaLM's appendix B;
docs/benchmarks.md), N without the position embeddings (the tied head is a real matmul). Headline:
MFU of the default config in the dtype and mode `python train.py` runs by default (auto dtype;
compiled on CUDA, eager on a CPU).
"""
from __future__ import annotations

import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from bench.common import (GPU_RECIPE, BenchArgs, bench_main, compose_config, fmt,
                          interleaved_medians, print_header, print_headline, print_table,
                          resolve_repetitions, setup, time_once)
from safeio.cli import check_choices
from model.fast_paths import trust_fused_attention
from model.gpt import GPT
from training.config import COMPILE_MODES, Config
from training.device import autocast, pick_dtype
from training.optim import make_optimizer

BIGGER = ["model.n_layer=6", "model.n_head=8", "model.n_embd=256"]
QUICK_BATCH = 1               # quick=true: runs every code path; bf16 is slow on most CPUs
REPS, QUICK_REPS = 5, 2       # training steps are long: fewer repetitions than the default
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SEED = 0

# The peak probe's ladder of matmul sizes n, climbed while the rate still gains PEAK_GAIN.
PEAK_SIZES = {"cpu": (512, 1024, 2048, 4096), "cuda": (1024, 2048, 4096, 8192, 16384)}
QUICK_PEAK_SIZES = {"cpu": (256, 512), "cuda": (1024, 2048, 4096)}
PEAK_GAIN = 0.03
PEAK_BUDGET_S = 10.0          # per dtype: a size whose probe would overrun this is not tried
PEAK_MEMORY_SHARE = 0.5       # of the free memory, for the probe's four n x n matrices


# ----------------------------------------------------------------------------- the peak


@dataclass
class Peak:
    """The fastest matmul of the ladder: FLOP/s, its size, its entry point, and every step."""

    flops: float = 0.0
    n: int = 0
    how: str = ""
    ladder: list[tuple[int, float]] = field(default_factory=list)
    stopped: str = "top of the ladder"
    again: Optional[float] = None  # the same size re-measured after the steps


def climb(sizes: Sequence[int], rate_at: Callable[[int], tuple[float, str, float]],
          fits: Callable[[int], bool], budget_s: float, gain: float = PEAK_GAIN) -> Peak:
    """Measure `rate_at(n)` -> (FLOP/s, entry point, seconds spent) up the ladder of sizes.

    Stops when a size gains no more than `gain` over the best so far (the device is saturated),
    when the next size does not fit, or when its probe, predicted from the last one (n^3 work),
    would overrun what is left of `budget_s`.
    """
    peak, spent, last_cost = Peak(), 0.0, None
    for i, n in enumerate(sizes):
        if not fits(n):
            peak.stopped = f"n={n} would not fit in memory"
            break
        if last_cost is not None and spent + last_cost * (n / sizes[i - 1]) ** 3 > budget_s:
            peak.stopped = f"n={n} would take over the {budget_s:g} s budget"
            break
        rate, how, last_cost = rate_at(n)
        spent += last_cost
        peak.ladder.append((n, rate))
        gained = peak.flops == 0 or rate > peak.flops * (1 + gain)
        if rate > peak.flops:
            peak.flops, peak.n, peak.how = rate, n, how
        if not gained:
            peak.stopped = f"n={n} gained no more than {gain:.0%}"
            break
    return peak


def free_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def matmul_rate(device: torch.device, dtype: torch.dtype, n: int, reps: int,
                warmup: int) -> tuple[float, str]:
    """FLOP/s of an n x n by n x n matmul in `dtype`, and the entry point that gave it.

    Both GEMM entry points are tried and the faster counts: they can take different kernels
    (on a CPU without bf16 instructions, bf16 `a @ b` takes a slow generic path while
    `F.linear` goes through oneDNN), and the model uses both (nn.Linear forward, matmuls in
    backward and attention).
    """
    gen = torch.Generator(device=device).manual_seed(SEED)
    a = torch.randn(n, n, device=device, generator=gen).to(dtype)
    b = torch.randn(n, n, device=device, generator=gen).to(dtype)
    times = interleaved_medians({"a @ b": lambda: a @ b, "F.linear": lambda: F.linear(a, b)},
                                device, reps, warmup)
    best = min(times, key=times.get)
    return 2 * n**3 / times[best], best


def peak_flops(device: torch.device, dtype: torch.dtype, sizes: Sequence[int], reps: int,
               warmup: int) -> Peak:
    """What this machine's matmuls do at best in `dtype`, now: the fastest size of the ladder."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    available = free_memory(device)

    def rate_at(n: int) -> tuple[float, str, float]:
        start = time.perf_counter()
        rate, how = matmul_rate(device, dtype, n, reps, warmup)
        return rate, how, time.perf_counter() - start

    def fits(n: int) -> bool:  # a, b, both products, and randn's fp32 staging
        return (4 * itemsize + 4) * n * n < PEAK_MEMORY_SHARE * available

    return climb(sizes, rate_at, fits, PEAK_BUDGET_S)


# ----------------------------------------------------------------------------- the step


@dataclass
class Case:
    name: str
    overrides: list[str]
    cfg: Config


@dataclass
class Run:
    """One timed row: a case in a dtype, eager (mode None) or compiled with `mode`."""

    case: Case
    dtype: str
    mode: Optional[str]
    seconds: Optional[float]  # median step; None when torch.compile failed
    why: str = ""

    @property
    def label(self) -> str:
        return "eager" if self.mode is None else f"compiled ({self.mode})"


def model_cases(device: torch.device, quick: bool, base: list[str]) -> list[Case]:
    """The configurations to run, each `base` + its own overrides."""
    arms = [("default", []), ("baby", ["model=baby"])]
    if not quick:
        arms.append(("bigger", BIGGER))
        if device.type == "cuda":
            arms.append(("GPU recipe", [GPU_RECIPE]))
    return [Case(name, base + extra, compose_config(base + extra)) for name, extra in arms]


def flops_per_token(model: GPT) -> int:
    """6 N + 12 n_layer n_embd T, N excluding position embeddings (see the module docstring)."""
    cfg = model.cfg
    n = model.num_params(positions=False)
    return 6 * n + 12 * cfg.n_layer * cfg.n_embd * cfg.block_size


def compiles_by_default(cfg: Config, device: torch.device) -> bool:
    """train.compile's null means: compile on CUDA, not on a CPU (train.py's rule)."""
    return cfg.train.compile if cfg.train.compile is not None else device.type == "cuda"


def build_step(cfg: Config, dtype: torch.dtype, compile_mode: Optional[str],
               device: torch.device) -> Callable[[], None]:
    """One training step of `cfg` on fixed random tokens, as train.py takes it: forward under
    autocast, backward, clipping, the optimizer step."""
    torch.manual_seed(SEED)
    vocab, batch, block = cfg.tokenizer.planned_vocab_size, cfg.train.batch_size, cfg.model.block_size
    model = GPT(cfg.model, vocab, cfg.attention).to(device)
    trust_fused_attention(model, device, dtype)  # as train.py: impl=auto uses a checked kernel
    optimizer = make_optimizer(model, cfg.optim, dtype)
    step_model = model
    if compile_mode is not None:
        # GPT.forward is one code object for every size and dtype: without a reset, dynamo's
        # recompile limit would silently fall back to eager after a few cases.
        torch._dynamo.reset()
        step_model = torch.compile(model, mode=compile_mode)
    amp = autocast(device, dtype)
    clip = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else math.inf
    gen = torch.Generator(device=device).manual_seed(SEED)
    x = torch.randint(0, vocab, (batch, block), device=device, generator=gen)
    y = torch.randint(0, vocab, (batch, block), device=device, generator=gen)

    def step() -> None:
        # as train.py: a new step for CUDA graphs (reduce-overhead), a no-op otherwise
        torch.compiler.cudagraph_mark_step_begin()
        with amp:
            _, loss = step_model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def step_time(cfg: Config, dtype: torch.dtype, compile_mode: Optional[str],
              device: torch.device, reps: int, warmup: int) -> tuple[Optional[float], str]:
    """Median seconds of one training step, eager or compiled with `compile_mode`; (None, why)
    when torch.compile fails."""
    step = build_step(cfg, dtype, compile_mode, device)
    try:
        # compiling happens in the first call(s): reduce-overhead records its graphs on the
        # ones after, so compiled runs get at least two untimed steps
        for _ in range(max(warmup, 2) if compile_mode is not None else warmup):
            step()
        times = [time_once(step, device) for _ in range(reps)]
    except Exception as exc:  # noqa: BLE001 -- any compiler failure means "not available here"
        if compile_mode is None:
            raise
        return None, f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:120]}"
    return statistics.median(times), ""


# ----------------------------------------------------------------------------- main


@dataclass
class TrainStepArgs(BenchArgs):
    # sequences per step for every model (null: each config's train.batch_size; with
    # quick=true, one)
    batch_size: Optional[int] = None
    dtypes: list[str] = field(default_factory=lambda: list(DTYPES))  # fp32, bf16 or both
    compile: bool = True           # the torch.compile rows too (never with quick=true)
    # torch.compile mode of the compiled rows (null: each config's train.compile_mode);
    # reduce-overhead uses CUDA graphs on CUDA
    compile_mode: Optional[str] = None
    # the peak probe's ladder of matmul sizes n (null: by device, smaller with quick=true)
    matmul_sizes: Optional[list[int]] = None


def main(argv: list[str]) -> int:
    return bench_main(argv, TrainStepArgs, "bench.train_step", __doc__, measure_all)


def measure_all(args: TrainStepArgs, overrides: list[str]) -> int:
    check_choices(args, dtypes=DTYPES, compile_mode=(None, *COMPILE_MODES))
    device = setup(args)
    kind = "cuda" if device.type == "cuda" else "cpu"
    if kind == "cuda":
        torch.set_float32_matmul_precision("high")  # as train.py: TF32 for fp32 matmuls
    reps, warmup = resolve_repetitions(args, reps=REPS, quick_reps=QUICK_REPS)
    batch = args.batch_size or (QUICK_BATCH if args.quick else None)
    base = overrides + ([f"train.batch_size={batch}"] if batch else [])
    cases = model_cases(device, args.quick, base)
    default = cases[0].cfg
    sizes = args.matmul_sizes or (QUICK_PEAK_SIZES if args.quick else PEAK_SIZES)[kind]
    eager_only = args.quick or not args.compile
    head_dtype = {v: k for k, v in DTYPES.items()}[pick_dtype(default.train.dtype, device)]
    head_compiled = compiles_by_default(default, device) and not eager_only
    dtypes = list(dict.fromkeys(args.dtypes + [head_dtype]))  # the headline needs its dtype
    unit, unit_name = (1e12, "TFLOP/s") if kind == "cuda" else (1e9, "GFLOP/s")

    print_header(
        "training step (forward + backward + clip + optimizer step): tokens/s and MFU",
        device,
        f"configs composed as train.py would ({' '.join(base) or 'no overrides'} + each "
        f"model's); random tokens; median of {reps} steps after {warmup} warm-up (compiled: "
        f"compilation in the warm-up)",
        "MFU = tokens/s x FLOPs/token / peak; FLOPs/token = 6 N + 12 n_layer n_embd T "
        "(N = params without position embeddings)",
        f"peak = the fastest n x n matmul of the ladder n in {list(sizes)} in the same dtype, "
        f"this run (faster of a @ b and F.linear; climbing stops when a size gains "
        f"<= {PEAK_GAIN:.0%})",
        "models: " + "; ".join(f"{c.name} = {' '.join(c.overrides[len(base):]) or 'defaults'}"
                               for c in cases),
    )
    peaks = {name: peak_flops(device, DTYPES[name], sizes, reps, warmup) for name in dtypes}

    runs = []
    for case in cases:
        modes: list[Optional[str]] = [None]
        if not eager_only:
            modes.append(args.compile_mode or case.cfg.train.compile_mode)
        for name in dtypes:
            for mode in modes:
                seconds, why = step_time(case.cfg, DTYPES[name], mode, device, reps, warmup)
                runs.append(Run(case, name, mode, seconds, why))

    # The machine may have been slower while the ladder ran than during the steps (other jobs
    # on a shared CPU, a GPU still raising its clocks): the peak's size is timed once more and
    # the faster reading counts, so that a slow probe cannot flatter the MFU.
    for name, p in peaks.items():
        p.again, how = matmul_rate(device, DTYPES[name], p.n, reps, warmup)
        if p.again > p.flops:
            p.flops, p.how = p.again, how
        ladder = ", ".join(f"{n}: {rate / unit:.3g}" for n, rate in p.ladder)
        print(f"   peak {name}: {p.flops / unit:.3g} {unit_name} at n={p.n} ({p.how}); "
              f"ladder {ladder} ({p.stopped}); n={p.n} after the steps {p.again / unit:.3g}")

    rows, headline = [], None
    for run in runs:
        cfg, m = run.case.cfg, run.case.cfg.model
        probe = GPT(m, cfg.tokenizer.planned_vocab_size, cfg.attention)
        fpt = flops_per_token(probe)
        row = [run.case.name, f"{m.n_layer}x{m.n_head}x{m.n_embd}",
               fmt(probe.num_params(positions=False) / 1e6, ".2f"), m.block_size,
               cfg.train.batch_size, fmt(fpt / 1e6, ".1f"), run.dtype, run.label]
        if run.seconds is None:
            rows.append(row + ["n/a"] * 4)
            continue
        tok_s = cfg.train.batch_size * m.block_size / run.seconds
        mfu = tok_s * fpt / peaks[run.dtype].flops
        rows.append(row + [fmt(run.seconds * 1e3, ".1f"), fmt(tok_s, ",.0f"),
                           fmt(tok_s * fpt / unit, ".3g"), fmt(100 * mfu, ".1f") + "%"])
        if (run.case is cases[0] and run.dtype == head_dtype
                and (run.mode is not None) == head_compiled):
            headline = mfu
    print_table(["model", "LxHxC", "N (M)", "T", "batch", "MFLOP/tok", "dtype", "mode",
                 "step ms", "tokens/s", unit_name, "MFU"], rows)
    for run in runs:
        if run.seconds is None:
            print(f"n/a: {run.case.name} {run.dtype} {run.label}: {run.why}")
    mode = (f"compiled ({args.compile_mode or default.train.compile_mode})" if head_compiled
            else "eager")
    why = ("" if head_compiled == compiles_by_default(default, device)
           else " (train.py would compile; the compiled rows were not run)")
    print(f"headline: MFU of the default config, {head_dtype} {mode}{why}, as `python train.py` "
          f"runs by default (fraction, not %)")
    if headline is None:
        print("error: the headline's step did not run (torch.compile failed)", file=sys.stderr)
        return 1
    print_headline(headline)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
