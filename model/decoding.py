"""Generating one token at a time: the next token's logits for a sequence that grows by one.

With the KV cache each step runs the model on the new token alone, reading the keys and values
of the earlier ones from the cache. When the context is full, the cache is refilled from the
last half of the context: the cached keys carry their positions (rotated by RoPE, or with a
learned position embedding added), so they cannot simply be shifted to new ones. Without the
cache each step reruns the whole cropped context, as nanoGPT does.

A batch of prompts of different lengths is decoded together left-padded to one length, with
`pad` [B] counting each row's pad tokens: the cache hides a row's pad keys and counts its
positions from its first real token, so each row decodes as its prompt alone would (while the
longest row fits the context: past it the whole batch is refilled at once).

On a GPU a small model's one-token step is a few hundred tiny kernels, and launching them costs
more than running them. With a static cache every step has the same shapes, so the step is
recorded once as a CUDA graph and then replayed with a single launch (`CapturedStep`).
"""
from __future__ import annotations

from typing import Optional

import torch

from model.attention import KVCache


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
            self.model.blocks[0].attn.new_sequence(self.cache)  # (a pitfall keeps the keys)
            self.cache.pad = pad

    def next_logits(self, context: torch.Tensor) -> torch.Tensor:
        block = self.model.cfg.block_size
        if self.cache is None:
            return self.model(context[:, -block:])[0][:, -1]
        t = context.size(1)
        pending = context[:, self.fed:]  # [B, new tokens]
        if self.cache.length + pending.size(1) > block:
            # full: refill from the whole context if it fits, else its last half, leaving room
            # to grow; a row's pads among the tokens left behind are gone too
            pending = context if t < block else context[:, -max(block // 2, 1):]
            self.cache.reset()
            if self.pad is not None:
                self.cache.pad = (self.pad - (t - pending.size(1))).clamp_min(0)
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
