"""Will it fit? A lower bound on the memory a model needs, checked before anything is allocated.

`model.n_embd=1000000` asks for tens of billions of parameters. Allocating them either fails deep
inside torch (a traceback, a half-made run directory) or, worse, succeeds thanks to the
kernel's overcommit and then has the process killed half-way through initialisation. So sizes
are estimated from the config alone and compared with the memory there is. The estimate counts
only what certainly exists (weights, gradients, AdamW's two moments, the activations kept for
backward, the causal masks, the KV cache), so a config it refuses cannot run; one it accepts may
still be tight.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from model.config import ModelConfig

GB = 1e9
FP32 = 4


def parameter_count(m: ModelConfig, vocab_size: int) -> int:
    """Parameters of model.gpt.GPT (the head is tied to the token embedding)."""
    d, r = m.n_embd, m.mlp_ratio
    bias = 1 if m.bias else 0
    per_block = (2 * (d + bias * d)                    # two LayerNorms
                 + 3 * d * d + bias * 3 * d            # W_QKV
                 + d * d + bias * d                    # W_O (counted even when switched off)
                 + r * d * d + bias * r * d            # MLP in
                 + r * d * d + bias * d)               # MLP out
    return vocab_size * d + m.block_size * d + m.n_layer * per_block + d + bias * d


def training_bytes(m: ModelConfig, vocab_size: int, batch_size: int, eval_batches: int) -> dict:
    """Lower bounds, by part, of the memory one training process needs (float32)."""
    B, T, L, d, h = batch_size, m.block_size, m.n_layer, m.n_embd, m.n_head
    return {
        "weights, gradients and AdamW's moments": 4 * FP32 * parameter_count(m, vocab_size),
        "activations kept for backward": FP32 * B * T * L * ((8 + 2 * m.mlp_ratio) * d + h * T),
        "logits and their gradient": 2 * FP32 * B * T * vocab_size,
        "causal masks": L * T * T,
        "validation batches": 8 * eval_batches * B * (T + 1),
    }


def inference_bytes(m: ModelConfig, vocab_size: int, batch_size: int = 1) -> dict:
    """Lower bounds, by part, of the memory sampling needs (float32, KV cache)."""
    T, L, d = m.block_size, m.n_layer, m.n_embd
    return {"weights": FP32 * parameter_count(m, vocab_size),
            "KV cache": 2 * FP32 * L * batch_size * T * d,
            "causal masks": L * T * T}


def available_bytes(device: torch.device) -> Optional[int]:
    """Memory this process may use on device: a GPU's total memory, or the host's available
    memory and swap within any cgroup limit; None when unknown."""
    if device.type == "cuda":
        try:
            return torch.cuda.get_device_properties(device.index or 0).total_memory
        except Exception:
            return None
    if device.type != "cpu":
        return None
    found = []
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        found.append(sum(int(info[k].split()[0]) * 1024 for k in ("MemAvailable", "SwapFree")))
    except (OSError, KeyError, ValueError):
        pass
    for limit_file, usage_file in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            limit = Path("/sys/fs/cgroup", limit_file).read_text().strip()
            usage = Path("/sys/fs/cgroup", usage_file).read_text().strip()
            if limit.isdigit() and int(limit) < 1 << 60:
                found.append(max(int(limit) - int(usage), 0))
        except (OSError, ValueError):
            pass
    return min(found) if found else None


def check_fits(parts: dict, device: torch.device, what: str, m: ModelConfig, vocab_size: int,
               advice: str) -> None:
    """Raise ValueError, with the estimate, when parts cannot fit in the device's memory."""
    needed = sum(parts.values())
    have = available_bytes(device)
    if have is None or needed <= have:
        return
    biggest = max(parts, key=parts.get)
    raise ValueError(
        f"{what} does not fit in memory: model.n_layer={m.n_layer}, n_embd={m.n_embd}, "
        f"block_size={m.block_size} and a vocabulary of {vocab_size:,} make "
        f"{_millions(parameter_count(m, vocab_size))} parameters; {what} needs at least "
        f"{needed / GB:,.1f} GB ({biggest}: {parts[biggest] / GB:,.1f} GB), but {device.type} has "
        f"{have / GB:,.1f} GB available; {advice}")


def _millions(n: int) -> str:
    return f"{n / 1e6:,.0f}M" if n >= 10**7 else f"{n / 1e6:.2f}M"
