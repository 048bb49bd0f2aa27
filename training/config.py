"""The whole run's typed configuration, and its registration with Hydra's ConfigStore.

`conf/config.yaml` starts its defaults list with `schema`, so every YAML file and every command
line override is merged into these dataclasses: an unknown key or a value of the wrong type is
rejected by Hydra before training starts. `validate` then checks the values themselves.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Optional, Sequence

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from data.config import DataConfig, TokenizerConfig, TokenizerKind
from model.config import AttentionConfig, ModelConfig, validate_attention, validate_model


class Schedule(str, Enum):
    cosine = "cosine"      # linear warmup, then cosine decay to min_lr at max_steps
    constant = "constant"  # linear warmup, then lr


class OptimizerName(str, Enum):
    adamw = "adamw"  # AdamW for every parameter
    muon = "muon"    # Muon for the blocks' weight matrices, AdamW for embeddings, norms, biases


class NonFinite(str, Enum):
    stop = "stop"
    skip = "skip"


@dataclass
class OptimConfig:
    """AdamW (or Muon + AdamW) with decoupled weight decay on matrices only (not on biases,
    LayerNorm). One schedule drives both optimizers: Muon's step is rescaled to AdamW's RMS, so
    the same lr suits both."""

    name: OptimizerName = OptimizerName.muon
    lr: float = 4e-3
    min_lr: float = 2e-4
    warmup_steps: int = 100
    schedule: Schedule = Schedule.cosine
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global gradient norm; 0 turns clipping off
    muon_momentum: float = 0.95  # Muon's (Nesterov) momentum; only with name=muon
    muon_lr_scale: float = 1.0   # Muon's lr = this x the schedule's lr (AdamW's)
    muon_ns_steps: int = 5       # Newton-Schulz iterations orthogonalising each update


@dataclass
class TrainConfig:
    max_steps: int = 2000
    batch_size: int = 16            # sequences per micro-batch, per process
    # Micro-batches per optimizer step: the step's batch is batch_size x grad_accum x processes.
    grad_accum: int = 1
    # Stop early once this much training time has passed (null: run all max_steps).
    max_minutes: Optional[float] = None
    eval_interval: int = 250
    eval_batches: int = 20          # fixed random validation batches for periodic evaluation
    final_full_eval: bool = True    # at the end, score every token of the validation split
    log_interval: int = 25
    sample_tokens: int = 300        # text sample logged at each evaluation (0 = none)
    sample_prompt: str = "\n"
    sample_temperature: float = 0.8
    keep_checkpoints: int = 2       # most recent checkpoints kept (the best one is kept too)
    device: str = "auto"            # auto | cpu | cuda | cuda:N
    dtype: str = "auto"             # auto | float32 | bfloat16 (autocast)
    # torch.compile the model; null = auto: on for CUDA, off for CPU, where it does not pay for its
    # compilation time (README, Benchmarks).
    compile: Optional[bool] = None
    # torch.compile's mode: default | reduce-overhead (CUDA graphs: the step is replayed with one
    # launch, for small models whose step is launch-bound on a GPU) | max-autotune |
    # max-autotune-no-cudagraphs
    compile_mode: str = "default"
    threads: Optional[int] = None   # torch CPU threads (null: PyTorch's default)
    progress: bool = True           # tqdm progress bar (on a terminal)
    # A non-finite loss or gradient: stop (keeping the last good checkpoint) or skip the step
    # (counted in TensorBoard as train/skipped_steps).
    on_nonfinite: NonFinite = NonFinite.stop
    # The overfitting guard: validation loss rising for this many evaluations in a row while
    # training loss falls is reported on the console and in TensorBoard (0 = off) ...
    overfit_patience: int = 3
    # ... and with early_stop the run then stops (the best weights are in checkpoints/best).
    early_stop: bool = False
    # Testing aid: make the loss NaN at this step, to exercise on_nonfinite.
    inject_nan_at_step: Optional[int] = None


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    data: DataConfig = field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    seed: int = 1337
    # A run directory to continue from its latest checkpoint.
    resume: Optional[str] = None
    # Name shown for this run in TensorBoard's run list and HParams table (and a multirun's
    # sub-directory name).
    run_name: str = "${attention.name}_seed${seed}"


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


def register_configs() -> None:
    ConfigStore.instance().store(name="schema", node=Config)


def compose(overrides: Sequence[str] = ()) -> Config:
    """The validated config `python train.py <overrides>` would run with, built by Hydra's compose
    API from conf/: benches and tests use the shipped configs instead of restating defaults."""
    from hydra import compose as hydra_compose, initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = hydra_compose("config", overrides=list(overrides))
    conf: Config = OmegaConf.to_object(cfg)
    validate(conf)
    return conf


def _positive(name: str, value, allow_zero: bool = False) -> None:
    ok = value >= 0 if allow_zero else value > 0
    if not ok or (isinstance(value, float) and not math.isfinite(value)):
        raise ValueError(f"{name} must be {'non-negative' if allow_zero else 'positive'}, got {value}")


def validate(cfg: Config) -> None:
    """Raise ValueError naming the first bad value (types were already checked by Hydra)."""
    validate_model(cfg.model)
    validate_attention(cfg.attention)
    o, t = cfg.optim, cfg.train
    _positive("optim.lr", o.lr)
    _positive("optim.min_lr", o.min_lr, allow_zero=True)
    _positive("optim.warmup_steps", o.warmup_steps, allow_zero=True)
    _positive("optim.weight_decay", o.weight_decay, allow_zero=True)
    _positive("optim.grad_clip", o.grad_clip, allow_zero=True)
    _positive("optim.muon_ns_steps", o.muon_ns_steps)
    _positive("optim.muon_lr_scale", o.muon_lr_scale)
    for name in ("beta1", "beta2", "muon_momentum"):
        if not 0.0 <= getattr(o, name) < 1.0:
            raise ValueError(f"optim.{name} must be in [0, 1), got {getattr(o, name)}")
    for name in ("max_steps", "batch_size", "grad_accum", "eval_interval", "eval_batches",
                 "log_interval",
                 "keep_checkpoints"):
        _positive(f"train.{name}", getattr(t, name))
    _positive("train.sample_tokens", t.sample_tokens, allow_zero=True)
    _positive("train.overfit_patience", t.overfit_patience, allow_zero=True)
    if t.compile_mode not in COMPILE_MODES:
        raise ValueError(f"train.compile_mode must be one of {', '.join(COMPILE_MODES)}, "
                         f"got {t.compile_mode!r}")
    _positive("train.sample_temperature", t.sample_temperature)
    if t.max_minutes is not None:
        _positive("train.max_minutes", t.max_minutes)
    if t.threads is not None:
        _positive("train.threads", t.threads)
    if t.dtype not in ("auto", "float32", "bfloat16"):
        raise ValueError(f"train.dtype must be auto, float32 or bfloat16, got {t.dtype!r}")
    if not (t.device in ("auto", "cpu", "cuda") or t.device.startswith("cuda:")):
        raise ValueError(f"train.device must be auto, cpu, cuda or cuda:N, got {t.device!r}")
    if cfg.data.num_proc is not None:
        _positive("data.num_proc", cfg.data.num_proc)
    if cfg.tokenizer.kind is TokenizerKind.bpe and cfg.tokenizer.vocab_size < 257:
        raise ValueError("tokenizer.vocab_size must be at least 257 for byte-level BPE "
                         f"(256 bytes + 1 special token), got {cfg.tokenizer.vocab_size}")
