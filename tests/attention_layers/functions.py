"""Scaled dot-product functions f(q, k, v, mask), in each mask convention, right and wrong.

Test material for tests/test_check_attention.py; not part of the package.
"""
import math

import torch


def keep_mask(q, k, v, mask):
    """mask: True (or 1) where a query may attend, the Annotated Transformer's convention."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    scores = scores.masked_fill(mask == 0, float("-inf"))
    weights = scores.softmax(dim=-1)
    return weights @ v, weights


def drop_mask(q, k, v, mask):
    """mask: True where a key is hidden, as torch's key_padding / triu masks are built."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    return torch.softmax(scores.masked_fill(mask, -1e9), dim=-1) @ v


def additive_mask(q, k, v, mask):
    """mask: 0 where visible, -inf where hidden, added to the scores."""
    scores = q @ k.transpose(-2, -1) / q.size(-1) ** 0.5 + mask
    return torch.softmax(scores, dim=-1) @ v


def no_scale(q, k, v, mask):
    scores = (q @ k.transpose(-2, -1)).masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def fill_zero(q, k, v, mask):
    scores = (q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))).masked_fill(~mask, 0.0)
    return torch.softmax(scores, dim=-1) @ v


def after_softmax(q, k, v, mask):
    weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)), dim=-1)
    return (weights * mask) @ v


def transposed_output(q, k, v, mask):
    """Right maths, but returns [..., d_v, n]."""
    return keep_mask(q, k, v, mask)[0].transpose(-2, -1)


def sqrt_d_model(q, k, v, mask):
    """Divides by sqrt of the whole width, heads times d_k."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1) * q.size(1))
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v


def builds_its_own_mask(q, k, v):
    """No mask parameter: the causal pattern is made inside."""
    n = q.size(-2)
    future = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
    scores = (q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))).masked_fill(future, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def forgets_the_mask(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)), dim=-1) @ v


def softmax_over_queries(q, k, v, mask):
    """The softmax's axis is the queries' (dim=-2), not the keys'."""
    scores = (q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))).masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-2) @ v
