"""A decoder-only transformer (GPT): embeddings, pre-norm blocks, LM head.

Each part is a switch of ModelConfig (docs/model.md): learned or rotary positions, LayerNorm or
RMSNorm, a GELU, ReLU^2 or SwiGLU MLP, grouped key/value heads, QK-norm, a gate on each head's
output, a head tied to the token embedding or not. GPT-2's architecture is one setting of them
(conf/arch/gpt2.yaml).
"""
from __future__ import annotations

import contextlib
import math
from typing import Iterator, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.attention import attention_layer
from model.config import AttentionConfig, MLPKind, ModelConfig, Norm, Positions
from model.decoding import Decoder, KVCache, PitfallCache
from model.fast_paths import relu_squared
from model.loss import choose_loss
from model.pitfalls import replaces_a_step
from model.rotary import rotary_tables
from model.sampling import sample_next


def make_norm(cfg: ModelConfig) -> nn.Module:
    """LayerNorm (GPT-2: centre, scale to unit variance, gain and bias) or RMSNorm (Llama:
    scale to unit root mean square, gain only) over the model width."""
    if Norm(cfg.norm) is Norm.rmsnorm:
        return nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.n_embd, eps=cfg.norm_eps, bias=cfg.bias)


class MLP(nn.Module):
    """Position-wise feed-forward: d_model -> hidden -> d_model.

    gelu, gelu_tanh, relu2: proj(act(fc(x))). swiglu: proj(silu(x W_gate) * (x W_up)), with
    W_gate and W_up stacked in `fc` (rows [gate | up], one matmul), as Llama's gate_proj,
    up_proj and down_proj (= proj)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.kind = MLPKind(cfg.mlp)
        hidden = cfg.hidden
        gated = self.kind is MLPKind.swiglu
        self.fc = nn.Linear(cfg.n_embd, (2 if gated else 1) * hidden, bias=cfg.bias)
        self.proj = nn.Linear(hidden, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)  # [B, T, hidden] (swiglu: [B, T, 2 * hidden])
        if self.kind is MLPKind.gelu:
            h = F.gelu(h)  # exact erf GELU
        elif self.kind is MLPKind.gelu_tanh:
            h = F.gelu(h, approximate="tanh")  # GPT-2's approximation (for weights trained with it)
        elif self.kind is MLPKind.relu2:
            h = relu_squared(h)  # F.relu(h).square(), by faster code
        else:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        return self.dropout(self.proj(h))


class Block(nn.Module):
    """x + attn(norm(x)), then x + mlp(norm(x)): pre-norm keeps the residual path an identity."""

    def __init__(self, cfg: ModelConfig, attn: AttentionConfig):
        super().__init__()
        self.ln_1 = make_norm(cfg)
        self.attn = attention_layer(cfg.n_embd, cfg.n_head, cfg.block_size, attn,
                                    dropout=cfg.dropout, bias=cfg.bias,
                                    attn_dropout=cfg.attn_dropout, n_kv_head=cfg.n_kv_head,
                                    qk_norm=cfg.qk_norm, norm_eps=cfg.norm_eps,
                                    gate=cfg.attn_gate, window=cfg.window)
        self.ln_2 = make_norm(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x, cache: Optional[KVCache] = None, layer: int = 0, return_weights=False,
                rotary=None, mask=None):
        a, weights = self.attn(self.ln_1(x), cache, layer, return_weights, rotary, mask)
        x = x + a
        x = x + self.mlp(self.ln_2(x))
        return x, weights


class GPT(nn.Module):
    """idx [B, T] token ids -> logits [B, T, vocab_size] (and the mean cross-entropy loss)."""

    def __init__(self, cfg: ModelConfig, vocab_size: int, attn: Optional[AttentionConfig] = None):
        super().__init__()
        attn = attn if attn is not None else AttentionConfig()
        self.cfg, self.attn_cfg, self.vocab_size = cfg, attn, vocab_size
        self.rope = Positions(cfg.positions) is Positions.rope
        self.tok_emb = nn.Embedding(vocab_size, cfg.n_embd)
        # learned positions: a vector per position added to the token's; RoPE has no table
        self.pos_emb = None if self.rope else nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, attn) for _ in range(cfg.n_layer))
        self.ln_f = make_norm(cfg)
        self.lm_head = nn.Linear(cfg.n_embd, vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight  # tied: one matrix reads and writes tokens
        self.reset_parameters()
        self.loss = choose_loss(self.tok_emb.weight.device, vocab_size)  # (model/loss.py)

    def reset_parameters(self) -> None:
        """GPT-2 init: weights N(0, init_std), biases 0, norms' gains 1 (and biases 0); the
        projections that write into the residual stream use init_std / sqrt(2 * n_layer), since
        each layer adds two such terms to it. W_Q and W_K may get their own std
        (attention.qk_init_std)."""
        std = self.cfg.init_std
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, 0.0, std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, 0.0, std)
            elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
                nn.init.ones_(module.weight)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
        resid_std = std / math.sqrt(2 * self.cfg.n_layer)
        for block in self.blocks:
            outputs = [block.mlp.proj.weight]
            if isinstance(block.attn.out_proj, nn.Linear):  # (not the no_out_proj pitfall)
                outputs.append(block.attn.out_proj.weight)
            for weight in outputs:
                nn.init.normal_(weight, 0.0, resid_std)
            if self.attn_cfg.qk_init_std is not None:
                rows = sum(block.attn.qkv_rows[:2])  # W_Q and W_K
                nn.init.normal_(block.attn.qkv.weight[:rows], 0.0, self.attn_cfg.qk_init_std)

    def num_params(self, positions: bool = True) -> int:
        """Parameters (a tied token embedding / head counted once); with positions=False,
        without the learned position embeddings: the N of 6N FLOPs per token, which counts the
        token embedding as the head's matmul."""
        n = sum(p.numel() for p in self.parameters())
        return n if positions or self.pos_emb is None else n - self.pos_emb.weight.numel()

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None,
                cache: Optional[KVCache] = None, return_weights: bool = False):
        """Returns (logits, loss); loss is None without targets. With return_weights, a third
        item lists each layer's attention weights [B, h, T, m]."""
        T, start = idx.size(1), 0 if cache is None else cache.length
        if start + T > self.cfg.block_size:
            raise ValueError(f"sequence of {start + T} tokens exceeds block_size {self.cfg.block_size}")
        pos, mask = torch.arange(T, device=idx.device), None  # [T]; None: the causal pattern
        if cache is not None:  # after the cached tokens ([B, T] in a padded batch), and the keys
            pos, mask = cache.positions(T), cache.visible(T)  # they may see, for every layer
        x = self.tok_emb(idx)  # [B, T, d_model]
        rotary = None
        if self.rope:  # the (cos, sin) tables of these positions, [1 or B, 1, T, d_k], shared
            rotary = rotary_tables(pos.view(-1, 1, T), self.cfg.head_dim, self.cfg.rope_theta,
                                   x.dtype)  # by every layer and head
        else:
            x = x + self.pos_emb(pos)
        x = self.drop(x)
        all_weights = []
        for layer, block in enumerate(self.blocks):
            x, weights = block(x, cache, layer, return_weights, rotary, mask)
            all_weights.append(weights)
        if cache is not None:
            cache.advance(T)
        x = self.ln_f(x)  # [B, T, d_model]
        if targets is None:
            logits, loss = self.lm_head(x), None  # [B, T, vocab_size]
        else:  # the same logits, and their mean cross-entropy (model/loss.py)
            logits, loss = self.loss(x, self.lm_head.weight, targets)
        return (logits, loss, all_weights) if return_weights else (logits, loss)

    def _apply(self, fn, recurse=True):
        result = super()._apply(fn, recurse)  # moved: each layer chooses its path again
        self.loss = choose_loss(self.tok_emb.weight.device, self.vocab_size)
        return result

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
        """An empty KV cache of `batch` rows (model/decoding.py): a PitfallCache for a pitfall."""
        p, c = self.tok_emb.weight, self.cfg
        cache = PitfallCache if replaces_a_step(self.attn_cfg) else KVCache
        return cache(c.n_layer, batch, c.kv_heads, c.block_size, c.head_dim, device or p.device,
                     dtype or p.dtype, static=static, window=c.window, attn=self.attn_cfg)

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: Optional[int] = None, top_p: Optional[float] = None,
                 generator=None, greedy: bool = False,
                 use_cache: bool = True, static_cache: Optional[bool] = None,
                 pad: Optional[torch.Tensor] = None) -> Iterator[torch.Tensor]:
        """Yield [B, 1] new token ids one at a time (so callers can stream them).

        use_cache: run each step on the new token alone, with a KV cache (model/decoding.py).
        static_cache: a cache whose steps all have the same shapes, so that on CUDA the
        one-token step runs as a captured CUDA graph; None = on for CUDA with the correct
        attention. The tokens are the same either way. pad: [B] left-pad tokens of each row of
        idx, prompts of different lengths in one batch (through the cache; the pad id is never
        seen); generator: one, or one per row (a list), each row then sampling as it would
        alone with it.
        """
        if static_cache is None:
            static_cache = idx.device.type == "cuda" and self.attn_cfg.is_causal()
        was_training = self.training
        self.eval()
        decoder = Decoder(self, idx.size(0), use_cache, static_cache, pad)
        context = idx
        try:
            for _ in range(max_new_tokens):
                logits = decoder.next_logits(context)  # [B, vocab_size]
                token = sample_next(logits, temperature, top_k, top_p, generator, greedy)
                context = torch.cat([context, token], dim=1)
                yield token
        finally:
            self.train(was_training)
