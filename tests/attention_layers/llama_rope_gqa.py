"""A Llama-style attention layer: rotary positions on q and k (rotate-half pairs, theta kept as an
attribute), grouped-query attention (n_kv_heads key/value heads shared by groups of query heads;
4 query heads read 2 key/value heads by default), separate projections without biases. Built as
LlamaAttention(d_model, n_heads). Subclasses: correct variations (QK-norm, interleaved pairs,
multi-query) and the second study's mistakes (values rotated, query heads reading another
group's keys; a custom backward that is not the forward's derivative).

Test material for tests/test_check_modern.py; not part of the package.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F


class LlamaAttention(nn.Module):
    rope_on_values = False   # mistake: v turned by its position too
    tiled_groups = False     # mistake: query head i reads kv head i % n_kv (another group's)
    interleaved = False      # pairs (2j, 2j + 1) instead of (j, j + d/2): correct if used alike
    qk_norm = False          # RMSNorm of each head's q and k

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int | None = None,
                 rope_theta: float = 10000.0):
        super().__init__()
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads or max(1, n_heads // 2)
        self.head_dim = d_model // n_heads
        self.rope_theta = rope_theta
        kv_width = self.n_kv_heads * self.head_dim
        self.q_proj = nn.Linear(d_model, d_model, bias=False)
        self.k_proj = nn.Linear(d_model, kv_width, bias=False)
        self.v_proj = nn.Linear(d_model, kv_width, bias=False)
        self.o_proj = nn.Linear(d_model, d_model, bias=False)
        if self.qk_norm:
            self.q_norm = nn.RMSNorm(self.head_dim, eps=1e-6)
            self.k_norm = nn.RMSNorm(self.head_dim, eps=1e-6)
            with torch.no_grad():  # gains away from 1, so that reading them matters
                self.q_norm.weight.uniform_(0.5, 1.5)
                self.k_norm.weight.uniform_(0.5, 1.5)

    def rotate(self, t: torch.Tensor) -> torch.Tensor:
        """t [B, heads, T, d] turned by each position's angles."""
        T, d = t.shape[-2], t.shape[-1]
        freqs = self.rope_theta ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)  # [d/2]
        angle = torch.arange(T, dtype=torch.float32)[:, None] * freqs[None, :]        # [T, d/2]
        cos, sin = angle.cos().to(t.dtype), angle.sin().to(t.dtype)
        if self.interleaved:
            a, b = t[..., 0::2], t[..., 1::2]
            return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)
        a, b = t[..., : d // 2], t[..., d // 2:]
        return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotate(q), self.rotate(k)
        if self.rope_on_values:
            v = self.rotate(v)
        group = self.n_heads // self.n_kv_heads
        if self.tiled_groups:  # [k0, k1, k0, k1]: head 1 reads kv head 1, not 0
            k, v = k.repeat(1, group, 1, 1), v.repeat(1, group, 1, 1)
        else:                  # [k0, k0, k1, k1]: heads 0, 1 read kv head 0
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        y = self.attend(q, k, v)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, D))

    def attend(self, q, k, v):  # each [B, n_heads, T, head_dim]
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class QKNorm(LlamaAttention):
    qk_norm = True


class Interleaved(LlamaAttention):
    interleaved = True


class MultiQuery(LlamaAttention):
    def __init__(self, d_model: int, n_heads: int):
        super().__init__(d_model, n_heads, n_kv_heads=1)


class RopeOnValues(LlamaAttention):
    rope_on_values = True


class TiledGroups(LlamaAttention):
    tiled_groups = True


class MixedPairs(LlamaAttention):
    """q turned with rotate-half pairs, k with interleaved ones: no longer relative positions,
    and no variant reproduces it."""

    def rotate(self, t):
        self.interleaved = t.shape[1] != self.n_heads  # k and v have n_kv_heads heads
        return super().rotate(t)


class Theta500k(LlamaAttention):
    """Llama 3's theta, 500,000."""

    def __init__(self, d_model: int, n_heads: int):
        super().__init__(d_model, n_heads, rope_theta=500000.0)


class FromConfig(LlamaAttention):
    """Built from a config object, as a model's blocks are: config.n_kv_heads, config.rope_theta."""

    def __init__(self, config):
        super().__init__(config.dim, config.n_heads, config.n_kv_heads, config.rope_theta)


class QKLayerNorm(LlamaAttention):
    """QK-norm as a LayerNorm (with a bias) of each head's q and k."""

    def __init__(self, d_model: int, n_heads: int):
        super().__init__(d_model, n_heads)
        self.qk_norm = True
        self.q_norm, self.k_norm = nn.LayerNorm(self.head_dim), nn.LayerNorm(self.head_dim)
        with torch.no_grad():
            for norm in (self.q_norm, self.k_norm):
                norm.weight.uniform_(0.5, 1.5), norm.bias.uniform_(-0.5, 0.5)


class FusedQKV(LlamaAttention):
    """q, k and v from one Linear of d_model + 2 n_kv_heads d_k rows (as Phi-3 and our model)."""

    def __init__(self, d_model: int, n_heads: int):
        super().__init__(d_model, n_heads)
        kv_width = self.n_kv_heads * self.head_dim
        del self.q_proj, self.k_proj, self.v_proj
        self.qkv_proj = nn.Linear(d_model, d_model + 2 * kv_width, bias=True)
        self.q_proj = lambda x: self.qkv_proj(x)[..., :d_model]
        self.k_proj = lambda x: self.qkv_proj(x)[..., d_model:d_model + kv_width]
        self.v_proj = lambda x: self.qkv_proj(x)[..., d_model + kv_width:]


class HiddenTheta(LlamaAttention):
    """Qwen's theta, 1,000,000, where the checker cannot read it (a class attribute): fitted."""
    rope_theta = 1000000.0

    def __init__(self, d_model: int, n_heads: int):
        super().__init__(d_model, n_heads)
        del self.rope_theta  # the class's value from now on


class WrongBackward(LlamaAttention):
    """Right forward, wrong backward: wrong_backward.py's custom autograd.Function (the softmax
    Jacobian's second term forgotten) after rotary positions and the kv heads' repeat."""

    def attend(self, q, k, v):
        from wrong_backward import Attention
        T = q.size(-2)
        return Attention.apply(q, k, v, torch.ones(T, T, dtype=torch.bool, device=q.device).tril())
