"""The processes a run trains in, and how they stop.

Multi-process training uses PyTorch's own engine: torch.distributed + DistributedDataParallel.
`torchrun --nproc_per_node=N train.py` sets RANK / WORLD_SIZE / LOCAL_RANK; a plain
`python train.py` runs as a world of one, with no process group at all. The backend is `nccl` on
CUDA and `gloo` on CPU. Only rank 0 writes logs, samples and checkpoints; every rank computes, and
the values that decide what happens next (losses, stop requests) are agreed with all_reduce so
that no rank waits for a collective the others skipped.

SIGINT / SIGTERM ask the loop to finish its step, save and exit (`StopFlag`). `Speedometer`
counts how fast the work goes: train.py's steps, generate.py's samples.
"""
from __future__ import annotations

import os
import signal
from dataclasses import dataclass

import torch
import torch.distributed as dist

from safeio.cli import UserError
from safeio.system import parse_launch


@dataclass
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1


def init_world(device: torch.device) -> World:
    """Join the process group that torchrun described in the environment, if any."""
    launch = parse_launch(os.environ)
    if launch.size == 1:
        return World(device=device)
    rank, size, local_rank = launch.rank, launch.size, launch.local_rank
    if device.type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise UserError(f"LOCAL_RANK={local_rank}, but this machine has "
                            f"{torch.cuda.device_count()} CUDA devices (torchrun "
                            f"--nproc_per_node must not exceed them)")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend)
    return World(rank=rank, size=size, local_rank=local_rank, device=device)


def shutdown(world: World) -> None:
    if world.distributed and dist.is_initialized():
        dist.destroy_process_group()


def all_sum(values: list[float], world: World) -> list[float]:
    """Element-wise sum over ranks (identity for a world of one)."""
    if not world.distributed:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=world.device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def all_mean(value: torch.Tensor, world: World) -> torch.Tensor:
    """Mean over ranks of a tensor, left on its device (itself for a world of one)."""
    if not world.distributed:
        return value
    total = value.clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total / world.size


def broadcast_from_main(value, world: World):
    """Rank 0's value of a picklable object, on every rank."""
    if not world.distributed:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier(world: World) -> None:
    if world.distributed:
        dist.barrier()


class StopFlag:
    """SIGINT/SIGTERM ask the loop to finish the current step, save, and exit; a second SIGINT
    interrupts at once."""

    def __init__(self):
        self.signal = None

    def __enter__(self):
        self._old = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc):
        for s, handler in self._old.items():
            signal.signal(s, handler)

    def _handle(self, signum, frame):
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal = signal.Signals(signum).name


class Speedometer:
    """Tokens per second of the work alone (training steps, or sampling): evaluation, checkpoint
    and start-up time are left out by whoever calls `add`."""

    def __init__(self):
        self.tokens, self.seconds = 0, 0.0
        self._window_tokens, self._window_seconds = 0, 0.0

    def add(self, tokens: int, seconds: float) -> None:
        self.tokens += tokens
        self.seconds += seconds
        self._window_tokens += tokens
        self._window_seconds += seconds

    def window_rate(self) -> float:
        """The rate since the last call."""
        rate = self._window_tokens / max(self._window_seconds, 1e-9)
        self._window_tokens, self._window_seconds = 0, 0.0
        return rate

    def rate(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)
