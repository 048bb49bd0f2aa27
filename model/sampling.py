"""Turning next-token logits into a sampled token: temperature, top-k, top-p (nucleus)."""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch


def filter_logits(logits: torch.Tensor, top_k: Optional[int] = None,
                  top_p: Optional[float] = None) -> torch.Tensor:
    """Set to -inf every logit outside the top-k and outside the top-p probability mass.

    logits [B, V] -> [B, V]. top_p keeps the smallest set of tokens whose probabilities sum to at
    least top_p (the most likely token always survives).
    """
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # [B, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # probability of the tokens ranked above
        drop_sorted = mass_before >= top_p
        drop_sorted[..., 0] = False  # the most likely token, whatever top_p's float32 value
        drop = drop_sorted.scatter(-1, order, drop_sorted)  # back to vocabulary order
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: Optional[int] = None,
                top_p: Optional[float] = None,
                generator: Union[torch.Generator, Sequence[torch.Generator], None] = None,
                greedy: bool = False) -> torch.Tensor:
    """logits [B, V] of the last position -> next token ids [B, 1]. generator: one for the
    batch, or one per row, each row then drawing from its own as it would alone."""
    if greedy:
        return logits.argmax(dim=-1, keepdim=True)
    if isinstance(generator, (list, tuple)):
        return torch.cat([sample_next(row, temperature, top_k, top_p, g)
                          for row, g in zip(logits.split(1), generator)])
    logits = filter_logits(logits.float() / temperature, top_k, top_p)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator)


def seeded_generator(seed: int, device: torch.device) -> torch.Generator:
    """A generator of its own on the device that samples (a CUDA sample needs a CUDA generator),
    so that sampling leaves the global random state alone."""
    return torch.Generator(device=device).manual_seed(seed)
