"""bf16 autocast tracks fp32: the same tiny model, data and seed, trained both ways.

bf16 keeps 8 bits of mantissa (relative rounding ~4e-3), the weights and AdamW state stay fp32
and softmax / loss run in fp32, so the two loss curves should agree to a few hundredths of a
nat while both fall by more than a nat; a 0.05 tolerance catches a broken mixed-precision path
(say, softmax in bf16 with -inf masks, or an fp32 reduction dropped) without flaking.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from data.batches import RandomWindows
from helpers import shakespeare_like
from model.config import ModelConfig
from model.gpt import GPT
from training.device import NATIVE_BF16_ENV, autocast, pick_dtype

STEPS = 60
TOLERANCE = 0.05


def train_curve(dtype: torch.dtype) -> list[float]:
    text = shakespeare_like(20_000, seed=5)
    vocab = sorted(set(text))
    tokens = np.array([vocab.index(c) for c in text], dtype=np.uint16)
    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layer=2, n_head=4, n_embd=32, block_size=32), len(vocab))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sampler = RandomWindows(tokens, 32, 16, seed=0)
    amp = autocast(torch.device("cpu"), dtype)
    curve = []
    for _ in range(STEPS):
        x, y = sampler.next_batch()
        with amp:
            _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        curve.append(loss.item())
    return curve


@pytest.mark.slow  # 9 s on 2 cores
def test_bf16_autocast_tracks_fp32():
    fp32, bf16 = train_curve(torch.float32), train_curve(torch.bfloat16)
    assert fp32[0] - fp32[-1] > 1.0  # it learns, so tracking is meaningful
    worst = max(abs(a - b) for a, b in zip(fp32, bf16))
    assert worst < TOLERANCE, worst
    assert fp32 != bf16  # bf16 really ran: the curves are not bit-identical


def test_auto_without_a_model_to_measure_is_fp32_on_a_cpu_unless_forced(monkeypatch):
    """pick_dtype (for callers without a model, e.g. the benchmarks) never guesses bf16 from a
    CPU flag: train.py measures (training/dtype_probe.py, tests/test_dtype_probe.py)."""
    monkeypatch.delenv(NATIVE_BF16_ENV, raising=False)
    monkeypatch.setattr("training.device.cpu_has_native_bf16", lambda: True)
    assert pick_dtype("auto", torch.device("cpu")) == torch.float32
    assert pick_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
    assert pick_dtype("float32", torch.device("cpu")) == torch.float32


def test_the_environment_can_decide_for_the_cpu(monkeypatch):
    monkeypatch.setenv(NATIVE_BF16_ENV, "1")
    assert pick_dtype("auto", torch.device("cpu")) == torch.bfloat16
    monkeypatch.setenv(NATIVE_BF16_ENV, "0")
    assert pick_dtype("auto", torch.device("cpu")) == torch.float32
