"""Random-number state: seeding a run, and saving / restoring every generator for exact resume."""
from __future__ import annotations

import random

import numpy as np
import torch


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
    return state


def set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    has_gauss, cached_gaussian = state.get("numpy_gauss", (0, 0.0))
    np.random.set_state(("MT19937", np.array(state["numpy"], dtype=np.uint32),
                         int(state.get("numpy_pos", 624)), int(has_gauss), float(cached_gaussian)))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
