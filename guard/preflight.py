"""Before a run: what it is, checked in full (its config, memory, corpus, tokenizer and the place
it will write), creating nothing; and what a run or a sweep that started before continues from.

train.py composes its config with Hydra's Compose API (guard/compose.py), not with `@hydra.main`,
which creates the run directory and writes `.hydra/` into it before the program runs: here the
config is composed, its values, memory and directory checked, and only then (guard/launch.py) the
directory created, so that a command refused writes nothing.

A new run gets a fresh directory (`hydra.run.dir`); `resume=DIR` continues DIR with its saved
config. A new run is never placed in or inside an existing run. A `-m` sweep's arms are each
checked here before the first one trains; `resume=<sweep directory>` replays the sweep's record
(sweep.json) and trains its runs that did not finish.
"""
from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional, Sequence

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from data.config import Order, Source, TokenizerConfig, TokenizerKind
from data.corpus import check_split_overlap
from guard.compose import compose_with_hydra, composing, empty_config, task_config
from guard.limits import check_config, check_fused_kernel, parse_device
from guard.memory import check_training_fits
from guard.run_dir import (MAX_LAYER_BYTES, check_resumable, corpus_of_run, is_model_folder,
                           is_run, layer_copy, load_folder_weights, read_source, resolved,
                           resume_target, saved_config)
from model.gpt import GPT
from safeio.cli import UserError, first_line, hydra_string
from safeio.corpus import load_tokenizer
from safeio.files import (MAX_CONFIG_BYTES, dump_run_config, literal, parse_run_config,
                          read_bytes, read_json, why_not_creatable)
from training.checkpoint import holds_checkpoints, latest_checkpoint
from training.config import Config

# Names a run writes at its top level: a new run refuses a directory holding them (unless it is a
# run that never saved a checkpoint, which it restarts).
RUN_FILES = ("config.yaml", "tokenizer.json", "train.log", ".hydra", "checkpoints")
# A sweep's record of its command line (its overrides), which `resume=<sweep directory>` replays
# to train the runs that did not finish; beside Hydra's multirun.yaml (the composed config).
SWEEP_RECORD = "sweep.json"


# ----------------------------------------------------------------------------- the config


@dataclass
class CheckedRun:
    """A run's typed config, checked in full, its directory, and whether it resumes."""

    cfg: Config
    run_dir: Path
    resuming: bool
    device: torch.device    # train.device, parsed


def check_run(cfg: DictConfig, task_overrides: list[str], output_dir: Path) -> CheckedRun:
    """The run a composed config and its task overrides describe: for `resume=DIR`, the saved
    config of DIR with this command's other overrides on top (e.g. a larger train.max_steps),
    checked in full, with the memory it needs, its corpus read through this command's cache
    (corpus_of_run). A new run's config must also read back as it will be written (config.yaml),
    its init_from folder and tokenizer file are read and checked, and its training and
    validation texts must not overlap."""
    own, trusted = cfg.data, cfg.trust_layer  # this command's: its command line, or conf/
    if cfg.resume:
        run_dir = resume_target(cfg.resume)
        cfg = merge_saved(run_dir, cfg, task_overrides)
        cfg.trust_layer = trusted  # (a run's config.yaml never grants it)
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
    if conf.your_layer and cfg.resume:  # the run's copy of its layer checked, and the consent
        layer_copy(run_dir, conf, trusted)
    elif conf.your_layer:  # (train.py keeps a copy in the run: check_attention/your_layer.py)
        read_bytes(Path(conf.your_layer.rpartition(":")[0]), "layer file", MAX_LAYER_BYTES)
    vocab = None
    if conf.tokenizer.kind is TokenizerKind.file:
        vocab = load_tokenizer(Path(conf.tokenizer.path)).get_vocab_size()
    if conf.data.source is not Source.shakespeare:  # (whose works are split by name)
        check_split_overlap(conf.data)  # the files exist, are texts, and do not overlap
    check_training_fits(conf, device, vocab)
    if not cfg.resume:
        check_saved_config(conf)
    return CheckedRun(conf, run_dir, bool(cfg.resume), device)


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
        back = OmegaConf.to_object(OmegaConf.merge(empty_config(),  # (merge copies it)
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
    values are resolved, and set as literals (a `${` in one is text). data.order cannot change:
    the checkpoint's sampler state is that order's."""
    merged = saved_config(run_dir / "config.yaml")
    order = merged.data.order
    for override in task_overrides:
        key = override.lstrip("+~").split("=", 1)[0]
        if key in ("your_layer", "your_layer_sha256"):
            raise UserError(f"resume={run_dir} continues with the layer it trained: no {key}=")
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


def started_training(path: Path) -> bool:
    """Whether a run has started training: a checkpoint, or TensorBoard events."""
    return holds_checkpoints(path) or any(path.glob("events.out.tfevents.*"))


def resumed(task: DictConfig, run: Path) -> CheckedRun:
    """An arm of a sweep (its config, without `hydra`) that started before, continued from its
    latest checkpoint."""
    check_resumable(run)
    task = task.copy()
    task.resume = str(run)
    return check_run(task, [], run)


def check_new_run(overrides: Sequence[str], run_dir: Path) -> Config:
    """The checked config of `python train.py <overrides> hydra.run.dir=<run_dir>`, after every
    check train.py makes before it creates the run's directory (the directory's place, every
    value, the memory it needs), creating nothing: bench.record checks each seed's run before
    the first one trains."""
    with composing():
        cfg = compose_with_hydra(overrides)
        check_new_run_dir(resolved(run_dir), cfg.hydra.output_subdir)
        return check_run(task_config(cfg), list(overrides), resolved(run_dir)).cfg


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



@dataclass
class Job:
    """One run to train: its checked config, and its composed one (Hydra's record of it)."""

    checked: CheckedRun
    composed: DictConfig
    record: Optional[str] = ".hydra"  # hydra.output_subdir; None: no record (a resume)
    single: bool = True               # not an arm of a sweep
