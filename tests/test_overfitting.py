"""The overfitting guard: validation loss rising while training loss falls is reported, with
the best checkpoint named, and train.early_stop stops the run and scores the best weights."""
from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from helpers import REPO_ROOT
from model.config import AttentionConfig
from training.config import Config
from training.evaluate import rising_validation
from training.checkpoint import Progress


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


class Recorder:
    def __init__(self):
        self.scalars, self.texts = [], []

    def add_scalar(self, tag, value, step):
        self.scalars.append((tag, value, step))

    def add_text(self, tag, text, step):
        self.texts.append((tag, text))


def guarded_run(attention: AttentionConfig):
    """What check_overfitting reads of a run, after four evaluations whose causal validation
    loss rose while the training loss fell."""
    history = [[50 * (i + 1), v, t] for i, (v, t) in
               enumerate(zip([2.78, 3.1, 4.2, 6.0], [2.5, 1.9, 0.9, 0.2]))]
    progress = Progress(step=200, best_val=2.78, best_step=50, history=history)
    return SimpleNamespace(progress=progress, cfg=Config(attention=attention), writer=Recorder(),
                           leaky=not attention.is_causal(), overfitting=False, leak_reported=False,
                           metrics={"val_loss": 0.17}, run_dir=Path("runs/x"))


def test_a_leak_is_not_called_overfitting(caplog):
    import train

    run = guarded_run(AttentionConfig(name="mask_zero", mask_value=0.0))
    for _ in range(2):  # said once
        train.check_overfitting(run)
    [(_, message)] = run.writer.texts
    assert "the leak, not overfitting" in message and "attention=mask_zero" in message
    assert "More data or dropout would not help" in message and "step 50" in message
    assert "weight decay, or a smaller model would help" not in message
    assert not run.overfitting  # train.early_stop does not stop a leaky run for it
    assert [v for tag, v, _ in run.writer.scalars if tag == "val/overfitting"] == [0.0, 0.0]


def test_the_same_curves_with_the_correct_mask_are_overfitting():
    import train

    run = guarded_run(AttentionConfig())
    train.check_overfitting(run)
    [(_, message)] = run.writer.texts
    assert "overfitting: validation loss has risen" in message and "More data, dropout" in message
    assert run.overfitting and run.writer.scalars == [("val/overfitting", 1.0, 200)]
