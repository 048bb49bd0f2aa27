"""Causal multi-head self-attention, written out as the equation.

    Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k) + M) V,     d_k = d_model / h
    MultiHead(X)       = Concat(head_1, ..., head_h) W_O

M is 0 where a query may look and -inf at every future key, added to the raw scores *before*
softmax, so each row renormalises over the past alone. Nothing here calls
`torch.nn.MultiheadAttention` or `F.scaled_dot_product_attention`; the tests use them as oracles.

The file reads from the top: the equation (`scaled_dot_product_attention`), then the layer
(`CausalSelfAttention`: project, split into heads, attend, concatenate, W_O), then the
optimisations, each marked, none of which changes what is computed:

    1. one mask pattern shared by the whole batch: the mask is added inside the score matmul
       (one fused `baddbmm`), and grouped heads share their keys without copies;
    2. query blocks (on a CPU): each block of query rows leaves out the keys after its last
       query, which would get weight exactly 0, so about half the work is never done;
    3. the kernel dispatch (on a GPU): our fused Triton kernel (model/fused_attention.py)
       computes the same equation without writing the T x T scores to memory.

The layer also reproduces the classic mistakes (see `AttentionConfig`), so that their effect on
training can be measured with the very same code path, and last comes the KV cache.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.config import AttentionConfig, AttentionImpl, MaskMode, Scale
from model.rotary import apply_rotary, apply_rotary_interleaved

# Query rows per block on a CPU when attention.query_block is null (by device); twice that from
# 1,024 queries on.
CPU_QUERY_BLOCK = 64


# ============================================================================= the equation


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

    Shapes: q [..., h, n, d_k], k [..., h_kv, m, d_k], v [..., h_kv, m, d_v] -> output
    [..., h, n, d_v], weights [..., h, n, m]. With fewer key/value heads than query heads
    (grouped-query attention, h_kv dividing h), query head i reads key/value head
    i // (h / h_kv). `visible` is a boolean mask broadcastable to [..., h, n, m] (True = may
    look), as for torch's SDPA: one [n, m] pattern, or one per batch element or head; M is 0
    there and `mask_value` elsewhere, applied as `mask_mode` says (the correct `add`, or a
    pitfall). `scale` defaults to 1 / sqrt(d_k), d_k being q's last dimension (the per-head
    size). `dropout_p` drops attention weights (training only; the returned weights are
    pre-dropout).
    """
    if scale is None:
        scale = 1.0 / math.sqrt(q.size(-1))
    if visible is not None and visible.dim() == 2 and q.dim() >= 3:
        # the model's case, one [n, m] pattern for all: the same numbers, faster (optimisation 1)
        return shared_mask_attention(q, k, v, visible, scale, mask_mode, mask_value, dropout_p)

    k, v = repeat_kv(k, q.size(-3)), repeat_kv(v, q.size(-3))  # head i reads kv head i // g
    scores = (q @ k.transpose(-2, -1)) * scale  # 1. score, 2. scale: [..., n, m]
    if visible is not None and mask_mode is MaskMode.add:
        scores = scores + additive_mask(visible, mask_value, scores.dtype)  # 3. mask (M)
    elif visible is not None and mask_mode is MaskMode.fill:
        scores = scores.masked_fill(~visible, mask_value)  # pitfall: a filled 0 still competes
    weights = torch.softmax(scores, dim=-1).to(v.dtype)  # 4. softmax over the keys
    if visible is not None and mask_mode is MaskMode.after_softmax:
        weights = weights.masked_fill(~visible, 0.0)  # pitfall: rows no longer sum to 1
    blend = F.dropout(weights, dropout_p) if dropout_p > 0 else weights
    return blend @ v, weights  # 5. blend: each output a weighted average of the values


