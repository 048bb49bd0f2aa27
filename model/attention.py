"""Causal multi-head self-attention, written out step by step.

    Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k) + M) V,     d_k = d_model / h
    MultiHead(X)       = Concat(head_1, ..., head_h) W_O

M is 0 where a query may look and -inf at every future key, added to the raw scores *before*
softmax, so each row renormalises over the past alone. Nothing here calls
`torch.nn.MultiheadAttention` or `F.scaled_dot_product_attention`; the tests use them as oracles.

One speed-up changes nothing in the result: with an exact (-inf) mask the layer can take its
query rows in blocks, and each block leaves out the keys after its last query, which would get
weight exactly 0. That skips about half the work of the T x T scores, which pays on a CPU; on a
GPU the extra kernel launches cost more than they save, so by default only CPUs do it. On a GPU
our fused Triton kernel (model/fused_attention.py) computes the same equation without ever
writing the T x T scores to memory.

The layer also reproduces the classic mistakes (see `AttentionConfig`), so that their effect on
training can be measured with the very same code path.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Optional

import torch
import torch.nn as nn

from model.config import AttentionConfig, AttentionImpl, MaskMode, Scale

# Query rows per block on a CPU when attention.query_block is null (by device).
CPU_QUERY_BLOCK = 64


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
    visible: Optional[torch.Tensor] = None,
    *,
    scale: Optional[float] = None,
    mask_mode: MaskMode = MaskMode.add,
    mask_value: float = float("-inf"),
    dropout_p: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T / sqrt(d_k) + M) v, returning (output, weights).

    Shapes: q [..., n, d_k], k [..., m, d_k], v [..., m, d_v] -> output [..., n, d_v],
    weights [..., n, m]. `visible` is the boolean [n, m] pattern of keys each query may see
    (True = visible); M is 0 there and `mask_value` elsewhere, applied as `mask_mode` says (the
    correct `add`, or a pitfall). `scale` defaults to 1 / sqrt(d_k), d_k being q's last
    dimension (the per-head size). `dropout_p` drops attention weights (training only; the
    returned weights are pre-dropout).
    """
    d_k = q.size(-1)
    if scale is None:
        scale = 1.0 / math.sqrt(d_k)
    n, m = q.size(-2), k.size(-2)
    batch_shape = q.shape[:-2]
    q3 = q.reshape(-1, n, d_k)  # [batch, n, d_k]
    k3 = k.reshape(-1, m, d_k)  # [batch, m, d_k]

    # 1. score, 2. scale, 3. mask: scores = M + (q @ k^T) / sqrt(d_k), one fused matmul.
    # Dividing by sqrt(d_k) keeps the scores' variance near 1 whatever d_k is; the mask is added
    # to the raw scores before softmax, so a row renormalises over the visible keys only.
    if visible is not None and mask_mode is MaskMode.add:
        M = torch.zeros(n, m, dtype=q.dtype, device=q.device).masked_fill_(~visible, mask_value)
        scores = torch.baddbmm(M, q3, k3.transpose(1, 2), alpha=scale)  # [batch, n, m]
    else:
        scores = torch.bmm(q3, k3.transpose(1, 2)) * scale  # [batch, n, m]
    scores = scores.view(*batch_shape, n, m)
    if visible is not None and mask_mode is MaskMode.fill:
        scores = scores.masked_fill(~visible, mask_value)  # pitfall: a filled 0 still competes

    # 4. softmax over the keys (PyTorch accumulates bfloat16/float16 rows in float32 inside)
    weights = torch.softmax(scores, dim=-1).to(v.dtype)  # [..., n, m]
    if visible is not None and mask_mode is MaskMode.after_softmax:
        weights = weights.masked_fill(~visible, 0.0)  # pitfall: rows no longer sum to 1
    # 5. blend: each output is a weighted average of the values
    blend = torch.nn.functional.dropout(weights, dropout_p) if dropout_p > 0 else weights
    return blend @ v, weights  # [..., n, d_v], [..., n, m]


