"""In which precision to run: bf16 autocast where it pays (the device string is parsed in
guard/limits.py)."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch


# Set to 1 or 0 to decide what `dtype=auto` takes a CPU for: the test suite's --cpu-bf16 runs
# everything as on a CPU with bf16 units (bf16 autocast works on any CPU, only slower).
NATIVE_BF16_ENV = "SCRATCH_GPT_CPU_BF16"


def cpu_has_native_bf16() -> bool:
    """True when the CPU has bf16 matrix instructions (AVX512-BF16 or AMX). Without them bf16
    matmuls are emulated and slower than fp32, so 'auto' keeps fp32."""
    forced = os.environ.get(NATIVE_BF16_ENV)
    if forced in ("0", "1"):
        return forced == "1"
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


# Devices without float64 (Apple's MPS): a float64 running total of their values lives on the CPU.
NO_FLOAT64 = ("mps",)


def float64_home(device: torch.device) -> torch.device:
    """Where a float64 total of values computed on `device` is kept: there, when it can be."""
    return torch.device("cpu") if device.type in NO_FLOAT64 else device


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "float32":
        return torch.float32
    if name == "bfloat16":
        return torch.bfloat16
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    if device.type == "mps":  # Apple GPUs: bf16 needs macOS 14 and is not known to pay; opt in
        return torch.float32
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def autocast(device: torch.device, dtype: torch.dtype):
    """Mixed precision for the forward pass; parameters and optimiser state stay fp32."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)
