"""Our attention implementations vs PyTorch's fused kernel: forward + backward, time and memory.

What does writing attention out by hand cost, and what does fusing it into one kernel buy?

    python -m bench.attention               # fp32, bf16; T in 64..1024 (CPU), 256..2048 (CUDA)
    python -m bench.attention quick=true    # seconds: T in {64, 128}, fewer repetitions
    python -m bench.attention dtypes=fp32 seq_lens=256,512
    python -m bench.attention decode=true   # one KV-cache decode step instead: microseconds

Every arm is the same layer with the same weights -- the qkv Linear, an attention core, the
out_proj Linear -- and only the core differs:

    SDPA (flash)                F.scaled_dot_product_attention(is_causal=True) pinned to one
    SDPA (cuDNN)                backend with torch.nn.attention.sdpa_kernel, one row each: its
    SDPA (efficient)            FlashAttention kernel (on a CPU too), and on CUDA cuDNN's and the
                                memory-efficient one, which differ by up to 2x on the same GPU.
                                A backend that cannot run the shape is skipped, with SDPA's
                                reason. The first that runs (flash) is the oracle and the unit of
                                every ratio.
    ours (reference)            model.attention.CausalSelfAttention itself: explicit scores, mask,
                                softmax, weights @ V, query rows in blocks of attention.query_block.
    ours (fused Triton kernel)  model.fused_attention.fused_causal_attention: one kernel per pass,
                                online softmax, nothing T x T in memory. CUDA with Triton only;
                                elsewhere the run says why it is skipped.

Shapes: the model the device trains by default -- on the CPU the default config (d_k 32), on
CUDA the GPU recipe's (`+experiment=gpu`, d_k 64) -- and a batch of about the same number of
tokens at every T, so the rows differ only in T. bf16 is autocast over fp32 weights, as in
training; fp32 is IEEE fp32 (no TF32), so that the oracle check can be tight.

Each call is timed in two parts, forward (under autocast, building the autograd graph) and
backward, each with a device sync: milliseconds, TFLOP/s (the layer's useful work, the same for
every arm: `layer_flops`) and ratios to SDPA's, forward, backward and the whole.

`decode=true` times what generation runs per layer and token instead: the attention core alone,
one new query over m cached keys (B sequences, the model's heads, no gradient), in microseconds
per call, against the same pinned SDPA backends.

Before any timing, each arm's output and input gradient are compared with SDPA's; beyond the dtype's
tolerance the bench prints its table but exits with status 1 (its timings would compare different
functions). Memory: on CUDA the allocator's peak during forward + backward, and everywhere the bytes
autograd keeps between them (`activation_bytes`), as ratios to SDPA's. Headline: ours (reference) /
SDPA time at T=256 (the GPU recipe's context, and the CPU figure the README has tracked) in the
dtype `python train.py` picks on the device (fp32 on a CPU without bf16 instructions, bf16 on a
recent GPU).
"""
from __future__ import annotations

import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from bench.common import (GPU_RECIPE, MIB, BenchArgs, activation_bytes, compose_config,
                          cuda_peak_bytes, fmt, interleaved_medians, print_header, print_headline,
                          print_table, resolve_repetitions, setup, sync, usage)
from safeio.cli import check_choices, parse_key_values, run_cli
from model.attention import CausalSelfAttention, attention_layer
from model.config import AttentionConfig, AttentionImpl, ModelConfig
from training.device import autocast, pick_dtype

SEQ_LENS = {"cpu": (64, 128, 256, 512, 1024), "cuda": (256, 1024, 2048)}
QUICK_SEQ_LENS = (64, 128)
# batch = tokens // T: the same work per row, only T changes
TOKENS_PER_BATCH = {"cpu": 8192, "cuda": 16384}
QUICK_TOKENS_PER_BATCH = 1024
HEADLINE_T = 256
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Largest |ours - SDPA| allowed, relative to the largest |SDPA output|: fp32 differs only in
# summation order; bf16 rounds every matmul input to 8 mantissa bits (eps = 2^-8 ~ 0.004).
REL_TOL = {"fp32": 1e-4, "bf16": 3e-2}
REFERENCE, FUSED = "ours (reference)", "ours (fused Triton kernel)"
SEED = 0

