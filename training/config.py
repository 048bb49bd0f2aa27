"""The whole run's typed configuration, and its registration with Hydra's ConfigStore.

`conf/config.yaml` starts its defaults list with `schema`, so every YAML file and every command
line override is merged into these dataclasses: an unknown key or a value of the wrong type is
rejected by Hydra before training starts. guard/limits.py then checks the values themselves.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Optional

from hydra.core.config_store import ConfigStore

from data.config import DataConfig, TokenizerConfig
from model.config import AttentionConfig, ModelConfig


class Schedule(str, Enum):
    cosine = "cosine"      # linear warmup, then cosine decay to min_lr at max_steps
    constant = "constant"  # linear warmup, then lr
    # linear warmup, lr held, then a straight line to min_lr over the last decay_fraction of the
    # steps after warmup (1.0: from the end of warmup; "warmup-stable-decay" below 1)
    linear = "linear"


class OptimizerName(str, Enum):
    adamw = "adamw"  # AdamW for every parameter
    muon = "muon"    # Muon for the blocks' weight matrices, AdamW for embeddings, norms, biases


class NonFinite(str, Enum):
    stop = "stop"
    skip = "skip"


class CachedEval(str, Enum):
    """How the final evaluation feeds its batches [B, T] through the KV cache, teacher forced
    (training/evaluate.py, decoded_losses; the third study, docs/ablations.md)."""

    tokens = "tokens"  # one token at a time: decoding
    # a server's second batch: each row's second half decoded first, then through the same
    # decoder its first half, left-padded by b % (T / 4) tokens (prompts of different lengths),
    # one token at a time; scored on the real tokens
    served = "served"
    chunks = "chunks"  # a prefill in chunks of model.window tokens (8 without a window)


class Headline(str, Enum):
    """The loss a study is read by: TensorBoard's HParams table shows it first (training/tb.py)."""

    causal_loss = "causal_loss"  # val/causal_loss: what training and the usual validation see
    cached_loss = "cached_loss"  # val/cached_loss: what decoding through the KV cache sees


@dataclass
class OptimConfig:
    """AdamW (or Muon + AdamW) with decoupled weight decay on matrices only (not on biases,
    LayerNorm). One schedule drives both optimizers: Muon's step is rescaled to AdamW's RMS, so
    the same lr suits both."""

    name: OptimizerName = OptimizerName.muon
    lr: float = 4e-3           # the peak learning rate, after warmup
    min_lr: float = 0.0        # the learning rate at the last step
    warmup_steps: int = 100    # steps of linear warmup from 0 to lr
    # the schedule and the weight decay of round 3 of docs/budget.md (rounds 1 and 2: cosine to
    # min_lr 2e-4, weight decay 0.1)
    schedule: Schedule = Schedule.linear
    decay_fraction: float = 1.0  # schedule=linear: the share of the steps after warmup that decay
    weight_decay: float = 0.6  # decoupled, on weight matrices only
    beta1: float = 0.9         # AdamW's momentum
    beta2: float = 0.99        # AdamW's decay of the squared gradients
    eps: float = 1e-8          # AdamW's epsilon
    grad_clip: float = 1.0  # max global gradient norm; 0 turns clipping off
    muon_momentum: float = 0.95  # Muon's (Nesterov) momentum; only with name=muon
    muon_lr_scale: float = 1.0   # Muon's lr = this x the schedule's lr (AdamW's)
    muon_ns_steps: int = 5       # Newton-Schulz iterations orthogonalising each update


