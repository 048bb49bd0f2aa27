"""Rotary positions (model/rotary.py) against the complex-number formula, and the property they
exist for: a rotated q.k score depends on the distance between the positions alone."""
from __future__ import annotations

import math

import pytest
import torch

from model.rotary import apply_rotary, rotary_angles, rotary_tables

D = torch.float64


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    cos, sin = rotary_tables(positions, x.size(-1), theta, x.dtype)
    return apply_rotary(x, cos, sin)


def complex_oracle(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE as written in the papers, in complex float64: the pairs (x_j, x_{j + d/2}) (Llama's
    rotate-half layout) as z_j = x_j + i x_{j + d/2}, each multiplied by exp(i t theta^(-2j/d))."""
    d = x.size(-1)
    half = d // 2
    z = torch.complex(x[..., :half], x[..., half:])  # [..., T, d/2]
    j = torch.arange(half, dtype=D)
    angle = positions.to(D)[:, None] * theta ** (-2 * j / d)[None, :]  # [T, d/2]
    turned = z * torch.polar(torch.ones_like(angle), angle)
    return torch.cat([turned.real, turned.imag], dim=-1)


@pytest.mark.parametrize("d,theta", [(2, 10000.0), (8, 10000.0), (32, 500000.0), (64, 10.0)])
def test_rotation_matches_the_complex_formula(d, theta):
    x = torch.randn(2, 3, 7, d, dtype=D)
    positions = torch.tensor([0, 1, 2, 5, 77, 1000, 4095])
    torch.testing.assert_close(rotate(x, positions, theta), complex_oracle(x, positions, theta),
                               atol=1e-12, rtol=0)


def test_the_layout_is_rotate_half_not_interleaved():
    """Dimension 0 turns into dimension d/2 (Llama's layout), not into dimension 1."""
    d = 8
    x = torch.zeros(1, 1, 1, d, dtype=D)
    x[..., 0] = 1.0
    out = rotate(x, torch.tensor([1]))[0, 0, 0]  # pair 0 turns by 1 radian at position 1
    assert out[0].item() == pytest.approx(math.cos(1.0)) and out[d // 2].item() == pytest.approx(math.sin(1.0))
    assert out[1].item() == 0.0 and out[torch.arange(d) % (d // 2) != 0].abs().max().item() == 0.0


def test_position_zero_is_the_identity_and_lengths_are_kept():
    x = torch.randn(2, 4, 5, 16, dtype=D)
    torch.testing.assert_close(rotate(x, torch.zeros(5, dtype=torch.long)), x, atol=0, rtol=0)
    turned = rotate(x, torch.arange(5) * 13)
    torch.testing.assert_close(turned.norm(dim=-1), x.norm(dim=-1), atol=1e-12, rtol=0)


def test_a_score_depends_only_on_the_distance_between_positions():
    """q at position s and k at position t: q_s . k_t is a function of s - t alone."""
    d = 16
    q, k = torch.randn(d, dtype=D), torch.randn(d, dtype=D)

    def score(s: int, t: int) -> float:
        qs = rotate(q.view(1, 1, 1, d), torch.tensor([s]))
        kt = rotate(k.view(1, 1, 1, d), torch.tensor([t]))
        return (qs * kt).sum().item()

    for distance in (0, 1, 5, 40):
        scores = [score(t + distance, t) for t in (0, 3, 100, 1234)]
        assert max(scores) - min(scores) < 1e-10, (distance, scores)
    # and it does depend on the distance (else the rotation would carry no position at all)
    assert abs(score(5, 0) - score(6, 0)) > 1e-3 and abs(score(5, 0) - score(0, 5)) > 1e-3


def test_angles_are_float64_whatever_the_positions_dtype():
    angles = rotary_angles(torch.arange(3, dtype=torch.int32), 4, 10000.0)
    assert angles.dtype == D and angles.shape == (3, 2)
    assert angles[2].tolist() == pytest.approx([2.0, 2.0 / 100.0])  # theta^(-2j/d): 1, 1/100
    cos, sin = rotary_tables(torch.arange(3), 4, 10000.0, torch.bfloat16)
    assert cos.dtype == sin.dtype == torch.bfloat16 and cos.shape == (3, 4)
