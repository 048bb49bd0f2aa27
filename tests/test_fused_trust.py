"""Whether impl=auto may hand a layer to our Triton kernel: only on CUDA, and only once the
kernel's self-check passed there (model/fused_attention.py, trust_fused_attention; guard/limits.py,
check_fused_kernel). The self-check itself is model/fused_attention.py's, tested on a GPU in
tests/test_fused_attention.py; here it is replaced, to test what its verdict decides."""
from __future__ import annotations

import pytest
import torch

import model.fused_attention as fused_attention
from safeio.cli import UserError
from guard.limits import check_fused_kernel
from model.attention import CausalSelfAttention
from model.fast_paths import trust_fused_attention
from model.config import AttentionConfig, AttentionImpl, ModelConfig
from model.gpt import GPT

CUDA = torch.device("cuda", 0)  # a device name only: nothing is allocated on it


def gpt(impl=AttentionImpl.auto, name="correct", mask_value=float("-inf"), **model) -> GPT:
    cfg = ModelConfig(n_layer=2, n_head=4, n_embd=64, block_size=16, **model)
    return GPT(cfg, 50, AttentionConfig(name=name, mask_value=mask_value, impl=impl))


def layers(model: GPT) -> list[CausalSelfAttention]:
    return [m for m in model.modules() if isinstance(m, CausalSelfAttention)]


@pytest.fixture
def verdict(monkeypatch):
    """Pretend Triton runs on CUDA; the self-check's verdict is `verdict.ok`, its calls logged."""
    class Verdict:
        ok, calls = True, []
    monkeypatch.setattr(fused_attention, "fused_available", lambda device: True)

    def self_check(device, head_dim, dtype, kv_group=1):
        Verdict.calls.append((torch.device(device), head_dim, dtype, kv_group))
        return fused_attention.KernelCheck(Verdict.ok, "pretend")
    monkeypatch.setattr(fused_attention, "self_check", self_check)
    return Verdict


def test_no_layer_is_trusted_until_the_check_passes(verdict):
    model = gpt()
    assert not any(layer.fused_trusted for layer in layers(model))
    assert trust_fused_attention(model, torch.device("cpu"), torch.float32) is None  # not CUDA
    assert not verdict.calls and not any(layer.fused_trusted for layer in layers(model))
    assert trust_fused_attention(model, CUDA, torch.bfloat16).ok
    assert all(layer.fused_trusted for layer in layers(model))
    assert verdict.calls == [(CUDA, 16, torch.bfloat16, 1)]  # head size 64 / 4, dtype as asked


def test_a_failed_check_keeps_auto_on_the_reference_attention(verdict):
    verdict.ok = False
    model = gpt()
    check_fused_kernel(model, CUDA, torch.float32)  # impl=auto: no error, the reference runs
    assert not any(layer.fused_trusted for layer in layers(model))


def test_a_failed_check_refuses_impl_fused(verdict):
    verdict.ok = False
    with pytest.raises(UserError, match="attention.impl=fused: the kernel failed its self-check"):
        check_fused_kernel(gpt(AttentionImpl.fused), CUDA, torch.float32)


def test_grouped_heads_are_checked_with_their_group(verdict):
    trust_fused_attention(gpt(n_kv_head=2), CUDA, torch.float32)
    assert verdict.calls[-1][3] == 2  # 4 query heads over 2 key/value heads


@pytest.mark.parametrize("case", ["reference", "pitfall"])
def test_layers_that_never_use_the_kernel_are_not_checked(verdict, case):
    model = gpt(AttentionImpl.reference) if case == "reference" else gpt(name="mask_zero",
                                                                          mask_value=0.0)
    assert trust_fused_attention(model, CUDA, torch.float32) is None and not verdict.calls


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_default_model_trusts_the_kernel():
    model = gpt().cuda()
    verdict = trust_fused_attention(model, torch.device("cuda"), torch.bfloat16)
    assert verdict is not None and verdict.ok, verdict
    assert all(layer.fused_trusted for layer in layers(model))
