"""Validation loss, bits per character, and attention diagnostics."""
from __future__ import annotations

import math
import numpy as np
import torch
import torch.nn.functional as F

from data.batches import sequential_windows
from model.attention import causal_pattern
from training.distributed import World, all_sum


@torch.no_grad()
def mean_loss(model, batches: list, amp, world: World = World()) -> float:
    """Mean cross-entropy (nats per token) over a fixed list of (x, y) batches.

    Under DDP each rank scores every world.size-th batch and the sums are added up, so the
    result is the same whatever the number of processes.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for x, y in batches[world.rank::world.size]:
        with amp:
            _, loss = model(x.to(device), y.to(device))
        total += loss.item() * y.numel()
        count += y.numel()
    model.train(was_training)
    total, count = all_sum([total, float(count)], world)
    return total / count


@torch.no_grad()
def full_split_loss(model, tokens: np.ndarray, block_size: int, batch_size: int, amp,
                    world: World = World()) -> float:
    """Nats per token over every token of a split (non-overlapping windows, each token once)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for i, (x, y) in enumerate(sequential_windows(tokens, block_size, batch_size)):
        if i % world.size != world.rank:
            continue
        with amp:
            logits, _ = model(x.to(device))
        nll = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.to(device).reshape(-1),
                              reduction="sum")
        total += nll.item()
        count += y.numel()
    model.train(was_training)
    total, count = all_sum([total, float(count)], world)
    return total / count


def bits_per_char(nats_per_token: float, n_tokens: int, n_chars: int) -> float:
    """Convert a per-token loss to bits per character, comparable across tokenizers."""
    return nats_per_token * n_tokens / n_chars / math.log(2)


@torch.no_grad()
def attention_diagnostics(model, x: torch.Tensor, amp) -> list[dict]:
    """Per layer: mean over rows of the largest attention weight, and the mean row entropy
    normalised by log(number of visible keys) (1 = uniform over the past, 0 = one-hot).

    A saturated softmax shows as max weight near 1 and entropy near 0. Row 0 (one visible key)
    is left out of the entropy.
    """
    was_training = model.training
    model.eval()
    with amp:
        _, _, weights = model(x.to(next(model.parameters()).device), return_weights=True)
    model.train(was_training)
    T = x.size(1)
    visible = causal_pattern(T, T).sum(-1).float()[1:]  # [T-1] keys per row (2..T)
    out = []
    for w in weights:  # [B, h, T, T]
        w = w.float()
        entropy = -(w * torch.log(w.clamp_min(1e-12))).sum(-1)[..., 1:]  # [B, h, T-1]
        out.append({
            "max_weight": w.max(dim=-1).values.mean().item(),
            "entropy": (entropy / torch.log(visible)).mean().item(),
        })
    return out


def qk_grad_norms(model) -> list[dict]:
    """Gradient norm of W_Q and W_K in each layer (call after backward, before zero_grad)."""
    out = []
    for block in model.blocks:
        grad = block.attn.qkv.weight.grad
        if grad is None:
            out.append({"q": 0.0, "k": 0.0})
            continue
        d = grad.size(1)
        out.append({"q": grad[:d].norm().item(), "k": grad[d:2 * d].norm().item()})
    return out
