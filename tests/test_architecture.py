"""The architecture's switches (model/config.py, docs/model.md), each against its formula or an
oracle: RMSNorm, the MLP kinds, grouped-query attention against full multi-head attention with
its keys and values repeated, QK-norm, rotary positions in the model, an untied head; and for
every switch, the KV cache (growing and static) against the uncached forward pass."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from model.attention import CausalSelfAttention
from guard.limits import check_model
from interop.hf import gpt2_problems
from model.config import AttentionConfig, MLPKind, ModelConfig, Positions
from model.fast_paths import relu_squared
from model.gpt import GPT, MLP, make_norm
from model.rotary import apply_rotary, rotary_tables
from training.checkpoint import load_weights, weights_bytes
from guard.compose import compose
from training.config import Config
from training.evaluate import qk_grad_norms

D = torch.float64
VOCAB = 37
ATOL = 1e-10

# Each switch on its own, then all of them together (and multi-query attention).
SWITCHES = {
    "gpt2": {},
    "rope": dict(positions="rope"),
    "rmsnorm": dict(norm="rmsnorm"),
    "gelu_tanh": dict(mlp="gelu_tanh"),
    "relu2": dict(mlp="relu2"),
    "swiglu": dict(mlp="swiglu"),
    "gqa": dict(n_kv_head=2),
    "mqa": dict(n_kv_head=1),
    "qk_norm": dict(qk_norm=True),
    "untied": dict(tie_embeddings=False),
    "gate": dict(attn_gate=True),
    "no_bias": dict(bias=False),
    "all": dict(positions="rope", norm="rmsnorm", mlp="swiglu", n_kv_head=2, qk_norm=True,
                tie_embeddings=False, bias=False),
    "all_mqa": dict(positions="rope", norm="rmsnorm", mlp="relu2", n_kv_head=1, qk_norm=True),
}
GPT2_ARCH = compose(["+arch=gpt2"]).model  # GPT-2's switches, at the default size


def config(**kw) -> ModelConfig:
    base = replace(GPT2_ARCH, n_layer=2, n_head=4, n_embd=32, block_size=16)
    return replace(base, **kw)


def randomized(cfg: ModelConfig, std: float = 0.2, seed: int = 0, attn=None) -> GPT:
    """A float64 model with weights far from init (norm gains too), so every path carries signal."""
    torch.manual_seed(seed)
    model = GPT(cfg, VOCAB, attn).to(D).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and ("ln" in name or "norm" in name):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0.0, std)
    return model


# ----------------------------------------------------------------------------- the formulas


def test_rmsnorm_is_x_over_its_root_mean_square_times_the_gain():
    cfg = config(norm="rmsnorm", norm_eps=1e-6)
    norm = make_norm(cfg).to(D)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(3, 5, 32, dtype=D) * 4 + 1
    expected = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * norm.weight
    torch.testing.assert_close(norm(x), expected, atol=ATOL, rtol=0)
    assert not hasattr(norm, "bias") or norm.bias is None  # no bias, no mean: that is RMSNorm
    layer = make_norm(config()).to(D)  # and LayerNorm still centres
    torch.testing.assert_close(layer(x).mean(-1), torch.zeros(3, 5, dtype=D), atol=1e-12, rtol=0)


@pytest.mark.parametrize("kind", list(MLPKind))
def test_each_mlp_is_its_formula(kind):
    cfg = config(mlp=kind.value)
    mlp = MLP(cfg).to(D)
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_(0.0, 0.3)
    x = torch.randn(2, 5, 32, dtype=D)
    a = x @ mlp.fc.weight.T + mlp.fc.bias  # [..., hidden] (swiglu: [gate | up])
    if kind is MLPKind.gelu:
        h = 0.5 * a * (1 + torch.erf(a / math.sqrt(2)))
    elif kind is MLPKind.gelu_tanh:
        h = 0.5 * a * (1 + torch.tanh(math.sqrt(2 / math.pi) * (a + 0.044715 * a ** 3)))
    elif kind is MLPKind.relu2:
        h = torch.clamp(a, min=0) ** 2
    else:
        gate, up = a[..., :cfg.hidden], a[..., cfg.hidden:]
        h = gate / (1 + torch.exp(-gate)) * up  # SiLU(x W_gate) * (x W_up)
    expected = h @ mlp.proj.weight.T + mlp.proj.bias
    torch.testing.assert_close(mlp(x), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("dtype", [D, torch.float32, torch.bfloat16])
def test_relu_squared_is_f_relu_square_in_value_and_gradient(dtype):
    """The MLP's relu2 runs model/fast_paths.py's relu_squared, which writes its own backward
    (2 relu(x)): values and gradients must be those of F.relu(x).square(), including at x = 0
    and below, where both are 0."""
    x = torch.randn(3, 5, 16, dtype=dtype)
    x[0, 0, :4] = 0.0
    x.requires_grad_(True)
    grad = torch.randn_like(x)
    y = relu_squared(x)
    y.backward(grad)
    reference = F.relu(x).square()
    (expected,) = torch.autograd.grad(reference, x, grad)
    torch.testing.assert_close(y, reference, atol=0, rtol=0)
    torch.testing.assert_close(x.grad, expected, atol=0, rtol=1e-15 if dtype is D else 1e-2)
    if dtype is D:
        assert torch.autograd.gradcheck(relu_squared, (x.detach()[1:].requires_grad_(True),))


def test_swiglu_matches_the_two_matrix_mlp_in_parameters():
    for d in (96, 128, 384):
        plain = MLP(config(n_embd=d, n_head=4))
        gated = MLP(config(n_embd=d, n_head=4, mlp="swiglu"))
        n_plain = sum(p.numel() for p in plain.parameters())
        n_gated = sum(p.numel() for p in gated.parameters())
        assert abs(n_gated - n_plain) / n_plain < 0.01, (d, n_plain, n_gated)
        assert gated.fc.weight.shape == (2 * gated.proj.weight.size(1), d)
    assert MLP(config(mlp="swiglu", mlp_hidden=50)).proj.weight.shape == (32, 50)


# ----------------------------------------------------------------------------- grouped heads


def repeated_kv_layer(gqa: CausalSelfAttention) -> CausalSelfAttention:
    """Full multi-head attention computing what `gqa` computes: head i's W_K and W_V rows (and
    biases) are the rows of key/value head i // g, written out h times instead of h_kv."""
    h, h_kv, d = gqa.n_head, gqa.n_kv_head, gqa.head_dim
    C = h * d
    full = CausalSelfAttention(C, h, gqa.causal.size(0), gqa.attn, n_kv_head=h).to(D)
    nq, nk, _ = gqa.qkv_rows
    heads = torch.arange(h) // (h // h_kv)  # the kv head of each query head (Llama's repeat_kv)
    rows = torch.cat([torch.arange(d) + j * d for j in heads])  # [C] rows within W_K or W_V
    with torch.no_grad():
        for name in ("weight", "bias"):
            src, dst = getattr(gqa.qkv, name), getattr(full.qkv, name)
            dst[:nq] = src[:nq]
            dst[C:2 * C] = src[nq:nq + nk][rows]
            dst[2 * C:] = src[nq + nk:][rows]
        full.out_proj.load_state_dict(gqa.out_proj.state_dict())
    return full


