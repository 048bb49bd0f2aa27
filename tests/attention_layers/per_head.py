"""The lecture style: one module per head with key / query / value Linears and a lower-triangular
buffer, a MultiHeadAttention that concatenates the heads and projects them, sizes read from
module-level globals as in the lecture's script. Built as MultiHeadAttention(num_heads,
head_size). Each subclass makes one classic mistake.

Test material for tests/test_check_attention.py; not part of the package.
"""
import torch
import torch.nn as nn
from torch.nn import functional as F

n_embd = 64
block_size = 32
dropout = 0.2


class Head(nn.Module):
    scale = "head_size"    # head_size, n_embd (C ** -0.5), none
    mask = "-inf"          # -inf, zero, fill_zero, after_softmax, no_diagonal, one_future

    def __init__(self, head_size):
        super().__init__()
        self.key = nn.Linear(n_embd, head_size, bias=False)
        self.query = nn.Linear(n_embd, head_size, bias=False)
        self.value = nn.Linear(n_embd, head_size, bias=False)
        self.register_buffer("tril", torch.tril(torch.ones(block_size, block_size)))
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        B, T, C = x.shape
        k = self.key(x)
        q = self.query(x)
        wei = q @ k.transpose(-2, -1)
        if self.scale == "head_size":
            wei = wei * k.shape[-1] ** -0.5
        elif self.scale == "n_embd":
            wei = wei * C ** -0.5
        tril = self.tril[:T, :T]
        if self.mask == "no_diagonal":
            tril = torch.tril(torch.ones(T, T), diagonal=-1)
        elif self.mask == "one_future":
            tril = torch.tril(torch.ones(T, T), diagonal=1)
        if self.mask in ("-inf", "no_diagonal", "one_future"):
            wei = wei.masked_fill(tril == 0, float("-inf"))
        elif self.mask == "fill_zero":
            wei = wei.masked_fill(tril == 0, 0.0)
        elif self.mask == "zero":
            wei = wei + (tril == 0).to(wei.dtype) * 0.0
        wei = F.softmax(wei, dim=-1)
        if self.mask == "after_softmax":
            wei = wei * tril.to(wei.dtype)
        wei = self.dropout(wei)
        v = self.value(x)
        return wei @ v


class MultiHeadAttention(nn.Module):
    head = Head
    project = True

    def __init__(self, num_heads, head_size):
        super().__init__()
        self.heads = nn.ModuleList([self.head(head_size) for _ in range(num_heads)])
        self.proj = nn.Linear(head_size * num_heads, n_embd)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        out = torch.cat([h(x) for h in self.heads], dim=-1)
        if self.project:
            out = self.proj(out)
        return self.dropout(out)


def variant(name, **head_fields):
    head = type(f"{name}Head", (Head,), head_fields)
    return type(name, (MultiHeadAttention,), {"head": head})


NoScale = variant("NoScale", scale="none")
ScaleDModel = variant("ScaleDModel", scale="n_embd")
MaskZero = variant("MaskZero", mask="zero")
MaskFillZero = variant("MaskFillZero", mask="fill_zero")
MaskAfterSoftmax = variant("MaskAfterSoftmax", mask="after_softmax")
MaskNoDiagonal = variant("MaskNoDiagonal", mask="no_diagonal")
MaskOneFuture = variant("MaskOneFuture", mask="one_future")


class NoOutProj(MultiHeadAttention):
    project = False
