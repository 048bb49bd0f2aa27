"""Apple Silicon (MPS) without a Mac: which device `auto` picks, what mps is refused, and which
branch each device-dependent choice takes for it.

No test here runs anything on MPS: `torch.backends.mps.is_available` and friends are
monkeypatched, and `torch.device("mps")` is only a name on this machine. What runs on the
device is tested on the `meta` stand-in (tests/test_devices.py, also as a device without
float64). docs/apple.md: none of this has been run on a Mac yet.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import training.optim as optim_module
from safeio.cli import UserError
from safeio.checkpoint import load_state
from guard.limits import check_config, parse_device
from guard.memory import check_training_fits
from safeio.system import available_bytes
from guard.compose import compose
from model.fast_paths import fused_refusal
from model.config import AttentionConfig
from training.device import NATIVE_BF16_ENV, float64_home, pick_dtype
from training.optim import make_optimizer
from training.checkpoint import latest_checkpoint, save_checkpoint
from training.checkpoint import rng_state, set_rng_state

MPS = torch.device("mps")


def machine(monkeypatch, cuda: bool, mps: bool, mps_built: bool = True,
            macos14: bool = True) -> None:
    """Pretend this machine has (or lacks) CUDA and MPS."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: mps)
    monkeypatch.setattr(torch.backends.mps, "is_built", lambda: mps_built)
    monkeypatch.setattr(torch.backends.mps, "is_macos_or_newer",
                        lambda major, minor: macos14 or (major, minor) < (14, 0))


# ----------------------------------------------------------------------------- the device


@pytest.mark.parametrize("cuda, mps, picked", [(True, True, "cuda"), (True, False, "cuda"),
                                               (False, True, "mps"), (False, False, "cpu")])
def test_auto_picks_cuda_then_mps_then_the_cpu(monkeypatch, cuda, mps, picked):
    machine(monkeypatch, cuda=cuda, mps=mps)
    assert parse_device("auto", "train.device") == torch.device(picked)


def test_mps_is_taken_where_it_is_available(monkeypatch):
    machine(monkeypatch, cuda=True, mps=True)
    assert parse_device("mps", "train.device") == MPS
    assert parse_device("cpu", "train.device") == torch.device("cpu")


@pytest.mark.parametrize("built, why", [(True, "Apple-silicon Mac"),
                                        (False, "PyTorch built with MPS")])
def test_mps_is_refused_where_there_is_none(monkeypatch, built, why):
    machine(monkeypatch, cuda=False, mps=False, mps_built=built)
    with pytest.raises(UserError, match=f"device=mps, but MPS is not available here: .*{why}"):
        parse_device("mps")


@pytest.mark.parametrize("name", ["mps:0", "MPS", "metal", "mps:x"])
def test_other_spellings_are_refused_with_the_list_of_names(monkeypatch, name):
    machine(monkeypatch, cuda=False, mps=True)
    with pytest.raises(UserError, match="must be auto, cpu, mps, cuda or cuda:N"):
        parse_device(name, "device")


def test_mps_runs_fp32_unless_bf16_is_asked_for(monkeypatch):
    monkeypatch.setenv(NATIVE_BF16_ENV, "1")  # what makes a CPU's auto pick bf16
    assert pick_dtype("auto", torch.device("cpu")) == torch.bfloat16
    assert pick_dtype("auto", MPS) == torch.float32
    assert pick_dtype("bfloat16", MPS) == torch.bfloat16
    assert pick_dtype("float32", MPS) == torch.float32


# ----------------------------------------------------------------------------- refusals


def check_on_mps(monkeypatch, overrides: list[str], **machine_kw) -> None:
    """check_config for a run that parse_device put on mps."""
    machine(monkeypatch, cuda=False, mps=True, **machine_kw)
    check_config(compose(overrides), parse_device("auto", "train.device"))


@pytest.mark.parametrize("overrides", [
    [], ["train.dtype=bfloat16"], ["train.compile=true"],
    ["train.compile=true", "train.compile_mode=max-autotune-no-cudagraphs"],
    ["train.compile_mode=reduce-overhead"],  # (compile stays off on mps: nothing recorded)
    ["optim=adamw", "train.dtype=float32"]])
def test_what_mps_accepts(monkeypatch, overrides):
    check_on_mps(monkeypatch, overrides)


def test_torchrun_on_mps_is_one_error_line(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UserError, match=r"^mps \(train.device=auto\) trains in one process only.*"
                                        r"WORLD_SIZE=2.*train.device=cpu"):
        check_on_mps(monkeypatch, [])
    monkeypatch.setenv("WORLD_SIZE", "1")
    check_on_mps(monkeypatch, [])


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_cuda_graph_modes_are_refused_on_mps(monkeypatch, mode):
    with pytest.raises(UserError, match=f"compile_mode={mode} records CUDA graphs"):
        check_on_mps(monkeypatch, ["train.compile=true", f"train.compile_mode={mode}"])


