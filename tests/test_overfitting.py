"""The overfitting guard: validation loss rising while training loss falls is reported, with
the best checkpoint named, and train.early_stop stops the run and scores the best weights."""
from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from helpers import REPO_ROOT
from training.evaluate import rising_validation


def history(vals, trains):
    return [[10 * i, v, t] for i, (v, t) in enumerate(zip(vals, trains))]


def test_rising_validation_needs_patience_rises_while_training_loss_falls():
    falling = [3.0, 2.9, 2.8, 2.7]
    assert rising_validation(history([2.0, 2.1, 2.2, 2.3], falling), patience=3)
    assert not rising_validation(history([2.0, 2.1, 2.2, 2.3], falling), patience=4)  # too few
    assert not rising_validation(history([2.0, 2.1, 2.05, 2.3], falling), patience=3)  # a dip
    assert not rising_validation(history([2.0, 2.1, 2.2, 2.3], [3.0, 2.9, 2.95, 2.7]), patience=3)
    assert rising_validation(history([2.5, 2.0, 2.1, 2.2], falling), patience=2)  # the last two
    assert not rising_validation(history([2.0, 2.1, 2.2, 2.3], falling), patience=0)  # off


@pytest.mark.slow
def test_a_run_that_memorises_its_data_is_warned_and_stopped_early(tmp_path):
    """1,500 random letters to train on and 1,500 others to validate on: nothing to learn but
    the letter frequencies, so a model that keeps fitting the training text gets worse."""
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz "
    for name in ("train", "val"):
        (tmp_path / f"{name}.txt").write_text("".join(rng.choice(letters) for _ in range(1500)))
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "train.py"), "+experiment=smoke", "data=text_files",
         f"data.train_files=[{tmp_path / 'train.txt'}]", f"data.val_files=[{tmp_path / 'val.txt'}]",
         f"data.cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={run_dir}", "train.dtype=float32",
         "train.max_steps=400", "train.eval_interval=20", "model.n_embd=64", "optim.lr=1e-2",
         "train.early_stop=true", "train.sample_tokens=0"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    warning = next(line for line in result.stderr.splitlines() if "overfitting" in line)
    assert warning.startswith("warning:") and str(run_dir / "checkpoints" / "best") in warning
    assert "scoring the best weights" in result.stderr
    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    flags = [e.value for e in acc.Scalars("val/overfitting")]
    assert flags[-1] == 1.0 and flags[0] == 0.0
    stopped_at = acc.Scalars("val/loss")[-1].step
    assert stopped_at < 400, "early_stop did not stop the run"
    assert "overfitting" in (run_dir / "train.log").read_text()
