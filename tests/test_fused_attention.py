"""The fused Triton attention against the plain layer: outputs, log-sum-exp and every gradient.

Without a GPU, conftest.py sets TRITON_INTERPRET=1 before triton is imported, so the very same
kernels run on the CPU through Triton's interpreter: slow, hence small shapes and 16-wide tiles
(`model.fused_attention._INTERPRETER_TILES`), which make even these shapes span several tiles.
On a CUDA machine the same tests launch the compiled kernels, and the `cuda` tests at the end
add realistic shapes in bf16 / fp16.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from model.attention import causal_pattern, scaled_dot_product_attention  # noqa: E402
from model.fused_attention import (Tiles, fused_attention_backward,  # noqa: E402
                                   fused_attention_forward, fused_available,
                                   fused_causal_attention)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = DEVICE == "cpu"
if not fused_available(DEVICE):
    pytest.skip("triton can run neither on a GPU nor in its interpreter here (TRITON_INTERPRET=1 "
                "must be set before triton is imported)", allow_module_level=True)

# Largest |fused - reference| allowed, relative to the largest |reference|, or to 1 (the inputs'
# scale) when that is smaller: with a single key dq is exactly 0. float64 and float32 differ only
# in summation order (on a GPU the scale reaches the kernel as an fp32 scalar, hence 1e-6);
# fp16 / bf16 round the inputs, the outputs and P (eps 2^-11 and 2^-8).
TOL = {torch.float64: 1e-12 if INTERPRETED else 1e-6, torch.float32: 2e-5,
       torch.float16: 5e-3, torch.bfloat16: 3e-2}

# (B, h, n, m, d): n queries over m keys, query i at position m - n + i
CASES = {
    "one_key": (1, 1, 1, 1, 16),              # n = m = 1: a row with a single visible key
    "ragged": (2, 2, 37, 37, 32),             # T not a multiple of any tile
    "aligned": (1, 2, 32, 32, 64),            # T a multiple of every tile
    "cached": (2, 1, 5, 29, 16),              # n < m: 24 cached keys, diagonal off the tile grid
    "decode": (1, 2, 1, 40, 32),              # a KV-cache decode step
    "cached_d128": (1, 1, 20, 37, 128),       # offset 17: the diagonal one key past a tile edge
}
LOW_PRECISION_CASES = ["one_key", "ragged", "cached"]


def make_qkv(B, h, n, m, d, dtype, device=DEVICE, requires_grad=True, h_kv=None):
    """q [B, h, n, d], k and v [B, h_kv, m, d] (h_kv = h unless given)."""
    h_kv = h if h_kv is None else h_kv
    q = torch.randn(B, h, n, d, dtype=dtype, device=device)
    k = torch.randn(B, h_kv, m, d, dtype=dtype, device=device)
    v = torch.randn(B, h_kv, m, d, dtype=dtype, device=device)
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def reference(q, k, v, grad_out, scale=None):
    """out, lse and (dq, dk, dv) of the plain layer with mask causal_pattern(n, m), in float64.

    With fewer kv heads than query heads (grouped-query attention), each kv head is repeated
    for the h // h_kv query heads of its group (query head i reads kv head i // group), so dk
    and dv come back summed over the group, as autograd sums over a repeat."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    n, m, d = q.size(-2), k.size(-2), q.size(-1)
    group = q.size(1) // k.size(1)
    k_rep, v_rep = (t.repeat_interleave(group, dim=1) for t in (k, v))  # [B, h, m, d]
    visible = causal_pattern(n, m, device=q.device)
    out, _ = scaled_dot_product_attention(q, k_rep, v_rep, visible, scale=scale)
    scores = (q @ k_rep.transpose(-1, -2)) * (1.0 / math.sqrt(d) if scale is None else scale)
    lse = torch.logsumexp(scores.masked_fill(~visible, -math.inf), dim=-1)
    grads = torch.autograd.grad(out, (q, k, v), grad_out.double())
    return out.detach(), lse.detach(), grads


