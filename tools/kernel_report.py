"""What each fused attention kernel uses on a GPU, found by compiling it for the GPU on the CPU.

The kernels are compiled for named NVIDIA GPUs on any machine (no GPU needed), and for each
launch the report prints shared memory, registers, spills and tensor-core instructions:

    python -m tools.kernel_report                      # sm_80 and sm_90, every variant
    python -m tools.kernel_report targets=sm_90 dtypes=bf16 head_dims=64,128
    python -m tools.kernel_report check=true           # exit 1 if a variant breaks a rule
    python -m tools.kernel_report json=true            # one JSON object per variant
    python -m tools.kernel_report launch=ragged,decode dtypes=bf16   # other launches
    python -m tools.kernel_report kernels=dkdv dtypes=fp32 tiles=16x32/4w1s  # try tiles
    python -m tools.kernel_report device=cuda          # on a GPU: what its launches compiled

One row per kernel (fwd, dkdv, dq and the backward's delta pass) x dtype (tf32: fp32 with
allow_tf32) x head size x target, with the tiles `model.fused_attention.default_tiles` picks and
the launch's constexprs (`launch_constants`), compiled by `triton.compile` for a `GPUTarget`.
Arguments are specialised as a training launch's are (`launch=train`: 16-byte alignment, sizes
multiple of 16); `launch=ragged` has lengths that are not, `launch=decode` is generation's
one-query forward. `kv_group` is never specialised: one variant serves GQA and MHA alike.
The rules (`check=true`) are docs/fused_attention.md's. Every variant is compiled afresh, in a
cache of its own deleted afterwards, since a cached kernel comes without ptxas's report.

`device=cuda` (on a machine with a GPU) launches the kernels forward and backward for each
dtype and head size instead, reads the compiled objects Triton made for that GPU (registers,
local memory, shared memory, as the driver reports them), and prints them next to the CPU's
prediction for the same compute capability: what tools/gpu_checks.sh records.
"""
from __future__ import annotations

import contextlib
import io
import json
import multiprocessing
import os
import re
import sys
import tempfile
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Optional

from safeio.cli import UserError, check_choices, parse_key_values, run_cli


@dataclass(frozen=True)
class Target:
    capability: int       # compute capability x 10, as GPUTarget takes it
    smem_limit: int       # largest dynamic shared memory per block (opt-in), bytes
    gpus: str


# The sm_80 build stands for all of compute capability 8.x, which shares its code path and its
# tiles: so it must fit the family's smallest limit, 99 KB (8.6: A10, A40, RTX 30xx; 8.9: L4,
# L40, RTX 40xx), not only A100's 163 KB. Figures: CUDA C Programming Guide, "Compute
# Capabilities", maximum shared memory per thread block.
TARGETS = {
    "sm_80": Target(80, 99 * 1024, "compute capability 8.x: A100 (163 KB), 8.6 / 8.9 (99 KB)"),
    "sm_90": Target(90, 227 * 1024, "compute capability 9.0: H100, H200 (227 KB)"),
}
DTYPE_NAMES = ("fp16", "bf16", "tf32", "fp32", "fp64")
KERNELS = ("fwd", "dkdv", "dq", "delta")
LAUNCHES = ("train", "ragged", "decode")
TENSOR_CORE_DTYPES = ("fp16", "bf16", "tf32")
SEQ_LEN = 1 << 16  # long enough that no tile is shrunk to the sequence


@dataclass(frozen=True)
class Variant:
    kernel: str
    dtype: str
    head_dim: int
    target: str
    tiles: Optional[str] = None  # "BMxBN/Ww/Ss" instead of the default tiles
    launch: str = "train"        # one of LAUNCHES


def parse_tiles(text: str):
    """"32x64/8w2s" -> Tiles(32, 64, 8, 2)."""
    from model.fused_attention import Tiles
    match = re.fullmatch(r"(\d+)x(\d+)/(\d+)w(\d+)s", text)
    if match is None:
        raise UserError(f"tiles look like 32x64/8w2s (BLOCK_M x BLOCK_N / "
                        f"warps / stages), not {text!r}")
    return Tiles(*map(int, match.groups()))


