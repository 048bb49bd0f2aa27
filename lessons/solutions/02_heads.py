"""Lesson 02's exercise, solved: multi-head causal self-attention.

    python -m check_attention lessons/solutions/02_heads.py:MultiHeadAttention
"""
import torch.nn as nn

from model.attention import causal_pattern, scaled_dot_product_attention


class MultiHeadAttention(nn.Module):
    """x [B, T, d_model] -> [B, T, d_model]: h heads of d_k = d_model / h, concatenated, W_O."""

    def __init__(self, d_model, n_head):
        super().__init__()
        assert d_model % n_head == 0, "the heads split d_model evenly"
        self.n_head, self.d_k = n_head, d_model // n_head
        # W_Q^i of the h heads side by side: head i owns output features i*d_k .. (i+1)*d_k
        self.W_Q = nn.Linear(d_model, d_model)
        self.W_K = nn.Linear(d_model, d_model)
        self.W_V = nn.Linear(d_model, d_model)
        self.W_O = nn.Linear(d_model, d_model)  # the only place the heads mix

    def split(self, t):
        """[B, T, d_model] -> [B, T, h, d_k] -> [B, h, T, d_k]: each head its own T x d_k."""
        B, T, _ = t.shape
        return t.view(B, T, self.n_head, self.d_k).transpose(1, 2)

    def forward(self, x):
        B, T, d_model = x.shape
        q, k, v = self.split(self.W_Q(x)), self.split(self.W_K(x)), self.split(self.W_V(x))
        y, _ = scaled_dot_product_attention(q, k, v, causal_pattern(T, T))  # [B, h, T, d_k]
        y = y.transpose(1, 2).reshape(B, T, d_model)  # concat: [B, T, h, d_k] -> [B, T, d_model]
        return self.W_O(y)
