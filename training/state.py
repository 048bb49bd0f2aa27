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
        """The counters of a saved state; ValueError naming the first that the loop cannot use
        (a tampered checkpoint: the loop would fail steps later, or train on garbage)."""
        p = cls(**{f.name: state[f.name] for f in fields(cls)})
        count = lambda v, high=2**63 - 1: type(v) is int and 0 <= v <= high  # noqa: E731
        number = lambda v: type(v) in (int, float) and not math.isnan(v)  # noqa: E731
        finite = lambda v: number(v) and math.isfinite(v)  # noqa: E731
        checks = {
            "step": count(p.step), "tokens_seen": count(p.tokens_seen),
            "skipped": count(p.skipped) and count(p.step) and p.skipped <= p.step,
            "best_step": p.best_step == -1 or count(p.best_step) and count(p.step)
            and p.best_step <= p.step,
            "best_val": number(p.best_val), "elapsed": finite(p.elapsed) and p.elapsed >= 0,
            "loss_window": type(p.loss_window) is list and all(map(finite, p.loss_window))
            and count(p.step) and len(p.loss_window) <= p.step,
            "history": type(p.history) is list and all(
                type(e) is list and len(e) == 3 and count(e[0]) and
                all(type(v) in (int, float) for v in e[1:]) for e in p.history),
        }
        wrong = next((name for name, ok in checks.items() if not ok), None)
        if wrong is not None:
            raise ValueError(f"{wrong} is {str(getattr(p, wrong))[:60]!r}, not what train.py "
                             f"writes")
        return p


PROGRESS_KEYS = tuple(f.name for f in fields(Progress))
STATE_KEYS = ("optimizer", "sampler", "rng") + PROGRESS_KEYS  # what a checkpoint's state holds


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
    pos = int(state["numpy_pos"])
    if not 0 <= pos <= 624:  # NumPy takes any position, and reads its state at it
        raise ValueError(f"numpy_pos {pos} is not a position in NumPy's state (0 to 624)")
    np.random.set_state(("MT19937", np.array(state["numpy"], dtype=np.uint32), pos,
                         int(has_gauss), float(cached_gaussian)))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "mps" in state and torch.backends.mps.is_available():
        torch.mps.set_rng_state(state["mps"])
