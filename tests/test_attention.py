"""The from-scratch attention against plain reference code and PyTorch's own SDPA (float64)."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from model.attention import (CausalSelfAttention, attention_layer, causal_pattern,
                             scaled_dot_product_attention)
from model.decoding import KVCache
from model import fast_paths
from model.config import AttentionConfig, MaskMode, Scale
from model.pitfalls import masked_softmax

ATOL = 1e-10
D = torch.float64

# (B, h, n, m, d_k): n queries against m keys; n < m is the KV-cache case (right-aligned mask)
SHAPES = [(1, 1, 1, 1, 4), (2, 3, 5, 5, 8), (3, 2, 7, 7, 16), (2, 4, 3, 9, 8),
          (1, 2, 1, 6, 4), (2, 1, 4, 11, 32)]


def reference(q, k, v, visible=None, additive=None, scale=None):
    """softmax(q k^T * scale + M) v written with loops over nothing but the definition."""
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    scores = torch.einsum("...nd,...md->...nm", q, k) * scale
    if additive is not None:
        scores = scores + additive
    if visible is not None:
        scores = torch.where(visible, scores, torch.full_like(scores, -math.inf))
    e = torch.exp(scores - scores.amax(-1, keepdim=True))
    w = e / e.sum(-1, keepdim=True)
    return torch.einsum("...nm,...md->...nd", w, v), w


def qkv(B, h, n, m, d_k, d_v=None):
    d_v = d_k if d_v is None else d_v
    return (torch.randn(B, h, n, d_k, dtype=D), torch.randn(B, h, m, d_k, dtype=D),
            torch.randn(B, h, m, d_v, dtype=D))


# ----------------------------------------------------------------------------- causal_pattern


def test_causal_pattern_square_is_lower_triangle():
    assert torch.equal(causal_pattern(5, 5), torch.ones(5, 5, dtype=torch.bool).tril())


@pytest.mark.parametrize("n,m", [(1, 1), (1, 6), (3, 9), (4, 4), (2, 3)])
def test_causal_pattern_is_right_aligned(n, m):
    p = causal_pattern(n, m)
    assert p.shape == (n, m) and p.dtype == torch.bool
    for i in range(n):
        absolute = m - n + i  # query i is the (m - n + i)-th position
        expected = torch.arange(m) <= absolute
        assert torch.equal(p[i], expected), (i, p[i])


# ----------------------------------------------------------------------------- scaled dot product


@pytest.mark.parametrize("B,h,n,m,d_k", SHAPES)
def test_sdpa_matches_reference_and_torch_with_causal_mask(B, h, n, m, d_k):
    q, k, v = qkv(B, h, n, m, d_k)
    visible = causal_pattern(n, m)
    out, w = scaled_dot_product_attention(q, k, v, visible)
    ref_out, ref_w = reference(q, k, v, visible)
    assert out.shape == (B, h, n, d_k) and w.shape == (B, h, n, m)
    assert out.dtype == D and w.dtype == D
    torch.testing.assert_close(w, ref_w, atol=ATOL, rtol=0)
    torch.testing.assert_close(out, ref_out, atol=ATOL, rtol=0)
    # PyTorch's is_causal is top-left aligned, so give it the right-aligned pattern explicitly
    torch_out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible)
    torch.testing.assert_close(out, torch_out, atol=ATOL, rtol=0)
    if n == m:
        torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True),
                                   atol=ATOL, rtol=0)


@pytest.mark.parametrize("B,h,n,m,d_k", SHAPES)
def test_sdpa_weights_are_a_distribution_over_the_visible_keys(B, h, n, m, d_k):
    q, k, v = qkv(B, h, n, m, d_k)
    visible = causal_pattern(n, m)
    _, w = scaled_dot_product_attention(q, k, v, visible)
    torch.testing.assert_close(w.sum(-1), torch.ones(B, h, n, dtype=D), atol=ATOL, rtol=0)
    assert (w[..., ~visible] == 0).all(), "a future key got a non-zero weight"
    assert (w[..., visible] > 0).all()


def test_sdpa_without_mask_matches_torch():
    q, k, v = qkv(2, 3, 6, 10, 8, d_v=5)
    out, w = scaled_dot_product_attention(q, k, v)
    assert out.shape == (2, 3, 6, 5)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v), atol=ATOL, rtol=0)
    torch.testing.assert_close(w, reference(q, k, v)[1], atol=ATOL, rtol=0)


def test_sdpa_default_scale_is_one_over_sqrt_d_k():
    q, k, v = qkv(1, 2, 4, 4, 16)
    q = q * 3  # large scores, so a wrong scale is far off
    out, _ = scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(out, reference(q, k, v, scale=0.25)[0], atol=ATOL, rtol=0)
    wrong = reference(q, k, v, scale=1.0)[0]
    assert (out - wrong).abs().max() > 1e-3


@pytest.mark.parametrize("scale", [1.0, 0.1, 0.5])
def test_sdpa_explicit_scale_matches_torch(scale):
    q, k, v = qkv(2, 2, 5, 5, 8)
    visible = causal_pattern(5, 5)
    out, _ = scaled_dot_product_attention(q, k, v, visible, scale=scale)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale),
                               atol=ATOL, rtol=0)


def test_sdpa_is_differentiable_and_matches_torch_gradients():
    q, k, v = (t.requires_grad_() for t in qkv(2, 2, 3, 6, 4))
    visible = causal_pattern(3, 6)
    g = torch.randn(2, 2, 3, 4, dtype=D)
    (scaled_dot_product_attention(q, k, v, visible)[0] * g).sum().backward()
    ours = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    (F.scaled_dot_product_attention(q, k, v, attn_mask=visible) * g).sum().backward()
    for a, b in zip(ours, (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


# ----------------------------------------------------------------------------- masks per batch and head


def random_mask(shape, seed=0):
    """A random boolean mask whose every row sees at least one key (an empty row is NaN in any
    softmax, ours and torch's alike)."""
    mask = torch.rand(shape, generator=torch.Generator().manual_seed(seed)) > 0.4
    mask[..., 0] = True
    return mask


@pytest.mark.parametrize("q_shape,mask_shape", [
    ((4, 12, 8), (4, 12, 16)),        # 3-D inputs, a mask per batch element
    ((4, 12, 8), (12, 16)),           # 3-D inputs, one shared pattern
    ((2, 2, 12, 8), (2, 2, 12, 16)),  # 4-D inputs, a mask per batch element and head
    ((2, 2, 12, 8), (2, 1, 12, 16)),  # per batch element, shared by the heads
    ((2, 3, 12, 8), (3, 12, 16)),     # per head, shared by the batch
    ((2, 3, 12, 8), (12, 16)),        # the model's case: one pattern for all
])
def test_sdpa_takes_boolean_masks_broadcast_like_torchs(q_shape, mask_shape):
    """Batched prompts of different lengths need a mask per batch element (and per head)."""
    *batch, n, d = q_shape
    q = torch.randn(q_shape, dtype=D, requires_grad=True)
    k, v = torch.randn(*batch, 16, d, dtype=D), torch.randn(*batch, 16, 5, dtype=D)
    mask = random_mask(mask_shape)
    out, w = scaled_dot_product_attention(q, k, v, mask)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)
    assert w.shape == (*batch, n, 16) and (w[~mask.expand_as(w)] == 0).all()
    g, = torch.autograd.grad(out.sum(), q)
    g_torch, = torch.autograd.grad(expected.sum(), q)
    torch.testing.assert_close(g, g_torch, atol=ATOL, rtol=0)


