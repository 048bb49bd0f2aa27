"""The benchmarks: each `python -m bench.<name> quick=true` (and the two maintainers' benches in
tools/) runs and ends with its headline; and the pieces of their logic that decide what gets
measured.

The benchmarks are run the way a user runs them (a subprocess from the repository root). Only
the contract is checked (exit status 0, last stdout line `ratio=<float>`), never the figures:
timings on a shared CI machine say nothing. tools.startup quick=true uses a synthetic corpus, so no
network is needed.
"""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.train_step import climb
from safeio.cli import hydra_string
from guard.compose import compose

REPO_ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ("bench.attention", "bench.train_step", "bench.arm_cost", "bench.generate",
              "bench.batch_generate", "tools.sampling_threads", "tools.startup",
              "tools.freed_memory")
HEADLINE = re.compile(r"ratio=([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)")
# quick=true takes seconds; the limit only turns a hang into a failure on a loaded machine.
TIMEOUT_S = 180


@pytest.mark.slow
@pytest.mark.parametrize("name", BENCHMARKS)
def test_quick_run_ends_with_ratio(name):
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    arms = ["arms=model.n_layer=5;optim=adamw"] if name == "bench.arm_cost" else []
    done = subprocess.run(
        [sys.executable, "-m", name, "quick=true", "threads=1", *arms],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S,
    )
    what = f"python -m {name} quick=true"
    assert done.returncode == 0, f"{what} failed:\n{done.stdout}\n{done.stderr}"
    lines = done.stdout.strip().splitlines()
    assert lines, f"{what} printed nothing"
    match = HEADLINE.fullmatch(lines[-1])
    assert match, f"last line of {what} is not ratio=<float>: {lines[-1]!r}"
    value = float(match.group(1))
    assert math.isfinite(value) and value > 0, f"{what} headline {value} is not positive"
    assert len(lines) > 1, "the headline should follow a table"


@pytest.mark.slow  # imports torch and composes the config: about 5 s on 2 cores
def test_a_bench_refuses_an_old_option_and_a_key_neither_it_nor_train_py_has():
    for argv, words in [(["--quick"], "write quick=..., not '--quick'"),
                        (["quick=true", "rep=3"], "rep is not a key of the config")]:
        done = subprocess.run([sys.executable, "-m", "bench.generate", *argv], cwd=REPO_ROOT,
                              capture_output=True, text=True, timeout=TIMEOUT_S)
        assert done.returncode == 2 and done.stdout == "", done.stderr
        assert done.stderr.startswith("error: ") and words in done.stderr, done.stderr
        assert "Traceback" not in done.stderr


def ladder(rates: dict[int, float], fits=lambda n: True, budget_s: float = 1e9):
    """climb() over a made-up machine whose n x n matmul runs at rates[n], 1 s a probe."""
    return climb(sorted(rates), lambda n: (rates[n], "a @ b", 1.0), fits, budget_s)


def test_peak_climbs_while_the_rate_gains_and_keeps_the_best():
    peak = ladder({1024: 100.0, 2048: 300.0, 4096: 700.0, 8192: 790.0, 16384: 780.0})
    assert (peak.n, peak.flops) == (8192, 790.0)
    assert [n for n, _ in peak.ladder] == [1024, 2048, 4096, 8192, 16384]


def test_peak_stops_once_a_size_gains_only_a_few_percent():
    peak = ladder({512: 100.0, 1024: 102.0, 2048: 300.0})
    assert [n for n, _ in peak.ladder] == [512, 1024]  # 2048 is never tried
    assert peak.n == 1024 and "gained" in peak.stopped


def test_peak_stops_before_a_size_that_does_not_fit_or_would_take_too_long():
    peak = ladder({512: 1.0, 1024: 2.0, 2048: 4.0}, fits=lambda n: n < 2048)
    assert peak.n == 1024 and "memory" in peak.stopped
    # the 1 s probe at 512 predicts 8 s at 1024: over a 5 s budget
    peak = ladder({512: 1.0, 1024: 2.0}, budget_s=5.0)
    assert peak.n == 512 and "budget" in peak.stopped


@pytest.mark.parametrize("path", ["/tmp/a b/c,d=e.txt", "/tmp/it's", "C:\\dir\\", "[x]"])
def test_hydra_string_passes_any_path_through_compose(path):
    cfg = compose(["data=text_files", f"data.train_files=[{hydra_string(path)}]",
                   f"data.cache_dir={hydra_string(path)}"])
    assert cfg.data.train_files == [path] and cfg.data.cache_dir == path
