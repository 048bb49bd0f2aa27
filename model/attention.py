"""Causal multi-head self-attention, written out as the equation.

    Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k) + M) V,     d_k = d_model / h
    MultiHead(X)       = Concat(head_1, ..., head_h) W_O

M is 0 where a query may look and -inf at every future key, added to the raw scores *before*
softmax, so each row renormalises over the past alone. Nothing here calls
`torch.nn.MultiheadAttention` or `F.scaled_dot_product_attention`; the tests use them as oracles.

The file reads from the top: the equation (`scaled_dot_product_attention`), then the layer
(`CausalSelfAttention`: project, split into heads, attend, concatenate, W_O). Three neighbours
keep their own concerns out of this reading path:

  - model/fast_paths.py: the faster code that computes the same numbers (one mask shared by the
    batch in a fused matmul, query blocks on a CPU, our Triton kernel on a GPU), chosen once per
    layer when it is built or moved (`FastPathChoice`), each tested equal to the equation;
  - model/pitfalls.py: the classic mistakes, each replacing the one step of this layer it
    breaks, so that their effect on training is measured with the same code everywhere else;
  - model/decoding.py: the KV cache, which keeps its own books (positions, visible keys, reset).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.config import AttentionConfig
from model.fast_paths import FastPathChoice
from model.pitfalls import PitfallSteps, replaces_a_step
from model.rotary import apply_rotary


# ============================================================================= the equation


def scaled_dot_product_attention(Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor,
                                 mask: Optional[torch.Tensor] = None, *,
                                 scale: Optional[float] = None, dropout_p: float = 0.0,
                                 masked_softmax=None) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(Q K^T / sqrt(d_k) + M) V, returning (output, weights).

    Shapes as on the cheat sheet (docs/cheat_sheet.md), with any leading dimensions: Q [n, d_k], K
    [m, d_k], V [m, d_v] -> output [n, d_v], weights [n, m]; or [B, n, d_k] / [B, h, n, d_k] and the
    same leading dimensions on K and V. With 4-D inputs K and V may have fewer heads than Q
    (grouped-query attention, h_kv dividing h): query head i reads key/value head i // (h / h_kv).
    `mask` broadcasts to [..., n, m], either boolean (True = may attend, as torch's SDPA) or
    additive (0 where a query may attend, -inf where not: M itself). `scale` defaults to 1 /
    sqrt(d_k), d_k being Q's last dimension. `dropout_p` drops attention weights (training only; the
    returned weights are before dropout). `masked_softmax`: steps 3 and 4, replaced only by the
    pitfalls (model/pitfalls.py).
    """
    scale = 1.0 / math.sqrt(Q.size(-1)) if scale is None else scale
    K, V = repeat_kv(K, Q), repeat_kv(V, Q)  # grouped heads: query head i reads kv head i // g
    scores = (Q @ K.transpose(-2, -1)) * scale  # 1. score, 2. scale: [..., n, m]
    weights = (masked_softmax or softmax_with_mask)(scores, mask).to(V.dtype)  # 3. mask, 4. softmax
    blend = F.dropout(weights, dropout_p) if dropout_p > 0 else weights
    return blend @ V, weights  # 5. blend: each output a weighted average of the values


def softmax_with_mask(scores: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """softmax(scores + M) over the keys: M added *before* softmax (exp(-inf) = 0), so each row
    renormalises over the keys it may see."""
    if mask is not None:
        scores = scores + additive_mask(mask, scores.dtype)
    return torch.softmax(scores, dim=-1)


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """M: a boolean mask (True = may attend) as 0 there and -inf elsewhere; an additive mask
    as it is."""
    if mask.dtype != torch.bool:
        return mask.to(dtype)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
        ~mask, float("-inf"))


