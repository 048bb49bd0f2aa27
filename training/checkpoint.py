"""Checkpoints that survive a kill at any instant and cannot run code when loaded.

A run directory holds:
    config.yaml, tokenizer.json      written once at the start of the run
    checkpoints/step_00001000/       one complete checkpoint (plain data, no pickle):
        model.safetensors            the weights
        state.json                   step and the loop's counters, the optimizer's settings, the
                                     Python and NumPy random states, naming the tensors of
        state.safetensors            the optimizer's moments and the torch generators' states
    checkpoints/best/                the weights with the lowest validation loss so far
    checkpoints/latest               the name of the newest complete checkpoint

A checkpoint is written to a temporary directory, every file flushed and fsync'ed, then renamed
into place; `latest` is replaced the same way afterwards. A crash leaves the previous checkpoint
(and `latest` pointing at it) intact. What is read back is checked first (safeio/checkpoint.py).
"""
from __future__ import annotations

import contextlib
import math
import os
import random
import shutil
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from safetensors.torch import save
from tokenizers import Tokenizer

from safeio.checkpoint import (STATE, STATE_TENSORS, load_state, read_pointer, read_weights,
                               state_files)
from safeio.cli import FormatError, StateMismatch, UserError, first_line
from safeio.corpus import check_same_tokenizer
from safeio.files import dump_run_config

# ----------------------------------------------------------------------------- the training state
# What a checkpoint holds besides weights and optimizer: the loop's counters (`Progress`) and
# every random-number generator's state (CPU, and CUDA or MPS where there is one), so that a resumed
# run continues bit-exactly.


@dataclass
class Progress:
    """The training loop's counters, saved in every checkpoint and restored on resume."""

    step: int = 0                 # optimizer steps taken (skipped non-finite ones included)
    tokens_seen: int = 0          # tokens of the steps that updated the weights
    best_val: float = math.inf    # lowest causal validation loss so far (the `best` weights)
    best_step: int = -1           # the step it was measured at
    elapsed: float = 0.0          # seconds of training so far, evaluations included, all processes
    skipped: int = 0              # non-finite steps skipped (train.on_nonfinite=skip)
    # training losses since the last log line (their mean is the logged train/loss)
    loss_window: list = field(default_factory=list)
    # [step, causal val loss, train loss] at every evaluation: the overfitting guard reads it
    history: list = field(default_factory=list)

    def state_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_state_dict(cls, state: dict) -> "Progress":
        """The counters of a saved state; ValueError naming the first that the loop cannot use
        (a tampered checkpoint: the loop would fail steps later, or train on garbage)."""
        p = cls(**{f.name: state[f.name] for f in fields(cls)})
        count = lambda v, high=2**63 - 1: type(v) is int and 0 <= v <= high  # noqa: E731
        number = lambda v: type(v) in (int, float) and not math.isnan(v)  # noqa: E731
        finite = lambda v: number(v) and math.isfinite(v)  # noqa: E731
        checks = {
            "step": count(p.step), "tokens_seen": count(p.tokens_seen),
            "skipped": count(p.skipped) and count(p.step) and p.skipped <= p.step,
            "best_step": p.best_step == -1 or count(p.best_step) and count(p.step)
            and p.best_step <= p.step,
            # a loss, with the step it was measured at; or none yet (inf, -1)
            "best_val": number(p.best_val) and (p.best_val == math.inf and p.best_step == -1
                                                or finite(p.best_val) and p.best_val >= 0
                                                and p.best_step != -1),
            "elapsed": finite(p.elapsed) and p.elapsed >= 0,
            "loss_window": type(p.loss_window) is list and all(map(finite, p.loss_window))
            and count(p.step) and len(p.loss_window) <= p.step,
            # one evaluation a step at most, in order, none after the state's own step
            "history": type(p.history) is list and count(p.step)
            and len(p.history) <= p.step + 1 and all(
                type(e) is list and len(e) == 3 and count(e[0]) and
                all(type(v) in (int, float) for v in e[1:]) for e in p.history)
            and all(a[0] < b[0] for a, b in zip(p.history, p.history[1:]))
            and (not p.history or p.history[-1][0] <= p.step),
        }
        wrong = next((name for name, ok in checks.items() if not ok), None)
        if wrong is not None:
            raise ValueError(f"{wrong} is {str(getattr(p, wrong))[:60]!r}, not what train.py "
                             f"writes")
        return p


