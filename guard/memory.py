"""Will it fit? The memory a run or a sampling command needs, estimated before anything is
allocated.

`model.n_embd=1000000` asks for tens of billions of parameters. Allocating them either fails
deep inside torch (a traceback, a half-made run directory) or, worse, succeeds thanks to the
kernel's overcommit and then has the process killed half-way through initialisation. So the
memory a config needs is estimated before anything is allocated, and compared with the memory
there is. The parameters, the optimizer's state, the causal masks and the KV cache are those of
the model itself, built on the `meta` device (shapes without storage); the estimate counts only
what certainly exists at one moment, the end of a forward pass after the first step (weights,
optimizer state, activations, logits; not the gradients, which set_to_none frees), each part at
its smallest (activations in autocast's 2 bytes unless the run is float32; on a CPU no float32
copy of the logits, which the row-block loss never makes), so a config it refuses cannot run,
and one it accepts may still be tight.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from model.config import AttentionConfig, AttentionImpl, ModelConfig
from model.fast_paths import fused_refusal
from safeio.cli import UserError
from safeio.system import available_bytes
from training.config import Config, OptimConfig


GB = 1e9
FP32 = 4


@dataclass(frozen=True)
class Sizes:
    """What a model holds, counted on the meta device."""

    params: int            # parameters (the tied head counted once)
    optimizer_words: int   # float32 words of optimizer state (AdamW: 2 per parameter, Muon: 1)
    cache_words: int       # KV cache of one sequence of block_size tokens
    buffer_bytes: int      # the causal masks


# The sizes counted so far in this process, by the configs they were counted for: a sweep's
# arms that differ only by seed (a study's 8 seeds of each arm) are counted once.
_counted: dict[str, Sizes] = {}


def model_sizes(m: ModelConfig, vocab_size: int, attn: AttentionConfig = AttentionConfig(),
                optim: OptimConfig = OptimConfig()) -> Sizes:
    """The sizes of GPT(m, vocab_size, attn) with optim's optimizers. Every block is alike, so
    models of one and two blocks are built and the difference is scaled to n_layer."""
    key = repr((m, vocab_size, attn, optim))  # the configs' every field (they are not hashable)
    if key not in _counted:
        one, two = (_sizes(replace(m, n_layer=n), vocab_size, attn, optim) for n in (1, 2))
        _counted[key] = Sizes(*(a + (m.n_layer - 1) * (b - a) for a, b in zip(one, two)))
    return _counted[key]


def _sizes(m: ModelConfig, vocab_size: int, attn: AttentionConfig, optim: OptimConfig) -> tuple:
    from model.gpt import GPT
    from training.optim import make_optimizer

    try:
        with torch.device("meta"):
            model = GPT(m, vocab_size, attn)
            cache = model.new_cache(1)
    except RuntimeError as exc:  # a tensor of more than 2**63 elements
        raise UserError(f"model.n_embd={m.n_embd}, mlp_ratio={m.mlp_ratio}, block_size="
                        f"{m.block_size} and a vocabulary of {vocab_size:,} make tensors too "
                        f"large to exist ({exc})") from None
    words = sum((1 if isinstance(opt, torch.optim.Muon) else 2) * p.numel()
                for opt in make_optimizer(model, optim).optimizers
                for group in opt.param_groups for p in group["params"])
    return (model.num_params(), words, cache.k.numel() + cache.v.numel(),
            sum(b.numel() * b.element_size() for b in model.buffers()))


def training_bytes(cfg: Config, vocab_size: int, device: torch.device, sizes: Sizes) -> dict:
    """Lower bounds, by part, of the memory one training process needs."""
    m, t = cfg.model, cfg.train
    act = FP32 if t.dtype == "float32" else 2  # autocast's bf16 (auto may pick it) keeps 2 bytes
    # the logits, and elsewhere than a CPU (model/loss.py) their float32 log-softmax for backward
    logits = act if device.type == "cpu" else act + FP32
    B, T, L, d, h = t.batch_size, m.block_size, m.n_layer, m.n_embd, m.n_head
    # the attention weights kept for backward: at least the visible triangle of each head (query
    # blocks keep a little more, the plain layer all T x T), but one number per row and head on
    # the fused kernel
    fused = fused_refusal(cfg.attention, m.head_dim, m.dropout if m.attn_dropout is None
                          else m.attn_dropout, device) is None and (
        cfg.attention.impl is AttentionImpl.fused
        or (cfg.attention.impl is AttentionImpl.auto and device.type == "cuda"))
    weights = h if fused else h * (T + 1) / 2
    return {
        "weights": FP32 * sizes.params,
        "optimizer state": FP32 * sizes.optimizer_words,
        "activations kept for backward": act * B * T * L * ((8 + 2 * m.mlp_ratio) * d + weights),
        "logits": logits * B * T * vocab_size,
        "causal masks": sizes.buffer_bytes,
        "validation batches": 8 * t.eval_batches * B * (T + 1),
    }


def inference_bytes(sizes: Sizes) -> dict:
    """Lower bounds, by part, of the memory sampling one sequence needs (float32, KV cache)."""
    return {"weights": FP32 * sizes.params, "KV cache": FP32 * sizes.cache_words,
            "causal masks": sizes.buffer_bytes}


def check_fits(parts: dict, device: torch.device, what: str, m: ModelConfig, vocab_size: int,
               params: int, advice: str) -> None:
    """Raise UserError, with the estimate, when parts cannot fit in the device's memory."""
    needed = sum(parts.values())
    have = available_bytes(device)
    if have is None or needed <= have:
        return
    biggest = max(parts, key=parts.get)
    raise UserError(
        f"{what} does not fit in memory: model.n_layer={m.n_layer}, n_embd={m.n_embd}, "
        f"block_size={m.block_size} and a vocabulary of {vocab_size:,} make "
        f"{_millions(params)} parameters; {what} needs at least {needed / GB:,.1f} GB "
        f"({biggest}: {parts[biggest] / GB:,.1f} GB), but {device.type} has "
        f"{have / GB:,.1f} GB available; {advice}")


def check_training_fits(cfg: Config, device: torch.device, vocab: Optional[int] = None) -> None:
    """vocab: the vocabulary size when known (a tokenizer file's), else the planned one."""
    vocab = vocab or cfg.tokenizer.planned_vocab_size
    sizes = model_sizes(cfg.model, vocab, cfg.attention, cfg.optim)
    check_fits(training_bytes(cfg, vocab, device, sizes), device, "training", cfg.model, vocab,
               sizes.params, "lower model.n_embd, model.n_layer, model.block_size, "
               "tokenizer.vocab_size or train.batch_size")


def check_sampling_fits(m: ModelConfig, vocab_size: int, attn: AttentionConfig,
                        device: torch.device, advice: str) -> None:
    sizes = model_sizes(m, vocab_size, attn)
    check_fits(inference_bytes(sizes), device, "sampling", m, vocab_size, sizes.params, advice)


def _millions(n: int) -> str:
    return f"{n / 1e6:,.0f}M" if n >= 10**7 else f"{n / 1e6:.2f}M"
