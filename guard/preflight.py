"""Before Hydra: which run directory a train.py command writes to, and every check made before
anything is written anywhere.

A new run gets a fresh directory (Hydra's `hydra.run.dir`); `resume=DIR` continues DIR with its
saved config. Hydra creates hydra.run.dir and writes `.hydra/` into it before train.py's main
runs, so `preflight` decides first, from the command line alone: it composes the config as Hydra
will, resolves the directory (through `..`, symbolic links and interpolations), checks every value
and that the model fits, and only then lets Hydra go on, with the directory spelt out. A resume's
Hydra directory is the run itself, with no `.hydra/` record rewritten, so a resume never leaves a
directory behind and writes only what the resumed training writes. A new run is never placed in
or inside an existing run, and a new run that fails before training leaves nothing.

Once per process: Hydra composes the config again to run main (it cannot be handed ours), and main
takes the typed config preflight settled (`resolve_run`). Each job of a `-m` sweep and the ranks
> 0 of torchrun skip preflight (a sweep's directories are Hydra's; other ranks write nothing), so
for them `resolve_run` settles the config in main.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf, open_dict

from guard.cli import UserError, first_line, hydra_string, one_line
from guard.limits import check_config, check_training_fits, parse_device
from guard.run_dir import is_run, resolved, resume_target, check_resumable, saved_config
from training.checkpoint import holds_checkpoints
from training.config import CONF_DIR, Config, register_configs

# Names a run writes at its top level: a new run refuses a directory holding them (unless it is a
# run that never saved a checkpoint, which it restarts).
RUN_FILES = ("config.yaml", "tokenizer.json", "train.log", ".hydra", "checkpoints")


# ----------------------------------------------------------------------------- the config


@dataclass
class Settled:
    """A run's typed, checked config, its directory, and whether it resumes."""

    cfg: Config
    run_dir: Path
    resuming: bool


def settle(cfg: DictConfig, task_overrides: list[str], output_dir: Path) -> Settled:
    """The run a composed config and its task overrides describe: for `resume=DIR`, the saved
    config of DIR with this command's other overrides on top (e.g. a larger train.max_steps),
    checked in full, with the memory it needs."""
    if cfg.resume:
        run_dir = resume_target(cfg.resume)
        cfg = merge_saved(run_dir, cfg, task_overrides)
    else:
        run_dir = output_dir
        refuse_checkpointed(run_dir)
    if run_dir.exists() and not os.access(run_dir, os.W_OK):
        raise UserError(f"run directory {run_dir} is not writable")
    conf: Config = OmegaConf.to_object(cfg)
    device = parse_device(conf.train.device, "train.device")
    check_config(conf, device)
    check_training_fits(conf, device)
    return Settled(conf, run_dir, bool(cfg.resume))


def merge_saved(run_dir: Path, cfg: DictConfig, task_overrides: list[str]) -> DictConfig:
    """The run's saved config with what this command overrode on top, taken from the config Hydra
    has composed (so values are parsed as usual): a key (train.max_steps=...) or a whole group
    (data=...). Packages such as +experiment=... only select values and are not replayed."""
    merged = saved_config(run_dir / "config.yaml")
    for override in task_overrides:
        key = override.lstrip("+~").split("=", 1)[0]
        if key == "resume" or key.startswith("hydra.") or ("." not in key and key not in cfg):
            continue
        OmegaConf.update(merged, key, OmegaConf.select(cfg, key), merge=False)
    merged.resume = str(run_dir)
    return merged


_this_process: Optional["Preflight"] = None  # what preflight decided, for main and for undo


def resolve_run(cfg: DictConfig) -> Settled:
    """The run main is to train: settled by preflight in this process, or (a job of a `-m`
    sweep, a rank > 0 of torchrun) settled here from the config Hydra composed."""
    if _this_process is not None and _this_process.settled is not None:
        return _this_process.settled
    hydra_cfg = HydraConfig.get()
    return settle(cfg, list(hydra_cfg.overrides.task), Path(hydra_cfg.runtime.output_dir))


def compose(overrides: Sequence[str] = ()) -> Config:
    """The checked config `python train.py <overrides>` would run with, composed by Hydra from
    conf/: benches and tests use the shipped configs instead of restating defaults."""
    composed = _compose(overrides, hydra_node=False)
    conf: Config = OmegaConf.to_object(composed)
    check_config(conf)
    return conf


