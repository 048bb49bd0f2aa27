"""The classic attention mistakes, each as the one step of the correct code that it replaces.

`conf/attention/*.yaml` names them; each is a diff on `AttentionConfig` (model/config.py). For
one, `attention_layer` (model/attention.py) builds a `PitfallAttention`: the methods of
`PitfallSteps` below in place of the correct layer's steps, and every other line the correct
layer's own, so that a pitfall's effect on training is measured with the very same code; and
GPT.new_cache builds a `PitfallCache` (model/decoding.py) the same way, from `PitfallCacheSteps`:
the mistakes of the KV cache's bookkeeping, which training never runs.

    the layer's step         the correct layer (model/attention.py)      the pitfalls
    split_heads              view(B, T, h, d_k).transpose(1, 2)          split_heads_no_transpose
    scale                    1 / sqrt(d_k)                               scale: d_model, none
    masked_softmax           softmax(scores + M) over the keys,          mask_mode, mask_value,
                             M = 0 / -inf                                softmax_over_queries
    make_out_proj            W_O                                         out_proj: false
    rotate                   RoPE on q and k, rotate-half pairs          rope_on_values,
                                                                         rotary_interleaved
    visible                  the causal pattern, right-aligned           upper_left_mask
    window_size              w keys, the query's own included            window_off_by_one
    attend (kv heads)        query head i reads kv head i // g           gqa_repeat_mismatch

    the cache's step         the correct cache (model/decoding.py)       the pitfalls
    positions                after the cached tokens, from each row's    cache_positions_restart,
                             first real token                            left_pad_positions
    window_size              the layer's: w keys                         window_off_by_one
    pattern                  no pad key                                  pad_keys_visible
    visible                  each query's own window                     window_cache_trim
    new_sequence             the cache emptied                           cache_not_reset

The layer's steps read its config at each call, so GPT.attention_variant can swap a trained
pitfall for its causal variant (train.py's causal evaluation).
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn as nn

from model.config import AttentionConfig, MaskMode, Scale
from model.rotary import apply_rotary, apply_rotary_interleaved


def _add(scores, visible, value, dim=-1):
    """M added before softmax, with `value` where the correct layer has -inf (0: no mask)."""
    M = torch.zeros(visible.shape, dtype=scores.dtype, device=scores.device)
    return torch.softmax(scores + M.masked_fill_(~visible, value), dim=dim)


def _fill(scores, visible, value, dim=-1):
    """Future scores set to `value` before softmax: a filled 0 still competes (exp(0) = 1)."""
    return torch.softmax(scores.masked_fill(~visible, value), dim=dim)


def _after_softmax(scores, visible, value, dim=-1):
    """Softmax over every key, then the future weights zeroed: rows no longer sum to 1."""
    return torch.softmax(scores, dim=dim).masked_fill(~visible, 0.0)


# How the boolean pattern (True = may attend) meets the scores: steps 3 and 4 of the equation.
MASK_MODES: dict[MaskMode, Callable] = {
    MaskMode.add: _add, MaskMode.fill: _fill, MaskMode.after_softmax: _after_softmax}


def masked_softmax(mode: MaskMode, value: float, dim: int = -1) -> Callable:
    """Steps 3 and 4 as `mode` and `value` say, for scaled_dot_product_attention's
    `masked_softmax`: (scores [..., n, m], boolean mask or None) -> weights. dim=-2: the
    softmax over the queries (softmax_over_queries), where the keys' axis, -1, belongs."""
    def step(scores: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        if mask is None:
            return torch.softmax(scores, dim=dim)
        return MASK_MODES[MaskMode(mode)](scores, mask, value, dim)
    return step


def replaces_a_step(attn: AttentionConfig) -> bool:
    """True when `attn` is not the correct attention: some step above is a pitfall's. (fill with
    -inf is the correct mask, written another way; impl, query_block, qk_init_std and the name
    do not change what a layer computes.)"""
    return not attn.is_correct() or Scale(attn.scale) is not Scale.d_k or not attn.out_proj


class PitfallSteps:
    """The steps of CausalSelfAttention that the pitfalls replace (see the module docstring);
    each falls back to the correct step when its switch is off."""

    def split_heads(self, t):
        if not self.attn.split_heads_no_transpose:
            return super().split_heads(t)
        # [B, T, n * d_k] read as [B, n, T, d_k] (x.view(B, h, T, d_k) of a contiguous x):
        # "position" t of head i is a d_k-slice of position (i * T + t) // n, later than t for
        # most of the heads
        return t.reshape(t.size(0), -1, t.size(1), self.head_dim)

    def scale(self) -> float:
        d_model = self.n_head * self.head_dim
        return {Scale.d_k: 1.0 / math.sqrt(self.head_dim),
                Scale.d_model: 1.0 / math.sqrt(d_model),  # softmax too flat by sqrt(n_head)
                Scale.none: 1.0}[Scale(self.attn.scale)]   # softmax saturates as d_k grows

    def masked_softmax(self, scores, mask):
        # over the queries: each key's column sums to 1, a query's weights then depend on the
        # scores of the later queries (the denominator), and a row no longer sums to 1
        dim = -2 if self.attn.softmax_over_queries else -1
        return masked_softmax(self.attn.mask_mode, self.attn.mask_value, dim)(scores, mask)

    def make_out_proj(self, n_embd: int, bias: bool) -> nn.Module:
        # no W_O: the concatenated heads go straight to the residual stream (no parameters)
        return super().make_out_proj(n_embd, bias) if self.attn.out_proj else nn.Identity()

    def rotate(self, q, k, v, cos, sin):
        # interleaved: pairs (2j, 2j + 1) where the weights expect rotate-half (j, j + d_k / 2)
        turn = apply_rotary_interleaved if self.attn.rotary_interleaved else apply_rotary
        q, k = turn(q, cos, sin), turn(k, cos, sin)
        # on values: outputs then carry each key's absolute position
        return q, k, turn(v, cos, sin) if self.attn.rope_on_values else v

    def visible(self, T, m, mask):
        if self.attn.upper_left_mask:
            # SDPA's is_causal alignment, query i sees keys 0..i whatever the cache holds: the
            # same pattern when T == m (training), one key for a decoded token
            return self.causal[:T, :m]
        return super().visible(T, m, mask)

    def window_size(self):
        # j >= s - w where j > s - w belongs: w + 1 keys
        off_by_one = self.attn.window_off_by_one and self.window is not None
        return self.window + 1 if off_by_one else self.window

    def attend(self, q, k, v, mask, return_weights=False):
        h, h_kv = self.n_head, k.size(1)
        if self.attn.gqa_repeat_mismatch and h_kv < h:
            # the kv heads tiled (query head i reads kv head i % h_kv) where each one belongs
            # to its g = h / h_kv consecutive query heads (i // g, repeat_kv)
            k, v = k.repeat(1, h // h_kv, 1, 1), v.repeat(1, h // h_kv, 1, 1)  # [B, h, m, d_k]
        return super().attend(q, k, v, mask, return_weights)


class PitfallCacheSteps:
    """The steps of KVCache that the pitfalls replace (the second table above), read from the
    variant the cache was built for; each falls back to the correct step when its switch is off."""

    window_size = PitfallSteps.window_size  # the layer's own step: its w + 1 keys here too

    def positions(self, T):
        new = torch.arange(T, device=self.position.device)  # [T]
        if self.attn.cache_positions_restart:  # from 0, ignoring the cached tokens before them
            return new
        if self.attn.left_pad_positions:  # pads counted: row b's tokens sit pad[b] positions late
            return new + self.position
        return super().positions(T)

    def pattern(self, slots, m, pad):
        # pad keys visible: the pattern of an unpadded batch
        return super().pattern(slots, m, None if self.attn.pad_keys_visible else pad)

    def visible(self, T):
        if not (self.attn.window_cache_trim and self.window is not None):
            return super().visible(T)
        # the cache keeps the last w keys before the chunk attends: the window of the chunk's
        # last query for all of them (one token at a time, the same as each query's own)
        slots, m = self.slots(T), self.key_slots(T)
        kept = torch.arange(m, device=slots.device) > slots[-1] - self.window  # [m]
        return self.pattern(slots, m, self.pad) & kept

    def new_sequence(self, pad=None):
        # not reset: the next sequence is appended after the last one's keys, and sees them
        if self.attn.cache_not_reset:
            self.pad = pad
        else:
            super().new_sequence(pad)
