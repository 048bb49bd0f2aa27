"""Before a run: the config composed once, every value and the run's directory checked, and only
then the directory made.

train.py composes its config with Hydra's Compose API (`initialize_config_dir` and `compose`), not
with `@hydra.main`, which creates the run directory and writes `.hydra/` into it before the program
runs: here the command line is parsed, the config composed, its values, memory and directory
checked, and the directory created, in that order, so that a command refused writes nothing. What
`@hydra.main` would do for the run is then done by `Launch.jobs`, which yields each run to train:
its logging (conf/hydra/job_logging) and the `.hydra/` record of its config and overrides.

A new run gets a fresh directory (`hydra.run.dir`); `resume=DIR` continues DIR with its saved
config, writing no `.hydra/` record. A new run is never placed in or inside an existing run, and
a new run that fails before training leaves nothing (`Launch.undo`). A `-m` sweep (guard/sweep.py)
composes and checks every arm before the first trains; each arm's directory is made at its turn.
"""
from __future__ import annotations

import argparse
import dataclasses
import enum
import functools
import json
import logging.config
import os
import shutil
import sys
import textwrap
import typing
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import torch

from hydra import compose as hydra_compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict, read_write
from omegaconf.errors import OmegaConfBaseException

from data.config import Order, Source, TokenizerConfig, TokenizerKind
from data.corpus import check_split_overlap
from safeio.cli import (UserError, exit_with, first_line, hydra_string, one_line,
                        python_command, run_cli)
from safeio.corpus import load_tokenizer
from safeio.files import (MAX_CONFIG_BYTES, dump_run_config, literal, parse_run_config,
                          read_json, why_not_creatable)
from safeio.key_help import closest, key_help, type_words
from guard.limits import (check_config, check_fused_kernel, check_text, check_training_fits,
                          parse_device)
from guard.run_dir import (check_resumable, corpus_of_run, is_model_folder, is_run,
                           load_folder_weights, read_source, refuse_folder_overrides, resolved,
                           resume_target, saved_config)
from guard.retired import retired_override
from safeio.run_lock import lock_run, release_locks, remember_command, unlock_run
from safeio.system import parse_launch
from guard.sweep import MAX_NAME, arm_names, expand
from guard.workers import oversubscription, train_in_workers, worker_count
from model.gpt import GPT
from training.checkpoint import holds_checkpoints, latest_checkpoint
from training.config import CONF_DIR, Config, register_configs

# Names a run writes at its top level: a new run refuses a directory holding them (unless it is a
# run that never saved a checkpoint, which it restarts).
RUN_FILES = ("config.yaml", "tokenizer.json", "train.log", ".hydra", "checkpoints")
# A sweep's record of its command line (its overrides), which `resume=<sweep directory>` replays
# to train the runs that did not finish; beside Hydra's multirun.yaml (the composed config).
SWEEP_RECORD = "sweep.json"
# Hydra's launchers that train.py runs: basic (one run after the other, in this process) and
# ours, conf/hydra/launcher/processes.yaml (worker processes, guard/workers.py).
LAUNCHERS = ("basic", "processes")


# ----------------------------------------------------------------------------- the config


@dataclass
class Settled:
    """A run's typed, checked config, its directory, and whether it resumes."""

    cfg: Config
    run_dir: Path
    resuming: bool
    device: torch.device    # train.device, parsed


def settle(cfg: DictConfig, task_overrides: list[str], output_dir: Path) -> Settled:
    """The run a composed config and its task overrides describe: for `resume=DIR`, the saved
    config of DIR with this command's other overrides on top (e.g. a larger train.max_steps),
    checked in full, with the memory it needs, its corpus read through this command's cache
    (corpus_of_run). A new run's config must also read back as it will be written (config.yaml),
    its init_from folder and tokenizer file are read and checked, and its training and
    validation texts must not overlap."""
    own = cfg.data  # this command's: its command line, or conf/
    if cfg.resume:
        run_dir = resume_target(cfg.resume)
        cfg = merge_saved(run_dir, cfg, task_overrides)
    else:
        run_dir = output_dir
        refuse_checkpointed(run_dir)
    if run_dir.exists() and not os.access(run_dir, os.W_OK):
        raise UserError(f"run directory {run_dir} is not writable")
    conf: Config = OmegaConf.to_object(cfg)
    if conf.train.fewer_steps is not None and not cfg.resume:
        raise UserError("train.fewer_steps is what train.py writes when a run trains fewer steps "
                        "than train.max_steps; a new run leaves it out")
    if cfg.resume:  # the cache and what may be fetched are this command's (corpus_of_run)
        if conf.data.cache_dir != own.cache_dir:
            print(f"note: the run's data.cache_dir {conf.data.cache_dir} is not used (a run "
                  f"directory does not choose where to write): this resume reads and builds "
                  f"its corpus in {own.cache_dir}; give data.cache_dir= to choose",
                  file=sys.stderr)
        conf = replace(conf, data=corpus_of_run(conf.data, own.cache_dir, own.package))
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
    return Settled(conf, run_dir, bool(cfg.resume), device)


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


