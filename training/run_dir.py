"""The run directory: which one a command writes to, and the checks made before anything is
written there.

A new run gets a fresh directory (Hydra's `hydra.run.dir`); `resume=DIR` continues DIR with its
saved config. A directory that already holds checkpoints is never written into by a new run.
"""
from __future__ import annotations

import os
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

from training.checkpoint import atomic_write, holds_checkpoints
from training.config import Config, validate
from training.errors import UserError, first_line


def resolve_run(cfg: DictConfig) -> tuple[Config, Path, bool]:
    """The typed config and the run directory; for `resume=DIR`, the saved config of DIR with
    this command's other overrides on top (e.g. a larger train.max_steps)."""
    if cfg.resume:
        run_dir = Path(cfg.resume)
        saved = run_dir / "config.yaml"
        if not saved.is_file():
            raise UserError(f"cannot resume: {saved} does not exist (is {run_dir} a run directory?)")
        try:
            saved_cfg = OmegaConf.load(saved)
        except Exception as exc:  # YAML syntax, unreadable file
            raise UserError(f"cannot resume: {saved} is not a readable run config: "
                            f"{first_line(exc)}") from exc
        merged = OmegaConf.merge(OmegaConf.structured(Config), saved_cfg)
        # What this command overrode wins over the saved config, taken from the config Hydra has
        # composed (so values are parsed as usual): a key (train.max_steps=...) or a whole group
        # (data=...). Packages such as +experiment=... only select values and are not replayed.
        for override in HydraConfig.get().overrides.task:
            key = override.lstrip("+~").split("=", 1)[0]
            if key == "resume" or key.startswith("hydra.") or ("." not in key and key not in cfg):
                continue
            OmegaConf.update(merged, key, OmegaConf.select(cfg, key), merge=False)
        merged.resume = str(run_dir)
        cfg = merged
    else:
        run_dir = Path(HydraConfig.get().runtime.output_dir)
        if holds_checkpoints(run_dir):
            raise UserError(f"{run_dir} already holds a checkpoint; resume it with resume={run_dir} "
                            "or choose another hydra.run.dir")
    conf: Config = OmegaConf.to_object(cfg)
    try:
        validate(conf)
    except ValueError as exc:
        raise UserError(str(exc)) from exc
    return conf, run_dir, bool(cfg.resume)



LATEST = Path("runs") / "latest"


def link_latest(run_dir: Path) -> None:
    """runs/latest names the newest run, so `python generate.py` finds it without a path.

    A small text file, not a symlink: TensorBoard follows links, so a `latest` link inside
    `--logdir runs` would show the newest run twice."""
    try:
        LATEST.parent.mkdir(exist_ok=True)
        if LATEST.is_symlink() or LATEST.is_dir():  # a link left by an earlier version
            LATEST.unlink()
        atomic_write(LATEST, f"{run_dir.resolve()}\n".encode())
    except OSError:
        pass  # a convenience only


def resolve_latest(path: Path) -> Path:
    """A run directory as given, or the run that a `latest` pointer file names."""
    if path.is_file() and path.name == "latest" and path.stat().st_size < 4096:
        return Path(path.read_text().strip())
    return path


def preflight(argv: list[str]) -> None:
    """Checks that must come before Hydra, which creates hydra.run.dir and writes .hydra/ into it
    before main runs: a directory holding a checkpoint is never written into by a new run, and
    one that cannot be created is reported in one line."""
    if any(a in ("-m", "--multirun") for a in argv):
        return
    try:
        parsed = OverridesParser.create().parse_overrides([a for a in argv if not a.startswith("-")])
    except Exception:  # Hydra reports an unparsable override itself
        return
    options = {o.key_or_group: o.value() for o in parsed if not o.is_delete()}
    run_dir = options.get("hydra.run.dir")
    if not isinstance(run_dir, str) or "${" in run_dir:
        return
    path = Path(run_dir)
    if not options.get("resume") and holds_checkpoints(path):
        raise UserError(f"{path} already holds a checkpoint; resume it with resume={path} "
                        "or choose another hydra.run.dir")
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise UserError(f"cannot create the run directory {path}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"cannot create the run directory {path}: {existing} is not writable")
    try:
        path.mkdir(parents=True, exist_ok=True)  # as Hydra is about to, but with a clear error
    except OSError as exc:
        raise UserError(f"cannot create the run directory {path}: {exc.strerror}") from exc
