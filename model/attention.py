"""Causal multi-head self-attention, written out step by step.

    Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k) + M) V,     d_k = d_model / h
    MultiHead(X)       = Concat(head_1, ..., head_h) W_O

M is 0 where a query may look and -inf at every future key, added to the raw scores *before*
softmax, so each row renormalises over the past alone. Nothing here calls
`torch.nn.MultiheadAttention` or `F.scaled_dot_product_attention`; the tests use them as oracles.

One speed-up changes nothing in the result: with an exact (-inf) mask the layer takes its query
rows in blocks, and each block leaves out the keys after its last query, which would get weight
exactly 0. That skips about half the work of the T x T scores at long context.

The layer also reproduces the classic mistakes (see `AttentionConfig`), so that their effect on
training can be measured with the very same code path.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Optional

import torch
import torch.nn as nn

from model.config import AttentionConfig, MaskMode, Scale


def causal_pattern(n: int, m: int, device=None) -> torch.Tensor:
    """Boolean [n, m]: True where query i (at absolute position m - n + i) may see key j.

    Right-aligned: with a KV cache the n new queries are the *last* n of the m positions, so
    query i sees keys 0 .. m - n + i. For n == m this is the usual lower triangle.
    """
    return torch.ones(n, m, dtype=torch.bool, device=device).tril(diagonal=m - n)


def scaled_dot_product_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    *,
    scale: Optional[float] = None,
    mask_mode: MaskMode = MaskMode.add,
    mask_value: float = float("-inf"),
    dropout_p: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T / sqrt(d_k) + mask) v, returning (output, weights).

    Shapes: q [..., n, d_k], k [..., m, d_k], v [..., m, d_v] -> output [..., n, d_v],
    weights [..., n, m]. `mask` is either a float tensor added to the scores as it is, or a
    boolean "may attend" pattern (True = visible) broadcastable to [..., n, m]; a boolean
    pattern is applied according to `mask_mode` with `mask_value` at hidden positions.
    `scale` defaults to 1 / sqrt(d_k), d_k being q's last dimension (the per-head size).
    `dropout_p` drops attention weights (training only; the returned weights are pre-dropout).
    """
    d_k = q.size(-1)
    if scale is None:
        scale = 1.0 / math.sqrt(d_k)
    n, m = q.size(-2), k.size(-2)
    batch_shape = q.shape[:-2]

    # The additive mask M: the float mask as given, or 0 where visible and mask_value elsewhere.
    additive = None
    if mask is not None and mask.dtype != torch.bool:
        additive = mask
    elif mask is not None and mask_mode is MaskMode.add:
        additive = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, mask_value)

    # 1. score, 2. scale, 3. mask, as one fused matmul: scores = M + (q @ k^T) / sqrt(d_k).
    # Dividing by sqrt(d_k) keeps the scores' variance near 1 whatever d_k is; the mask is added
    # to the raw scores before softmax, so a row renormalises over the visible keys only.
    q3 = q.reshape(-1, n, d_k)  # [batch, n, d_k]
    k3 = k.reshape(-1, m, d_k)  # [batch, m, d_k]
    if additive is not None:
        bias = additive.expand(*batch_shape, n, m).reshape(-1, n, m) if additive.dim() > 2 else additive
        scores = torch.baddbmm(bias.to(q.dtype), q3, k3.transpose(1, 2), alpha=scale)  # [batch, n, m]
    else:
        scores = torch.bmm(q3, k3.transpose(1, 2)) * scale  # [batch, n, m]
    scores = scores.view(*batch_shape, n, m)
    if mask is not None and mask.dtype == torch.bool and mask_mode is MaskMode.fill:
        scores = scores.masked_fill(~mask, mask_value)  # pitfall: a filled 0 still competes

    # 4. softmax over the keys, in at least float32 (bfloat16 matmuls upcast, float64 kept)
    weights = torch.softmax(scores.to(torch.promote_types(scores.dtype, torch.float32)), dim=-1)
    weights = weights.to(v.dtype)  # [..., n, m]
    if mask is not None and mask.dtype == torch.bool and mask_mode is MaskMode.after_softmax:
        weights = weights.masked_fill(~mask, 0.0)  # pitfall: rows no longer sum to 1
    # 5. blend: each output is a weighted average of the values
    blend = torch.nn.functional.dropout(weights, dropout_p) if dropout_p > 0 else weights
    return blend @ v, weights  # [..., n, d_v], [..., n, m]


