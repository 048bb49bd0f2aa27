"""The optimizers (AdamW, or Muon + AdamW) and the learning-rate schedule."""
from __future__ import annotations

import math

import torch

from training.config import OptimConfig, OptimizerName, Schedule
from training.muon import Muon


class Optimizers:
    """Several optimizers over disjoint parameters, stepped as one.

    Exposes what the training loop and checkpoints use: `param_groups` (the schedule sets every
    group's lr), `step`, `zero_grad`, `state_dict` and `load_state_dict`.
    """

    def __init__(self, *optimizers: torch.optim.Optimizer):
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict]:
        return [group for opt in self.optimizers for group in opt.param_groups]

    def set_lr(self, lr: float) -> None:
        """The schedule's lr for every group (times the group's own lr_scale, Muon's)."""
        for group in self.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"optimizers": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state: dict) -> None:
        if len(state.get("optimizers", ())) != len(self.optimizers):
            raise ValueError("the checkpoint's optimizer state does not match optim.name")
        for opt, saved in zip(self.optimizers, state["optimizers"]):
            opt.load_state_dict(saved)


def make_optimizer(model: torch.nn.Module, cfg: OptimConfig,
                   dtype: torch.dtype = torch.float32) -> Optimizers:
    """Weight decay on matrices and embeddings (dim >= 2) only: decaying biases and LayerNorm
    gains pulls them towards 0, which is not a useful prior for them.

    With optim.name=muon, the weight matrices inside the transformer blocks (W_QKV, W_O and the
    MLP's) get Muon: its update is the momentum orthogonalised by a few Newton-Schulz steps, so
    every direction of the matrix moves at the same rate. Embeddings (tied with the head),
    positions, biases and LayerNorm stay with AdamW, as Muon is meant for hidden matrices only.
    `dtype` is the run's: under bf16 Muon orthogonalises in bf16 too (training/muon.py).
    """
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]  # tied: once
    hidden = [p for n, p in named if cfg.name is OptimizerName.muon
              and p.dim() == 2 and n.startswith("blocks.")]
    chosen = {id(p) for p in hidden}
    rest = [p for _, p in named if id(p) not in chosen]
    groups = [{"params": [p for p in rest if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}]
    # On CUDA and MPS, the fused kernel updates every parameter in a few launches instead of
    # several per tensor (MPS has no foreach kernels, so its default is one tensor at a time).
    # Elsewhere (a CPU) the foreach implementation, which PyTorch's default keeps for CUDA: each
    # update one call over all the tensors instead of a Python loop, the same numbers to the bit
    # (tests/test_optim.py); the CPU's fused kernel rounds differently.
    fused = named[0][1].device.type in ("cuda", "mps")
    adamw = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                              fused=True if fused else None, foreach=None if fused else True)
    if not hidden:
        return Optimizers(adamw)
    hidden_group = {"params": hidden, "lr_scale": cfg.muon_lr_scale}
    muon = Muon([hidden_group], lr=cfg.lr * cfg.muon_lr_scale, weight_decay=cfg.weight_decay,
                momentum=cfg.muon_momentum, ns_steps=cfg.muon_ns_steps,
                adjust_lr_fn="match_rms_adamw",
                ns_dtype=torch.bfloat16 if dtype == torch.bfloat16 else None)
    return Optimizers(muon, adamw)


def lr_at(step: int, cfg: OptimConfig, max_steps: int) -> float:
    """Linear warmup over warmup_steps, then lr decays to min_lr at max_steps: along a cosine
    (`cosine`), or held and then along a straight line over the last decay_fraction of the steps
    (`linear`), or not at all (`constant`).

    A pure function of the step, so a resumed run needs no scheduler state.
    """
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule is Schedule.constant or max_steps <= cfg.warmup_steps:
        return cfg.lr
    progress = min(1.0, (step - cfg.warmup_steps) / (max_steps - cfg.warmup_steps))  # 0 .. 1
    if cfg.schedule is Schedule.linear:
        left = (1.0 - progress) / cfg.decay_fraction  # 1 where the decay starts, 0 at the end
        return cfg.min_lr + min(1.0, left) * (cfg.lr - cfg.min_lr)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)