def start_model(model: GPT, cfg: Config, resuming: bool, device: torch.device,
                dtype: torch.dtype) -> GPT:
    """The new model of a run, on device, as its config asks: a new run with init_from= starts
    from the folder's weights (start_from_folder gave it the folder's shape), and attention.impl=
    fused is refused where our kernel fails its self-check on device (impl=auto then runs the
    reference attention)."""
    if cfg.init_from and not resuming:
        load_folder_weights(model, Path(cfg.init_from))
    model = model.to(device)
    check_fused_kernel(model, device, dtype)
    return model


def check_saved_config(conf: Config) -> None:
    """What train.py will write as the run's config.yaml must read back as this config, within
    the limits generate.py and the scripts read it with (safeio/files.py)."""
    text = dump_run_config(conf)
    size = len(text.encode("utf-8"))
    if size > MAX_CONFIG_BYTES:
        raise UserError(f"this run's config.yaml would be {size:,} bytes, more than the "
                        f"{MAX_CONFIG_BYTES:,} a run's config may hold (a corpus listed file by "
                        f"file? give data.train_files a folder instead)")
    try:
        back = OmegaConf.to_object(OmegaConf.merge(_schema(),  # (merge copies it)
                                                   parse_run_config(text, Path("config.yaml"))))
    except (UserError, OmegaConfBaseException) as exc:
        raise UserError(f"this run's config could not be read back from its config.yaml: "
                        f"{first_line(exc)}") from None
    if back != conf:
        key = _first_difference(dataclasses.asdict(back), dataclasses.asdict(conf))
        raise UserError(f"{key} would not read back from config.yaml as given; choose another "
                        f"value")


@functools.lru_cache(maxsize=1)
def _schema() -> DictConfig:
    """The typed, empty Config, made once: a third of each arm's check_saved_config."""
    return OmegaConf.structured(Config)


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
    values are resolved, and set as literals (a `${` in one is text). data.order cannot change:
    the checkpoint's sampler state is that order's."""
    merged = saved_config(run_dir / "config.yaml")
    order = merged.data.order
    for override in task_overrides:
        key = override.lstrip("+~").split("=", 1)[0]
        if key == "resume" or key.startswith("hydra.") or ("." not in key and key not in cfg):
            continue
        value = OmegaConf.select(cfg, key)
        group = isinstance(value, DictConfig)  # a whole group: every key of it, merged in
        if isinstance(value, (DictConfig, ListConfig)):
            value = OmegaConf.to_container(value, resolve=True, enum_to_str=True)
        OmegaConf.update(merged, key, literal(value), merge=group)
    if merged.data.order != order:
        raise UserError(f"data.order={Order(merged.data.order).value}: {run_dir} trained with "
                        f"data.order={Order(order).value}, and a resume continues its batches "
                        f"where they stopped; leave data.order out")
    merged.resume = str(run_dir)
    return merged


# ----------------------------------------------------------------------------- continuing a sweep


def sweep_to_continue(resume: str) -> Optional[Path]:
    """The sweep directory `resume=` names (one holding the sweep's record), or None when it
    names something else (a run)."""
    path = resume_target(resume)
    if (path / SWEEP_RECORD).is_file():
        return path
    if (path / "multirun.yaml").is_file() and not is_run(path):
        raise UserError(f"cannot resume the sweep {path}: it was started by an earlier version, "
                        f"which kept no record of its command ({SWEEP_RECORD}); resume each of "
                        f"its runs with python train.py resume=<run>")
    return None


def recorded_sweep(sweep: Path, overrides: list[str]) -> list[str]:
    """The overrides of the command that started `sweep` (its record), its directory pinned,
    with this command's choice of launcher (hydra/launcher=..., hydra.launcher.n_jobs=...) on
    top. Anything else would make the sweep's runs differ from the ones it started with."""
    other = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") != "resume"
             and not o.lstrip("+~").startswith(("hydra/launcher=", "hydra.launcher."))]
    if other:
        raise UserError(f"resume={sweep} continues the sweep as it was started, and takes no "
                        f"overrides but the launcher's (got {other[0]}); to change a run, "
                        f"resume it alone: python train.py resume=<run> {other[0]}")
    record = read_json(sweep / SWEEP_RECORD, "the sweep's record", MAX_CONFIG_BYTES)
    lines = record.get("overrides")
    if not isinstance(lines, list) or not all(isinstance(o, str) for o in lines):
        raise UserError(f"{sweep / SWEEP_RECORD} is not a sweep record of train.py (its "
                        f"'overrides' must be a list of strings)")
    lines = [o for o in lines if o.split("=", 1)[0] != "hydra.sweep.dir"]
    return lines + [f"hydra.sweep.dir={hydra_string(str(sweep))}"] + \
        [o for o in overrides if o.split("=", 1)[0].lstrip("+~") != "resume"]