@pytest.mark.parametrize("h,h_kv", [(4, 2), (4, 1), (6, 3), (6, 2), (8, 4)])
@pytest.mark.parametrize("block", [0, 3])
def test_grouped_heads_equal_full_attention_with_repeated_keys_and_values(h, h_kv, block):
    d = 8
    gqa = CausalSelfAttention(h * d, h, 12, AttentionConfig(query_block=block), n_kv_head=h_kv).to(D)
    with torch.no_grad():
        for p in gqa.parameters():
            p.normal_(0.0, 0.3)
    assert gqa.qkv.weight.shape == ((h + 2 * h_kv) * d, h * d)
    full = repeated_kv_layer(gqa)
    x = torch.randn(3, 12, h * d, dtype=D, requires_grad=True)
    y, w = gqa(x, return_weights=True)
    y_full, w_full = full(x, return_weights=True)
    torch.testing.assert_close(y, y_full, atol=ATOL, rtol=0)
    torch.testing.assert_close(w, w_full, atol=ATOL, rtol=0)
    assert w.shape == (3, h, 12, 12)
    if block:  # the query-block path too, gradients included
        gx, = torch.autograd.grad(gqa(x)[0].sum(), x)
        gx_full, = torch.autograd.grad(full(x)[0].sum(), x)
        torch.testing.assert_close(gx, gx_full, atol=ATOL, rtol=0)
    # and torch's own SDPA with enable_gqa, on the layer's projections
    q, k, v = gqa.qkv(x).split(gqa.qkv_rows, dim=2)
    q = q.view(3, 12, h, d).transpose(1, 2)
    k, v = (t.view(3, 12, h_kv, d).transpose(1, 2) for t in (k, v))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(y, gqa.out_proj(o.transpose(1, 2).reshape(3, 12, h * d)),
                               atol=ATOL, rtol=0)


