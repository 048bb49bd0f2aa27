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
from model.config import (AttentionConfig, AttentionImpl, ModelConfig, validate_attention,
                          validate_model)


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
    # At each evaluation, every layer's attention maps on a fixed validation window of this many
    # tokens (capped at model.block_size) go to TensorBoard's Images tab (README, TensorBoard).
    attention_maps: bool = True
    attention_map_tokens: int = 48
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
    # A GPT-2-format folder (config.json, model.safetensors, tokenizer.json; e.g. from
    # scripts/export_hf.py) to start from: its weights, model shape and tokenizer are used.
    init_from: Optional[str] = None
    # Name shown for this run in TensorBoard's run list and HParams table (and a multirun's
    # sub-directory name).
    run_name: str = "${attention.name}_seed${seed}"


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# Seeds, step counts and token ids end up in torch's and numpy's 64-bit integers (a seed plus the
# step seeds each evaluation's sample), so they must stay well inside them.
MAX_SEED = 2**63 - 1
MAX_COUNT = 2**62
# Below this, logits / temperature overflow float32 and sampling yields NaN: use greedy instead.
MIN_TEMPERATURE = 1e-6
MAX_WORKERS = 1024  # threads or processes: more is a typo, and each one costs memory
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


def _at_most(name: str, value, limit) -> None:
    if value > limit:
        raise ValueError(f"{name} must be at most {limit:,}, got {value:,}")


def check_seed(name: str, seed: int) -> None:
    if not 0 <= seed <= MAX_SEED:
        raise ValueError(f"{name} must be an integer from 0 to 2**63 - 1, got {seed}")


def check_temperature(name: str, value: float) -> None:
    if not (math.isfinite(value) and value >= MIN_TEMPERATURE):
        raise ValueError(f"{name} must be a finite number of at least {MIN_TEMPERATURE:g}, got "
                         f"{value} (for the most likely token, sample greedily)")


def validate(cfg: Config) -> None:
    """Raise ValueError naming the first bad value (types were already checked by Hydra)."""
    validate_model(cfg.model)
    validate_attention(cfg.attention)
    m = cfg.model
    if cfg.attention.impl is AttentionImpl.fused and \
            (m.dropout if m.attn_dropout is None else m.attn_dropout) > 0:
        raise ValueError("attention.impl=fused has no dropout on the attention weights: set "
                         "model.attn_dropout=0 (dropout elsewhere stays), or attention.impl=auto")
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
    _positive("train.attention_map_tokens", t.attention_map_tokens)
    _positive("train.overfit_patience", t.overfit_patience, allow_zero=True)
    if t.compile_mode not in COMPILE_MODES:
        raise ValueError(f"train.compile_mode must be one of {', '.join(COMPILE_MODES)}, "
                         f"got {t.compile_mode!r}")
    _positive("train.sample_temperature", t.sample_temperature)
    check_temperature("train.sample_temperature", t.sample_temperature)
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
    check_seed("seed", cfg.seed)
    if cfg.attention.impl is AttentionImpl.fused:
        from model.fused_attention import HEAD_DIMS  # Triton is optional: only when asked for
        if cfg.model.n_embd % cfg.model.n_head or cfg.model.head_dim not in HEAD_DIMS:
            raise ValueError(f"attention.impl=fused supports head sizes {HEAD_DIMS}; model.n_embd "
                             f"/ model.n_head = {cfg.model.n_embd} / {cfg.model.n_head} gives "
                             f"{cfg.model.n_embd / cfg.model.n_head:g} (or use attention.impl=auto)")
    if not (o.eps > 0 and math.isfinite(o.eps)):
        raise ValueError(f"optim.eps must be a positive number, got {o.eps}")
    for name in ("max_steps", "grad_accum", "eval_interval", "eval_batches", "log_interval",
                 "sample_tokens", "keep_checkpoints", "overfit_patience"):
        _at_most(f"train.{name}", getattr(t, name), MAX_COUNT)
    _at_most("optim.warmup_steps", o.warmup_steps, MAX_COUNT)
    _at_most("optim.muon_ns_steps", o.muon_ns_steps, 1000)
    if t.threads is not None:
        _at_most("train.threads", t.threads, MAX_WORKERS)
    if cfg.data.num_proc is not None:
        _at_most("data.num_proc", cfg.data.num_proc, MAX_WORKERS)
    if cfg.data.max_documents is not None:
        _positive("data.max_documents", cfg.data.max_documents)
    _positive("tokenizer.min_frequency", cfg.tokenizer.min_frequency, allow_zero=True)
    _at_most("tokenizer.min_frequency", cfg.tokenizer.min_frequency, 2**32 - 1)
    _positive("tokenizer.vocab_size", cfg.tokenizer.vocab_size)
    _at_most("tokenizer.vocab_size", cfg.tokenizer.vocab_size, 2**32)  # ids are stored as uint32
    if cfg.tokenizer.kind is TokenizerKind.file and not cfg.tokenizer.path:
        raise ValueError("tokenizer.kind=file needs tokenizer.path (a tokenizer.json)")
    if cfg.tokenizer.kind is TokenizerKind.bpe and cfg.tokenizer.vocab_size < 257:
        raise ValueError("tokenizer.vocab_size must be at least 257 for byte-level BPE "
                         f"(256 bytes + 1 special token), got {cfg.tokenizer.vocab_size}")