def finished(run: Path) -> bool:
    """Whether a run has trained all its steps: its latest checkpoint is of its config's
    train.max_steps (checkpoints are named step_<N>, training/checkpoint.py)."""
    latest = latest_checkpoint(run)
    if latest is None:
        return False
    steps = saved_config(run / "config.yaml").train.max_steps
    return int(latest.name.rsplit("_", 1)[-1]) >= steps


def resumed(composed: DictConfig, run: Path) -> Settled:
    """An arm of a sweep that started before, continued from its latest checkpoint."""
    check_resumable(run)
    task = _task(composed)
    task.resume = str(run)
    return settle(task, [], run)


# ----------------------------------------------------------------------------- composing


def compose(overrides: Sequence[str] = ()) -> Config:
    """The checked config `python train.py <overrides>` would run with, composed by Hydra from
    conf/: benches and tests use the shipped configs instead of restating defaults."""
    with _hydra():
        conf: Config = OmegaConf.to_object(_task(_compose(overrides)))
    check_config(conf)
    return conf


def check_new_run(overrides: Sequence[str], run_dir: Path) -> Config:
    """The checked config of `python train.py <overrides> hydra.run.dir=<run_dir>`, after every
    check train.py makes before it creates the run's directory (the directory's place, every
    value, the memory it needs), creating nothing: bench.record checks each seed's run before
    the first one trains."""
    with _hydra():
        cfg = _compose(overrides)
        check_new_run_dir(resolved(run_dir), cfg.hydra.output_subdir)
        return settle(_task(cfg), list(overrides), resolved(run_dir)).cfg


@contextmanager
def _hydra() -> Iterator[None]:
    """Hydra set up to compose conf/ (its job named train: the log is train.log)."""
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="train"):
        yield


def _compose(overrides: Sequence[str]) -> DictConfig:
    """The config of these overrides, with its `hydra` node; a key added with + that the schema
    does not have is refused (it would be silently ignored)."""
    try:
        cfg = hydra_compose("config", overrides=list(overrides), return_hydra_config=True)
    except Exception as exc:
        raise UserError(retired_override(overrides) or unknown_key(overrides)
                        or one_line(exc)) from exc
    HydraConfig.instance().set_config(cfg)  # for ${hydra:...}, and the run's record of choices
    unknown = _added_key(cfg)
    if unknown:
        guess = closest(unknown, config_keys())
        raise UserError(f"{unknown} is not a key of the config (added with +)"
                        + (f": did you mean {guess}?" if guess else "")
                        + f" ({python_command()} train.py --help all lists the keys)")
    return cfg


def config_keys(schema: type = Config, prefix: str = "") -> dict[str, str]:
    """Every key of the typed config, dotted (model.n_layer), with its description: the comment
    its dataclass gives it (safeio/key_help.py), an enum's values, or else its type."""
    out = {}
    words = key_help(schema)
    for name, hint in typing.get_type_hints(schema).items():
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = args[0] if typing.get_origin(hint) is typing.Union and len(args) == 1 else hint
        if dataclasses.is_dataclass(hint):
            out.update(config_keys(hint, f"{prefix}{name}."))
        elif isinstance(hint, type) and issubclass(hint, enum.Enum):
            out[f"{prefix}{name}"] = " ".join([words.get(name, ""), f"({type_words(hint)})"]).strip()
        else:
            out[f"{prefix}{name}"] = words.get(name) or type_words(hint)
    return out


def unknown_key(overrides: Sequence[str]) -> Optional[str]:
    """The first override that names no key of the config, said with the key it is closest to:
    Hydra's own message would advise adding it with +, which the schema then refuses too."""
    keys = config_keys()
    sections = {key.split(".")[0] for key in keys}
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        if key in keys or key in sections or key.startswith(("hydra.", "hydra/")) or \
                ("." not in key and (CONF_DIR / key).is_dir()):
            continue
        by_name = {k.rsplit(".", 1)[-1]: k for k in keys}  # n_layers=2: model.n_layer
        guess = closest(key, keys) or by_name.get(closest(key.rsplit(".", 1)[-1], by_name))
        return (f"{key} is not a key of the config" + (f": did you mean {guess}?" if guess else "")
                + f" ({python_command()} train.py --help all lists the keys)")
    return None


