"""A CS336 / Llama style layer: separate q, k, v and output projections without biases, built as
MultiHeadSelfAttention(d_model, num_heads), the causal mask made in forward. Each subclass makes
one classic mistake.

Test material for tests/test_check_attention.py; not part of the package.
"""
import torch
import torch.nn as nn


class MultiHeadSelfAttention(nn.Module):
    divide_by = "d_k"      # d_k, d_model, none
    mask = "-inf"  # -inf, finfo_min, zero, fill_zero, after_softmax, no_diagonal, one_future
    project = True
    window_of, window_slip = None, 0   # a sliding window of that many keys; 1: one key more

    def __init__(self, d_model: int, num_heads: int):
        super().__init__()
        self.window = self.window_of
        self.d_model, self.num_heads = d_model, num_heads
        self.d_head = d_model // num_heads
        self.q_proj = nn.Linear(d_model, d_model, bias=False)
        self.k_proj = nn.Linear(d_model, d_model, bias=False)
        self.v_proj = nn.Linear(d_model, d_model, bias=False)
        self.output_proj = nn.Linear(d_model, d_model, bias=False)

    def split_heads(self, t):
        b, n, _ = t.shape
        return t.reshape(b, n, self.num_heads, self.d_head).permute(0, 2, 1, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = (self.split_heads(p(x)) for p in (self.q_proj, self.k_proj, self.v_proj))
        scores = torch.einsum("bhid,bhjd->bhij", q, k)
        if self.divide_by == "d_k":
            scores = scores / self.d_head ** 0.5
        elif self.divide_by == "d_model":
            scores = scores / self.d_model ** 0.5
        i = torch.arange(n, device=x.device)
        offset = {"no_diagonal": -1, "one_future": 1}.get(self.mask, 0)
        allowed = i[None, :] <= i[:, None] + offset  # [n, n]
        if self.window is not None:  # a sliding window: the last `window` keys, its own included
            allowed = allowed & (i[None, :] > i[:, None] - self.window - self.window_slip)
        if self.mask == "finfo_min":
            scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        elif self.mask == "zero":
            scores = scores + torch.zeros(n, n, dtype=scores.dtype, device=x.device)
        elif self.mask == "fill_zero":
            scores = torch.where(allowed, scores, torch.zeros_like(scores))
        elif self.mask != "after_softmax":
            additive = torch.zeros(n, n, dtype=scores.dtype, device=x.device)
            scores = scores + additive.masked_fill(~allowed, float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        if self.mask == "after_softmax":
            weights = weights * allowed
        out = torch.einsum("bhij,bhjd->bhid", weights, v)
        out = out.permute(0, 2, 1, 3).reshape(b, n, self.d_model)
        return self.output_proj(out) if self.project else out


class NoScale(MultiHeadSelfAttention):
    divide_by = "none"


class ScaleDModel(MultiHeadSelfAttention):
    divide_by = "d_model"


class NoOutProj(MultiHeadSelfAttention):
    project = False


class MaskZero(MultiHeadSelfAttention):
    mask = "zero"


class MaskFillZero(MultiHeadSelfAttention):
    mask = "fill_zero"


class MaskAfterSoftmax(MultiHeadSelfAttention):
    mask = "after_softmax"


class MaskNoDiagonal(MultiHeadSelfAttention):
    mask = "no_diagonal"


class MaskOneFuture(MultiHeadSelfAttention):
    mask = "one_future"


class FinfoMinMask(MultiHeadSelfAttention):
    mask = "finfo_min"


class SlidingWindow(MultiHeadSelfAttention):
    window_of = 4


class WindowOffByOne(MultiHeadSelfAttention):
    """window = 4 keys, but j >= i - 4 where j > i - 4 belongs: 5 keys."""
    window_of, window_slip = 4, 1
