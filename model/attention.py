"""Causal multi-head self-attention, written out as the equation.

    Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k) + M) V,     d_k = d_model / h
    MultiHead(X)       = Concat(head_1, ..., head_h) W_O

M is 0 where a query may look and -inf at every future key, added to the raw scores *before*
softmax, so each row renormalises over the past alone. Nothing here calls
`torch.nn.MultiheadAttention` or `F.scaled_dot_product_attention`; the tests use them as oracles.

The file reads from the top: the equation (`scaled_dot_product_attention`), then the layer
(`CausalSelfAttention`: project, split into heads, attend, concatenate, W_O), then the KV cache.
Two neighbours keep their own concerns out of this reading path:

  - model/fast_paths.py: the faster code that computes the same numbers (one mask shared by the
    batch in a fused matmul, query blocks on a CPU, our Triton kernel on a GPU), chosen once per
    layer when it is built or moved (`select_fast_path`), each tested equal to the equation;
  - model/pitfalls.py: the classic mistakes, each replacing the one step of this layer it
    breaks, so that their effect on training is measured with the same code everywhere else.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from model import fast_paths
from model.config import AttentionConfig
from model.pitfalls import PitfallSteps, replaces_a_step
from model.rotary import apply_rotary


# ============================================================================= the equation


def scaled_dot_product_attention(Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor,
                                 mask: Optional[torch.Tensor] = None, *,
                                 scale: Optional[float] = None, dropout_p: float = 0.0,
                                 masked_softmax=None) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(Q K^T / sqrt(d_k) + M) V, returning (output, weights).

    Shapes as on the cheat sheet, with any leading dimensions: Q [n, d_k], K [m, d_k],
    V [m, d_v] -> output [n, d_v], weights [n, m]; or [B, n, d_k] / [B, h, n, d_k] and the same
    leading dimensions on K and V. With 4-D inputs K and V may have fewer heads than Q
    (grouped-query attention, h_kv dividing h): query head i reads key/value head i // (h / h_kv).
    `mask` broadcasts to [..., n, m], either boolean (True = may attend, as torch's SDPA) or
    additive (0 where a query may attend, -inf where not: M itself). `scale` defaults to
    1 / sqrt(d_k), d_k being Q's last dimension. `dropout_p` drops attention weights (training
    only; the returned weights are before dropout). `masked_softmax`: steps 3 and 4, replaced
    only by the pitfalls (model/pitfalls.py).
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


class CausalSelfAttention(nn.Module):
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
        # Whether impl=auto may use our kernel here: set by trust_fused_attention once the
        # kernel's self-check passed on the run's device (never by default).
        self.fused_trusted = False
        self.attn = attn  # the variant
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
        self.register_buffer("causal", self.pattern(torch.arange(block_size), block_size),
                             persistent=False)
        self.select_fast_path()

    def forward(self, x: torch.Tensor, cache: Optional["KVCache"] = None, layer: int = 0,
                return_weights: bool = False,
                rotary: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                mask: Optional[torch.Tensor] = None):
        """x [B, T, d_model] -> (y [B, T, d_model], weights [B, h, T, m] or None). rotary: the
        (cos, sin) tables of the T positions, [T, d_k] or one per row [B, 1, T, d_k]
        (model/rotary.py), or None. mask: the keys the queries may see after a cache
        (`cache_pattern`: [T, m] or [B, 1, T, m], which GPT.forward builds once per pass, as
        the rotary tables), or None: the layer's causal pattern, right-aligned."""
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

    def pattern(self, slots: torch.Tensor, m: int,
                pad: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The keys the queries in `slots` may see (`visible_keys`, with this layer's window)."""
        return visible_keys(slots, m, self.window_size(), pad)

    def cache_pattern(self, cache: "KVCache", T: int) -> Optional[torch.Tensor]:
        """The keys T new queries may see after `cache`: None where the layer's own causal
        pattern is it (a growing cache of unpadded rows), else [T, m] (a static cache: its
        unfilled slots hidden) or [B, 1, T, m] (a left-padded batch: each row's pads hidden)."""
        if cache.pad is None and not cache.static:
            return None
        return self.pattern(cache.slots(T), cache.key_slots(T), cache.pad)

    def first_position(self, cache: "KVCache") -> torch.Tensor:
        """The position of the first new token after a cache: the count it holds (on the
        device, so that a captured decode step replays it), less each row's left pad in a
        padded batch ([B, 1]: every row's first real token at position 0)."""
        return cache.position if cache.pad is None else cache.position - cache.pad[:, None]

    def new_sequence(self, cache: "KVCache") -> None:
        """Before a new sequence is decoded: the cache emptied of the last one's keys."""
        cache.reset()

    def make_out_proj(self, n_embd: int, bias: bool) -> nn.Module:
        return nn.Linear(n_embd, n_embd, bias=bias)

    # ------------------------------------------------------------ chosen once, not per call

    @property
    def attn(self) -> AttentionConfig:
        return self._attn

    @attn.setter
    def attn(self, attn: AttentionConfig) -> None:
        """A new variant (GPT.attention_variant swaps a trained pitfall for its causal variant):
        the fast path is chosen again for it. Only a PitfallAttention runs a pitfall's steps."""
        if replaces_a_step(attn) and not isinstance(self, PitfallSteps):
            raise ValueError(f"attention {attn.name!r} replaces a step of the correct layer: "
                             f"build the layer with attention_layer()")
        self._attn = attn
        if "qkv" in self._modules:
            self.select_fast_path()

    def select_fast_path(self, device=None) -> None:
        """Choose which code computes `attend` on `device` (default: where the weights are).
        Called when the layer is built, moved (`.to()`), switched between train and eval (the
        kernel has no dropout), given another variant, or when its kernel is trusted."""
        device = self.qkv.weight.device if device is None else torch.device(device)
        self.fast_path = fast_paths.choose(self, device)

    def _apply(self, fn, recurse=True):
        result = super()._apply(fn, recurse)
        self.select_fast_path()
        return result

    def train(self, mode: bool = True):
        result = super().train(mode)
        self.select_fast_path()
        return result


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


# ============================================================================= the KV cache


class KVCache:
    """Keys and values of the positions already seen, preallocated up to the context length.

    One cache holds every layer: k, v are [n_layer, B, h_kv, max_len, d_k], with the model's
    key/value heads only (grouped-query attention stores n_head / n_kv_head times less).
    Writing into a fixed buffer (instead of concatenating) keeps each generation step O(T) with
    no reallocation. A batch of prompts of different lengths is left-padded to one length:
    `pad` [B] counts each row's pad tokens, so that its first real token is at slot pad[b]
    (the layer then hides the pad keys and counts each row's positions from there).

    Growing (the default): each forward pass writes its n new positions after the `length`
    filled ones and attends over that prefix, so shapes grow by one every token. Static
    (`static=True`): the write position is a device tensor, every step attends over the whole
    buffer with the unfilled tail masked out, and the shapes never change, so a one-token decode
    step can be recorded once as a CUDA graph and replayed (model/decoding.py). The masked tail
    gets weight exactly 0, so both give the same tokens.
    """

    def __init__(self, n_layer: int, batch: int, kv_heads: int, max_len: int, head_dim: int,
                 device=None, dtype=torch.float32, static: bool = False):
        shape = (n_layer, batch, kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.max_len, self.static = max_len, static
        self.length = 0  # positions filled, shared by all layers (on the host)
        self.position = torch.zeros((), dtype=torch.long, device=device)  # the same, on the device
        self.pad: Optional[torch.Tensor] = None  # [B] left-pad tokens of each row, or None

    @property
    def nbytes(self) -> int:
        """Memory held by the keys and values."""
        return self.k.nbytes + self.v.nbytes

    def append(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor):
        """Store [B, h_kv, n, d_k] new keys/values for `layer`. Returns the keys and values to
        attend over, [B, h_kv, m, d_k]: the filled prefix (growing), or the whole buffer
        (static: the layer's `cache_pattern` hides the unfilled slots)."""
        n = k_new.size(2)
        if self.length + n > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions, asked for {self.length + n}")
        if not self.static:
            start, end = self.length, self.length + n
            self.k[layer, :, :, start:end] = k_new
            self.v[layer, :, :, start:end] = v_new
            return self.k[layer, :, :, :end], self.v[layer, :, :, :end]
        new = self.slots(n)  # [n] the slots written, read from the device
        self.k[layer].index_copy_(2, new, k_new.to(self.k.dtype))
        self.v[layer].index_copy_(2, new, v_new.to(self.v.dtype))
        return self.k[layer], self.v[layer]

    def slots(self, n: int) -> torch.Tensor:
        """[n] the slots the next n tokens are written to (on the device)."""
        return self.position + torch.arange(n, device=self.position.device)

    def key_slots(self, n: int) -> int:
        """The keys n new queries attend over: the filled prefix (growing) or the buffer."""
        return self.max_len if self.static else self.length + n

    def advance(self, n: int) -> None:
        """Called once per forward pass, after every layer has appended its n positions."""
        self.length += n
        self.position += n  # in place: a captured decode step replays this too

    def reset(self) -> None:
        """Empty the cache, keeping its buffers (a captured decode step stays valid)."""
        self.length = 0
        self.position.zero_()
        self.pad = None
