"""The attention checker on modern layers and the course's shapes: a Llama-style layer (rotary
positions, grouped key/value heads, QK-norm) judged and its mistakes named by the second study's
switches; a scaled dot-product function on the cheat sheet's 2-D tensors; CS336's adapter
functions recognised by their signatures, with weights the checker makes.

The checks run in one shared sandbox host (a fork per check); several checks per test.
"""
from __future__ import annotations

import pytest
import torch

from check_helpers import ITEMS, PROBES, failing, run, sandbox, text  # noqa: F401 (a fixture)
from check_attention import layouts
from check_attention.sandbox import course



# ----------------------------------------------------------------------------- without a sandbox


def test_adapters_are_recognised_by_their_signatures():
    import tests.attention_layers.cs336_adapters as student  # plain functions: safe to import
    assert course.adapter_kind(student.run_multihead_self_attention) == "mha"
    assert course.adapter_kind(student.run_multihead_self_attention_wrong) == "mha"
    assert course.adapter_kind(student.run_multihead_self_attention_with_rope) == "mha_rope"
    assert course.adapter_kind(student.run_scaled_dot_product_attention) is None  # a function
    assert course.adapter_kind(lambda d_model, num_heads, x: x) is None


def test_theta_is_the_layers_own_then_ours():
    d_k = 16
    inv_freq = 500000.0 ** (-torch.arange(0, d_k, 2, dtype=torch.float64) / d_k)
    assert layouts.thetas({"attrs": {}, "buffers": {}}, d_k) == [10000.0, 500000.0]
    assert layouts.thetas({"attrs": {"rope_theta": 1e6}}, d_k) == [1e6, 10000.0, 500000.0]
    assert layouts.thetas({"attrs": {}, "buffers": {"rotary.inv_freq": inv_freq}}, d_k)[0] \
        == 500000.0


# ----------------------------------------------------------------------------- in the sandbox


@pytest.mark.slow
def test_correct_modern_layers_pass_every_item(sandbox):
    layouts = {}
    for name in ("LlamaAttention", "QKNorm", "QKLayerNorm", "Interleaved", "MultiQuery",
                 "Theta500k", "HiddenTheta", "FromConfig", "FusedQKV"):
        report = run(sandbox, f"llama_rope_gqa.py:{name}")
        assert {k: i.status for k, i in report.items.items()} == \
            dict.fromkeys(ITEMS + PROBES, "PASS"), text(report)  # all 13, the probes too
        assert report.exit_code == 0
        layouts[name] = report.header["layout"]
    assert "k_proj, v_proj [64 -> 32]" in layouts["LlamaAttention"]
    assert "2 key/value heads for 4 query heads" in layouts["LlamaAttention"]
    assert "rotary positions (rotate-half pairs, theta 10000)" in layouts["LlamaAttention"]
    assert "QK-norm: RMSNorm of each head's q and k (q_norm, k_norm)" in layouts["QKNorm"]
    assert "QK-norm: LayerNorm" in layouts["QKLayerNorm"]
    assert "fused q/k/v Linear qkv_proj [64 -> 128] (q, then k and v of 32 rows)" in \
        layouts["FusedQKV"]
    assert "interleaved pairs" in layouts["Interleaved"]
    assert "multi-query: 1 key/value head" in layouts["MultiQuery"]
    assert "theta 500000)" in layouts["Theta500k"]
    assert "theta 1000000, fitted)" in layouts["HiddenTheta"]
    assert "2 key/value heads for 4 query heads" in layouts["FromConfig"]  # config.n_kv_heads
    # a layer with rotary positions and the classic layout (it was "not judged" before)
    assert run(sandbox, "odd.py:Rotary").exit_code == 0


