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
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional, Sequence

from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from data.config import Source, TokenizerConfig, TokenizerKind
from data.corpus import check_split_overlap
from guard.cli import UserError, first_line, hydra_string, one_line
from guard.corpus import load_tokenizer
from guard.files import MAX_CONFIG_BYTES, dump_run_config, literal, parse_run_config
from guard.limits import check_config, check_text, check_training_fits, parse_device
from guard.run_dir import (check_resumable, is_model_folder, is_run, read_source, resolved,
                           resume_target, saved_config)
from guard.run_lock import lock_run, unlock_run
from guard.sweep import SweepPlan, plan_sweep
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
    checked in full, with the memory it needs. A new run's config must also read back as it will
    be written (config.yaml), its init_from folder and tokenizer file are read and checked, and
    its training and validation texts must not overlap."""
    if cfg.resume:
        run_dir = resume_target(cfg.resume)
        cfg = merge_saved(run_dir, cfg, task_overrides)
    else:
        run_dir = output_dir
        refuse_checkpointed(run_dir)
    if run_dir.exists() and not os.access(run_dir, os.W_OK):
        raise UserError(f"run directory {run_dir} is not writable")
    conf: Config = OmegaConf.to_object(cfg)
    if conf.init_from and not cfg.resume:
        conf = start_from_folder(conf)
    device = parse_device(conf.train.device, "train.device")
    check_config(conf, device)
    vocab = None
    if conf.tokenizer.kind is TokenizerKind.file:
        vocab = load_tokenizer(Path(conf.tokenizer.path)).get_vocab_size()
    if conf.data.source is not Source.shakespeare:  # (whose works are split by name)
        check_split_overlap(conf.data)  # the files exist, are texts, and do not overlap
    check_training_fits(conf, device, vocab)
    if not cfg.resume:
        check_saved_config(conf)
    return Settled(conf, run_dir, bool(cfg.resume))


def start_from_folder(conf: Config) -> Config:
    """init_from=<model folder>: the folder's model shape and tokenizer in place of the config's
    (dropout and the attention variant stay the run's); train.py loads its weights."""
    folder = resolved(Path(conf.init_from))
    if not is_model_folder(folder):
        raise UserError(f"init_from={conf.init_from} is not a model folder (config.json, "
                        f"model.safetensors, tokenizer.json); to continue a run of train.py, "
                        f"use resume=")
    source = read_source(folder)
    model = replace(source.cfg.model, dropout=conf.model.dropout,
                    attn_dropout=conf.model.attn_dropout)
    tokenizer = TokenizerConfig(kind=TokenizerKind.file, path=str(folder / "tokenizer.json"))
    return replace(conf, model=model, tokenizer=tokenizer, init_from=str(folder))


def check_saved_config(conf: Config) -> None:
    """What train.py will write as the run's config.yaml must read back as this config, within
    the limits generate.py and the scripts read it with (guard/files.py)."""
    text = dump_run_config(conf)
    size = len(text.encode("utf-8"))
    if size > MAX_CONFIG_BYTES:
        raise UserError(f"this run's config.yaml would be {size:,} bytes, more than the "
                        f"{MAX_CONFIG_BYTES:,} a run's config may hold (a corpus listed file by "
                        f"file? give data.train_files a folder instead)")
    try:
        back = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config),
                                                   parse_run_config(text, Path("config.yaml"))))
    except (UserError, OmegaConfBaseException) as exc:
        raise UserError(f"this run's config could not be read back from its config.yaml: "
                        f"{first_line(exc)}") from None
    if back != conf:
        key = _first_difference(dataclasses.asdict(back), dataclasses.asdict(conf))
        raise UserError(f"{key} would not read back from config.yaml as given; choose another "
                        f"value")


def _first_difference(a, b, prefix: str = "") -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in b:
            if a.get(key) != b[key]:
                return _first_difference(a.get(key), b[key], f"{prefix}{key}.")
    return prefix.rstrip(".") or "the config"


def merge_saved(run_dir: Path, cfg: DictConfig, task_overrides: list[str]) -> DictConfig:
    """The run's saved config with what this command overrode on top, taken from the config Hydra
    has composed (so values are parsed as usual): a key (train.max_steps=...) or a whole group
    (data=...). Packages such as +experiment=... only select values and are not replayed. The
    values are resolved, and set as literals (a `${` in one is text)."""
    merged = saved_config(run_dir / "config.yaml")
    for override in task_overrides:
        key = override.lstrip("+~").split("=", 1)[0]
        if key == "resume" or key.startswith("hydra.") or ("." not in key and key not in cfg):
            continue
        value = OmegaConf.select(cfg, key)
        group = isinstance(value, DictConfig)  # a whole group: every key of it, merged in
        if isinstance(value, (DictConfig, ListConfig)):
            value = OmegaConf.to_container(value, resolve=True, enum_to_str=True)
        OmegaConf.update(merged, key, literal(value), merge=group)
    merged.resume = str(run_dir)
    return merged


_this_process: Optional["Preflight"] = None  # what preflight decided, for main and for undo