@dataclass
class Row:
    kernel: str
    dtype: str
    head_dim: int
    target: str
    launch: str = "train"
    tiles: str = ""           # BLOCK_M x BLOCK_N / warps / stages
    shared: int = 0           # bytes of shared memory per block
    smem_limit: int = 0
    registers: int = 0        # per thread
    spill_stores: int = 0     # bytes
    spill_loads: int = 0
    tensor_cores: str = ""    # "wgmma", "mma" or "" (FMA)
    kv_group: str = ""        # how the kernel's kv_group argument was typed ("i32": any group)
    seconds: float = 0.0
    error: str = ""

    def problems(self) -> list[str]:
        """The rules this variant breaks (none: it may ship)."""
        if self.error:
            return [f"does not compile: {self.error}"]
        found = []
        if self.shared > self.smem_limit:
            found.append(f"shared memory {self.shared:,} B over the limit {self.smem_limit:,} B")
        if self.spill_stores or self.spill_loads:
            found.append(f"spills {self.spill_stores} B stores / {self.spill_loads} B loads")
        if self.dtype in TENSOR_CORE_DTYPES and self.kernel != "delta" and not self.tensor_cores:
            found.append("no tensor-core instructions (mma / wgmma) in its PTX")
        if self.kernel != "delta" and self.kv_group not in ("i32", "i64"):
            found.append(f"kv_group specialised as {self.kv_group}: one group size only")
        return found


def _torch_dtype(name: str):
    import torch
    return {"fp16": torch.float16, "bf16": torch.bfloat16, "tf32": torch.float32,
            "fp32": torch.float32, "fp64": torch.float64}[name]


def _signature(kernel, constants: dict, dtype_name: str, launch: str) -> tuple[dict, dict]:
    """Triton's signature and alignment attributes for a `launch` of `kernel`.

    By the kernels' naming: upper-case arguments are pointers (LSE and DELTA to the
    accumulator dtype), `scale` arguments fp32, every other one an i32; pointers and strides
    are marked divisible by 16, as Triton marks them at a launch where they are, and so are the
    lengths n_q and n_k of a training launch.
    """
    element = {"fp16": "fp16", "bf16": "bf16", "tf32": "fp32", "fp32": "fp32", "fp64": "fp64"}
    accumulator = "fp64" if dtype_name == "fp64" else "fp32"
    signature, attrs = {}, {}
    aligned = [["tt.divisibility", 16]]
    for i, name in enumerate(kernel.arg_names):
        if name in constants:
            signature[name] = "constexpr"
        elif name in ("LSE", "DELTA"):
            signature[name], attrs[(i,)] = "*" + accumulator, aligned
        elif name.isupper():
            signature[name], attrs[(i,)] = "*" + element[dtype_name], aligned
        elif "scale" in name:
            signature[name] = "fp32"
        elif name in getattr(kernel, "do_not_specialize", ()) or \
                i in getattr(kernel, "do_not_specialize", ()):
            signature[name] = "i32"
        elif name in ("n_q", "n_k") and launch != "train":
            signature[name] = "i32"
        else:
            signature[name], attrs[(i,)] = "i32", aligned
    return signature, attrs


