"""How much of the machine does a training step use? Tokens/s and model FLOPs utilisation.

    python bench/train_step.py            # 3 model sizes x {fp32, bf16} x {eager, compiled}
    python bench/train_step.py --quick    # seconds: 2 sizes, small batch, eager only

One step is what train.py does per batch: forward under autocast, backward, gradient clipping,
optimizer step (the default Muon + AdamW; random tokens over the default BPE vocabulary of 4,096). MFU is the model's
useful FLOPs per second over the machine's peak, and the peak is *measured in the same run* by a
large square matmul of the same dtype (2 n^3 FLOPs), so the figure is comparable between
machines without trusting a datasheet, and is an upper bound rather than a spec-sheet number.

Model FLOPs per token (nanoGPT's estimate, after the PaLM paper, appendix B):
    6 N + 12 n_layer n_embd T
N = parameters other than the position embeddings (the token embedding is counted: it is also
the tied LM head, a real matmul); 6 = 2 (multiply-add) x 3 (forward, and backward twice as
much); the second term is the QK^T and weights @ V matmuls over the full T x T (causal masking
not discounted). Headline: MFU of the default config (conf/model/small.yaml) in the dtype and
mode `python train.py` uses by default (auto dtype, no compile).
"""
from __future__ import annotations

import sys
from pathlib import Path

# `python bench/train_step.py` puts bench/ first on sys.path, where bench/data.py would shadow
# the project's `data` package: put the repository root there instead.
_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [str(_ROOT)] + [p for p in sys.path
                              if Path(p or ".").resolve() not in (_ROOT, _ROOT / "bench")]

import statistics  # noqa: E402
from dataclasses import dataclass, replace  # noqa: E402
from typing import Optional  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from bench.common import (REPO_ROOT, fmt, interleaved_medians, make_parser,  # noqa: E402
                          print_header, print_headline, print_table, resolve_repetitions, setup,
                          time_once)
from model.config import ModelConfig  # noqa: E402
from model.gpt import GPT  # noqa: E402
from training.config import OptimConfig, OptimizerName, TrainConfig  # noqa: E402
from training.device import autocast, pick_dtype  # noqa: E402
from training.optim import make_optimizer  # noqa: E402

VOCAB_SIZE = 4096             # the default tokenizer, conf/tokenizer/bpe.yaml
DEFAULT_MODEL = "small"       # conf/config.yaml's model group default
BIGGER = {"n_layer": 6, "n_head": 8, "n_embd": 256}   # on top of the default config
QUICK_BATCH = 1               # --quick: runs every code path; bf16 is slow on most CPUs
MATMUL_N = 2048               # peak probe: n x n @ n x n, 2 n^3 FLOPs
QUICK_MATMUL_N = 512
REPS, QUICK_REPS = 5, 2       # training steps are long: fewer repetitions than the default
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SEED = 0


@dataclass
class Case:
    name: str
    cfg: ModelConfig


def load_model_config(name: str) -> ModelConfig:
    """conf/model/<name>.yaml merged into the schema, as Hydra would do for train.py."""
    merged = OmegaConf.merge(OmegaConf.structured(ModelConfig),
                             OmegaConf.load(REPO_ROOT / "conf" / "model" / f"{name}.yaml"))
    return OmegaConf.to_object(merged)


def model_cases(quick: bool) -> list[Case]:
    small = load_model_config(DEFAULT_MODEL)
    cases = [Case(f"{DEFAULT_MODEL} (default)", small), Case("baby", load_model_config("baby"))]
    if not quick:
        label = "bigger (" + ", ".join(f"{k} {v}" for k, v in BIGGER.items()) + ")"
        cases.append(Case(label, replace(small, **BIGGER)))
    return cases


def flops_per_token(model: GPT, cfg: ModelConfig) -> int:
    """6 N + 12 n_layer n_embd T, N excluding position embeddings (see the module docstring)."""
    n = model.num_params(include_embeddings=False)
    return 6 * n + 12 * cfg.n_layer * cfg.n_embd * cfg.block_size


def peak_flops(device: torch.device, dtype: torch.dtype, n: int, reps: int,
               warmup: int) -> tuple[float, str]:
    """FLOP/s of an n x n by n x n matmul in `dtype`: what this machine can do at best, now.

    Both GEMM entry points are tried and the faster one counts: they can take different
    kernels (on a CPU without bf16 instructions, bf16 `a @ b` takes a slow generic path while
    `F.linear` goes through oneDNN and is ~10x faster), and the model uses both (nn.Linear
    forward, matmuls in backward and attention). Returns (FLOP/s, the entry point's name).
    """
    gen = torch.Generator(device=device).manual_seed(SEED)
    a = torch.randn(n, n, device=device, generator=gen).to(dtype)
    b = torch.randn(n, n, device=device, generator=gen).to(dtype)
    times = interleaved_medians({"a @ b": lambda: a @ b, "F.linear": lambda: F.linear(a, b)},
                                device, reps, warmup)
    best = min(times, key=times.get)
    return 2 * n**3 / times[best], best