class KVCache:
    """Keys and values of the positions already seen, preallocated up to the context length.

    One cache holds every layer: k, v are [n_layer, B, h, max_len, d_k]. Writing into a fixed
    buffer (instead of concatenating) keeps each generation step O(T) with no reallocation.

    Growing (the default): each forward pass writes its n new positions after the `length`
    filled ones and attends over that prefix, so shapes grow by one every token. Static
    (`static=True`): the write position is a device tensor, every step attends over the whole
    buffer with the unfilled tail masked out, and the shapes never change, so a one-token decode
    step can be recorded once as a CUDA graph and replayed (model/decoding.py). The masked tail
    gets weight exactly 0, so both give the same tokens.
    """

    def __init__(self, n_layer: int, batch: int, n_head: int, max_len: int, head_dim: int,
                 device=None, dtype=torch.float32, static: bool = False):
        shape = (n_layer, batch, n_head, max_len, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.max_len, self.static = max_len, static
        self.length = 0  # positions filled, shared by all layers (on the host)
        self.position = torch.zeros((), dtype=torch.long, device=device)  # the same, on the device

    def append(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor):
        """Store [B, h, n, d_k] new keys/values for `layer`. Returns the keys and values to
        attend over, [B, h, m, d_k], and the [n, m] visible pattern (None: the layer's causal
        pattern, right-aligned, applies)."""
        n = k_new.size(2)
        if self.length + n > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions, asked for {self.length + n}")
        if not self.static:
            start, end = self.length, self.length + n
            self.k[layer, :, :, start:end] = k_new
            self.v[layer, :, :, start:end] = v_new
            return self.k[layer, :, :, :end], self.v[layer, :, :, :end], None
        new = self.position + torch.arange(n, device=k_new.device)  # [n] absolute positions
        self.k[layer].index_copy_(2, new, k_new.to(self.k.dtype))
        self.v[layer].index_copy_(2, new, v_new.to(self.v.dtype))
        keys = torch.arange(self.max_len, device=k_new.device)
        visible = keys[None, :] <= new[:, None]  # [n, max_len]: filled and not in the future
        return self.k[layer], self.v[layer], visible

    def advance(self, n: int) -> None:
        """Called once per forward pass, after every layer has appended its n positions."""
        self.length += n
        self.position += n  # in place: a captured decode step replays this too

    def reset(self) -> None:
        """Empty the cache, keeping its buffers (a captured decode step stays valid)."""
        self.length = 0
        self.position.zero_()


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which position t sees positions 0..t only.

    x [B, T, d_model] -> [B, T, d_model]. The variant (correct, or one of the pitfalls) comes
    from `AttentionConfig`.
    """

    def __init__(self, n_embd: int, n_head: int, block_size: int, attn: AttentionConfig,
                 dropout: float = 0.0, bias: bool = True, attn_dropout: Optional[float] = None):
        super().__init__()
        assert n_embd % n_head == 0, \
            f"d_model ({n_embd}) must be divisible by the number of heads ({n_head})"
        self.n_head = n_head
        self.head_dim = n_embd // n_head  # d_k
        self.attn = attn
        # W_Q, W_K, W_V of every head in one matmul: [d_model, 3 * d_model]
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        # W_O mixes the concatenated heads; the no_out_proj pitfall leaves it out entirely
        self.out_proj = nn.Linear(n_embd, n_embd, bias=bias) if attn.out_proj else None
        self.dropout = dropout if attn_dropout is None else attn_dropout  # on the weights
        self.resid_dropout = nn.Dropout(dropout)  # on the layer's output
        # The causal pattern is a property of the task: built once, shared by heads and batch.
        self.register_buffer("causal", causal_pattern(block_size, block_size), persistent=False)

    def scale(self) -> float:
        d_model = self.n_head * self.head_dim
        return {
            Scale.d_k: 1.0 / math.sqrt(self.head_dim),
            Scale.d_model: 1.0 / math.sqrt(d_model),
            Scale.none: 1.0,
        }[self.attn.scale]

    def forward(self, x: torch.Tensor, cache: Optional[KVCache] = None, layer: int = 0,
                return_weights: bool = False):
        B, T, C = x.shape
        h, d_k = self.n_head, self.head_dim

        # per-head projections, split [B, T, d_model] -> [B, h, T, d_k] (views, no copies)
        q, k, v = self.qkv(x).split(C, dim=2)
        q = q.view(B, T, h, d_k).transpose(1, 2)
        k = k.view(B, T, h, d_k).transpose(1, 2)
        v = v.view(B, T, h, d_k).transpose(1, 2)
        visible = None
        if cache is not None:
            k, v, visible = cache.append(layer, k, v)  # [B, h, m, d_k], m = positions so far
        m = k.size(2)
        if visible is None:
            # query i sits at absolute position m - T + i: the right-aligned slice of the triangle
            visible = self.causal[m - T:m, :m]  # [T, m]

        weights, block = None, self._query_block(q, T)
        if self._fused(q, return_weights, static=cache is not None and cache.static):
            from model.fused_attention import fused_causal_attention
            # (a KV cache keeps the weights' dtype; under autocast q is already bf16)
            y = fused_causal_attention(q, k.to(q.dtype), v.to(q.dtype), scale=self.scale())
        elif block and not return_weights:
            y = self._attend_by_query_blocks(q, k, v, visible, block)  # [B, h, T, d_k]
        else:
            y, weights = self._attend(q, k, v, visible)  # [B, h, T, d_k], [B, h, T, m]

        # concat heads: [B, h, T, d_k] -> [B, T, h * d_k]
        y = y.transpose(1, 2).reshape(B, T, C)
        # project: W_O is the only step where the heads' outputs combine
        if self.out_proj is not None:
            y = self.out_proj(y)
        y = self.resid_dropout(y)
        return y, weights

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
        q [B, h, T, d_k], k, v [B, h, m, d_k] -> [B, h, T, d_k].
        """
        T, m = q.size(2), k.size(2)
        outputs = []
        for r0 in range(0, T, block):
            r1 = min(r0 + block, T)
            end = m - T + r1  # keys visible to this block's last query
            y, _ = self._attend(q[:, :, r0:r1], k[:, :, :end], v[:, :, :end],
                                visible[r0:r1, :end])  # [B, h, r1 - r0, d_k]
            outputs.append(y.transpose(1, 2))  # [B, r1 - r0, h, d_k]
        # joined in the layout the heads are concatenated in, so that the caller's
        # transpose back and reshape copy nothing
        return torch.cat(outputs, dim=1).transpose(1, 2)  # [B, h, T, d_k]

    def _query_block(self, q: torch.Tensor, T: int) -> int:
        """Rows per query block, 0 for one pass: blocks only with the exact mask, and by
        default only on a CPU."""
        block = self.attn.query_block
        if block is None:
            block = CPU_QUERY_BLOCK if q.device.type == "cpu" else 0
        return block if block and T > block and self.attn.is_causal() else 0

    def _fused(self, q: torch.Tensor, return_weights: bool, static: bool) -> bool:
        """Whether our Triton kernel computes this call (`fused_refusal` decides what it can do).
        Never for weights to return or a static cache's masked buffer; by default only on CUDA;
        and asked for by name (impl=fused), never a silent fallback to the reference code."""
        impl = self.attn.impl
        if impl is AttentionImpl.reference or return_weights or static:
            return False
        if impl is AttentionImpl.auto and q.device.type != "cuda":
            return False
        refusal = fused_refusal(self.attn, q.size(-1), self.dropout if self.training else 0.0,
                                q.device, q.dtype)
        if refusal is not None and impl is AttentionImpl.fused:
            raise ValueError(refusal)
        return refusal is None


def fused_refusal(attn: AttentionConfig, head_dim: Optional[int] = None, dropout: float = 0.0,
                  device=None, dtype: Optional[torch.dtype] = None) -> Optional[str]:
    """Why our Triton kernel cannot compute this attention, or None when it can: the correct
    causal attention only, without dropout on the weights, for the head sizes and dtypes it is
    built for, on a device it runs on. The one decision, made by the config checks with what a
    config knows (guard/limits.py) and by the layer at each call with the tensors in hand."""
    if not attn.is_causal():
        return (f"attention.impl=fused computes the correct attention only; the pitfall "
                f"{attn.name!r} always runs the reference code")
    if dropout > 0:
        return ("attention.impl=fused has no dropout on the attention weights: set "
                "model.attn_dropout=0 (dropout elsewhere stays)")
    if head_dim is None and dtype is None and device is None:
        return None
    from model.fused_attention import DTYPES, HEAD_DIMS, fused_available  # Triton: only if asked
    if head_dim is not None and head_dim not in HEAD_DIMS:
        return f"attention.impl=fused supports head sizes {HEAD_DIMS}, not {head_dim}"
    if dtype is not None and dtype not in DTYPES:
        return f"attention.impl=fused takes {[str(d) for d in DTYPES]}, not {dtype}"
    if device is not None and torch.device(device).type == "mps":  # even under the interpreter
        return "attention.impl=fused needs Triton and a CUDA device, not mps (no Metal target)"
    if device is not None and not fused_available(device):
        return (f"attention.impl=fused needs Triton and a CUDA device (or TRITON_INTERPRET=1), "
                f"not {torch.device(device).type}")
    return None


def causal_variant(attn: AttentionConfig) -> AttentionConfig:
    """The same layer with the correct causal mask: what a model can do at generation time.

    Only the masking changes; scaling and W_O belong to the trained weights and stay as trained.
    """
    return replace(attn, mask_mode=MaskMode.add, mask_value=float("-inf"))
