"""Checkpoints that survive a kill at any instant and cannot run code when loaded.

A run directory holds:
    config.yaml, tokenizer.json      written once at the start of the run
    checkpoints/step_00001000/       one complete checkpoint:
        model.safetensors            the weights (safetensors: data only, no pickle)
        state.pt                     optimiser, step, RNG and sampler state (weights_only load)
    checkpoints/best/                the weights with the lowest validation loss so far
    checkpoints/latest               the name of the newest complete checkpoint

A checkpoint is written to a temporary directory, every file flushed and fsync'ed, then renamed
into place; `latest` is replaced the same way afterwards. A crash leaves the previous checkpoint
(and `latest` pointing at it) intact.
"""
from __future__ import annotations

import io
import os
import pickle
import pickletools
import shutil
import warnings
import zipfile
from pathlib import Path
from typing import Optional

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save
from tokenizers import Tokenizer

from data.tokenizer import load_tokenizer
from training.errors import UserError, first_line
from training.state import PROGRESS_KEYS, Progress, set_rng_state

CHECKPOINTS = "checkpoints"
WEIGHTS = "model.safetensors"
STATE = "state.pt"
TIED = ("lm_head.weight",)  # shares storage with tok_emb.weight; stored once


class CheckpointError(RuntimeError):
    """A checkpoint is missing, unreadable, unsafe, or does not fit the model."""


def _fsync_write(path: Path, payload: bytes) -> None:
    with open(path, "wb") as f:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, payload: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    _fsync_write(tmp, payload)
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def weights_bytes(model: torch.nn.Module) -> bytes:
    tensors = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()
               if k not in TIED}
    return save(tensors)


def _step_of(path: Path) -> int:
    try:
        return int(path.name[len("step_"):])
    except ValueError:
        return -1


def save_checkpoint(run_dir: Path, step: int, model: torch.nn.Module, state: dict,
                    keep: int) -> Path:
    """Write checkpoints/step_<step>/ atomically, point `latest` at it, prune old ones."""
    root = run_dir / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-*"):  # left behind by a process killed while saving
        shutil.rmtree(stale, ignore_errors=True)
    name = f"step_{step:08d}"
    tmp = root / f".tmp-{name}"
    tmp.mkdir()
    _fsync_write(tmp / WEIGHTS, weights_bytes(model))
    buffer = io.BytesIO()
    torch.save(state, buffer)
    _fsync_write(tmp / STATE, buffer.getvalue())
    _fsync_dir(tmp)
    final = root / name
    if final.exists():  # this step was saved before (a resumed run passing it again)
        old = root / f".tmp-old-{name}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_dir(root)
    atomic_write(root / "latest", name.encode())
    # Keep the newest `keep` checkpoints up to this one. Any later than this one belong to a
    # timeline that was abandoned (a run resumed from an earlier checkpoint): they go, or they
    # would count among the newest and push out the one `latest` names.
    others = [p for p in root.glob("step_*") if p.is_dir() and p != final]
    newer = [p for p in others if _step_of(p) > step]
    older = sorted((p for p in others if _step_of(p) < step), key=_step_of)
    for old in newer + older[:max(len(older) - (keep - 1), 0)]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def save_best(run_dir: Path, model: torch.nn.Module, step: int, val_loss: float) -> None:
    root = run_dir / CHECKPOINTS / "best"
    root.mkdir(parents=True, exist_ok=True)
    atomic_write(root / WEIGHTS, weights_bytes(model))
    atomic_write(root / "info.txt", f"step {step}\nval_loss {val_loss:.6f}\n".encode())


def holds_checkpoints(run_dir: Path) -> bool:
    """Whether run_dir holds any checkpoint, even one `latest` does not (validly) name: a new run
    must not start there, or it would overwrite them."""
    root = run_dir / CHECKPOINTS
    return (root / "latest").is_file() or any(root.glob("step_*"))


def latest_checkpoint(run_dir: Path) -> Optional[Path]:
    pointer = run_dir / CHECKPOINTS / "latest"
    if not pointer.is_file():
        return None
    path = run_dir / CHECKPOINTS / pointer.read_text().strip()
    return path if path.is_dir() else None


def find_weights(run_dir: Path, which: str = "latest") -> Path:
    """model.safetensors of the `latest` or `best` checkpoint of a run."""
    if which == "best" and (run_dir / CHECKPOINTS / "best" / WEIGHTS).is_file():
        return run_dir / CHECKPOINTS / "best" / WEIGHTS
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        raise CheckpointError(f"{run_dir} holds no checkpoint (expected {CHECKPOINTS}/latest)")
    return ckpt / WEIGHTS