def test_sdpa_masks_per_head_with_grouped_heads_match_torch():
    q = torch.randn(2, 6, 12, 8, dtype=D)
    k, v = torch.randn(2, 2, 16, 8, dtype=D), torch.randn(2, 2, 16, 8, dtype=D)
    for shape in [(2, 6, 12, 16), (2, 1, 12, 16), (12, 16)]:
        mask = random_mask(shape, seed=len(shape))
        out, _ = scaled_dot_product_attention(q, k, v, mask)
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)


def test_the_cheat_sheets_shapes_and_both_mask_conventions():
    """Q [n, d_k], K [m, d_k], V [m, d_v] as on the sheet (and with a batch, and heads): the
    output is [n, d_v]; a boolean mask (True = may attend) and the additive one (0 / -inf) it
    stands for give the same numbers as torch's SDPA."""
    n, m, d_k, d_v = 5, 7, 8, 3
    for lead in [(), (4,), (2, 3)]:
        Q, K, V = (torch.randn(*lead, t, d, dtype=D) for t, d in ((n, d_k), (m, d_k), (m, d_v)))
        out, w = scaled_dot_product_attention(Q, K, V)
        assert out.shape == (*lead, n, d_v) and w.shape == (*lead, n, m)
        torch.testing.assert_close(out, F.scaled_dot_product_attention(Q, K, V), atol=ATOL, rtol=0)
        keep = causal_pattern(n, m)
        additive = torch.zeros(n, m, dtype=D).masked_fill(~keep, -math.inf)
        by_bool, _ = scaled_dot_product_attention(Q, K, V, keep)
        by_add, _ = scaled_dot_product_attention(Q, K, V, additive)
        expected = F.scaled_dot_product_attention(Q, K, V, attn_mask=keep)
        torch.testing.assert_close(by_bool, expected, atol=ATOL, rtol=0)
        torch.testing.assert_close(by_add, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("dropout_p", [0.0, 0.5])
def test_shared_pattern_path_is_the_equation(dropout_p, monkeypatch):
    """The model's one-[n, m]-pattern path (fused baddbmm, grouped heads unrepeated) gives the
    equation's numbers (dropout included, on the same random stream), and never repeats keys
    and values."""
    q = torch.randn(2, 4, 7, 8, dtype=D)
    k, v = torch.randn(2, 2, 9, 8, dtype=D), torch.randn(2, 2, 9, 8, dtype=D)
    visible = causal_pattern(7, 9)
    torch.manual_seed(1)
    general, _ = scaled_dot_product_attention(q, k, v, visible[None], dropout_p=dropout_p)
    import model.attention as attention
    monkeypatch.setattr(attention, "repeat_kv", lambda *a: pytest.fail("keys were repeated"))
    torch.manual_seed(1)
    shared = fast_paths.shared_mask_attention(q, k, v, visible, 1 / math.sqrt(8), dropout_p)
    torch.testing.assert_close(shared, general, atol=ATOL, rtol=0)


@pytest.mark.parametrize("mode,value", [(MaskMode.add, -math.inf), (MaskMode.add, 0.0),
                                        (MaskMode.add, -5.0), (MaskMode.fill, 0.0),
                                        (MaskMode.fill, -math.inf),
                                        (MaskMode.after_softmax, -math.inf)])
def test_the_mask_modes_are_the_definitions(mode, value):
    """Each mask mode (model/pitfalls.py, written once) against its definition in plain code."""
    q, k, v = qkv(2, 3, 6, 6, 8)
    visible = causal_pattern(6, 6)
    out, w = scaled_dot_product_attention(q, k, v, visible, masked_softmax=masked_softmax(mode, value))
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(8)
    if mode is MaskMode.add:
        expected = torch.softmax(scores + torch.where(visible, 0.0, value), -1)
    elif mode is MaskMode.fill:
        expected = torch.softmax(torch.where(visible, scores, value), -1)
    else:
        expected = torch.softmax(scores, -1) * visible
    torch.testing.assert_close(w, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(out, expected @ v, atol=ATOL, rtol=0)


# ----------------------------------------------------------------------------- the pitfalls


def test_pitfall_masks_leak_and_correct_modes_do_not():
    q, k, v = qkv(1, 1, 5, 5, 8)
    visible = causal_pattern(5, 5)
    ref_out, _ = reference(q, k, v, visible)
    # correct: add -inf, or fill with -inf
    for mode in (MaskMode.add, MaskMode.fill):
        out, w = scaled_dot_product_attention(q, k, v, visible,
                                              masked_softmax=masked_softmax(mode, -math.inf))
        torch.testing.assert_close(out, ref_out, atol=ATOL, rtol=0)
    # adding 0 = no mask at all
    out, w = scaled_dot_product_attention(q, k, v, visible,
                                          masked_softmax=masked_softmax(MaskMode.add, 0.0))
    torch.testing.assert_close(out, reference(q, k, v)[0], atol=ATOL, rtol=0)
    assert (w[..., ~visible] > 0).all()
    # filling with 0: the future keys get weight exp(0)
    out, w = scaled_dot_product_attention(q, k, v, visible,
                                          masked_softmax=masked_softmax(MaskMode.fill, 0.0))
    assert (w[..., ~visible] > 0).all()
    # zeroing after softmax: rows no longer sum to 1 (except the last, which sees everything)
    out, w = scaled_dot_product_attention(
        q, k, v, visible, masked_softmax=masked_softmax(MaskMode.after_softmax, -math.inf))
    assert (w[..., ~visible] == 0).all()
    sums = w.sum(-1)[0, 0]
    assert (sums[:-1] < 1 - 1e-6).all() and abs(sums[-1].item() - 1) < ATOL
    # a large finite negative value: nearly, not exactly, causal
    out, w = scaled_dot_product_attention(q, k, v, visible,
                                          masked_softmax=masked_softmax(MaskMode.add, -1e4))
    torch.testing.assert_close(out, ref_out, atol=1e-8, rtol=0)


# ----------------------------------------------------------------------------- the module


def manual_module_forward(mod: CausalSelfAttention, x: torch.Tensor, divisor: float,
                          out_proj: bool = True) -> torch.Tensor:
    """The layer recomputed from its own W_Q, W_K, W_V (and W_O) with a chosen score divisor."""
    B, T, C = x.shape
    h = mod.n_head
    d_k = C // h
    W, b = mod.qkv.weight, mod.qkv.bias  # [3C, C], [3C]
    outs = []
    for head in range(h):
        rows = slice(head * d_k, (head + 1) * d_k)
        q = x @ W[:C][rows].T + b[:C][rows]
        k = x @ W[C:2 * C][rows].T + b[C:2 * C][rows]
        v = x @ W[2 * C:][rows].T + b[2 * C:][rows]
        scores = q @ k.transpose(-1, -2) / divisor
        scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), -math.inf)
        outs.append(torch.softmax(scores, -1) @ v)  # [B, T, d_k]
    y = torch.cat(outs, dim=-1)
    return mod.out_proj(y) if out_proj else y


