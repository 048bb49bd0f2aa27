"""tools/gpu_checks.sh cannot run without a GPU; here it is checked as far as a CPU can:
bash parses it, a dry run lists every step within the 540 s budget, and every command it
would run exists and accepts its arguments."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest

from helpers import REPO_ROOT, SCRIPT_ENV
from guard.compose import compose

SCRIPT = REPO_ROOT / "tools" / "gpu_checks.sh"


def dry_run(tmp_path) -> list[str]:
    done = subprocess.run(["bash", str(SCRIPT)], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "DRY_RUN": "1", "OUT": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_bash_parses_it():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True, timeout=30)


def test_a_dry_run_lists_every_step_within_the_budget_and_runs_nothing(tmp_path):
    lines = dry_run(tmp_path)
    steps = [re.match(r"== (\w+)", line).group(1) for line in lines if line.startswith("== ")]
    assert steps == ["kernels", "fused_gpu_tests", "fused_tests", "bench_attention",
                     "bench_decode", "bench_train_step", "bench_generate", "mask_values",
                     "recipe"]
    limits = [int(m.group(1)) for line in lines if (m := re.search(r"\(limit (\d+)s\)", line))]
    assert len(limits) == len(steps) and sum(limits) <= 540  # the worst case: all run, in time
    assert lines[-1] == f"total {sum(limits)}s of 540s"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.txt"]  # no log, no run


@pytest.mark.slow
def test_every_command_exists_and_takes_its_arguments(tmp_path):
    """Each `python -m module args` parses its arguments (`--help` last: argparse checks what
    comes before it, then exits); the pytest selections collect tests; the recipe's overrides
    compose."""
    commands = [shlex.split(line.split("): ", 1)[1]) for line in dry_run(tmp_path)
                if line.startswith("== ")]
    for argv in commands:
        assert argv[0] == "python3"
        if argv[1:3] == ["-m", "pytest"]:
            done = subprocess.run([sys.executable, *argv[1:], "--collect-only", "-q"],
                                  cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                                  env=SCRIPT_ENV)
            collected = re.search(r"test_fused_attention.py: (\d+)", done.stdout)
            assert done.returncode == 0 and collected and int(collected.group(1)) > 0, done
        elif argv[1] == "-m":
            done = subprocess.run([sys.executable, *argv[1:], "--help"], cwd=REPO_ROOT,
                                  capture_output=True, text=True, timeout=300, env=SCRIPT_ENV)
            assert done.returncode == 0, (argv, done.stderr[-2000:])
        else:
            assert argv[1] == "train.py" and (REPO_ROOT / "train.py").is_file()
            overrides = [a for a in argv[2:] if not a.startswith(("hydra.", "data.sdist_path"))]
            cfg = compose(overrides)
            assert cfg.train.max_minutes == 2 and cfg.train.progress is False