def compile_variant(variant: Variant) -> Row:
    """Compile one variant for its target and read what it uses."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import model.fused_attention as fa

    row = Row(variant.kernel, variant.dtype, variant.head_dim, variant.target, variant.launch)
    target = TARGETS[variant.target]
    row.smem_limit = target.smem_limit
    torch.backends.cuda.matmul.allow_tf32 = variant.dtype == "tf32"
    dtype = _torch_dtype(variant.dtype)
    capability = divmod(target.capability, 10)
    kernel = {"fwd": fa._fwd_kernel, "dkdv": fa._bwd_dkdv_kernel, "dq": fa._bwd_dq_kernel,
              "delta": fa._bwd_delta_kernel}[variant.kernel]
    if not isinstance(kernel, triton.runtime.jit.JITFunction):
        raise RuntimeError("the kernels were built by Triton's interpreter (TRITON_INTERPRET=1 "
                           "before triton was imported): run this as its own process")
    n_q = 1 if variant.launch == "decode" else SEQ_LEN
    tiles = (parse_tiles(variant.tiles) if variant.tiles else
             fa.default_tiles("dq" if variant.kernel == "delta" else variant.kernel,
                              variant.head_dim, dtype, n_q, SEQ_LEN, capability))
    constants = fa.launch_constants(variant.kernel, variant.head_dim, dtype, tiles)
    if variant.launch == "decode":
        constants["n_q"] = 1  # Triton makes an integer argument equal to 1 a constant
    # delta is launched without launch options: Triton's defaults, 4 warps and 3 stages
    warps, stages = (4, 3) if variant.kernel == "delta" else (tiles.num_warps, tiles.num_stages)
    row.tiles = (f"{tiles.block_m}x{tiles.block_n}/{warps}w{stages}s" if variant.kernel != "delta"
                 else f"{tiles.block_m} rows/{warps}w")
    signature, attrs = _signature(kernel, constants, variant.dtype, variant.launch)
    row.kv_group = signature.get("kv_group", "")
    triton.knobs.nvidia.dump_ptxas_log = True  # ptxas -v's report, printed to stdout
    # A kernel from the cache comes without that report: each variant gets a cache of its own
    # (two variants can be one kernel: delta does not depend on tf32).
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(dir=os.environ.get("KERNEL_REPORT_CACHE"))
    log, start = io.StringIO(), time.perf_counter()
    try:
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(ASTSource(kernel, signature, constants, attrs),
                                      target=GPUTarget("cuda", target.capability, 32),
                                      options=dict(num_warps=warps, num_stages=stages))
    except Exception as exc:  # noqa: BLE001 -- reported as the variant's problem
        row.error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}"
        return row
    row.seconds = round(time.perf_counter() - start, 2)
    report = log.getvalue()
    registers = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    if registers is None or spills is None:
        row.error = f"no ptxas report in the compiler's output: {report[-200:]!r}"
        return row
    row.registers = int(registers.group(1))
    row.spill_stores, row.spill_loads = int(spills.group(1)), int(spills.group(2))
    row.shared = compiled.metadata.shared
    ptx = compiled.asm["ptx"]
    row.tensor_cores = "wgmma" if "wgmma.mma_async" in ptx else "mma" if "mma.sync" in ptx else ""
    return row


def variants(targets, dtypes, head_dims, kernels, tiles=None, launches=("train",)
             ) -> list[Variant]:
    """Every combination; a decode step runs the forward kernel only."""
    return [Variant(k, dt, d, t, tiles, launch) for launch in launches for t in targets
            for dt in dtypes for d in head_dims for k in kernels
            if launch != "decode" or k == "fwd"]


def run(todo: list[Variant], jobs: int) -> list[Row]:
    """Compile every variant, `jobs` at a time, in a fresh Triton cache."""
    with tempfile.TemporaryDirectory(prefix="kernel-report-") as cache:
        os.environ["KERNEL_REPORT_CACHE"] = cache  # compile_variant makes one per variant in it
        if min(jobs, len(todo)) <= 1:  # no pool: the workers' start-up would cost more
            return [compile_variant(v) for v in todo]
        # spawn, not fork: the parent may hold a CUDA context (device=cuda)
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"),
                                 initializer=_quiet) as pool:
            return list(pool.map(compile_variant, todo))


def _quiet() -> None:
    # The kernels must be compiled, not interpreted: Triton reads this when
    # `model.fused_attention` first imports it, in compile_variant.
    os.environ["TRITON_INTERPRET"] = "0"
    # Triton 3.9 warns once per process that its FP-fusion default will change.
    warnings.filterwarnings("ignore", message=".*TRITON_DEFAULT_FP_FUSION.*")


def _dtype_name(constants: dict) -> str:
    """The report's dtype name of a compiled kernel, from its constexprs."""
    dot, precision = str(constants.get("DOT_DTYPE", "")), constants.get("PRECISION", "ieee")
    for name in ("fp16", "bf16", "fp64"):
        if name in dot:
            return name
    if "fp32" in dot:
        return "tf32" if precision == "tf32" else "fp32"
    return "acc " + str(constants.get("ACC_DTYPE", "?"))  # delta: no DOT_DTYPE