def _compose(argv: Sequence[str], hydra_node: bool = True) -> DictConfig:
    """The config Hydra will compose for these overrides (with its `hydra` node). Where it does
    not compose, Hydra would fail the same way: the reason is reported now (some of Hydra's own
    reports are tracebacks)."""
    from hydra import compose as hydra_compose, initialize_config_dir

    register_configs()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = hydra_compose("config", overrides=list(argv), return_hydra_config=hydra_node)
    except Exception as exc:
        raise UserError(one_line(exc)) from exc
    if hydra_node:
        HydraConfig.instance().set_config(cfg)  # for ${hydra:...} in hydra.run.dir
    unknown = _added_keys(cfg, "")
    if unknown:
        raise UserError(f"{unknown[0]} is not a key of the config (added with +); check its "
                        f"spelling against conf/")
    return cfg


def _added_keys(node, prefix: str) -> list[str]:
    """Keys of node (recursively) that its schema dataclass does not have: `+model.width=3`
    adds one, which would be silently ignored."""
    if not isinstance(node, DictConfig):
        return []
    schema = OmegaConf.get_type(node)
    known = {f.name for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) \
        else None
    found = []
    for key in node.keys():
        name = f"{prefix}{key}"
        if known is not None and key not in known and name != "hydra":
            found.append(name)
        elif name != "hydra":
            found += _added_keys(node._get_node(key), f"{name}.")
    return found


# ----------------------------------------------------------------------------- before Hydra


@dataclass
class Preflight:
    """What preflight decided: the command line Hydra gets, the run it settled, and what to undo
    if the run fails."""

    argv: list[str]
    settled: Optional[Settled] = None
    run_dir: Optional[Path] = None        # a new run's directory
    created: list = field(default_factory=list)  # directories it created, innermost first
    names_before: Optional[set] = None    # entries of run_dir before, if it existed

    def undo(self) -> None:
        """A new run failed: if it never started training (no checkpoint, no TensorBoard
        events), remove what this command wrote."""
        path = self.run_dir
        if path is None or not path.is_dir() or holds_checkpoints(path) \
                or any(path.glob("events.out.tfevents.*")):
            return
        if self.names_before is not None:
            for name in set(os.listdir(path)) - self.names_before:
                entry = path / name
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
            return
        shutil.rmtree(path, ignore_errors=True)
        for parent in self.created[1:]:  # created above it (e.g. runs/): only if left empty
            try:
                parent.rmdir()
            except OSError:
                break


def preflight(argv: list[str]) -> list[str]:
    """Checks that must come before Hydra, which creates hydra.run.dir and writes .hydra/ into it
    before main runs. Returns the command line to give Hydra: the run directory spelt out (a
    resume's is the run itself, without a new .hydra/ record)."""
    global _this_process
    _this_process = _preflight(argv)
    return _this_process.argv


def undo_failed_run() -> None:
    """What this process's preflight created for a new run that failed before training."""
    if _this_process is not None:
        _this_process.undo()


def _preflight(argv: list[str]) -> Preflight:
    if any(a.startswith("-") for a in argv):  # -m, --cfg, --help ...: Hydra's own modes
        return Preflight(argv)
    parser = OverridesParser.create()
    parsed = []
    for arg in argv:
        try:
            parsed += parser.parse_overrides([arg])
        except Exception as exc:
            raise UserError(f"cannot parse the override {arg!r}: {one_line(exc)}") from None
        if not parsed[-1].key_or_group:
            raise UserError(f"the override {arg!r} names no key")
    options = {o.key_or_group: o.value() for o in parsed if not o.is_delete()}
    placement = {"hydra.run.dir", "hydra.output_subdir"}
    rest = [o.input_line for o in parsed if o.key_or_group not in placement]
    if options.get("resume"):
        run = resume_target(options["resume"])
        check_resumable(run)
        composed = _compose(argv)
        if "hydra.run.dir" in options:
            given = _hydra_run_dir(composed)
            if not isinstance(given, str) or resolved(Path(given)) != run:
                raise UserError(f"resume={options['resume']} continues {run} in place; leave "
                                f"hydra.run.dir out (it names {given})")
        settled = settle(_task_config(composed), list(composed.hydra.overrides.task), run)
        return Preflight(rest + [f"hydra.run.dir={_quoted(run)}", "hydra.output_subdir=null"],
                         settled)
    composed = _compose(argv)
    raw = _hydra_run_dir(composed)
    if not isinstance(raw, str) or not raw:
        raise UserError(f"hydra.run.dir must be a directory path, got {raw!r}")
    path = resolved(Path(raw))
    check_new_run_dir(path, composed.hydra.output_subdir)
    settled = settle(_task_config(composed), list(composed.hydra.overrides.task), path)
    plan = create_run_dir(path, unique="hydra.run.dir" not in options)
    plan.settled = dataclasses.replace(settled, run_dir=plan.run_dir)
    plan.argv = rest + [f"hydra.run.dir={_quoted(plan.run_dir)}"] \
        + [o.input_line for o in parsed if o.key_or_group == "hydra.output_subdir"]
    return plan


