"""The third study's pitfalls, each caught by a test that passes on the correct layer and fails
on the pitfall (its negative control).

What catches what:
- the head split without the transpose and the softmax over the queries leak the future: the
  leak detectors of tests/test_pitfalls.py fire, and each equals its oracle (the reshape without
  the transpose; weights whose columns, not rows, sum to 1);
- the padding pitfalls (left_pad_positions, pad_keys_visible) show in a left-padded row's logits
  through the cache against the prompt alone; with rotary positions left_pad_positions moves
  every token of a row alike, and the scores see distances only: it is invisible there;
- cache_not_reset shows in a second prompt decoded through the same Decoder;
- the window: each query sees exactly w keys (w + 1 with window_off_by_one), against torch's
  SDPA with a band mask; the trimmed cache shows in a prefill in chunks, not one token at a time;
- decoded_losses (the study's measurement) is the forward pass's loss to rounding for the
  correct layer in every way of feeding the cache, and differs for each pitfall where it shows.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from guard.limits import check_pitfall_switches
from guard.compose import compose
from helpers import VARIANT_NEEDS
from model.attention import attention_layer, visible_keys
from model.config import BOOKKEEPING_SWITCHES, AttentionConfig, ModelConfig
from model.decoding import Decoder
from model.fast_paths import fused_refusal
from model.gpt import GPT
from safeio.cli import UserError
from test_pitfalls import future_jacobian, prefix_shift, tiny_model
from training.config import CachedEval
from training.evaluate import decoded_losses

D = torch.float64
VOCAB = 37
ATOL = 1e-10
VARIANTS = {name: compose([f"attention={name}", *VARIANT_NEEDS.get(name, [])]).attention
            for name in ("correct", *BOOKKEEPING_SWITCHES)}
LEAKY = ["split_heads_no_transpose", "softmax_over_queries"]
ARCH = {"learned": dict(), "rope_gqa": dict(positions="rope", n_kv_head=2)}


def model_of(variant: str, arch: str = "learned", block: int = 16, **size) -> GPT:
    """A float64 GPT, weights far from init, the same tensors for every variant of a seed."""
    cfg = ModelConfig(**{**dict(n_layer=2, n_head=4, n_embd=32, block_size=block), **ARCH[arch],
                         **size})
    torch.manual_seed(0)
    model = GPT(cfg, VOCAB, VARIANTS[variant]).to(D).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model


def tokens(batch: int = 2, T: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, T), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- the two leaks


@pytest.mark.parametrize("arch", ["learned", "rope_gqa"])
@pytest.mark.parametrize("variant", ["correct", *LEAKY])
def test_the_leak_detectors_fire_on_the_head_split_and_the_softmax_axis(variant, arch):
    model = tiny_model(VARIANTS[variant], **ARCH[arch])
    for t in (0, 7, 14):
        if variant == "correct":
            assert prefix_shift(model, t) == 0.0 and future_jacobian(model, t) == 0.0
        else:
            assert prefix_shift(model, t) > 1e-6 and future_jacobian(model, t) > 1e-6, t
    if variant != "correct":  # the causal variant is the correct layer, the same weights
        with model.attention_variant(model.attn_cfg.causal_variant()):
            assert prefix_shift(model, 7) == 0.0 and future_jacobian(model, 7) == 0.0


def test_split_heads_no_transpose_is_the_reshape_without_the_transpose():
    """The oracle: q, k, v [B, T, C] reshaped to [B, h, T, d_k] in memory order; the correct
    layer is the same weights with view(B, T, h, d_k).transpose(1, 2)."""
    torch.manual_seed(0)
    B, T, h, d = 2, 8, 4, 8
    layers = {name: attention_layer(h * d, h, T, VARIANTS[name]).to(D)
              for name in ("correct", "split_heads_no_transpose")}
    layers["split_heads_no_transpose"].load_state_dict(layers["correct"].state_dict())
    x = torch.randn(B, T, h * d, dtype=D)
    layer = layers["correct"]
    q, k, v = layer.qkv(x).split(h * d, dim=2)
    for name, cut in (("correct", lambda t: t.view(B, T, h, d).transpose(1, 2)),
                      ("split_heads_no_transpose", lambda t: t.reshape(B, h, T, d))):
        y = F.scaled_dot_product_attention(cut(q), cut(k), cut(v), is_causal=True)
        oracle = layer.out_proj(y.transpose(1, 2).reshape(B, T, h * d))
        torch.testing.assert_close(layers[name](x)[0], oracle, atol=ATOL, rtol=0)
    assert (layers["correct"](x)[0] - layers["split_heads_no_transpose"](x)[0]).abs().max() > 1e-2


def test_softmax_over_queries_makes_the_columns_sum_to_one():
    x = torch.randn(2, 8, 32, dtype=D, generator=torch.Generator().manual_seed(0))
    for name in ("correct", "softmax_over_queries"):
        torch.manual_seed(0)
        weights = attention_layer(32, 4, 8, VARIANTS[name]).to(D)(x, return_weights=True)[1]
        sums = weights.sum(-1 if name == "correct" else -2)  # rows, or columns
        torch.testing.assert_close(sums, torch.ones_like(sums), atol=ATOL, rtol=0)
        assert (weights.sum(-2 if name == "correct" else -1) - 1).abs().max() > 0.1


# ----------------------------------------------------------------------------- padding


def padded_logits(model: GPT, prompt: torch.Tensor, n_pad: int, sizes) -> torch.Tensor:
    """[T, V] the logits of prompt [1, T] behind n_pad pad tokens, fed through the cache in
    chunks of `sizes` (the pads' rows dropped)."""
    idx = torch.cat([torch.zeros(1, n_pad, dtype=torch.long), prompt], dim=1)
    cache = model.new_cache(1)
    cache.pad = torch.tensor([n_pad])
    pieces, start = [], 0
    with torch.no_grad():
        for size in sizes:
            pieces.append(model(idx[:, start:start + size], cache=cache)[0][0])
            start += size
    return torch.cat(pieces)[n_pad:]


@pytest.mark.parametrize("arch", list(ARCH))
@pytest.mark.parametrize("variant", ["correct", "left_pad_positions", "pad_keys_visible"])
def test_a_left_padded_row_is_its_prompt_alone_but_for_the_padding_pitfalls(variant, arch):
    """Prefilled at once and one token at a time. left_pad_positions with rotary positions is the
    exception that is a result: every token of the row moves by the same n_pad positions, which
    rotary scores cannot see (only the learned positions' vectors change)."""
    model = model_of(variant, arch)
    prompt = tokens(1, 10)
    with torch.no_grad():
        alone = model(prompt)[0][0]
    for sizes in ([15], [6] + [1] * 9):
        error = (padded_logits(model, prompt, 5, sizes) - alone).abs().max().item()
        invisible = variant == "left_pad_positions" and arch == "rope_gqa"
        if variant == "correct" or invisible:
            assert error < ATOL, (sizes, error)
        else:
            assert error > 1e-2, (sizes, error)


@pytest.mark.parametrize("variant", ["left_pad_positions", "pad_keys_visible",
                                     "cache_not_reset", "window_cache_trim"])
def test_the_decoding_pitfalls_train_exactly_as_the_correct_layer(variant):
    """Training has no pads, no second sequence and no cache: the loss and every gradient are
    the correct layer's, to the bit."""
    arch = dict(window=4) if variant.startswith("window") else {}
    idx = tokens()
    losses, grads = [], []
    for name in ("correct", variant):
        model = model_of(name, **arch)
        loss = model(idx[:, :-1], idx[:, 1:])[1]
        grads.append(torch.autograd.grad(loss, list(model.parameters())))
        losses.append(loss)
    assert torch.equal(losses[0], losses[1])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


# ----------------------------------------------------------------------------- cache reuse


@pytest.mark.parametrize("arch", list(ARCH))
@pytest.mark.parametrize("variant", ["correct", "cache_not_reset"])
def test_a_second_prompt_decodes_as_alone_unless_the_cache_is_kept(variant, arch):
    model = model_of(variant, arch)
    first, second = tokens(1, 6, seed=2), tokens(1, 8, seed=3)
    with torch.no_grad():
        alone = model(second)[0][0]  # [8, V]
        decoder = Decoder(model, 1)
        decoder.next_logits(first)
        decoder.restart()
        logits = torch.stack([decoder.next_logits(second[:, :t + 1])[0] for t in range(8)])
    error = (logits - alone).abs().max().item()
    assert error < ATOL if variant == "correct" else error > 1e-2, error


# ----------------------------------------------------------------------------- the window


@pytest.mark.parametrize("w", [1, 3, 5])
@pytest.mark.parametrize("variant", ["correct", "window_off_by_one"])
def test_a_window_of_w_sees_w_keys_against_sdpa_with_a_band(variant, w):
    """Each query sees its last w keys, its own included (min(i + 1, w)): the weights' nonzero
    count, and the output of torch's SDPA with the band mask. window_off_by_one sees w + 1."""
    torch.manual_seed(0)
    T, h, d = 10, 4, 8
    layer = attention_layer(h * d, h, T, VARIANTS[variant], window=w).to(D)
    x = torch.randn(2, T, h * d, dtype=D)
    y, weights = layer(x, return_weights=True)
    keys = w + (variant == "window_off_by_one")
    seen = (weights > 0).sum(-1)  # [B, h, T]
    assert torch.equal(seen, torch.arange(1, T + 1).clamp_max(keys).expand_as(seen))
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    band = (j <= i) & (j > i - w)  # the correct window
    with torch.no_grad():
        q, k, v = (t.view(2, T, h, d).transpose(1, 2) for t in layer.qkv(x).split(h * d, dim=2))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=band)
        oracle = layer.out_proj(o.transpose(1, 2).reshape(2, T, h * d))
    error = (y - oracle).abs().max().item()
    assert error < ATOL if variant == "correct" else error > 1e-3, error
    assert torch.equal(visible_keys(torch.arange(T), T, w), band)
    assert layer(x)[0].sub(y).abs().max() < ATOL  # the fast path computes the same