def _added_key(node: DictConfig, prefix: str = "") -> Optional[str]:
    """The first key of node (recursively) that its schema dataclass does not have."""
    schema = OmegaConf.get_type(node)
    known = {f.name for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) \
        else None
    for key in node.keys():
        name = f"{prefix}{key}"
        if name == "hydra":
            continue
        if known is not None and key not in known:
            return name
        if not (OmegaConf.is_missing(node, key) or OmegaConf.is_interpolation(node, key)) \
                and isinstance(node[key], DictConfig):
            found = _added_key(node[key], f"{name}.")
            if found:
                return found
    return None


def _task(cfg: DictConfig) -> DictConfig:
    """The config without its `hydra` node: what the program runs with."""
    task = cfg.copy()
    with open_dict(task):
        del task["hydra"]
    return task


def _select(cfg: DictConfig, key: str) -> str:
    try:
        value = OmegaConf.select(cfg, key, throw_on_resolution_failure=True)
    except Exception as exc:
        raise UserError(f"cannot resolve {key}: {first_line(exc)}") from None
    if not isinstance(value, (str, int)) or value == "":
        raise UserError(f"{key} must be a directory path, got {value!r}")
    return str(value)


# ----------------------------------------------------------------------------- the command line

UNSUPPORTED = ("-cp", "--config-path", "-cn", "--config-name", "-cd", "--config-dir")


