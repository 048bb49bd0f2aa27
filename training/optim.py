"""AdamW parameter groups and the learning-rate schedule."""
from __future__ import annotations

import math

import torch

from training.config import OptimConfig, Schedule


def make_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """Weight decay on matrices and embeddings (dim >= 2) only: decaying biases and LayerNorm
    gains pulls them towards 0, which is not a useful prior for them."""
    params = [p for p in model.parameters() if p.requires_grad]  # tied weights appear once
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)


def lr_at(step: int, cfg: OptimConfig, max_steps: int) -> float:
    """Linear warmup over warmup_steps, then cosine decay from lr to min_lr at max_steps.

    A pure function of the step, so a resumed run needs no scheduler state.
    """
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule is Schedule.constant or max_steps <= cfg.warmup_steps:
        return cfg.lr
    progress = min(1.0, (step - cfg.warmup_steps) / (max_steps - cfg.warmup_steps))
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)
