"""Evaluation: the whole-split loss scores every token once, and the bits-per-character conversion."""
from __future__ import annotations

import contextlib
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from model.config import ModelConfig
from model.gpt import GPT
from training.evaluate import bits_per_char, full_split_loss, mean_loss

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
