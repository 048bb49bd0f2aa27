"""In which precision to run: bf16 autocast where it pays (the device string is parsed in
guard/limits.py; on a CPU, whether it pays is measured: training/dtype_probe.py)."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Optional

import torch


# Set to 1 or 0 to decide what `dtype=auto` takes on a CPU (bf16 or fp32) without measuring: the
# test suite's --cpu-bf16 runs everything in bf16 (bf16 autocast works on any CPU, only slower).
NATIVE_BF16_ENV = "SCRATCH_GPT_CPU_BF16"


def forced_cpu_bf16() -> Optional[bool]:
    """What SCRATCH_GPT_CPU_BF16 decides for a CPU: True (bf16), False (fp32) or None (unset)."""
    forced = os.environ.get(NATIVE_BF16_ENV)
    return forced == "1" if forced in ("0", "1") else None


CPUINFO = Path("/proc/cpuinfo")


def cpu_fields() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (the others repeat them), e.g. "model name"
    and "flags"; empty where there is no such file (macOS, Windows)."""
    try:
        block = CPUINFO.read_text().split("\n\n")[0]
    except OSError:
        return {}
    return {key.strip(): value.strip() for key, value in
            (line.split(":", 1) for line in block.splitlines() if ":" in line)}


def cpu_has_native_bf16() -> bool:
    """True when the CPU has bf16 matrix instructions (AVX512-BF16 or AMX): what it can do, not
    what is fast (with AVX512-BF16 but no AMX, bf16 can still be the slower choice), so this
    only annotates benchmarks; `dtype=auto` measures (training/dtype_probe.py)."""
    flags = cpu_fields().get("flags", "").split()
    return "avx512_bf16" in flags or "amx_bf16" in flags


# Devices without float64 (Apple's MPS): a float64 running total of their values lives on the CPU.
NO_FLOAT64 = ("mps",)


def float64_home(device: torch.device) -> torch.device:
    """Where a float64 total of values computed on `device` is kept: there, when it can be."""
    return torch.device("cpu") if device.type in NO_FLOAT64 else device


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """A dtype name as a torch dtype, `auto` as decided without a model to measure: bf16 on CUDA
    (where supported), fp32 on MPS, and on a CPU what SCRATCH_GPT_CPU_BF16 says, else fp32 (the
    accurate choice). train.py settles a CPU's auto by measuring its model
    (training/dtype_probe.py)."""
    if name == "float32":
        return torch.float32
    if name == "bfloat16":
        return torch.bfloat16
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    if device.type == "mps":  # Apple GPUs: bf16 needs macOS 14 and is not known to pay; opt in
        return torch.float32
    return torch.bfloat16 if forced_cpu_bf16() else torch.float32


def autocast(device: torch.device, dtype: torch.dtype):
    """Mixed precision for the forward pass; parameters and optimiser state stay fp32."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)