def assert_close(actual, expected, tol, what):
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    assert torch.isfinite(actual).all(), what
    err = (actual.double() - expected).abs().max().item()
    size = expected.abs().max().item()
    assert err <= tol * max(size, 1.0), f"{what}: max error {err:.3g}, largest value {size:.3g}"


def check_against_reference(q, k, v, scale=None):
    """Forward through autograd, backward with a random dO; compare everything."""
    grad_out = torch.randn_like(q)
    out = fused_causal_attention(q, k, v, scale)
    out.backward(grad_out)
    _, lse = fused_attention_forward(q.detach(), k.detach(), v.detach(), scale)
    ref_out, ref_lse, ref_grads = reference(q, k, v, grad_out, scale)
    tol = TOL[q.dtype]
    assert out.dtype == q.dtype and lse.dtype in (torch.float32, torch.float64)
    assert_close(out, ref_out, tol, "out")
    assert_close(lse, ref_lse, min(tol, 2e-5), "lse")  # lse is float32 or better throughout
    for name, t, g in zip("qkv", (q, k, v), ref_grads):
        assert t.grad.dtype == t.dtype
        assert_close(t.grad, g, tol, f"d{name}")


# ----------------------------------------------------------------------------- vs the reference


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_matches_reference(case, dtype):
    check_against_reference(*make_qkv(*CASES[case], dtype))


@pytest.mark.parametrize("case", LOW_PRECISION_CASES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_matches_reference_in_16_bit(case, dtype):
    check_against_reference(*make_qkv(*CASES[case], dtype))


def test_explicit_scale():
    check_against_reference(*make_qkv(1, 2, 9, 17, 16, torch.float64), scale=0.3)


@pytest.mark.parametrize("n,m", [(50, 50), (19, 54), (16, 48)])  # offset m - n: 0, 35, 32
@pytest.mark.parametrize("fwd,dkdv,dq", [
    ((16, 16), (16, 16), (16, 16)),
    ((32, 16), (16, 32), (32, 16)),   # taller than wide: whole masked rows in diagonal tiles
    ((16, 64), (64, 16), (16, 32)),   # wider than tall: one tile holds several diagonal steps
], ids=["square", "tall", "wide"])
def test_tile_shapes(n, m, fwd, dkdv, dq):
    """The diagonal bookkeeping holds for any tile shape, aligned to the diagonal or not."""
    q, k, v = make_qkv(2, 1, n, m, 16, torch.float64, requires_grad=False)
    grad_out = torch.randn_like(q)
    out, lse = fused_attention_forward(q, k, v, tiles=Tiles(*fwd))
    dq_, dk_, dv_ = fused_attention_backward(q, k, v, out, lse, grad_out,
                                             dkdv_tiles=Tiles(*dkdv), dq_tiles=Tiles(*dq))
    ref_out, ref_lse, (ref_dq, ref_dk, ref_dv) = reference(q, k, v, grad_out)
    tol = TOL[torch.float64]
    for name, a, b in [("out", out, ref_out), ("lse", lse, ref_lse), ("dq", dq_, ref_dq),
                       ("dk", dk_, ref_dk), ("dv", dv_, ref_dv)]:
        assert_close(a, b, tol, name)


@pytest.mark.slow
def test_every_diagonal_alignment():
    """Offsets m - n = 0 .. 16 put the diagonal at every position within a 16-wide tile."""
    n, tiles = 17, Tiles(16, 16)
    for offset in range(17):
        q, k, v = make_qkv(1, 1, n, n + offset, 16, torch.float64, requires_grad=False)
        grad_out = torch.randn_like(q)
        out, lse = fused_attention_forward(q, k, v, tiles=tiles)
        grads = fused_attention_backward(q, k, v, out, lse, grad_out, dkdv_tiles=tiles,
                                         dq_tiles=tiles)
        ref_out, ref_lse, ref_grads = reference(q, k, v, grad_out)
        for name, a, b in zip(["out", "lse", "dq", "dk", "dv"], (out, lse, *grads),
                              (ref_out, ref_lse, *ref_grads)):
            assert_close(a, b, TOL[torch.float64], f"{name}, offset {offset}")


# ----------------------------------------------------------------------- grouped-query attention

# (B, h, h_kv, n, m, d): h // h_kv query heads share each kv head
GQA_CASES = {
    "pairs": (2, 4, 2, 37, 37, 32),          # groups of 2, ragged T
    "multi_query": (1, 4, 1, 20, 20, 16),    # one kv head for all (MQA)
    "cached": (2, 6, 2, 5, 29, 16),          # groups of 3 over a KV cache (n < m)
    "decode": (1, 4, 2, 1, 40, 32),          # a decode step
}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in ("pairs", "cached")
                                  else c for c in GQA_CASES])  # those two: 2-4 s each
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_grouped_query_attention_matches_repeated_kv_heads(case, dtype):
    """k, v with h_kv < h heads: the same as the plain layer with each kv head repeated for its
    group (query head i reads kv head i // (h / h_kv)), dk and dv summed over the group."""
    B, h, h_kv, n, m, d = GQA_CASES[case]
    check_against_reference(*make_qkv(B, h, n, m, d, dtype, h_kv=h_kv))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_grouped_query_attention_in_16_bit(dtype):
    check_against_reference(*make_qkv(1, 4, 19, 19, 16, dtype, h_kv=2))