class KVCache:
    """Keys and values of the positions already seen, preallocated up to the context length.

    Writing into a fixed buffer (instead of concatenating) keeps each generation step O(T) with
    no reallocation. One cache holds every layer: k, v are [n_layer, B, h, block_size, d_k].
    """

    def __init__(self, n_layer: int, batch: int, n_head: int, max_len: int, head_dim: int,
                 device=None, dtype=torch.float32):
        shape = (n_layer, batch, n_head, max_len, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.length = 0  # positions filled, shared by all layers
        self.max_len = max_len

    def append(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor):
        """Store [B, h, n, d_k] new keys/values for `layer`; return all [B, h, m, d_k] so far."""
        start, end = self.length, self.length + k_new.size(2)
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions, asked for {end}")
        self.k[layer, :, :, start:end] = k_new
        self.v[layer, :, :, start:end] = v_new
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def advance(self, n: int) -> None:
        """Called once per forward pass, after every layer has appended its n positions."""
        self.length += n


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which position t sees positions 0..t only.

    x [B, T, d_model] -> [B, T, d_model]. The variant (correct, or one of the pitfalls) comes
    from `AttentionConfig`; this is the only place that reads it.
    """

    def __init__(self, n_embd: int, n_head: int, block_size: int, attn: AttentionConfig,
                 dropout: float = 0.0, bias: bool = True):
        super().__init__()
        if n_embd % n_head != 0:
            raise ValueError(f"d_model ({n_embd}) must be divisible by the number of heads ({n_head})")
        self.n_head = n_head
        self.head_dim = n_embd // n_head  # d_k
        self.attn = attn
        # W_Q, W_K, W_V of every head in one matmul: [d_model, 3 * d_model]
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        # W_O mixes the concatenated heads; the no_out_proj pitfall leaves it out entirely
        self.out_proj = nn.Linear(n_embd, n_embd, bias=bias) if attn.out_proj else None
        self.dropout = dropout
        self.resid_dropout = nn.Dropout(dropout)
        # The causal pattern is a property of the task: built once, shared by heads and batch.
        self.register_buffer("causal", causal_pattern(block_size, block_size), persistent=False)

    def scale(self) -> float:
        d_model = self.n_head * self.head_dim
        return {
            Scale.d_k: 1.0 / math.sqrt(self.head_dim),
            Scale.d_model: 1.0 / math.sqrt(d_model),
            Scale.none: 1.0,
        }[self.attn.scale]

    def _attend(self, q, k, v, visible):
        """The equation, with this layer's variant: scale, mask handling and dropout."""
        return scaled_dot_product_attention(
            q, k, v, visible, scale=self.scale(),
            mask_mode=self.attn.mask_mode, mask_value=self.attn.mask_value,
            dropout_p=self.dropout if self.training else 0.0,
        )

    def _attend_by_query_blocks(self, q, k, v, visible, block: int) -> torch.Tensor:
        """The same output as `_attend`, skipping the work the causal mask throws away.

        Queries r0..r1 see keys 0..m - T + r1 only; every later key gets exp(-inf) = 0 weight.
        So each block of query rows attends over its visible prefix of keys and nothing after,
        an exact result with about half the score / softmax / blend work when T is long
        (T^2 / 2 + T * block / 2 entries instead of T^2). Only valid when the mask is exact.
        q [B, h, T, d_k], k, v [B, h, m, d_k] -> [B, T, h, d_k] (heads not yet concatenated).
        """
        T, m = q.size(2), k.size(2)
        outputs = []
        for r0 in range(0, T, block):
            r1 = min(r0 + block, T)
            end = m - T + r1  # keys visible to this block's last query
            y, _ = self._attend(q[:, :, r0:r1], k[:, :, :end], v[:, :, :end],
                                visible[r0:r1, :end])  # [B, h, r1 - r0, d_k]
            outputs.append(y.transpose(1, 2))  # [B, r1 - r0, h, d_k]
        return torch.cat(outputs, dim=1)  # [B, T, h, d_k]

    def forward(self, x: torch.Tensor, cache: Optional[KVCache] = None, layer: int = 0,
                return_weights: bool = False):
        B, T, C = x.shape
        h, d_k = self.n_head, self.head_dim

        # per-head projections, split [B, T, d_model] -> [B, h, T, d_k] (views, no copies)
        q, k, v = self.qkv(x).split(C, dim=2)
        q = q.view(B, T, h, d_k).transpose(1, 2)
        k = k.view(B, T, h, d_k).transpose(1, 2)
        v = v.view(B, T, h, d_k).transpose(1, 2)
        if cache is not None:
            k, v = cache.append(layer, k, v)  # [B, h, m, d_k], m = positions so far
        m = k.size(2)

        # query i sits at absolute position m - T + i: the right-aligned slice of the triangle
        visible = self.causal[m - T:m, :m]  # [T, m]
        block = self.attn.query_block
        if block and T > block and self.attn.is_causal() and not return_weights:
            y, weights = self._attend_by_query_blocks(q, k, v, visible, block), None
        else:
            y, weights = self._attend(q, k, v, visible)  # y [B, h, T, d_k], weights [B, h, T, m]
            y = y.transpose(1, 2)  # [B, T, h, d_k]

        # concat heads: [B, T, h, d_k] -> [B, T, h * d_k]
        y = y.reshape(B, T, C)
        # project: W_O is the only step where the heads' outputs combine
        if self.out_proj is not None:
            y = self.out_proj(y)
        y = self.resid_dropout(y)
        return (y, weights) if return_weights else (y, None)


def causal_variant(attn: AttentionConfig) -> AttentionConfig:
    """The same layer with the correct causal mask: what a model can do at generation time.

    Only the masking changes; scaling and W_O belong to the trained weights and stay as trained.
    """
    return replace(attn, mask_mode=MaskMode.add, mask_value=float("-inf"))
