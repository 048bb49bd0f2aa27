"""A student's adapters file for Stanford CS336 (assignment 1), the three attention adapters with
the course's signatures: weights [d_out, d_in], in_features [..., seq, d_in], masks boolean with
True = may attend, rotary pairs adjacent (2j, 2j + 1) as the handout writes them. The `_wrong`
functions take the same parameters and make one mistake each, as does `_no_transpose`.

Test material for tests/test_check_modern.py and test_check_attention_causes.py; not part of
the package.
"""
import math

import torch


def run_scaled_dot_product_attention(Q, K, V, mask=None):
    """Q [..., n, d_k], K [..., m, d_k], V [..., m, d_v], mask [..., n, m] (True = attend)."""
    scores = Q @ K.transpose(-2, -1) / math.sqrt(Q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ V


def _heads(t, num_heads):  # [..., seq, d] -> [..., heads, seq, d / heads]
    return t.unflatten(-1, (num_heads, -1)).transpose(-3, -2)


def _rope(t, theta, positions):  # t [..., heads, seq, d]; positions [..., seq]
    d = t.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float32, device=t.device) / d)
    angle = positions.to(torch.float32)[..., None, :, None] * inv  # [..., 1, seq, d/2]
    cos, sin = angle.cos().to(t.dtype), angle.sin().to(t.dtype)
    even, odd = t[..., 0::2], t[..., 1::2]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)


def _attention(d_model, num_heads, wq, wk, wv, wo, x, theta=None, positions=None, divide=None):
    seq = x.shape[-2]
    q, k, v = (_heads(x @ w.T, num_heads) for w in (wq, wk, wv))
    if theta is not None:
        if positions is None:
            positions = torch.arange(seq, device=x.device)
        q, k = _rope(q, theta, positions), _rope(k, theta, positions)
    if divide is not None:  # the mistake: scores scaled by another divisor (CS336's d_model)
        q = q * math.sqrt(q.shape[-1]) / math.sqrt(divide)
    causal = torch.ones(seq, seq, dtype=torch.bool, device=x.device).tril()
    y = run_scaled_dot_product_attention(q, k, v, causal)
    return y.transpose(-3, -2).flatten(-2) @ wo.T


def run_multihead_self_attention(d_model, num_heads, q_proj_weight, k_proj_weight,
                                 v_proj_weight, o_proj_weight, in_features):
    return _attention(d_model, num_heads, q_proj_weight, k_proj_weight, v_proj_weight,
                      o_proj_weight, in_features)


def run_multihead_self_attention_with_rope(d_model, num_heads, max_seq_len, theta, q_proj_weight,
                                           k_proj_weight, v_proj_weight, o_proj_weight,
                                           in_features, token_positions=None):
    return _attention(d_model, num_heads, q_proj_weight, k_proj_weight, v_proj_weight,
                      o_proj_weight, in_features, theta, token_positions)


def run_multihead_self_attention_wrong(d_model, num_heads, q_proj_weight, k_proj_weight,
                                       v_proj_weight, o_proj_weight, in_features):
    """Scores divided by sqrt(d_model) instead of sqrt(d_k)."""
    return _attention(d_model, num_heads, q_proj_weight, k_proj_weight, v_proj_weight,
                      o_proj_weight, in_features, divide=d_model)


def run_multihead_self_attention_with_rope_wrong(d_model, num_heads, max_seq_len, theta,
                                                 q_proj_weight, k_proj_weight, v_proj_weight,
                                                 o_proj_weight, in_features,
                                                 token_positions=None):
    """Rotary positions on the values too."""
    seq = in_features.shape[-2]
    positions = torch.arange(seq) if token_positions is None else token_positions
    q, k, v = (_heads(in_features @ w.T, num_heads)
               for w in (q_proj_weight, k_proj_weight, v_proj_weight))
    q, k, v = (_rope(t, theta, positions) for t in (q, k, v))
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    y = run_scaled_dot_product_attention(q, k, v, causal)
    return y.transpose(-3, -2).flatten(-2) @ o_proj_weight.T



def run_multihead_self_attention_with_rope_no_transpose(d_model, num_heads, max_seq_len, theta,
                                                        q_proj_weight, k_proj_weight,
                                                        v_proj_weight, o_proj_weight,
                                                        in_features, token_positions=None):
    """Heads split by .view(..., heads, seq, d_k), without the transpose."""
    *lead, seq, _ = in_features.shape
    positions = torch.arange(seq) if token_positions is None else token_positions
    q, k, v = ((in_features @ w.T).view(*lead, num_heads, seq, d_model // num_heads)
               for w in (q_proj_weight, k_proj_weight, v_proj_weight))
    q, k = _rope(q, theta, positions), _rope(k, theta, positions)
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    y = run_scaled_dot_product_attention(q, k, v, causal)
    return y.transpose(-3, -2).flatten(-2) @ o_proj_weight.T
