"""Training batches: random windows of block_size + 1 tokens from one long token stream."""
from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

from safeio.cli import CorpusError


def check_split_lengths(train: np.ndarray, validation: np.ndarray, block_size: int) -> None:
    """Enough tokens to draw batches from: a window of block_size + 1 tokens of training text,
    and at least two validation tokens (its windows are cut to fit)."""
    if len(train) < block_size + 1:
        raise CorpusError(f"the training split has {len(train)} tokens, fewer than one window of "
                          f"model.block_size + 1 = {block_size + 1}; use more text or a smaller "
                          f"block_size")
    if len(validation) < 2:
        raise CorpusError("the validation split is shorter than 2 tokens")


class RandomWindows:
    """Draws (x, y) batches, y being x shifted by one token; x, y are int64 [batch, block_size].

    The offsets come from a torch.Generator whose state is part of the training checkpoint, so a
    resumed run sees exactly the batches the uninterrupted run would have seen.
    """

    def __init__(self, tokens: np.ndarray, block_size: int, batch_size: int, seed: int,
                 device: torch.device = torch.device("cpu")):
        assert len(tokens) >= block_size + 1, \
            f"the split has {len(tokens)} tokens, fewer than one window of {block_size + 1}"
        self.tokens, self.block_size, self.batch_size = tokens, block_size, batch_size
        self.device = device
        self.generator = torch.Generator().manual_seed(seed)
        self._span = np.arange(block_size + 1)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._windows(self._draw(self.batch_size))

    def _draw(self, n: int) -> np.ndarray:
        """The starts of the next n windows: any offset, with replacement."""
        high = len(self.tokens) - self.block_size - 1
        return torch.randint(0, high + 1, (n,), generator=self.generator).numpy()

    def next_step(self, accum: int = 1, rank: int = 0, world: int = 1
                  ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This process's micro-batches for one optimizer step.

        One generator (the same on every rank) draws the step's batch_size x accum x world
        windows and `rank` takes its own share, so N processes with accumulation A see exactly
        the windows of one with N x A, and a checkpoint from N ranks resumes on any number.
        """
        starts = self._draw(self.batch_size * accum * world)
        mine = starts.reshape(accum, world, self.batch_size)[:, rank]  # [accum, batch]
        return [self._windows(s) for s in mine]

    def _windows(self, starts: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        windows = torch.from_numpy(self.tokens[starts[:, None] + self._span].astype(np.int64))
        if self.device.type == "cuda":  # page-locked, so the copy overlaps the GPU's work
            windows = windows.pin_memory().to(self.device, non_blocking=True)
        elif self.device.type != "cpu":
            windows = windows.to(self.device)
        return windows[:, :-1], windows[:, 1:]  # [B, T], [B, T]

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])


class EpochWindows(RandomWindows):
    """data.order=epochs: the stream cut into windows of block_size + 1 tokens that share their
    boundary token, read in a fresh random order each epoch, each window once (without
    replacement), where RandomWindows draws any offset with replacement (over the default's
    3.9 epochs, some text is then read six times and some never). Each epoch shifts the grid by a
    random offset below block_size, so a token does not always sit at one place in its window; a
    step may run from one epoch into the next. The state is the generator before the epoch's
    shuffle, the epoch and the position in it, so a resumed run reads exactly the windows the
    uninterrupted one would have."""

    def __init__(self, tokens: np.ndarray, block_size: int, batch_size: int, seed: int,
                 device: torch.device = torch.device("cpu")):
        super().__init__(tokens, block_size, batch_size, seed, device)
        self.count = (len(tokens) - 1) // block_size       # windows per epoch
        self.slack = len(tokens) - 1 - self.count * block_size  # the grid's possible shifts
        self.epoch = 0
        self._shuffle()

    def _shuffle(self) -> None:
        self._epoch_state = self.generator.get_state()
        shift = int(torch.randint(0, self.slack + 1, (1,), generator=self.generator))
        order = torch.randperm(self.count, generator=self.generator).numpy()
        self._starts = shift + order * self.block_size     # [count]
        self.position = 0

    def _draw(self, n: int) -> np.ndarray:
        taken = []
        while n > 0:
            if self.position == self.count:
                self.epoch += 1
                self._shuffle()
            take = min(n, self.count - self.position)
            taken.append(self._starts[self.position:self.position + take])
            self.position += take
            n -= take
        return np.concatenate(taken)

    def state_dict(self) -> dict:
        return {"generator": self._epoch_state, "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        position, epoch = state["position"], state["epoch"]
        if not (type(position) is int and 0 <= position <= self.count  # (True is an int)
                and type(epoch) is int and 0 <= epoch < 2**63):
            raise ValueError(f"an epoch position from 0 to {self.count} and an epoch from 0 are "
                             f"needed, got {position!r} and {epoch!r}")
        self.generator.set_state(state["generator"])
        self._shuffle()
        self.position, self.epoch = position, epoch


def training_windows(order: str, tokens: np.ndarray, block_size: int, batch_size: int,
                     seed: int, device: torch.device = torch.device("cpu")) -> RandomWindows:
    """The sampler of data.order: "epochs" (EpochWindows, the default) or "random"."""
    kind = {"random": RandomWindows, "epochs": EpochWindows}[str(getattr(order, "value", order))]
    return kind(tokens, block_size, batch_size, seed, device)


def fixed_windows(tokens: np.ndarray, block_size: int, n_batches: int, batch_size: int,
                  seed: int, device: torch.device = torch.device("cpu")
                  ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same n_batches random batches every time, kept on the device: comparable periodic
    evaluations."""
    sampler = RandomWindows(tokens, block_size, batch_size, seed, device)
    return [sampler.next_batch() for _ in range(n_batches)]


def sequential_windows(tokens: np.ndarray, block_size: int, batch_size: int
                       ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Every token of the split predicted exactly once: non-overlapping windows covering it all.

    The last window is shorter when the split's length is not a multiple of block_size; it is
    yielded on its own so no token is counted twice.
    """
    n_targets = len(tokens) - 1
    full = n_targets // block_size
    span = np.arange(block_size + 1)
    for first in range(0, full, batch_size):
        starts = np.arange(first, min(first + batch_size, full)) * block_size
        w = torch.from_numpy(tokens[starts[:, None] + span].astype(np.int64))
        yield w[:, :-1], w[:, 1:]
    rest = n_targets - full * block_size
    if rest > 0:
        w = torch.from_numpy(tokens[full * block_size:].astype(np.int64))[None]
        yield w[:, :-1], w[:, 1:]