@dataclass
class TrainConfig:
    # Steps to train, the same on every machine. 2,500: more are better (docs/budget.md: 2,800 by
    # 0.006 nats/char in round 3, 3,400 by 0.0056 more in round 7), but on the slowest 2-core CPU
    # measured 2,800 took the README's first command to 11.9 of its 12 minutes (docs/results.md).
    max_steps: int = 2500
    # Optional: train fewer steps where max_steps would take longer than this many minutes. The
    # count is fixed from the speed of the first 50 steps, shortened at an evaluation where the
    # steps have slowed, and written in config.yaml (training/budget.py). null: always max_steps.
    budget_minutes: Optional[float] = None
    batch_size: int = 16            # sequences per micro-batch, per process
    # Micro-batches per optimizer step: the step's batch is batch_size x grad_accum x processes.
    grad_accum: int = 1
    # Stop early once this much training time has passed (null: run all max_steps).
    max_minutes: Optional[float] = None
    eval_interval: int = 500        # steps between evaluations (and checkpoints)
    eval_batches: int = 20          # fixed random validation batches for periodic evaluation
    final_full_eval: bool = True    # at the end, score every token of the validation split
    # At the end, the loss of the first this-many evaluation batches (all, if there are fewer)
    # computed through the generation path too (a KV cache fed one token at a time, teacher
    # forced; 0 = off), next to the causal loss of the same batches: equal to rounding for a
    # correct layer, a cache pitfall's cost otherwise (val/cached_loss, val/cache_gap;
    # docs/ablations.md). About 5 times the cost of scoring the same batches uncached.
    cached_eval_batches: int = 4
    cached_eval: CachedEval = CachedEval.tokens  # how they go through the cache (CachedEval)
    log_interval: int = 25          # steps between training-loss points (their mean)
    sample_tokens: int = 300        # text sample logged at each evaluation (0 = none)
    sample_prompt: str = "\n"       # the prompt of the logged samples
    sample_temperature: float = 0.8  # and their temperature
    # false: the sample at the last evaluation only. The pitfall studies read losses, not text,
    # and a sample costs about as much as the evaluation's losses (docs/ablations.md).
    sample_every_eval: bool = True
    # At each evaluation, every layer's attention maps on a fixed validation window of this many
    # tokens (capped at model.block_size) go to TensorBoard's Images tab (docs/tensorboard.md);
    # 32 is what its 350-pixel cards show at a legible 9 pixels per token.
    attention_maps: bool = True
    attention_map_tokens: int = 32  # the maps' window, in tokens
    keep_checkpoints: int = 2       # most recent checkpoints kept (the best one is kept too)
    device: str = "auto"            # auto (cuda, else mps, else cpu) | cpu | mps | cuda | cuda:N
    # auto | float32 | bfloat16 (autocast). auto: bf16 on CUDA, fp32 on mps, and on a CPU the
    # faster of the two as measured on this machine (docs/dtype.md); config.yaml records which.
    dtype: str = "auto"
    # torch.compile the model; null = auto: on for CUDA, off for CPU, where it does not pay for its
    # compilation time (docs/benchmarks.md).
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
    # Written by train.py, not set by hand: why the run trained fewer steps than the
    # train.max_steps it was started with (budget_minutes, max_minutes or early_stop), as its
    # summary says too. null: it trains them all.
    fewer_steps: Optional[str] = None
    # The loss TensorBoard's HParams table shows first: a study's headline (conf/experiment/).
    headline: Headline = Headline.causal_loss


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    data: DataConfig = field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    seed: int = 1337  # the initial weights, the batches and the samples
    # A run directory to continue from its latest checkpoint.
    resume: Optional[str] = None
    # A GPT-2, Llama or Qwen3 folder (config.json, model.safetensors, tokenizer.json; e.g. from
    # scripts/export_hf.py) to start from: its weights, model shape and tokenizer are used.
    init_from: Optional[str] = None
    # Name shown for this run in TensorBoard's run list and HParams table (and a multirun's
    # sub-directory name).
    run_name: str = "${attention.name}_seed${seed}"
    # FILE.py:NAME, a learner's attention class in every block in place of ours (+arm=leak-yours;
    # docs/your_layer.md). The run keeps a copy of FILE: its config.yaml names layer/FILE.py.
    your_layer: Optional[str] = None
    # Written by train.py, not set by hand: the sha256 of the run's copy of its layer's file.
    your_layer_sha256: Optional[str] = None
    # resume= imports the run's copy of its layer (code) only with this on its command line; a
    # run's config.yaml never grants it.
    trust_layer: bool = False


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
DTYPE_CHOICES = ("auto", "float32", "bfloat16")
CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


def register_configs() -> None:
    ConfigStore.instance().store(name="schema", node=Config)
