"""A decoder-only transformer (GPT): embeddings, pre-LayerNorm blocks, tied LM head."""
from __future__ import annotations

import contextlib
import math
from typing import Iterator, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.attention import CausalSelfAttention, KVCache
from model.config import Activation, AttentionConfig, ModelConfig
from model.decoding import Decoder
from model.sampling import sample_next


class MLP(nn.Module):
    """Position-wise feed-forward: d_model -> mlp_ratio * d_model -> d_model."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, cfg.mlp_ratio * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)
        # exact erf GELU, or GPT-2's tanh approximation (for weights trained with it)
        tanh = Activation(cfg.activation) is Activation.gelu_tanh
        self.approximate = "tanh" if tanh else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x), approximate=self.approximate)))


class Block(nn.Module):
    """x + attn(ln(x)), then x + mlp(ln(x)): pre-LN keeps the residual path an identity."""

    def __init__(self, cfg: ModelConfig, attn: AttentionConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg.n_embd, cfg.n_head, cfg.block_size, attn,
                                        dropout=cfg.dropout, bias=cfg.bias,
                                        attn_dropout=cfg.attn_dropout)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x, cache: Optional[KVCache] = None, layer: int = 0, return_weights=False):
        a, weights = self.attn(self.ln_1(x), cache, layer, return_weights)
        x = x + a
        x = x + self.mlp(self.ln_2(x))
        return x, weights


class GPT(nn.Module):
    """idx [B, T] token ids -> logits [B, T, vocab_size] (and the mean cross-entropy loss)."""

    def __init__(self, cfg: ModelConfig, vocab_size: int, attn: Optional[AttentionConfig] = None):
        super().__init__()
        attn = attn if attn is not None else AttentionConfig()
        self.cfg, self.attn_cfg, self.vocab_size = cfg, attn, vocab_size
        self.tok_emb = nn.Embedding(vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, attn) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight  # tied: one matrix reads and writes tokens
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 init: weights N(0, init_std), biases 0, LayerNorm (1, 0); the projections that
        write into the residual stream use init_std / sqrt(2 * n_layer), since each layer adds two
        such terms to it. W_Q and W_K may get their own std (attention.qk_init_std)."""
        std = self.cfg.init_std
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, 0.0, std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, 0.0, std)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        resid_std = std / math.sqrt(2 * self.cfg.n_layer)
        for block in self.blocks:
            nn.init.normal_(block.mlp.proj.weight, 0.0, resid_std)
            if block.attn.out_proj is not None:
                nn.init.normal_(block.attn.out_proj.weight, 0.0, resid_std)
            if self.attn_cfg.qk_init_std is not None:
                d = self.cfg.n_embd
                nn.init.normal_(block.attn.qkv.weight[: 2 * d], 0.0, self.attn_cfg.qk_init_std)

    def num_params(self, positions: bool = True) -> int:
        """Parameters (the tied token embedding / head counted once); with positions=False,
        without the position embeddings: the N of 6N FLOPs per token, which counts the token
        embedding as the head's matmul."""
        n = sum(p.numel() for p in self.parameters())
        return n if positions else n - self.pos_emb.weight.numel()

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None,
                cache: Optional[KVCache] = None, return_weights: bool = False):
        """Returns (logits, loss); loss is None without targets. With return_weights, a third
        item lists each layer's attention weights [B, h, T, m]."""
        B, T = idx.shape
        start = cache.length if cache is not None else 0
        if start + T > self.cfg.block_size:
            raise ValueError(f"sequence of {start + T} tokens exceeds block_size {self.cfg.block_size}")
        pos = torch.arange(T, device=idx.device)  # [T] positions, after the cached ones
        if cache is not None:
            pos = pos + cache.position  # read on the device: a captured decode step replays it
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))  # [B, T, d_model]
        all_weights = []
        for layer, block in enumerate(self.blocks):
            x, weights = block(x, cache, layer, return_weights)
            all_weights.append(weights)
        if cache is not None:
            cache.advance(T)
        x = self.ln_f(x)
        logits = self.lm_head(x)  # [B, T, vocab_size]
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
        return (logits, loss, all_weights) if return_weights else (logits, loss)

    @contextlib.contextmanager
    def attention_variant(self, attn: AttentionConfig) -> Iterator[None]:
        """Temporarily run every layer with another masking rule (the causal evaluation)."""
        saved = [block.attn.attn for block in self.blocks]
        for block in self.blocks:
            block.attn.attn = attn
        try:
            yield
        finally:
            for block, old in zip(self.blocks, saved):
                block.attn.attn = old

    def new_cache(self, batch: int, device=None, dtype=None, static: bool = False) -> KVCache:
        p = self.tok_emb.weight
        return KVCache(self.cfg.n_layer, batch, self.cfg.n_head, self.cfg.block_size,
                       self.cfg.head_dim, device or p.device, dtype or p.dtype, static=static)

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: Optional[int] = None, top_p: Optional[float] = None,
                 generator: Optional[torch.Generator] = None, greedy: bool = False,
                 use_cache: bool = True, static_cache: Optional[bool] = None
                 ) -> Iterator[torch.Tensor]:
        """Yield [B, 1] new token ids one at a time (so callers can stream them).

        use_cache: run each step on the new token alone, with a KV cache (model/decoding.py).
        static_cache: a cache whose steps all have the same shapes, so that on CUDA the
        one-token step runs as a captured CUDA graph; None = on for CUDA with the correct
        attention. The tokens are the same either way.
        """
        if static_cache is None:
            static_cache = idx.device.type == "cuda" and self.attn_cfg.is_causal()
        was_training = self.training
        self.eval()
        decoder = Decoder(self, idx.size(0), use_cache, static_cache)
        context = idx
        try:
            for _ in range(max_new_tokens):
                logits = decoder.next_logits(context)  # [B, vocab_size]
                token = sample_next(logits, temperature, top_k, top_p, generator, greedy)
                context = torch.cat([context, token], dim=1)
                yield token
        finally:
            self.train(was_training)
