"""Evaluation: the whole-split loss scores every token once, the bits-per-character conversion,
and the teacher-forced decode's batches fed together give each batch's losses."""
from __future__ import annotations

import contextlib
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from guard.compose import compose
from helpers import VARIANT_NEEDS
from model.config import ModelConfig
from model.gpt import GPT
from training.config import CachedEval
from training.evaluate import (bits_per_char, decoded_losses, full_split_loss, mean_loss,
                                 merged_batches)

VOCAB = 30


@pytest.fixture
def model() -> GPT:
    torch.manual_seed(0)
    return GPT(ModelConfig(n_layer=1, n_head=2, n_embd=16, block_size=8), VOCAB).double().eval()


@pytest.mark.parametrize("n_tokens, batch", [(50, 3), (33, 4), (9, 1), (200, 64)])
def test_full_split_loss_is_the_mean_nll_of_every_token(model, n_tokens, batch):
    tokens = np.random.default_rng(0).integers(0, VOCAB, n_tokens).astype(np.uint16)
    got = full_split_loss(model, tokens, 8, batch, contextlib.nullcontext())
    # reference: each target t+1 predicted from the window it falls in (windows of 8 from 0)
    ids = torch.from_numpy(tokens.astype(np.int64))
    total, count = 0.0, 0
    for start in range(0, n_tokens - 1, 8):
        x = ids[start:min(start + 8, n_tokens - 1)]
        y = ids[start + 1:start + 1 + len(x)]
        logits, _ = model(x[None])
        total += F.cross_entropy(logits[0], y, reduction="sum").item()
        count += len(y)
    assert count == n_tokens - 1
    assert got == pytest.approx(total / count, rel=1e-6)  # the loss is computed in float32


def test_mean_loss_weights_every_token_equally(model):
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, VOCAB, (b, 8), generator=g),
                torch.randint(0, VOCAB, (b, 8), generator=g)) for b in (1, 3)]
    got = mean_loss(model, batches, contextlib.nullcontext())
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    _, loss = model(x, y)
    assert got == pytest.approx(loss.item(), rel=1e-6)  # the loss is computed in float32


def test_bits_per_char():
    # char level: one token per character, so bits/char = nats/token / ln 2
    assert bits_per_char(math.log(2), 100, 100) == pytest.approx(1.0)
    # BPE: 3 characters per token on average means a third of the bits per character
    assert bits_per_char(3 * math.log(2), 100, 300) == pytest.approx(1.0)


def test_merged_batches_join_consecutive_batches_of_one_shape_up_to_the_budget():
    g = torch.Generator().manual_seed(0)
    shapes = [(4, 8)] * 5 + [(3, 8), (4, 8)]  # 32 tokens each, then a smaller batch, then one
    batches = [(torch.randint(0, VOCAB, s, generator=g), torch.randint(0, VOCAB, s, generator=g))
               for s in shapes]
    merged = merged_batches(batches, merge_tokens=64)
    assert [tuple(x.shape) for x, _ in merged] == [(8, 8), (8, 8), (4, 8), (3, 8), (4, 8)]
    # every row once, in order, each x with its own y
    assert torch.equal(torch.cat([x for x, _ in merged]), torch.cat([x for x, _ in batches]))
    assert torch.equal(torch.cat([y for _, y in merged]), torch.cat([y for _, y in batches]))
    assert [tuple(x.shape) for x, _ in merged_batches(batches, 0)] == shapes  # 0: one by one


@pytest.mark.parametrize("variant", ["correct", "cache_positions_restart", "upper_left_mask"])
def test_a_decode_fed_merged_gives_the_losses_of_its_batches_one_by_one(variant):
    """training/evaluate.py's decoded_losses joins the batches it feeds one token at a time
    (merged_batches): the rows are independent, so the losses are those of the batches fed one
    by one, to float rounding, for the correct layer and for the cache pitfalls the
    second study measures with it."""
    cfg = compose([f"attention={variant}", "model.positions=rope", *VARIANT_NEEDS.get(variant, []),
                   "model.n_layer=2", "model.n_head=4", "model.n_embd=32", "model.block_size=12"])
    torch.manual_seed(0)
    model = GPT(cfg.model, VOCAB, cfg.attention).double().eval()
    with torch.no_grad():  # weights far from init, where the pitfalls show
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, VOCAB, (4, 12), generator=g),
                torch.randint(0, VOCAB, (4, 12), generator=g)) for _ in range(5)]
    off = contextlib.nullcontext()
    one_by_one = decoded_losses(model, batches, off, CachedEval.tokens, merge_tokens=0)
    merged = decoded_losses(model, batches, off, CachedEval.tokens, merge_tokens=96)  # 2, 2, 1
    assert merged == pytest.approx(one_by_one, rel=1e-6, abs=0)  # the loss is in float32
    if variant != "correct":  # the pitfall shows through the cache: the comparison is not moot
        assert abs(merged[0] - merged[1]) > 1e-4
