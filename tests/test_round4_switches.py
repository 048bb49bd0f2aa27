"""Round 4's switches (model/config.py, docs/model.md): value residual, U-net skips, the per-head
output gate, exclusive self-attention, multi-token prediction, the hashed bigram embedding and
the smear gate. Each off changes nothing;
each on stays causal, agrees with the KV cache, learns, and keeps what it promises."""
from __future__ import annotations

import pytest
import torch

from interop.hf_llama import llama_problems
from model.attention import exclude_own_value
from model.config import ModelConfig, gpt2_problems
from model.gpt import GPT
from training.optim import make_optimizer
from training.config import OptimConfig

D = torch.float64
VOCAB = 41
SWITCHES = {"value_residual": True, "unet_skips": True, "attn_gate": True, "xsa": True,
            "mtp": 0.5, "bigram_buckets": 64, "smear": True}
ALL_ON = {**SWITCHES}


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


def test_each_switch_off_is_the_model_it_was():
    base = make()
    idx = torch.randint(0, VOCAB, (2, 16))
    for key, off in [("value_residual", False), ("unet_skips", False), ("attn_gate", False),
                     ("xsa", False), ("mtp", 0.0), ("bigram_buckets", 0), ("smear", False)]:
        torch.testing.assert_close(make(**{key: off})(idx)[0], base(idx)[0], rtol=0, atol=0)
    assert params(**{k: type(v)(0) for k, v in SWITCHES.items()}) == params()


def test_each_switch_adds_only_its_own_parameters():
    base = params()
    assert params(value_residual=True) - base == {f"blocks.{i}.attn.value_mix" for i in (1, 2, 3)}
    assert params(unet_skips=True) - base == {"skip_weights"}
    assert params(attn_gate=True) - base == {f"blocks.{i}.attn.gate.{w}" for i in range(4)
                                             for w in ("weight", "bias")}
    assert params(xsa=True) == base
    assert params(mtp=0.5) - base == {"mtp_proj.weight"}
    assert params(bigram_buckets=64) - base == {"bigram.weight"}
    assert params(smear=True) - base == {"smear_gate.weight", "smear_lam"}
    for key, on in SWITCHES.items():
        idx = torch.randint(0, VOCAB, (2, 16))
        assert not torch.allclose(make(**{key: on})(idx)[0], make()(idx)[0]) or key == "mtp"


@pytest.mark.parametrize("switches", [{k: v} for k, v in SWITCHES.items()] + [ALL_ON],
                         ids=[*SWITCHES, "all"])
def test_a_future_token_never_changes_an_earlier_logit(switches):
    model = make(**switches)
    idx = torch.randint(0, VOCAB, (2, 16))
    changed = idx.clone()
    changed[:, 9:] = (changed[:, 9:] + 1) % VOCAB
    torch.testing.assert_close(model(changed)[0][:, :9], model(idx)[0][:, :9], rtol=0, atol=0)


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("switches", [{k: v} for k, v in SWITCHES.items()] + [ALL_ON],
                         ids=[*SWITCHES, "all"])
def test_the_kv_cache_gives_the_full_forward_pass_logits(switches, static):
    model = make(**switches)
    idx = torch.randint(0, VOCAB, (2, 16))
    full, _ = model(idx)
    cache = model.new_cache(2, static=static)
    outs, pos = [], 0
    for n in [5, 1, 1, 4, 5]:
        outs.append(model(idx[:, pos:pos + n], cache=cache)[0])
        pos += n
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-10, rtol=0)


def test_exclusive_attention_leaves_each_output_orthogonal_to_its_own_value():
    y, v = torch.randn(2, 4, 7, 8, dtype=D), torch.randn(2, 4, 7, 8, dtype=D)
    out = exclude_own_value(y, v)
    # to the eps that keeps a zero value vector finite (1e-6 against |v|^2 ~ 8)
    torch.testing.assert_close((out * v).sum(-1), torch.zeros(2, 4, 7, dtype=D), atol=1e-5,
                               rtol=0)
    assert (out * v).sum(-1).abs().max() < 1e-3 * (y * v).sum(-1).abs().max()
    # what is orthogonal to v already passes unchanged
    across = out - (out * v).sum(-1, keepdim=True) * v / (v * v).sum(-1, keepdim=True)
    torch.testing.assert_close(exclude_own_value(across, v), across)


