"""Lesson 01's exercise, solved: the cheat sheet's attention (docs/cheat_sheet.md).

    python -m check_attention lessons/solutions/01_equation.py:attention
"""
import math

import torch


def attention(Q, K, V, mask=None):
    """softmax(Q K^T / sqrt(d_k) + M) V, returning (output, weights).

    Q [..., n, d_k], K [..., m, d_k], V [..., m, d_v] -> output [..., n, d_v], weights
    [..., n, m]. mask: None, or M [n, m], 0 where a query may look and -inf where it may not.
    """
    d_k = Q.size(-1)
    scores = Q @ K.transpose(-2, -1) / math.sqrt(d_k)  # 1. score, 2. scale: [..., n, m]
    if mask is not None:
        scores = scores + mask  # 3. mask, before softmax (lesson 03)
    weights = torch.softmax(scores, dim=-1)  # 4. softmax over the keys: each row sums to 1
    return weights @ V, weights  # 5. blend: [..., n, d_v]
