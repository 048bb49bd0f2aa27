"""Generating one token at a time: the KV cache, and the next token's logits for a sequence that
grows by one.

With the KV cache each step runs the model on the new token alone, reading the keys and values
of the earlier ones from the cache, which keeps the books that go with them: the new tokens'
positions, the keys they may see, the reset between sequences. When the context is full, the
cache is refilled from the last half of the context: the cached keys carry their positions
(rotated by RoPE, or with a learned position embedding added), so they cannot simply be shifted
to new ones. Without the cache each step reruns the whole cropped context, as nanoGPT does.

A batch of prompts of different lengths is decoded left-padded, `pad` [B] counting each row's
pad tokens: the cache hides them and counts positions from each row's first real token, so a
row decodes as its prompt alone would (docs/sampling.md says when the batch refills). On a GPU
a small model's one-token step is a few hundred tiny kernels, costlier to launch than to run, so
with a static cache it is recorded once as a CUDA graph and replayed (`CapturedStep`).
"""
from __future__ import annotations

from typing import Optional

import torch

from model.attention import visible_keys
from model.config import AttentionConfig
from model.pitfalls import PitfallCacheSteps


class KVCache:
    """Keys and values of the positions already seen, preallocated up to the context length.

    One cache holds every layer: k, v are [n_layer, B, h_kv, max_len, d_k], with the model's
    key/value heads only (grouped-query attention stores n_head / n_kv_head times less).
    Writing into a fixed buffer (instead of concatenating) keeps each generation step O(T) with
    no reallocation. `pad` [B]: each row's left-pad tokens in a batch of prompts of different
    lengths, its first real token at slot pad[b]. `window`: the model's sliding window
    (model.window); `attn`: its variant (what a PitfallCache's steps read).

    Growing (the default): each pass writes its n new positions after the `length` filled ones
    and attends over that prefix. Static (`static=True`): the write position is a device tensor
    and every step attends over the whole buffer, its unfilled tail masked (weight exactly 0: the
    same tokens), so the shapes never change and a step can be a CUDA graph (`CapturedStep`).
    """

    def __init__(self, n_layer: int, batch: int, kv_heads: int, max_len: int, head_dim: int,
                 device=None, dtype=torch.float32, static: bool = False,
                 window: Optional[int] = None, attn: Optional[AttentionConfig] = None):
        shape = (n_layer, batch, kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.max_len, self.static, self.window, self.attn = max_len, static, window, attn
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
        (static: `visible` hides the unfilled slots)."""
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

    def reset(self, pad: Optional[torch.Tensor] = None) -> None:
        """Empty the cache for a sequence whose rows are left-padded by `pad` [B] (None: none),
        keeping its buffers (a captured decode step stays valid)."""
        self.length = 0
        self.position.zero_()
        self.pad = pad

    # ------------------------------------------------------------ the steps a pitfall replaces

    def positions(self, T: int) -> torch.Tensor:
        """[T] the positions of the next T tokens, after the cached ones (counted on the device,
        so that a captured decode step replays it); [B, T] in a padded batch, each row's from its
        first real token (a pad's, negative, clamped to 0: its key is never seen)."""
        first = self.position if self.pad is None else self.position - self.pad[:, None]
        return (torch.arange(T, device=self.position.device) + first).clamp_min(0)

    def visible(self, T: int) -> Optional[torch.Tensor]:
        """The keys T new queries may see: None where the layers' own causal pattern is it (a
        growing cache of unpadded rows), else [T, m] (a static cache: its unfilled slots hidden)
        or [B, 1, T, m] (a left-padded batch: each row's pads hidden)."""
        if self.pad is None and not self.static:
            return None
        return self.pattern(self.slots(T), self.key_slots(T), self.pad)

    def pattern(self, slots: torch.Tensor, m: int, pad: Optional[torch.Tensor]) -> torch.Tensor:
        """The keys the queries in `slots` may see (`visible_keys`): the window's, no pad key."""
        return visible_keys(slots, m, self.window_size(), pad)

    def window_size(self) -> Optional[int]:
        return self.window

    # Before a new sequence is decoded: the cache emptied of the last one's keys (a refill past
    # the context empties it by `reset` whatever the variant)
    new_sequence = reset


class PitfallCache(PitfallCacheSteps, KVCache):
    """The cache with a classic mistake: model/pitfalls.py's cache steps in place of the correct
    ones it breaks, this file's code everywhere else (GPT.new_cache builds it)."""


class Decoder:
    """Next-token logits [B, V] for a context [B, t] that grows between calls; pad [B]: the
    left-pad tokens of each row of a batch of prompts (None: none)."""

    def __init__(self, model, batch: int, use_cache: bool = True, static: bool = False,
                 pad: Optional[torch.Tensor] = None):
        if pad is not None and not use_cache:
            raise ValueError("a left-padded batch is decoded through the KV cache (use_cache)")
        self.model = model
        self.cache: Optional[KVCache] = model.new_cache(batch, static=static) if use_cache else None
        self.fed = 0  # tokens of the context the cache holds keys and values for
        self.captured: Optional[CapturedStep] = None
        self.restart(pad)

    def restart(self, pad: Optional[torch.Tensor] = None) -> None:
        """Forget the context: the next call starts a new sequence (the buffers, and a captured
        step, are kept for it), its rows left-padded by `pad`."""
        self.fed, self.pad = 0, pad
        if self.cache is not None:
            self.cache.new_sequence(pad)  # (a pitfall keeps the keys)

    def next_logits(self, context: torch.Tensor) -> torch.Tensor:
        block = self.model.cfg.block_size
        if self.cache is None:
            return self.model(context[:, -block:])[0][:, -1]
        t = context.size(1)
        pending = context[:, self.fed:]  # [B, new tokens]
        if self.cache.length + pending.size(1) > block:
            # full: refill from the whole context if it fits, else its last half (room to grow)
            pending = context if t < block else context[:, -max(block // 2, 1):]
            gone = t - pending.size(1)  # tokens left behind: a row's pads among them go too
            self.cache.reset(None if self.pad is None else (self.pad - gone).clamp_min(0))
        self.fed = t
        if (pending.size(1) == 1 and self.cache.static and context.device.type == "cuda"
                and self.cache.pad is None):  # (a padded batch's step reads its pads: uncaptured)
            if self.captured is None:
                self.captured = CapturedStep(self.model, self.cache)
            return self.captured(pending)
        return self.model(pending, cache=self.cache)[0][:, -1]


class CapturedStep:
    """The one-token decode step over a static KV cache, recorded once as a CUDA graph.

    The graph reads its input token from a fixed buffer and writes the logits into another;
    the cache's write position is a device tensor that the graph itself advances. Only the
    host's count of filled positions is kept up to date here.
    """

    def __init__(self, model, cache: KVCache):
        self.cache = cache
        self.token = torch.zeros(cache.k.size(1), 1, dtype=torch.long, device=cache.k.device)
        length, position = cache.length, cache.position.clone()
        # warm-up runs (lazy initialisation, library handles) must happen outside the graph,
        # on a side stream; each is undone so the cache is as it was
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                model(self.token, cache=cache)
                cache.length = length
                cache.position.copy_(position)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = model(self.token, cache=cache)[0][:, -1]  # [B, V], a fixed buffer
        cache.length = length  # capturing records the kernels without running them

    def __call__(self, token: torch.Tensor) -> torch.Tensor:
        self.token.copy_(token)
        self.graph.replay()
        self.cache.length += 1
        return self.logits
