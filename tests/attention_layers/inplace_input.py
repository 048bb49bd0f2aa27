"""Writes into the caller's tensors: a function that scales q in place to save memory (its
output is right; the caller's q is not), and a layer that adds its residual into x in place.

Test material for tests/test_check_probes.py; not part of the package.
"""
import math

import torch

from separate import MultiHeadSelfAttention


def scales_q_in_place(q, k, v, mask):
    """mask: True = may attend."""
    q *= 1 / math.sqrt(q.size(-1))  # the caller's q is now scaled too
    return torch.softmax((q @ k.transpose(-2, -1)).masked_fill(~mask, float("-inf")), -1) @ v


class ResidualInPlace(MultiHeadSelfAttention):
    def forward(self, x):
        return x.add_(super().forward(x))  # x + attention(x), written into x
