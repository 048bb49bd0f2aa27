"""Smoke test of the benchmarks: each `bench/<name>.py --quick` runs and ends with its headline.

The benchmarks are run the way a user runs them (a subprocess from the repository root), so the
sys.path set-up at the top of each script is exercised too. Only the contract is checked (exit
status 0, last stdout line `ratio=<float>`), never the figures: timings on a shared CI machine
say nothing. bench/data.py --quick uses a synthetic corpus, so no network is needed.
"""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ("attention", "train_step", "generate", "data")
HEADLINE = re.compile(r"ratio=([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)")
# --quick takes seconds; the limit only turns a hang into a failure on a loaded machine.
TIMEOUT_S = 180


@pytest.mark.parametrize("name", SCRIPTS)
def test_quick_run_ends_with_ratio(name):
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, f"bench/{name}.py", "--quick", "--threads", "1"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S,
    )
    assert done.returncode == 0, f"bench/{name}.py --quick failed:\n{done.stdout}\n{done.stderr}"
    lines = done.stdout.strip().splitlines()
    assert lines, f"bench/{name}.py printed nothing"
    match = HEADLINE.fullmatch(lines[-1])
    assert match, f"last line of bench/{name}.py is not ratio=<float>: {lines[-1]!r}"
    value = float(match.group(1))
    assert math.isfinite(value) and value > 0, f"bench/{name}.py headline {value} is not positive"
    assert len(lines) > 1, "the headline should follow a table"