@pytest.mark.slow
def test_grouped_query_attention_from_one_fused_projection():
    """q, k, v split out of one [B, T, (h + 2 h_kv) d] projection (views, no copy), with tiles
    that leave several query tiles per key tile in each head of the group."""
    B, T, h, h_kv, d = 2, 33, 4, 2, 16
    qkv = torch.randn(B, T, (h + 2 * h_kv) * d, dtype=torch.float64, device=DEVICE,
                      requires_grad=True)
    q, k, v = qkv.split([h * d, h_kv * d, h_kv * d], dim=2)
    q = q.view(B, T, h, d).transpose(1, 2)
    k, v = (t.view(B, T, h_kv, d).transpose(1, 2) for t in (k, v))
    for t in (q, k, v):
        t.retain_grad()
    check_against_reference(q, k, v)
    grad_out = torch.randn_like(q)
    out, lse = fused_attention_forward(q.detach(), k.detach(), v.detach(), tiles=Tiles(16, 32))
    grads = fused_attention_backward(q.detach(), k.detach(), v.detach(), out, lse, grad_out,
                                     dkdv_tiles=Tiles(32, 16), dq_tiles=Tiles(16, 16))
    _, _, ref_grads = reference(q, k, v, grad_out)
    for name, a, b in zip(["dq", "dk", "dv"], grads, ref_grads):
        assert_close(a, b, TOL[torch.float64], name)


# ----------------------------------------------------------------------------- the causal contract


def test_kv_cache_steps_reproduce_the_full_pass():
    """Prefill a prefix, then decode one query at a time: each step equals that row of one pass."""
    T, prefix = 14, 9
    q, k, v = make_qkv(1, 2, T, T, 32, torch.float64, requires_grad=False)
    full, _ = fused_attention_forward(q, k, v)
    chunk, _ = fused_attention_forward(q[:, :, :prefix], k[:, :, :prefix], v[:, :, :prefix])
    torch.testing.assert_close(chunk, full[:, :, :prefix], rtol=0, atol=1e-12)
    for t in range(prefix, T):  # query t over keys 0..t: n = 1, m = t + 1
        step, _ = fused_attention_forward(q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1])
        torch.testing.assert_close(step, full[:, :, t:t + 1], rtol=0, atol=1e-12)


def test_future_keys_have_no_influence():
    """Changing key/value j changes only the outputs of queries at positions >= j."""
    n, m, j = 6, 20, 17  # query i sits at 14 + i: queries 0..2 cannot see key 17
    q, k, v = make_qkv(1, 1, n, m, 16, torch.float64, requires_grad=False)
    out, _ = fused_attention_forward(q, k, v)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, j] += 5.0
    v2[:, :, j] -= 5.0
    out2, _ = fused_attention_forward(q, k2, v2)
    assert torch.equal(out[:, :, :3], out2[:, :, :3])
    assert (out[:, :, 3:] - out2[:, :, 3:]).abs().amax(dim=-1).min() > 1e-6


