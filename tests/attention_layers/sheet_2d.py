"""The cheat sheet's own shapes: a scaled dot-product function on 2-D tensors, Q [n, d_k],
K [m, d_k], V [m, d_v], written with K.T as the sheet writes it (so it takes no batch or head
dimensions), and the mask given as an additive [n, m] matrix of 0 and -inf. Two wrong twins.

Test material for tests/test_check_modern.py and test_check_attention_causes.py; not part of
the package.
"""
import math

import torch


def attention(Q, K, V, M):
    return torch.softmax(Q @ K.T / math.sqrt(K.shape[1]) + M, dim=1) @ V


def attention_no_scale(Q, K, V, M):
    return torch.softmax(Q @ K.T + M, dim=1) @ V


def attention_kq(Q, K, V, M):
    """K Q^T where Q K^T belongs: row i holds key i against every query."""
    return torch.softmax(K @ Q.T / math.sqrt(K.shape[1]) + M, dim=1) @ V