PROGRESS_KEYS = tuple(f.name for f in fields(Progress))
STATE_KEYS = ("optimizer", "sampler", "rng") + PROGRESS_KEYS  # what a checkpoint's state holds


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict:
    _, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": keys.tolist(), "numpy_pos": int(pos),
             "numpy_gauss": [int(has_gauss), float(cached_gaussian)]}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if torch.backends.mps.is_available():  # dropout on mps draws from its own generator
        state["mps"] = torch.mps.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    has_gauss, cached_gaussian = state["numpy_gauss"]
    pos = int(state["numpy_pos"])
    if not 0 <= pos <= 624:  # NumPy takes any position, and reads its state at it
        raise ValueError(f"numpy_pos {pos} is not a position in NumPy's state (0 to 624)")
    np.random.set_state(("MT19937", np.array(state["numpy"], dtype=np.uint32), pos,
                         int(has_gauss), float(cached_gaussian)))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "mps" in state and torch.backends.mps.is_available():
        torch.mps.set_rng_state(state["mps"])


# ----------------------------------------------------------------------------- files

CHECKPOINTS = "checkpoints"
WEIGHTS = "model.safetensors"

def write_run_files(run_dir: Path, tokenizer: Tokenizer, cfg) -> None:
    """A new run's tokenizer.json and config.yaml, each written atomically: what generate.py,
    the scripts and a resume read back (the config as plain YAML, safeio/files.py)."""
    atomic_write(run_dir / "tokenizer.json", tokenizer.to_str().encode())
    write_run_config(run_dir, cfg)


def write_run_config(run_dir: Path, cfg) -> None:
    """config.yaml, atomically (again when train.budget_minutes has fixed the step count)."""
    atomic_write(run_dir / "config.yaml", dump_run_config(cfg).encode())


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
    with contextlib.suppress(FileNotFoundError, IsADirectoryError):
        os.unlink(tmp)  # left by a writer that was killed, or planted: a link, a FIFO
    _fsync_write(tmp, payload)
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def stored_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict as a checkpoint stores it: a parameter shared by two modules once (the
    head is tied to the token embedding: `lm_head.weight` is `tok_emb.weight`)."""
    own = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
    return {k: v for k, v in model.state_dict().items() if k in own}


def weights_bytes(model: torch.nn.Module) -> bytes:
    return save({k: v.detach().cpu().contiguous() for k, v in stored_tensors(model).items()})


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
    text, tensors = state_files(state)
    _fsync_write(tmp / STATE_TENSORS, tensors)
    _fsync_write(tmp / STATE, text)
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
    """The checkpoint directory `latest` names, or None if there is none."""
    name = read_pointer(run_dir / CHECKPOINTS / "latest")
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
        raise UserError(f"{run_dir} holds no checkpoint (expected {CHECKPOINTS}/latest)")
    return ckpt / WEIGHTS


def load_weights(model: torch.nn.Module, path: Path) -> None:
    """Load a checkpoint's weights into model (read_weights checks they are the model's)."""
    tensors = read_weights(path, stored_tensors(model), getattr(model, "vocab_size", None))
    model.load_state_dict(tensors, strict=False)


def restore(run_dir: Path, model: torch.nn.Module, optimizer, sampler,
            tokenizer: Tokenizer) -> Progress:
    """Load the latest checkpoint of run_dir into the model, the optimizer, the batch sampler and
    the random generators; return the loop's counters saved with it."""
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        name = read_pointer(run_dir / CHECKPOINTS / "latest")
        if name is not None:
            raise FormatError(f"cannot resume: {run_dir / CHECKPOINTS / 'latest'} names "
                              f"{name!r}, which is not in {run_dir / CHECKPOINTS}")
        raise UserError(f"cannot resume: {run_dir} holds no checkpoint")
    check_same_tokenizer(tokenizer, run_dir / "tokenizer.json")
    load_weights(model, ckpt / WEIGHTS)
    state = load_state(ckpt, STATE_KEYS, params=sum(p.numel() for p in model.parameters()))
    return load_training_state(state, optimizer, sampler, ckpt)