def test_saves_no_n_by_m_tensor_for_backward():
    """Autograd keeps q, k, v, out and the [B, h, n] lse: nothing with n x m entries."""
    B, h, n, m, d = 1, 2, 24, 24, 16
    q, k, v = make_qkv(B, h, n, m, d, torch.float32)
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fused_causal_attention(q, k, v)
    assert (B, h, n) in saved
    assert all(math.prod(s) <= B * h * m * d for s in saved), saved
    out.sum().backward()  # and the backward runs from those alone
    assert all(t.grad is not None for t in (q, k, v))


@pytest.mark.slow
def test_torch_compile_sees_one_graph():
    """The kernels are opaque operators to torch.compile (on by default on CUDA): no graph break,
    and the compiled forward and backward equal the eager ones."""
    q, k, v = make_qkv(1, 2, 20, 20, 16, torch.float64)

    def loss(q, k, v):
        return (fused_causal_attention(q, k, v) * 2.0).sum()

    assert torch._dynamo.explain(loss)(q, k, v).graph_break_count == 0
    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    grads = torch.autograd.grad(compiled(q, k, v), (q, k, v))
    expected = torch.autograd.grad(loss(q, k, v), (q, k, v))
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=1e-12)


@pytest.mark.parametrize("h_kv", [pytest.param(2, marks=pytest.mark.slow), 1],  # heads: 4.7 s
                         ids=["heads", "grouped"])
def test_opcheck_the_forward_operator(h_kv):
    """torch.library's own tests of a custom op: schema, fake (meta) implementation against the
    real one (shapes, strides, dtypes), autograd registration, and the op under AOT autograd
    with dynamic shapes, forward and backward, against eager. Real kernels, interpreted here."""
    q, k, v = make_qkv(1, 2, 9, 21, 16, torch.float64, h_kv=h_kv)
    torch.library.opcheck(torch.ops.scratch_gpt.fused_attention_fwd.default, (q, k, v, 0.3))


@pytest.mark.slow
def test_opcheck_the_backward_operator():
    q, k, v = make_qkv(2, 4, 9, 21, 16, torch.float64, requires_grad=False, h_kv=2)
    out, lse = fused_attention_forward(q, k, v, 0.3)
    grad_out = torch.randn_like(q)
    torch.library.opcheck(torch.ops.scratch_gpt.fused_attention_bwd.default,
                          (q, k, v, out, lse, grad_out, 0.3))


@pytest.mark.slow
def test_the_whole_model_with_impl_fused_compiles_as_one_graph():
    """GPT with attention.impl=fused under torch.compile(fullgraph=True): the dispatch in the
    layer (fused_available included) and both kernels' operators trace without a graph break,
    and the compiled loss and gradients equal eager ones. The aot_eager backend captures the
    same graphs as the default (inductor) one without generating code for them."""
    from model.config import AttentionConfig, AttentionImpl, ModelConfig
    from model.gpt import GPT

    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=24), 30,
                AttentionConfig(impl=AttentionImpl.fused)).double().to(DEVICE)
    idx = torch.randint(0, 30, (2, 19), device=DEVICE)

    def loss_and_grads(fn):
        model.zero_grad(set_to_none=True)
        loss = fn(idx, idx)[1]
        loss.backward()
        return [loss.detach()] + [p.grad.clone() for p in model.parameters()]

    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(idx, idx)
    assert explained.graph_break_count == 0, explained.break_reasons
    ops = [str(node.target) for graph in explained.graphs for node in graph.graph.nodes]
    assert ops.count("scratch_gpt.fused_attention_fwd.default") == 2  # one per layer
    compiled = loss_and_grads(torch.compile(model, backend="aot_eager", fullgraph=True))
    for a, b in zip(compiled, loss_and_grads(model)):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)


