"""The keys train.py no longer has, which an older run's config.yaml may still hold.

A switch that a round of docs/budget.md measured and rejected leaves the code after its round is
written up (docs/budget.md says how, and which commit reproduces each round). The run directories
and records/ written while it existed still load: where a saved config is read
(guard/run_dir.py's saved_config), a retired key at its off value, which every run that did not
try the switch wrote, is dropped; at any other value the run needs the code that had the switch,
and is refused in one line that names the commit to check out; so is a command line that sets
one (guard/preflight.py).
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from omegaconf import DictConfig, OmegaConf

from safeio.cli import FormatError

# Each retired key with its off value, under the last commit whose code has it: `git checkout`
# that commit to read a run that used one (docs/budget.md, "Reproducing a round").
RETIRED_AFTER = {
    "2bfc0c4": {
        "model.zero_init_residual": False,  # round 2
        "model.value_residual": False,      # round 4, with the five below
        "model.unet_skips": False,
        "model.xsa": False,
        "model.mtp": 0.0,
        "model.bigram_buckets": 0,
        "model.smear": False,
        "model.activation": None,           # the old name of model.mlp
        "optim.embedding_lr_scale": 1.0,    # rounds 3 and 5
        "optim.embedding_weight_decay": None,
        "train.ema": 0.0,                   # round 4
        "train.ema_start": 0,
        "data.num_proc": None,              # unused since the corpus is tokenized as a stream
    },
}
# key -> (off value, the commit that reads it)
RETIRED = {key: (off, commit) for commit, keys in RETIRED_AFTER.items()
           for key, off in keys.items()}


def drop_retired(saved: DictConfig, path: Path) -> None:
    """Remove from `saved` (a run's config.yaml, as read) the retired keys at their off values;
    refuse (FormatError) one at any other value."""
    written = OmegaConf.to_container(saved, resolve=False)  # the values as written, unresolved
    for key, (off, commit) in RETIRED.items():
        group, name = key.split(".")
        if not isinstance(written.get(group), dict) or name not in written[group]:
            continue
        value = written[group][name]
        if value != off:
            raise FormatError(f"{path}: {key}={_shown(value)} is a switch train.py no longer "
                              f"has (docs/budget.md); `git checkout {commit}` reads this run")
        del saved[group][name]


def retired_override(overrides: Sequence[str]) -> Optional[str]:
    """Why a command line that sets a retired key fails (None when it sets none): Hydra's own
    message would only say the key is not in the schema."""
    for override in overrides:
        key = override.lstrip("+~").split("=", 1)[0]
        if key in RETIRED:
            return (f"{key} is a switch train.py no longer has (docs/budget.md); "
                    f"`git checkout {RETIRED[key][1]}` has it")
    return None


def _shown(value) -> str:
    """A value as YAML writes it, cut short."""
    text = {True: "true", False: "false", None: "null"}.get(value, value) \
        if isinstance(value, (bool, type(None))) else str(value)
    return text if len(text) <= 40 else text[:37] + "..."