def _hydra_run_dir(cfg: DictConfig):
    try:
        return OmegaConf.select(cfg, "hydra.run.dir", throw_on_resolution_failure=True)
    except Exception as exc:
        raise UserError(f"cannot resolve hydra.run.dir: {first_line(exc)}") from None


def _task_config(composed: DictConfig) -> DictConfig:
    cfg = composed.copy()
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg


def _quoted(path: Path) -> str:
    """path as a Hydra override value; `${` would be read as an interpolation even quoted."""
    if "${" in str(path):
        raise UserError(f"the run directory {path} contains '${{', which Hydra would read as an "
                        f"interpolation; choose another hydra.run.dir")
    return hydra_string(str(path))


# ----------------------------------------------------------------------------- placement


def refuse_checkpointed(path: Path) -> None:
    """A new run never starts where checkpoints are: it would overwrite them."""
    if holds_checkpoints(path):
        raise UserError(f"{path} already holds a checkpoint; resume it with resume={path} "
                        "or choose another hydra.run.dir")


def check_new_run_dir(path: Path, output_subdir: Optional[str]) -> None:
    """A new run's directory (resolved) must not hold a checkpoint, lie inside a run, or hold
    files of something that is not a run; and it must be possible to create."""
    refuse_checkpointed(path)
    for parent in path.parents:
        if is_run(parent) or holds_checkpoints(parent):
            raise UserError(f"hydra.run.dir {path} is inside the run {parent}; a new run goes "
                            f"into a directory of its own")
    if path.exists() or path.is_symlink():
        if not path.is_dir():
            raise UserError(f"cannot create the run directory {path}: it exists and is not a "
                            f"directory")
        if not is_run(path):
            clash = sorted(n for n in RUN_FILES if os.path.lexists(path / n))
            if clash:
                raise UserError(f"{path} holds {', '.join(clash)} but is not a run directory; "
                                f"a new run would overwrite them: choose a new or empty "
                                f"hydra.run.dir")
    if output_subdir is not None:
        inner = resolved(path / str(output_subdir))
        if inner != path and path not in inner.parents:
            raise UserError(f"hydra.output_subdir={output_subdir} leads out of the run directory "
                            f"{path}")
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise UserError(f"cannot create the run directory {path}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"cannot create the run directory {path}: {existing} is not writable")


def create_run_dir(path: Path, unique: bool) -> Preflight:
    """Create the new run's directory (recording what was created, to undo a failed run). With
    unique (the default timestamped name), a directory another run created in the same second
    is not shared: this run takes the name with _2, _3, ... appended."""
    missing = []
    parent = path.parent
    while not parent.exists():
        missing.append(parent)
        parent = parent.parent
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        for i in range(1, 1000):
            candidate = path if i == 1 else path.with_name(f"{path.name}_{i}")
            try:
                candidate.mkdir()
                return Preflight([], run_dir=candidate, created=[candidate, *missing])
            except FileExistsError:
                if not unique:
                    return Preflight([], run_dir=candidate, created=[],
                                     names_before=set(os.listdir(candidate)))
    except OSError as exc:
        raise UserError(f"cannot create the run directory {path}: {exc.strerror}") from exc
    raise UserError(f"cannot create the run directory {path}: too many runs of that name")