def test_fused_available_is_decided_once_and_traces_without_a_break(monkeypatch):
    import model.fused_attention as fused_module

    assert fused_available(DEVICE)  # decided now, if it was not already
    monkeypatch.setitem(fused_module._AVAILABLE, torch.device(DEVICE).type, False)
    assert not fused_available(DEVICE)  # the stored answer, not a fresh look at the machine
    monkeypatch.undo()

    def layer(x):
        return x * 2 if fused_available(x.device) else x

    torch._dynamo.reset()
    assert torch._dynamo.explain(layer)(torch.ones(3, device=DEVICE)).graph_break_count == 0


# ----------------------------------------------------------------------------- inputs


def test_strided_views_and_partial_gradients():
    """Heads split out of one fused projection (no copy), k from a transposed layout (copied)."""
    B, T, h, d = 2, 21, 2, 16
    qkv = torch.randn(B, T, 3 * h * d, dtype=torch.float64, device=DEVICE, requires_grad=True)
    q, k, v = (t.view(B, T, h, d).transpose(1, 2) for t in qkv.split(h * d, dim=2))
    assert not q.is_contiguous() and q.stride(-1) == 1
    kT = torch.randn(B, h, d, T, dtype=torch.float64, device=DEVICE, requires_grad=True)
    k = kT.transpose(-1, -2)  # stride 1 along T, not along d
    for t in (q, k, v):
        t.retain_grad()
    check_against_reference(q, k, v)
    assert qkv.grad is not None and kT.grad is not None

    # only q needs a gradient: the others simply get none
    q3, k3, v3 = make_qkv(1, 1, 16, 16, 16, torch.float64)
    k3.requires_grad_(False)
    v3.requires_grad_(False)
    fused_causal_attention(q3, k3, v3).sum().backward()
    assert q3.grad is not None and k3.grad is None


def test_rejects_what_it_cannot_compute():
    q, k, v = make_qkv(1, 1, 4, 4, 16, torch.float32, requires_grad=False)
    with pytest.raises(ValueError, match="more queries than keys"):
        fused_attention_forward(q, k[:, :, :3], v[:, :, :3])
    with pytest.raises(ValueError, match="head size"):
        fused_attention_forward(*make_qkv(1, 1, 4, 4, 24, torch.float32, requires_grad=False))
    with pytest.raises(ValueError, match="share one of"):
        fused_attention_forward(q, k.double(), v)
    q3, k2, v2 = make_qkv(1, 3, 4, 4, 16, torch.float32, requires_grad=False, h_kv=2)
    with pytest.raises(ValueError, match="h_kv dividing h = 3"):
        fused_attention_forward(q3, k2, v2)
    with pytest.raises(ValueError, match="h_kv dividing"):  # k and v with different heads
        fused_attention_forward(q3, k2[:, :1], v2)


def test_available_here():
    assert fused_available(DEVICE)
    if INTERPRETED:
        assert fused_available("cpu")


# ----------------------------------------------------------------------------- the self-check


@pytest.fixture
def fresh_self_check():
    """Each test gets its own verdicts: self_check decides once per process otherwise."""
    from model.fused_attention import _self_check

    _self_check.cache_clear()
    yield
    _self_check.cache_clear()


def self_check_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "model.fused_attention" and r.levelname == "WARNING"]


@pytest.mark.parametrize("head_dim,dtype,kv_group", [
    (16, torch.float64, 1), (32, torch.float32, 2), (16, torch.bfloat16, 1)])
def test_self_check_trusts_the_kernels_here(fresh_self_check, caplog, head_dim, dtype, kv_group):
    from model.fused_attention import self_check

    rng = torch.random.get_rng_state()
    verdict = self_check(DEVICE, head_dim, dtype, kv_group)
    assert verdict.ok, verdict.reason
    assert "largest error" in verdict.reason
    assert not self_check_warnings(caplog)
    assert torch.equal(torch.random.get_rng_state(), rng)  # the run's random stream untouched


def test_self_check_decides_once_per_process(fresh_self_check, monkeypatch):
    import model.fused_attention as fused_module

    first = fused_module.self_check(DEVICE, 16, torch.float64)
    monkeypatch.setattr(fused_module, "fused_attention_forward", None)  # would fail if run
    assert fused_module.self_check(DEVICE, 16, torch.float64) is first


