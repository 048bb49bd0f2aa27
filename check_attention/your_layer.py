"""A learner's attention layer in the project's GPT: `python train.py +arm=leak-yours
your_layer=FILE.py:NAME` trains our GPT with every block's attention built from NAME, bound as the
checker binds it (sandbox/runner.py's `bind`: d_model / n_embd / embed_dim ..., n_head /
num_heads ..., a config object, a factory; a returned tuple's first tensor). docs/your_layer.md.

The layer sees x alone: no rotary tables, no KV cache, no mask. So its run has learned
positions, generates by recomputing its context (the Decoder's no-cache path), and its causal
loss is each position's scored from its prefix alone (training/evaluate.py's `prefix_losses`),
which needs nothing of the layer. A file is code: the run keeps a copy (guard/run_dir.py's
`layer_copy`) and imports it, from the bytes it hashed, only when the user says so.
"""
from __future__ import annotations

import hashlib
import inspect
import os
import sys
import types
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn

from check_attention.sandbox.course import adapter_factory, adapter_kind
from check_attention.sandbox.runner import SubmissionError, bind, describe, is_scaled_dot_product
from guard.run_dir import LAYER_DIR, MAX_LAYER_BYTES, layer_copy, load_run
from model.config import ModelConfig
from model.gpt import GPT
from safeio.cli import UserError
from safeio.files import read_bytes
from training.config import Config

NO_CACHE = ("a learner's layer sees x alone and keeps no KV cache: sample it with "
            "use_cache=false (one prompt= at a time)")


class LearnerAttention(nn.Module):
    """What a Block calls, (x, cache, layer, return_weights, rotary, mask) -> (out, weights), on
    a layer that takes x [B, T, d_model] alone: its output (a tuple's first tensor), no weights."""

    def __init__(self, layer: nn.Module, file: str):
        super().__init__()
        self.layer, self.file = layer, file  # (file: to name the learner's line that failed)

    def forward(self, x, cache=None, layer=0, return_weights=False, rotary=None, mask=None):
        try:  # (no cache or rotary tables come: LearnerGPT makes no cache, check_layer no RoPE)
            out = self.layer(x)
        except Exception as exc:  # noqa: BLE001  (the learner's code: one line, their line)
            raise UserError(f"{type(self.layer).__name__} failed on x of shape {list(x.shape)}: "
                            f"{describe(exc, self.file)}") from None
        out = out[0] if isinstance(out, (tuple, list)) and out else out
        if not isinstance(out, torch.Tensor) or out.shape != x.shape:
            shape = list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise UserError(f"{type(self.layer).__name__} returned {shape} for x of shape "
                            f"{list(x.shape)}; a layer returns x's shape")
        return out, None


class LearnerGPT(GPT):
    """Our GPT with a learner's layer in every block; its Linears get the GPT's init (N(0,
    init_std), biases 0) as ours do, and it generates without a KV cache."""

    def __init__(self, cfg: ModelConfig, vocab_size: int, attn, make_layer: Callable[[], nn.Module],
                 file: str):
        super().__init__(cfg, vocab_size, attn)  # (ours built and dropped: the rest inits as ours)
        for block in self.blocks:
            block.attn = LearnerAttention(make_layer(), file)
            for module in block.attn.modules():
                if isinstance(module, nn.Linear):
                    nn.init.normal_(module.weight, 0.0, cfg.init_std)
                    if module.bias is not None:
                        nn.init.zeros_(module.bias)

    def new_cache(self, *args, **kwargs):
        raise UserError(NO_CACHE)

    def generate(self, *args, **kwargs):  # use_cache=False unless asked (then: NO_CACHE)
        call = inspect.signature(GPT.generate).bind(self, *args, **kwargs)
        call.arguments.setdefault("use_cache", False)
        return GPT.generate(*call.args, **call.kwargs)


def layer_factory(code: bytes, path: Path, name: str, m: ModelConfig) -> Callable[[], nn.Module]:
    """A maker of NAME's layers at the model's sizes, NAME from the module whose code is `code`
    (path: its file, for tracebacks; the file is not read again). Each mistake is one UserError
    saying what the checker expected (`bind`'s words)."""
    module = types.ModuleType(f"learner_layer_{hashlib.sha256(code).hexdigest()[:12]}")
    module.__file__ = str(path)
    sys.modules[module.__name__] = module  # (dataclasses and pickling look a class's module up)
    try:
        exec(compile(code, str(path), "exec"), module.__dict__)
    except Exception as exc:  # noqa: BLE001  (the learner's code: any mistake is theirs)
        raise UserError(f"importing {path} failed: {describe(exc, str(path))} (a run keeps the "
                        f"one file your_layer= names: it may import the project and packages, not "
                        f"files of yours beside it)") from None
    obj = getattr(module, name, None)
    if obj is None or isinstance(obj, nn.Module) or not callable(obj) or (
            not isinstance(obj, type) and is_scaled_dot_product(obj)):  # (no weights to train)
        raise UserError(f"your_layer={path.name}:{name}: give a layer class (an nn.Module) or a "
                        f"factory of one, which {path.name} defines: {name} is "
                        f"{'not there' if obj is None else type(obj).__name__}")
    if adapter_kind(obj):  # a course's adapter (CS336): a layer holding its weights
        obj = adapter_factory(obj, adapter_kind(obj))
    try:
        args, kwargs, how, _ = bind(obj, {"d_model": m.n_embd, "n_head": m.n_head,
                                          "block_size": m.block_size})
    except SubmissionError as exc:
        raise UserError(f"your_layer={path.name}:{name}: {exc}") from None

    def make() -> nn.Module:
        try:
            layer = obj(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001
            raise UserError(f"building {how} failed: {describe(exc, str(path))}") from None
        if not isinstance(layer, nn.Module):
            raise UserError(f"{how} returned a {type(layer).__name__}, not an nn.Module")
        return layer
    return make


def keep_layer(cfg: Config, run_dir: Path, write: bool) -> None:
    """A new run's your_layer= file kept as layer/FILE.py (written where `write`: rank 0); cfg's
    your_layer and your_layer_sha256 name that copy, which the run imports from now on."""
    file, _, name = cfg.your_layer.rpartition(":")
    code = read_bytes(Path(file), "layer file", MAX_LAYER_BYTES)
    copy = f"{LAYER_DIR}/{Path(file).name}"
    if write:
        (run_dir / LAYER_DIR).mkdir(parents=True)
        (run_dir / copy).write_bytes(code)
    cfg.your_layer, cfg.your_layer_sha256 = f"{copy}:{name}", hashlib.sha256(code).hexdigest()


def run_model(cfg: Config, vocab_size: int, run_dir: Path, trusted: bool) -> GPT:
    """A run's GPT: ours, or with the learner's layer its config names, imported from the run's
    copy (checked, and refused unless trusted: guard/run_dir.py's layer_copy)."""
    if cfg.your_layer is None:
        return GPT(cfg.model, vocab_size, cfg.attention)
    path, name, code = layer_copy(run_dir, cfg, trusted)
    path = Path(os.path.abspath(path))  # (describe finds the learner's lines by it)
    return LearnerGPT(cfg.model, vocab_size, cfg.attention,
                      layer_factory(code, path, name, cfg.model), str(path))


def open_run(run_dir: Path, which: str, device: torch.device, trust_layer: bool):
    """load_run for generate.py and bench.score: a learner's layer's run too, if trust_layer."""
    return load_run(run_dir, which, device,
                    make=lambda cfg, vocab: run_model(cfg, vocab, run_dir, trust_layer))
