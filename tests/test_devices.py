"""Device placement: every tensor the code makes takes its device from the data it meets.

A CPU-only machine cannot run CUDA, but it can catch the bug CUDA users hit first: a tensor
made on the CPU inside the code (a mask, an index, a counter) and then mixed with the model's
tensors. The `meta` device stands in for the accelerator: tensors there have shapes and dtypes
but no data, every op runs (shape inference only), and an op that mixes a meta tensor with a CPU
tensor of one or more dimensions raises, exactly as a CUDA op mixing CUDA and CPU tensors does.
Values read back to the host (`.item()`, `.tolist()`) are answered with a constant by
`PretendValues`, so whole code paths, training loop included, run on meta in a second or two.

`NoFloat64` makes meta stand in for Apple's MPS as well, which has no float64: an op that makes
a float64 tensor on the device raises there.

The CUDA tests (tests/test_cuda.py) run the same flows for real where a GPU exists.
"""
from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import train as train_script
import training.device
import training.evaluate
from model.config import AttentionConfig, MaskMode, ModelConfig, Scale
from model.gpt import GPT
from guard.compose import compose
from training.runtime import World
from training.evaluate import attention_diagnostics, full_split_loss, mean_loss, qk_grad_norms
from training.optim import make_optimizer

META = torch.device("meta")
VOCAB = 40


class PretendValues(TorchDispatchMode):
    """Answers the host's reads of meta tensors with a constant (0.5, or 1 for integers), so
    code that logs or checks a value goes on; every other op runs as it is."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        src = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if src is not None and src.device.type == "meta":
            fill = 0.5 if src.is_floating_point() else 1
            if func is torch.ops.aten._local_scalar_dense.default:
                return fill
            if func is torch.ops.aten._to_copy.default and str(kwargs.get("device")) == "cpu":
                return torch.full(src.shape, fill, dtype=kwargs.get("dtype") or src.dtype)
        return func(*args, **kwargs)


class NoFloat64(PretendValues):
    """PretendValues on a device without float64, as MPS: a float64 tensor made on meta raises."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "meta" and t.dtype == torch.float64:
                raise RuntimeError(f"{func} made a float64 tensor on a device without float64")
        return out


def as_mps(monkeypatch) -> NoFloat64:
    """Meta as a device without float64: the code's choices for mps taken for meta too."""
    monkeypatch.setattr(training.device, "NO_FLOAT64", ("mps", "meta"))
    return NoFloat64()


def test_the_stand_in_catches_a_cpu_tensor_mixed_into_device_work():
    """The guard itself: what a CUDA device would refuse, meta refuses too."""
    with PretendValues():
        on_device = torch.ones(4, 4, device=META)
        with pytest.raises(RuntimeError, match="device"):
            on_device / torch.ones(4)  # a CPU tensor of 1+ dimensions
        on_device / torch.tensor(2.0)  # a 0-dim CPU tensor is a scalar, allowed (as on CUDA)
        assert (on_device.sum() * 2).item() == 0.5


def meta_model(attn: AttentionConfig = AttentionConfig(), **model) -> GPT:
    cfg = ModelConfig(n_layer=2, n_head=2, n_embd=16, block_size=16, **model)
    with torch.device(META):
        return GPT(cfg, VOCAB, attn)


VARIANTS = {
    "correct": AttentionConfig(),
    "query_blocks": AttentionConfig(query_block=4),
    "no_scale": AttentionConfig(name="no_scale", scale=Scale.none),
    "no_out_proj": AttentionConfig(name="no_out_proj", out_proj=False),
    "mask_zero": AttentionConfig(name="mask_zero", mask_value=0.0),
    "mask_fill_zero": AttentionConfig(name="mask_fill_zero", mask_mode=MaskMode.fill,
                                      mask_value=0.0),
    "mask_after_softmax": AttentionConfig(name="mask_after_softmax",
                                          mask_mode=MaskMode.after_softmax),
}


@pytest.mark.parametrize("name", VARIANTS)
def test_training_step_and_diagnostics_stay_on_the_device(name):
    model = meta_model(VARIANTS[name], dropout=0.1)
    optimizer = make_optimizer(model, compose().optim)
    x = torch.zeros(3, 16, dtype=torch.long, device=META)
    with PretendValues():
        _, loss = model(x, x)
        loss.backward()
        qk_grad_norms(model).tolist()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item()
        optimizer.step()
        optimizer.zero_grad()
        for layer in attention_diagnostics(model, x, contextlib.nullcontext()):
            assert set(layer) == {"max_weight", "entropy", "future_weight"}


SWITCHES = {"rope": dict(positions="rope"), "gqa": dict(n_kv_head=1),
            "all": dict(positions="rope", norm="rmsnorm", mlp="swiglu", n_kv_head=1,
                        qk_norm=True, tie_embeddings=False)}