def test_self_check_refuses_a_kernel_that_computes_the_wrong_thing(fresh_self_check, caplog,
                                                                   monkeypatch):
    """A kernel 1% off in its output (as a miscompile might be) fails, with one warning line,
    once: asking again gives the same verdict and no second warning."""
    import model.fused_attention as fused_module

    forward = fused_module.fused_attention_forward
    monkeypatch.setattr(fused_module, "fused_attention_forward",
                        lambda *a, **k: (lambda o, lse: (o * 1.01, lse))(*forward(*a, **k)))
    verdict = fused_module.self_check(DEVICE, 16, torch.float32)
    assert not verdict.ok and "tolerance" in verdict.reason, verdict
    assert fused_module.self_check(DEVICE, 16, torch.float32) is verdict
    warning, = self_check_warnings(caplog)
    assert warning.startswith("warning: the fused attention kernel failed its self-check")
    assert "head size 16, float32" in warning and "using the reference attention" in warning
    assert "\n" not in warning


def test_self_check_refuses_a_kernel_that_does_not_launch(fresh_self_check, caplog,
                                                         monkeypatch):
    """A launch that raises (here Triton's out-of-resources error, the way a tile too large for
    the GPU's shared memory fails) gives ok=False with Triton's message, and one warning."""
    import model.fused_attention as fused_module
    from triton.runtime.errors import OutOfResources

    class TooLarge:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise OutOfResources(229_888, 166_912, "shared memory")
            return launch

    monkeypatch.setattr(fused_module, "_bwd_dkdv_kernel", TooLarge())
    verdict = fused_module.self_check(DEVICE, 32, torch.float64, kv_group=2)
    assert not verdict.ok
    assert verdict.reason.startswith("OutOfResources: out of resource: shared memory"), verdict
    warning, = self_check_warnings(caplog)
    assert "2 query heads per kv head" in warning and "OutOfResources" in warning


def test_self_check_counts_nan_as_a_failure(fresh_self_check, caplog, monkeypatch):
    import model.fused_attention as fused_module

    backward = fused_module.fused_attention_backward
    monkeypatch.setattr(fused_module, "fused_attention_backward",
                        lambda *a, **k: [g.fill_(math.nan) for g in backward(*a, **k)])
    verdict = fused_module.self_check(DEVICE, 16, torch.float64)
    assert not verdict.ok and "inf" in verdict.reason, verdict
    assert len(self_check_warnings(caplog)) == 1


def test_self_check_says_what_it_does_not_support_without_a_warning(fresh_self_check, caplog):
    from model.fused_attention import self_check

    verdict = self_check(DEVICE, 24, torch.float32)
    assert not verdict.ok and "not supported" in verdict.reason
    assert not self_check(DEVICE, 16, torch.int32).ok
    assert not self_check_warnings(caplog)


# ----------------------------------------------------------------------------- GPU only


