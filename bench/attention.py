"""How much does writing attention out by hand cost? Our layer vs PyTorch's fused kernel.

    python bench/attention.py            # T in 64..1024, fp32 and bf16
    python bench/attention.py --quick    # seconds: T in {64, 128}, fewer repetitions

Times forward + backward of `model.attention.CausalSelfAttention` (explicit scores, mask,
softmax, weights @ V) against an oracle with the *same weights* and the same qkv / out_proj
Linears whose core is `F.scaled_dot_product_attention(q, k, v, is_causal=True)` (flash or
memory-efficient kernels, which never materialise the T x T weights). The batch is sized so that
every T processes about the same number of tokens, so the rows differ only in T.

Memory: "activation memory" is what autograd keeps between forward and backward (counted with
saved_tensors_hooks, works on CPU too); on CUDA the allocator's peak is reported as well.
Outputs and input gradients are compared first, so the two layers are shown to compute the same
function. Headline: ours / oracle time at T=256 in fp32 (the largest T run, with --quick).
"""
from __future__ import annotations

import sys
from pathlib import Path

# `python bench/attention.py` puts bench/ first on sys.path, where bench/data.py would shadow
# the project's `data` package: put the repository root there instead.
_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [str(_ROOT)] + [p for p in sys.path
                              if Path(p or ".").resolve() not in (_ROOT, _ROOT / "bench")]

import contextlib  # noqa: E402

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.common import (MIB, activation_bytes, cuda_peak_bytes, fmt,  # noqa: E402
                          interleaved_medians, make_parser, print_header, print_headline,
                          print_table, resolve_repetitions, setup)
from model.attention import CausalSelfAttention  # noqa: E402
from model.config import AttentionConfig  # noqa: E402

D_MODEL = 128              # the default model's width (conf/model/small.yaml)
N_HEAD = 4
TOKENS_PER_BATCH = 8192    # batch = tokens // T: same work per row, only T changes
QUICK_TOKENS_PER_BATCH = 1024
SEQ_LENS = (64, 128, 256, 512, 1024)
QUICK_SEQ_LENS = (64, 128)
HEADLINE_T = 256
HEADLINE_DTYPE = "fp32"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Largest |ours - oracle| allowed, relative to the largest |oracle output|: fp32 differs only
# in summation order; bf16 rounds every matmul input to 8 mantissa bits (eps = 2^-8 ~ 0.004).
REL_TOL = {"fp32": 1e-4, "bf16": 3e-2}
SEED = 0


class OracleAttention(nn.Module):
    """The same layer with PyTorch's fused causal attention in the middle.

    Parameter names match CausalSelfAttention's (qkv, out_proj), so our layer's state_dict
    loads into it unchanged: the comparison is weight for weight.
    """

    def __init__(self, n_embd: int, n_head: int, bias: bool = True):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.out_proj = nn.Linear(n_embd, n_embd, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        h = self.n_head
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, h, C // h).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out_proj(y.transpose(1, 2).reshape(B, T, C))


class Ours(nn.Module):
    """CausalSelfAttention returns (y, weights); the benchmark only needs y."""

    def __init__(self, layer: CausalSelfAttention):
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)[0]


def build_pair(T: int, device: torch.device, query_block: int) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(SEED)
    ours = CausalSelfAttention(D_MODEL, N_HEAD, block_size=T,
                               attn=AttentionConfig(query_block=query_block)).to(device)
    oracle = OracleAttention(D_MODEL, N_HEAD).to(device)
    oracle.load_state_dict(ours.state_dict())
    return Ours(ours), oracle


