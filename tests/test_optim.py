"""Which optimizer owns which parameter, and that the pair saves and restores exactly."""
from __future__ import annotations


import pytest
import torch

from safeio.checkpoint import load_state
from model.config import ModelConfig
from model.gpt import GPT
from training.checkpoint import latest_checkpoint, save_checkpoint
from training.config import OptimConfig, OptimizerName
from training.optim import make_optimizer


def tiny_gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(ModelConfig(n_layer=2, n_head=2, n_embd=16, block_size=8), vocab_size=11)


def owners(model: GPT, opt) -> dict[str, str]:
    """Parameter name -> class name of the optimizer that updates it (checks each has one)."""
    by_id = {}
    for inner in opt.optimizers:
        for group in inner.param_groups:
            for p in group["params"]:
                assert id(p) not in by_id, "a parameter is in two optimizers"
                by_id[id(p)] = type(inner).__name__
    names = dict(model.named_parameters())  # tied weights once, under tok_emb
    assert len(by_id) == len(names), "every parameter is optimized exactly once"
    return {name: by_id[id(p)] for name, p in names.items()}


def test_adamw_owns_everything():
    model = tiny_gpt()
    assert set(owners(model, make_optimizer(model, OptimConfig(name=OptimizerName.adamw)))) == \
           set(dict(model.named_parameters()))
    assert {type(o).__name__ for o in make_optimizer(model, OptimConfig(name=OptimizerName.adamw)).optimizers} == {"AdamW"}


def test_muon_owns_the_blocks_weight_matrices_and_adamw_the_rest():
    model = tiny_gpt()
    own = owners(model, make_optimizer(model, OptimConfig(name=OptimizerName.muon)))
    muon = sorted(n for n, o in own.items() if o == "Muon")
    assert muon == sorted(f"blocks.{i}.{m}.weight" for i in range(2)
                          for m in ("attn.qkv", "attn.out_proj", "mlp.fc", "mlp.proj"))
    assert own["tok_emb.weight"] == own["pos_emb.weight"] == own["blocks.0.attn.qkv.bias"] == "AdamW"
    assert own["blocks.1.ln_1.weight"] == own["ln_f.weight"] == "AdamW"


def test_the_schedule_reaches_every_group():
    model = tiny_gpt()
    opt = make_optimizer(model, OptimConfig(name=OptimizerName.muon))
    for group in opt.param_groups:
        group["lr"] = 0.0  # what the training loop does at each step
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.randint(0, 11, (4, 8))
    model(x, x)[1].backward()
    opt.step()
    for p, q in zip(model.parameters(), before):  # lr 0 (and decay * lr = 0): nothing moves
        assert torch.equal(p, q)


def test_cpu_adamw_updates_all_tensors_at_once_and_equals_one_at_a_time_to_the_bit():
    """On a CPU, AdamW is PyTorch's foreach implementation (one call per update over every
    tensor, not a Python loop; docs/ablations.md measures what it saves): 30 steps of it give
    the weights and the state of the one-tensor-at-a-time AdamW exactly, so the studies'
    numbers do not move."""
    cfg = OptimConfig(name=OptimizerName.adamw, lr=3e-3, weight_decay=0.1)
    runs = []
    for foreach in (True, False):
        model = tiny_gpt(seed=3)
        opt = make_optimizer(model, cfg)
        adamw = opt.optimizers[0]
        assert adamw.defaults["foreach"] is True
        adamw.defaults["foreach"] = foreach
        for group in adamw.param_groups:
            group["foreach"] = foreach
        gen = torch.Generator().manual_seed(0)
        for _ in range(30):
            x = torch.randint(0, 11, (4, 8), generator=gen)
            model(x, x.roll(1, dims=1))[1].backward()
            opt.step()
            opt.zero_grad()
        runs.append((model.state_dict(), adamw.state_dict()["state"]))
    (weights, state), (weights_1, state_1) = runs
    for name in weights:
        assert torch.equal(weights[name], weights_1[name]), name
    for i in state:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(state[i][key], state_1[i][key]), (i, key)


@pytest.mark.parametrize("name", list(OptimizerName))
def test_state_round_trip_continues_bit_exactly(name, tmp_path):
    """Two steps, save, two more; versus a fresh model + optimizer loaded from the save."""
    cfg = OptimConfig(name=name)
    data = [torch.randint(0, 11, (4, 8), generator=torch.Generator().manual_seed(i)) for i in range(4)]

    def train(model, opt, batches):
        for x in batches:
            model(x, x)[1].backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    a = tiny_gpt()
    opt_a = make_optimizer(a, cfg)
    train(a, opt_a, data[:2])
    saved_model = {k: v.clone() for k, v in a.state_dict().items()}
    saved_opt = opt_a.state_dict()
    save_checkpoint(tmp_path, 2, a, {"optimizer": saved_opt}, keep=1)  # JSON and safetensors
    saved_opt = load_state(latest_checkpoint(tmp_path))["optimizer"]
    train(a, opt_a, data[2:])

    b = tiny_gpt(seed=1)
    b.load_state_dict(saved_model)
    opt_b = make_optimizer(b, cfg)
    opt_b.load_state_dict(saved_opt)
    train(b, opt_b, data[2:])
    for (key, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), key


def test_loading_another_optimizers_state_is_refused():
    model = tiny_gpt()
    adamw_state = make_optimizer(model, OptimConfig(name=OptimizerName.adamw)).state_dict()
    with pytest.raises(ValueError, match="optim.name"):
        make_optimizer(model, OptimConfig(name=OptimizerName.muon)).load_state_dict(adamw_state)


