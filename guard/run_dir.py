"""Reading a run directory that may come from someone else: which directory a path names, whether
a run may be resumed, and the model, tokenizer and config a run (or a GPT-2 folder) holds.

Everything comes from the directory alone: config.yaml (model shape), tokenizer.json and a
checkpoint's model.safetensors (no pickle is loaded). Each file is checked before use (kind,
size, content: plain YAML, a tokenizer without custom regular expressions, finite weights of the
right shapes), and the model's size against the memory there is.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from tokenizers import Tokenizer

from guard.cli import FormatError, UserError, first_line
from guard.corpus import load_tokenizer
from guard.files import kind_of, load_run_config, read_text
from guard.limits import check_choice, check_config, check_sampling_fits
from model.config import ModelConfig
from model.gpt import GPT
from model.hf import TOKENIZER, load_folder_tokenizer, load_gpt2_folder
from training.checkpoint import find_weights, load_weights
from training.config import Config

# A run directory holds a few dozen entries; walking one with more is not worth the time.
MAX_RUN_ENTRIES = 10_000


def resolve_latest(path: Path) -> Path:
    """A run directory as given, or the run that a `latest` pointer file names."""
    if path.name == "latest" and path.is_file():
        return Path(read_text(path, "run pointer", 4096).strip())
    return path


def resolved(path: Path) -> Path:
    """path made absolute, through `..` and symbolic links (as far as it exists)."""
    try:
        return path.expanduser().resolve()
    except (RuntimeError, OSError) as exc:  # a symbolic link loop, a name too long
        raise UserError(f"cannot resolve the path {path}: {first_line(exc)}") from None


def is_run(path: Path) -> bool:
    """Whether path is a run directory (of train.py, or of another Hydra program)."""
    return ((path / "config.yaml").is_file()
            and ((path / "tokenizer.json").is_file() or (path / "checkpoints").is_dir())) \
        or (path / ".hydra" / "config.yaml").is_file()


def saved_config(path: Path) -> DictConfig:
    """A run's config.yaml merged into the schema: data, of which nothing is instantiated."""
    saved = load_run_config(path)
    try:
        return OmegaConf.merge(OmegaConf.structured(Config), saved)
    except OmegaConfBaseException as exc:  # keys or values that do not fit the schema
        key = getattr(exc, "full_key", None)
        raise FormatError(f"{path} is not a run config of train.py: {first_line(exc)}"
                          + (f" ({key})" if key else "")) from None


# ----------------------------------------------------------------------------- resuming


def resume_target(resume: str) -> Path:
    """The run directory `resume=` names, with links and `..` resolved."""
    path = resolve_latest(Path(str(resume)).expanduser())
    if not path.exists():
        raise UserError(f"cannot resume: {path} does not exist")
    if not path.is_dir():
        raise UserError(f"cannot resume: {path} is not a directory (give a run directory of "
                        f"train.py)")
    return resolved(path)


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


# ----------------------------------------------------------------------------- sampling from a run


def load_run(run_dir: Path, which: str, device: torch.device) -> tuple[GPT, Tokenizer, Config]:
    """(model in eval mode on device, tokenizer, run config) of a run directory of train.py, with
    its `best` or `latest` weights, or of a GPT-2 folder (config.json, model.safetensors,
    tokenizer.json; e.g. one written by scripts/export_hf.py)."""
    check_choice("weights", which)
    if not run_dir.is_dir():
        raise UserError(f"run directory {run_dir} does not exist" if not run_dir.exists()
                        else f"run directory {run_dir} is not a directory")
    if not (run_dir / "config.yaml").exists() and (run_dir / "config.json").exists():
        cfg, state, tokenizer = read_gpt2_folder(run_dir)
        model = GPT(cfg, tokenizer.get_vocab_size())
        model.load_state_dict(state, strict=False)  # all but the tied head, stored once
        return model.to(device).eval(), tokenizer, Config(model=cfg)
    if not (run_dir / "config.yaml").exists():
        raise UserError(f"{run_dir} has no config.yaml: is it a run directory of train.py (or a "
                        f"GPT-2 folder with config.json)?")
    run_cfg: Config = OmegaConf.to_object(saved_config(run_dir / "config.yaml"))
    check_config(run_cfg)
    tokenizer = load_tokenizer(run_dir / "tokenizer.json")
    vocab = tokenizer.get_vocab_size()
    check_sampling_fits(run_cfg.model, vocab, run_cfg.attention, device,
                        f"{run_dir / 'config.yaml'} describes a model too big for this machine")
    model = GPT(run_cfg.model, vocab, run_cfg.attention)
    load_weights(model, find_weights(run_dir, which))
    return model.to(device).eval(), tokenizer, run_cfg


def read_gpt2_folder(folder: Path) -> tuple[ModelConfig, dict, Tokenizer]:
    """A GPT-2 folder's model shape, weights (without the tied head) and tokenizer, which must
    belong together."""
    cfg, state = load_gpt2_folder(folder)
    tokenizer = load_folder_tokenizer(folder)
    if tokenizer is None:
        raise FormatError(f"{folder} has no {TOKENIZER}: the weights need the tokenizer they "
                          f"were trained with")
    if tokenizer.get_vocab_size() != state["tok_emb.weight"].size(0):
        raise FormatError(f"{folder}: its {TOKENIZER} and its weights have different vocabulary "
                          f"sizes")
    return cfg, state, tokenizer