def parse_command(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """(the options, the overrides) of `train.py <argv>`; a mistake as one UserError. An override
    that Hydra cannot parse is named; `resume=` takes any path (one Hydra named with `=`, as
    override_dirname does, is quoted for it)."""
    for arg in argv:  # (Hydra's parser would say "token recognition error")
        check_text(arg, f"the argument {arg[:40]!r}")
    parser = argparse.ArgumentParser(prog="train.py", add_help=False)
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("-h", "--help", nargs="?", const="short")  # --help all | <section>
    parser.add_argument("-m", "--multirun", action="store_true")
    parser.add_argument("-c", "--cfg", choices=("job", "hydra", "all"))
    parser.add_argument("--resolve", action="store_true")
    for short, long in zip(UNSUPPORTED[::2], UNSUPPORTED[1::2]):
        parser.add_argument(short, long, dest=long[2:].replace("-", "_"))

    def refuse(message: str):
        raise UserError(f"{message} ({python_command()} train.py --help lists the options)")

    parser.error = refuse
    args = parser.parse_intermixed_args(argv)  # (options anywhere, as Hydra takes them)
    given = next((a for a in argv if a.split("=", 1)[0] in UNSUPPORTED), None)
    if given:
        raise UserError(f"{given.split('=', 1)[0]} is not supported: train.py composes "
                        f"conf/config.yaml (choose configs with overrides such as "
                        f"+experiment=..., or add a config directory with "
                        f"hydra.searchpath=[file:///path/to/conf])")
    if args.help is not None and args.help not in HELP_FORMS:  # an override after --help
        argv_overrides = [args.help, *args.overrides]
        args.help, args.overrides = "short", argv_overrides
    if args.multirun and args.cfg:
        raise UserError("--multirun and --cfg exclude each other: give one of them")
    if args.resolve and not args.cfg:
        raise UserError("--resolve only goes with --cfg (job, hydra or all)")
    overrides, parser = [], OverridesParser.create()
    for arg in args.overrides:
        key, _, value = arg.partition("=")
        try:
            if not parser.parse_overrides([arg])[0].key_or_group:
                raise UserError(f"the override {arg!r} names no key")
        except UserError:
            raise
        except Exception as exc:
            if key != "resume":
                raise UserError(f"cannot parse the override {arg!r}: {one_line(exc)}; a value "
                                f"holding = , or brackets as text is quoted for Hydra: "
                                f"\"{key}={hydra_string(value)}\"") from None
            arg = f"resume={hydra_string(value)}"
        overrides.append(arg)
    return args, overrides


SECTIONS = ("model", "attention", "data", "tokenizer", "optim", "train")
HELP_FORMS = ("short", "all", *SECTIONS)
# The keys the short --help describes: those most runs set (--help all describes every one).
COMMON_KEYS = ("seed", "train.max_steps", "train.budget_minutes", "train.max_minutes",
               "train.device", "train.dtype", "train.eval_interval", "model.n_layer",
               "model.n_head", "model.n_embd", "model.block_size", "optim.lr", "resume",
               "init_from")
WIDTH = 100


def help_text(cfg: DictConfig, form: str = "short") -> str:
    """--help: the usage, the config groups with their options, then keys with the value this
    command would use and the words their dataclass gives them (config_keys): the keys most runs
    set, each on a line (short), or every key (all) or a section's (model, train, ...) in full."""
    groups = sorted(p for p in CONF_DIR.iterdir() if p.is_dir() and p.name != "hydra")
    choices = cfg.hydra.runtime.choices
    task = _task(cfg)
    cmd = f"{python_command()} train.py"
    lines = [f"usage: {cmd} [-m] [--cfg job|hydra|all [--resolve]] [group=option ...] "
             f"[key=value ...]", "",
             "Train a GPT (the default: byte-level BPE on the works of Shakespeare). Every value "
             "of conf/ can be", "set on the command line (docs/configuration.md).", "",
             "config groups (group=option, * the one chosen; those marked + are added with "
             "+group=option):"]
    for p in groups:
        chosen = choices.get(p.name)
        options = [f.stem + ("*" if f.stem == chosen else "") for f in sorted(p.glob("*.yaml"))]
        lines += textwrap.wrap(", ".join(options), WIDTH, break_on_hyphens=False,
                               initial_indent=f"  {'' if p.name in choices else '+'}{p.name}: ",
                               subsequent_indent="      ")
    keys = config_keys()
    if form == "short":
        lines += ["", "the keys most runs set (key=value; the value this command would use):"]
        for key in COMMON_KEYS:
            row = f"  {key}={_shown(OmegaConf.select(task, key))}"
            words = keys[key].split(". ")[0].rstrip(".")
            room = WIDTH - max(len(row), 32) - 1
            words = words if len(words) <= room else \
                words[:room - 3].rsplit(" ", 1)[0].rstrip(",;:(") + "..."
            lines.append(f"{row:<32} {words}" if len(row) < 32 else f"{row} {words}")
        lines += ["", f"every key, described: {cmd} --help all ({len(keys)} keys)",
                  f"one section's: {cmd} --help {'|'.join(SECTIONS)}"]
        return "\n".join(lines)
    for section in SECTIONS if form == "all" else (form,):
        lines += ["", f"{section}.* (key=value; the value this command would use):"]
        for key, words in keys.items():
            if key.split(".")[0] == section:
                lines.append(f"  {key}={_shown(OmegaConf.select(task, key))}")
                lines += textwrap.wrap(words, WIDTH, initial_indent=" " * 6,
                                       subsequent_indent=" " * 6)
    if form == "all":
        lines += ["", "and (key=value):"]
        for key, words in keys.items():
            if "." not in key:
                lines.append(f"  {key}={_shown(OmegaConf.select(task, key))}")
                lines += textwrap.wrap(words, WIDTH, initial_indent=" " * 6,
                                       subsequent_indent=" " * 6)
    return "\n".join(lines)


def _shown(value) -> str:
    """A value as it is written on the command line."""
    if isinstance(value, (DictConfig, ListConfig)):
        value = OmegaConf.to_container(value, resolve=False)
    if isinstance(value, list):
        return "[" + ",".join(map(str, value)) + "]"
    if isinstance(value, enum.Enum):
        return str(value.value)
    return {None: "null", True: "true", False: "false"}.get(value, repr(value)) \
        if value is None or isinstance(value, bool) or value == "" or \
        (isinstance(value, str) and value.strip() != value) else str(value)


# ----------------------------------------------------------------------------- the runs


@dataclass
class Made:
    """A directory this command made, or entered (names_before: what it held), to take back if
    its run fails before training; parents: the directories made above it, innermost first."""

    path: Path
    names_before: Optional[set] = None
    parents: list = field(default_factory=list)

    def undo(self) -> None:
        if not self.path.is_dir() or trained(self.path):
            return
        if self.names_before is None:
            shutil.rmtree(self.path, ignore_errors=True)
            return self._remove_parents()
        for name in set(os.listdir(self.path)) - self.names_before:
            entry = self.path / name
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)

    def _remove_parents(self) -> None:
        for parent in self.parents:  # only if left empty
            try:
                parent.rmdir()
            except OSError:
                break


def trained(path: Path) -> bool:
    """Whether a run has started training: a checkpoint, or TensorBoard events."""
    return holds_checkpoints(path) or any(path.glob("events.out.tfevents.*"))


@dataclass
class Job:
    """One run to train: its checked config, and its composed one (Hydra's record of it)."""

    settled: Settled
    composed: DictConfig
    record: Optional[str] = ".hydra"  # hydra.output_subdir; None: no record (a resume)
    single: bool = True               # not an arm of a sweep


