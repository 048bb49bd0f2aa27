"""Rotary position embedding (RoPE): positions as rotations of q and k.

Each head's d_k dimensions are taken as d_k / 2 pairs, and pair j of the vector at position t
is turned by the angle t * theta_j, theta_j = rope_theta^(-2j / d_k): fast turns for the first
pairs, slow ones for the last. The dot product of q at position s and k at position t then
depends on (s - t) * theta_j alone: a score sees how far apart they are, never where. Nothing is
added to the residual stream, so there is no position table to learn.

The layout is Llama's ("rotate half"): pair j is dimensions (j, j + d_k / 2), not (2j, 2j + 1),
so that weights trained with transformers' Llama rotate the same way. In complex numbers, with
z_j = x_j + i x_{j + d_k/2}, the rotation is z_j * exp(i t theta_j) (tests/test_rotary.py checks
it against that formula).
"""
from __future__ import annotations

import torch


def rotary_angles(positions: torch.Tensor, head_dim: int, theta: float) -> torch.Tensor:
    """[..., T] integer positions -> [..., T, head_dim / 2] angles t * theta_j, in float64.

    Computed from the positions each forward pass (a few thousand numbers), so the positions
    can live on the device (a KV cache's position counter, read inside a captured CUDA graph),
    and in float64 whatever the model's dtype, so that far positions keep their precision.
    """
    j = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float64)  # [d/2]: 2j
    inv_freq = theta ** (-j / head_dim)  # theta_j
    return positions.to(torch.float64)[..., None] * inv_freq  # [..., T, d/2]


def rotary_tables(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each [..., T, head_dim], of the angles of `positions` [..., T], repeated for
    both halves (the rotate-half layout), in `dtype`. Made once per forward pass and shared by
    every layer."""
    angles = rotary_angles(positions, head_dim, theta)
    angles = torch.cat([angles, angles], dim=-1)  # [..., T, d]: pair j is dims j and j + d/2
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last dimension: x turned by 90 degrees in
    each pair's plane."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, d] turned pair by pair: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin).
    cos, sin [T, d] (or one table per sequence, [B, 1, T, d]) broadcast over the batch and
    head dimensions (and are cast to x's dtype: under bf16 autocast the rotation is done in
    bf16, as transformers does)."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + rotate_half(x) * sin


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Pitfall (attention.rotary_interleaved): the rotation with pair j laid out as dimensions
    (2j, 2j + 1), as GPT-J and Meta's original Llama code do, where the weights expect rotate-half
    (j, j + d_k / 2). A rotation all the same (relative positions hold, and a model trained with
    it learns as well), but weights trained with the other layout are rotated wrongly.
    x [..., T, d]; cos, sin the rotate-half tables [T, d] of `rotary_tables`."""
    half = x.size(-1) // 2
    cos, sin = (t[..., :half].repeat_interleave(2, dim=-1).to(x.dtype) for t in (cos, sin))
    even, odd = x[..., 0::2], x[..., 1::2]  # [..., T, d/2]: the two members of each pair
    turned = torch.stack([-odd, even], dim=-1).flatten(-2)  # (x0, x1) -> (-x1, x0) in each pair
    return x * cos + turned * sin
