"""What is read back from a checkpoint, checked before any of it is used: the `latest` pointer,
the weights (model.safetensors) and the training state (state.pt).

A checkpoint can be damaged, or come from someone else. The pointer must name a checkpoint, not a
path out of the run. The weights must be a safetensors file of plausible size holding finite
floats of the model's names and shapes. The training state is a torch.save zip archive, loaded
with `torch.load(weights_only=True)` after its bytes are checked (a plain pickle or compressed
entries are refused unread). That guarantees that loading ran no code, not that what came out is
what train.py saved: a tampered state.pt can hold a string where the step count belongs, an
optimizer moment of the wrong shape, or a random generator state of the wrong length. Used as
they are, such fields fail somewhere inside the first training step, with a traceback, or
silently train on garbage (a NaN moment). So each one is checked against the model, the optimizer
and the generators it will be loaded into, and the first wrong one is named.
"""
from __future__ import annotations

import math
import numbers
import os
import pickle
import pickletools
import re
import warnings
import zipfile
from pathlib import Path
from typing import Optional

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from guard.cli import FormatError, StateMismatch, first_line
from guard.files import MIB, check_regular, read_text
from guard.system import MAX_COUNT
from training.state import PROGRESS_KEYS

STEP_NAME = re.compile(r"step_\d{8,}")


def read_pointer(pointer: Path) -> Optional[str]:
    """The checkpoint name a `latest` file holds; None without one. Only a name of the form
    step_<digits> is accepted: a path could lead out of the run directory."""
    if not os.path.lexists(pointer):
        return None
    name = read_text(pointer, "checkpoint pointer", 256).strip()
    if not STEP_NAME.fullmatch(name):
        raise FormatError(f"{pointer} holds {name[:40]!r}, not the name of a checkpoint "
                          f"(step_<number>); it was not written by train.py")
    return name


# ----------------------------------------------------------------------------- weights


