"""A Hugging Face model folder from elsewhere (config.json, model.safetensors), for any
architecture: its files, the fields of its config.json and the tensors of its weights, each
checked before it is used. interop/hf.py says what GPT-2's names and shapes are.

Only a single, unsharded model.safetensors is read, never a pickle (pytorch_model.bin). The
weights file may be no bigger than the tensors the config implies, every tensor's shape is checked
in the file's header before it is read, and every value must be a finite float.
"""
from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path
from typing import Iterator, Union

import torch
from safetensors import SafetensorError, safe_open

from safeio.checkpoint import check_float_weights
from safeio.cli import FormatError, first_line
from safeio.files import check_regular, read_json

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
MAX_JSON_BYTES = 1 << 20  # config.json is a few hundred bytes
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on its JSON header

PathLike = Union[str, os.PathLike]


def open_folder(path: PathLike) -> tuple[dict, Path, Path]:
    """(config.json's object, its path, the weights' path) of a model folder."""
    folder = Path(path)
    if not folder.is_dir():
        raise FormatError(f"{folder} is not a directory (expected a Hugging Face model folder "
                          f"with {CONFIG} and {WEIGHTS})")
    config_path, weights_path = folder / CONFIG, folder / WEIGHTS
    if not config_path.exists():
        raise FormatError(f"{folder} has no {CONFIG}: not a Hugging Face model folder")
    if not weights_path.exists():
        others = [n for n in ("model.safetensors.index.json", "pytorch_model.bin")
                  if (folder / n).exists()]
        hint = (f" (it has {others[0]}: only a single, unsharded {WEIGHTS} is read, never a "
                f"pickle)" if others else "")
        raise FormatError(f"{folder} has no {WEIGHTS}{hint}")
    return read_json(config_path, "a model config", MAX_JSON_BYTES), config_path, weights_path


class Fields:
    """The values of a config.json, each read with its type checked; errors name the file."""

    def __init__(self, config: dict, path: Path):
        self.config, self.path = config, path

    def positive_int(self, key: str) -> int:
        if key not in self.config:
            raise FormatError(f"{self.path} has no {key!r}")
        value = self.config[key]
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise FormatError(f"{self.path}: {key} must be a positive integer, got {value!r}")
        return value

    def option(self, key: str, default):
        """An optional value: `default` (transformers' own) when absent, else of its type (an
        int where a float is expected passes)."""
        value = self.config.get(key, default)
        if value is not None and type(value) is not type(default) and not (
                isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool)):
            raise FormatError(f"{self.path}: {key} must be {type(default).__name__}, got {value!r}")
        return value


def tensor_names(weights: Path, limit: int) -> set[str]:
    """The tensor names in a weights file of at most limit bytes."""
    check_regular(weights, "the weights of this config", limit)
    with _reading(weights):
        with safe_open(str(weights), framework="pt") as f:
            return set(f.keys())


def read_tensors(weights: Path, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """The tensors named in `shapes`, as float32, each of the shape given there."""
    out = {}
    with _reading(weights):
        with safe_open(str(weights), framework="pt") as f:
            for name, expected in shapes.items():
                shape = tuple(f.get_slice(name).get_shape())
                if shape != expected:
                    raise FormatError(f"{weights}: {name} has shape {shape}, {CONFIG} implies "
                                      f"{expected}")
                tensor = f.get_tensor(name)
                if tensor.is_floating_point():
                    tensor = tensor.to(torch.float32)
                check_float_weights(tensor, f"{weights}: {name}")
                out[name] = tensor
    return out


def size_limit(shapes: dict[str, tuple[int, ...]], extra_elements: int = 0) -> int:
    """The most bytes a weights file of these tensors can hold: 8 a value (float64), plus what
    else such files may carry, plus the header."""
    elements = sum(math.prod(s) for s in shapes.values()) + extra_elements
    return 8 * elements + MAX_HEADER_BYTES


@contextlib.contextmanager
def _reading(weights: Path) -> Iterator[None]:
    """safetensors' and the file system's errors as FormatError."""
    try:
        yield
    except SafetensorError as exc:
        raise FormatError(f"cannot read {weights} (truncated or corrupt?): "
                          f"{first_line(exc)}") from None
    except OSError as exc:
        raise FormatError(f"cannot read {weights}: {exc.strerror or exc}") from None
