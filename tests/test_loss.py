"""The CPU's row-block head and loss (model/loss.py) against the plain F.cross_entropy(x W^T)."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from model.config import ModelConfig
from model.gpt import GPT
from model.loss import cross_entropy, row_block_cross_entropy


def inputs(n_rows=37, width=16, vocab=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, n_rows, width, generator=g, requires_grad=True)
    w = (torch.randn(vocab, width, generator=g) * 0.3).requires_grad_()
    y = torch.randint(0, vocab, (1, n_rows), generator=g)
    return x, w, y


def plain(x, w, y):
    logits = x @ w.t()
    return logits, F.cross_entropy(logits.float().view(-1, w.size(0)), y.view(-1))


def loss_and_grads(fn, x, w, y, scale=1.0):
    x.grad = w.grad = None
    logits, loss = fn(x, w, y)
    (loss * scale).backward()
    return logits.detach(), loss.detach(), x.grad.clone(), w.grad.clone()


@pytest.mark.parametrize("block_rows", [1, 5, 16, 37, 1000])
def test_float32_equals_the_plain_loss_and_gradients(block_rows):
    x, w, y = inputs()
    ours = loss_and_grads(functools.partial(row_block_cross_entropy, block_rows=block_rows), x, w, y)
    ref = loss_and_grads(plain, x, w, y)
    for a, b in zip(ours, ref):  # logits (a block's matmul may round differently), loss, grads
        torch.testing.assert_close(a, b.view_as(a), rtol=1e-5, atol=1e-6)


def test_backward_scales_by_the_loss_gradient():
    """The gradients are made in forward for a loss gradient of 1: backward must still multiply
    by whatever it is given (a loss divided over micro-batches, a weighted sum)."""
    x, w, y = inputs()
    ours = loss_and_grads(functools.partial(row_block_cross_entropy, block_rows=8), x, w, y, scale=-2.5)
    ref = loss_and_grads(plain, x, w, y, scale=-2.5)
    for a, b in zip(ours[2:], ref[2:]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_bf16_autocast_matches_the_plain_loss_under_autocast():
    x, w, y = inputs(n_rows=300, width=32, vocab=700)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = loss_and_grads(functools.partial(row_block_cross_entropy, block_rows=64), x, w, y)
        ref = loss_and_grads(cross_entropy, x, w, y)
    assert ours[0].dtype == ref[0].dtype == torch.bfloat16  # logits in autocast's dtype
    assert ours[2].dtype == ours[3].dtype == torch.float32  # gradients of the fp32 leaves
    torch.testing.assert_close(ours[0], ref[0], rtol=1e-2, atol=1e-2)  # bf16 rounding
    torch.testing.assert_close(ours[1], ref[1], rtol=1e-4, atol=1e-4)
    for a, b in zip(ours[2:], ref[2:]):
        assert (a - b).norm() <= 0.01 * b.norm()  # bf16 rounding of the gradients, no more


def test_without_gradients_only_the_loss_is_computed():
    x, w, y = inputs()
    with torch.no_grad():
        logits, loss = row_block_cross_entropy(x, w, y, block_rows=4)
    torch.testing.assert_close(loss, plain(x, w, y)[1].detach(), rtol=1e-6, atol=0)
    assert not loss.requires_grad and not logits.requires_grad


def test_the_logits_carry_no_gradient():
    x, w, y = inputs()
    logits, _ = row_block_cross_entropy(x, w, y, block_rows=4)
    assert not logits.requires_grad


def test_a_tied_model_trains_the_same_through_either_path(monkeypatch):
    """Whole model, tied head: the embedding's gradient is its own plus the head's."""
    torch.manual_seed(0)
    model_ = GPT(ModelConfig(n_layer=2, n_head=2, n_embd=16, block_size=12), vocab_size=40)
    idx = torch.randint(0, 40, (3, 12))

    def grads():
        model_.zero_grad(set_to_none=True)
        _, loss = model_(idx[:, :-1], idx[:, 1:])
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model_.named_parameters()}

    assert model_.loss.func is row_block_cross_entropy  # the CPU default: row blocks
    ours = grads()
    monkeypatch.setattr(model_, "loss", cross_entropy)
    ref = grads()
    torch.testing.assert_close(ours[0], ref[0], rtol=1e-6, atol=0)
    for name in ref[1]:
        torch.testing.assert_close(ours[1][name], ref[1][name], rtol=1e-4, atol=1e-6)
