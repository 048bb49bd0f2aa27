"""Checkpoints, in process: pruning, and the random states' round trip (what is read back from a
run directory is checked in guard/: tests/test_guard.py)."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from safeio.checkpoint import load_state
from safeio.cli import FormatError
from training.checkpoint import latest_checkpoint, save_checkpoint
from training.checkpoint import rng_state, set_rng_state


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


def test_rng_state_round_trips_every_generator_through_json_and_safetensors(tmp_path):
    random.seed(3), np.random.seed(3), torch.manual_seed(3)
    random.random(), np.random.rand(7), np.random.randn(1), torch.rand(2)  # mid-stream, cached gauss
    save_checkpoint(tmp_path, 1, torch.nn.Linear(2, 2), {"rng": rng_state()}, keep=1)
    first = (random.random(), np.random.randn(3).tolist(), torch.rand(3).tolist())
    random.random(), np.random.rand(50), torch.rand(50)
    set_rng_state(load_state(latest_checkpoint(tmp_path), ["rng"])["rng"])
    assert (random.random(), np.random.randn(3).tolist(), torch.rand(3).tolist()) == first


def test_the_state_round_trips_what_json_cannot_say(tmp_path):
    """Tuples, dtypes, integer keys, infinities and tensors (a scalar among them) come back as
    they were saved: Optimizer.load_state_dict matches its state by integer keys."""
    state = {"betas": (0.9, 0.99), "ns_dtype": torch.bfloat16, "none": None,
             "state": {0: {"step": torch.tensor(3.0), "m": torch.arange(6.0).view(2, 3)}},
             "best_val": float("inf"), "history": [[2, float("nan"), 3.0]]}
    save_checkpoint(tmp_path, 1, torch.nn.Linear(2, 2), state, keep=1)
    ckpt = latest_checkpoint(tmp_path)
    assert sorted(p.name for p in ckpt.iterdir()) == ["model.safetensors", "state.json",
                                                      "state.safetensors"]
    back = load_state(ckpt)
    assert back["betas"] == (0.9, 0.99) and back["ns_dtype"] is torch.bfloat16
    assert back["none"] is None and back["best_val"] == float("inf")
    assert list(back["state"]) == [0] and torch.equal(back["state"][0]["m"], state["state"][0]["m"])
    assert back["state"][0]["step"].shape == () and back["history"][0][1] != back["history"][0][1]


def test_a_state_pt_of_an_earlier_version_is_refused_in_one_line_without_unpickling(tmp_path):
    save_checkpoint(tmp_path, 1, torch.nn.Linear(2, 2), {"step": 1}, keep=1)
    ckpt = latest_checkpoint(tmp_path)
    for name in ("state.json", "state.safetensors"):
        (ckpt / name).unlink()
    (ckpt / "state.pt").write_bytes(b"not even a pickle")  # never opened
    with pytest.raises(FormatError, match="state.pt .*earlier version.* cannot resume") as info:
        load_state(ckpt)
    assert "\n" not in str(info.value)


# ----------------------------------------------------------------------------- tampered counters


def _progress(**changes) -> dict:
    from training.checkpoint import Progress

    return {**Progress(step=20, tokens_seen=640, best_val=1.5, best_step=20,
                       history=[[10, 1.7, 1.8], [20, 1.5, 1.6]]).state_dict(), **changes}


def test_the_counters_train_py_writes_are_taken():
    from training.checkpoint import Progress

    assert Progress.from_state_dict(_progress()).best_val == 1.5
    fresh = Progress().state_dict()  # no evaluation yet: best_val inf at step -1
    assert Progress.from_state_dict(fresh).best_step == -1
    diverged = _progress(best_val=float("inf"), best_step=-1, history=[[10, float("nan"), 2.0]])
    assert Progress.from_state_dict(diverged).history[0][0] == 10


@pytest.mark.parametrize("changes, field", [
    ({"best_val": float("-inf")}, "best_val"),      # round five: every loss "worse" than best
    ({"best_val": -0.5}, "best_val"),               # a cross-entropy is not negative
    ({"best_val": float("inf")}, "best_val"),       # no best, yet a best step
    ({"best_val": 1.0, "best_step": -1}, "best_val"),
    ({"history": [[i, 1.0, 1.0] for i in range(2_000_000)]}, "history"),  # round five
    ({"history": [[20, 1.0, 1.0], [10, 1.0, 1.0]]}, "history"),  # out of order
    ({"history": [[10, 1.0, 1.0], [10, 1.0, 1.0]]}, "history"),  # twice the same step
    ({"history": [[30, 1.0, 1.0]]}, "history"),     # after the state's own step
])
def test_counters_train_py_never_writes_are_refused(changes, field):
    from training.checkpoint import Progress

    with pytest.raises(ValueError, match=f"^{field} is"):
        Progress.from_state_dict(_progress(**changes))


@pytest.mark.parametrize("position, epoch", [(True, 0), (1, False), (1.0, 0), (-1, 0), (10**9, 0),
                                             (0, -1), (0, 2**70), ("1", 0)])
def test_an_epoch_sampler_takes_only_its_own_positions(position, epoch):
    """Round five: a position of `true` resumed (True is an int to isinstance)."""
    from data.batches import EpochWindows

    sampler = EpochWindows(np.arange(1000, dtype=np.uint16), 16, 4, seed=1)
    state = {**sampler.state_dict(), "position": position, "epoch": epoch}
    with pytest.raises(ValueError, match="epoch position"):
        sampler.load_state_dict(state)
    sampler.load_state_dict({**sampler.state_dict(), "position": 3, "epoch": 2})
    assert (sampler.position, sampler.epoch) == (3, 2)