def read_weights(path: Path, expected: dict[str, torch.Tensor], vocab_size: Optional[int]
                 ) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file that are to replace `expected` (a model's stored
    tensors), saying which part (vocabulary or model shape) disagrees when they do not fit. The
    file must be a regular file no bigger than the model's float32 weights (plus the header), and
    every weight a finite float."""
    limit = sum(4 * v.numel() for v in expected.values()) + 16 * MIB
    check_regular(path, "weights file", limit)
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise FormatError(f"cannot read weights {path} (truncated or corrupt?): "
                          f"{first_line(exc)}") from exc
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise FormatError(f"weights {path} do not match the model shape of the config: missing "
                          f"{missing[:3]}, unexpected {unexpected[:3]} (different model.n_layer "
                          f"or model.bias?)")
    emb = tensors.get("tok_emb.weight")
    if vocab_size is not None and emb is not None and emb.ndim == 2 and emb.shape[0] != vocab_size:
        raise FormatError(
            f"weights {path} are for a vocabulary of {emb.shape[0]} tokens, but the tokenizer has "
            f"{vocab_size}: the checkpoint and the tokenizer do not belong together")
    for key, value in expected.items():
        if tensors[key].shape != value.shape:
            raise FormatError(
                f"weights {path} do not match the model shape of the config: {key} has shape "
                f"{tuple(tensors[key].shape)}, the config gives {tuple(value.shape)} (different "
                f"model.n_embd, n_head, block_size or mlp_ratio?)")
    for key, tensor in tensors.items():
        check_float_weights(tensor, f"weights {path}: {key}")
    return tensors


def check_float_weights(tensor: torch.Tensor, name: str) -> None:
    """A weight from elsewhere must be floating point and finite."""
    if not tensor.is_floating_point():
        raise FormatError(f"{name} holds {tensor.dtype} values, not a floating-point tensor")
    if not bool(torch.isfinite(tensor).all()):
        raise FormatError(f"{name} holds NaN or infinite values; these weights cannot be used")


# ----------------------------------------------------------------------------- state.pt


STATE_KEYS = ("optimizer", "sampler", "rng") + PROGRESS_KEYS


# Without the model at hand: the largest state.pt this project could write.
MAX_STATE_BYTES = 1 << 34


def load_state(path: Path, params: Optional[int] = None) -> dict:
    """The training state of a model of `params` parameters, loaded without ever executing
    pickled code, and not yet checked field by field (`check_state`).

    torch.save writes a zip archive of stored (uncompressed) entries; anything else is refused
    before it is unpickled: a plain pickle (its imports are named, from its opcodes), entries
    that would decompress to more than the file's size limit (the weights, two optimizer moments
    per weight, and the small rest). torch.load(weights_only=True) then refuses any global outside
    its allow-list, naming it."""
    limit = MAX_STATE_BYTES if params is None else 4 * 4 * params + 64 * MIB
    check_regular(path, "training state", limit)
    try:
        if not zipfile.is_zipfile(path):
            names = _pickle_imports(path.read_bytes())
            if names:
                raise _refuse(path, names)
            raise FormatError(f"cannot read training state {path}: not a checkpoint written "
                              f"by train.py (truncated or corrupt?)")
        with zipfile.ZipFile(path) as archive:
            entries = archive.infolist()
        if any(e.compress_type != zipfile.ZIP_STORED for e in entries) \
                or sum(e.file_size for e in entries) > limit:
            raise FormatError(f"refusing to load {path}: it holds compressed or oversized "
                              f"entries, which torch.save never writes")
    except (OSError, zipfile.BadZipFile) as exc:
        raise FormatError(f"cannot read training state {path} (truncated or corrupt?): "
                          f"{first_line(exc)}") from exc
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        lines = [l for l in str(exc).splitlines() if "GLOBAL" in l or "operand" in l]
        if any("GLOBAL" in l for l in lines):
            raise FormatError(f"refusing to load {path}: {lines[0].strip().rstrip('.')}; "
                              f"nothing was executed") from exc
        raise FormatError(f"cannot read training state {path} (truncated or corrupt?)"
                          + (f": {lines[0].strip()}" if lines else "")) from exc
    except Exception as exc:  # the zip or pickle reader on damaged bytes: many kinds of error
        raise FormatError(f"cannot read training state {path} (truncated or corrupt?): "
                          f"{first_line(exc)}") from exc
    if not isinstance(state, dict) or any(k not in state for k in STATE_KEYS):
        raise FormatError(f"training state {path} lacks "
                          + (", ".join(k for k in STATE_KEYS if k not in state)
                             if isinstance(state, dict) else "everything (not a dict)")
                          + ": not a checkpoint written by train.py")
    return state


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


def _refuse(path: Path, names: list[str]) -> FormatError:
    return FormatError(
        f"refusing to load {path}: its pickle would import {', '.join(sorted(set(names))[:3])}, "
        f"which can run code; nothing was loaded or executed (use only checkpoints that train.py "
        f"wrote)")


# ----------------------------------------------------------------------------- the state's fields


def check_state(state: dict, optimizer, sampler) -> None:
    """Raise StateMismatch naming the first field of a loaded state that the loop cannot use."""
    check_progress(state)
    check_optimizer(state["optimizer"], optimizer)
    sampler_state = _dict(state["sampler"], "sampler")
    _tensor(sampler_state.get("generator"), "sampler.generator", sampler.generator.get_state().shape,
            torch.uint8)
    check_rng(state["rng"])


# ----------------------------------------------------------------------------- scalars


def _int(value, name: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise StateMismatch(f"{name} must be an integer, got {type(value).__name__}")
    if not low <= value <= high:
        raise StateMismatch(f"{name} must be between {low} and {high}, got {value}")
    return int(value)


def _float(value, name: str, finite: bool = True, allow_nan: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise StateMismatch(f"{name} must be a number, got {type(value).__name__}")
    value = float(value)
    if math.isnan(value) and not allow_nan or finite and math.isinf(value):
        raise StateMismatch(f"{name} must be a finite number, got {value}")
    return value


def _list(value, name: str, max_len: int) -> list:
    if not isinstance(value, (list, tuple)):
        raise StateMismatch(f"{name} must be a list, got {type(value).__name__}")
    if len(value) > max_len:
        raise StateMismatch(f"{name} has {len(value)} entries, more than {max_len}")
    return list(value)


def _dict(value, name: str) -> dict:
    if not isinstance(value, dict):
        raise StateMismatch(f"{name} must be a mapping, got {type(value).__name__}")
    return value


def _tensor(value, name: str, shape, dtype: torch.dtype) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise StateMismatch(f"{name} must be a tensor, got {type(value).__name__}")
    if tuple(value.shape) != tuple(shape) or value.dtype != dtype:
        raise StateMismatch(f"{name} is a {str(value.dtype).replace('torch.', '')} tensor of "
                            f"shape {tuple(value.shape)}, expected {str(dtype).replace('torch.', '')}"
                            f" {tuple(shape)}")
    if value.is_floating_point() and not bool(torch.isfinite(value).all()):
        raise StateMismatch(f"{name} holds NaN or infinite values")
    return value


# ----------------------------------------------------------------------------- the parts


def check_progress(state: dict) -> None:
    """The loop's counters (training.state.Progress)."""
    step = _int(state["step"], "step", 0, MAX_COUNT)
    _int(state["tokens_seen"], "tokens_seen", 0, 2**63 - 1)
    _float(state["best_val"], "best_val", finite=False)
    _int(state["best_step"], "best_step", -1, step)
    if _float(state["elapsed"], "elapsed") < 0:
        raise StateMismatch(f"elapsed must not be negative, got {state['elapsed']}")
    _int(state["skipped"], "skipped", 0, step)
    for i, loss in enumerate(_list(state["loss_window"], "loss_window", step)):
        _float(loss, f"loss_window[{i}]")
    for i, entry in enumerate(_list(state["history"], "history", step + 1)):
        entry = _list(entry, f"history[{i}]", 3)
        if len(entry) != 3:
            raise StateMismatch(f"history[{i}] must be [step, val loss, train loss]")
        _int(entry[0], f"history[{i}] step", 0, step)
        for value, what in zip(entry[1:], ("val loss", "train loss")):
            _float(value, f"history[{i}] {what}", finite=False, allow_nan=True)