def load_training_state(state: dict, optimizer, sampler, ckpt: Path) -> Progress:
    """Load a saved state into the optimizer, the batch sampler and the random generators; return
    the loop's counters. What does not fit is refused by the setters themselves (a generator
    state of the wrong size, an optimizer of other groups or parameters), in one line naming
    the part."""
    parts = (("optimizer", lambda s: load_optimizer(optimizer, s)),
             ("sampler", sampler.load_state_dict), ("rng", set_rng_state),
             ("progress", lambda s: Progress.from_state_dict(state)))
    for part, load in parts:
        try:
            progress = load(state.get(part))
        except (TypeError, ValueError, RuntimeError, LookupError, AttributeError,
                ArithmeticError) as exc:  # what a setter raises on data of another shape
            raise StateMismatch(f"cannot resume from {ckpt}: its {part} state does not fit this "
                                f"run: {first_line(exc)}") from None
    return progress


def load_optimizer(optimizers, saved: dict) -> None:
    """optimizers.load_state_dict(saved), which checks the groups and their sizes, then what it
    takes as it is and the first step would trip on (a traceback) or train on (garbage): each
    hyper-parameter of the kind it was, each moment of its parameter's shape and finite."""
    before = [{k: v for k, v in g.items() if k != "params"} for g in optimizers.param_groups]
    optimizers.load_state_dict(saved)
    for old, group in zip(before, optimizers.param_groups):
        for key, value in old.items():
            if key in group and not _same_kind(group[key], value):
                raise ValueError(f"its {key} is {str(group[key])[:40]}, where this run has "
                                 f"{value!r}")
    for opt in optimizers.optimizers:
        for p, slots in opt.state.items():
            if not isinstance(p, torch.Tensor):  # torch keeps what it cannot place
                raise ValueError(f"it holds state for parameter {p!r}, which this model does "
                                 f"not have")
            for name, value in slots.items():
                if not isinstance(value, torch.Tensor):
                    continue
                if value.dim() and value.shape != p.shape:
                    raise ValueError(f"a {name} of shape {tuple(value.shape)} for a parameter of "
                                     f"shape {tuple(p.shape)}")
                if value.is_floating_point() and not bool(torch.isfinite(value).all()):
                    raise ValueError(f"a {name} holds NaN or infinite values")


def _same_kind(value, reference) -> bool:
    if isinstance(reference, (int, float)) and not isinstance(reference, bool):
        return type(value) in (int, float) and math.isfinite(value)
    if isinstance(reference, tuple):
        return type(value) is tuple and len(value) == len(reference) and all(
            map(_same_kind, value, reference))
    return type(value) is type(reference)


LATEST = Path("runs") / "latest"


def link_latest(run_dir: Path) -> None:
    """runs/latest names the newest run, so `python generate.py` finds it without a path.

    A small text file, not a symlink: TensorBoard follows links, so a `latest` link inside
    `--logdir runs` would show the newest run twice."""
    try:
        LATEST.parent.mkdir(exist_ok=True)
        if LATEST.is_symlink() or LATEST.is_dir():  # a link left by an earlier version
            LATEST.unlink()
        atomic_write(LATEST, f"{run_dir.resolve()}\n".encode())
    except OSError:
        pass  # a convenience only