def additive_mask(visible: torch.Tensor, mask_value: float, dtype: torch.dtype) -> torch.Tensor:
    """M: 0 where visible, mask_value elsewhere (-inf for the correct layer), so that adding it
    to the raw scores takes the hidden keys out of the softmax (exp(-inf) = 0)."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(
        ~visible, mask_value)


def repeat_kv(x: torch.Tensor, n_head: int) -> torch.Tensor:
    """[..., h_kv, m, d] -> [..., n_head, m, d]: each key/value head repeated for the
    n_head / h_kv query heads that read it (query head i gets kv head i // g)."""
    h_kv = x.size(-3) if x.dim() >= 3 else n_head
    if h_kv == n_head:
        return x
    assert n_head % h_kv == 0, f"{h_kv} key/value heads cannot serve {n_head} query heads"
    return x.repeat_interleave(n_head // h_kv, dim=-3)


def causal_pattern(n: int, m: int, device=None) -> torch.Tensor:
    """Boolean [n, m]: True where query i (at absolute position m - n + i) may see key j.

    Right-aligned: with a KV cache the n new queries are the *last* n of the m positions, so
    query i sees keys 0 .. m - n + i. For n == m this is the usual lower triangle.
    """
    return torch.ones(n, m, dtype=torch.bool, device=device).tril(diagonal=m - n)


# ============================================================================= the layer


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which position t sees positions 0..t only.

    x [B, T, d_model] -> [B, T, d_model]. The variant (correct, or one of the pitfalls) comes
    from `AttentionConfig`; the rest of the architecture from the arguments: n_kv_head
    key/value heads (grouped-query attention; None = n_head), qk_norm (RMSNorm of each head's
    q and k), and in forward the rotary tables (RoPE) when the model uses them.
    """

    def __init__(self, n_embd: int, n_head: int, block_size: int, attn: AttentionConfig,
                 dropout: float = 0.0, bias: bool = True, attn_dropout: Optional[float] = None,
                 n_kv_head: Optional[int] = None, qk_norm: bool = False, norm_eps: float = 1e-5):
        super().__init__()
        assert n_embd % n_head == 0, \
            f"d_model ({n_embd}) must be divisible by the number of heads ({n_head})"
        n_kv_head = n_head if n_kv_head is None else n_kv_head
        assert n_head % n_kv_head == 0, \
            f"the heads ({n_head}) must be divisible by the key/value heads ({n_kv_head})"
        self.n_head, self.n_kv_head = n_head, n_kv_head
        self.head_dim = d_k = n_embd // n_head
        self.attn = attn
        # W_Q (n_head heads), W_K and W_V (n_kv_head heads each) in one matmul; its rows are
        # [W_Q | W_K | W_V], each head's d_k rows in turn (qkv_rows gives the three sizes).
        self.qkv_rows = (n_head * d_k, n_kv_head * d_k, n_kv_head * d_k)
        self.qkv = nn.Linear(n_embd, sum(self.qkv_rows), bias=bias)
        # QK-norm: one gain per dimension of a head, shared by the heads
        self.q_norm = nn.RMSNorm(d_k, eps=norm_eps) if qk_norm else None
        self.k_norm = nn.RMSNorm(d_k, eps=norm_eps) if qk_norm else None
        # W_O mixes the concatenated heads; the no_out_proj pitfall leaves it out entirely
        self.out_proj = nn.Linear(n_embd, n_embd, bias=bias) if attn.out_proj else None
        self.dropout = dropout if attn_dropout is None else attn_dropout  # on the weights
        # Whether impl=auto may use our kernel here: set by trust_fused_attention once the
        # kernel's self-check passed on the run's device (never by default).
        self.fused_trusted = False
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

    def forward(self, x: torch.Tensor, cache: Optional["KVCache"] = None, layer: int = 0,
                return_weights: bool = False,
                rotary: Optional[tuple[torch.Tensor, torch.Tensor]] = None):
        """x [B, T, d_model] -> (y [B, T, d_model], weights [B, h, T, m] or None). rotary: the
        (cos, sin) tables [T, d_k] of the T positions (model/rotary.py), or None."""
        B, T, C = x.shape
        h, h_kv, d_k = self.n_head, self.n_kv_head, self.head_dim

        # per-head projections: [B, T, d_model] -> q [B, h, T, d_k], k, v [B, h_kv, T, d_k]
        q, k, v = self.qkv(x).split(self.qkv_rows, dim=2)
        q = q.view(B, T, h, d_k).transpose(1, 2)
        k = k.view(B, T, h_kv, d_k).transpose(1, 2)
        v = v.view(B, T, h_kv, d_k).transpose(1, 2)
        if self.q_norm is not None:  # QK-norm: each head's q and k to RMS 1, times a gain
            q, k = self.q_norm(q), self.k_norm(k)
        if rotary is not None:  # RoPE: q and k turned by their positions' angles
            rotate = apply_rotary_interleaved if self.attn.rotary_interleaved else apply_rotary
            q, k = rotate(q, *rotary), rotate(k, *rotary)  # (interleaved: a pitfall)
            if self.attn.rope_on_values:  # pitfall: v turned too, so outputs carry positions
                v = rotate(v, *rotary)
        visible = None
        if cache is not None:
            k, v, visible = cache.append(layer, k, v)  # [B, h_kv, m, d_k], m = positions so far
        m = k.size(2)
        if self.attn.upper_left_mask:
            # pitfall: SDPA's is_causal alignment, query i sees keys 0..i whatever the cache
            # holds; the same pattern when T == m (training), one key for a decoded token
            visible = self.causal[:T, :m]  # [T, m]
        elif visible is None:
            # query i sits at absolute position m - T + i: the right-aligned slice of the triangle
            visible = self.causal[m - T:m, :m]  # [T, m]
        if self.attn.gqa_repeat_mismatch and h_kv < h:
            # pitfall: the kv heads tiled (query head i reads kv head i % h_kv) where each one
            # belongs to its g = h / h_kv consecutive query heads (i // g, repeat_kv)
            k, v = k.repeat(1, h // h_kv, 1, 1), v.repeat(1, h // h_kv, 1, 1)  # [B, h, m, d_k]

        y, weights = self.attend(q, k, v, visible, return_weights,
                                 static=cache is not None and cache.static)  # [B, h, T, d_k]
        # concat heads: [B, h, T, d_k] -> [B, T, h * d_k]
        y = y.transpose(1, 2).reshape(B, T, h * d_k)
        # project: W_O is the only step where the heads' outputs combine
        if self.out_proj is not None:
            y = self.out_proj(y)
        y = self.resid_dropout(y)
        return y, weights

    def attend(self, q, k, v, visible, return_weights: bool = False, static: bool = False):
        """The equation with this layer's variant: (output [B, h, T, d_k], weights or None).

        Which code computes it is a matter of speed only (optimisations 2 and 3 below)."""
        block = self._query_block(q, q.size(2))
        if self._fused(q, return_weights, static):
            from model.fused_attention import fused_causal_attention
            # k, v keep their n_kv_head heads (the kernel maps query head i to kv head i // g);
            # a KV cache keeps the weights' dtype, and under autocast q is already bf16
            return fused_causal_attention(q, k.to(q.dtype), v.to(q.dtype),
                                          scale=self.scale()), None
        if block and not return_weights:
            return self._attend_by_query_blocks(q, k, v, visible, block), None
        return self._attend(q, k, v, visible)

    def _attend(self, q, k, v, visible):
        """scaled_dot_product_attention with this layer's scale, mask handling and dropout."""
        return scaled_dot_product_attention(
            q, k, v, visible, scale=self.scale(),
            mask_mode=self.attn.mask_mode, mask_value=self.attn.mask_value,
            dropout_p=self.dropout if self.training else 0.0,
        )

    # ------------------------------------------------------------------ optimisation 2: query blocks

    def _attend_by_query_blocks(self, q, k, v, visible, block: int) -> torch.Tensor:
        """The same output as `_attend`, skipping the work the causal mask throws away.

        Queries r0..r1 see keys 0..m - T + r1 only; every later key gets exp(-inf) = 0 weight.
        So each block of query rows attends over its visible prefix of keys and nothing after,
        an exact result with about half the score / softmax / blend work when T is long
        (T^2 / 2 + T * block / 2 entries instead of T^2). Only valid when the mask is exact.

        The keys and values are cut into chunks at the blocks' ends, and block i reads chunks
        0..i joined: autograd then hands each chunk its share of the gradient, where taking a
        slice k[:, :, :end] per block would make a zero-filled gradient of the whole of k for
        every block (at T = 1024, more memory traffic than the scores themselves).
        q [B, h, T, d_k], k, v [B, h_kv, m, d_k] -> [B, h, T, d_k].
        """
        T, m = q.size(2), k.size(2)
        starts = range(0, T, block)
        ends = [m - T + min(r0 + block, T) for r0 in starts]  # keys visible to each block
        sizes = [ends[0]] + [b - a for a, b in zip(ends, ends[1:])]
        k_chunks, v_chunks = k.split(sizes, dim=2), v.split(sizes, dim=2)
        outputs = []
        for i, (r0, q_block) in enumerate(zip(starts, q.split(block, dim=2))):
            keys = torch.cat(k_chunks[:i + 1], dim=2)  # [B, h_kv, ends[i], d_k]
            values = torch.cat(v_chunks[:i + 1], dim=2)
            y, _ = self._attend(q_block, keys, values,
                                visible[r0:r0 + q_block.size(2), :ends[i]])  # [B, h, rows, d_k]
            outputs.append(y.transpose(1, 2))  # [B, rows, h, d_k]
        # joined in the layout the heads are concatenated in, so that the caller's
        # transpose back and reshape copy nothing
        return torch.cat(outputs, dim=1).transpose(1, 2)  # [B, h, T, d_k]

    def _query_block(self, q: torch.Tensor, T: int) -> int:
        """Rows per query block, 0 for one pass: blocks only with the exact mask, and by
        default only on a CPU."""
        block = self.attn.query_block
        if block is None:  # by device: rows per block measured on a CPU (docs/model.md)
            block = (CPU_QUERY_BLOCK if T < 1024 else 2 * CPU_QUERY_BLOCK) \
                if q.device.type == "cpu" else 0
        return block if block and T > block and self.attn.is_causal() else 0

    # ------------------------------------------------------------------ optimisation 3: the kernel

    def _fused(self, q: torch.Tensor, return_weights: bool, static: bool) -> bool:
        """Whether our Triton kernel computes this call (`fused_refusal` decides what it can do).
        Never for weights to return or a static cache's masked buffer; by default only on CUDA;
        and asked for by name (impl=fused), never a silent fallback to the reference code."""
        impl = self.attn.impl
        if impl is AttentionImpl.reference or return_weights or static:
            return False
        if impl is AttentionImpl.auto and not (q.device.type == "cuda" and self.fused_trusted):
            return False
        refusal = fused_refusal(self.attn, q.size(-1), self.dropout if self.training else 0.0,
                                q.device, q.dtype)
        if refusal is not None and impl is AttentionImpl.fused:
            raise ValueError(refusal)
        return refusal is None


def trust_fused_attention(model: nn.Module, device, dtype: torch.dtype):
    """Run the kernel's self-check for model's attention on device in dtype (the dtype q has:
    autocast's, or the weights'), and let impl=auto use the kernel only if it passes. Returns the
    verdict (model/fused_attention.py's KernelCheck), or None when no layer would use the kernel
    there (not a CUDA device, impl=reference, a pitfall variant). Call it after the model is on
    its device and before torch.compile traces it."""
    layers = [m for m in model.modules() if isinstance(m, CausalSelfAttention)]
    if not layers or torch.device(device).type != "cuda":
        return None
    first = layers[0]
    if first.attn.impl is AttentionImpl.reference or not first.attn.is_correct():
        return None
    from model.fused_attention import fused_available, self_check  # Triton: only on CUDA
    if not fused_available(device):
        return None
    verdict = self_check(device, first.head_dim, dtype, first.n_head // first.n_kv_head)
    for layer in layers:
        layer.fused_trusted = verdict.ok
    return verdict


def fused_refusal(attn: AttentionConfig, head_dim: Optional[int] = None, dropout: float = 0.0,
                  device=None, dtype: Optional[torch.dtype] = None) -> Optional[str]:
    """Why our Triton kernel cannot compute this attention, or None when it can: the correct
    causal attention only, without dropout on the weights, for the head sizes and dtypes it is
    built for, on a device it runs on. The one decision, made by the config checks with what a
    config knows (guard/limits.py) and by the layer at each call with the tensors in hand."""
    if not attn.is_correct():
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


# ============================================================================= optimisation 1


def shared_mask_attention(q, k, v, visible, scale: float, mask_mode: MaskMode,
                          mask_value: float, dropout_p: float):
    """scaled_dot_product_attention with one [n, m] pattern for every batch element and head
    (the model's case): the same numbers, in fewer passes over memory.

    - Score, scale and mask in one fused matmul: M + scale * (q @ k^T) is `baddbmm(M, q, k^T)`,
      which writes the [n, m] scores once instead of three times.
    - Grouped heads without copies: the g = h / h_kv query heads that read one key/value head
      are stacked as the rows of one matrix, [..., h_kv, g * n, d_k], so a single matmul against
      that head's keys serves them all, and k and v are never repeated.
    The pitfalls' mask modes take the same steps as in the equation.
    """
    *batch, h, n, d_k = q.shape
    h_kv, m, d_v = k.size(-3), k.size(-2), v.size(-1)
    g = h // h_kv
    assert g * h_kv == h, f"{h_kv} key/value heads cannot serve {h} query heads"
    q3 = q.reshape(-1, g * n, d_k)  # [batch * h_kv, g * n, d_k]: head i = kv head i // g
    k3, v3 = k.reshape(-1, m, d_k), v.reshape(-1, m, d_v)  # [batch * h_kv, m, d]
    rows = visible.repeat(g, 1) if g > 1 else visible  # [g * n, m]: each query head of a group
    if mask_mode is MaskMode.add:
        M = additive_mask(rows, mask_value, q.dtype)
        scores = torch.baddbmm(M, q3, k3.transpose(1, 2), alpha=scale)  # [batch * h_kv, g * n, m]
    else:
        scores = torch.bmm(q3, k3.transpose(1, 2)) * scale
        if mask_mode is MaskMode.fill:
            scores = scores.masked_fill(~rows, mask_value)  # pitfall: a filled 0 still competes
    weights = torch.softmax(scores, dim=-1).to(v.dtype)
    if mask_mode is MaskMode.after_softmax:
        weights = weights.masked_fill(~rows, 0.0)  # pitfall: rows no longer sum to 1
    blend = F.dropout(weights, dropout_p) if dropout_p > 0 else weights
    out = torch.bmm(blend, v3)  # [batch * h_kv, g * n, d_v]
    return out.view(*batch, h, n, d_v), weights.view(*batch, h, n, m)


# ============================================================================= the KV cache


class KVCache:
    """Keys and values of the positions already seen, preallocated up to the context length.

    One cache holds every layer: k, v are [n_layer, B, h_kv, max_len, d_k], with the model's
    key/value heads only (grouped-query attention stores n_head / n_kv_head times less).
    Writing into a fixed buffer (instead of concatenating) keeps each generation step O(T) with
    no reallocation.

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

    @property
    def nbytes(self) -> int:
        """Memory held by the keys and values."""
        return self.k.nbytes + self.v.nbytes

    def append(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor):
        """Store [B, h_kv, n, d_k] new keys/values for `layer`. Returns the keys and values to
        attend over, [B, h_kv, m, d_k], and the [n, m] visible pattern (None: the layer's
        causal pattern, right-aligned, applies)."""
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
