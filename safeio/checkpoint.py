"""What is read back from a checkpoint, checked before any of it is used: the `latest` pointer,
the weights (model.safetensors) and the training state (state.json with state.safetensors).

A checkpoint can be damaged, or come from someone else. The pointer must name a checkpoint, not a
path out of the run; the weights, finite floats of the model's names and shapes; the training
state is plain data (JSON for counters, hyper-parameters and random states, safetensors for every
tensor), so reading runs no code and there is no pickle to inspect. Whether it fits the run is
asked of the code it is loaded into (training/checkpoint.py).
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Iterable, Optional

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save

from safeio.cli import FormatError, first_line
from safeio.files import MIB, check_regular, read_text

STEP_NAME = re.compile(r"step_\d{8,}")
STATE = "state.json"             # the training state: JSON, naming the tensors it holds
STATE_TENSORS = "state.safetensors"
OLD_STATE = "state.pt"           # the pickle (torch.save) of versions before issue 29


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
    tensors = _load_tensors(path, "weights", limit)
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


def _load_tensors(path: Path, what: str, limit: int) -> dict[str, torch.Tensor]:
    check_regular(path, what, limit)
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise FormatError(f"cannot read {what} {path} (truncated or corrupt?): "
                          f"{first_line(exc)}") from exc


# ----------------------------------------------------------------------------- training state


# Without the model at hand: the largest state this project could write. The JSON holds the
# counters, one loss per step at most and the Python and NumPy generators (about 15 KB).
MAX_STATE_BYTES = 1 << 34
MAX_STATE_JSON = 256 * MIB


def state_files(state: dict) -> tuple[bytes, bytes]:
    """The training state (nested dicts, lists and tuples of numbers, strings, dtypes and
    tensors) as the bytes of state.json and of state.safetensors."""
    tensors: dict[str, torch.Tensor] = {}
    plain = _plain(state, "", tensors)
    return json.dumps(plain).encode(), save(tensors)


def _plain(value, name: str, tensors: dict):
    """value as JSON; a tensor goes into `tensors` under its path, and what JSON cannot say
    (a tuple, a dtype, a dict with other than string keys) is written as a one-key {"$...": }."""
    if isinstance(value, torch.Tensor):
        if name in tensors:
            raise ValueError(f"two tensors named {name!r}")
        tensors[name] = value.detach().to("cpu", copy=True).contiguous()
        return {"$tensor": name}
    if isinstance(value, torch.dtype):
        return {"$dtype": str(value).removeprefix("torch.")}
    if isinstance(value, (list, tuple)):
        items = [_plain(v, f"{name}.{i}", tensors) for i, v in enumerate(value)]
        return {"$tuple": items} if isinstance(value, tuple) else items
    if isinstance(value, dict):
        items = [[k, _plain(v, f"{name}.{k}".lstrip("."), tensors)] for k, v in value.items()]
        plain = all(isinstance(k, str) and not k.startswith("$") for k in value)
        return dict(items) if plain else {"$items": items}
    if isinstance(value, np.generic):  # a NumPy number among the counters
        value = value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"{name}: a {type(value).__name__} is not plain data")


def _rebuilt(value, tensors: dict):
    """What _plain wrote, back (KeyError, TypeError or ValueError on anything else)."""
    if isinstance(value, list):
        return [_rebuilt(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1 and next(iter(value)).startswith("$"):
        tag, inner = next(iter(value.items()))
        if tag == "$tensor":
            return tensors[inner]
        if tag == "$dtype" and isinstance(getattr(torch, str(inner), None), torch.dtype):
            return getattr(torch, inner)
        if tag == "$tuple":
            return tuple(_rebuilt(v, tensors) for v in inner)
        if tag == "$items":
            return {k: _rebuilt(v, tensors) for k, v in inner}
        raise ValueError(f"unknown entry {tag!r}")
    return {k: _rebuilt(v, tensors) for k, v in value.items()}


def load_state(ckpt: Path, keys: Iterable[str] = (), params: Optional[int] = None) -> dict:
    """The training state of checkpoint directory `ckpt` for a model of `params` parameters,
    holding (at least) `keys`; not yet loaded into anything."""
    path = ckpt / STATE
    if not os.path.lexists(path) and os.path.lexists(ckpt / OLD_STATE):
        raise FormatError(f"{ckpt} holds its training state as {OLD_STATE} (a pickle, written by "
                          f"an earlier version of train.py), which this version cannot resume; "
                          f"its weights still load (generate.py, init_from)")
    text = read_text(path, "training state", MAX_STATE_JSON)
    # a moment or two per parameter (float32) and the generators' states, with room to spare
    limit = MAX_STATE_BYTES if params is None else 4 * 4 * params + 64 * MIB
    tensors = _load_tensors(ckpt / STATE_TENSORS, "training state tensors", limit)
    try:
        state = _rebuilt(json.loads(text), tensors)
    except RecursionError:
        raise FormatError(f"training state {path} is nested too deeply: not written by "
                          f"train.py") from None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise FormatError(f"cannot read training state {path} (truncated or corrupt?): "
                          f"{first_line(exc)}") from None
    if not isinstance(state, dict):
        raise FormatError(f"training state {path} holds a JSON {type(state).__name__}, not a "
                          f"dict: not a checkpoint written by train.py")
    missing = [k for k in keys if k not in state]
    if missing:
        raise FormatError(f"training state {path} lacks {', '.join(missing)}: not a checkpoint "
                          f"written by train.py")
    return state
