"""bench.attention's SDPA rows: each is pinned to the backend it names, or skipped with SDPA's
reason, and the unit of the ratios is the first that ran. (tests/test_bench.py runs the bench
itself, `quick=true`, as a user does.)"""
from __future__ import annotations

import torch
from torch.nn.attention import SDPBackend

from bench import attention as bench
from model.config import AttentionConfig, ModelConfig


def test_a_pinned_row_runs_the_backend_it_names():
    q = torch.randn(1, 2, 16, 8, requires_grad=True)
    out = bench.sdpa_core(SDPBackend.FLASH_ATTENTION)(q, q, q)
    assert "Flash" in type(out.grad_fn).__name__
    math_out = bench.sdpa_core(SDPBackend.MATH)(q, q, q)
    assert "Flash" not in type(math_out.grad_fn).__name__
    torch.testing.assert_close(out, math_out)


def test_a_backend_that_cannot_run_is_skipped_with_its_reason(monkeypatch):
    """On a CPU the memory-efficient backend does not exist: asked for it (as on CUDA), the
    bench skips that row, says why, and times the others against the first that ran."""
    backends = {"SDPA (efficient)": SDPBackend.EFFICIENT_ATTENTION,
                "SDPA (flash)": SDPBackend.FLASH_ATTENTION}
    monkeypatch.setattr(bench, "sdpa_backends", lambda device: backends)
    rows = bench.measure(ModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=32),
                         AttentionConfig(), 32, "fp32", 64, torch.device("cpu"), reps=1,
                         warmup=0, fused=None)
    by_arm = {r["arm"]: r for r in rows}
    skipped = by_arm["SDPA (efficient)"]
    assert skipped["skipped"] and skipped["ok"]
    assert "scaled_dot_product_attention" in skipped["error"]
    flash, ours = by_arm["SDPA (flash)"], by_arm[bench.REFERENCE]
    assert flash["unit"] == ours["unit"] == "SDPA (flash)" and flash["ratio"] == 1.0
    assert ours["ok"] and ours["fwd_s"] > 0 and ours["bwd_s"] > 0
    assert ours["ratio"] == (ours["fwd_s"] + ours["bwd_s"]) / (flash["fwd_s"] + flash["bwd_s"])


def test_flops_count_the_causal_half_and_a_backward_of_two_and_a_half_forwards():
    B, T, C = 2, 64, 32
    fwd, bwd = bench.layer_flops(B, T, C)
    projections = 2 * B * T * (C * 3 * C + C * C)     # qkv and out_proj, 2 FLOPs per MAC
    core = 2 * 2 * B * T * T * C / 2                  # Q K^T and P V over half the pairs
    assert (fwd, bwd) == (projections + core, 2 * projections + 2.5 * core)


def test_decode_times_one_query_over_the_cache_against_pinned_sdpa():
    model = ModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=64)
    times, diffs, skipped = bench.decode_step_times(model, 40, 2, torch.float32,
                                                    torch.device("cpu"), reps=1, warmup=0,
                                                    fused=None)
    assert set(times) == {"SDPA (flash)", bench.REFERENCE} and not skipped
    assert all(t > 0 for t in times.values())
    assert diffs[bench.REFERENCE] < 1e-5  # the reference layer's core, unmasked: the same