def gpu_rows(dtypes, head_dims) -> tuple[list[Row], str]:
    """Launch the kernels on this machine's GPU (forward and backward, grouped-query, T = 1024)
    and read the compiled objects Triton keeps: one row per distinct compiled kernel."""
    import torch
    import model.fused_attention as fa

    device = torch.device("cuda", torch.cuda.current_device())
    major, minor = torch.cuda.get_device_capability(device)
    target = f"sm_{major}{minor}"
    props = torch.cuda.get_device_properties(device)
    limit = getattr(props, "shared_memory_per_block_optin", 0)
    kernels = {"fwd": fa._fwd_kernel, "dkdv": fa._bwd_dkdv_kernel, "dq": fa._bwd_dq_kernel,
               "delta": fa._bwd_delta_kernel}
    rows: list[Row] = []
    seen: set = set()
    for name in dtypes:
        torch.backends.cuda.matmul.allow_tf32 = name == "tf32"
        for d in head_dims:
            dtype = _torch_dtype(name)
            q = torch.randn(1, 4, 1024, d, device=device, dtype=dtype)
            k, v = (torch.randn(1, 2, 1024, d, device=device, dtype=dtype) for _ in range(2))
            out, lse = fa.fused_attention_forward(q, k, v)
            fa.fused_attention_backward(q, k, v, out, lse, torch.randn_like(q))
            torch.cuda.synchronize(device)
            for kernel_name, kernel in kernels.items():
                for compiled in kernel.device_caches[device.index][0].values():
                    if id(compiled) in seen:
                        continue
                    seen.add(id(compiled))
                    constants = {kernel.arg_names[path[0]]: value
                                 for path, value in compiled.src.constants.items()}
                    meta = compiled.metadata
                    tiles = (f"{constants.get('BLOCK_M')}x{constants.get('BLOCK_N')}/"
                             f"{meta.num_warps}w{meta.num_stages}s")
                    rows.append(Row(kernel_name, _dtype_name(constants),
                                    constants.get("HEAD_DIM", 0), target,
                                    tiles=tiles if kernel_name != "delta"
                                    else f"{constants.get('BLOCK_M')} rows/{meta.num_warps}w",
                                    shared=meta.shared, smem_limit=limit,
                                    registers=compiled.n_regs,
                                    spill_stores=4 * compiled.n_spills,  # local memory, bytes
                                    tensor_cores="mma" if "mma" in compiled.asm.get("ptx", "")
                                    else "", kv_group="i32"))
    return rows, f"{target} ({torch.cuda.get_device_name(device)}), {limit:,} B per block"


def print_table(rows: list[Row]) -> None:
    targets = list(dict.fromkeys(r.target for r in rows))
    by_key = {(r.launch, r.kernel, r.dtype, r.head_dim, r.target): r for r in rows}
    keys = list(dict.fromkeys((r.launch, r.kernel, r.dtype, r.head_dim) for r in rows))
    head = f"{'launch':6} {'kernel':6} {'dtype':5} {'d':>3}"
    for t in targets:
        head += f" | {t + ' tiles':16} {'smem B':>7} {'regs':>4} {'spill':>5} {'mma':5}"
    print(head)
    for key in keys:
        line = f"{key[0]:6} {key[1]:6} {key[2]:5} {key[3]:>3}"
        for t in targets:
            r = by_key.get(key + (t,))
            if r is None:
                line += f" | {'':41}"
            elif r.error:
                line += f" | {'ERROR ' + r.error[:35]:41}"
            else:
                spill = r.spill_stores + r.spill_loads
                flag = "!" if r.problems() else " "
                line += (f" | {r.tiles:16} {r.shared:>7} {r.registers:>4} {spill:>5} "
                         f"{r.tensor_cores or '-':5}{flag}")
        print(line.rstrip())
    for t in targets:
        print(f"{t}: {TARGETS[t].gpus}; limit {TARGETS[t].smem_limit:,} B of shared memory per "
              f"block")
    print("spill = bytes of spill stores + loads per thread; mma = the tensor-core instruction "
          "in the PTX (- : FMA); ! = breaks a rule (check=true says which)")


