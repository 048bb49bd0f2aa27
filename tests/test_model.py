"""The GPT as a whole: shapes, causality, loss at init, overfitting, KV cache, sampling."""
from __future__ import annotations

import math
import time

import pytest
import torch

from model.config import ModelConfig
from model.gpt import GPT
from model.sampling import filter_logits, sample_next

D = torch.float64
VOCAB = 37


def make_gpt(vocab=VOCAB, attn=None, dtype=D, **kw) -> GPT:
    cfg = ModelConfig(**{**dict(n_layer=2, n_head=4, n_embd=32, block_size=16), **kw})
    model = GPT(cfg, vocab, attn).to(dtype)
    return model.eval()


def randomize(model: GPT, std: float = 0.2) -> GPT:
    """Weights far from init, so that every path carries a visible signal."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ln" not in name:
                p.normal_(0.0, std)
    return model


# ----------------------------------------------------------------------------- structure


@pytest.mark.parametrize("n_head", [1, 2, 4, 8])
def test_logits_shape_for_several_head_counts(n_head):
    model = make_gpt(n_head=n_head)
    for B, T in [(1, 1), (3, 9), (2, 16)]:
        idx = torch.randint(0, VOCAB, (B, T))
        logits, loss = model(idx)
        assert logits.shape == (B, T, VOCAB) and loss is None
        logits, loss, weights = model(idx, idx, return_weights=True)
        assert loss.shape == () and len(weights) == 2
        assert all(w.shape == (B, n_head, T, T) for w in weights)


def test_indivisible_heads_fail_an_assertion():
    """A programmer error inside the model (users' values are checked in guard/limits.py)."""
    with pytest.raises(AssertionError, match="divisible"):
        GPT(ModelConfig(n_embd=30, n_head=4), VOCAB)


def test_too_long_sequence_raises():
    model = make_gpt(block_size=8)
    with pytest.raises(ValueError, match="exceeds block_size 8"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_lm_head_is_tied_to_token_embedding():
    model = make_gpt()
    assert model.lm_head.weight is model.tok_emb.weight


def test_every_block_has_a_scaled_attention_with_output_projection():
    model = make_gpt(n_embd=48, n_head=6)
    for block in model.blocks:
        assert block.attn.scale() == pytest.approx(1 / math.sqrt(8))
        assert isinstance(block.attn.out_proj, torch.nn.Linear)


# Causality (the future never moves the past) and its negative controls, the leaky pitfalls,
# are tested in tests/test_pitfalls.py.


# ----------------------------------------------------------------------------- loss


@pytest.mark.parametrize("vocab", [37, 65, 500])
def test_loss_at_init_is_close_to_log_vocab(vocab):
    model = make_gpt(vocab=vocab, dtype=torch.float32)
    idx = torch.randint(0, vocab, (8, 16))
    targets = torch.randint(0, vocab, (8, 16))
    _, loss = model(idx, targets)
    assert abs(loss.item() - math.log(vocab)) < 0.1


def test_loss_is_mean_cross_entropy_of_logits():
    model = randomize(make_gpt())
    idx, targets = torch.randint(0, VOCAB, (3, 10)), torch.randint(0, VOCAB, (3, 10))
    logits, loss = model(idx, targets)
    logp = torch.log_softmax(logits, -1)
    expected = -logp.gather(-1, targets[..., None]).mean()
    assert loss.item() == pytest.approx(expected.item(), abs=1e-5)


@pytest.mark.slow
def test_tiny_model_overfits_one_batch():
    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=16), 20)
    model.train()
    x = torch.randint(0, 20, (4, 16))
    y = torch.randint(0, 20, (4, 16))  # arbitrary targets: only memorisation can fit them
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    start = time.perf_counter()
    first = None
    for step in range(300):
        _, loss = model(x, y)
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 0.05:
            break
    assert first > 2.5
    assert loss.item() < 0.1, f"loss still {loss.item():.3f} after {step + 1} steps"
    assert time.perf_counter() - start < 20


# ----------------------------------------------------------------------------- KV cache


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("chunks", [[16], [1] * 16, [5, 1, 1, 4, 5], [9, 7]])
def test_cached_incremental_forward_equals_full_forward(chunks, static):
    """Growing cache (attends over the filled prefix) and static cache (attends over the whole
    buffer, its unfilled tail masked): both give the full forward pass's logits."""
    model = randomize(make_gpt())
    idx = torch.randint(0, VOCAB, (2, 16))
    full, _ = model(idx)
    cache = model.new_cache(2, static=static)
    assert cache.k.dtype == D
    outs, pos = [], 0
    for n in chunks:
        logits, _ = model(idx[:, pos:pos + n], cache=cache)
        outs.append(logits)
        pos += n
        assert cache.length == pos == cache.position.item()
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-10, rtol=0)