def amp(device: torch.device, dtype: torch.dtype):
    """bf16 the way training runs it: autocast, weights kept in fp32."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def fwd_bwd(module: nn.Module, x: torch.Tensor, grad_out: torch.Tensor, device, dtype):
    """One training-style call: forward under autocast, backward of a fixed output gradient."""
    module.zero_grad(set_to_none=True)
    x.grad = None
    with amp(device, dtype):
        y = module(x)
    y.backward(grad_out.to(y.dtype))
    return y


def max_rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|: the error on the scale of the values themselves."""
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def measure(T: int, dtype_name: str, tokens: int, device: torch.device, reps: int,
            warmup: int, query_block: int) -> dict:
    dtype = DTYPES[dtype_name]
    ours, oracle = build_pair(T, device, query_block)
    B = max(1, tokens // T)
    gen = torch.Generator(device=device).manual_seed(SEED)
    x = torch.randn(B, T, D_MODEL, device=device, generator=gen, requires_grad=True)
    grad_out = torch.randn(B, T, D_MODEL, device=device, generator=gen)

    # 1. same function? outputs and input gradients, before any timing
    y_ours = fwd_bwd(ours, x, grad_out, device, dtype).detach()
    dx_ours = x.grad.clone()
    y_oracle = fwd_bwd(oracle, x, grad_out, device, dtype).detach()
    dx_oracle = x.grad.clone()
    diff_y, diff_dx = max_rel_diff(y_ours, y_oracle), max_rel_diff(dx_ours, dx_oracle)

    # 2. memory kept for backward (weights and the input excluded: both layers hold them alike)
    def kept(module: nn.Module) -> int:
        exclude = [x, *module.parameters(), *module.buffers()]
        with amp(device, dtype):
            n_bytes, y = activation_bytes(lambda: module(x), exclude)
        del y
        return n_bytes

    peaks = {name: cuda_peak_bytes(lambda m=m: fwd_bwd(m, x, grad_out, device, dtype), device)
             for name, m in (("ours", ours), ("oracle", oracle))}

    # 3. time, alternating the two layers repetition by repetition
    times = interleaved_medians({"ours": lambda: fwd_bwd(ours, x, grad_out, device, dtype),
                                 "oracle": lambda: fwd_bwd(oracle, x, grad_out, device, dtype)},
                                device, reps, warmup)
    return {"T": T, "B": B, "dtype": dtype_name, "ours_s": times["ours"],
            "oracle_s": times["oracle"], "ratio": times["ours"] / times["oracle"],
            "act_ours": kept(ours), "act_oracle": kept(oracle), "peak_ours": peaks["ours"],
            "peak_oracle": peaks["oracle"], "diff_y": diff_y, "diff_dx": diff_dx,
            "ok": diff_y <= REL_TOL[dtype_name] and diff_dx <= REL_TOL[dtype_name]}


def main() -> int:
    parser = make_parser(__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=None,
                        help=f"sequence lengths T (default {list(SEQ_LENS)}, "
                             f"--quick {list(QUICK_SEQ_LENS)})")
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=list(DTYPES))
    parser.add_argument("--tokens", type=int, default=None,
                        help=f"tokens per batch, B = tokens // T (default {TOKENS_PER_BATCH}, "
                             f"--quick {QUICK_TOKENS_PER_BATCH})")
    parser.add_argument("--query-block", type=int, default=AttentionConfig.query_block,
                        help="our layer's attention.query_block (0: every row over every key; "
                             f"default {AttentionConfig.query_block})")
    args = parser.parse_args()
    device = setup(args)
    reps, warmup = resolve_repetitions(args)
    seq_lens = args.seq_lens or (QUICK_SEQ_LENS if args.quick else SEQ_LENS)
    tokens = args.tokens or (QUICK_TOKENS_PER_BATCH if args.quick else TOKENS_PER_BATCH)

    cuda = device.type == "cuda"
    print_header(
        "causal self-attention, forward + backward: ours vs F.scaled_dot_product_attention",
        device,
        f"d_model {D_MODEL}, {N_HEAD} heads, batch = {tokens} // T, query_block "
        f"{args.query_block}; bf16 = autocast "
        f"(fp32 weights); median of {reps} reps after {warmup} warm-up",
        "act = bytes kept for backward (saved tensors, weights/input excluded)"
        + ("; peak = CUDA max_memory_allocated above baseline" if cuda else
           "; CPU has no peak counter, see act"),
        f"|dy|, |dx| = max |ours - oracle| / max |oracle| (tolerance fp32 {REL_TOL['fp32']:g}, "
        f"bf16 {REL_TOL['bf16']:g})",
    )
    results = [measure(T, name, tokens, device, reps, warmup, args.query_block)
               for name in args.dtypes for T in seq_lens]

    headers = ["dtype", "T", "B", "ours ms", "oracle ms", "ours/oracle", "act ours MiB",
               "act oracle MiB"] + (["peak ours MiB", "peak oracle MiB"] if cuda else []) + [
               "|dy|", "|dx|", "match"]
    rows = []
    for r in results:
        row = [r["dtype"], r["T"], r["B"], fmt(r["ours_s"] * 1e3, ".1f"),
               fmt(r["oracle_s"] * 1e3, ".1f"),
               fmt(r["ratio"], ".2f"), fmt(r["act_ours"] / MIB, ".1f"),
               fmt(r["act_oracle"] / MIB, ".1f")]
        if cuda:
            row += [fmt(r["peak_ours"] / MIB, ".1f"), fmt(r["peak_oracle"] / MIB, ".1f")]
        row += [fmt(r["diff_y"], ".1e"), fmt(r["diff_dx"], ".1e"), "yes" if r["ok"] else "NO"]
        rows.append(row)
    print_table(headers, rows)

    mismatched = [r for r in results if not r["ok"]]
    if mismatched:
        print(f"error: ours and the oracle disagree beyond tolerance at "
              f"{[(r['dtype'], r['T']) for r in mismatched]}: the timings compare different "
              f"functions", file=sys.stderr)
    headline_dtype = HEADLINE_DTYPE if HEADLINE_DTYPE in args.dtypes else args.dtypes[0]
    candidates = [r for r in results if r["dtype"] == headline_dtype]
    head = next((r for r in candidates if r["T"] == HEADLINE_T), None)
    if head is None:
        head = max(candidates, key=lambda r: r["T"])
        print(f"headline: ours/oracle time at T={head['T']} {headline_dtype} "
              f"(T={HEADLINE_T} was not run; this is the largest T of this run)")
    else:
        print(f"headline: ours/oracle time at T={HEADLINE_T} {headline_dtype}")
    print_headline(head["ratio"])
    return 1 if mismatched else 0


if __name__ == "__main__":
    sys.exit(main())