@dataclass
class Launch:
    """What `python train.py <argv>` is to do, and what it made (to undo a failure)."""

    argv: list[str]
    rank: int = 0  # torchrun's (set by jobs): a rank > 0 checks what rank 0 does, writes nothing
    made: list = field(default_factory=list)
    sweep_dir: Optional[Made] = None
    workers: int = 1  # processes that train a sweep's runs at once (hydra/launcher=processes)

    def undo(self) -> None:
        """Take back the directories of runs that never trained (and a sweep's own directory,
        if nothing but its records and lock are left in it)."""
        for made in reversed(self.made):
            made.undo()
        d = self.sweep_dir
        if d is not None and d.path.is_dir() and set(os.listdir(d.path)) - \
                (d.names_before or set()) <= {"multirun.yaml", SWEEP_RECORD, ".lock"}:
            d.undo()

    def run(self, train: Callable[[Job], Optional[dict]], interrupted: str) -> None:
        """Train each job (train), every mistake one `error:` line, undoing what a failed new
        run made (HYDRA_FULL_ERROR=1 shows the traceback); exits with the status. A sweep stopped
        by a signal before all its runs finished says how to continue it (after a mistake, the
        `error:` line stays the last word: continuing would meet it again)."""
        remember_command([sys.argv[0], *self.argv])  # the lock's holder, as the user typed it
        code = run_cli(lambda: self._train_all(train), undo=self.undo,
                       trace=os.environ.get("HYDRA_FULL_ERROR") == "1", interrupted=interrupted)
        release_locks()
        d = self.sweep_dir
        if code > 128 and d is not None and (d.path / SWEEP_RECORD).is_file():
            print(f"the sweep stopped before all its runs finished; continue it (its unfinished "
                  f"runs only) with:\n  python train.py resume={d.path}", file=sys.stderr)
        exit_with(code)

    def _train_all(self, train: Callable[[Job], Optional[dict]]) -> Optional[int]:
        """Train the runs: one after the other here, or a sweep's in worker processes."""
        jobs = self.plan()
        if self.workers > 1:
            return train_in_workers(jobs, train, self.workers, self.sweep_dir.path,
                                    functools.partial(Launch, []))
        for job in self._ready(jobs):
            train(job)
        return None

    def jobs(self) -> Iterator[Job]:
        """The runs to train, one after the other, each ready (its directory, lock, log and
        record); every check made before the first. None for --help and --cfg."""
        return self._ready(self.plan())

    def _ready(self, jobs: Optional[list[Job]]) -> Iterator[Job]:
        for job in jobs or ():
            if self.rank == 0:
                self._begin(job)
            yield job
            if not job.single:
                unlock_run(job.settled.run_dir)

    def plan(self) -> Optional[list[Job]]:
        """Every run of the command, composed and checked, and the directories made that are
        made before the first trains (a sweep's own); None for --help and --cfg."""
        self.rank = parse_launch(os.environ).rank
        args, overrides = parse_command(self.argv)
        if self.rank == 0:
            refuse_folder_overrides(overrides)  # init_from= gives the shape and the tokenizer
        with _hydra():
            if args.multirun:
                if self.rank > 0:
                    raise UserError("a -m sweep cannot run under torchrun; run each arm with it")
                return self._plan_sweep(overrides)
            cfg = _compose(overrides)
            if args.help or args.cfg:
                print(help_text(cfg, args.help) if args.help else OmegaConf.to_yaml(
                    {"job": _task(cfg), "hydra": {"hydra": cfg.hydra}, "all": cfg}[
                        args.cfg or "all"], resolve=args.resolve))
                return None
            sweep = _task(cfg).resume and self.rank == 0 and sweep_to_continue(_task(cfg).resume)
            if sweep:
                return self._plan_sweep(recorded_sweep(sweep, overrides), continuing=sweep)
            return [self._plan_run(cfg)]

    def _plan_run(self, cfg: DictConfig) -> Job:
        task, overrides = _task(cfg), list(cfg.hydra.overrides.task)
        given = {o.split("=", 1)[0] for o in cfg.hydra.overrides.hydra}
        if self.rank > 0:  # rank 0's directory: broadcast when training starts
            return Job(settle(task, overrides, Path(".")), cfg, None)
        if task.resume:
            run = resume_target(task.resume)
            check_resumable(run)
            if "hydra.run.dir" in given and resolved(Path(_select(cfg, "hydra.run.dir"))) != run:
                raise UserError(f"resume={task.resume} continues {run} in place; leave "
                                f"hydra.run.dir out (it names {cfg.hydra.run.dir})")
            settled = settle(task, overrides, run)
            lock_run(run)  # after every check, before anything is written
            return Job(settled, cfg, None)
        path, unique = resolved(Path(_select(cfg, "hydra.run.dir"))), "hydra.run.dir" not in given
        check_new_run_dir(path, cfg.hydra.output_subdir, unique)
        settled = settle(task, overrides, path)
        made = create_dir(path, unique)
        self.made.append(made)
        lock_run(made.path)
        return Job(replace(settled, run_dir=made.path), cfg, cfg.hydra.output_subdir)

    def _plan_sweep(self, overrides: list[str], continuing: Optional[Path] = None) -> list[Job]:
        """Every arm composed and checked, and the sweep's directory made. continuing: the
        directory of this sweep, started before (resume=): its finished runs are left out, its
        started ones resumed, and the others start afresh."""
        parsed = [o for arg in overrides for o in OverridesParser.create().parse_overrides([arg])]
        hydra_lines = [o.input_line for o in parsed if o.is_hydra_override()]
        swept_hydra = [o.input_line for o in parsed
                       if o.is_hydra_override() and o.is_sweep_override()]
        if swept_hydra:
            raise UserError(f"sweeping over Hydra's own configuration ({swept_hydra[0]}) is not "
                            f"supported")
        master = _compose([o.input_line for o in parsed if not o.is_sweep_override()])
        choices = master.hydra.runtime.choices
        if choices.get("hydra/sweeper") != "basic" or choices.get("hydra/launcher") not in LAUNCHERS:
            raise UserError("train.py runs sweeps with Hydra's basic sweeper and the launchers "
                            "hydra/launcher=basic (one run after the other) or processes "
                            "(several at once)")
        params = [f"{k}={v}" for k, v in (master.hydra.sweeper.params or {}).items()]
        try:
            task_lines = [o.input_line for o in parsed if not o.is_hydra_override()]
            arms, swept = expand(params + task_lines, GlobalHydra.instance().config_loader())
        except UserError:
            raise
        except Exception as exc:
            raise UserError(one_line(exc)) from exc
        if "resume" in swept or any(a.split("=", 1)[0] == "resume" for arm in arms for a in arm):
            raise UserError("resume= continues one run in place and cannot be part of a -m sweep; "
                            "resume each run with python train.py resume=<run>")
        root = resolved(Path(_select(master, "hydra.sweep.dir")))
        if not continuing:
            check_sweep_dir(root)
        if len(arms) > 4:
            print(f"checking the {len(arms)} arms of this sweep before the first one starts ...",
                  file=sys.stderr)
        jobs = []
        for i, arm in enumerate(arms):
            cfg = _compose(hydra_lines + arm)
            OmegaConf.copy_cache(from_config=master, to_config=cfg)  # the same ${now:...}
            with read_write(cfg.hydra.job), open_dict(cfg.hydra.job):
                cfg.hydra.job.num = cfg.hydra.job.id = i
            jobs.append(Job(None, cfg, single=False))
        configured = []
        for job in jobs:
            HydraConfig.instance().set_config(job.composed)
            configured.append(_select(job.composed, "hydra.sweep.subdir"))
        names = arm_names(arms, configured, swept)
        given = {a.split("=", 1)[0] for a in hydra_lines}
        shared = next((n for n in names if names.count(n) > 1), None)
        if shared or "hydra.sweep.subdir" in given and names != configured:
            raise UserError(f"several arms of this sweep would write to "
                            f"{root / (shared or configured[0])}; set hydra.sweep.subdir so that "
                            f"it tells them apart (e.g. '${{run_name}}_${{optim.lr}}')")
        for job, arm, name in zip(jobs, arms, names):
            if not name or len(name) > MAX_NAME:
                raise UserError(f"hydra.sweep.subdir gives the arm {' '.join(arm)} the directory "
                                f"name {name[:60]!r}: it must be 1 to {MAX_NAME} characters")
            path = resolved(root / name)
            if root not in path.parents:
                raise UserError(f"the arm {' '.join(arm)} would write to {path}, outside the "
                                f"sweep's directory {root} (hydra.sweep.subdir={name!r})")
            if continuing and holds_checkpoints(path):  # a run of this sweep, started before
                job.settled = None if finished(path) else resumed(job.composed, path)
                job.record = None  # (a resume writes no record)
                continue
            check_new_run_dir(path, job.composed.hydra.output_subdir)
            job.settled = settle(_task(job.composed), arm, path)
            job.record = job.composed.hydra.output_subdir
        if continuing and all(job.settled is None for job in jobs):
            print(f"every run of the sweep {continuing} has finished: nothing to train",
                  file=sys.stderr)
        jobs = [job for job in jobs if job.settled is not None]
        for a in jobs:
            for b in jobs:
                if a.settled.run_dir in b.settled.run_dir.parents:
                    raise UserError(f"the arm in {b.settled.run_dir} would lie inside the arm in "
                                    f"{a.settled.run_dir}; give hydra.sweep.subdir a flat name")
        launcher = master.hydra.launcher if choices.get("hydra/launcher") == "processes" else {}
        self.workers = worker_count(launcher.get("n_jobs", 1), len(jobs)) if jobs else 1
        warning = oversubscription(self.workers, [job.settled.cfg.train.threads for job in jobs])
        if warning:
            print(warning, file=sys.stderr)
        self.sweep_dir = create_dir(root, unique="hydra.sweep.dir" not in given)
        lock_run(self.sweep_dir.path)
        if not continuing:
            OmegaConf.save(master, self.sweep_dir.path / "multirun.yaml")
            record = {"overrides": overrides, "continue": "python train.py resume=<this directory>"}
            (self.sweep_dir.path / SWEEP_RECORD).write_text(json.dumps(record, indent=1) + "\n")
        for job in jobs:  # the name was taken a moment ago: the arms move with it
            job.settled.run_dir = self.sweep_dir.path / job.settled.run_dir.relative_to(root)
        return jobs

    def _begin(self, job: Job) -> None:
        """What @hydra.main would do for the run: its directory (an arm's, at its turn), its
        logging (train.log in it) and its record (.hydra/: config, hydra config, overrides)."""
        cfg, run_dir = job.composed, job.settled.run_dir
        if not job.single:
            self.made.append(create_dir(run_dir, unique=False))
            lock_run(run_dir)
        with read_write(cfg.hydra.runtime):
            cfg.hydra.runtime.output_dir = str(run_dir)
        HydraConfig.instance().set_config(cfg)
        logging.config.dictConfig(OmegaConf.to_container(cfg.hydra.job_logging, resolve=True))
        if job.record is not None:
            record = run_dir / job.record
            record.mkdir(parents=True, exist_ok=True)
            OmegaConf.save(_task(cfg), record / "config.yaml")
            OmegaConf.save({"hydra": cfg.hydra}, record / "hydra.yaml")
            OmegaConf.save(cfg.hydra.overrides.task, record / "overrides.yaml")