def test_a_static_cache_reset_refills_the_same_buffers():
    model = randomize(make_gpt())
    idx = torch.randint(0, VOCAB, (1, 12))
    cache = model.new_cache(1, static=True)
    buffers = cache.k.data_ptr(), cache.position.data_ptr()
    model(torch.randint(0, VOCAB, (1, 7)), cache=cache)
    cache.reset()
    logits, _ = model(idx, cache=cache)
    torch.testing.assert_close(logits, model(idx)[0], atol=1e-10, rtol=0)
    assert (cache.k.data_ptr(), cache.position.data_ptr()) == buffers


def test_cache_overflow_raises():
    model = make_gpt(block_size=8)
    cache = model.new_cache(1)
    model(torch.zeros(1, 6, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="exceeds block_size"):
        model(torch.zeros(1, 3, dtype=torch.long), cache=cache)


@pytest.mark.parametrize("prompt_len,new", [(1, 15), (4, 12), (10, 6)])
def test_greedy_generation_with_and_without_cache_agree_within_block(prompt_len, new):
    model = randomize(make_gpt(), std=0.3)
    model.train()  # generate must switch to eval and back
    idx = torch.randint(0, VOCAB, (3, prompt_len))
    with_cache = torch.cat(list(model.generate(idx, new, greedy=True, use_cache=True)), 1)
    static = torch.cat(list(model.generate(idx, new, greedy=True, static_cache=True)), 1)
    without = torch.cat(list(model.generate(idx, new, greedy=True, use_cache=False)), 1)
    assert model.training
    assert with_cache.shape == (3, new)
    assert torch.equal(with_cache, without) and torch.equal(static, without)
    # and greedy really is argmax of the full forward pass
    seq = torch.cat([idx, without], 1)
    logits, _ = model.eval()(seq[:, :-1])
    assert torch.equal(logits[:, prompt_len - 1:].argmax(-1), without)


def test_generation_past_block_size_keeps_going():
    model = randomize(make_gpt(block_size=8), std=0.3)
    idx = torch.randint(0, VOCAB, (1, 3))
    outs = {}
    for use_cache, static in ((True, False), (True, True), (False, False)):
        out = torch.cat(list(model.generate(idx, 30, greedy=True, use_cache=use_cache,
                                            static_cache=static)), 1)
        assert out.shape == (1, 30) and ((0 <= out) & (out < VOCAB)).all()
        outs[use_cache, static] = out
    # the two caches refill at the same points, from the same half context
    assert torch.equal(outs[True, False], outs[True, True])


def test_sampling_is_reproducible_with_a_generator():
    model = randomize(make_gpt(), std=0.3)
    idx = torch.randint(0, VOCAB, (2, 3))
    runs = [torch.cat(list(model.generate(idx, 10, temperature=1.0, top_k=10,
                                          generator=torch.Generator().manual_seed(7))), 1)
            for _ in range(2)]
    assert torch.equal(runs[0], runs[1])


# ----------------------------------------------------------------------------- sampling


def test_top_k_keeps_exactly_the_k_largest():
    logits = torch.tensor([[1.0, 5.0, 3.0, -2.0, 4.0, 0.0], [0.0, 0.1, 0.2, 0.3, 0.4, 0.5]])
    out = filter_logits(logits, top_k=3)
    kept = torch.isfinite(out)
    assert kept.tolist() == [[False, True, True, False, True, False],
                             [False, False, False, True, True, True]]
    assert torch.equal(out[kept], logits[kept])  # survivors unchanged
    assert (out[~kept] == -math.inf).all()
    assert torch.equal(filter_logits(logits, top_k=6), logits)
    assert torch.equal(filter_logits(logits, top_k=1).isfinite().sum(-1), torch.tensor([1, 1]))


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([[0.05, 0.5, 0.2, 0.25], [0.97, 0.01, 0.01, 0.01]])
    logits = probs.log()
    # sorted: 0.5, 0.25, 0.2, 0.05 -> cumulative 0.5, 0.75, 0.95, 1.0
    cases = {0.3: [1], 0.499: [1], 0.501: [1, 3], 0.749: [1, 3], 0.751: [1, 2, 3], 0.99: [0, 1, 2, 3]}
    for p, keep in cases.items():
        kept = torch.isfinite(filter_logits(logits, top_p=p))[0]
        assert kept.nonzero().flatten().tolist() == keep, p
    # the most likely token always survives, however small p is
    assert torch.isfinite(filter_logits(logits, top_p=0.01)).sum(-1).tolist() == [1, 1]
    assert torch.equal(filter_logits(logits, top_p=1.0), logits)


def test_top_k_and_top_p_combine():
    logits = torch.tensor([[0.05, 0.5, 0.2, 0.25]]).log()
    kept = torch.isfinite(filter_logits(logits, top_k=2, top_p=0.99))[0]
    assert kept.tolist() == [False, True, False, True]


def test_sample_next_only_draws_kept_tokens():
    logits = torch.randn(4, 50)
    gen = torch.Generator().manual_seed(0)
    allowed = torch.topk(logits, 5, dim=-1).indices
    for _ in range(50):
        tok = sample_next(logits, temperature=2.0, top_k=5, generator=gen)
        assert tok.shape == (4, 1)
        assert (tok == allowed).any(-1).all()
    assert torch.equal(sample_next(logits, greedy=True), logits.argmax(-1, keepdim=True))
