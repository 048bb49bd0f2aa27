"""train.py's command line and its config: the options parsed, the config composed by Hydra from
conf/ (its Compose API: composing writes nothing), every override that names no key, no option or
a value of the wrong type said in one line, and --help.

`compose` is the checked config a command would run with (benches, tests and lessons use the
shipped configs through it); guard/preflight.py checks a run's values and place, and
guard/launch.py starts it.
"""
from __future__ import annotations

import argparse
import dataclasses
import enum
import functools
import textwrap
import typing
from contextlib import contextmanager
from typing import Iterator, Optional, Sequence

from hydra import compose as hydra_compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict
from omegaconf.errors import ValidationError

from guard.limits import check_config, check_text
from guard.retired import retired_override
from safeio.cli import UserError, first_line, hydra_string, one_line, python_command
from safeio.key_help import closest, key_help, type_words
from training.config import CONF_DIR, Config, register_configs

# Hydra's launchers of ours, and the requirements file that installs each (docs/cluster.md)
LAUNCHER_FILES = {"joblib": "requirements.txt", "ray": "requirements-cluster.txt",
                  "ray_aws": "requirements-cluster.txt", "submitit_local": "requirements-cluster.txt",
                  "submitit_slurm": "requirements-cluster.txt"}

def compose(overrides: Sequence[str] = ()) -> Config:
    """The checked config `python train.py <overrides>` would run with, composed by Hydra from
    conf/: benches and tests use the shipped configs instead of restating defaults."""
    with composing():
        conf: Config = OmegaConf.to_object(task_config(compose_with_hydra(overrides)))
    check_config(conf)
    return conf



@contextmanager
def composing() -> Iterator[None]:
    """Hydra set up to compose conf/ (its job named train: the log is train.log)."""
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="train"):
        yield


def compose_with_hydra(overrides: Sequence[str]) -> DictConfig:
    """The config of these overrides, with its `hydra` node; a key added with + that the schema
    does not have is refused (it would be silently ignored)."""
    try:
        cfg = hydra_compose("config", overrides=list(overrides), return_hydra_config=True)
    except Exception as exc:
        raise UserError(retired_override(overrides) or unknown_key(overrides)
                        or unknown_option(overrides) or wrong_type(exc) or one_line(exc)) from exc
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


def unknown_option(overrides: Sequence[str]) -> Optional[str]:
    """The first override that chooses an option its config group does not have
    (+arm=leak-mask_zeor), said with the option it is closest to; a cluster launcher whose plugin
    is not installed is said as such."""
    loader = GlobalHydra.instance().config_loader()
    for override in overrides:
        key, _, value = override.partition("=")
        group = key.lstrip("+~").split("@", 1)[0]
        options = [] if "." in group or "," in value else loader.get_group_options(group)
        if not options or value in options:
            continue
        if group == "hydra/launcher" and value in LAUNCHER_FILES:
            return (f"hydra/launcher={value} needs Hydra's {value.split('_')[0]} launcher plugin, "
                    f"which is not installed: pip install -r {LAUNCHER_FILES[value]} "
                    f"(docs/cluster.md)")
        guess = closest(value, options)
        return f"{key}={value}: {group} has no option {value}" + (
            f"; did you mean {guess}?" if guess else f" (its options: {', '.join(options)})")
    return None


def wrong_type(exc: Exception) -> Optional[str]:
    """A value the key's type cannot take (optim.lr=abc), said with the type and a valid value:
    the key's default, or one of its type."""
    cause = exc.__cause__
    key = getattr(cause, "full_key", None)
    if not isinstance(cause, ValidationError) or not key or key.startswith("hydra."):
        return None
    hint, schema = Config, None
    for part in key.split("."):
        if not dataclasses.is_dataclass(hint) or part not in typing.get_type_hints(hint):
            return None
        hint = typing.get_type_hints(hint)[part]
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        schema = args[0] if typing.get_origin(hint) is typing.Union and len(args) == 1 else hint
        hint = schema if dataclasses.is_dataclass(schema) else hint
    if typing.get_origin(schema) is list:  # (written in brackets: Hydra's own message says so)
        return None
    given = f"{key}={_shown(getattr(cause, 'value', ''))}"
    if isinstance(schema, type) and issubclass(schema, enum.Enum):
        return f"{given}: {key} takes {type_words(schema)}"
    default = OmegaConf.select(empty_config(), key)
    if default is None or isinstance(default, (DictConfig, ListConfig)):
        default = {int: 2, float: 0.5, bool: True}.get(schema, "text")
    return f"{given}: {key} takes {type_words(hint)}, e.g. {key}={_shown(default)}"


@functools.lru_cache(maxsize=1)
def empty_config() -> DictConfig:
    """The typed Config with its defaults, made once (merges copy it)."""
    return OmegaConf.structured(Config)


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


def task_config(cfg: DictConfig) -> DictConfig:
    """The config without its `hydra` node: what the program runs with."""
    task = cfg.copy()
    with open_dict(task):
        del task["hydra"]
    return task


def select_path(cfg: DictConfig, key: str) -> str:
    """The directory path a key of the config gives (hydra.run.dir, hydra.sweep.dir, ...)."""
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
    task = task_config(cfg)
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


