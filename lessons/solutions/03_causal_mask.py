"""Lesson 03's exercise, solved: attention that masks the future itself.

    python -m check_attention lessons/solutions/03_causal_mask.py:causal_attention
"""
import math

import torch


def causal_attention(Q, K, V):
    """softmax(Q K^T / sqrt(d_k) + M) V with the causal M built here, returning (output, weights).

    Q [..., n, d_k], K [..., m, d_k], V [..., m, d_v]. The n queries are the last n of the m
    positions (n == m in training; fewer with a KV cache), so query i sits at position
    m - n + i and may see keys 0 .. m - n + i.
    """
    n, m = Q.size(-2), K.size(-2)
    scores = Q @ K.transpose(-2, -1) / math.sqrt(Q.size(-1))  # [..., n, m]
    visible = torch.ones(n, m, dtype=torch.bool, device=Q.device).tril(diagonal=m - n)
    M = torch.zeros(n, m, dtype=scores.dtype, device=Q.device).masked_fill(~visible, -math.inf)
    weights = torch.softmax(scores + M, dim=-1)  # M added before softmax: rows renormalise
    return weights @ V, weights