# ----------------------------------------------------------------------------- placement


def refuse_checkpointed(path: Path) -> None:
    """A new run never starts where checkpoints are: it would overwrite them."""
    if holds_checkpoints(path):
        raise UserError(f"{path} already holds a checkpoint; resume it with resume={path} "
                        "or choose another hydra.run.dir")


def check_new_run_dir(path: Path, output_subdir: Optional[str], unique: bool = False) -> None:
    """A new run's directory (resolved) must not hold a checkpoint, lie inside a run, or hold
    files of something that is not a run; and it must be possible to create. With unique (the
    default timestamped name), what a directory of that name holds does not matter: another run
    started in the same second may be filling it, and create_dir takes a name of its own."""
    if not unique:
        refuse_checkpointed(path)
    if "${" in str(path):  # resume= would read it as an interpolation
        raise UserError(f"the run directory {path} contains '${{', which an override (resume=) "
                        f"would read as an interpolation; choose another directory")
    for parent in path.parents:
        if is_run(parent) or holds_checkpoints(parent):
            raise UserError(f"hydra.run.dir {path} is inside the run {parent}; a new run goes "
                            f"into a directory of its own")
    if (path.exists() or path.is_symlink()) and not unique:
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
    why = why_not_creatable(path.parent if unique else path)  # unique: a new name beside path
    if why:
        raise UserError(f"cannot create the run directory {path}: {why}")


