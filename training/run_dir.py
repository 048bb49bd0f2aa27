"""The run directory: which one a command writes to, and the checks made before anything is
written anywhere.

A new run gets a fresh directory (Hydra's `hydra.run.dir`); `resume=DIR` continues DIR with its
saved config. Hydra creates hydra.run.dir and writes `.hydra/` into it before train.py's main
runs, so `preflight` decides first, from the command line alone: it composes the config as Hydra
will, resolves the directory (through `..`, symbolic links and interpolations), validates every
value, and only then lets Hydra go on, with the directory spelt out. A resume's Hydra directory is
the run itself, with no `.hydra/` record rewritten, so a resume never leaves a directory behind
and writes only what the resumed training writes. A new run is never placed in or inside an
existing run, and a new run that fails before training leaves nothing.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from data.config import TokenizerKind
from data.files import kind_of, read_text
from model.config import AttentionImpl
from training.checkpoint import atomic_write, holds_checkpoints
from training.config import CONF_DIR, Config, register_configs, validate
from training.errors import UserError, first_line, one_line
from training.memory import check_fits, training_bytes
from training.safe_yaml import load_run_config

LATEST = Path("runs") / "latest"
# Names a run writes at its top level: a new run refuses a directory holding them (unless it is a
# run that never saved a checkpoint, which it restarts).
RUN_FILES = ("config.yaml", "tokenizer.json", "train.log", ".hydra", "checkpoints")
# A run directory holds a few dozen entries; walking one with more is not worth the time.
MAX_RUN_ENTRIES = 10_000


# ----------------------------------------------------------------------------- the config


def resolve_run(cfg: DictConfig) -> tuple[Config, Path, bool]:
    """The typed config and the run directory of the running Hydra job; for `resume=DIR`, the
    saved config of DIR with this command's other overrides on top (e.g. a larger
    train.max_steps)."""
    hydra_cfg = HydraConfig.get()
    return settle(cfg, list(hydra_cfg.overrides.task), Path(hydra_cfg.runtime.output_dir))


def settle(cfg: DictConfig, task_overrides: list[str], output_dir: Path
           ) -> tuple[Config, Path, bool]:
    """resolve_run's work, from a composed config and its task overrides: also run by
    `preflight`, before Hydra has created anything."""
    if cfg.resume:
        run_dir = resume_target(cfg.resume)
        cfg = _merge_saved(run_dir, cfg, task_overrides)
    else:
        run_dir = output_dir
        refuse_checkpointed(run_dir)
    try:
        conf: Config = OmegaConf.to_object(cfg)
        validate(conf)
        check_resources(conf)
    except ValueError as exc:
        raise UserError(str(exc)) from exc
    return conf, run_dir, bool(cfg.resume)


def _merge_saved(run_dir: Path, cfg: DictConfig, task_overrides: list[str]) -> DictConfig:
    """The run's saved config with what this command overrode on top, taken from the config Hydra
    has composed (so values are parsed as usual): a key (train.max_steps=...) or a whole group
    (data=...). Packages such as +experiment=... only select values and are not replayed."""
    saved = run_dir / "config.yaml"
    saved_cfg = load_run_config(saved)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(Config), saved_cfg)
    except OmegaConfBaseException as exc:
        raise UserError(f"cannot resume: {saved} does not fit the config schema: "
                        f"{first_line(exc)}" + (f" ({exc.full_key})" if getattr(exc, "full_key", None)
                                                else "")) from None
    for override in task_overrides:
        key = override.lstrip("+~").split("=", 1)[0]
        if key == "resume" or key.startswith("hydra.") or ("." not in key and key not in cfg):
            continue
        OmegaConf.update(merged, key, OmegaConf.select(cfg, key), merge=False)
    merged.resume = str(run_dir)
    return merged


def check_resources(conf: Config) -> None:
    """Refuse what this machine cannot run, before a byte is allocated: sizes that cannot fit
    (with the estimate), the fused attention kernel where it cannot run."""
    tok = conf.tokenizer
    vocab = tok.vocab_size if tok.kind is TokenizerKind.bpe else 256  # char: distinct characters
    name = conf.train.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        return  # reported when the device is picked
    if conf.attention.impl is AttentionImpl.fused:
        from model.fused_attention import fused_available
        if not fused_available(device):
            raise ValueError(f"attention.impl=fused needs Triton and a CUDA device, not "
                             f"{device.type} (use attention.impl=auto)")
    t = conf.train
    check_fits(training_bytes(conf.model, vocab, t.batch_size, t.eval_batches), device,
               "training", conf.model, vocab,
               "lower model.n_embd, model.n_layer, model.block_size, tokenizer.vocab_size or "
               "train.batch_size")


# ----------------------------------------------------------------------------- runs/latest


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
    if path.name == "latest" and path.is_file():
        return Path(read_text(path, "run pointer", 4096).strip())
    return path


def resume_target(resume: str) -> Path:
    """The run directory `resume=` names, with links and `..` resolved."""
    path = resolve_latest(Path(str(resume)).expanduser())
    if not path.exists():
        raise UserError(f"cannot resume: {path} does not exist")
    if not path.is_dir():
        raise UserError(f"cannot resume: {path} is not a directory (give a run directory of "
                        f"train.py)")
    return resolved(path)


def resolved(path: Path) -> Path:
    """path made absolute, through `..` and symbolic links (as far as it exists)."""
    try:
        return path.expanduser().resolve()
    except (RuntimeError, OSError) as exc:  # a symbolic link loop, a name too long
        raise UserError(f"cannot resolve the path {path}: {first_line(exc)}") from None


# ----------------------------------------------------------------------------- before Hydra


@dataclass
class Plan:
    """What preflight decided: the command line Hydra gets, and what to undo if the run fails."""

    argv: list[str]
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


def preflight(argv: list[str]) -> Plan:
    """Checks that must come before Hydra, which creates hydra.run.dir and writes .hydra/ into it
    before main runs. Returns the command line to give Hydra: the run directory spelt out (a
    resume's is the run itself, without a new .hydra/ record)."""
    if any(a.startswith("-") for a in argv):  # -m, --cfg, --help ...: Hydra's own modes
        return Plan(argv)
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
        settle(_task_config(composed), list(composed.hydra.overrides.task), run)
        return Plan(rest + [f"hydra.run.dir={_quote(run)}", "hydra.output_subdir=null"])
    composed = _compose(argv)
    raw = _hydra_run_dir(composed)
    if not isinstance(raw, str) or not raw:
        raise UserError(f"hydra.run.dir must be a directory path, got {raw!r}")
    path = resolved(Path(raw))
    check_new_run_dir(path, composed.hydra.output_subdir)
    settle(_task_config(composed), list(composed.hydra.overrides.task), path)
    plan = _claim(path, unique="hydra.run.dir" not in options)
    plan.argv = rest + [f"hydra.run.dir={_quote(plan.run_dir)}"] \
        + [o.input_line for o in parsed if o.key_or_group == "hydra.output_subdir"]
    return plan


def _compose(argv: list[str]) -> DictConfig:
    """The config Hydra will compose for these overrides, with its `hydra` node. Where it does
    not compose, Hydra would fail the same way: the reason is reported now (some of Hydra's own
    reports are tracebacks)."""
    from hydra import compose, initialize_config_dir
    register_configs()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose("config", overrides=list(argv), return_hydra_config=True)
    except Exception as exc:
        raise UserError(one_line(exc)) from exc
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


def _quote(path: Path) -> str:
    """path as a Hydra override value."""
    text = str(path)
    if "\\" in text or "${" in text:
        raise UserError(f"the run directory {text} contains '\\' or '${{', which Hydra would "
                        f"read as escapes or interpolations; choose another hydra.run.dir")
    return "'" + text.replace("'", "\\'") + "'"


def is_run(path: Path) -> bool:
    """Whether path is a run directory (of train.py, or of another Hydra program)."""
    return ((path / "config.yaml").is_file()
            and ((path / "tokenizer.json").is_file() or (path / "checkpoints").is_dir())) \
        or (path / ".hydra" / "config.yaml").is_file()


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


def _claim(path: Path, unique: bool) -> Plan:
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
                return Plan([], run_dir=candidate, created=[candidate, *missing])
            except FileExistsError:
                if not unique:
                    return Plan([], run_dir=candidate, created=[],
                                names_before=set(os.listdir(candidate)))
    except OSError as exc:
        raise UserError(f"cannot create the run directory {path}: {exc.strerror}") from exc
    raise UserError(f"cannot create the run directory {path}: too many runs of that name")


def check_resumable(run: Path) -> None:
    """A resumed run writes into its directory: checkpoints, TensorBoard events, train.log. So
    nothing in it may be a symbolic link (the writes would land elsewhere), a hard-linked log
    (the appends would change another file) or a FIFO or device (opening it would block)."""
    seen = 0
    stack = [(run, 0)]
    while stack:
        directory, depth = stack.pop()
        try:
            entries = list(os.scandir(directory))
        except OSError as exc:
            raise UserError(f"cannot resume: cannot list {directory}: {exc.strerror}") from None
        seen += len(entries)
        if seen > MAX_RUN_ENTRIES:
            raise UserError(f"cannot resume: {run} holds more than {MAX_RUN_ENTRIES:,} files; it "
                            f"is not a run directory of train.py")
        for entry in entries:
            path = Path(entry.path)
            st = entry.stat(follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                raise UserError(f"cannot resume: {path} is a symbolic link; a resumed run writes "
                                f"into its directory, and a link could send those writes "
                                f"elsewhere")
            if stat.S_ISDIR(st.st_mode):
                if depth < 3:
                    stack.append((path, depth + 1))
            elif not stat.S_ISREG(st.st_mode):
                raise UserError(f"cannot resume: {path} is {kind_of(st.st_mode)}, not a regular "
                                f"file")
    config = run / "config.yaml"
    if not config.is_file():
        raise UserError(f"cannot resume: {config} does not exist (is {run} a run directory?)")
    log = run / "train.log"
    if log.exists() and log.stat().st_nlink > 1:
        raise UserError(f"cannot resume: {log} is a hard link to another file, which the "
                        f"resumed run would append to")

