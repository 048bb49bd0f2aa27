"""Layers written in others' styles, each with the mistake a learner makes in that style (or
correct where the checker used to misjudge the style): a tutorial's boolean mask buffer, a
lecture's per-head modules, Hugging Face Llama and Mistral, Meta's original Llama (complex
rotary pairs) and LitGPT's grouped fused projection.

Test material for tests/test_check_attention_causes.py; not part of the package.
"""
import math

import torch
import torch.nn as nn


def causal_scores(scores, T):
    """Future keys to -inf (True = may attend)."""
    visible = torch.ones(T, T, dtype=torch.bool, device=scores.device).tril()
    return scores.masked_fill(~visible, float("-inf"))


def rotate_half(t, theta=10000.0):
    """Rotary positions on pairs (j, j + d/2), as Hugging Face's Llama and LitGPT do: t [B, h, T,
    d]."""
    T, d = t.shape[-2], t.shape[-1]
    freqs = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = torch.arange(T, dtype=torch.float64)[:, None] * freqs[None, :]
    cos, sin = (torch.cat([a, a], dim=-1).to(t.dtype) for a in (angle.cos(), angle.sin()))
    a, b = t[..., : d // 2], t[..., d // 2:]
    return t * cos + torch.cat([-b, a], dim=-1) * sin


# ----------------------------------------------------------------------------- tutorials


class InvertedMask(nn.Module):
    """A boolean triu buffer (True = hidden) used as if True meant visible: masked_fill(~mask)."""

    def __init__(self, d_model, n_head, block_size):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)
        self.register_buffer("mask", torch.triu(torch.ones(block_size, block_size),
                                                diagonal=1).bool())

    def heads(self, t):
        B, T, D = t.shape
        return t.view(B, T, self.n_head, D // self.n_head).transpose(1, 2)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = (self.heads(t) for t in self.qkv(x).chunk(3, dim=-1))
        scores = q @ k.transpose(-2, -1) / math.sqrt(D // self.n_head)
        scores = scores.masked_fill(~self.mask[:T, :T], float("-inf"))
        y = torch.softmax(scores, dim=-1) @ v
        return self.out(y.transpose(1, 2).reshape(B, T, D))


class ScaleAfterSoftmax(InvertedMask):
    """softmax(QK^T + M) / sqrt(d_k): the weights scaled, not the scores."""

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = (self.heads(t) for t in self.qkv(x).chunk(3, dim=-1))
        weights = torch.softmax(causal_scores(q @ k.transpose(-2, -1), T), dim=-1)
        y = weights / math.sqrt(D // self.n_head) @ v
        return self.out(y.transpose(1, 2).reshape(B, T, D))


class Head(nn.Module):
    """The lecture's head, with a projection of its own."""

    def __init__(self, n_embd, head_size):
        super().__init__()
        self.key, self.query, self.value = (nn.Linear(n_embd, head_size, bias=False)
                                            for _ in range(3))
        self.proj = nn.Linear(head_size, head_size)

    def forward(self, x):
        q, k, v = self.query(x), self.key(x), self.value(x)
        wei = causal_scores(q @ k.transpose(-2, -1) * k.size(-1) ** -0.5, x.size(1))
        return self.proj(torch.softmax(wei, dim=-1) @ v)


class OwnProjections(nn.Module):
    """Each head projected on its own and the heads concatenated: never mixed."""

    def __init__(self, n_embd, n_head):
        super().__init__()
        self.heads = nn.ModuleList(Head(n_embd, n_embd // n_head) for _ in range(n_head))

    def forward(self, x):
        return torch.cat([h(x) for h in self.heads], dim=-1)


# ----------------------------------------------------------------------------- Llama, Mistral


class LlamaHeadDim(nn.Module):
    """Hugging Face Llama's layout (q_proj, k_proj, v_proj, o_proj; 2 key/value heads; rotate-half
    pairs), the scores divided by head_dim where sqrt(head_dim) belongs. Also Mistral's, with
    sliding_window set (a window of that many keys, the query's own included)."""

    divisor = "head_dim"
    window = None

    def __init__(self, hidden_size, num_attention_heads, num_key_value_heads):
        super().__init__()
        self.sliding_window = self.window
        self.num_heads, self.num_kv = num_attention_heads, num_key_value_heads
        self.head_dim = hidden_size // num_attention_heads
        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.k_proj, self.v_proj = (nn.Linear(hidden_size, num_key_value_heads * self.head_dim,
                                              bias=False) for _ in range(2))
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)

    def forward(self, x):
        B, T, D = x.shape
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        k, v = (p(x).view(B, T, -1, self.head_dim).transpose(1, 2).repeat_interleave(
            self.num_heads // self.num_kv, dim=1) for p in (self.k_proj, self.v_proj))
        q, k = rotate_half(q), rotate_half(k)
        divisor = self.head_dim if self.divisor == "head_dim" else math.sqrt(self.head_dim)
        scores = causal_scores(q @ k.transpose(-2, -1) / divisor, T)
        if self.sliding_window is not None:
            i = torch.arange(T)
            scores = scores.masked_fill(i[None, :] <= i[:, None] - self.sliding_window,
                                        float("-inf"))
        y = torch.softmax(scores, dim=-1) @ v
        return self.o_proj(y.transpose(1, 2).reshape(B, T, D))


class MistralWindow(LlamaHeadDim):
    """Correct, with a sliding window of 6 keys."""

    divisor, window = "sqrt", 6


class MetaLlama(nn.Module):
    """Meta's original Llama: wq, wk, wv, wo and rotary positions on complex pairs (2j, 2j + 1)
    (right for weights trained so; transformers' Llama weights pair (j, j + d/2))."""

    def __init__(self, dim, n_heads):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def rotary(self, t):
        T, d = t.shape[1], self.head_dim
        freqs = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
        cis = torch.polar(torch.ones(T, d // 2, dtype=torch.float64),
                          torch.arange(T, dtype=torch.float64)[:, None] * freqs)
        pairs = torch.view_as_complex(t.double().reshape(*t.shape[:-1], -1, 2))  # [B, T, h, d/2]
        return torch.view_as_real(pairs * cis[:, None, :]).flatten(-2).to(t.dtype)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = (w(x).view(B, T, self.n_heads, self.head_dim) for w in (self.wq, self.wk,
                                                                            self.wv))
        q, k = self.rotary(q), self.rotary(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        scores = causal_scores(q @ k.transpose(-2, -1) / math.sqrt(self.head_dim), T)
        y = torch.softmax(scores, dim=-1) @ v
        return self.wo(y.transpose(1, 2).reshape(B, T, D))


# ----------------------------------------------------------------------------- LitGPT


class LitGPTAttention(nn.Module):
    """LitGPT's CausalSelfAttention: one Linear `attn` whose rows hold, for each of the
    n_query_groups groups, its q_per_kv query heads, then its key head and its value head;
    rotate-half rotary positions; `proj` mixes the heads. Correct."""

    def __init__(self, config):
        super().__init__()
        self.n_head, self.n_query_groups = config.n_head, config.n_query_groups
        self.head_size, self.rope_base = config.head_size, config.rope_base
        shape = (config.n_head + 2 * config.n_query_groups) * config.head_size
        self.attn = nn.Linear(config.n_embd, shape, bias=config.bias)
        self.proj = nn.Linear(config.n_head * config.head_size, config.n_embd, bias=config.bias)

    def forward(self, x):
        B, T, C = x.shape
        q_per_kv, hs = self.n_head // self.n_query_groups, self.head_size
        qkv = self.attn(x).view(B, T, self.n_query_groups, q_per_kv + 2, hs)
        qkv = qkv.permute(0, 2, 3, 1, 4)  # [B, groups, q_per_kv + 2, T, hs]
        q, k, v = qkv.split((q_per_kv, 1, 1), dim=2)
        k, v = (t.expand(B, self.n_query_groups, q_per_kv, T, hs) for t in (k, v))
        q, k, v = (t.reshape(B, -1, T, hs) for t in (q, k, v))
        q, k = rotate_half(q, self.rope_base), rotate_half(k, self.rope_base)
        scores = causal_scores(q @ k.transpose(-2, -1) / math.sqrt(hs), T)
        y = torch.softmax(scores, dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))
