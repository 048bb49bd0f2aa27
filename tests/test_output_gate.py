"""The per-head output gate (model.attn_gate, on in the default model since round 4 of
docs/budget.md): off, it changes nothing; on, it adds only W_g, stays causal, learns, and no
export format takes it. That it agrees with the KV cache, growing and static, is
tests/test_architecture.py's check of every switch."""
from __future__ import annotations

import torch

from interop.hf import gpt2_problems
from interop.hf_llama import llama_problems
from model.config import ModelConfig
from model.gpt import GPT
from training.optim import make_optimizer
from training.config import OptimConfig

D = torch.float64
VOCAB = 41


def make(seed=0, **switches) -> GPT:
    torch.manual_seed(seed)
    cfg = ModelConfig(n_layer=4, n_head=4, n_embd=32, block_size=16, positions="rope",
                      mlp="relu2", n_kv_head=2, **switches)
    model = GPT(cfg, VOCAB).to(D)
    with torch.no_grad():  # weights far from init, so that every path carries a signal
        for name, p in model.named_parameters():
            if "ln" not in name:
                p.normal_(0.0, 0.2)
    return model.eval()


def params(**switches) -> set[str]:
    return {n for n, _ in make(**switches).named_parameters()}


def test_the_gate_off_is_the_model_it_was_and_on_adds_only_its_own_parameters():
    idx = torch.randint(0, VOCAB, (2, 16))
    torch.testing.assert_close(make(attn_gate=False)(idx)[0], make()(idx)[0], rtol=0, atol=0)
    assert params(attn_gate=True) - params() == {f"blocks.{i}.attn.gate.{w}" for i in range(4)
                                                 for w in ("weight", "bias")}
    assert not torch.allclose(make(attn_gate=True)(idx)[0], make()(idx)[0])


def test_a_future_token_never_changes_an_earlier_logit():
    model = make(attn_gate=True)
    idx = torch.randint(0, VOCAB, (2, 16))
    changed = idx.clone()
    changed[:, 9:] = (changed[:, 9:] + 1) % VOCAB
    torch.testing.assert_close(model(changed)[0][:, :9], model(idx)[0][:, :9], rtol=0, atol=0)


def test_the_gate_learns_and_gets_a_gradient():
    model = make(attn_gate=True).float().train()
    optimizer = make_optimizer(model, OptimConfig(lr=3e-3), torch.float32)
    idx = torch.randint(0, VOCAB, (4, 16))
    losses = []
    for _ in range(30):
        loss = model(idx, idx.roll(-1, 1))[1]
        loss.backward()
        assert model.get_parameter("blocks.0.attn.gate.weight").grad.abs().sum() > 0
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses


def test_no_export_format_has_weights_for_it():
    cfg = ModelConfig(attn_gate=True)
    assert any("model.attn_gate=" in p for p in gpt2_problems(cfg))
    assert any("model.attn_gate=" in p for p in llama_problems(cfg))
