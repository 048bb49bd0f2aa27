"""What an answer from the sandboxed child must look like before the checker reads any of it.

The child runs the user's file, so it may write anything onto the pipe: a frame that is not
runner.py's (a forged answer), or one whose tensors the comparisons cannot use (sparse,
quantized, complex: the last would lose its imaginary part and pass). `check_answer` refuses
each with one sentence, so the checker never fails on them with a traceback, and never judges
them.
"""
from __future__ import annotations

import torch

DTYPES = {"float64", "float32", "float16", "bfloat16"}


class BadAnswer(ValueError):
    """The child answered what we did not ask for (one sentence)."""


def _tensor(value, where: str, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, torch.Tensor):
        raise BadAnswer(f"{where} is a {type(value).__name__}, not a tensor")
    kind = ("sparse" if value.layout != torch.strided else "quantized" if value.is_quantized else
            "complex" if value.is_complex() else "")
    if kind:
        raise BadAnswer(f"{where} is a {kind} tensor; the checker compares dense real tensors")


def _list(value, where: str, n=None) -> list:
    if not isinstance(value, (list, tuple)) or (n is not None and len(value) != n):
        raise BadAnswer(f"{where} is not a list" + (f" of {n}" if n is not None else ""))
    return list(value)


def _of(value, types, where: str):
    types = types if isinstance(types, tuple) else (types,)
    if not isinstance(value, types) or isinstance(value, bool) and bool not in types:
        raise BadAnswer(f"{where} is a {type(value).__name__}")
    return value


def check_answer(cmd: str, request: dict, answer) -> None:
    """Raise BadAnswer unless `answer` is what runner.py answers to `request`."""
    if not isinstance(answer, dict):
        raise BadAnswer("the answer is not a dict")
    if "error" in answer:
        _of(answer["error"], str, "the error")
        return
    if cmd == "load" and answer.get("kind") == "function":
        _of(answer.get("how"), str, "how"), _of(answer.get("takes_mask"), bool, "takes_mask")
    elif cmd == "load":
        _of(answer.get("kind"), str, "kind")
        if answer["kind"] != "module" or answer.get("dtype") not in DTYPES:
            raise BadAnswer("the layer's kind or dtype is none the checker knows")
        for key in ("how", "device"):
            _of(answer.get(key), str, key)
        _of(answer.get("dropouts"), int, "dropouts")
        for name in _list(answer.get("consumed"), "consumed"):
            _of(name, str, "consumed")
        for name, p in _of(answer.get("params"), dict, "params").items():
            _tensor(p, f"parameter {_of(name, str, 'a parameter name')}")
        for entry in _list(answer.get("linears"), "linears"):
            _of(entry.get("name") if isinstance(entry, dict) else None, str, "a Linear's name")
            _of(entry.get("cls"), str, "a Linear's class")
        for key, value in _of(answer.get("attrs"), dict, "attrs").items():
            _of(key, str, "an attribute's name"), _of(value, (int, float), key)
        for key in ("d_model", "n_head", "window"):
            _of(answer.get(key), (int, type(None)), key)
        for entry in _list(answer.get("norms", []), "norms"):
            _of(entry.get("name") if isinstance(entry, dict) else None, str, "a norm's name")
            _of(entry.get("cls"), str, "a norm's class")
            _of(entry.get("eps"), (int, float, type(None)), "a norm's eps")
        for name, b in _of(answer.get("buffers", {}), dict, "buffers").items():
            _tensor(b, f"buffer {_of(name, str, 'a buffer name')}")
    elif cmd == "forward":
        n = len(request["xs"])
        for y in _list(answer.get("ys"), "ys", n):
            _tensor(y, "an output", optional=True)
        for e in _list(answer.get("errors"), "errors", n):
            _of(e, (str, type(None)), "an error")
        for capture in _list(answer.get("captures", [{}] * n), "captures", n):
            for record in _of(capture, dict, "a capture").values():
                _of(_of(record, dict, "a capture").get("calls"), int, "calls")
                for key in ("input", "output"):
                    _tensor(record.get(key), f"a captured {key}", optional=True)
        for moved in _list(answer.get("changed", [[]] * n), "changed", n):
            for name in _list(moved, "changed"):
                _of(name, str, "a changed input")
        for grads in _list(answer.get("grads", [None] * n), "grads", n):
            for key, g in (_of(grads, dict, "grads") if grads is not None else {}).items():
                _tensor(g, f"the gradient of {_of(key, str, 'a gradient name')}", optional=True)
    elif cmd == "context":
        for size in _list(answer.get("sizes"), "sizes"):
            _of(size, int, "a size")
    elif cmd == "rebuild":
        for size in _list(answer.get("shape"), "shape"):
            _of(size, int, "a size")
