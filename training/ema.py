"""Weight averaging (train.ema): an exponential moving average of the weights, which evaluation
scores and checkpoints hold, while training goes on with the weights themselves.

SGD-like iterates bounce around the bottom of a valley; their average sits nearer its middle,
a flatter and usually better point, for free (one float32 copy of the parameters, one update per
step). With a learning rate that decays linearly to 0, as here, the last iterates already settle
down, so the gain may be small: measuring it is what the switch is for.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch


class WeightAverage:
    """A float32 copy of model's parameters (the model has no floating-point buffers: its one
    buffer, the causal mask, is boolean and not saved), updated after every optimizer step:
    avg = decay * avg + (1 - decay) * weights, or avg = weights before step `start`."""

    def __init__(self, model: torch.nn.Module, decay: float, start: int = 0):
        self.decay, self.start = decay, start
        self.average = {name: p.detach().float().clone() for name, p in model.named_parameters()}

    @torch.no_grad()
    def reset(self, model: torch.nn.Module) -> None:
        """The average becomes the model's weights."""
        for name, p in model.named_parameters():
            self.average[name].copy_(p)

    @torch.no_grad()
    def update(self, model: torch.nn.Module, step: int) -> None:
        """After optimizer step `step` (the steps taken, counted from 1)."""
        if step < self.start:
            return self.reset(model)
        for name, p in model.named_parameters():
            self.average[name].lerp_(p.detach().float(), 1 - self.decay)

    @contextlib.contextmanager
    def swapped_in(self, model: torch.nn.Module) -> Iterator[dict]:
        """The average in the model's parameters for the block (evaluating, saving), which is
        given the model's own weights; those are back in the model after it."""
        own = {name: p.detach().clone() for name, p in model.named_parameters()}
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(self.average[name])
        try:
            yield own
        finally:
            with torch.no_grad():
                for name, p in model.named_parameters():
                    p.copy_(own[name])