@pytest.mark.parametrize("static", [False, True], ids=["growing", "static"])
@pytest.mark.parametrize("variant", ["correct", "window_off_by_one", "window_cache_trim"])
def test_a_windowed_cache_one_token_at_a_time_and_in_chunks(variant, static):
    """Past the window (w = 4, 16 tokens): the cached logits equal the forward pass's for the
    correct layer and the off-by-one (whose forward pass has the same wrong window: the static
    cache's pattern is the cache's own, and must be as wrong as the layer's), token by token and
    in chunks; the trimmed cache is right one token at a time, wrong in chunks."""
    model = model_of(variant, "rope_gqa", window=4)
    idx = tokens()
    with torch.no_grad():
        full = model(idx)[0]
        for size in (1, 4, 3):
            cache = model.new_cache(2, static=static)
            cached = torch.cat([model(piece, cache=cache)[0] for piece in idx.split(size, 1)], 1)
            error = (cached - full).abs().max().item()
            if variant == "window_cache_trim" and size > 1:
                assert error > 1e-2, (size, error)
            else:
                assert error < ATOL, (size, error)


# ----------------------------------------------------------------------------- the maps


@pytest.mark.parametrize("variant", ["correct", "pad_keys_visible", "cache_not_reset"])
def test_the_served_maps_show_what_a_padded_second_prompt_sees(variant):
    """training/attention_maps.py's served maps (TensorBoard's decoding_layer<i> and the
    summary's KV-cache row for train.cached_eval=served): a 12-token window's second half, then
    its first half behind 3 pads. The correct layer's second prompt puts no weight on the first
    prompt's keys nor on its pads; cache_not_reset's on the first prompt's (and, its slots
    counted from the first prompt's, on its pads too), pad_keys_visible's on the pads."""
    from training.attention_maps import attention_weights

    model = model_of(variant)
    ids = tokens(1, 12)[0].tolist()
    off = torch.autocast("cpu", enabled=False)
    weights, leaks = attention_weights(model, ids, off, cached=True, how=CachedEval.served)
    assert weights.shape == (2, 4, 12, 12) and (leaks == 0).all()
    real = weights[:, :, 9:]  # the second prompt's real tokens (rows 9..11)
    on_first, on_pads = real[..., :6].sum(-1), real[..., 6:9].sum(-1)
    assert on_first.max() > 1e-2 if variant == "cache_not_reset" else on_first.max() == 0
    if variant != "cache_not_reset":  # (kept: its pads sit past the slots pad= hides)
        assert on_pads.max() > 1e-2 if variant == "pad_keys_visible" else on_pads.max() == 0