@dataclass
class ReportArgs:
    # the GPU generations compiled for (TARGETS)
    targets: list[str] = field(default_factory=lambda: list(TARGETS))
    # the dtypes of q, k, v (tf32: fp32 with allow_tf32)
    dtypes: list[str] = field(default_factory=lambda: list(DTYPE_NAMES))
    head_dims: list[int] = field(default_factory=lambda: [16, 32, 64, 128])  # d_k
    # the forward, the backward's dK/dV and dQ, and the backward's small delta pass
    kernels: list[str] = field(default_factory=lambda: list(KERNELS))
    # train: lengths multiples of 16; ragged: not; decode: one query
    launch: list[str] = field(default_factory=lambda: ["train"])
    tiles: Optional[str] = None    # compile these tiles (e.g. 32x64/8w2s) instead of the defaults
    jobs: Optional[int] = None     # compilations at a time (null: the CPU count, at most 8)
    # cuda: launch on this machine's GPU and report what it compiled, next to the CPU's
    # prediction for its compute capability
    device: str = "cpu"
    json: bool = False             # one JSON object per variant
    check: bool = False            # exit with status 1 if a variant breaks a rule, naming it


USAGE = "usage: python -m tools.kernel_report [key=value ...]"


def main(argv: list[str]) -> int:
    def body() -> int:
        args = parse_key_values(argv, ReportArgs, USAGE, about=__doc__.split("\n\n")[0])
        check_choices(args, targets=TARGETS, dtypes=DTYPE_NAMES, kernels=KERNELS,
                      launch=LAUNCHES, device=("cpu", "cuda"))
        if args.jobs is None:
            args.jobs = min(8, os.cpu_count() or 1)
        return report(args)
    return run_cli(body)


def report(args: ReportArgs) -> int:
    _quiet()  # first: parse_tiles imports the kernels, which must not be interpreted
    if args.tiles:
        parse_tiles(args.tiles)  # a typo is an error before anything compiles
    start = time.perf_counter()
    if args.device == "cuda":
        return report_gpu(args)
    rows = run(variants(args.targets, args.dtypes, args.head_dims, args.kernels, args.tiles,
                        args.launch), args.jobs)
    if args.json:
        for r in rows:
            print(json.dumps(asdict(r)))
    else:
        print_table(rows)
        print(f"{len(rows)} variants compiled in {time.perf_counter() - start:.0f} s "
              f"({args.jobs} at a time)")
    broken = [(r, p) for r in rows for p in r.problems()]
    if args.check and broken:
        for r, p in broken:
            print(f"error: {r.launch} {r.kernel} {r.dtype} d={r.head_dim} {r.target} "
                  f"({r.tiles}): {p}", file=sys.stderr)
        return 1
    return 0


def report_gpu(args: ReportArgs) -> int:
    """device=cuda: the GPU's compiled kernels, then the CPU's prediction for that target."""
    import torch

    rows, where = gpu_rows(args.dtypes, args.head_dims)
    print(f"== compiled on this GPU: {where} (spill = local memory, bytes per thread)")
    print_table(rows)
    major, minor = torch.cuda.get_device_capability()
    family = "sm_90" if major == 9 else "sm_80"
    predicted = run(variants([family], args.dtypes, args.head_dims, args.kernels), args.jobs)
    print(f"== predicted on the CPU for {family} (spill = ptxas's spill stores + loads)")
    print_table(predicted)
    # local memory on the GPU includes stack frames, not only spills: only shared memory and
    # failures count as broken here; the prediction's table has ptxas's spill figures
    broken = [(r, p) for r in rows for p in r.problems() if "shared memory" in p]
    for r, p in broken:
        print(f"error: {r.kernel} {r.dtype} d={r.head_dim} {r.target} ({r.tiles}): {p}",
              file=sys.stderr)
    return 1 if args.check and broken else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
