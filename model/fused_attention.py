"""Fused causal attention in Triton: the next chapter after `scaled_dot_product_attention`.

    Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k) + M) V

`model/attention.py` computes this one step at a time (S = Q K^T * scale + M, P = softmax(S),
O = P V), a kernel each, and kernels only talk through memory: the n x m scores and weights are
written out, read back, and kept until the backward. At long context that O(T^2) round trip, not
the arithmetic, is what the layer spends its time and memory on, and no arrangement of PyTorch
ops avoids it (model/fast_paths.py's `query_blocks` halves it); only a kernel that does all the
steps at once can. `F.scaled_dot_product_attention` is PyTorch's; this file is ours.

This file computes the same equation in one kernel per pass, the way FlashAttention does: a
program walks one tile of query rows over the key tiles, keeps each tile of scores in registers
(nothing n x m in memory), normalises with an online softmax (a running max and sum, rescaled as
the max grows: exact, not an approximation), skips the key tiles wholly in the future, and saves
one log-sum-exp per row so that the backward rebuilds P instead of reading it back.

The mask is right-aligned, exactly like `causal_pattern(n, m)`: n new queries over m keys
(n <= m), query i sits at absolute position m - n + i and sees keys 0 .. m - n + i. n = m is
training; n = 1 is a KV-cache decode step.

k and v may have fewer heads than q (grouped-query attention): query head i reads kv head
i // (h / h_kv).

Entry points: `fused_causal_attention` (differentiable), `fused_attention_forward` and
`fused_attention_backward` (the kernels as plain functions, for tests and benchmarks),
`fused_available(device)` (can the kernels run there?) and `self_check(device, head_dim,
dtype)` (do they compute the right thing there, against the equation in float64? decided
once per process, before trusting them). This module imports nothing of the project: the
layer's fast paths (model/fast_paths.py) call it, never the other way. Without Triton it still
imports and `fused_available` says False, so callers keep the reference path; under
TRITON_INTERPRET=1 (set before triton is imported) the kernels run on the CPU, which is how the
tests check them without a GPU. How it works, step by step: docs/fused_attention.md.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import math
from dataclasses import dataclass
from typing import Optional

import torch

try:
    import triton
    import triton.language as tl
except Exception:  # not installed, or an install that cannot load: the reference path remains
    triton = tl = None


def _jit(fn=None, **options):
    """`triton.jit` when Triton is importable; otherwise the plain function, never launched."""
    if fn is None:
        return lambda fn: _jit(fn, **options)
    return triton.jit(fn, **options) if triton is not None else fn


HEAD_DIMS = (16, 32, 64, 128)  # d_k must be a power of two: tl.arange spans it
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_LOG2E = math.log2(math.e)

# Throughout the kernels: B batch, h heads, n queries, m keys, d = d_k the head size.
# One program handles one (tile, head, batch): program_id(0) is the tile, 1 the head, 2 the batch.
# Every [B, h, t, d] tensor has unit stride along d and is addressed through its B, h and t
# strides, so views (a head split of a fused qkv projection, a KV cache) need no copy.
#
# Scores are kept in base 2: the kernels use exp2, the GPU's native exponential, and log2(e) is
# folded into the scale once, on the host, since exp(x) = exp2(x * log2(e)). With
# `qk_scale` = scale * log2(e), s = (q . k) * qk_scale is the score S in log2 units.


# ----------------------------------------------------------------------------- shared helpers


@_jit
def _head_ptr(ptr, stride_b, stride_h, head):
    """Start of the (this program's batch, `head`) slice, in 64 bits: B h t d can exceed 2^31."""
    batch = tl.program_id(2).to(tl.int64)
    return ptr + batch * stride_b + tl.cast(head, tl.int64) * stride_h


@_jit
def _row_ptr(ptr, n_heads, head, n_q):
    """Start of the [n] row of (this program's batch, `head`) in a contiguous [B, h, n] tensor."""
    return ptr + tl.cast(tl.program_id(2) * n_heads + head, tl.int64) * n_q


@_jit
def _key_range(start_m, n_q, n_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Which keys the query rows start_m .. start_m + BLOCK_M - 1 can see, in two spans.

    Row i sees keys j <= (n_k - n_q) + i. Keys [0, diag) are visible to every row of the tile
    (diag is a multiple of BLOCK_N, so these are whole tiles, with no mask and no bound check);
    keys [diag, end) straddle the diagonal and need the mask; keys >= end are in the future of
    every row and are never touched: that skips the tiles above the diagonal.
    """
    first_row_pos = n_k - n_q + start_m  # absolute position of the tile's first query
    diag = (first_row_pos // BLOCK_N) * BLOCK_N
    end = tl.minimum(first_row_pos + BLOCK_M, n_k)
    return diag, end


@_jit
def _query_range(start_n, n_q, n_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Which query rows see the keys start_n .. start_n + BLOCK_N - 1: `_key_range` transposed.

    Key j is seen by rows i >= j - (n_k - n_q). Rows below `lo` see none of the tile (skipped);
    rows [lo, mid) straddle the diagonal and need the mask; rows [mid, n_q) see every key of it.
    """
    offset = n_k - n_q
    first = tl.maximum(start_n - offset, 0)               # first row to see the tile's first key
    full = tl.maximum(start_n + BLOCK_N - 1 - offset, 0)  # first row to see its last key
    lo = (first // BLOCK_M) * BLOCK_M
    mid = tl.cdiv(full, BLOCK_M) * BLOCK_M
    return lo, mid


# ----------------------------------------------------------------------------- forward


@_jit
def _fwd_key_tiles(acc, l_i, m_i, q, k_head, v_head, stride_kvt, offs_m, offs_d, lo, hi,
                   n_q, n_k, qk_scale,
                   BLOCK_N: tl.constexpr, ON_DIAGONAL: tl.constexpr,
                   DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """Fold the keys lo .. hi - 1 into one query tile's running softmax, BLOCK_N keys at a time:
    m_i the running max of the scores (log2 units), l_i the running sum of 2^(s_j - m_i), acc_i
    the output not yet divided by l_i; when a tile raises the max to m_new, both are re-based by
    alpha = 2^(m_i - m_new), so every exponent stays <= 0 (the identity: docs/fused_attention.md,
    "The online softmax")."""
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + tl.arange(0, BLOCK_N)                         # key positions [BLOCK_N]
        kv_offs = offs_n[:, None] * stride_kvt + offs_d[None, :]         # [BLOCK_N, d]
        if ON_DIAGONAL:  # the last tile may run past m: padded keys load as 0, the mask hides them
            k = tl.load(k_head + kv_offs, mask=offs_n[:, None] < n_k, other=0.0)
            v = tl.load(v_head + kv_offs, mask=offs_n[:, None] < n_k, other=0.0)
        else:
            k = tl.load(k_head + kv_offs)
            v = tl.load(v_head + kv_offs)
        k = k.to(DOT_DTYPE)  # a no-op except for bf16 under the interpreter
        v = v.to(DOT_DTYPE)

        # 1-3. score, scale, mask: s = (Q K^T * scale + M) * log2(e)          [BLOCK_M, BLOCK_N]
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        if ON_DIAGONAL:  # M: -inf where key j comes after query i's position (n_k - n_q) + i
            s = tl.where(offs_n[None, :] <= (n_k - n_q) + offs_m[:, None], s, float("-inf"))

        # 4. softmax, online: raise the max, re-base the old sums on it, add this tile's terms.
        # Every row sees key 0, which sits in the first tile walked, so m_i is finite from the
        # first tile on and a fully masked row of a later tile just adds 2^-inf = 0.
        m_new = tl.maximum(m_i, tl.max(s, 1))                            # [BLOCK_M]
        alpha = tl.math.exp2(m_i - m_new)                      # [BLOCK_M], 0 on the first tile
        p = tl.math.exp2(s - m_new[:, None])                             # [BLOCK_M, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, 1)

        # 5. blend: acc = alpha acc + P V, accumulated in fp32; P is rounded to the input dtype,
        # as torch's own 16-bit path rounds the weights, so the product runs on the tensor cores.
        acc = tl.dot(p.to(DOT_DTYPE), v, acc * alpha[:, None], input_precision=PRECISION,
                     out_dtype=acc.dtype)
        m_i = m_new
    return acc, l_i, m_i


@_jit(do_not_specialize=["kv_group"])  # one variant for any group
def _fwd_kernel(Q, K, V, O, LSE,
                stride_qb, stride_qh, stride_qt,     # q [B, h, n, d]
                stride_kvb, stride_kvh, stride_kvt,  # k, v [B, h_kv, m, d] (same strides)
                stride_ob, stride_oh, stride_ot,     # out [B, h, n, d]
                n_q, n_k, qk_scale,                  # qk_scale = scale * log2(e)
                kv_group,                            # h // h_kv query heads share a kv head
                HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                DOT_DTYPE: tl.constexpr, ACC_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """out = softmax(Q K^T * scale + M) V and lse_i = log sum_j exp(S_ij), for BLOCK_M rows."""
    # The last query tiles see the most keys; launch them first so the short ones fill the tail.
    start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)                             # query rows [BLOCK_M]
    offs_d = tl.arange(0, HEAD_DIM)                                      # [d]
    row_ok = offs_m < n_q                                                # rows past n are padding
    head = tl.program_id(1)
    q_head = _head_ptr(Q, stride_qb, stride_qh, head)
    k_head = _head_ptr(K, stride_kvb, stride_kvh, head // kv_group)      # the group's kv head
    v_head = _head_ptr(V, stride_kvb, stride_kvh, head // kv_group)

    # The query tile is loaded once and stays in registers for the whole walk over the keys.
    q = tl.load(q_head + offs_m[:, None] * stride_qt + offs_d[None, :],
                mask=row_ok[:, None], other=0.0).to(DOT_DTYPE)           # [BLOCK_M, d]
    m_i = tl.full([BLOCK_M], float("-inf"), ACC_DTYPE)                   # running max
    l_i = tl.zeros([BLOCK_M], ACC_DTYPE)                                 # running sum
    acc = tl.zeros([BLOCK_M, HEAD_DIM], ACC_DTYPE)                       # running P V

    diag, end = _key_range(start_m, n_q, n_k, BLOCK_M, BLOCK_N)
    acc, l_i, m_i = _fwd_key_tiles(acc, l_i, m_i, q, k_head, v_head, stride_kvt, offs_m, offs_d,
                                   0, diag, n_q, n_k, qk_scale,
                                   BLOCK_N, False, DOT_DTYPE, PRECISION)   # the past: no mask
    acc, l_i, m_i = _fwd_key_tiles(acc, l_i, m_i, q, k_head, v_head, stride_kvt, offs_m, offs_d,
                                   diag, end, n_q, n_k, qk_scale,
                                   BLOCK_N, True, DOT_DTYPE, PRECISION)    # the diagonal

    # Normalise once at the end: softmax(S) V = acc / l. l >= 1 (the max term is 2^0).
    out = acc / l_i[:, None]                                             # [BLOCK_M, d]
    # lse = log sum_j exp(S_ij) = (m_i + log2 l_i) * ln 2, back in natural-log units.
    lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453                 # [BLOCK_M]
    o_head = _head_ptr(O, stride_ob, stride_oh, head)
    tl.store(o_head + offs_m[:, None] * stride_ot + offs_d[None, :],
             out.to(O.dtype.element_ty), mask=row_ok[:, None])
    tl.store(_row_ptr(LSE, tl.num_programs(1), head, n_q) + offs_m, lse, mask=row_ok)


# ----------------------------------------------------------------------------- backward
#
# With S = Q K^T * scale + M, P = softmax(S) row by row, O = P V and dO = dLoss/dO:
#     dV = P^T dO                       dP = dO V^T
#     dS = P * (dP - delta)             delta_i = sum_j P_ij dP_ij = dO_i . O_i
#     dQ = dS K * scale                 dK = dS^T Q * scale
# dS is softmax's backward: the row-wise Jacobian diag(p) - p p^T applied to dP. Its correction
# term delta_i collapses to dO_i . O_i (as sum_j P_ij dO_i . v_j = dO_i . O_i), so a small kernel
# computes it from O and dO before the two main ones. Those rebuild each tile of P from Q, K and
# the saved lse: P_ij = exp(S_ij - lse_i) = 2^(s_ij - lse_i log2(e)), already normalised.
# dK and dV sum over query rows, dQ over keys, so they get a kernel each and neither needs atomics:
# one program per key tile walks the query tiles that see it (dK, dV), one per query tile walks
# its visible key tiles (dQ).


@_jit
def _bwd_delta_kernel(O, DO, DELTA, stride_ob, stride_oh, stride_ot, n_q,
                      HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, ACC_DTYPE: tl.constexpr):
    """delta_i = dO_i . O_i for one tile of rows: softmax's backward correction, [B, h, n]."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < n_q
    offs = offs_m[:, None] * stride_ot + offs_d[None, :]                 # [BLOCK_M, d]
    head = tl.program_id(1)
    o = tl.load(_head_ptr(O, stride_ob, stride_oh, head) + offs, mask=row_ok[:, None], other=0.0)
    do = tl.load(_head_ptr(DO, stride_ob, stride_oh, head) + offs, mask=row_ok[:, None],
                 other=0.0)
    delta = tl.sum(o.to(ACC_DTYPE) * do.to(ACC_DTYPE), 1)                # [BLOCK_M]
    tl.store(_row_ptr(DELTA, tl.num_programs(1), head, n_q) + offs_m, delta, mask=row_ok)


@_jit
def _dkdv_query_tiles(dk, dv, k, v, q_head, do_head, lse_head, delta_head, stride_qt, stride_ot,
                      offs_n, offs_d, lo, hi, n_q, n_k, qk_scale,
                      BLOCK_M: tl.constexpr, ON_DIAGONAL: tl.constexpr,
                      DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """Add the query rows lo .. hi - 1 to one key tile's dK and dV, BLOCK_M rows at a time.

    Works on transposed tiles ([keys, queries]) so that dV = P^T dO and dK = dS^T Q are plain
    products. Padding rows (>= n) load q = dO = 0, lse = delta = 0: they add exactly nothing.
    """
    for start_m in range(lo, hi, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        offs_m = start_m + tl.arange(0, BLOCK_M)                         # query rows [BLOCK_M]
        row_ok = offs_m < n_q
        q = tl.load(q_head + offs_m[:, None] * stride_qt + offs_d[None, :],
                    mask=row_ok[:, None], other=0.0).to(DOT_DTYPE)       # [BLOCK_M, d]
        do = tl.load(do_head + offs_m[:, None] * stride_ot + offs_d[None, :],
                     mask=row_ok[:, None], other=0.0).to(DOT_DTYPE)      # [BLOCK_M, d]
        lse2 = tl.load(lse_head + offs_m, mask=row_ok, other=0.0) * 1.4426950408889634  # log2
        delta = tl.load(delta_head + offs_m, mask=row_ok, other=0.0)     # [BLOCK_M]

        # P^T rebuilt from the saved lse: 2^(s^T - lse log2(e))               [BLOCK_N, BLOCK_M]
        sT = tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale
        if ON_DIAGONAL:  # M^T: key j is hidden from query i when j > (n_k - n_q) + i
            sT = tl.where(offs_n[:, None] <= (n_k - n_q) + offs_m[None, :], sT, float("-inf"))
        pT = tl.math.exp2(sT - lse2[None, :])

        dv = tl.dot(pT.to(DOT_DTYPE), do, dv, input_precision=PRECISION,
                    out_dtype=dv.dtype)                                      # dV += P^T dO
        dpT = tl.dot(v, tl.trans(do), input_precision=PRECISION)             # dP^T = V dO^T
        dsT = pT * (dpT - delta[None, :])                                    # dS^T
        dk = tl.dot(dsT.to(DOT_DTYPE), q, dk, input_precision=PRECISION,
                    out_dtype=dk.dtype)                                      # dK += dS^T Q
    return dk, dv


@_jit(do_not_specialize=["kv_group"])  # one variant for any group
def _bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV,
                     stride_qb, stride_qh, stride_qt,      # q [B, h, n, d]
                     stride_kvb, stride_kvh, stride_kvt,   # k, v [B, h_kv, m, d]
                     stride_ob, stride_oh, stride_ot,      # dO [B, h, n, d]
                     stride_gb, stride_gh, stride_gt,      # dK, dV [B, h_kv, m, d]
                     n_q, n_k, scale, qk_scale,            # qk_scale = scale * log2(e)
                     kv_group,                             # h // h_kv query heads per kv head
                     HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     DOT_DTYPE: tl.constexpr, ACC_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """dK and dV of one tile of BLOCK_N keys of one kv head: a sum over the query rows that see
    them, in every query head of the head's group."""
    start_n = tl.program_id(0) * BLOCK_N  # the first key tiles, seen by the most rows, start first
    offs_n = start_n + tl.arange(0, BLOCK_N)                             # key positions [BLOCK_N]
    offs_d = tl.arange(0, HEAD_DIM)
    key_ok = offs_n < n_k
    kv_head = tl.program_id(1)
    kv_offs = offs_n[:, None] * stride_kvt + offs_d[None, :]             # [BLOCK_N, d]
    k = tl.load(_head_ptr(K, stride_kvb, stride_kvh, kv_head) + kv_offs, mask=key_ok[:, None],
                other=0.0).to(DOT_DTYPE)
    v = tl.load(_head_ptr(V, stride_kvb, stride_kvh, kv_head) + kv_offs, mask=key_ok[:, None],
                other=0.0).to(DOT_DTYPE)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], ACC_DTYPE)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], ACC_DTYPE)

    # Rows before lo see none of these keys (the tiles above the diagonal): never loaded. Rows
    # [lo, mid) straddle the diagonal and take the mask; rows [mid, n) see every key: no mask.
    lo, mid = _query_range(start_n, n_q, n_k, BLOCK_M, BLOCK_N)
    n_heads = tl.num_programs(1) * kv_group
    # The group's query heads all read these keys: their contributions add up in dk and dv, one
    # head after another (in a fixed order, so the sum is deterministic; no atomics).
    for head in range(kv_head * kv_group, (kv_head + 1) * kv_group):
        q_head = _head_ptr(Q, stride_qb, stride_qh, head)
        do_head = _head_ptr(DO, stride_ob, stride_oh, head)
        lse_row = _row_ptr(LSE, n_heads, head, n_q)
        delta_row = _row_ptr(DELTA, n_heads, head, n_q)
        dk, dv = _dkdv_query_tiles(dk, dv, k, v, q_head, do_head, lse_row, delta_row,
                                   stride_qt, stride_ot, offs_n, offs_d, lo, tl.minimum(mid, n_q),
                                   n_q, n_k, qk_scale, BLOCK_M, True, DOT_DTYPE, PRECISION)
        dk, dv = _dkdv_query_tiles(dk, dv, k, v, q_head, do_head, lse_row, delta_row,
                                   stride_qt, stride_ot, offs_n, offs_d, mid, n_q,
                                   n_q, n_k, qk_scale, BLOCK_M, False, DOT_DTYPE, PRECISION)

    # S = Q K^T * scale, so dK = dS^T Q * scale: the scale is applied once, here.
    g_offs = offs_n[:, None] * stride_gt + offs_d[None, :]
    tl.store(_head_ptr(DK, stride_gb, stride_gh, kv_head) + g_offs,
             (dk * scale).to(DK.dtype.element_ty), mask=key_ok[:, None])
    tl.store(_head_ptr(DV, stride_gb, stride_gh, kv_head) + g_offs,
             dv.to(DV.dtype.element_ty), mask=key_ok[:, None])


@_jit
def _dq_key_tiles(dq, q, do, lse, delta, k_head, v_head, stride_kvt, offs_m, offs_d, lo, hi,
                  n_q, n_k, qk_scale,
                  BLOCK_N: tl.constexpr, ON_DIAGONAL: tl.constexpr,
                  DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """Add the keys lo .. hi - 1 to one query tile's dQ = dS K, BLOCK_N keys at a time."""
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + tl.arange(0, BLOCK_N)                         # key positions [BLOCK_N]
        kv_offs = offs_n[:, None] * stride_kvt + offs_d[None, :]         # [BLOCK_N, d]
        if ON_DIAGONAL:
            k = tl.load(k_head + kv_offs, mask=offs_n[:, None] < n_k, other=0.0)
            v = tl.load(v_head + kv_offs, mask=offs_n[:, None] < n_k, other=0.0)
        else:
            k = tl.load(k_head + kv_offs)
            v = tl.load(v_head + kv_offs)
        k = k.to(DOT_DTYPE)
        v = v.to(DOT_DTYPE)

        # P rebuilt from the saved lse, as in the dK/dV kernel                 [BLOCK_M, BLOCK_N]
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        if ON_DIAGONAL:
            s = tl.where(offs_n[None, :] <= (n_k - n_q) + offs_m[:, None], s, float("-inf"))
        p = tl.math.exp2(s - lse[:, None])

        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)              # dP = dO V^T
        ds = p * (dp - delta[:, None])                                       # dS
        dq = tl.dot(ds.to(DOT_DTYPE), k, dq, input_precision=PRECISION,
                    out_dtype=dq.dtype)                                      # dQ += dS K
    return dq


@_jit(do_not_specialize=["kv_group"])  # one variant for any group
def _bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ,
                   stride_qb, stride_qh, stride_qt,      # q [B, h, n, d]
                   stride_kvb, stride_kvh, stride_kvt,   # k, v [B, h_kv, m, d]
                   stride_ob, stride_oh, stride_ot,      # dO and dQ [B, h, n, d]
                   n_q, n_k, scale, qk_scale,            # qk_scale = scale * log2(e)
                   kv_group,                             # h // h_kv query heads per kv head
                   HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   DOT_DTYPE: tl.constexpr, ACC_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """dQ of one tile of BLOCK_M query rows: a sum over the keys they see."""
    start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M  # longest first, as forward
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < n_q
    head = tl.program_id(1)
    q = tl.load(_head_ptr(Q, stride_qb, stride_qh, head) + offs_m[:, None] * stride_qt
                + offs_d[None, :], mask=row_ok[:, None], other=0.0).to(DOT_DTYPE)  # [BLOCK_M, d]
    o_offs = offs_m[:, None] * stride_ot + offs_d[None, :]
    do = tl.load(_head_ptr(DO, stride_ob, stride_oh, head) + o_offs,
                 mask=row_ok[:, None], other=0.0).to(DOT_DTYPE)          # [BLOCK_M, d]
    lse_row = _row_ptr(LSE, tl.num_programs(1), head, n_q)
    lse2 = tl.load(lse_row + offs_m, mask=row_ok, other=0.0) * 1.4426950408889634  # log2 units
    delta = tl.load(_row_ptr(DELTA, tl.num_programs(1), head, n_q) + offs_m, mask=row_ok,
                    other=0.0)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], ACC_DTYPE)

    k_head = _head_ptr(K, stride_kvb, stride_kvh, head // kv_group)  # the group's kv head
    v_head = _head_ptr(V, stride_kvb, stride_kvh, head // kv_group)
    diag, end = _key_range(start_m, n_q, n_k, BLOCK_M, BLOCK_N)
    dq = _dq_key_tiles(dq, q, do, lse2, delta, k_head, v_head, stride_kvt, offs_m, offs_d,
                       0, diag, n_q, n_k, qk_scale, BLOCK_N, False, DOT_DTYPE, PRECISION)
    dq = _dq_key_tiles(dq, q, do, lse2, delta, k_head, v_head, stride_kvt, offs_m, offs_d,
                       diag, end, n_q, n_k, qk_scale, BLOCK_N, True, DOT_DTYPE, PRECISION)

    # dQ = dS K * scale
    tl.store(_head_ptr(DQ, stride_ob, stride_oh, head) + o_offs,
             (dq * scale).to(DQ.dtype.element_ty), mask=row_ok[:, None])


# ----------------------------------------------------------------------------- host side


@dataclass(frozen=True)
class Tiles:
    """Tile sizes and launch settings of one kernel."""

    block_m: int         # query rows per tile
    block_n: int         # keys per tile
    num_warps: int = 4
    num_stages: int = 3  # software-pipelining depth of the loads in the tile loops


KERNELS = ("fwd", "dkdv", "dq")  # the kernels with their own tiles (delta borrows dq's rows)

# What a tile costs depends on how the kernel multiplies, which the dtype decides:
#   "16-bit"  fp16 / bf16 operands on the tensor cores, fp32 accumulators;
#   "tf32"    fp32 operands rounded to tf32 on the tensor cores (torch's allow_tf32 switch);
#   "fp32"    IEEE fp32: no tensor cores, every tl.dot becomes FMAs on operands held in
#             registers, so the tiles must be small or they spill;
#   "fp64"    fp64 operands and accumulators, twice the bytes of fp32 everywhere.
# Per kind, per kernel, by head size ({largest d: Tiles}). The forward keeps a query tile
# resident and streams keys: tall tiles of queries. dK/dV keeps a key tile and its two
# accumulators resident and streams queries: the transpose. dQ is shaped like the forward.
# Each entry is compiled for sm_80 and sm_90 by tests/test_kernel_compile.py, on a CPU: its
# shared memory fits every GPU of the family (99 KB per block on compute capability 8.6 / 8.9,
# 163 KB on A100, 227 KB on H100) and nothing spills to local memory, so every generation
# takes the same table. `python -m tools.kernel_report` prints it.
_GPU_TILES = {
    "16-bit": {
        "fwd": {32: Tiles(128, 64, 4, 3), 128: Tiles(128, 64, 8, 3)},
        "dkdv": {32: Tiles(32, 128, 4, 3), 64: Tiles(32, 128, 8, 3), 128: Tiles(32, 64, 8, 3)},
        "dq": {32: Tiles(128, 32, 4, 3), 64: Tiles(128, 32, 8, 3), 128: Tiles(64, 32, 8, 3)},
    },
    "tf32": {
        "fwd": {32: Tiles(64, 32, 4, 2), 128: Tiles(64, 32, 8, 2)},
        "dkdv": {16: Tiles(32, 64, 4, 2), 128: Tiles(32, 32, 8, 2)},
        "dq": {32: Tiles(64, 32, 4, 2), 64: Tiles(64, 32, 8, 2), 128: Tiles(32, 32, 8, 2)},
    },
    "fp32": {
        "fwd": {64: Tiles(32, 32, 8, 2), 128: Tiles(32, 16, 8, 2)},
        "dkdv": {32: Tiles(32, 32, 8, 1), 128: Tiles(16, 16, 4, 1)},
        "dq": {64: Tiles(32, 32, 8, 2), 128: Tiles(32, 16, 8, 2)},
    },
    "fp64": {
        "fwd": {128: Tiles(16, 32, 4, 2)},
        "dkdv": {128: Tiles(16, 16, 4, 1)},
        "dq": {64: Tiles(16, 32, 4, 2), 128: Tiles(16, 16, 4, 1)},
    },
}
# The interpreter runs every program one after another in numpy: small tiles keep small test
# shapes multi-tile, and unequal ones exercise diagonals that straddle tile boundaries.
_INTERPRETER_TILES = {"fwd": Tiles(16, 16), "dkdv": Tiles(16, 32), "dq": Tiles(32, 16)}


def _interpreting() -> bool:
    """True when the kernels were built by Triton's interpreter (TRITON_INTERPRET=1 at import)."""
    if triton is None:
        return False
    from triton.runtime.interpreter import InterpretedFunction
    return isinstance(_fwd_kernel, InterpretedFunction)


_INTERPRETED = _interpreting()  # fixed once the kernels exist: decided here, once
_AVAILABLE: dict[str, bool] = {}  # device type -> fused_available's answer


def fused_available(device) -> bool:
    """Whether the fused kernels can run on tensors of `device`.

    A CUDA device with Triton importable, or any device under Triton's interpreter
    (TRITON_INTERPRET=1 set before triton was first imported). Decided once per device type
    and then a dictionary lookup, cheap enough to sit in a traced forward. Whether the kernels
    also compute the right thing there is `self_check`'s question.
    """
    kind = torch.device(device).type
    if kind not in _AVAILABLE:
        _AVAILABLE[kind] = triton is not None and (
            _INTERPRETED or (kind == "cuda" and torch.cuda.is_available()))
    return _AVAILABLE[kind]


def _arithmetic(dtype: torch.dtype) -> str:
    """"16-bit", "tf32", "fp32" or "fp64": how the kernels multiply inputs of `dtype`."""
    if dtype.itemsize == 2:
        return "16-bit"
    if dtype == torch.float64:
        return "fp64"
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32"


def default_tiles(kernel: str, head_dim: int, dtype: torch.dtype, n_q: int, n_k: int,
                  capability: Optional[tuple[int, int]] = None) -> Tiles:
    """The tiles a kernel ("fwd", "dkdv" or "dq") is launched with, shrunk to short sequences.

    `capability`, the GPU's compute capability ((9, 0) for an H100), does not change the
    answer today: every generation compiled so far (sm_80, sm_90) takes the same table. Under
    the interpreter the tiles are its own small ones.
    """
    if _INTERPRETED:
        return _fit(_INTERPRETER_TILES[kernel], n_q, n_k)
    table = _GPU_TILES[_arithmetic(dtype)][kernel]
    tiles = table[min(d for d in table if d >= head_dim)]
    return _fit(tiles, n_q, n_k)


def _fit(tiles: Tiles, n_q: int, n_k: int) -> Tiles:
    """No tile taller than the sequence needs (a decode step has n = 1); tl.dot needs >= 16."""
    block_m = min(tiles.block_m, max(16, triton.next_power_of_2(n_q)))
    block_n = min(tiles.block_n, max(16, triton.next_power_of_2(n_k)))
    return Tiles(block_m, block_n, tiles.num_warps, tiles.num_stages)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if triton is None:
        raise RuntimeError("fused attention needs triton (pip install triton)")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"expected q [B, h, n, d], k and v [B, h_kv, m, d]; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    B, h, n, d = q.shape
    h_kv, m = k.size(1), k.size(2)
    if k.shape != (B, h_kv, m, d) or v.shape != k.shape or h_kv == 0 or h % h_kv:
        raise ValueError(f"k and v must be [B, h_kv, m, d] = [{B}, h_kv, m, {d}] with h_kv "
                         f"dividing h = {h}; got {tuple(k.shape)}, {tuple(v.shape)}")
    if n > m:
        raise ValueError(f"more queries than keys ({n} > {m}): the causal mask is right-aligned, "
                         "so the n queries must be the last n of the m positions")
    if d not in HEAD_DIMS:
        raise ValueError(f"head size {d} not supported; one of {HEAD_DIMS}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in DTYPES:
        raise ValueError(f"q, k, v must share one of {DTYPES}; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError("q, k and v must be on the same device")
    if not fused_available(q.device):
        raise RuntimeError(f"fused attention cannot run on {q.device}: it needs a CUDA GPU, or "
                           "TRITON_INTERPRET=1 set before triton is imported")


def _unit_stride(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """The kernels address d with stride 1; copy any tensor that does not have it."""
    return [t if t.stride(-1) == 1 else t.contiguous() for t in tensors]


def _empty_heads(B: int, h: int, t: int, d: int, like: torch.Tensor) -> torch.Tensor:
    """[B, h, t, d] stored as [B, t, h, d]: what concatenating the heads back reads for free."""
    return torch.empty(B, t, h, d, dtype=like.dtype, device=like.device).transpose(1, 2)


def _kernel_dtypes(dtype: torch.dtype) -> dict:
    """The constexprs that depend on the input dtype.

    DOT_DTYPE: what tl.dot multiplies. The input dtype, so that 16-bit inputs use the tensor
    cores, except bf16 under the interpreter, which stores bf16 as raw 16-bit integers and cannot
    do arithmetic on it: there the tiles are upcast to fp32 once loaded (memory stays bf16).
    ACC_DTYPE: accumulators, softmax statistics and lse: fp32, or fp64 for fp64 inputs.
    PRECISION: fp32 inputs follow PyTorch's tf32 switch; other dtypes ignore it.
    """
    dot = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16,
           torch.float32: tl.float32, torch.float64: tl.float64}[dtype]
    if dtype == torch.bfloat16 and _INTERPRETED:
        dot = tl.float32
    return dict(DOT_DTYPE=dot, ACC_DTYPE=tl.float64 if dtype == torch.float64 else tl.float32,
                PRECISION="tf32" if _arithmetic(dtype) == "tf32" else "ieee")


def launch_constants(kernel: str, head_dim: int, dtype: torch.dtype, tiles: Tiles) -> dict:
    """Every constexpr a kernel is launched with ("fwd", "dkdv", "dq" or "delta"): what makes
    one compiled variant. The launches below and tools/kernel_report.py both use it."""
    constants = dict(HEAD_DIM=head_dim, BLOCK_M=tiles.block_m, **_kernel_dtypes(dtype))
    if kernel == "delta":
        return dict(HEAD_DIM=head_dim, BLOCK_M=tiles.block_m, ACC_DTYPE=constants["ACC_DTYPE"])
    return dict(constants, BLOCK_N=tiles.block_n)


def _on_device(t: torch.Tensor):
    """Launch on the tensors' GPU, not on whichever is current."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _tiles_for(kernel: str, q: torch.Tensor, n_k: int, tiles: Optional[Tiles]) -> Tiles:
    n_q, d = q.size(2), q.size(3)
    if tiles is not None:
        return _fit(tiles, n_q, n_k)
    return default_tiles(kernel, d, q.dtype, n_q, n_k)


def fused_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            scale: Optional[float] = None, *,
                            tiles: Optional[Tiles] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """out = softmax(q k^T * scale + M) v with the right-aligned causal M, and each row's lse.

    q [B, h, n, d], k and v [B, h_kv, m, d], n <= m, h_kv dividing h -> out [B, h, n, d] (q's
    dtype) and
    lse [B, h, n] = log sum_j exp(scale * q_i . k_j) over the visible keys, natural log, float32
    (float64 for float64 inputs). `scale` defaults to 1 / sqrt(d). No gradient is tracked.
    """
    _check(q, k, v)
    B, h, n, d = q.shape
    m = k.size(2)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    q, k, v = _unit_stride(q, k, v)
    if k.stride() != v.stride():  # one set of strides addresses both
        k, v = k.contiguous(), v.contiguous()
    out = _empty_heads(B, h, n, d, q)
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    lse = torch.empty(B, h, n, dtype=acc_dtype, device=q.device)
    if n == 0:
        return out, lse
    t = _tiles_for("fwd", q, m, tiles)
    with _on_device(q):
        _fwd_kernel[(triton.cdiv(n, t.block_m), h, B)](
            q, k, v, out, lse, *q.stride()[:3], *k.stride()[:3], *out.stride()[:3],
            n, m, scale * _LOG2E, h // k.size(1), **launch_constants("fwd", d, q.dtype, t),
            num_warps=t.num_warps, num_stages=t.num_stages)
    return out, lse


def fused_attention_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             out: torch.Tensor, lse: torch.Tensor, grad_out: torch.Tensor,
                             scale: Optional[float] = None, *,
                             dkdv_tiles: Optional[Tiles] = None,
                             dq_tiles: Optional[Tiles] = None
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of fused attention, from the forward's out and lse and dLoss/dout.

    Shapes as in `fused_attention_forward`; grad_out is [B, h, n, d]; dk and dv are
    [B, h_kv, m, d], each kv head's gradient summed over the query heads of its group. The
    weights are rebuilt tile by tile from q, k and lse, never stored.
    """
    _check(q, k, v)
    B, h, n, d = q.shape
    h_kv, m = k.size(1), k.size(2)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    q, k, v = _unit_stride(q, k, v)
    if k.stride() != v.stride():
        k, v = k.contiguous(), v.contiguous()
    # O, dO and dQ share one set of strides: the layout the forward gives O, which is also the
    # one dO has when the heads were concatenated after the forward. Anything else is copied.
    dq = _empty_heads(B, h, n, d, q)
    out, grad_out = (t if t.stride() == dq.stride() else _empty_heads(B, h, n, d, q).copy_(t)
                     for t in (out, grad_out.to(q.dtype)))
    dk = _empty_heads(B, h_kv, m, d, k)
    dv = _empty_heads(B, h_kv, m, d, v)
    if n == 0:
        return dq, dk.zero_(), dv.zero_()
    lse = lse.contiguous()
    delta = torch.empty_like(lse)
    t_kv = _tiles_for("dkdv", q, m, dkdv_tiles)
    t_q = _tiles_for("dq", q, m, dq_tiles)
    with _on_device(q):
        _bwd_delta_kernel[(triton.cdiv(n, t_q.block_m), h, B)](
            out, grad_out, delta, *out.stride()[:3], n,
            **launch_constants("delta", d, q.dtype, t_q))
        _bwd_dkdv_kernel[(triton.cdiv(m, t_kv.block_n), h_kv, B)](
            q, k, v, grad_out, lse, delta, dk, dv,
            *q.stride()[:3], *k.stride()[:3], *grad_out.stride()[:3], *dk.stride()[:3],
            n, m, scale, scale * _LOG2E, h // h_kv, **launch_constants("dkdv", d, q.dtype, t_kv),
            num_warps=t_kv.num_warps, num_stages=t_kv.num_stages)
        _bwd_dq_kernel[(triton.cdiv(n, t_q.block_m), h, B)](
            q, k, v, grad_out, lse, delta, dq,
            *q.stride()[:3], *k.stride()[:3], *grad_out.stride()[:3],
            n, m, scale, scale * _LOG2E, h // h_kv, **launch_constants("dq", d, q.dtype, t_q),
            num_warps=t_q.num_warps, num_stages=t_q.num_stages)
    return dq, dk, dv


# torch.compile must not trace into a kernel launch (Triton's launcher, or its interpreter, is
# Python it cannot follow): the two passes are registered as opaque operators, with "fake"
# versions that only say what they return, and the forward's autograd formula calls the
# backward's operator. torch.library.opcheck tests both (tests/test_fused_attention.py).


@torch.library.custom_op("scratch_gpt::fused_attention_fwd", mutates_args=())
def _fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return fused_attention_forward(q, k, v, scale)


@_fwd_op.register_fake
def _(q, k, v, scale):
    B, h, n, d = q.shape
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return _empty_heads(B, h, n, d, q), q.new_empty(B, h, n, dtype=acc_dtype)


@torch.library.custom_op("scratch_gpt::fused_attention_bwd", mutates_args=())
def _bwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
            lse: torch.Tensor, grad_out: torch.Tensor,
            scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return fused_attention_backward(q, k, v, out, lse, grad_out, scale)


@_bwd_op.register_fake
def _(q, k, v, out, lse, grad_out, scale):
    B, h, n, d = q.shape
    h_kv, m = k.size(1), k.size(2)
    return (_empty_heads(B, h, n, d, q), _empty_heads(B, h_kv, m, d, k),
            _empty_heads(B, h_kv, m, d, v))


def _save_for_backward(ctx, inputs, output):
    """The forward keeps q, k, v, out and the [B, h, n] lse: nothing n x m for the backward."""
    q, k, v, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.scale = scale
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_out, _grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = _bwd_op(q, k, v, out, lse, grad_out, ctx.scale)
    return dq, dk, dv, None


_fwd_op.register_autograd(_backward, setup_context=_save_for_backward)


def fused_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           scale: Optional[float] = None) -> torch.Tensor:
    """softmax(q k^T * scale + M) v with the right-aligned causal mask, in fused Triton kernels.

    q [B, h, n, d], k and v [B, h_kv, m, d] (n <= m, h_kv dividing h: the module docstring)
    -> [B, h, n, d], differentiable w.r.t. q, k and v; `scale` defaults to 1 / sqrt(d). The
    same as `scaled_dot_product_attention(q, k, v, causal_pattern(n, m))[0]` up to rounding;
    check `fused_available(q.device)` first, and `self_check` before trusting it.
    """
    if scale is None:
        scale = 1.0 / math.sqrt(q.size(-1))
    return _fwd_op(q, k, v, float(scale))[0]


# ----------------------------------------------------------------------------- the self-check


@dataclass(frozen=True)
class KernelCheck:
    """`self_check`'s verdict: whether the kernels can be trusted here, and why or why not."""

    ok: bool
    reason: str


# Largest |kernel - reference| the self-check accepts, relative to the largest |reference| (or
# to 1 when that is smaller), per kind of arithmetic: twice what the tests allow, since the
# check is there to catch a kernel that computes the wrong thing (a miscompile, a tile that
# does not fit, a broken driver), not to grade rounding.
SELF_CHECK_TOL = {("16-bit", torch.float16): 1e-2, ("16-bit", torch.bfloat16): 6e-2,
                  ("tf32", torch.float32): 1e-2, ("fp32", torch.float32): 4e-5,
                  ("fp64", torch.float64): 2e-6}
_log = logging.getLogger(__name__)


def self_check(device, head_dim: int, dtype: torch.dtype, kv_group: int = 1) -> KernelCheck:
    """Run the kernels once, forward and backward, against the reference attention in float64.

    Decided once per process for each (device, head size, dtype, query heads per kv head, tf32
    switch), on a small random problem (a few tiles of a training pass, and a decode step). A
    kernel that fails to compile or launch, or disagrees beyond SELF_CHECK_TOL, gets one warning
    line (logged as `model.fused_attention`, so train.log has it) and `ok=False`: the caller
    then uses the reference attention. Call it before torch.compile traces the model.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return _self_check(device, head_dim, dtype, kv_group, _arithmetic(dtype))


@functools.lru_cache(maxsize=None)
def _self_check(device: torch.device, head_dim: int, dtype: torch.dtype, kv_group: int,
                arithmetic: str) -> KernelCheck:
    what = f"head size {head_dim}, {str(dtype).replace('torch.', '')}"
    what += f", {kv_group} query heads per kv head" if kv_group > 1 else ""
    if not fused_available(device):
        return KernelCheck(False, f"fused attention cannot run on {device.type}")
    if head_dim not in HEAD_DIMS or dtype not in DTYPES:
        return KernelCheck(False, f"{what} is not supported (head sizes {HEAD_DIMS}, "
                                  f"dtypes {[str(t).replace('torch.', '') for t in DTYPES]})")
    try:
        error = _largest_error(device, head_dim, dtype, kv_group)
    except Exception as exc:  # noqa: BLE001 -- whatever breaks, the run keeps the reference path
        message = str(exc).strip().splitlines()
        verdict = KernelCheck(False, f"{type(exc).__name__}: {message[0] if message else ''}"[:300])
    else:
        tol = SELF_CHECK_TOL[arithmetic, dtype]
        verdict = KernelCheck(error <= tol, f"largest error {error:.2g} of the reference's scale "
                                            f"(tolerance {tol:g})")
    if not verdict.ok:
        _log.warning(f"warning: the fused attention kernel failed its self-check on {device} "
                     f"({what}): {verdict.reason}; using the reference attention")
    return verdict


def _largest_error(device: torch.device, head_dim: int, dtype: torch.dtype,
                   kv_group: int) -> float:
    """The largest relative error of out, lse, dq, dk, dv and a decode step's out against the
    equation in float64, on random inputs from a private generator (the caller's random stream
    is untouched). NaN or inf counts as an infinite error."""
    # Long enough for a full tile of the largest kind and a ragged one after it: every kernel
    # then sees full tiles, diagonal tiles and padding rows.
    largest = max(max(t.block_m, t.block_n) for t in (
        default_tiles(kernel, head_dim, dtype, 1 << 20, 1 << 20)
        for kernel in KERNELS))
    B, h_kv, T = 2, 2, largest + 7
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v, grad_out = (torch.randn(B, heads, T, head_dim, generator=gen, device=device,
                                     dtype=dtype)
                         for heads in (h_kv * kv_group, h_kv, h_kv, h_kv * kv_group))
    with torch.autocast(device.type, enabled=False), torch.no_grad():
        out, lse = fused_attention_forward(q, k, v)
        grads = fused_attention_backward(q, k, v, out, lse, grad_out)
        step, _ = fused_attention_forward(q[:, :, -1:], k, v)  # one query over T keys
    with torch.autocast(device.type, enabled=False), torch.enable_grad():
        q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
        # the equation, softmax(q k^T / sqrt(d) + M) v, written out: query head i reads kv
        # head i // kv_group, and the causal M hides the keys after each query
        k_rep, v_rep = (t.repeat_interleave(kv_group, dim=1) for t in (k64, v64))
        future = torch.ones(T, T, dtype=torch.bool, device=device).triu(1)
        scores = ((q64 @ k_rep.transpose(-1, -2)) / math.sqrt(head_dim)).masked_fill(future,
                                                                                    -math.inf)
        ref = torch.softmax(scores, dim=-1) @ v_rep
        ref_grads = torch.autograd.grad(ref, (q64, k64, v64), grad_out.double())
        ref_lse = torch.logsumexp(scores, dim=-1)

    def error(actual: torch.Tensor, expected: torch.Tensor) -> float:
        diff = (actual.double() - expected).abs().max().item()
        return diff / max(expected.abs().max().item(), 1.0) if math.isfinite(diff) else math.inf

    pairs = [(out, ref), (lse, ref_lse), *zip(grads, ref_grads), (step, ref[:, :, -1:])]
    return max(error(a, e.detach()) for a, e in pairs)

