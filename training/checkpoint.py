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
import shutil
from pathlib import Path
from typing import Optional

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save

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


def save_checkpoint(run_dir: Path, step: int, model: torch.nn.Module, state: dict,
                    keep: int) -> Path:
    """Write checkpoints/step_<step>/ atomically, point `latest` at it, prune old ones."""
    root = run_dir / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    name = f"step_{step:08d}"
    tmp = root / f".tmp-{name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    _fsync_write(tmp / WEIGHTS, weights_bytes(model))
    buffer = io.BytesIO()
    torch.save(state, buffer)
    _fsync_write(tmp / STATE, buffer.getvalue())
    _fsync_dir(tmp)
    final = root / name
    if final.exists():  # same step saved twice (e.g. signal right after a periodic save)
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    atomic_write(root / "latest", name.encode())
    for old in sorted(root.glob("step_*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def save_best(run_dir: Path, model: torch.nn.Module, step: int, val_loss: float) -> None:
    root = run_dir / CHECKPOINTS / "best"
    root.mkdir(parents=True, exist_ok=True)
    atomic_write(root / WEIGHTS, weights_bytes(model))
    atomic_write(root / "info.txt", f"step {step}\nval_loss {val_loss:.6f}\n".encode())


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
    """Load safetensors weights into model, naming any tensor whose shape disagrees."""
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read weights {path}: {exc}") from exc
    expected = {k: v for k, v in model.state_dict().items() if k not in TIED}
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"weights {path} do not match the model: missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]} (different model config?)")
    for key, value in expected.items():
        if tensors[key].shape != value.shape:
            raise CheckpointError(
                f"weights {path}: {key} has shape {tuple(tensors[key].shape)}, the model expects "
                f"{tuple(value.shape)} (different model size or vocabulary?)")
    model.load_state_dict(tensors, strict=False)


def load_state(path: Path) -> dict:
    """The training state, loaded without ever executing pickled code."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(f"refusing to load {path}: it contains objects that could run code "
                              f"({str(exc).splitlines()[0]})") from exc
    except (RuntimeError, OSError, EOFError, ValueError) as exc:
        raise CheckpointError(f"cannot read training state {path}: {exc}") from exc