def check_optimizer(saved, optimizers) -> None:
    """The optimizer state against the live optimizers (training.optim.Optimizers): the same
    optimizers, groups and parameters, every tensor of its parameter's shape and finite."""
    saved = _dict(saved, "optimizer")
    states = _list(saved.get("optimizers"), "optimizer.optimizers", 16)
    if len(states) != len(optimizers.optimizers):
        raise StateMismatch(f"the optimizer state holds {len(states)} optimizer(s), this run has "
                            f"{len(optimizers.optimizers)} (different optim.name?)")
    for k, (state, live) in enumerate(zip(states, optimizers.optimizers)):
        name = f"optimizer {k} ({type(live).__name__})"
        state = _dict(state, name)
        live_sd = live.state_dict()
        groups = _list(state.get("param_groups"), f"{name} param_groups", 64)
        if len(groups) != len(live_sd["param_groups"]):
            raise StateMismatch(f"{name} has {len(groups)} parameter groups, expected "
                                f"{len(live_sd['param_groups'])}")
        params = {}
        for g, (group, live_group, live_params) in enumerate(zip(
                groups, live_sd["param_groups"], live.param_groups)):
            group = _dict(group, f"{name} group {g}")
            if group.get("params") != live_group["params"]:
                raise StateMismatch(f"{name} group {g} lists other parameters than this model "
                                    f"has (different model shape or optim settings?)")
            params.update(zip(live_group["params"], live_params["params"]))
            for key, value in live_group.items():
                if key != "params":
                    _same_kind(group.get(key, _ABSENT), value, f"{name} group {g} {key}")
        per_param = _dict(state.get("state"), f"{name} state")
        for index, slots in per_param.items():
            if index not in params:
                raise StateMismatch(f"{name} holds state for parameter {index!r}, which this "
                                    f"model does not have")
            p = params[index]
            for slot, value in _dict(slots, f"{name} state of parameter {index}").items():
                where = f"{name} {slot} of parameter {index}"
                if isinstance(value, torch.Tensor) and value.dim() == 0:
                    _tensor(value, where, (), value.dtype)
                    if not value.is_floating_point() and value.dtype != torch.int64:
                        raise StateMismatch(f"{where} has dtype {value.dtype}")
                elif isinstance(value, torch.Tensor):
                    _tensor(value, where, p.shape, p.dtype)
                else:
                    _float(value, where)