def test_the_fused_kernel_is_refused_on_mps(monkeypatch):
    with pytest.raises(UserError, match="impl=fused needs Triton and a CUDA device, not mps"):
        check_on_mps(monkeypatch, ["attention.impl=fused", "model.n_embd=128",
                                   "model.n_head=2", "model.dropout=0"])
    # the layer's own decision too (it runs at each call), even if the interpreter is on
    assert "not mps" in fused_refusal(AttentionConfig(), 64, 0.0, MPS, torch.float32)
    assert "not mps" in fused_refusal(AttentionConfig(), 64, 0.0, "mps")


def test_bf16_is_refused_before_macos_14(monkeypatch):
    with pytest.raises(UserError, match="train.dtype=bfloat16 on mps needs macOS 14"):
        check_on_mps(monkeypatch, ["train.dtype=bfloat16"], macos14=False)
    # an fp32 run's Muon orthogonalises in float32 (training/muon.py): fine before macOS 14 too
    check_on_mps(monkeypatch, ["train.dtype=float32"], macos14=False)


# ----------------------------------------------------------------------------- branch points


@pytest.mark.slow  # 3.4 s on 2 cores
def test_mps_memory_is_metals_recommended_working_set(monkeypatch):
    monkeypatch.setattr(torch.mps, "recommended_max_memory", lambda: 8 * 10**9)
    assert available_bytes(MPS) == 8 * 10**9
    with pytest.raises(UserError, match="does not fit in memory.*mps has 8.0 GB available"):
        check_training_fits(compose(["model.n_embd=8192", "model.n_layer=8"]), MPS)

    def no_metal():
        raise RuntimeError("no Metal device")
    monkeypatch.setattr(torch.mps, "recommended_max_memory", no_metal)
    assert available_bytes(MPS) is None  # unknown: nothing refused


@pytest.mark.parametrize("device, fused", [("cuda", True), ("mps", True), ("cpu", None)])
def test_adamw_is_fused_on_cuda_and_mps(monkeypatch, device, fused):
    """MPS has fused AdamW kernels but no foreach ones: unfused, it updates one tensor at a time."""
    seen = {}
    monkeypatch.setattr(optim_module.torch.optim, "AdamW",
                        lambda groups, **kwargs: seen.update(kwargs))
    param = SimpleNamespace(device=torch.device(device), is_cuda=device == "cuda",
                            is_mps=device == "mps", requires_grad=True, dim=lambda: 2)
    model = SimpleNamespace(named_parameters=lambda: [("wte.weight", param)])
    make_optimizer(model, compose(["optim=adamw"]).optim)
    assert seen["fused"] is fused


def test_float64_totals_live_on_the_cpu_for_mps():
    """MPS has no float64: evaluation's running totals are kept on the host there."""
    assert float64_home(MPS) == torch.device("cpu")
    assert float64_home(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert float64_home(torch.device("cpu")) == torch.device("cpu")


class FakeMpsGenerator:
    def __init__(self):
        self.state = torch.arange(16, dtype=torch.uint8)

    def get(self):
        return self.state.clone()

    def set(self, state):  # refuses what torch.mps.set_rng_state refuses
        if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8:
            raise TypeError("RNG state must be a torch.ByteTensor")
        if state.shape != self.state.shape:
            raise RuntimeError(f"Expected an MPS generator state of size {self.state.numel()}")
        self.state = state.clone()


def test_the_mps_generator_is_saved_and_restored(monkeypatch, tmp_path):
    """Dropout on mps draws from MPS's own generator: a resumed run needs its state back."""
    gen = FakeMpsGenerator()
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(torch.mps, "get_rng_state", gen.get)
    monkeypatch.setattr(torch.mps, "set_rng_state", gen.set)
    save_checkpoint(tmp_path, 1, torch.nn.Linear(1, 1), {"rng": rng_state()}, keep=1)
    saved = load_state(latest_checkpoint(tmp_path), ["rng"])["rng"]
    assert torch.equal(saved["mps"], torch.arange(16, dtype=torch.uint8))
    gen.state = torch.zeros(16, dtype=torch.uint8)  # the generator moves on ...
    set_rng_state(saved)
    assert torch.equal(gen.state, saved["mps"])     # ... and the resume puts it back
    for bad in (torch.zeros(8, dtype=torch.uint8), torch.zeros(16), [0] * 16):
        with pytest.raises((TypeError, RuntimeError)):  # load_training_state: one line
            set_rng_state({**saved, "mps": bad})
    # a checkpoint from a Mac resumed on a machine without MPS: the state is not used
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    set_rng_state(saved)
    assert "mps" not in rng_state()
