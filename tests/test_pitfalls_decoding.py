"""The pitfalls of rotary positions, grouped heads and the KV cache, each caught by a test that
passes on the correct layer and fails on the pitfall (its negative control).

What catches what:
- the cache pitfalls (cache_positions_restart, upper_left_mask) train exactly as the correct
  layer; only decoding through the cache tells them apart: teacher-forced cached logits against
  the forward pass, and the loss through the cache (`cached_loss`) against the causal one;
- rope_on_values breaks the relative-position property: the same tokens later in the sequence
  give other outputs;
- gqa_repeat_mismatch and rotary_interleaved are relabellings (of heads, of dimensions): the
  pitfall equals the correct layer with permuted weights, which is why training from scratch
  cannot see them; the oracles that can are full multi-head attention with repeat_interleave'd
  keys and values, the rotate-half rotation in complex numbers, and transformers' Llama.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from safeio.cli import UserError
from guard.limits import check_pitfall_switches
from guard.compose import compose
from helpers import VARIANT_NEEDS
from model.attention import CausalSelfAttention, attention_layer
from model.fast_paths import fused_refusal
from model.config import DECODING_SWITCHES, PITFALL_SWITCHES, AttentionConfig, ModelConfig
from model.gpt import GPT
from model.rotary import apply_rotary, apply_rotary_interleaved, rotary_angles, rotary_tables
from training.evaluate import cached_loss, mean_loss

D = torch.float64
VOCAB = 37
ATOL = 1e-10
# Every variant as shipped in conf/attention/ (the study's files), by name
VARIANTS = {name: compose([f"attention={name}", *VARIANT_NEEDS.get(name, [])]).attention
            for name in ("correct", *DECODING_SWITCHES)}
CACHE_PITFALLS = ["cache_positions_restart", "upper_left_mask"]
# The modern switches the pitfalls live in: rotary positions and grouped heads, with the rest of
# Llama's (learned positions for the cache pitfalls that do not need rotary ones)
ARCH = {"llama": dict(positions="rope", norm="rmsnorm", mlp="swiglu", n_kv_head=2, bias=False,
                      tie_embeddings=False),
        "rope_gqa_qk_norm": dict(positions="rope", n_kv_head=2, qk_norm=True),
        "learned": dict()}


def model_of(variant: str, arch: str = "llama", seed: int = 0, std: float = 0.3) -> GPT:
    """A float64 GPT with weights far from init (so every path carries signal), seeded alike
    for every variant: the variants of one seed hold the same tensors."""
    cfg = ModelConfig(**{**dict(n_layer=2, n_head=4, n_embd=32, block_size=16), **ARCH[arch]})
    torch.manual_seed(seed)
    model = GPT(cfg, VOCAB, VARIANTS[variant]).to(D).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if p.dim() == 1 and "ln" in name
                    else std * torch.randn_like(p))
    return model


def tokens(batch: int = 2, T: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, T), generator=torch.Generator().manual_seed(seed))


def cached_pieces(model: GPT, idx: torch.Tensor, sizes, static: bool = False) -> torch.Tensor:
    """[B, T, V]: the logits of idx fed through one KV cache in chunks of `sizes` tokens."""
    cache = model.new_cache(idx.size(0), static=static)
    pieces, pos = [], 0
    with torch.no_grad():
        for n in sizes:
            pieces.append(model(idx[:, pos:pos + n], cache=cache)[0])
            pos += n
    return torch.cat(pieces, 1)


def random_layer(attn: AttentionConfig, h: int = 4, h_kv: int = 2, d: int = 8, T: int = 12,
                 seed: int = 0) -> CausalSelfAttention:
    torch.manual_seed(seed)
    layer = attention_layer(h * d, h, T, attn, n_kv_head=h_kv).to(D)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.3)
    return layer


# ----------------------------------------------------------------------------- the cache


@pytest.mark.parametrize("static", [False, True], ids=["growing", "static"])
@pytest.mark.parametrize("arch", ["llama", "rope_gqa_qk_norm"])
@pytest.mark.parametrize("variant", ["correct", *DECODING_SWITCHES])
def test_cached_teacher_forced_logits_equal_the_forward_pass_except_for_the_cache_pitfalls(
        variant, arch, static):
    """One token at a time, then a prompt and chunks: the cached logits are the forward pass's
    for the correct layer, and for the pitfalls that are not in the cache (the cache cannot see
    those; the tests below do). The two cache pitfalls give other logits."""
    model = model_of(variant, arch)
    idx = tokens()
    with torch.no_grad():
        full = model(idx)[0]
    for sizes in ([1] * 16, [5, 1, 1, 4, 5]):
        error = (cached_pieces(model, idx, sizes, static) - full).abs().max().item()
        if variant in CACHE_PITFALLS:
            assert error > 1e-2, (sizes, error)
        else:
            assert error < ATOL, (sizes, error)


@pytest.mark.parametrize("variant", CACHE_PITFALLS)
def test_the_cache_pitfalls_break_learned_positions_too(variant):
    model = model_of(variant, "learned")
    idx = tokens()
    with torch.no_grad():
        full = model(idx)[0]
    assert (cached_pieces(model, idx, [1] * 16) - full).abs().max() > 1e-2
    correct = model_of("correct", "learned")
    with torch.no_grad():
        assert (cached_pieces(correct, idx, [1] * 16) - correct(idx)[0]).abs().max() < ATOL


@pytest.mark.parametrize("variant", CACHE_PITFALLS)
def test_the_cache_pitfalls_train_exactly_as_the_correct_layer(variant):
    """Without a cache (training, the causal validation loss) they are the correct layer, to
    the bit: the same loss and the same gradients."""
    idx = tokens()
    losses, grads = [], []
    for name in ("correct", variant):
        model = model_of(name)
        loss = model(idx[:, :-1], idx[:, 1:])[1]
        grads.append(torch.autograd.grad(loss, list(model.parameters())))
        losses.append(loss)
    assert torch.equal(losses[0], losses[1])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_upper_left_mask_lets_a_decoded_token_see_only_the_first_key():
    """After 5 cached tokens, the 6th query: the correct pattern spreads its weight over the 6
    keys; the top-left aligned one (SDPA's is_causal with fewer queries than keys) puts all of
    it on key 0."""
    idx = tokens(1, 6)
    weights = {}
    for name in ("correct", "upper_left_mask"):
        model = model_of(name)
        cache = model.new_cache(1)
        with torch.no_grad():
            model(idx[:, :5], cache=cache)
            weights[name] = model(idx[:, 5:], cache=cache, return_weights=True)[2][0][0, :, 0]
    assert weights["correct"].shape == (4, 6)  # [heads, keys]
    assert (weights["correct"] > 1e-6).all()
    torch.testing.assert_close(weights["upper_left_mask"][:, 0], torch.ones(4, dtype=D))
    assert weights["upper_left_mask"][:, 1:].abs().max() == 0


@pytest.mark.parametrize("variant", ["correct", *DECODING_SWITCHES])
def test_the_loss_through_the_cache_is_the_causal_loss_except_for_the_cache_pitfalls(variant):
    """training/evaluate.py's cached_loss: the generation path (Decoder, one token at a time,
    teacher forced) gives the uncached loss of the same batches to rounding for every layer but
    the cache pitfalls, for which it differs."""
    model = model_of(variant)
    batches = [(tokens(3, 16, seed), tokens(3, 16, seed + 10)) for seed in (1, 2)]  # (x, y)
    off = torch.autocast("cpu", enabled=False)
    uncached, cached = mean_loss(model, batches, off), cached_loss(model, batches, off)
    if variant in CACHE_PITFALLS:
        assert abs(cached - uncached) > 0.05, (cached, uncached)  # (random targets: it is
        # the trained models of the study that show the cache pitfalls' loss to be far worse)
    else:  # both losses are taken in float32 (as in training), from float64 logits
        assert abs(cached - uncached) < 1e-6, (cached, uncached)


# ----------------------------------------------------------------------------- rotary positions


def test_rope_on_values_breaks_the_relative_position_property():
    """The same inputs at positions 0.. and at positions 5..: the correct layer gives the same
    output (scores see distances only, values carry no position); rotating v too gives another."""
    x = torch.randn(2, 6, 32, dtype=D, generator=torch.Generator().manual_seed(0))
    now = rotary_tables(torch.arange(6), 8, 10000.0, D)
    later = rotary_tables(torch.arange(6) + 5, 8, 10000.0, D)
    outputs = {}
    for name in ("correct", "rope_on_values"):
        layer = random_layer(VARIANTS[name])
        a, b = layer(x, rotary=now)[0], layer(x, rotary=later)[0]
        outputs[name] = a
        shift = (a - b).abs().max().item()
        assert shift < ATOL if name == "correct" else shift > 1e-2, (name, shift)
    # the same weights: only the values' rotation differs (position 0 is not rotated at all)
    torch.testing.assert_close(outputs["correct"][:, 0], outputs["rope_on_values"][:, 0],
                               atol=ATOL, rtol=0)
    assert (outputs["correct"] - outputs["rope_on_values"]).abs().max() > 1e-2


def rotate_complex(x: torch.Tensor, positions: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """The rotation as complex numbers z_j * exp(i t theta_j), pair j being (j, j + d/2)
    (rotate-half, what Llama's weights expect) or (2j, 2j + 1) (interleaved)."""
    d = x.size(-1)
    angles = rotary_angles(positions, d, 10000.0)  # [T, d/2]
    turn = torch.polar(torch.ones_like(angles), angles)
    if interleaved:
        z = torch.view_as_complex(x.unflatten(-1, (d // 2, 2)).contiguous())
        return torch.view_as_real(z * turn).flatten(-2)
    z = torch.complex(x[..., :d // 2], x[..., d // 2:])
    w = z * turn
    return torch.cat([w.real, w.imag], -1)


def test_rotary_interleaved_is_a_rotation_of_the_wrong_pairs():
    """Negative control for the rotary layout: ours is the rotate-half rotation in complex
    numbers, the interleaved one is not (it is the rotation of pairs (2j, 2j + 1)); scores of
    either depend only on the distance, so that property alone cannot tell them apart."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 10, 16, dtype=D, generator=g)
    pos = torch.arange(10)
    cos, sin = rotary_tables(pos, 16, 10000.0, D)
    half = rotate_complex(x, pos, interleaved=False)
    torch.testing.assert_close(apply_rotary(x, cos, sin), half, atol=ATOL, rtol=0)
    assert (apply_rotary_interleaved(x, cos, sin) - half).abs().max() > 1e-2
    torch.testing.assert_close(apply_rotary_interleaved(x, cos, sin),
                               rotate_complex(x, pos, interleaved=True), atol=ATOL, rtol=0)
    q, k = torch.randn(16, dtype=D, generator=g), torch.randn(16, dtype=D, generator=g)
    for rotate in (apply_rotary, apply_rotary_interleaved):
        def score(s: int, t: int) -> float:
            (cs, ss), (ct, st) = (rotary_tables(torch.tensor([p]), 16, 10000.0, D) for p in (s, t))
            return (rotate(q, cs, ss) * rotate(k, ct, st)).sum().item()
        assert score(7, 3) == pytest.approx(score(4, 0), abs=1e-12)
        assert score(7, 3) != pytest.approx(score(7, 2), abs=1e-6)  # and the distance counts


def half_to_interleaved(d: int) -> torch.Tensor:
    """[d]: the dimension of a rotate-half vector that each interleaved dimension takes
    (2j <- j, 2j + 1 <- j + d/2)."""
    return torch.stack([torch.arange(d // 2), torch.arange(d // 2) + d // 2], -1).flatten()


def test_rotary_interleaved_is_the_correct_layer_with_permuted_weights():
    """Why training from scratch cannot see it: the pitfall with W_Q and W_K rows permuted in
    each head is the correct layer exactly. Without the permutation (imported weights) it is
    not."""
    h, h_kv, d = 4, 2, 8
    correct = random_layer(VARIANTS["correct"], h, h_kv, d)
    wrong = random_layer(VARIANTS["rotary_interleaved"], h, h_kv, d)
    wrong.load_state_dict(correct.state_dict())
    x = torch.randn(2, 12, h * d, dtype=D, generator=torch.Generator().manual_seed(3))
    rotary = rotary_tables(torch.arange(12), d, 10000.0, D)
    y = correct(x, rotary=rotary)[0]
    assert (wrong(x, rotary=rotary)[0] - y).abs().max() > 1e-2
    perm = half_to_interleaved(d)
    rows = torch.cat([head * d + perm for head in range(h + h_kv)])  # W_Q's heads, then W_K's
    with torch.no_grad():
        wrong.qkv.weight[:(h + h_kv) * d] = correct.qkv.weight[rows]
        wrong.qkv.bias[:(h + h_kv) * d] = correct.qkv.bias[rows]
    torch.testing.assert_close(wrong(x, rotary=rotary)[0], y, atol=ATOL, rtol=0)


# ----------------------------------------------------------------------------- grouped heads


def full_mha_with(layer: CausalSelfAttention, kv_of_head: torch.Tensor) -> CausalSelfAttention:
    """Full multi-head attention whose query head i reads the key/value head kv_of_head[i] of
    `layer` (rows of W_K and W_V copied h times instead of h_kv)."""
    h, d = layer.n_head, layer.head_dim
    C = h * d
    full = CausalSelfAttention(C, h, layer.causal.size(0), VARIANTS["correct"]).to(D)
    nq, nk, _ = layer.qkv_rows
    rows = torch.cat([torch.arange(d) + j * d for j in kv_of_head])  # [C]
    with torch.no_grad():
        for name in ("weight", "bias"):
            src, dst = getattr(layer.qkv, name), getattr(full.qkv, name)
            dst[:nq] = src[:nq]
            dst[C:2 * C] = src[nq:nq + nk][rows]
            dst[2 * C:] = src[nq + nk:][rows]
        full.out_proj.load_state_dict(layer.out_proj.state_dict())
    return full


@pytest.mark.parametrize("h,h_kv", [(4, 2), (6, 2), (6, 3), (8, 4)])
@pytest.mark.parametrize("variant", ["correct", "gqa_repeat_mismatch"])
def test_grouped_heads_against_full_attention_with_repeat_interleaved_keys_and_values(
        variant, h, h_kv):
    """The oracle: query head i reads key/value head i // g (repeat_interleave, Llama's
    repeat_kv). The correct layer equals it; the pitfall equals the tiled mapping i % h_kv
    instead, and differs from the oracle (the cache changes nothing in either)."""
    d, g = 8, h // h_kv
    layer = random_layer(VARIANTS[variant], h, h_kv, d)
    x = torch.randn(2, 12, h * d, dtype=D, generator=torch.Generator().manual_seed(4))
    y = layer(x)[0]
    interleave = full_mha_with(layer, torch.arange(h_kv).repeat_interleave(g))(x)[0]
    tile = full_mha_with(layer, torch.arange(h_kv).repeat(g))(x)[0]
    if variant == "correct":
        torch.testing.assert_close(y, interleave, atol=ATOL, rtol=0)
        assert (y - tile).abs().max() > 1e-2
    else:
        assert (y - interleave).abs().max() > 1e-2
        torch.testing.assert_close(y, tile, atol=ATOL, rtol=0)


def test_gqa_repeat_mismatch_is_the_correct_layer_with_its_query_heads_relabelled():
    """Why training from scratch cannot see it: giving query head i the W_Q rows (and W_O
    columns) of the correct layer's head (i % h_kv) * g + i // h_kv makes the pitfall the
    correct layer exactly."""
    h, h_kv, d = 6, 2, 8
    g = h // h_kv
    correct = random_layer(VARIANTS["correct"], h, h_kv, d)
    wrong = random_layer(VARIANTS["gqa_repeat_mismatch"], h, h_kv, d)
    wrong.load_state_dict(correct.state_dict())
    heads = (torch.arange(h) % h_kv) * g + torch.arange(h) // h_kv  # the correct head of slot i
    cols = torch.cat([torch.arange(d) + j * d for j in heads])
    with torch.no_grad():
        wrong.qkv.weight[:h * d] = correct.qkv.weight[cols]
        wrong.qkv.bias[:h * d] = correct.qkv.bias[cols]
        wrong.out_proj.weight.copy_(correct.out_proj.weight[:, cols])
    x = torch.randn(2, 12, h * d, dtype=D, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(wrong(x)[0], correct(x)[0], atol=ATOL, rtol=0)


# ----------------------------------------------------------------------------- imported weights


@pytest.mark.slow
def test_on_llama_weights_the_correct_layer_agrees_with_transformers_and_each_pitfall_does_not():
    """A tiny random LlamaForCausalLM (transformers, built locally) copied into our GPT: the
    correct layer's logits agree, through the forward pass and the cache; each pitfall's do not,
    the cache pitfalls through the cache only (scripts/llama_pitfalls.py prints the table)."""
    pytest.importorskip("transformers")
    from scripts.llama_pitfalls import measure

    rows = {r["variant"]: r for r in measure(seed=0, batch=2, tokens=16)}
    # transformers' RMSNorm computes in float32 even for float64 weights: agreement to ~1e-6
    assert rows["correct"]["max_error"] < 1e-4 and rows["correct"]["cached_max_error"] < 1e-4
    for name in DECODING_SWITCHES:
        assert rows[name]["cached_max_error"] > 0.1 and rows[name]["cached_kl"] > 1e-2, rows[name]
        if name in CACHE_PITFALLS:
            assert rows[name]["max_error"] < 1e-4  # invisible without the cache
        else:
            assert rows[name]["max_error"] > 0.1, rows[name]


# ----------------------------------------------------------------------------- the checks


@pytest.mark.parametrize("switch,model,message", [
    ("rope_on_values", {}, "needs model.positions=rope"),
    ("rotary_interleaved", {}, "needs model.positions=rope"),
    ("gqa_repeat_mismatch", {}, "needs grouped heads"),
    ("gqa_repeat_mismatch", dict(n_kv_head=1), "needs grouped heads"),
    ("gqa_repeat_mismatch", dict(n_kv_head=4), "needs grouped heads"),
])
def test_a_pitfall_that_would_change_nothing_is_refused(switch, model, message):
    with pytest.raises(UserError, match=message):
        check_pitfall_switches(ModelConfig(n_head=4, **model), AttentionConfig(**{switch: True}))
    check_pitfall_switches(ModelConfig(n_head=4, positions="rope", n_kv_head=2),
                           AttentionConfig(**{switch: True}))  # where it does something
    with pytest.raises(UserError, match=message):
        compose(["+arch=gpt2", f"attention={switch}",  # GPT-2's switches: the default has rope
                 *[f"model.{k}={v}" for k, v in model.items()]])


@pytest.mark.parametrize("switch", PITFALL_SWITCHES)
def test_the_fused_kernel_refuses_every_pitfall(switch):
    attn = replace(AttentionConfig(), name=switch, **{switch: True})
    leaks = switch in ("split_heads_no_transpose", "softmax_over_queries")
    assert attn.is_causal() != leaks and not attn.is_correct()
    assert "always runs the reference code" in fused_refusal(attn)
    assert fused_refusal(AttentionConfig()) is None


# ----------------------------------------------------------------------------- the maps


@pytest.mark.parametrize("variant", ["correct", "upper_left_mask", "cache_positions_restart"])
def test_the_decoding_maps_show_the_cache_pitfalls(variant):
    """training/attention_maps.py's maps of the generation path (TensorBoard's decoding_layer<i>,
    scripts.attention_map mask=cached): the forward pass's map for the correct layer; every row
    on key 0 for upper_left_mask; another map for cache_positions_restart."""
    from training.attention_maps import attention_weights

    model = model_of(variant)
    ids = tokens(1, 12)[0].tolist()
    off = torch.autocast("cpu", enabled=False)
    forward, _ = attention_weights(model, ids, off)
    cached, leaks = attention_weights(model, ids, off, cached=True)
    assert cached.shape == forward.shape == (2, 4, 12, 12) and (leaks == 0).all()
    error = abs(cached - forward).max()
    if variant == "correct":
        assert error < 1e-6
    elif variant == "upper_left_mask":
        assert (cached[..., 0] == 1).all() and (cached[..., 1:] == 0).all()
    else:
        assert error > 1e-2


# ----------------------------------------------------------------------------- the summary


def test_the_summary_s_decoding_table_pairs_by_seed_and_marks_identical_runs():
    """scripts/summarize_ablations.py's second table: the effect on the causal and on the cached
    loss, paired per seed; a pitfall whose runs are the correct ones to the bit says so."""
    import numpy as np

    from scripts.summarize_ablations import decoding_table, effect

    def runs(causal, cached):
        return {seed: {"causal": (np.array([250]), np.array([c])),
                       "cached": (np.array([250]), np.array([k]))}
                for seed, (c, k) in enumerate(zip(causal, cached))}

    base = [2.25, 2.27, 2.24, 2.26]
    arms = {("decode", "correct"): runs(base, base),
            ("decode", "upper_left_mask"): runs(base, [b + 0.9 + 0.01 * i for i, b in enumerate(base)]),
            ("decode", "gqa_repeat_mismatch"): runs([b + d for b, d in zip(base, [.02, -.03, .01, 0])],
                                                    [b + d for b, d in zip(base, [.02, -.03, .01, 0])])}
    e = effect(arms[("decode", "upper_left_mask")], arms[("decode", "correct")], "cached")
    assert e.paired and e.n == 4 and e.mean == pytest.approx(0.915) and e.in_se > 50
    e = effect(arms[("decode", "gqa_repeat_mismatch")], arms[("decode", "correct")])
    assert e.low < 0 < e.high
    lines = {line.split(" | ")[1]: line for line in decoding_table(arms).splitlines()[2:]}
    assert "| 0 | 0 | [0, 0] | identical |" in lines["upper_left_mask"]
    assert "identical" not in lines["gqa_repeat_mismatch"]
    assert decoding_table({("leak", "correct"): {0: {"causal": (np.array([1]), np.array([2.0]))}}}) == ""