# ----------------------------------------------------------------------------- the measurement


@pytest.mark.parametrize("variant,arch,how", [
    ("correct", {}, CachedEval.served), ("correct", dict(window=4), CachedEval.chunks),
    ("correct", {}, CachedEval.tokens),
    ("left_pad_positions", {}, CachedEval.served), ("pad_keys_visible", {}, CachedEval.served),
    ("cache_not_reset", {}, CachedEval.served),
    ("window_cache_trim", dict(window=4), CachedEval.chunks),
    ("window_cache_trim", dict(window=4), CachedEval.tokens),
])
def test_decoded_losses_see_each_decoding_pitfall_where_it_shows(variant, arch, how):
    """training/evaluate.py's decoded_losses, the study's headline: the loss through the cache
    equals the forward pass's loss of the same tokens for the correct layer whatever the way of
    feeding it, and differs for a pitfall on the path that shows it (the trimmed cache: not one
    token at a time)."""
    model = model_of(variant, block=16, **arch)
    batches = [(tokens(8, 16, seed), tokens(8, 16, seed + 10)) for seed in (1, 2)]
    off = torch.autocast("cpu", enabled=False)
    cached, forward = decoded_losses(model, batches, off, how)
    shows = variant != "correct" and how is not CachedEval.tokens
    # (random targets: the trained models of the study show the costs to be far larger)
    assert abs(cached - forward) > 1e-4 if shows else abs(cached - forward) < 1e-6, \
        (cached, forward)


# ----------------------------------------------------------------------------- the checks


@pytest.mark.parametrize("switch,model,message", [
    ("window_off_by_one", {}, "needs model.window"),
    ("window_cache_trim", {}, "needs model.window"),
    ("split_heads_no_transpose", dict(n_head=1), "needs model.n_head > 1"),
])
def test_a_bookkeeping_pitfall_that_would_change_nothing_is_refused(switch, model, message):
    with pytest.raises(UserError, match=message):
        check_pitfall_switches(ModelConfig(**{"n_head": 4, **model}),
                               AttentionConfig(**{switch: True}))
    check_pitfall_switches(ModelConfig(n_head=4, window=8), AttentionConfig(**{switch: True}))


def test_the_fused_kernel_refuses_a_window():
    from guard.limits import check_config

    assert "no sliding window" in fused_refusal(AttentionConfig(), window=8)
    assert fused_refusal(AttentionConfig()) is None
    with pytest.raises(UserError, match="no sliding window"):
        check_config(compose(["model.window=8", "attention.impl=fused"]))