def check_sweep_dir(path: Path) -> None:
    """A sweep's directory holds runs, and is none itself: not a run, not inside one, not another
    sweep's (its multirun.yaml would be overwritten)."""
    if is_run(path) or holds_checkpoints(path):
        raise UserError(f"hydra.sweep.dir {path} is a run directory; a sweep goes into a "
                        f"directory of its own")
    for parent in path.parents:
        if is_run(parent) or holds_checkpoints(parent):
            raise UserError(f"hydra.sweep.dir {path} is inside the run {parent}; a sweep goes "
                            f"into a directory of its own")
    if "${" in str(path):
        raise UserError(f"the sweep directory {path} contains '${{', which an override would "
                        f"read as an interpolation; choose another hydra.sweep.dir")
    if os.path.lexists(path / "multirun.yaml"):
        raise UserError(f"hydra.sweep.dir {path} holds another sweep (its multirun.yaml); "
                        f"choose a new hydra.sweep.dir")
    if os.path.lexists(path) and not path.is_dir():
        raise UserError(f"cannot create the sweep directory {path}: it exists and is not a "
                        f"directory")


def create_dir(path: Path, unique: bool) -> Made:
    """Create a run's (or a sweep's) directory, recording what was created. With unique (the
    default timestamped name), a directory another run created in the same second is not shared:
    this one takes the name with _2, _3, ... appended."""
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
                return Made(candidate, parents=missing)
            except FileExistsError:
                if not unique:
                    return Made(candidate, names_before=set(os.listdir(candidate)))
    except OSError as exc:
        raise UserError(f"cannot create the run directory {path}: {exc.strerror}") from exc
    raise UserError(f"cannot create the run directory {path}: too many runs of that name")
