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
import re
import shutil
import warnings
import zipfile
from pathlib import Path
from typing import Optional

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save
from tokenizers import Tokenizer

from data.files import MIB, FileRefused, check_regular, read_text
from data.tokenizer import load_tokenizer
from training.errors import UserError, first_line
from training.state import PROGRESS_KEYS, Progress, set_rng_state
from training.state_check import StateMismatch, check_state

CHECKPOINTS = "checkpoints"
WEIGHTS = "model.safetensors"
STATE = "state.pt"
TIED = ("lm_head.weight",)  # shares storage with tok_emb.weight when tied; then stored once


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


def stored_state(model: torch.nn.Module) -> dict:
    """The model's state dict without a TIED tensor that is another's storage (a tied head)."""
    state = model.state_dict()
    others = {v.data_ptr() for k, v in state.items() if k not in TIED}
    return {k: v for k, v in state.items() if k not in TIED or v.data_ptr() not in others}


def weights_bytes(model: torch.nn.Module) -> bytes:
    tensors = {k: v.detach().cpu().contiguous() for k, v in stored_state(model).items()}
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


STEP_NAME = re.compile(r"step_\d{8,}")


def latest_pointer(run_dir: Path) -> Optional[str]:
    """The checkpoint name `latest` holds; None without a pointer. Only a name of the form
    step_<digits> is accepted: a path could lead out of the run directory."""
    pointer = run_dir / CHECKPOINTS / "latest"
    if not os.path.lexists(pointer):
        return None
    try:
        name = read_text(pointer, "checkpoint pointer", 256).strip()
    except FileRefused as exc:
        raise CheckpointError(str(exc)) from None
    if not STEP_NAME.fullmatch(name):
        raise CheckpointError(f"{pointer} holds {name[:40]!r}, not the name of a checkpoint "
                              f"(step_<number>); it was not written by train.py")
    return name


def latest_checkpoint(run_dir: Path) -> Optional[Path]:
    """The checkpoint directory `latest` names, or None if there is none."""
    name = latest_pointer(run_dir)
    if name is None:
        return None
    path = run_dir / CHECKPOINTS / name
    return path if path.is_dir() else None


def find_weights(run_dir: Path, which: str = "latest") -> Path:
    """model.safetensors of the `latest` or `best` checkpoint of a run."""
    best = run_dir / CHECKPOINTS / "best" / WEIGHTS
    if which == "best" and os.path.lexists(best):  # load_weights checks what it is
        return best
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        raise CheckpointError(f"{run_dir} holds no checkpoint (expected {CHECKPOINTS}/latest)")
    return ckpt / WEIGHTS


def load_weights(model: torch.nn.Module, path: Path) -> None:
    """Load safetensors weights into model, saying which part (vocabulary or model shape)
    disagrees when they do not fit. The file must be a regular file no bigger than the model's
    float32 weights (plus the header), and every weight a finite float."""
    expected = stored_state(model)
    limit = sum(4 * v.numel() for v in expected.values()) + 16 * MIB
    try:
        check_regular(path, "weights file", limit)
        tensors = load_file(str(path))
    except FileRefused as exc:
        raise CheckpointError(str(exc)) from None
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"cannot read weights {path} (truncated or corrupt?): "
                              f"{first_line(exc)}") from exc
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
    for key, tensor in tensors.items():
        if not tensor.is_floating_point():
            raise CheckpointError(f"weights {path}: {key} holds {tensor.dtype} values, not "
                                  f"floating-point weights")
        if not bool(torch.isfinite(tensor).all()):
            raise CheckpointError(f"weights {path}: {key} holds NaN or infinite values; these "
                                  f"weights cannot be used (train.py never saves such weights)")
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
# The optimizer state of the largest model this project trains is a few hundred MB; a state.pt
# is checked against its own model's size in `restore`.
MAX_STATE_BYTES = 1 << 34


def load_state(path: Path, limit: int = MAX_STATE_BYTES) -> dict:
    """The training state, loaded without ever executing pickled code.

    torch.save writes a zip archive of stored (uncompressed) entries; anything else is refused
    before it is unpickled: a plain pickle (its imports are named, from its opcodes), entries
    that would decompress to more than the file's size limit. torch.load(weights_only=True)
    then refuses any global outside its allow-list, naming it."""
    try:
        check_regular(path, "training state", limit)
    except FileRefused as exc:
        raise CheckpointError(str(exc)) from None
    try:
        is_zip = zipfile.is_zipfile(path)
        if not is_zip:
            names = _pickle_imports(path.read_bytes())
            if names:
                raise _refuse(path, names)
            raise CheckpointError(f"cannot read training state {path}: not a checkpoint written "
                                  f"by train.py (truncated or corrupt?)")
        with zipfile.ZipFile(path) as archive:
            entries = archive.infolist()
        if any(e.compress_type != zipfile.ZIP_STORED for e in entries) \
                or sum(e.file_size for e in entries) > limit:
            raise CheckpointError(f"refusing to load {path}: it holds compressed or oversized "
                                  f"entries, which torch.save never writes")
    except (OSError, zipfile.BadZipFile, ValueError) as exc:
        raise CheckpointError(f"cannot read training state {path} (truncated or corrupt?): "
                              f"{first_line(exc)}") from exc
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        lines = [l for l in str(exc).splitlines() if "GLOBAL" in l or "operand" in l]
        if any("GLOBAL" in l for l in lines):
            raise CheckpointError(f"refusing to load {path}: {lines[0].strip().rstrip('.')}; "
                                  f"nothing was executed") from exc
        raise CheckpointError(f"cannot read training state {path} (truncated or corrupt?)"
                              + (f": {lines[0].strip()}" if lines else "")) from exc
    except Exception as exc:  # the zip or pickle reader on damaged bytes: many kinds of error
        raise CheckpointError(f"cannot read training state {path} (truncated or corrupt?): "
                              f"{first_line(exc)}") from exc
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
        name = latest_pointer(run_dir)
        if name is not None:
            raise CheckpointError(f"cannot resume: {run_dir / CHECKPOINTS / 'latest'} names "
                                  f"{name!r}, which is not in {run_dir / CHECKPOINTS}")
        raise UserError(f"cannot resume: {run_dir} holds no checkpoint")
    check_tokenizer(tokenizer, run_dir / "tokenizer.json")
    load_weights(model, ckpt / WEIGHTS)
    # weights, optimizer moments (two per weight) and the small rest
    params = sum(p.numel() for p in model.parameters())
    state = load_state(ckpt / STATE, limit=4 * 4 * params + 64 * MIB)
    try:
        check_state(state, optimizer, sampler)
    except StateMismatch as exc:
        raise CheckpointError(f"training state {ckpt / STATE} is not one train.py wrote for "
                              f"this run: {exc}") from exc
    try:
        optimizer.load_state_dict(state["optimizer"])
        sampler.load_state_dict(state["sampler"])
        set_rng_state(state["rng"])
        return Progress.from_state_dict(state)
    except (KeyError, ValueError, TypeError, RuntimeError) as exc:
        raise CheckpointError(f"training state {ckpt / STATE} does not fit this model and "
                              f"run: {first_line(exc)}") from exc