Core = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def sdpa_backends(device: torch.device) -> dict[str, "SDPBackend"]:
    """SDPA's backends worth a row on this device, by row name, the oracle first."""
    from torch.nn.attention import SDPBackend

    names = {"flash": "FLASH_ATTENTION"}
    if device.type == "cuda":
        names.update({"cuDNN": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION"})
    return {f"SDPA ({name})": getattr(SDPBackend, member) for name, member in names.items()
            if hasattr(SDPBackend, member)}  # an older torch may lack cuDNN's


def sdpa_core(backend, is_causal: bool = True) -> Core:
    """F.scaled_dot_product_attention restricted to one backend: it runs that one or raises."""
    from torch.nn.attention import sdpa_kernel

    def core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
    return core


def layer_flops(B: int, T: int, C: int) -> tuple[float, float]:
    """Useful FLOPs of one layer call, (forward, backward): qkv and out_proj matmuls (8 B T C^2,
    twice that backward) and the causal core (Q K^T and P V over half the T x T pairs,
    2 B T^2 C; backward 2.5x)."""
    projections, core = 8.0 * B * T * C * C, 2.0 * B * T * T * C
    return projections + core, 2 * projections + 2.5 * core


def fused_core(device: torch.device) -> tuple[Optional[Core], str]:
    """The fused Triton kernel when it can be timed here, else (None, why not).

    The module is optional: it may be absent from a checkout, and without Triton it imports but
    cannot run. On a CPU only Triton's interpreter could run it, which checks correctness and
    says nothing about speed.
    """
    if device.type != "cuda":
        return None, "needs a CUDA GPU (on a CPU only Triton's interpreter runs it: not timed)"
    try:
        from model.fused_attention import fused_available, fused_causal_attention
    except ImportError as exc:
        return None, f"model.fused_attention cannot be imported ({exc})"
    if not fused_available(device):
        return None, "Triton is not importable here"
    return fused_causal_attention, ""


class CoreLayer(nn.Module):
    """qkv -> core(q, k, v) on [B, h, T, d_k] heads -> out_proj.

    Parameter names match CausalSelfAttention's (qkv, out_proj), so our layer's state_dict loads
    unchanged: arms are compared weight for weight.
    """

    def __init__(self, n_embd: int, n_head: int, core: Core, bias: bool = True):
        super().__init__()
        self.n_head, self.core = n_head, core
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.out_proj = nn.Linear(n_embd, n_embd, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        h = self.n_head
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, h, C // h).transpose(1, 2) for t in (q, k, v))
        y = self.core(q, k, v)
        return self.out_proj(y.transpose(1, 2).reshape(B, T, C))


class Reference(nn.Module):
    """CausalSelfAttention returns (y, weights); the benchmark only needs y."""

    def __init__(self, layer: CausalSelfAttention):
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)[0]


def build_arms(model: ModelConfig, attn: AttentionConfig, T: int, device: torch.device,
               fused: Optional[Core]) -> dict[str, nn.Module]:
    """SDPA's backends first (the first is the unit), then ours; one set of weights for all."""
    torch.manual_seed(SEED)
    # impl=reference: left to itself (auto) the layer would hand the work to the fused kernel
    reference = replace(attn, impl=AttentionImpl.reference)
    ours = attention_layer(model.n_embd, model.n_head, block_size=T, attn=reference,
                           bias=model.bias).to(device)
    arms = {name: CoreLayer(model.n_embd, model.n_head, sdpa_core(backend), model.bias)
            for name, backend in sdpa_backends(device).items()}
    arms[REFERENCE] = Reference(ours)
    if fused is not None:
        arms[FUSED] = CoreLayer(model.n_embd, model.n_head, fused, model.bias)
    for name, arm in arms.items():
        if name != REFERENCE:
            arm.to(device).load_state_dict(ours.state_dict())
    return arms


def fwd_bwd(module: nn.Module, x: torch.Tensor, grad_out: torch.Tensor,
            dtype: torch.dtype) -> torch.Tensor:
    """One training-style call: forward under autocast, backward of a fixed output gradient."""
    module.zero_grad(set_to_none=True)
    x.grad = None
    with autocast(x.device, dtype):
        y = module(x)
    y.backward(grad_out.to(y.dtype))
    return y


def timed_phases(arms: dict[str, nn.Module], x: torch.Tensor, grad_out: torch.Tensor,
                 dtype: torch.dtype, reps: int, warmup: int) -> dict[str, tuple[float, float]]:
    """Median (forward, backward) seconds of each arm, warm-up excluded.

    As bench.common.interleaved_medians: the arms take turns within each repetition, so that
    the machine's drift affects them alike. Each call syncs the device before the forward,
    between forward and backward, and after the backward.
    """
    device = x.device

    def once(module: nn.Module) -> tuple[float, float]:
        module.zero_grad(set_to_none=True)
        x.grad = None
        sync(device)
        start = time.perf_counter()
        with autocast(device, dtype):
            y = module(x)
        sync(device)
        middle = time.perf_counter()
        y.backward(grad_out if grad_out.dtype == y.dtype else grad_out.to(y.dtype))
        sync(device)
        return middle - start, time.perf_counter() - middle

    for _ in range(warmup):
        for module in arms.values():
            once(module)
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in arms}
    for _ in range(reps):
        for name, module in arms.items():
            samples[name].append(once(module))
    return {name: (statistics.median(f for f, _ in s), statistics.median(b for _, b in s))
            for name, s in samples.items()}


def max_rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|: the error on the scale of the values themselves."""
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def measure(model: ModelConfig, attn: AttentionConfig, T: int, dtype_name: str, tokens: int,
            device: torch.device, reps: int, warmup: int, fused: Optional[Core]) -> list[dict]:
    """One row per arm at this (T, dtype): times, memory and agreement with SDPA."""
    dtype = DTYPES[dtype_name]
    arms = build_arms(model, attn, T, device, fused)
    B = max(1, tokens // T)
    gen = torch.Generator(device=device).manual_seed(SEED)
    x = torch.randn(B, T, model.n_embd, device=device, generator=gen, requires_grad=True)
    grad_out = torch.randn(B, T, model.n_embd, device=device, generator=gen)
    calls = {name: (lambda m=m: fwd_bwd(m, x, grad_out, dtype)) for name, m in arms.items()}

    # 1. the same function? outputs and input gradients, before any timing (this first call
    #    also compiles the Triton kernels, so neither memory nor time pays for it). An SDPA
    #    backend that cannot run this shape raises: it is skipped, with SDPA's reason.
    outputs, failed = {}, []
    for name, call in list(calls.items()):
        try:
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                outputs[name] = (call().detach(), x.grad.clone())
        except Exception as exc:  # noqa: BLE001 -- a failing kernel is reported, the rest timed
            if name == REFERENCE:
                raise
            del calls[name], arms[name]
            why = next((str(w.message) for w in said), "") or str(exc)
            row = {"arm": name, "T": T, "B": B, "dtype": dtype_name, "ok": name != FUSED,
                   "error": f"{type(exc).__name__}: {why.strip().splitlines()[0][:200]}"}
            failed.append(row if name == FUSED else dict(row, skipped=True))
    sdpa = [name for name in outputs if name.startswith("SDPA")]
    if not sdpa:
        raise RuntimeError(f"no SDPA backend runs T={T} {dtype_name} here: "
                           f"{[r['error'] for r in failed]}")
    unit = sdpa[0]
    y_ref, dx_ref = outputs[unit]

    # 2. memory: what autograd keeps for backward (weights and input excluded: every arm holds
    #    them alike), and on CUDA the allocator's peak over a whole forward + backward
    def kept(module: nn.Module) -> int:
        with autocast(device, dtype):
            n_bytes, y = activation_bytes(lambda: module(x),
                                          [x, *module.parameters(), *module.buffers()])
        del y
        return n_bytes

    kept_bytes = {name: kept(m) for name, m in arms.items()}
    peaks = {name: cuda_peak_bytes(call, device) for name, call in calls.items()}

    # 3. time forward and backward, the arms taking turns repetition by repetition
    times = timed_phases(arms, x, grad_out.to(outputs[unit][0].dtype), dtype, reps, warmup)
    flops = layer_flops(B, T, model.n_embd)

    rows = []
    for name in arms:
        y, dx = outputs[name]
        diff_y, diff_dx = max_rel_diff(y, y_ref), max_rel_diff(dx, dx_ref)
        memory = peaks if device.type == "cuda" else kept_bytes
        (fwd, bwd), (unit_fwd, unit_bwd) = times[name], times[unit]
        rows.append({"arm": name, "T": T, "B": B, "dtype": dtype_name, "unit": unit,
                     "s": fwd + bwd, "fwd_s": fwd, "bwd_s": bwd,
                     "fwd_tflops": flops[0] / fwd / 1e12, "bwd_tflops": flops[1] / bwd / 1e12,
                     "ratio": (fwd + bwd) / (unit_fwd + unit_bwd), "fwd_ratio": fwd / unit_fwd,
                     "bwd_ratio": bwd / unit_bwd, "kept": kept_bytes[name],
                     "peak": peaks[name], "mem_ratio": memory[name] / max(memory[unit], 1),
                     "diff_y": diff_y, "diff_dx": diff_dx,
                     "ok": diff_y <= REL_TOL[dtype_name] and diff_dx <= REL_TOL[dtype_name]})
    return rows + failed


DECODE_LENS = {"cpu": (256, 1024), "cuda": (1024, 4096, 8192)}
QUICK_DECODE_LENS = (128,)
DECODE_BATCH = 8
DECODE_CALLS = 50  # calls per timed sample: one is a few microseconds on a GPU


def decode_step_times(model: ModelConfig, m: int, B: int, dtype: torch.dtype,
                      device: torch.device, reps: int, warmup: int,
                      fused: Optional[Core]) -> tuple[dict[str, float], dict[str, float], dict]:
    """Seconds per decode-step call of each core, their largest difference from the first SDPA
    backend that ran, and the backends skipped (name -> why)."""
    from model.attention import scaled_dot_product_attention

    h, d = model.n_head, model.head_dim
    gen = torch.Generator(device=device).manual_seed(SEED)
    q = torch.randn(B, h, 1, d, device=device, dtype=dtype, generator=gen)
    k, v = (torch.randn(B, h, m, d, device=device, dtype=dtype, generator=gen) for _ in "kv")
    # one query at the end of the cache sees every key: no mask (SDPA's is_causal would be
    # top-left aligned and show it key 0 only)
    cores = {name: (lambda core=sdpa_core(backend, is_causal=False): core(q, k, v))
             for name, backend in sdpa_backends(device).items()}
    cores[REFERENCE] = lambda: scaled_dot_product_attention(q, k, v)[0]
    if fused is not None:
        from model.fused_attention import fused_attention_forward
        cores[FUSED] = lambda: fused_attention_forward(q, k, v)[0]
    outputs, skipped = {}, {}
    with torch.no_grad():
        for name, core in list(cores.items()):
            try:
                outputs[name] = core()
            except Exception as exc:  # noqa: BLE001 -- reported, the others timed
                if name == REFERENCE:
                    raise
                skipped[name] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:160]}"
                del cores[name]
        unit = next(name for name in outputs if name.startswith("SDPA"))
        diffs = {name: max_rel_diff(out, outputs[unit]) for name, out in outputs.items()}
        calls = {name: (lambda core=core: [core() for _ in range(DECODE_CALLS)])
                 for name, core in cores.items()}
        times = interleaved_medians(calls, device, reps, warmup)
    return {name: t / DECODE_CALLS for name, t in times.items()}, diffs, skipped


def decode_main(args, device: torch.device, reps: int, warmup: int) -> int:
    kind = "cuda" if device.type == "cuda" else "cpu"
    lens = args.seq_lens or (QUICK_DECODE_LENS if args.quick else DECODE_LENS[kind])
    model, _, which = shapes_config(device)
    dtype_name = {v: k for k, v in DTYPES.items()}[pick_dtype("auto", device)]
    fused, why_not_fused = fused_core(device)
    print_header("one KV-cache decode step (one query over m cached keys, no gradient): "
                 "our attention cores vs F.scaled_dot_product_attention", device,
                 f"shapes of {which}: {model.n_head} heads of d_k {model.head_dim}, batch "
                 f"{DECODE_BATCH}, {dtype_name}; median of {reps} reps of {DECODE_CALLS} calls "
                 f"after {warmup} warm-up", "/SDPA = ratio to the first SDPA backend that ran")
    if fused is None:
        print(f"   skipped: {FUSED}: {why_not_fused}")
    rows, bad, head = [], [], None
    for m in lens:
        times, diffs, skipped = decode_step_times(model, m, DECODE_BATCH, DTYPES[dtype_name],
                                                  device, reps, warmup, fused)
        unit = next(name for name in times if name.startswith("SDPA"))
        for name, seconds in times.items():
            ok = diffs[name] <= REL_TOL[dtype_name]
            bad += [] if ok else [(name, m)]
            rows.append([m, name, fmt(seconds * 1e6, ".1f"), fmt(seconds / times[unit], ".2f"),
                         fmt(diffs[name], ".1e"), "yes" if ok else "NO"])
        for name, why in skipped.items():
            print(f"skipped: {name} m={m}: {why}")
        ours = FUSED if FUSED in times else REFERENCE
        head = (ours, unit, m, times[ours] / times[unit])
    print_table(["m", "attention", "us/call", "time/SDPA", "|dy|", "match"], rows)
    if bad:
        print(f"error: these disagree with SDPA beyond tolerance: {bad}", file=sys.stderr)
    print(f"headline: {head[0]} / {head[1]} time per decode step at m={head[2]}")
    print_headline(head[3])
    return 1 if bad else 0


def shapes_config(device: torch.device) -> tuple[ModelConfig, AttentionConfig, str]:
    """The model whose attention is measured: the one this device trains by default."""
    if device.type != "cuda":
        cfg = compose_config()
        return cfg.model, cfg.attention, "the default config"
    cfg = compose_config([GPU_RECIPE])
    return cfg.model, cfg.attention, f"the GPU recipe ({GPU_RECIPE})"


@dataclass
class AttentionArgs(BenchArgs):
    # sequence lengths T, or with decode=true the cache lengths m (null: by device, fewer with
    # quick=true)
    seq_lens: Optional[list[int]] = None
    dtypes: list[str] = field(default_factory=lambda: list(DTYPES))  # fp32, bf16 or both
    # tokens per batch, B = tokens // T (null: by device, fewer with quick=true)
    tokens: Optional[int] = None
    # our layer's attention.query_block (0: every row over every key; null: the config's)
    query_block: Optional[int] = None
    decode: bool = False           # time one KV-cache decode step of the attention core instead


def main(argv: list[str]) -> int:
    def body() -> int:
        args = parse_key_values(argv, AttentionArgs, usage("bench.attention", overrides=False),
                                about=__doc__.split("\n\n")[0])
        check_choices(args, dtypes=DTYPES)
        return measure_all(args)
    return run_cli(body)


def measure_all(args: AttentionArgs) -> int:
    device = setup(args)
    reps, warmup = resolve_repetitions(args)
    if args.decode:
        return decode_main(args, device, reps, warmup)
    kind = "cuda" if device.type == "cuda" else "cpu"
    seq_lens = args.seq_lens or (QUICK_SEQ_LENS if args.quick else SEQ_LENS[kind])
    tokens = args.tokens or (QUICK_TOKENS_PER_BATCH if args.quick else TOKENS_PER_BATCH[kind])
    model, attn, which = shapes_config(device)
    if args.query_block is not None:
        attn.query_block = args.query_block
    fused, why_not_fused = fused_core(device)

    cuda = device.type == "cuda"
    print_header(
        "causal self-attention, forward + backward: our implementations vs "
        "F.scaled_dot_product_attention",
        device,
        f"shapes of {which}: d_model {model.n_embd}, {model.n_head} heads (d_k "
        f"{model.head_dim}); batch = {tokens} // T; our layer's attention.query_block "
        f"{'null (by device)' if attn.query_block is None else attn.query_block}",
        f"bf16 = autocast (fp32 weights); median of {reps} reps after {warmup} warm-up",
        ("mem = CUDA max_memory_allocated during forward + backward, above the baseline"
         if cuda else "mem = bytes kept for backward (saved tensors; weights and input excluded)"),
        f"|dy|, |dx| = max |arm - SDPA| / max |SDPA| (tolerance fp32 {REL_TOL['fp32']:g}, "
        f"bf16 {REL_TOL['bf16']:g}); /SDPA = ratio to the first SDPA row that ran "
        f"({next(iter(sdpa_backends(device)))}), forward, backward and both",
        "SDPA rows are pinned to one backend each (torch.nn.attention.sdpa_kernel): a row is "
        "the backend it names, or skipped; TFLOP/s = the layer's useful FLOPs / time",
    )
    if fused is None:
        print(f"   skipped: {FUSED}: {why_not_fused}")
    results = [row for name in args.dtypes for T in seq_lens
               for row in measure(model, attn, T, name, tokens, device, reps, warmup, fused)]

    headers = ["dtype", "T", "B", "attention", "fwd ms", "bwd ms", "fwd TFLOP/s",
               "bwd TFLOP/s", "time/SDPA", "fwd/SDPA", "bwd/SDPA", "mem MiB", "mem/SDPA"]
    headers += ["kept MiB"] if cuda else []
    headers += ["|dy|", "|dx|", "match"]

    def scaled(value: Optional[float], by: float) -> Optional[float]:
        return None if value is None else value * by

    rows = []
    for r in results:
        if r.get("skipped"):
            continue
        r = {key: None for key in ("fwd_s", "bwd_s", "fwd_tflops", "bwd_tflops", "ratio",
                                   "fwd_ratio", "bwd_ratio", "peak", "kept", "mem_ratio",
                                   "diff_y", "diff_dx")} | r  # a failed arm has no figures
        mem = r["peak"] if cuda else r["kept"]
        row = [r["dtype"], r["T"], r["B"], r["arm"], fmt(scaled(r["fwd_s"], 1e3), ".2f"),
               fmt(scaled(r["bwd_s"], 1e3), ".2f"), fmt(r["fwd_tflops"], ".3g"),
               fmt(r["bwd_tflops"], ".3g"), fmt(r["ratio"], ".2f"), fmt(r["fwd_ratio"], ".2f"),
               fmt(r["bwd_ratio"], ".2f"), fmt(scaled(mem, 1 / MIB), ".1f"),
               fmt(r["mem_ratio"], ".2f")]
        row += [fmt(scaled(r["kept"], 1 / MIB), ".1f")] if cuda else []
        row += [fmt(r["diff_y"], ".1e"), fmt(r["diff_dx"], ".1e"),
                "FAILED" if "error" in r else "yes" if r["ok"] else "NO"]
        rows.append(row)
    print_table(headers, rows)
    ran = sorted({r["arm"] for r in results if r["arm"].startswith("SDPA") and "error" not in r},
                 key=list(sdpa_backends(device)).index)
    print(f"SDPA backends that ran: {', '.join(ran)}")
    for r in results:
        if r.get("skipped"):
            print(f"skipped: {r['arm']} {r['dtype']} T={r['T']}: {r['error']}")
        elif "error" in r:
            print(f"FAILED: {r['arm']} {r['dtype']} T={r['T']}: {r['error']}")

    mismatched = [r for r in results if not r["ok"]]
    if mismatched:
        print(f"error: these failed or disagree with SDPA beyond tolerance: "
              f"{[(r['arm'], r['dtype'], r['T']) for r in mismatched]}; a timing is only "
              f"meaningful for the same function", file=sys.stderr)
    auto = {v: k for k, v in DTYPES.items()}[pick_dtype("auto", device)]
    headline_dtype = auto if auto in args.dtypes else args.dtypes[0]
    candidates = [r for r in results if r["dtype"] == headline_dtype and r["arm"] == REFERENCE]
    head = next((r for r in candidates if r["T"] == HEADLINE_T), None)
    if head is None:
        head = max(candidates, key=lambda r: r["T"])
        print(f"headline: {REFERENCE} / {head['unit']} time at T={head['T']} {headline_dtype} "
              f"(T={HEADLINE_T} was not run; this is the largest T of this run)")
    else:
        print(f"headline: {REFERENCE} / {head['unit']} time at T={HEADLINE_T} {headline_dtype}")
    print_headline(head["ratio"])
    return 1 if mismatched else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