def _rel_err(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("B,h,n,m,d", [
    (2, 4, 1024, 1024, 64),    # training shape
    (1, 4, 2048, 2048, 128),
    (2, 4, 256, 1024, 64),     # chunked prefill over a cache
    (4, 4, 1, 1024, 64),       # decode step
])
def test_gpu_realistic_shapes(dtype, B, h, n, m, d):
    """As accurate as PyTorch's own 16-bit attention, against an fp32 reference of the same inputs.

    Both are compared with the plain layer run in fp32 on the 16-bit inputs; ours may be at
    most twice as far off as PyTorch's fused SDPA in the same dtype (plus a small floor).
    """
    q, k, v = make_qkv(B, h, n, m, d, dtype, device="cuda", requires_grad=False)
    grad_out = torch.randn_like(q)
    visible = causal_pattern(n, m, device="cuda")

    def run(fn, dtype):
        leaves = [t.to(dtype, copy=True).requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        out.backward(grad_out.to(dtype))
        return [out.detach()] + [t.grad for t in leaves]

    ref = run(lambda a, b, c: scaled_dot_product_attention(a, b, c, visible)[0], torch.float32)
    ours = run(fused_causal_attention, dtype)
    # PyTorch's SDPA in the same dtype; its is_causal is top-left aligned, so n < m takes the mask
    torch_ = run(lambda a, b, c: F.scaled_dot_product_attention(
        a, b, c, attn_mask=None if n == m else visible, is_causal=n == m), dtype)
    for name, o, t, r in zip(["out", "dq", "dk", "dv"], ours, torch_, ref):
        assert torch.isfinite(o).all(), name
        err, baseline = _rel_err(o, r), _rel_err(t, r)
        assert err <= 2 * baseline + 1e-3, f"{name}: ours {err:.3g} vs PyTorch {baseline:.3g}"
        assert err <= TOL[dtype], f"{name}: {err:.3g}"


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("h_kv", [4, 2], ids=["heads", "grouped"])
def test_gpu_runs_are_bitwise_deterministic(h_kv):
    """Every program owns the rows it writes (no atomics, a fixed order over a group's heads):
    two runs on the same inputs give the same bits."""
    q, k, v = make_qkv(2, 4, 1000, 1000, 64, torch.bfloat16, device="cuda",
                       requires_grad=False, h_kv=h_kv)
    grad_out = torch.randn_like(q)

    def run():
        out, lse = fused_attention_forward(q, k, v)
        return [out, lse, *fused_attention_backward(q, k, v, out, lse, grad_out)]

    for a, b in zip(run(), run()):
        assert torch.equal(a, b)


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("T", [4096, 8192])
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_long_context_stays_finite_and_close_to_sdpa(T, d):
    """At T = 4096 and 8192 in bf16 the running softmax keeps every value finite, and the
    output and gradients stay as close to PyTorch's own bf16 attention as at short T."""
    leaves = make_qkv(1, 4, T, T, d, torch.bfloat16, device="cuda", h_kv=2)
    grad_out = torch.randn_like(leaves[0])
    ours = fused_causal_attention(*leaves)
    ours.backward(grad_out)
    ours_grads = [t.grad for t in leaves]
    rep = [t.detach().clone().requires_grad_() for t in leaves]
    k_rep, v_rep = (t.repeat_interleave(2, dim=1) for t in rep[1:])
    theirs = F.scaled_dot_product_attention(rep[0], k_rep, v_rep, is_causal=True)
    theirs.backward(grad_out)
    for name, a, b in zip(["out", "dq", "dk", "dv"], [ours] + ours_grads,
                          [theirs] + [t.grad for t in rep]):
        assert torch.isfinite(a).all(), name
        assert _rel_err(a, b) <= 2 * TOL[torch.bfloat16], f"{name}: {_rel_err(a, b):.3g}"


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("d,dtype,tf32", [
    *[(d, dtype, False) for dtype in (torch.bfloat16, torch.float16) for d in (16, 32, 64, 128)],
    (64, torch.float32, True), (64, torch.float32, False)])
def test_gpu_self_check_trusts_the_kernels(d, dtype, tf32, monkeypatch):
    """No false alarm on a real GPU: the self-check passes for every head size in the training
    dtypes (fp32, with and without tf32, at one), with and without grouped-query attention."""
    from model.fused_attention import self_check

    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", tf32)
    for group in (1, 2):
        verdict = self_check("cuda", d, dtype, group)
        assert verdict.ok, (group, verdict.reason)


@pytest.mark.cuda
@needs_gpu
def test_gpu_compiled_step_with_cuda_graphs_captures_the_kernels():
    """torch.compile(mode="reduce-overhead") records the step, fused kernels included, as CUDA
    graphs (Inductor counts every graph it had to skip), and trains as eager does."""
    from torch._dynamo.utils import counters

    from model.config import AttentionConfig, AttentionImpl, ModelConfig
    from model.gpt import GPT

    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layer=2, n_head=4, n_embd=256, block_size=256), 64,
                AttentionConfig(impl=AttentionImpl.fused)).cuda()
    idx = torch.randint(0, 64, (8, 256), device="cuda")

    def losses(step):
        out = []
        for _ in range(3):
            torch.compiler.cudagraph_mark_step_begin()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = step(idx, idx)[1]
            loss.backward()
            out.append(loss.detach().clone())
        return torch.stack(out)

    torch._dynamo.reset()
    counters.clear()
    compiled = losses(torch.compile(model, mode="reduce-overhead"))
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    model.zero_grad(set_to_none=True)
    torch.testing.assert_close(compiled, losses(model), atol=2e-2, rtol=0)