def test_a_wrong_grouping_is_caught_by_the_oracle():
    """Negative control: interleaving heads (i % h_kv) instead of grouping them (i // g) gives
    another function, which the repeated-keys oracle tells apart."""
    h, h_kv, d = 4, 2, 8
    gqa = CausalSelfAttention(h * d, h, 8, AttentionConfig(), n_kv_head=h_kv).to(D)
    with torch.no_grad():
        for p in gqa.parameters():
            p.normal_(0.0, 0.3)
    x = torch.randn(2, 8, h * d, dtype=D)
    y = gqa(x)[0]
    q, k, v = gqa.qkv(x).split(gqa.qkv_rows, dim=2)
    q = q.view(2, 8, h, d).transpose(1, 2)
    k, v = (t.view(2, 8, h_kv, d).transpose(1, 2) for t in (k, v))
    wrong = torch.arange(h) % h_kv
    o = F.scaled_dot_product_attention(q, k[:, wrong], v[:, wrong], is_causal=True)
    assert (y - gqa.out_proj(o.transpose(1, 2).reshape(2, 8, h * d))).abs().max() > 1e-3


def test_the_kv_cache_holds_only_the_key_value_heads():
    sizes = {}
    for h_kv in (4, 2, 1):
        model = GPT(config(n_kv_head=h_kv), VOCAB)
        cache = model.new_cache(3)
        assert cache.k.shape == (2, 3, h_kv, 16, 8)
        sizes[h_kv] = cache.nbytes
    assert sizes[4] == 2 * sizes[2] == 4 * sizes[1]  # shrinks by n_head / n_kv_head


def test_qk_grad_norms_read_the_query_and_key_rows_with_grouped_heads():
    model = GPT(config(n_kv_head=1), VOCAB)
    idx = torch.randint(0, VOCAB, (2, 16))
    model(idx, idx)[1].backward()
    norms = qk_grad_norms(model)
    for layer, block in enumerate(model.blocks):
        grad = block.attn.qkv.weight.grad
        assert norms[layer, 0].item() == pytest.approx(grad[:32].norm().item(), rel=1e-5)
        assert norms[layer, 1].item() == pytest.approx(grad[32:40].norm().item(), rel=1e-5)


# ----------------------------------------------------------------------------- QK-norm, RoPE


def test_qk_norm_normalises_each_heads_q_and_k_before_the_rotation():
    cfg = config(qk_norm=True, positions="rope", norm_eps=1e-6)
    model = randomized(cfg)
    layer = model.blocks[0].attn
    x = torch.randn(2, 16, 32, dtype=D)
    cos, sin = rotary_tables(torch.arange(16), 8, cfg.rope_theta, D)
    y, w = layer(x, return_weights=True, rotary=(cos, sin))
    q, k, v = layer.qkv(x).split(layer.qkv_rows, dim=2)
    q, k, v = (t.view(2, 16, 4, 8).transpose(1, 2) for t in (q, k, v))

    def rms(t, gain):
        return t / torch.sqrt((t * t).mean(-1, keepdim=True) + 1e-6) * gain

    q = apply_rotary(rms(q, layer.q_norm.weight), cos, sin)
    k = apply_rotary(rms(k, layer.k_norm.weight), cos, sin)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(y, layer.out_proj(o.transpose(1, 2).reshape(2, 16, 32)),
                               atol=ATOL, rtol=0)