_ABSENT = object()


def _same_kind(value, reference, name: str) -> None:
    """value is of reference's kind (a hyper-parameter of an optimizer group)."""
    if value is _ABSENT:  # saved by another torch version: torch fills in its default
        return
    if reference is None or isinstance(reference, (bool, str)):
        if type(value) is not type(reference):
            raise StateMismatch(f"{name} must be {reference!r}-like, got {type(value).__name__}")
    elif isinstance(reference, numbers.Real):
        _float(value, name)
    elif isinstance(reference, (tuple, list)):
        value = _list(value, name, len(reference))
        if len(value) != len(reference):
            raise StateMismatch(f"{name} must have {len(reference)} entries")
        for i, (v, r) in enumerate(zip(value, reference)):
            _same_kind(v, r, f"{name}[{i}]")
    elif isinstance(reference, torch.Tensor):
        _tensor(value, name, reference.shape, reference.dtype)


def check_rng(rng) -> None:
    """The Python, NumPy, torch (and CUDA, MPS) generator states of training.state.rng_state."""
    rng = _dict(rng, "rng")
    for key in ("python", "torch", "numpy", "numpy_pos", "numpy_gauss"):
        if key not in rng:
            raise StateMismatch(f"rng lacks its {key} state")
    python = _list(rng["python"], "rng.python", 3)
    if len(python) != 3:
        raise StateMismatch("rng.python must be (version, state, gauss)")
    _int(python[0], "rng.python version", 3, 3)
    internal = _list(python[1], "rng.python state", 625)
    if len(internal) != 625:
        raise StateMismatch(f"rng.python state must have 625 entries, got {len(internal)}")
    for i, word in enumerate(internal[:-1]):
        _int(word, f"rng.python state[{i}]", 0, 2**32 - 1)
    _int(internal[-1], "rng.python position", 0, 624)
    if python[2] is not None:
        _float(python[2], "rng.python gauss")
    _tensor(rng["torch"], "rng.torch", torch.get_rng_state().shape, torch.uint8)
    keys = _list(rng["numpy"], "rng.numpy", 624)
    if len(keys) != 624:
        raise StateMismatch(f"rng.numpy must have 624 entries, got {len(keys)}")
    for i, word in enumerate(keys):
        _int(word, f"rng.numpy[{i}]", 0, 2**32 - 1)
    _int(rng["numpy_pos"], "rng.numpy_pos", 0, 624)
    gauss = _list(rng["numpy_gauss"], "rng.numpy_gauss", 2)
    if len(gauss) != 2:
        raise StateMismatch("rng.numpy_gauss must be [has_gauss, cached_gaussian]")
    _int(gauss[0], "rng.numpy_gauss flag", 0, 1)
    _float(gauss[1], "rng.numpy_gauss value")
    if "cuda" in rng:
        for i, s in enumerate(_list(rng["cuda"], "rng.cuda", 1024)):
            if not isinstance(s, torch.Tensor) or s.dtype != torch.uint8 or s.dim() != 1:
                raise StateMismatch(f"rng.cuda[{i}] must be a byte tensor")
    if "mps" in rng:  # restored only where there is MPS, which then says its size
        s = rng["mps"]
        if not isinstance(s, torch.Tensor) or s.dtype != torch.uint8 or s.dim() != 1:
            raise StateMismatch("rng.mps must be a byte tensor")
        if torch.backends.mps.is_available():
            _tensor(s, "rng.mps", torch.mps.get_rng_state().shape, torch.uint8)