@pytest.mark.slow
def test_the_probes_judge_modern_layers_against_the_modern_reference(sandbox):
    # gradients through rotary positions, the kv heads' repeat and QK-norm, and the rotary
    # tables of each length (the CS336 adapter gets its weights as arguments)
    for target in ("llama_rope_gqa.py:QKNorm", "cs336_adapters.py:"
                   "run_multihead_self_attention_with_rope"):
        report = run(sandbox, target)
        assert report.exit_code == 0 and len(report.items) == 13, text(report)
        assert report.items["lengths"].detail == "lengths 1, 7, 65, 129, 257", text(report)
        if "QKNorm" in target:
            assert "q_norm.weight.grad, k_norm.weight.grad within" in \
                report.items["backward"].detail
    # a right forward with a custom backward that forgets the softmax Jacobian's second term
    report = run(sandbox, "llama_rope_gqa.py:WrongBackward")
    assert failing(report) == {"backward"}, text(report)
    detail = report.items["backward"].detail
    assert detail.startswith("backward is wrong: ") and \
        "; right: v_proj.weight.grad, o_proj.weight.grad;" in detail, detail
    assert "2 key/value heads for 4 query heads; rotary positions" in report.header["layout"]


@pytest.mark.slow
def test_the_second_studys_mistakes_are_named(sandbox):
    for name, switch, words, options in (
            ("RopeOnValues", "rope_on_values", "values are rotated too", {}),
            # tiled heads are a mistake for weights trained in Llama's order only (without
            # llama_weights they pass with a note: tests/test_check_attention_causes.py)
            ("TiledGroups", "gqa_repeat_mismatch", "reads another group's keys",
             {"llama_weights": True})):
        report = run(sandbox, f"llama_rope_gqa.py:{name}", **options)
        assert failing(report) == {"equation"}, text(report)
        assert words in report.items["equation"].detail
        assert any(f"attention={switch} " in d for d in report.diagnosis), report.diagnosis
    # no variant reproduces q and k rotated with different pair layouts: the equation fails,
    # the black-box checks still judge what they can
    report = run(sandbox, "llama_rope_gqa.py:MixedPairs")
    assert failing(report) == {"equation"}, text(report)
    assert "no variant of ours reproduces it, with or without rotary positions" in \
        report.items["equation"].detail
    assert report.items["causal"].status == "PASS" and report.items["scale"].status == "SKIP"


@pytest.mark.slow
def test_cs336_adapters_are_judged_as_they_are(sandbox):
    for name in ("run_multihead_self_attention", "run_multihead_self_attention_with_rope"):
        report = run(sandbox, f"cs336_adapters.py:{name}")
        assert report.exit_code == 0, text(report)
        assert f"the CS336 adapter {name}(d_model=64, num_heads=4" in report.header["layer"]
    assert "interleaved pairs, theta 10000" in report.header["layout"]
    report = run(sandbox, "cs336_adapters.py:run_scaled_dot_product_attention")
    assert report.exit_code == 0, text(report)
    assert report.header["mask"].startswith("boolean, True = may attend")

    report = run(sandbox, "cs336_adapters.py:run_multihead_self_attention_wrong")
    assert failing(report) == {"scale", "equation"}, text(report)
    assert "divided by sqrt(d_model) = 8.0, not sqrt(d_k) = 4.0" in report.items["scale"].detail
    report = run(sandbox, "cs336_adapters.py:run_multihead_self_attention_with_rope_wrong")
    assert failing(report) == {"equation"}, text(report)
    assert "values are rotated too" in report.items["equation"].detail


@pytest.mark.slow
def test_the_sheets_2d_function(sandbox):
    report = run(sandbox, "sheet_2d.py:attention")
    assert report.exit_code == 0, text(report)
    assert report.header["probes"].startswith("q, k, v [8, 16]")
    assert "the sheet's 2-D shapes" in report.header["layer"]
    assert report.header["mask"].startswith("additive")
    report = run(sandbox, "sheet_2d.py:attention_no_scale")
    assert failing(report) == {"scale", "equation"}, text(report)
    assert "not divided at all" in report.items["scale"].detail