@pytest.mark.slow  # 3-5 s each on 2 cores
@pytest.mark.parametrize("switches", list(SWITCHES))
def test_every_switch_trains_and_generates_on_the_device(switches):
    """Rotary tables, grouped heads and the rest are made from the device's tensors (the
    positions a static cache reads on the device included)."""
    model = meta_model(AttentionConfig(query_block=4), **SWITCHES[switches])
    optimizer = make_optimizer(model, compose().optim)
    x = torch.zeros(3, 16, dtype=torch.long, device=META)
    prompt = torch.zeros(1, 5, dtype=torch.long, device=META)
    with PretendValues():
        _, loss = model(x, x)
        loss.backward()
        qk_grad_norms(model).tolist()
        optimizer.step()
        for layer in attention_diagnostics(model, x, contextlib.nullcontext()):
            assert set(layer) == {"max_weight", "entropy", "future_weight"}
        for static in (False, True):
            tokens = list(model.generate(prompt, 20, greedy=True, static_cache=static))
            assert len(tokens) == 20 and all(t.device == META for t in tokens)


def test_the_mps_stand_in_catches_float64_on_the_device():
    with NoFloat64():
        torch.zeros(3, device=META, dtype=torch.float32).sum().item()
        with pytest.raises(RuntimeError, match="float64"):
            torch.zeros(3, device=META).double()
    with pytest.raises(RuntimeError, match="float64"):  # evaluation, not told it is on "mps"
        evaluate_on_meta(NoFloat64())


@pytest.mark.parametrize("like", ["cuda", "mps"])
def test_evaluation_moves_cpu_batches_to_the_model(like, monkeypatch):
    evaluate_on_meta(as_mps(monkeypatch) if like == "mps" else PretendValues())


def evaluate_on_meta(mode: PretendValues) -> None:
    model = meta_model()
    tokens = np.arange(100, dtype=np.uint16) % VOCAB
    batches = [(torch.zeros(2, 16, dtype=torch.long), torch.zeros(2, 16, dtype=torch.long))]
    with mode:
        # (the pretended sums over real token counts: the values mean nothing, the placement does)
        assert isinstance(mean_loss(model, batches, contextlib.nullcontext()), float)
        assert isinstance(full_split_loss(model, tokens, 16, 4, contextlib.nullcontext()), float)


@pytest.mark.parametrize("static_cache", [False, True])
@pytest.mark.parametrize("use_cache", [False, True])
def test_generation_stays_on_the_device(use_cache, static_cache):
    model = meta_model()
    prompt = torch.zeros(1, 5, dtype=torch.long, device=META)
    with PretendValues():
        # 30 tokens: past the 16-token context, so the cache is refilled on the way
        tokens = list(model.generate(prompt, 30, greedy=True, use_cache=use_cache,
                                     static_cache=static_cache))
        tokens += list(model.generate(prompt, 3, temperature=0.8, top_k=5, top_p=0.9))
    assert len(tokens) == 33 and all(t.device == META for t in tokens)


@pytest.mark.slow  # 9-15 s each on 2 cores
@pytest.mark.parametrize("like", ["cuda", "mps"])
def test_the_whole_training_loop_stays_on_the_device(tmp_path, monkeypatch, like):
    """train.train() end to end, with the model and the batches on the stand-in device:
    training steps, logging, evaluations with a leaky variant's causal pass, samples, the
    whole-split score. Only the checkpoint writes (which copy data to the host) are left out.
    Like mps: with no float64 on the device."""
    train_txt, val_txt = tmp_path / "train.txt", tmp_path / "val.txt"
    train_txt.write_text("To be, or not to be, that is the question.\n" * 40)
    val_txt.write_text("Whether 'tis nobler in the mind to suffer.\n" * 10)
    cfg = compose(["+experiment=smoke", "attention=mask_after_softmax", "data=text_files",
                   f"data.train_files=[{train_txt}]", f"data.val_files=[{val_txt}]",
                   f"data.cache_dir={tmp_path / 'cache'}", "train.dtype=float32",
                   "train.max_steps=4", "train.eval_interval=2", "train.log_interval=1",
                   "train.sample_tokens=5", "train.final_full_eval=true", "train.progress=false"])
    monkeypatch.setattr(train_script, "save_checkpoint", lambda *args, **kwargs: None)
    monkeypatch.setattr(train_script, "save_best", lambda *args, **kwargs: None)
    monkeypatch.setattr(training.evaluate, "seeded_generator", lambda seed, device: None)
    with as_mps(monkeypatch) if like == "mps" else PretendValues():
        metrics = train_script.train(cfg, tmp_path / "run", False, World(device=META))
    assert metrics["steps"] == 4 and "val_loss_full" in metrics and "causal_val_loss" in metrics