def test_value_residual_at_lam_1_is_each_layer_s_own_values():
    plain, mixed = make(), make(value_residual=True)
    mixed.load_state_dict(plain.state_dict(), strict=False)  # the same weights, and lam = 1:
    with torch.no_grad():
        for block in mixed.blocks[1:]:
            block.attn.value_mix.fill_(1.0)
    idx = torch.randint(0, VOCAB, (2, 16))
    torch.testing.assert_close(mixed(idx)[0], plain(idx)[0], rtol=0, atol=1e-12)


def test_unet_skips_at_weight_0_are_the_plain_model():
    plain, skipped = make(), make(unet_skips=True)
    skipped.load_state_dict(plain.state_dict(), strict=False)
    with torch.no_grad():
        skipped.skip_weights.zero_()
    idx = torch.randint(0, VOCAB, (2, 16))
    torch.testing.assert_close(skipped(idx)[0], plain(idx)[0], rtol=0, atol=0)


def test_multi_token_prediction_adds_the_after_next_loss_in_training_only():
    plain, mtp = make(), make(mtp=0.5)
    mtp.load_state_dict(plain.state_dict(), strict=False)
    idx, targets = torch.randint(0, VOCAB, (2, 16)), torch.randint(0, VOCAB, (2, 16))
    eval_loss = mtp(idx, targets)[1]
    torch.testing.assert_close(eval_loss, plain(idx, targets)[1], rtol=0, atol=0)
    mtp.train()
    train_loss = mtp(idx, targets)[1]
    assert train_loss > eval_loss
    # the extra term is 0.5 x the cross-entropy of the token after next
    mtp.eval()
    hidden = {}
    mtp.ln_f.register_forward_hook(lambda m, i, o: hidden.setdefault("x", o))
    mtp(idx)
    logits = mtp.lm_head(mtp.mtp_proj(hidden["x"][:, :-1]))
    after_next = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB),
                                                   targets[:, 1:].reshape(-1))
    torch.testing.assert_close(train_loss, eval_loss + 0.5 * after_next.to(train_loss.dtype))


def test_every_switch_learns_and_every_new_parameter_gets_a_gradient():
    model = make(**ALL_ON).float().train()
    optimizer = make_optimizer(model, OptimConfig(lr=3e-3), torch.float32)
    idx = torch.randint(0, VOCAB, (4, 16))
    losses = []
    for _ in range(30):
        loss = model(idx, idx.roll(-1, 1))[1]
        loss.backward()
        for name in ("blocks.1.attn.value_mix", "skip_weights", "blocks.0.attn.gate.weight",
                     "mtp_proj.weight", "bigram.weight", "smear_gate.weight", "smear_lam"):
            assert model.get_parameter(name).grad.abs().sum() > 0, name
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses


def test_no_export_format_has_weights_for_them():
    for key, on in SWITCHES.items():
        cfg = ModelConfig(**{key: on})
        assert any(f"model.{key}=" in p for p in gpt2_problems(cfg)), key
        assert any(f"model.{key}=" in p for p in llama_problems(cfg)), key


def test_the_previous_token_terms_start_at_zero_and_read_only_the_token_before():
    """Freshly built, both start as the plain model; trained, position t sees token t - 1
    through them (and nothing earlier: a 1-layer model with attention cut off)."""
    torch.manual_seed(0)
    cfg = dict(n_layer=1, n_head=4, n_embd=32, block_size=16)
    idx = torch.randint(0, VOCAB, (2, 16))
    torch.manual_seed(1)
    plain = GPT(ModelConfig(**cfg), VOCAB)
    for switch in ({"bigram_buckets": 64}, {"smear": True}):
        torch.manual_seed(1)
        model = GPT(ModelConfig(**cfg, **switch), VOCAB)
        model.load_state_dict(plain.state_dict(), strict=False)
        torch.testing.assert_close(model(idx)[0], plain(idx)[0], rtol=0, atol=0)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.2)
            model.blocks[0].attn.out_proj.weight.zero_()  # no attention: tokens only
        changed = idx.clone()
        changed[:, 5] = (changed[:, 5] + 1) % VOCAB
        moved = (model(changed)[0] - model(idx)[0]).abs().amax(dim=(0, 2))  # [T]
        assert moved[5] > 0 and moved[6] > 0, switch  # the token itself, and the one after
        assert moved[:5].max() == 0 and moved[7:].max() == 0, switch
