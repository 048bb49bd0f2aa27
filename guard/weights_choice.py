"""Which checkpoint of a run the tools sample from and draw (`weights=`), and the words that say
which one it was.

A run keeps two sets of weights: `best`, those with the lowest *causal* validation loss so far,
and `latest`, the last checkpoint. For a correct model the best ones are what the run learned.
For a leaky variant (mask_zero, ...) they are not: its causal loss is lowest early (step 50 in
the study), before the model learns to read the tokens it should predict, and climbs from then
on. So `weights=auto`, the default, takes `best` for a causal run and `latest` for a leaky one:
the weights that show what the pitfall learned. Every tool names what it loaded.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from omegaconf import OmegaConf

from guard.run_dir import saved_config
from model.config import AttentionConfig
from safeio.checkpoint import read_pointer
from safeio.cli import UserError
from safeio.files import read_text
from training.checkpoint import CHECKPOINTS, WEIGHTS

WEIGHTS_CHOICES = ("auto", "best", "latest")


@dataclass
class Chosen:
    """The checkpoint a tool loads: its kind (best | latest, or `folder` for a model folder), its
    step where known, and a note when the choice needs a word (a leaky run)."""

    kind: str
    step: Optional[int] = None
    causal_loss: Optional[float] = None  # best: the causal validation loss it was kept for
    note: str = ""

    def describe(self) -> str:
        """e.g. `best weights (step 1750, causal val loss 4.1100)`, `latest weights (step 400)`."""
        if self.kind == "folder":
            return "the folder's weights"
        facts = [f"step {self.step}"] if self.step is not None else []
        if self.causal_loss is not None:
            facts.append(f"causal val loss {self.causal_loss:.4f}")
        return f"{self.kind} weights" + (f" ({', '.join(facts)})" if facts else "")


def choose_weights(run_dir: Path, which: str) -> Chosen:
    """What `weights=which` loads from run_dir. Reads only the run's config and the checkpoint
    pointers (each checked as guard/ checks them); the weights themselves are load_run's."""
    if which not in WEIGHTS_CHOICES:
        raise UserError(f"weights must be auto, best or latest, got {which!r}")
    config = run_dir / "config.yaml"
    if not config.is_file():  # a model folder, or not a run at all (load_run says which)
        return Chosen("folder" if (run_dir / "config.json").is_file() else
                      ("best" if which == "auto" else which))
    attention = _attention(config)
    leaky = attention is not None and not attention.is_causal()
    kind = ("latest" if leaky else "best") if which == "auto" else which
    if kind == "best" and not os.path.lexists(run_dir / CHECKPOINTS / "best" / WEIGHTS):
        kind = "latest"  # no evaluation yet: find_weights falls back to the latest checkpoint
    best = _best_info(run_dir)
    chosen = Chosen(kind, *(best if kind == "best" else (_latest_step(run_dir), None)))
    if leaky and chosen.kind == "latest" and best[0] is not None and best[0] != chosen.step:
        chosen.note = (f"attention={attention.name} leaks, so these are the latest weights: what "
                       f"the leak learned (weights=best is step {best[0]}, the lowest causal loss, "
                       f"before it learned to read ahead)")
    elif leaky and chosen.kind == "best":
        chosen.note = (f"attention={attention.name} leaks: weights=best is the lowest causal loss, "
                       f"before the model learned to read ahead; weights=auto or latest shows "
                       f"what the leak learned")
    return chosen


def _attention(config: Path) -> Optional[AttentionConfig]:
    """The run's attention variant; None where config.yaml cannot say (load_run will)."""
    try:
        return OmegaConf.to_object(saved_config(config).attention)
    except (UserError, OSError, ValueError):
        return None


def _best_info(run_dir: Path) -> tuple[Optional[int], Optional[float]]:
    """(step, causal val loss) of checkpoints/best, from its info.txt."""
    info = run_dir / CHECKPOINTS / "best" / "info.txt"
    try:
        text = read_text(info, "best checkpoint's info", 4096) if info.exists() else ""
    except (UserError, OSError):
        return None, None
    step = re.search(r"^step (\d+)$", text, re.M)
    loss = re.search(r"^val_loss ([0-9.eE+-]+)$", text, re.M)
    return (int(step[1]) if step else None, float(loss[1]) if loss else None)


def _latest_step(run_dir: Path) -> Optional[int]:
    try:
        name = read_pointer(run_dir / CHECKPOINTS / "latest")
    except (UserError, OSError):
        return None  # load_run reports what is wrong with it
    return int(name[len("step_"):]) if name and name[len("step_"):].isdigit() else None
