"""training/cpu_memory.py: a CPU training step reuses the memory the step before it freed,
instead of having every page of it faulted in again."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import train as train_script
from guard.compose import compose
from training import cpu_memory
from training.runtime import World

ROOT = Path(__file__).resolve().parents[1]

# The default model's fp32 training step in a fresh interpreter (glibc's own settings unless
# argv[1] is "keep"): the median of its page faults over 8 steps once warm ("nan" where the settings
# do not exist). The median, as the kept heap still grows now and then when a block does not fit
# its free space (a step of thousands of faults among steps of none).
STEP_FAULTS = """
import resource, statistics, sys, torch
from bench.common import compose_config
from bench.train_step import build_step
from training.cpu_memory import keep_freed_memory
if sys.argv[1] == "keep" and not keep_freed_memory():
    sys.exit(print("nan"))
torch.set_num_threads(1)
step = build_step(compose_config([]), torch.float32, None, torch.device("cpu"))
for _ in range(2):
    step()
faults = []
for _ in range(8):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(statistics.median(faults))
"""


def step_faults(mode: str) -> float:
    done = subprocess.run([sys.executable, "-c", STEP_FAULTS, mode], cwd=ROOT, text=True,
                          capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return float(done.stdout)


@pytest.mark.slow  # 20 s on 2 cores: two fresh interpreters
def test_a_step_reuses_the_memory_the_last_one_freed():
    kept = step_faults("keep")
    if kept != kept:
        pytest.skip("glibc's malloc settings are not here")
    plain = step_faults("plain")
    # glibc's own settings: thousands of fresh pages a step (the 32 MiB of logits alone are
    # 8,192); kept: almost none
    assert plain > 4000 and kept < plain / 5, (plain, kept)


def test_settings_the_user_made_are_left_alone(monkeypatch):
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "1000000")
    assert cpu_memory.keep_freed_memory() is False


def test_a_cpu_run_keeps_freed_memory(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(train_script, "keep_freed_memory", lambda: calls.append(1))
    train_txt, val_txt = tmp_path / "train.txt", tmp_path / "val.txt"
    train_txt.write_text("To be, or not to be, that is the question.\n" * 40)
    val_txt.write_text("Whether 'tis nobler in the mind to suffer.\n" * 10)
    cfg = compose(["+experiment=smoke", "data=text_files", f"data.train_files=[{train_txt}]",
                   f"data.val_files=[{val_txt}]", f"data.cache_dir={tmp_path / 'cache'}",
                   "train.dtype=float32", "train.max_steps=1", "train.progress=false",
                   "train.sample_tokens=0", "train.final_full_eval=false"])
    train_script.train(cfg, tmp_path / "run", False, World(device=torch.device("cpu")))
    assert calls == [1]