# ----------------------------------------------------------------------------- Muon in float32


@pytest.mark.parametrize("adjust", ["match_rms_adamw", "original"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_our_muon_follows_torch_muon_step_for_step(adjust, nesterov):
    """Same rule as torch.optim.Muon; only the orthogonalisation's dtype differs (theirs bf16,
    ours fp32), so the updates agree to bf16's precision over several steps of momentum."""
    from training.muon import Muon

    torch.manual_seed(0)
    shapes = [(48, 16), (16, 48), (32, 32)]
    start = [torch.randn(s) for s in shapes]
    grads = [[torch.randn(s) for s in shapes] for _ in range(3)]
    moved = []
    for cls in (torch.optim.Muon, Muon):
        params = [torch.nn.Parameter(p.clone()) for p in start]
        opt = cls(params, lr=0.02, weight_decay=0.1, nesterov=nesterov, adjust_lr_fn=adjust)
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = g.clone()
            opt.step()
        moved.append([p.detach() - s for p, s in zip(params, start)])
    for theirs, ours in zip(*moved):
        assert (ours - theirs).norm() / theirs.norm() < 2e-2
    # and the comparison can tell rules apart: the other momentum rule lands elsewhere
    params = [torch.nn.Parameter(p.clone()) for p in start]
    other = Muon(params, lr=0.02, weight_decay=0.1, nesterov=not nesterov, adjust_lr_fn=adjust)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        other.step()
    assert max(((p.detach() - s) - t).norm() / t.norm()
               for p, s, t in zip(params, start, moved[0])) > 0.1


def test_orthogonalize_flattens_the_spectrum_in_float32():
    from training.muon import orthogonalize

    torch.manual_seed(1)
    g = torch.randn(64, 16) @ torch.diag(torch.logspace(-2, 1, 16))  # condition number 1000
    o = orthogonalize(g, (3.4445, -4.775, 2.0315), steps=5, eps=1e-7)
    assert o.dtype == torch.float32 and o.shape == g.shape
    s = torch.linalg.svdvals(o)
    assert s.max() < 1.5 and s.min() > 0.2  # from 1000:1 to about 4:1
    assert torch.linalg.svdvals(g).max() / torch.linalg.svdvals(g).min() > 100


def test_under_bf16_muon_orthogonalises_in_bf16_as_torch_does():
    """A bf16 run's Muon iterates in bf16 (fast where bf16 is native), landing where
    torch.optim.Muon (bf16 too) does to within bf16 rounding; an fp32 run's stays in fp32."""
    from training.muon import orthogonalize

    model = tiny_gpt()
    for dtype, expected in ((torch.bfloat16, torch.bfloat16), (torch.float32, None)):
        muon = make_optimizer(model, OptimConfig(name=OptimizerName.muon), dtype).optimizers[0]
        assert muon.ns_dtype == expected
    torch.manual_seed(1)
    g = torch.randn(64, 16) @ torch.diag(torch.logspace(-2, 1, 16))
    ours = orthogonalize(g, (3.4445, -4.775, 2.0315), steps=5, eps=1e-7, dtype=torch.bfloat16)
    assert ours.dtype == torch.bfloat16
    s = torch.linalg.svdvals(ours.float())
    assert s.max() < 1.5 and s.min() > 0.2
    in_fp32 = orthogonalize(g, (3.4445, -4.775, 2.0315), steps=5, eps=1e-7)
    assert 1e-4 < (ours.float() - in_fp32).norm() / in_fp32.norm() < 5e-2  # bf16, and close


def test_orthogonalizing_a_batch_equals_one_matrix_at_a_time():
    """Muon orthogonalises all matrices of one shape in one batch: the same result as one by one
    (and a batch whose matrices were mixed up would not match)."""
    from training.muon import orthogonalize

    coefficients = (3.4445, -4.775, 2.0315)
    torch.manual_seed(2)
    for shape in [(4, 48, 16), (3, 16, 48), (2, 32, 32)]:
        batch = torch.randn(shape)
        together = orthogonalize(batch, coefficients, steps=5, eps=1e-7)
        one_by_one = torch.stack([orthogonalize(m, coefficients, steps=5, eps=1e-7) for m in batch])
        torch.testing.assert_close(together, one_by_one, atol=1e-5, rtol=1e-5)
        assert (together[0] - one_by_one[1]).abs().max() > 0.01


def test_linear_schedule_holds_then_falls_in_a_straight_line_to_min_lr():
    from training.config import Schedule
    from training.optim import lr_at
    cfg = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=10, schedule=Schedule.linear,
                      decay_fraction=0.5)
    lrs = [lr_at(s, cfg, 110) for s in range(111)]  # 100 steps after warmup: 50 held, 50 falling
    assert lrs[9] == 1.0 and lrs[10] == lrs[60] == 1.0  # warmup's end, then held
    assert lrs[85] == pytest.approx(0.55) and lrs[110] == pytest.approx(0.1)  # halfway, the end
    steps = [a - b for a, b in zip(lrs[60:110], lrs[61:111])]
    assert max(steps) == pytest.approx(min(steps)) == pytest.approx(0.9 / 50)  # a straight line
    whole = OptimConfig(lr=1.0, min_lr=0.0, warmup_steps=10, schedule=Schedule.linear)
    assert lr_at(10, whole, 110) == 1.0 and lr_at(60, whole, 110) == pytest.approx(0.5)
