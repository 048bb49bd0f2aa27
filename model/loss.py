"""The LM head and its loss: logits = x W^T, loss = the mean cross-entropy of the targets.

    loss = mean_i [ logsumexp_j(z_ij) - z_i,y_i ],          z = x W^T    [tokens, vocab]
    d loss / d z = (softmax(z) - onehot(y)) / tokens

`cross_entropy` computes exactly that: `F.cross_entropy(F.linear(x, W))`. On a CPU the model
uses `row_block_cross_entropy` instead (GPT chooses once, built or moved, with `choose_loss`),
for speed only: the plain version writes and reads the [tokens, vocab] logits several times
over, each pass far larger than the CPU's caches. Since the loss is the network's last step, the
gradient of the logits is known in the forward up to the one number backward brings, so each
block of rows makes its gradients of x and W while its logits are still in the cache, and
backward only scales them. It agrees with the plain version to rounding (tests/test_loss.py);
docs/budget.md, round 3, has what it saves.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

# Rows per block: about a million float32 logits (4 MiB), so that a block's logits, their
# exponentials and their gradient stay in the cache while they are used.
BLOCK_ELEMENTS = 2**20


def cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, T, C], weight [V, C] (the LM head), targets [B, T] -> (logits [B, T, V], loss)."""
    logits = F.linear(x, weight)  # [B, T, V]
    return logits, F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


def row_block_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                            block_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`cross_entropy`'s results, block_rows rows at a time (RowBlockCrossEntropy).

    The logits are those of the forward pass, for reading only (no gradient flows back through
    them; the loss's does). Under autocast the matmuls run in its dtype, as nn.Linear's would,
    and the softmax in float32."""
    B, T, C = x.shape
    if torch.is_autocast_enabled(x.device.type):  # what autocast would give F.linear
        dtype = torch.get_autocast_dtype(x.device.type)
        x, weight = x.to(dtype), weight.to(dtype)
    loss, logits = RowBlockCrossEntropy.apply(x.reshape(B * T, C), weight, targets.reshape(-1),
                                              block_rows)
    return logits.view(B, T, -1), loss


def choose_loss(device: torch.device, vocab_size: int):
    """The loss function for `device`: row blocks on a CPU (by vocabulary size), plain elsewhere."""
    if torch.device(device).type != "cpu":
        return cross_entropy
    return functools.partial(row_block_cross_entropy,
                             block_rows=max(1, BLOCK_ELEMENTS // vocab_size))


class RowBlockCrossEntropy(torch.autograd.Function):
    """The mean cross-entropy of x W^T, block of rows by block of rows, with the gradients of x
    and W made in the forward pass (see the module docstring). x [N, C], weight [V, C],
    targets [N] -> (loss [], logits [N, V])."""

    @staticmethod
    def forward(ctx, x, weight, targets, block_rows: int):
        N, V = x.size(0), weight.size(0)
        with_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        logits = torch.empty(N, V, dtype=x.dtype, device=x.device)
        nll = torch.empty(N, dtype=torch.float32, device=x.device)  # per row: lse - z_target
        if with_grad:
            grad_x = torch.empty(x.shape, dtype=torch.float32, device=x.device)
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=x.device)
        with torch.autocast(x.device.type, enabled=False):  # dtypes as given (see row_block_cross_entropy)
            for r0 in range(0, N, block_rows):
                rows = slice(r0, r0 + block_rows)
                x_b, y_b = x[rows], targets[rows, None]                  # [R, C], [R, 1]
                z = torch.mm(x_b, weight.t(), out=logits[rows]).float()  # [R, V]
                z_max = z.amax(dim=1, keepdim=True)                      # [R, 1]
                e = (z - z_max).exp_()                                   # [R, V], at most 1
                total = e.sum(dim=1, keepdim=True)                       # [R, 1]
                nll[rows] = (z_max + total.log() - z.gather(1, y_b)).squeeze(1)  # lse - z_y
                if with_grad:
                    dz = e.div_(total)                                   # softmax, [R, V]
                    dz.scatter_add_(1, y_b, torch.full_like(total, -1.0))  # - onehot(y)
                    dz = dz.to(x.dtype)
                    grad_x[rows] = dz @ weight                           # [R, C]
                    grad_w += (dz.t() @ x_b).float()                     # [V, C]
        if with_grad:  # the 1 / N of the mean, then backward's own factor
            ctx.save_for_backward(grad_x.div_(N), grad_w.div_(N))
        ctx.dtypes = x.dtype, weight.dtype
        ctx.mark_non_differentiable(logits)
        ctx.set_materialize_grads(False)  # no [N, V] zeros made for the logits' (unused) gradient
        return nll.mean(), logits

    @staticmethod
    def backward(ctx, grad_loss, _grad_logits):
        grad_x, grad_w = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        return (grad_x * grad_loss).to(x_dtype), (grad_w * grad_loss).to(w_dtype), None, None
