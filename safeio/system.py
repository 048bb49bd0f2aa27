"""What this process can know about the machine and its launch, with no project import below it.

Ground floor: the memory a device offers, torchrun's variables, and the two integer bounds every
counter and seed shares. The core (data/, training/) and the policy (guard.limits) both read it.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from safeio.cli import UserError

MAX_SEED = 2**63 - 1
MAX_COUNT = 2**62


# ----------------------------------------------------------------------------- torchrun's variables


@dataclass(frozen=True)
class Launch:
    """This process's place in a torchrun job: a world of one without torchrun."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0


def parse_launch(environ) -> Launch:
    """RANK, WORLD_SIZE and LOCAL_RANK as torchrun sets them, checked: set by hand, or left over
    from another shell, they must still describe a job (a stray RANK=1 would make this process a
    rank without a rank 0, writing its run nowhere it should), and a world of several processes
    needs the rendezvous address torchrun sets (MASTER_ADDR, MASTER_PORT)."""
    values = {}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        raw = environ.get(name)
        if raw is None:
            continue
        text = raw.strip()
        if not (text.isascii() and text.isdigit() and len(text) <= 9):
            raise UserError(f"the environment variable {name}={raw[:40]!r} must be a "
                            f"non-negative integer (torchrun sets it; unset it to train in one "
                            f"process)")
        values[name] = int(text)
    size, rank, local = values.get("WORLD_SIZE"), values.get("RANK"), values.get("LOCAL_RANK", 0)
    if size is None:
        if rank or local:
            name = "RANK" if rank else "LOCAL_RANK"
            raise UserError(f"{name}={values[name]} is set but WORLD_SIZE is not: torchrun sets "
                            f"both (left over from another shell?); unset {name} to train in one "
                            f"process, or start the job with torchrun")
        return Launch()
    if size < 1:
        raise UserError(f"WORLD_SIZE must be at least 1, got {size}")
    if rank is None and size > 1:
        raise UserError(f"WORLD_SIZE={size} is set but RANK is not: torchrun sets both; start "
                        f"the job with torchrun")
    rank = rank or 0
    if rank >= size or local >= size:
        name, value = ("RANK", rank) if rank >= size else ("LOCAL_RANK", local)
        raise UserError(f"{name}={value} must be below WORLD_SIZE={size}")
    if size > 1:
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if not environ.get(name):
                raise UserError(f"WORLD_SIZE={size} needs {name}, which torchrun sets; start the "
                                f"job with torchrun")
        port = environ["MASTER_PORT"].strip()
        if not (port.isascii() and port.isdigit() and 0 < int(port) < 65536):
            raise UserError(f"MASTER_PORT must be a port number (1 to 65535), got "
                            f"{environ['MASTER_PORT'][:20]!r}")
    return Launch(rank, size, local)


def available_bytes(device: torch.device) -> Optional[int]:
    """Memory this process may use on device: a GPU's total memory, Metal's recommended working
    set on mps (a share of the memory it shares with the CPU), or the host's available memory
    and swap within any cgroup limit; None when unknown."""
    if device.type == "cuda":
        try:
            return torch.cuda.get_device_properties(device.index or 0).total_memory
        except Exception:
            return None
    if device.type == "mps":
        try:
            return int(torch.mps.recommended_max_memory()) or None
        except Exception:  # an older torch, or no Metal device
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