# ----------------------------------------------------------------------------- in the model


@pytest.mark.slow
def test_the_layer_with_impl_fused_matches_the_reference_layer_with_a_cache(monkeypatch):
    """attention.impl=fused routes the layer through the kernel: the same outputs and
    gradients as the reference layer on the same weights, for a full pass and for a prefill
    plus decode steps over a growing KV cache."""
    import model.fused_attention as fused_module
    from model.config import AttentionConfig, AttentionImpl, ModelConfig
    from model.gpt import GPT

    calls = []
    kernel = fused_module.fused_causal_attention
    monkeypatch.setattr(fused_module, "fused_causal_attention",
                        lambda *a, **k: calls.append(a[0].shape) or kernel(*a, **k))

    size = ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=24)
    torch.manual_seed(0)
    models = {impl: GPT(size, 30, AttentionConfig(impl=impl)).double().to(DEVICE)
              for impl in (AttentionImpl.reference, AttentionImpl.fused)}
    models[AttentionImpl.fused].load_state_dict(models[AttentionImpl.reference].state_dict())
    idx = torch.randint(0, 30, (2, 19), device=DEVICE)
    grads = {}
    for impl, model in models.items():
        logits, loss = model(idx, idx)
        loss.backward()
        grads[impl] = (logits.detach(), [p.grad for p in model.parameters()])
    (ref_logits, ref_grads), (fused_logits, fused_grads) = grads.values()
    assert len(calls) == 2  # the kernel ran, once per layer (and the reference layer never)
    torch.testing.assert_close(fused_logits, ref_logits, atol=1e-10, rtol=0)
    for a, b in zip(fused_grads, ref_grads):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)
    fused = models[AttentionImpl.fused].eval()
    with torch.no_grad():
        cache = fused.new_cache(2)
        steps = [fused(idx[:, :12], cache=cache)[0]] + [
            fused(idx[:, t:t + 1], cache=cache)[0] for t in range(12, 19)]
        torch.testing.assert_close(torch.cat(steps, 1), ref_logits, atol=1e-10, rtol=0)
    assert calls[-1] == (2, 2, 1, 16)  # decode steps too: one query over the cached keys


def test_impl_fused_refuses_what_the_kernel_cannot_do():
    from guard.limits import check_attention
    from model.config import AttentionConfig, AttentionImpl, MaskMode
    from model.attention import CausalSelfAttention

    with pytest.raises(ValueError, match="pitfall 'mask_zero'"):
        check_attention(AttentionConfig(name="mask_zero", mask_value=0.0,
                                        impl=AttentionImpl.fused))
    with pytest.raises(ValueError, match="pitfall"):
        check_attention(AttentionConfig(name="x", mask_mode=MaskMode.after_softmax,
                                        impl=AttentionImpl.fused))
    layer = CausalSelfAttention(24, 2, 8, AttentionConfig(impl=AttentionImpl.fused)).to(DEVICE)
    with pytest.raises(ValueError, match="head sizes"):  # d_k = 12 is not a power of two
        layer(torch.randn(1, 8, 24, device=DEVICE))


def test_the_fused_layer_reads_a_float32_cache_under_bf16_autocast():
    """Sampling during training runs under autocast with a cache in the weights' dtype: the
    kernel gets bf16 queries and float32 cached keys, which the layer must reconcile."""
    from model.config import AttentionConfig, AttentionImpl, ModelConfig
    from model.gpt import GPT

    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=16), 30,
                AttentionConfig(impl=AttentionImpl.fused)).to(DEVICE)
    prompt = torch.randint(0, 30, (1, 4), device=DEVICE)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        tokens = list(model.generate(prompt, 3, greedy=True, static_cache=False))
    assert len(tokens) == 3