def load_weights(model: torch.nn.Module, path: Path) -> None:
    """Load safetensors weights into model, saying which part (vocabulary or model shape)
    disagrees when they do not fit."""
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CheckpointError(f"cannot read weights {path} (truncated or corrupt?): {reason}") from exc
    expected = {k: v for k, v in model.state_dict().items() if k not in TIED}
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"weights {path} do not match the model shape of the config: missing "
                              f"{missing[:3]}, unexpected {unexpected[:3]} (different model.n_layer "
                              f"or model.bias?)")
    vocab = getattr(model, "vocab_size", None)
    emb = tensors.get("tok_emb.weight")
    if vocab is not None and emb is not None and emb.ndim == 2 and emb.shape[0] != vocab:
        raise CheckpointError(
            f"weights {path} are for a vocabulary of {emb.shape[0]} tokens, but the tokenizer has "
            f"{vocab}: the checkpoint and the tokenizer do not belong together")
    for key, value in expected.items():
        if tensors[key].shape != value.shape:
            raise CheckpointError(
                f"weights {path} do not match the model shape of the config: {key} has shape "
                f"{tuple(tensors[key].shape)}, the config gives {tuple(value.shape)} (different "
                f"model.n_embd, n_head, block_size or mlp_ratio?)")
    model.load_state_dict(tensors, strict=False)


def _pickle_imports(data: bytes) -> list[str]:
    """module.name of each global a pickle would import, found by reading its opcodes (nothing
    is unpickled)."""
    found, strings = [], []
    try:
        for op, arg, _ in pickletools.genops(data):
            if op.name in ("GLOBAL", "INST"):
                found.append(str(arg).replace(" ", "."))
            elif op.name == "STACK_GLOBAL":
                found.append(".".join(strings[-2:]) if len(strings) >= 2 else "?")
            elif isinstance(arg, str):
                strings.append(arg)
    except Exception:  # not (or not wholly) a pickle: what was found so far
        pass
    return found


def _refuse(path: Path, names: list[str]) -> CheckpointError:
    return CheckpointError(
        f"refusing to load {path}: its pickle would import {', '.join(sorted(set(names))[:3])}, "
        f"which can run code; nothing was loaded or executed (use only checkpoints that train.py "
        f"wrote)")


STATE_KEYS = ("optimizer", "sampler", "rng") + PROGRESS_KEYS


def load_state(path: Path) -> dict:
    """The training state, loaded without ever executing pickled code."""
    if not path.is_file():
        raise CheckpointError(f"cannot read training state {path}: no such file")
    if not zipfile.is_zipfile(path):  # torch.save always writes a zip archive
        try:
            names = _pickle_imports(path.read_bytes())
        except OSError as exc:
            raise CheckpointError(f"cannot read training state {path}: {exc}") from exc
        if names:
            raise _refuse(path, names)
        raise CheckpointError(f"cannot read training state {path}: not a checkpoint written by "
                              f"train.py (truncated or corrupt?)")
    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
    except Exception as exc:
        raise CheckpointError(f"cannot read training state {path} (truncated or corrupt?): "
                              f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from exc
    if unsafe:
        raise _refuse(path, unsafe)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        lines = [l for l in str(exc).splitlines() if "GLOBAL" in l or "operand" in l]
        if any("GLOBAL" in l for l in lines):
            raise CheckpointError(f"refusing to load {path}: {lines[0].strip()}; nothing was "
                                  f"executed") from exc
        raise CheckpointError(f"cannot read training state {path} (truncated or corrupt?)"
                              + (f": {lines[0].strip()}" if lines else "")) from exc
    except (RuntimeError, OSError, EOFError, ValueError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CheckpointError(f"cannot read training state {path} (truncated or corrupt?): "
                              f"{reason}") from exc
    if not isinstance(state, dict) or any(k not in state for k in STATE_KEYS):
        raise CheckpointError(f"training state {path} lacks "
                              + (", ".join(k for k in STATE_KEYS if k not in state)
                                 if isinstance(state, dict) else "everything (not a dict)")
                              + ": not a checkpoint written by train.py")
    return state


def check_tokenizer(tokenizer: Tokenizer, saved: Path) -> None:
    """On resume, the tokenizer built from today's data must be the run's own."""
    try:
        run_tokenizer = load_tokenizer(saved)
    except Exception as exc:  # tokenizers raises plain Exception
        raise CheckpointError(f"cannot resume: cannot read {saved}: {first_line(exc)}") from exc
    if run_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise UserError(
            f"cannot resume: the tokenizer built from the current data "
            f"({tokenizer.get_vocab_size()} tokens) differs from the run's {saved} "
            f"({run_tokenizer.get_vocab_size()} tokens); the corpus (data.*) or the tokenizer "
            f"config changed since the run started")


def restore(run_dir: Path, model: torch.nn.Module, optimizer, sampler,
            tokenizer: Tokenizer) -> Progress:
    """Load the latest checkpoint of run_dir into the model, the optimizer, the batch sampler and
    the random generators; return the loop's counters saved with it."""
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        pointer = run_dir / CHECKPOINTS / "latest"
        if pointer.is_file():
            raise CheckpointError(f"cannot resume: {pointer} names {pointer.read_text().strip()!r}, "
                                  f"which is not in {pointer.parent}")
        raise UserError(f"cannot resume: {run_dir} holds no checkpoint")
    check_tokenizer(tokenizer, run_dir / "tokenizer.json")
    load_weights(model, ckpt / WEIGHTS)
    state = load_state(ckpt / STATE)
    try:
        optimizer.load_state_dict(state["optimizer"])
        sampler.load_state_dict(state["sampler"])
        set_rng_state(state["rng"])
        return Progress.from_state_dict(state)
    except (KeyError, ValueError, TypeError, RuntimeError) as exc:
        raise CheckpointError(f"training state {ckpt / STATE} does not fit this model and "
                              f"run: {first_line(exc)}") from exc
