"""Muon with its Newton-Schulz iterations in float32 (or in bf16 where the run trains in bf16).

Muon (MomentUm Orthogonalized by Newton-Schulz) replaces each weight matrix's update by its
momentum made (nearly) orthogonal: U S V^T -> ~U V^T. Every direction of the matrix then moves at
a similar rate, instead of the few directions with large gradients dominating, which lets the
hidden layers learn faster per step than with AdamW.

Why not `torch.optim.Muon` as it is: it runs the Newton-Schulz iterations in bfloat16, which is
fast where bf16 matmuls are (GPUs, CPUs with AVX512-BF16 or AMX) and several times slower than
float32 where they are not (CPUs with AVX2 only: docs/benchmarks.md). And it orthogonalises one
matrix at a time, which on a GPU is a few dozen tiny kernel launches per matrix. This subclass
keeps torch's constructor, argument checks, defaults and state layout (one `momentum_buffer` per
matrix, so checkpoints look the same), orthogonalises in float32 unless the run trains in bf16
(then in bf16, as torch does: the iteration is made to tolerate it, and there bf16 is the fast
dtype), and does all the matrices of one shape in a single batch of matmuls. The tests check it against `torch.optim.Muon` step for
step.
"""
from __future__ import annotations

import torch


def orthogonalize(update: torch.Tensor, coefficients: tuple[float, float, float], steps: int,
                 eps: float, dtype: torch.dtype | None = None) -> torch.Tensor:
    """~U V^T of update = U S V^T by a quintic Newton-Schulz iteration, in `dtype` (None: at
    least float32).

    update is one matrix [rows, cols] or a batch of same-shaped ones [n, rows, cols], all
    orthogonalised together (one batched matmul per iteration instead of n). The iteration maps
    each singular value s -> a s + b s^3 + c s^5, which, starting from s <= 1 (hence the division
    by the Frobenius norm), pushes all of them towards ~1.
    """
    x = update.to(dtype or torch.promote_types(update.dtype, torch.float32))
    single = x.dim() == 2
    if single:
        x = x[None]  # [1, rows, cols]
    tall = x.size(1) > x.size(2)
    if tall:
        x = x.mT  # iterate on the wide side: the Gram matrix x x^T is the smaller one
    x = x / x.norm(dim=(1, 2), keepdim=True).clamp(min=eps)
    a, b, c = coefficients
    for _ in range(steps):
        gram = x @ x.mT                                          # [n, r, r], r = min(rows, cols)
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)  # b G + c G^2
        x = torch.baddbmm(x, poly, x, beta=a)                    # a x + (b G + c G^2) x
    if tall:
        x = x.mT
    return x[0] if single else x


class Muon(torch.optim.Muon):
    """`torch.optim.Muon`'s update rule, orthogonalising in batches of same-shaped matrices and
    in float32, or in `ns_dtype` when given: train.py passes bfloat16 when the run trains in
    bf16, i.e. where bf16 matmuls are fast (see the module docstring)."""

    def __init__(self, params, *args, ns_dtype: torch.dtype | None = None, **kwargs):
        super().__init__(params, *args, **kwargs)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, momentum = group["lr"], group["momentum"]
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            for p in params:
                if "momentum_buffer" not in self.state[p]:
                    self.state[p]["momentum_buffer"] = torch.zeros_like(p.grad)
            grads = [p.grad for p in params]
            bufs = [self.state[p]["momentum_buffer"] for p in params]
            torch._foreach_lerp_(bufs, grads, 1 - momentum)  # B = mu B + (1 - mu) g
            updates = ([g.lerp(b, momentum) for g, b in zip(grads, bufs)] if group["nesterov"]
                       else bufs)
            torch._foreach_mul_(params, 1 - lr * group["weight_decay"])  # decoupled weight decay
            by_shape: dict[torch.Size, list[int]] = {}
            for i, p in enumerate(params):
                by_shape.setdefault(p.shape, []).append(i)
            for shape, members in by_shape.items():
                ortho = orthogonalize(torch.stack([updates[i] for i in members]),
                                      group["ns_coefficients"], group["ns_steps"], group["eps"],
                                      self.ns_dtype)
                torch._foreach_add_([params[i] for i in members],
                                    list(ortho.to(params[members[0]].dtype).unbind(0)),
                                    alpha=-self._scaled_lr(lr, group, shape))
        return loss

    @staticmethod
    def _scaled_lr(lr: float, group: dict, shape: torch.Size) -> float:
        """The step size for a matrix of this shape, as torch.optim.Muon's adjust_lr_fn sets it:
        "match_rms_adamw" gives the update AdamW's typical RMS, so AdamW's lr carries over."""
        rows, cols = shape[:2]
        if group["adjust_lr_fn"] == "match_rms_adamw":
            return lr * 0.2 * max(rows, cols) ** 0.5
        return lr * max(1.0, rows / cols) ** 0.5  # "original" (Keller Jordan's scaling)