def test_rope_model_has_no_position_table_and_sees_only_relative_positions():
    model = randomized(config(positions="rope"))
    assert model.pos_emb is None
    assert not any("pos_emb" in name for name in model.state_dict())
    # one layer, no MLP effect on positions: a sequence shifted in position by a cache prefix of
    # padding gives the same attention output only if positions are relative. Here, the direct
    # check: the same tokens at positions 0.. and at positions 5.. (after 5 cached tokens that
    # every query is forbidden to see) give the same logits.
    layer = model.blocks[0].attn
    x = torch.randn(1, 6, 32, dtype=D)
    head = rotary_tables(torch.arange(6), 8, 10000.0, D)
    later = rotary_tables(torch.arange(6) + 5, 8, 10000.0, D)
    torch.testing.assert_close(layer(x, rotary=head)[0], layer(x, rotary=later)[0], atol=ATOL, rtol=0)
    learned = randomized(config())
    assert learned.pos_emb is not None


# ----------------------------------------------------------------------------- the cache, per switch


@pytest.mark.parametrize("static", [False, True], ids=["growing", "static"])
@pytest.mark.parametrize("switch", list(SWITCHES))
def test_cached_forward_equals_the_full_pass_for_every_switch(switch, static):
    """Prompt, single tokens, then chunks: positions continue after the cached ones."""
    model = randomized(config(**SWITCHES[switch]))
    idx = torch.randint(0, VOCAB, (2, 16))
    full, _ = model(idx)
    cache = model.new_cache(2, static=static)
    pieces, pos = [], 0
    for n in [5, 1, 1, 4, 5]:
        pieces.append(model(idx[:, pos:pos + n], cache=cache)[0])
        pos += n
    torch.testing.assert_close(torch.cat(pieces, 1), full, atol=ATOL, rtol=0)


@pytest.mark.parametrize("switch", ["rope", "gqa", "all", "all_mqa"])
def test_cache_with_positions_restarting_at_zero_would_differ(switch):
    """Negative control for the cache test: a second chunk rotated (or embedded) as if it
    started at position 0 gives other logits, so the test above sees the cached positions."""
    model = randomized(config(**SWITCHES[switch]))
    idx = torch.randint(0, VOCAB, (1, 10))
    full, _ = model(idx)
    cache = model.new_cache(1)
    model(idx[:, :6], cache=cache)
    cache.position.zero_()  # the device counter that rotary and learned positions read
    wrong, _ = model(idx[:, 6:], cache=cache)
    if SWITCHES[switch].get("positions") == "rope":
        assert (wrong - full[:, 6:]).abs().max() > 1e-4


@pytest.mark.parametrize("switch", ["gpt2", "rope", "swiglu", "gqa", "qk_norm", "gate", "all",
                                    "all_mqa"])
def test_greedy_generation_is_the_same_with_and_without_the_cache(switch):
    model = randomized(config(**SWITCHES[switch]), std=0.3)
    idx = torch.randint(0, VOCAB, (2, 3))
    runs = [torch.cat(list(model.generate(idx, 30, greedy=True, use_cache=c, static_cache=s)), 1)
            for c, s in ((False, False), (True, False), (True, True))]
    # 30 tokens: past the 16-token context, so the caches are refilled on the way, and each
    # refill restarts positions at 0 as the uncached pass over the cropped context does
    assert torch.equal(runs[1], runs[2])
    within = 16 - 3  # before the first refill, the cache is the uncached pass exactly
    assert torch.equal(runs[0][:, :within], runs[1][:, :within])


# ----------------------------------------------------------------------------- the head, the checkpoint