def resolve_run(cfg: DictConfig) -> Settled:
    """The run main is to train: settled by preflight in this process (a single run, or the arm
    of a `-m` sweep that Hydra is running), or (a rank > 0 of torchrun) settled here from the
    config Hydra composed. Rank 0 holds the run's lock from here on (release_run)."""
    hydra_cfg = HydraConfig.get()
    if _this_process is not None and _this_process.sweep is not None:
        arm = _this_process.sweep.arm_at(resolved(Path(hydra_cfg.runtime.output_dir)))
        if arm is None:
            raise UserError(f"Hydra runs the sweep job {hydra_cfg.runtime.output_dir}, which "
                            f"train.py did not plan")
        lock_run(arm.settled.run_dir)
        return arm.settled
    if _this_process is not None and _this_process.settled is not None:
        return _this_process.settled
    return settle(cfg, list(hydra_cfg.overrides.task), Path(hydra_cfg.runtime.output_dir))


def release_run(settled: Settled) -> None:
    """A sweep's arm is done: its directory is free for others (a single run's lock is held to
    the end of the process)."""
    if _this_process is not None and _this_process.sweep is not None:
        unlock_run(settled.run_dir)


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
    """What preflight decided: the command line Hydra gets, the run it settled (or the sweep it
    planned), and what to undo if the run fails."""

    argv: list[str]
    settled: Optional[Settled] = None
    run_dir: Optional[Path] = None        # a new run's directory
    created: list = field(default_factory=list)  # directories it created, innermost first
    names_before: Optional[set] = None    # entries of run_dir before, if it existed
    sweep: Optional[SweepPlan] = None     # a -m sweep's arms

    def undo(self) -> None:
        """A new run (or a sweep) failed: remove what this command wrote for any run that never
        started training (no checkpoint, no TensorBoard events)."""
        if self.sweep is not None:
            self.sweep.undo(trained)
        path = self.run_dir
        if path is None or not path.is_dir() or trained(path):
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


def trained(path: Path) -> bool:
    """Whether a run has started training: a checkpoint, or TensorBoard events."""
    return holds_checkpoints(path) or any(path.glob("events.out.tfevents.*"))


def preflight(argv: list[str]) -> list[str]:
    """Checks that must come before Hydra, which creates hydra.run.dir and writes .hydra/ into it
    before main runs. Returns the command line to give Hydra: the run directory spelt out (a
    resume's is the run itself, without a new .hydra/ record), or a sweep's directories."""
    global _this_process
    _this_process = _preflight(argv)
    return _this_process.argv


def undo_failed_run() -> None:
    """What this process's preflight created for a new run that failed before training."""
    if _this_process is not None:
        _this_process.undo()


# Hydra's options (hydra/_internal/utils.py): those that only show something, and those that
# would make Hydra compose another config than the one preflight checks.
SHOWING = {"--help", "-h", "--hydra-help", "--version", "--cfg", "-c", "--info", "-i",
           "--shell-completion", "-sc"}
UNSUPPORTED = {"--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd",
               "--experimental-rerun"}


def _options(argv: list[str]) -> tuple[set, list[str]]:
    """(the options given, the overrides) of a command line, parsed by Hydra's own parser; a
    mistake in them as a UserError (argparse would print its usage and several lines)."""
    from hydra._internal.utils import get_args_parser

    parser = get_args_parser()

    def refuse(message: str):
        raise UserError(f"{message} (python train.py --help lists the options)")

    parser.error = refuse
    parser.exit = lambda status=0, message=None: refuse((message or "").strip() or "bad option")
    flags = {a.split("=", 1)[0] for a in argv if a.startswith("-")}
    if "--version" in flags:
        return flags, argv  # argparse prints and exits: Hydra's own, untouched
    args = parser.parse_intermixed_args(argv)  # (flags anywhere: Hydra gets them first)
    unsupported = sorted(flags & UNSUPPORTED)
    if unsupported and not flags & SHOWING:
        raise UserError(f"{unsupported[0]} is not supported: train.py composes conf/config.yaml "
                        f"(choose configs with overrides such as +experiment=..., or add a config "
                        f"directory with hydra.searchpath=[file:///path/to/conf])")
    modes = [name for name, given in (("--run", args.run), ("--multirun", args.multirun),
                                      ("--cfg", args.cfg), ("--info", args.info),
                                      ("--shell-completion", args.shell_completion)) if given]
    if len(modes) > 1:
        raise UserError(f"{' and '.join(modes)} exclude each other: give one of --run, "
                        f"--multirun, --cfg, --info and --shell-completion")
    if (args.resolve or args.package) and not args.cfg:
        raise UserError("--resolve and --package only go with --cfg (job, hydra or all)")
    return flags, list(args.overrides)


def _preflight(argv: list[str]) -> Preflight:
    for arg in argv:  # (Hydra's parser would say "token recognition error")
        check_text(arg, f"the argument {arg[:40]!r}")
    flags, overrides = _options(argv)
    if flags & SHOWING:  # Hydra prints a config or its help, and runs nothing
        return Preflight(argv)
    if flags & {"--multirun", "-m"}:
        hydra_argv, plan = plan_sweep(overrides, settle, check_new_run_dir, create_run_dir)
        try:
            lock_run(plan.sweep_dir)
        except BaseException:
            plan.undo(trained)
            raise
        return Preflight(hydra_argv, sweep=plan)
    argv = overrides
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
        lock_run(run)  # after every check, before anything is written
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
    try:
        lock_run(plan.run_dir)
    except BaseException:
        plan.undo()
        raise
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
