"""What a checkpoint holds besides weights and optimizer: the loop's counters (`Progress`) and
every random-number generator's state (CPU, and CUDA or MPS where there is one), so that a resumed
run continues bit-exactly."""
from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, field, fields

import numpy as np
import torch


@dataclass
class Progress:
    """The training loop's counters, saved in every checkpoint and restored on resume."""

    step: int = 0                 # optimizer steps taken (skipped non-finite ones included)
    tokens_seen: int = 0          # tokens of the steps that updated the weights
    best_val: float = math.inf    # lowest causal validation loss so far (the `best` weights)
    best_step: int = -1           # the step it was measured at
    elapsed: float = 0.0          # seconds of training so far, evaluations included, all processes
    skipped: int = 0              # non-finite steps skipped (train.on_nonfinite=skip)
    # training losses since the last log line (their mean is the logged train/loss)
    loss_window: list = field(default_factory=list)
    # [step, causal val loss, train loss] at every evaluation: the overfitting guard reads it
    history: list = field(default_factory=list)

    def state_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_state_dict(cls, state: dict) -> "Progress":
        return cls(**{f.name: state[f.name] for f in fields(cls)})


PROGRESS_KEYS = tuple(f.name for f in fields(Progress))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict:
    _, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": keys.tolist(), "numpy_pos": int(pos),
             "numpy_gauss": [int(has_gauss), float(cached_gaussian)]}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if torch.backends.mps.is_available():  # dropout on mps draws from its own generator
        state["mps"] = torch.mps.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    has_gauss, cached_gaussian = state["numpy_gauss"]
    np.random.set_state(("MT19937", np.array(state["numpy"], dtype=np.uint32),
                         int(state["numpy_pos"]), int(has_gauss), float(cached_gaussian)))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "mps" in state and torch.backends.mps.is_available():
        torch.mps.set_rng_state(state["mps"])