def test_an_untied_head_is_its_own_matrix_and_survives_a_checkpoint(tmp_path):
    tied, untied = GPT(config(), VOCAB), GPT(config(tie_embeddings=False), VOCAB)
    assert tied.lm_head.weight is tied.tok_emb.weight
    assert untied.lm_head.weight is not untied.tok_emb.weight
    assert untied.num_params() - tied.num_params() == VOCAB * 32
    path = tmp_path / "model.safetensors"
    path.write_bytes(weights_bytes(untied))
    other = GPT(config(tie_embeddings=False), VOCAB)
    load_weights(other, path)
    assert torch.equal(other.lm_head.weight, untied.lm_head.weight)
    assert not torch.equal(other.lm_head.weight, other.tok_emb.weight)


def test_the_residual_projections_start_with_gpt2s_smaller_std():
    """GPT-2's init: every weight N(0, init_std), but W_O and the MLP's output projection, which
    write into the residual stream twice per block, N(0, init_std / sqrt(2 n_layer)), so the
    stream's variance does not grow with depth. 65,536 draws a matrix: each std to about 1%."""
    torch.manual_seed(0)
    model = GPT(config(n_layer=8, n_embd=256, n_head=4, init_std=0.02), VOCAB)
    resid = 0.02 / math.sqrt(2 * 8)
    for block in model.blocks:
        for weight in (block.attn.out_proj.weight, block.mlp.proj.weight):
            assert abs(weight.std().item() / resid - 1) < 0.03, weight.std().item()
        for weight in (block.attn.qkv.weight, block.mlp.fc.weight):
            assert abs(weight.std().item() / 0.02 - 1) < 0.03, weight.std().item()


def test_the_gpt2_configuration_keeps_gpt2s_init_and_parameters():
    """The switches' GPT-2 values build exactly GPT-2's modules, so GPT-2 import/export and the
    pitfall study (which depend on them) are unchanged."""
    model = GPT(config(), VOCAB)
    names = {n for n, _ in model.named_parameters()}
    assert "pos_emb.weight" in names and not any("norm" in n for n in names)
    assert isinstance(model.ln_f, torch.nn.LayerNorm) and model.ln_f.bias is not None
    assert model.blocks[0].attn.qkv.weight.shape == (96, 32)
    assert not gpt2_problems(config())


# ----------------------------------------------------------------------------- config


def test_a_config_of_none_of_the_switches_is_gpt2():
    """config.yaml of a run made before the switches has none of their keys: it loads as GPT-2
    (ModelConfig's defaults), and GPT-2 import builds it the same way (interop/hf.py)."""
    old = OmegaConf.create({"model": {"n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 8,
                                      "dropout": 0.0, "attn_dropout": None, "bias": True,
                                      "init_std": 0.02, "mlp_ratio": 4}})
    cfg: Config = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), old))
    assert not gpt2_problems(cfg.model) and cfg.model.kv_heads == 2
    assert cfg.model == replace(GPT2_ARCH, n_layer=2, n_head=2, n_embd=16, block_size=8)


@pytest.mark.parametrize("bad,match", [
    (dict(n_kv_head=3), "model.n_kv_head must divide model.n_head"),
    (dict(n_kv_head=0), "model.n_kv_head must be a positive integer"),
    (dict(n_kv_head=8), "model.n_kv_head must divide"),
    (dict(positions="rope", n_head=32), "must be even"),
    (dict(positions="rope", rope_theta=1.0), "model.rope_theta must be"),
    (dict(norm_eps=0.0), "model.norm_eps must be"),
    (dict(mlp_hidden=0), "model.mlp_hidden must be"),
    (dict(norm="batchnorm"), "model.norm must be one of"),
    (dict(positions="alibi"), "model.positions must be one of"),
])
def test_bad_switch_values_raise_one_clear_sentence(bad, match):
    with pytest.raises(ValueError, match=match):
        check_model(config(**bad))


@pytest.mark.parametrize("override", ["model.positions=rope", "model.norm=rmsnorm", "model.mlp=swiglu",
                                      "model.n_kv_head=2", "model.qk_norm=true",
                                      "model.tie_embeddings=false", "model.rope_theta=500000"])
def test_each_switch_is_a_hydra_override(override):
    key, value = override.split("=")
    cfg = compose([override])
    got = getattr(cfg.model, key.split(".")[1])
    assert str(getattr(got, "value", got)).lower() == value.lower() or got == float(value)
