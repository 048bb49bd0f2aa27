"""Checkpoints, in process: pruning, and the random states' round trip (what is read back from a
run directory is checked in guard/: tests/test_guard.py)."""
from __future__ import annotations

import random

import numpy as np
import torch

from training.checkpoint import latest_checkpoint, save_checkpoint
from training.state import rng_state, set_rng_state


def test_pruning_never_removes_the_checkpoint_latest_names(tmp_path):
    """A kill between renaming step_20 into place and pointing `latest` at it leaves a newer
    checkpoint than `latest`; the resumed run then saves step 15 (SIGINT): with keep=1, step_20
    must not count as the newest and push step_15 out."""
    model = torch.nn.Linear(2, 2)
    state = {"step": 0}
    save_checkpoint(tmp_path, 10, model, state, keep=1)
    save_checkpoint(tmp_path, 20, model, state, keep=1)
    (tmp_path / "checkpoints" / "latest").write_text("step_00000010")  # as if killed before
    (tmp_path / "checkpoints" / ".tmp-step_00000030").mkdir()  # a write killed half-way
    save_checkpoint(tmp_path, 15, model, state, keep=1)
    assert latest_checkpoint(tmp_path).name == "step_00000015"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_00000015"]


def test_rng_state_round_trips_every_generator_through_a_weights_only_load(tmp_path):
    random.seed(3), np.random.seed(3), torch.manual_seed(3)
    random.random(), np.random.rand(7), np.random.randn(1), torch.rand(2)  # mid-stream, cached gauss
    saved = rng_state()
    torch.save({"rng": saved}, tmp_path / "s.pt")
    first = (random.random(), np.random.randn(3).tolist(), torch.rand(3).tolist())
    random.random(), np.random.rand(50), torch.rand(50)
    set_rng_state(torch.load(tmp_path / "s.pt", weights_only=True)["rng"])
    assert (random.random(), np.random.randn(3).tolist(), torch.rand(3).tolist()) == first