def make_module(n_embd=32, n_head=4, block_size=16, attn=None, std=0.3):
    mod = attention_layer(n_embd, n_head, block_size, attn or AttentionConfig()).double()
    with torch.no_grad():  # larger weights than GPT's init, so that the scale matters
        for p in mod.parameters():
            p.normal_(0.0, std)
    return mod.eval()


@pytest.mark.parametrize("n_embd,n_head", [(32, 1), (32, 2), (32, 4), (48, 6), (64, 8)])
def test_module_output_shape_and_oracle(n_embd, n_head):
    mod = make_module(n_embd, n_head)
    for B, T in [(1, 1), (2, 7), (3, 16)]:
        x = torch.randn(B, T, n_embd, dtype=D)
        y, w = mod(x, return_weights=True)
        assert y.shape == (B, T, n_embd)
        assert w.shape == (B, n_head, T, T)
        # oracle: PyTorch's fused attention on the module's own projections, then W_O
        q, k, v = mod.qkv(x).split(n_embd, dim=2)
        q, k, v = (t.view(B, T, n_head, n_embd // n_head).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        expected = mod.out_proj(o.transpose(1, 2).reshape(B, T, n_embd))
        torch.testing.assert_close(y, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("n_head", [2, 4, 8])
def test_module_divides_scores_by_sqrt_d_k_not_sqrt_d_model(n_head):
    n_embd = 32
    mod = make_module(n_embd, n_head)
    assert mod.head_dim == n_embd // n_head
    assert mod.scale() == pytest.approx(1 / math.sqrt(n_embd / n_head), rel=1e-15)
    x = torch.randn(2, 10, n_embd, dtype=D)
    y, _ = mod(x)
    right = manual_module_forward(mod, x, math.sqrt(n_embd / n_head))
    wrong = manual_module_forward(mod, x, math.sqrt(n_embd))
    torch.testing.assert_close(y, right, atol=ATOL, rtol=0)
    assert (y - wrong).abs().max() > 1e-3, "sqrt(d_k) and sqrt(d_model) should give different outputs"


def test_scale_pitfall_variants_use_their_divisor():
    n_embd, n_head = 32, 4
    x = torch.randn(2, 6, n_embd, dtype=D)
    for scale, divisor in [(Scale.d_model, math.sqrt(n_embd)), (Scale.none, 1.0)]:
        mod = make_module(n_embd, n_head, attn=AttentionConfig(scale=scale), std=0.1)
        torch.testing.assert_close(mod(x)[0], manual_module_forward(mod, x, divisor), atol=ATOL, rtol=0)


def test_output_projection_exists_and_changes_the_output():
    mod = make_module(32, 4)
    assert isinstance(mod.out_proj, torch.nn.Linear)
    assert mod.out_proj.weight.shape == (32, 32)
    x = torch.randn(2, 5, 32, dtype=D)
    y0, _ = mod(x)
    with torch.no_grad():
        mod.out_proj.weight.add_(torch.randn_like(mod.out_proj.weight))
    y1, _ = mod(x)
    assert (y0 - y1).abs().max() > 1e-3
    # it is the only place heads mix: without W_O, output = concatenated heads
    no_wo = make_module(32, 4, attn=AttentionConfig(out_proj=False))
    assert isinstance(no_wo.out_proj, torch.nn.Identity) and not list(no_wo.out_proj.parameters())
    torch.testing.assert_close(no_wo(x)[0], manual_module_forward(no_wo, x, math.sqrt(8), out_proj=False),
                               atol=ATOL, rtol=0)


@pytest.mark.parametrize("n_embd,n_head", [(30, 4), (32, 3), (10, 20)])
def test_indivisible_heads_fail_a_clear_assertion(n_embd, n_head):
    with pytest.raises(AssertionError, match=rf"d_model \({n_embd}\) must be divisible by the number of heads \({n_head}\)"):
        CausalSelfAttention(n_embd, n_head, 8, AttentionConfig())


def test_module_with_cache_matches_full_pass():
    mod = make_module(32, 4, block_size=12)
    x = torch.randn(2, 12, 32, dtype=D)
    full, _ = mod(x)
    cache = KVCache(1, 2, 4, 12, 8, dtype=D)
    pieces = []
    for a, b in [(0, 5), (5, 6), (6, 9), (9, 12)]:  # a prompt, then one token, then chunks
        y, _ = mod(x[:, a:b], cache=cache, layer=0)
        cache.advance(b - a)
        pieces.append(y)
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=ATOL, rtol=0)


# ----------------------------------------------------------------------------- query blocks


@pytest.mark.parametrize("T,block", [(16, 4), (16, 5), (17, 16), (9, 1), (16, 15)])
def test_query_blocks_match_one_pass_and_the_oracle_with_gradients(T, block):
    """The block path (rows in blocks, each over its visible key prefix) is the same function:
    outputs and every gradient equal the one-pass layer's, and SDPA's output."""
    one_pass = make_module(32, 4, block_size=T, attn=AttentionConfig(query_block=0)).train()
    blocked = make_module(32, 4, block_size=T, attn=AttentionConfig(query_block=block)).train()
    blocked.load_state_dict(one_pass.state_dict())
    x = torch.randn(3, T, 32, dtype=D, requires_grad=True)
    grad_out = torch.randn(3, T, 32, dtype=D)
    results = []
    for mod in (one_pass, blocked):
        y, w = mod(x)
        assert w is None or mod is one_pass
        grads = torch.autograd.grad(y, [x, *mod.parameters()], grad_out)
        results.append((y, grads))
    torch.testing.assert_close(results[1][0], results[0][0], atol=ATOL, rtol=0)
    for g_blocked, g_one in zip(results[1][1], results[0][1]):
        torch.testing.assert_close(g_blocked, g_one, atol=ATOL, rtol=0)
    with torch.no_grad():
        q, k, v = blocked.qkv(x).split(32, dim=2)
        q, k, v = (t.view(3, T, 4, 8).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        oracle = blocked.out_proj(o.transpose(1, 2).reshape(3, T, 32))
    torch.testing.assert_close(results[1][0], oracle, atol=ATOL, rtol=0)


def test_query_blocks_with_a_cache_match_the_full_pass():
    """Right-aligned blocks: n new queries after a cached prefix see the prefix and their past."""
    mod = make_module(32, 4, block_size=20, attn=AttentionConfig(query_block=3))
    x = torch.randn(2, 20, 32, dtype=D)
    reference_mod = make_module(32, 4, block_size=20, attn=AttentionConfig(query_block=0))
    reference_mod.load_state_dict(mod.state_dict())
    full, _ = reference_mod(x)
    cache = KVCache(1, 2, 4, 20, 8, dtype=D)
    pieces = []
    for a, b in [(0, 7), (7, 8), (8, 18), (18, 20)]:  # blocks of 3 over 7, 1, 10 and 2 queries
        y, _ = mod(x[:, a:b], cache=cache, layer=0)
        cache.advance(b - a)
        pieces.append(y)
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=ATOL, rtol=0)


@pytest.mark.parametrize("attn", [AttentionConfig(mask_value=0.0),
                                  AttentionConfig(mask_mode=MaskMode.fill, mask_value=0.0),
                                  AttentionConfig(mask_mode=MaskMode.after_softmax),
                                  AttentionConfig(mask_value=-5.0)],
                         ids=["mask_zero", "fill_zero", "after_softmax", "finite_mask"])
def test_query_blocks_never_change_a_pitfall(attn):
    """Skipping the future keys is only exact when they get weight exactly 0; the pitfalls let
    the future in, so they must take the one-pass path and keep their leak."""
    one_pass = make_module(32, 4, block_size=12, attn=replace(attn, query_block=0))
    blocked = make_module(32, 4, block_size=12, attn=replace(attn, query_block=2))
    blocked.load_state_dict(one_pass.state_dict())
    x = torch.randn(2, 12, 32, dtype=D)
    assert torch.equal(blocked(x)[0], one_pass(x)[0])
    changed = x.clone()
    changed[:, -1] += 1.0  # the last position moves; a leaky layer moves the first output too
    assert (blocked(changed)[0][:, 0] - blocked(x)[0][:, 0]).abs().max() > 1e-6


def test_kv_cache_refuses_to_overflow():
    cache = KVCache(1, 1, 2, 4, 3)
    cache.append(0, torch.zeros(1, 2, 4, 3), torch.zeros(1, 2, 4, 3))
    cache.advance(4)
    with pytest.raises(ValueError, match="holds 4 positions"):
        cache.append(0, torch.zeros(1, 2, 1, 3), torch.zeros(1, 2, 1, 3))


def test_attention_config_is_causal_flags():
    assert AttentionConfig().is_causal()
    assert AttentionConfig(mask_mode=MaskMode.fill).is_causal()
    assert not AttentionConfig(mask_value=0.0).is_causal()
    assert not AttentionConfig(mask_mode=MaskMode.fill, mask_value=0.0).is_causal()
    assert not AttentionConfig(mask_mode=MaskMode.after_softmax).is_causal()