def step_time(case: Case, dtype: torch.dtype, compile_model: bool, batch: int,
              device: torch.device, reps: int, warmup: int) -> tuple[Optional[float], str]:
    """Median seconds of one training step, or (None, why) when torch.compile fails."""
    torch.manual_seed(SEED)
    model = GPT(case.cfg, VOCAB_SIZE).to(device)
    optim_cfg = OptimConfig(name=OptimizerName.muon)  # conf/config.yaml's default optim group
    optimizer = make_optimizer(model, optim_cfg)
    if compile_model:
        # GPT.forward is one code object for every size and dtype: without a reset, dynamo's
        # recompile limit would silently fall back to eager after a few cases.
        torch._dynamo.reset()
    step_model = torch.compile(model) if compile_model else model
    amp = autocast(device, dtype)
    gen = torch.Generator(device=device).manual_seed(SEED)
    x = torch.randint(0, VOCAB_SIZE, (batch, case.cfg.block_size), device=device, generator=gen)
    y = torch.randint(0, VOCAB_SIZE, (batch, case.cfg.block_size), device=device, generator=gen)

    def step() -> None:
        with amp:
            _, loss = step_model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), optim_cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    try:
        for _ in range(max(warmup, 1) if compile_model else warmup):  # compiling = first call
            step()
        times = [time_once(step, device) for _ in range(reps)]
    except Exception as exc:  # noqa: BLE001 -- any compiler failure means "not available here"
        if not compile_model:
            raise
        return None, f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:120]}"
    return statistics.median(times), ""


def main() -> int:
    parser = make_parser(__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=None,
                        help=f"sequences per step (default: train.batch_size = "
                             f"{TrainConfig().batch_size}, --quick {QUICK_BATCH})")
    parser.add_argument("--matmul-n", type=int, default=None,
                        help=f"size of the peak-FLOPs matmul (default {MATMUL_N}, "
                             f"--quick {QUICK_MATMUL_N})")
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=list(DTYPES))
    parser.add_argument("--no-compile", action="store_true",
                        help="skip the torch.compile rows (always skipped with --quick)")
    args = parser.parse_args()
    device = setup(args)
    reps, warmup = resolve_repetitions(args, reps=REPS, quick_reps=QUICK_REPS)
    batch = args.batch_size or (QUICK_BATCH if args.quick else TrainConfig().batch_size)
    matmul_n = args.matmul_n or (QUICK_MATMUL_N if args.quick else MATMUL_N)
    compile_modes = [False] if (args.quick or args.no_compile) else [False, True]
    default_dtype = {v: k for k, v in DTYPES.items()}[pick_dtype("auto", device)]
    dtypes = list(dict.fromkeys(args.dtypes + [default_dtype]))  # the headline needs its dtype

    print_header(
        "training step (forward + backward + clip + optimizer step): tokens/s and MFU",
        device,
        f"batch {batch} x block_size, vocab {VOCAB_SIZE}, random tokens; median of {reps} steps "
        f"after {warmup} warm-up (compiled: compilation in the warm-up)",
        "MFU = tokens/s x FLOPs/token / peak; FLOPs/token = 6 N + 12 n_layer n_embd T "
        "(N = params without position embeddings)",
        f"peak = median FLOP/s of a {matmul_n}x{matmul_n} matmul in the same dtype, this run "
        f"(faster of a @ b and F.linear)",
    )
    probes = {name: peak_flops(device, DTYPES[name], matmul_n, reps, warmup) for name in dtypes}
    peaks = {name: flops for name, (flops, _) in probes.items()}
    print("   peak: " + ", ".join(f"{name} {flops / 1e9:.1f} GFLOP/s ({how})"
                                  for name, (flops, how) in probes.items()))

    rows, failures, headline = [], [], None
    for case in model_cases(args.quick):
        probe = GPT(case.cfg, VOCAB_SIZE)
        fpt = flops_per_token(probe, case.cfg)
        n_params = probe.num_params(include_embeddings=False)
        tokens = batch * case.cfg.block_size
        for name in dtypes:
            for compiled in compile_modes:
                seconds, why = step_time(case, DTYPES[name], compiled, batch, device, reps, warmup)
                mode = "compiled" if compiled else "eager"
                if seconds is None:
                    failures.append(f"{case.name} {name} compiled: {why}")
                    rows.append([case.name, fmt(n_params / 1e6, ".2f"), case.cfg.block_size,
                                 fmt(fpt / 1e6, ".1f"), name, mode, "n/a", "n/a", "n/a", "n/a"])
                    continue
                tok_s = tokens / seconds
                mfu = tok_s * fpt / peaks[name]
                rows.append([case.name, fmt(n_params / 1e6, ".2f"), case.cfg.block_size,
                             fmt(fpt / 1e6, ".1f"), name, mode, fmt(seconds * 1e3, ".1f"),
                             fmt(tok_s, ",.0f"), fmt(tok_s * fpt / 1e9, ".2f"),
                             fmt(100 * mfu, ".1f") + "%"])
                if case.name.startswith(DEFAULT_MODEL) and name == default_dtype and not compiled:
                    headline = mfu
    print_table(["model", "N (M)", "T", "MFLOP/tok", "dtype", "mode", "step ms", "tokens/s",
                 "GFLOP/s", "MFU"], rows)
    for line in failures:
        print(f"n/a: {line}")
    print(f"headline: MFU of the default config ({DEFAULT_MODEL}), {default_dtype} eager, "
          f"as `python train.py` runs by default (fraction, not %)")
    print_headline(headline)
    return 0


if __name__ == "__main__":
    sys.exit(main())