def repeat_kv(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """K or V [..., h_kv, m, d] -> [..., h, m, d] for q [..., h, n, d]: each key/value head
    repeated for the h / h_kv query heads that read it (query head i gets kv head i // g).
    Unchanged when the heads already match, or for inputs without a head dimension."""
    if q.dim() < 4 or x.size(-3) == q.size(-3):
        return x
    h, h_kv = q.size(-3), x.size(-3)
    assert h % h_kv == 0, f"{h_kv} key/value heads cannot serve {h} query heads"
    return x.repeat_interleave(h // h_kv, dim=-3)


def causal_pattern(n: int, m: int, device=None) -> torch.Tensor:
    """Boolean [n, m]: True where query i (at absolute position m - n + i) may see key j.

    Right-aligned: with a KV cache the n new queries are the *last* n of the m positions, so
    query i sees keys 0 .. m - n + i. For n == m this is the usual lower triangle.
    """
    return visible_keys(torch.arange(m - n, m, device=device), m)


def visible_keys(slots: torch.Tensor, m: int, window: Optional[int] = None,
                 pad: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Boolean [T, m], or [B, 1, T, m] with `pad`: True where the query in slot s = slots[i]
    may see the key in slot j (of m), which is when

        j <= s                      causal: no later key
        j >  s - window             the window: its last `window` keys, its own included
        j >= pad[b]  or  j == s     no pad key of its row b (pad[b] left-pad tokens), and a pad
                                    query sees itself alone: a row with no key would be 0 / 0

    A row that sees no key is softmax over nothing: exp(-inf) / sum(exp(-inf)) = 0 / 0 = NaN,
    and a NaN value reaches every later query, even with weight 0 (0 * NaN = NaN).
    """
    j = torch.arange(m, device=slots.device)  # [m] key slots
    s = slots[:, None]  # [T, 1] query slots
    visible = j <= s  # [T, m]
    if window is not None:
        visible = visible & (j > s - window)
    if pad is not None:
        real = j >= pad[:, None, None, None]  # [B, 1, 1, m]: the row's tokens, not its pads
        visible = visible & (real | (j == s))  # [B, 1, T, m]
    return visible


# ============================================================================= the layer


class CausalSelfAttention(FastPathChoice, nn.Module):
    """Multi-head self-attention in which position t sees positions 0..t only.

    x [B, T, d_model] -> [B, T, d_model]. The architecture comes from the arguments: n_kv_head
    key/value heads (grouped-query attention; None = n_head), qk_norm (RMSNorm of each head's
    q and k), gate (a sigmoid gate on each head's output), and in forward the rotary tables
    (RoPE) when the model uses them, and window (a sliding window of that many keys, the
    query's own included). `attn` is the variant: this class computes the correct layer;
    `attention_layer` (below) builds a `PitfallAttention` for a classic mistake.
    """

    def __init__(self, n_embd: int, n_head: int, block_size: int, attn: AttentionConfig,
                 dropout: float = 0.0, bias: bool = True, attn_dropout: Optional[float] = None,
                 n_kv_head: Optional[int] = None, qk_norm: bool = False, norm_eps: float = 1e-5,
                 gate: bool = False, window: Optional[int] = None):
        super().__init__()
        assert n_embd % n_head == 0, \
            f"d_model ({n_embd}) must be divisible by the number of heads ({n_head})"
        n_kv_head = n_head if n_kv_head is None else n_kv_head
        assert n_head % n_kv_head == 0, \
            f"the heads ({n_head}) must be divisible by the key/value heads ({n_kv_head})"
        self.n_head, self.n_kv_head, self.window = n_head, n_kv_head, window
        self.head_dim = d_k = n_embd // n_head
        self.dropout = dropout if attn_dropout is None else attn_dropout  # on the weights
        if replaces_a_step(attn) and not isinstance(self, PitfallSteps):
            raise ValueError(f"{attn.name!r} replaces a step of this layer: use attention_layer()")
        self.attn = attn  # the variant (its fast path chosen once: model/fast_paths.py)
        # W_Q (n_head heads), W_K and W_V (n_kv_head heads each) in one matmul; its rows are
        # [W_Q | W_K | W_V], each head's d_k rows in turn (qkv_rows gives the three sizes).
        self.qkv_rows = (n_head * d_k, n_kv_head * d_k, n_kv_head * d_k)
        self.qkv = nn.Linear(n_embd, sum(self.qkv_rows), bias=bias)
        # QK-norm: one gain per dimension of a head, shared by the heads
        self.q_norm = nn.RMSNorm(d_k, eps=norm_eps) if qk_norm else None
        self.k_norm = nn.RMSNorm(d_k, eps=norm_eps) if qk_norm else None
        self.out_proj = self.make_out_proj(n_embd, bias)  # W_O mixes the concatenated heads
        # the per-head output gate's W_g (gated attention): after the equation, never inside it
        self.gate = nn.Linear(n_embd, n_head, bias=bias) if gate else None
        self.resid_dropout = nn.Dropout(dropout)  # on the layer's output
        # The causal pattern (a band, with a window) is a property of the task: built once,
        # shared by heads and batch.
        self.register_buffer("causal", visible_keys(torch.arange(block_size), block_size,
                                                    self.window_size()), persistent=False)
        self.select_fast_path()

    def forward(self, x: torch.Tensor, cache=None, layer: int = 0, return_weights: bool = False,
                rotary: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                mask: Optional[torch.Tensor] = None):
        """x [B, T, d_model] -> (y [B, T, d_model], weights [B, h, T, m] or None). cache: a
        KVCache (model/decoding.py) or None. rotary: the (cos, sin) tables of the T positions,
        [T, d_k] or [B, 1, T, d_k] (model/rotary.py), or None. mask: the keys the queries may
        see after a cache (`KVCache.visible`: [T, m] or [B, 1, T, m], asked once per pass by
        GPT.forward), or None: the layer's causal pattern, right-aligned."""
        B, T, C = x.shape

        # per-head projections: [B, T, d_model] -> q [B, h, T, d_k], k, v [B, h_kv, T, d_k]
        q, k, v = (self.split_heads(t) for t in self.qkv(x).split(self.qkv_rows, dim=2))
        if self.q_norm is not None:  # QK-norm: each head's q and k to RMS 1, times a gain
            q, k = self.q_norm(q), self.k_norm(k)
        if rotary is not None:  # RoPE: q and k turned by their positions' angles
            q, k, v = self.rotate(q, k, v, *rotary)
        if cache is not None:  # keys and values of every position so far: [B, h_kv, m, d_k]
            k, v = cache.append(layer, k, v)
        y, weights = self.attend(q, k, v, mask, return_weights)  # [B, h, T, d_k]
        if self.gate is not None:  # one gate per head and token: [B, T, h] -> [B, h, T, 1]
            y = y * torch.sigmoid(self.gate(x)).transpose(1, 2).unsqueeze(-1)
        # concat heads, [B, h, T, d_k] -> [B, T, h * d_k], then W_O: the only step where the
        # heads' outputs combine
        y = self.out_proj(y.transpose(1, 2).reshape(B, T, C))
        return self.resid_dropout(y), weights

    def attend(self, q, k, v, mask, return_weights: bool = False):
        """The equation on the heads: (y [B, h, T, d_k], weights [B, h, T, m] or None). The
        weights come from the equation itself; otherwise the fast path chosen for this device
        computes the same numbers (model/fast_paths.py)."""
        if return_weights:
            return self.equation(q, k, v, mask)
        return self.fast_path(self, q, k, v, mask), None

    def equation(self, q, k, v, mask):
        """scaled_dot_product_attention with this layer's scale, causal pattern and dropout."""
        return scaled_dot_product_attention(
            q, k, v, self.visible(q.size(2), k.size(2), mask), scale=self.scale(),
            dropout_p=self.dropout if self.training else 0.0, masked_softmax=self.masked_softmax)

    # ------------------------------------------------------------ the steps a pitfall replaces

    def split_heads(self, t: torch.Tensor) -> torch.Tensor:
        """[B, T, n * d_k] -> [B, n, T, d_k]: each position's vector cut into n heads of d_k,
        then the heads brought before the positions, so that head i holds dimensions
        i * d_k .. (i + 1) * d_k of every position."""
        B, T, _ = t.shape
        return t.view(B, T, -1, self.head_dim).transpose(1, 2)

    def scale(self) -> float:
        """1 / sqrt(d_k): the per-head size, whose dot products the scores are."""
        return 1.0 / math.sqrt(self.head_dim)

    masked_softmax = staticmethod(softmax_with_mask)

    def rotate(self, q, k, v, cos, sin):
        """RoPE: q and k turned by their positions' angles; v as it is."""
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def visible(self, T: int, m: int, mask: Optional[torch.Tensor]) -> torch.Tensor:
        """The boolean [T, m] pattern (or [B, 1, T, m]): the mask given (a cache's), or the
        causal one, right-aligned: query i sits at absolute position m - T + i."""
        return self.causal[m - T:m, :m] if mask is None else mask

    def window_size(self) -> Optional[int]:
        """w: the keys a query sees in its sliding window, its own included (None: all)."""
        return self.window

    def make_out_proj(self, n_embd: int, bias: bool) -> nn.Module:
        return nn.Linear(n_embd, n_embd, bias=bias)


class PitfallAttention(PitfallSteps, CausalSelfAttention):
    """The layer with a classic mistake: model/pitfalls.py's steps in place of the correct
    ones it breaks, this file's code everywhere else."""


def attention_layer(n_embd: int, n_head: int, block_size: int, attn: AttentionConfig,
                    **options) -> CausalSelfAttention:
    """The layer of the variant `attn`, its class chosen once: the correct layer, or a
    PitfallAttention when `attn` replaces one of its steps (model/pitfalls.py). `options` are
    CausalSelfAttention's (n_kv_head, qk_norm, gate, ...)."""
    layer = PitfallAttention if replaces_a_step(attn) else CausalSelfAttention
    return layer(n_embd, n_head, block_size, attn, **options)
