"""Layers the checker must still handle honestly: other layouts, factories, rotary embeddings,
wrong shapes, outputs that are not tensors.

Test material for tests/test_check_attention.py; not part of the package.
"""
import torch
import torch.nn as nn


class Torch(nn.Module):
    """nn.MultiheadAttention with a causal mask: fused in_proj_weight, out_proj."""

    def __init__(self, embed_dim, num_heads):
        super().__init__()
        self.mha = nn.MultiheadAttention(embed_dim, num_heads, batch_first=True)

    def forward(self, x):
        T = x.size(1)
        future = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        return self.mha(x, x, x, attn_mask=future, need_weights=False)


class Ours(nn.Module):
    """The project's own layer, built through a factory below."""


def ours():
    from model.attention import CausalSelfAttention
    from model.config import AttentionConfig
    return CausalSelfAttention(48, 6, block_size=16, attn=AttentionConfig())


class Rotary(nn.Module):
    """Correct attention with rotary position embeddings on q and k: not the sheet's equation
    (q = x W_Q), though causal and well-formed."""

    def __init__(self, d_model, n_head):
        super().__init__()
        self.n_head = n_head
        self.wq = nn.Linear(d_model, d_model, bias=False)
        self.wk = nn.Linear(d_model, d_model, bias=False)
        self.wv = nn.Linear(d_model, d_model, bias=False)
        self.wo = nn.Linear(d_model, d_model, bias=False)

    def rotate(self, t):  # t [B, h, T, d]
        T, d = t.size(-2), t.size(-1)
        freq = 1.0 / 10000 ** (torch.arange(0, d, 2, dtype=t.dtype) / d)
        angle = torch.arange(T, dtype=t.dtype)[:, None] * freq[None, :]
        cos, sin = angle.cos(), angle.sin()
        a, b = t[..., 0::2], t[..., 1::2]
        return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (w(x).view(B, T, self.n_head, -1).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        q, k = self.rotate(q), self.rotate(k)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, C))


class HeadsOut(nn.Module):
    """Forgets to concatenate: returns [B, h, T, d_k]."""

    def __init__(self, d_model, n_head):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(d_model, 3 * d_model)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2)
                   for t in self.qkv(x).split(C, dim=-1))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


class ReturnsDict(nn.Module):
    def __init__(self, d_model, n_head):
        super().__init__()
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        return {"y": self.proj(x)}


class NeedsVocab(nn.Module):
    def __init__(self, d_model, n_head, vocab_size):
        super().__init__()


class RandomInEval(nn.Module):
    """Dropout that ignores eval(): F.dropout(..., training=True)."""

    def __init__(self, d_model, n_head):
        super().__init__()
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        return torch.nn.functional.dropout(self.proj(x), 0.5, training=True)


NOT_A_LAYER = 42


class FourHeadsOnly(nn.Module):
    """Correct, but refuses any head count but 4."""

    def __init__(self, d_model, n_head):
        super().__init__()
        if n_head != 4:
            raise ValueError("this layer has 4 heads")
        from model.attention import CausalSelfAttention
        from model.config import AttentionConfig
        self.inner = CausalSelfAttention(d_model, n_head, block_size=64, attn=AttentionConfig())

    def forward(self, x):
        return self.inner(x)


class BareParameters(nn.Module):
    """Weights as bare nn.Parameters used as x @ W ([in, out]), no Linear modules at all."""
    divisor = "d_k"

    def __init__(self, d_model, num_heads):
        super().__init__()
        self.h = num_heads
        self.W_q, self.W_k, self.W_v, self.W_o = (
            nn.Parameter(torch.randn(d_model, d_model) / d_model ** 0.5) for _ in range(4))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = ((x @ w).view(B, T, self.h, -1).transpose(1, 2)
                   for w in (self.W_q, self.W_k, self.W_v))
        d = q.size(-1) if self.divisor == "d_k" else C
        scores = (q @ k.transpose(-2, -1)) / d ** 0.5
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        y = scores.softmax(-1) @ v
        return y.transpose(1, 2).reshape(B, T, C) @ self.W_o


class BareParametersScaleDModel(BareParameters):
    divisor = "d_model"


class ALiBi(Rotary):
    """Correct attention with ALiBi's linear position biases on the scores (no rotation): not
    the sheet's equation, though causal and well-formed; no variant of ours has it."""

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (w(x).view(B, T, self.n_head, -1).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        slopes = 2.0 ** (-8.0 * torch.arange(1, self.n_head + 1, dtype=x.dtype) / self.n_head)
        i = torch.arange(T)
        bias = slopes[:, None, None] * (i[None, :] - i[:, None]).to(x.dtype)  # [h, T, T]
        bias = bias.masked_fill(i[None, :] > i[:, None], float("-inf"))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.wo(y.transpose(1, 2).reshape(B, T, C))
