"""A nanoGPT / minGPT style layer, as a user would write it: one Linear for q, k, v (c_attn), one
output Linear (c_proj), built from a config. Each subclass makes one classic mistake.

Test material for tests/test_check_attention.py (user code the checker runs in its sandbox);
not part of the package.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class CausalSelfAttention(nn.Module):
    scale = "d_k"          # d_k, d_model, none, d_k_no_sqrt
    mask = "-inf"          # -inf, -1e9, zero, fill_zero, after_softmax, no_diagonal, one_future, -5
    out_proj = True
    split = "heads"        # heads; mixed: reshape(B, h, T, d_k), no transpose; view: the same
    softmax_dim = -1       # -2: softmax over the queries

    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(0.1)
        self.resid_dropout = nn.Dropout(0.1)
        self.n_head, self.n_embd = config.n_head, config.n_embd
        self.register_buffer("bias", torch.tril(torch.ones(config.block_size, config.block_size))
                             .view(1, 1, config.block_size, config.block_size))

    def heads(self, t, B, T, C):
        if self.split == "mixed":
            return t.reshape(B, self.n_head, T, C // self.n_head)
        if self.split == "view":  # the literal nanoGPT line without its transpose, after split
            return t.view(B, self.n_head, T, C // self.n_head)
        return t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (self.heads(t, B, T, C) for t in (q, k, v))
        divisor = {"d_k": math.sqrt(k.size(-1)), "d_model": math.sqrt(C), "none": 1.0,
                   "d_k_no_sqrt": k.size(-1)}[self.scale]
        att = (q @ k.transpose(-2, -1)) / divisor
        future = self.bias[:, :, :T, :T] == 0
        if self.mask == "no_diagonal":
            future = torch.ones(T, T, dtype=torch.bool, device=x.device).tril(-1) == 0
        if self.mask == "one_future":
            future = torch.ones(T, T, dtype=torch.bool, device=x.device).tril(1) == 0
        if self.mask in ("-inf", "no_diagonal", "one_future"):
            att = att.masked_fill(future, float("-inf"))
        elif self.mask == "-1e9":
            att = att.masked_fill(future, -1e9)
        elif self.mask == "-5":
            att = att.masked_fill(future, -5.0)
        elif self.mask == "zero":
            att = att + torch.zeros_like(att)  # an additive mask whose value is 0
        elif self.mask == "fill_zero":
            att = att.masked_fill(future, 0.0)
        att = F.softmax(att, dim=self.softmax_dim)
        if self.mask == "after_softmax":
            att = att.masked_fill(future, 0.0)
        att = self.attn_dropout(att)
        y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        if self.out_proj:
            y = self.c_proj(y)
        return self.resid_dropout(y)


class NoScale(CausalSelfAttention):
    scale = "none"


class ScaleDModel(CausalSelfAttention):
    scale = "d_model"


class ScaleDkNoSqrt(CausalSelfAttention):
    scale = "d_k_no_sqrt"


class NoOutProj(CausalSelfAttention):
    out_proj = False


class MaskZero(CausalSelfAttention):
    mask = "zero"


class MaskFillZero(CausalSelfAttention):
    mask = "fill_zero"


class MaskAfterSoftmax(CausalSelfAttention):
    mask = "after_softmax"


class MaskNoDiagonal(CausalSelfAttention):
    mask = "no_diagonal"


class MaskOneFuture(CausalSelfAttention):
    mask = "one_future"


class FiniteMask(CausalSelfAttention):
    mask = "-1e9"


class SmallMask(CausalSelfAttention):
    mask = "-5"


class MixedHeads(CausalSelfAttention):
    split = "mixed"


class ViewHeads(CausalSelfAttention):
    split = "view"


class SoftmaxOverQueries(CausalSelfAttention):
    softmax_dim = -2


class NoScaleNoOutProj(CausalSelfAttention):
    scale, out_proj = "none", False
