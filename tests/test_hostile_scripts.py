"""Issue 28's hostile inputs to the scripts and to what they read: each class checked in process
(the checking function itself, fast), with one command per class run as a user would
(`@pytest.mark.slow`), which must end with exit code 2 and one `error:` line, in seconds.

    HANGS        a FIFO (or a device) named like a TensorBoard events file in a run directory
    CHECK_FIRST  scripts that wrote (or replaced) files before finding a mistake in their input;
                 values without the real bound (a layer past the last one)
    TRACEBACKS   the legacy model.activation out of range; scripts.llama_pitfalls' values
    FOLDERS      overrides that cannot apply to an imported model folder (init_from=)
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from guard.cli import FileRefused, UserError
from helpers import REPO_ROOT, SCRIPT_ENV, one_error_line

TIMEOUT_S = 60  # a refusal takes a few seconds (imports); one that needs this long is hanging


def script(module: str, *args: str, cwd: Path, env: dict | None = None):
    """`python -m module args` in cwd, as a user would start it."""
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd,
                          env={**SCRIPT_ENV, "PYTHONPATH": str(REPO_ROOT), **(env or {})},
                          capture_output=True, text=True, timeout=TIMEOUT_S)


def refused(result) -> str:
    assert result.returncode == 2, result
    return one_error_line(result)


# ----------------------------------------------------------------------------- hangs


def fifo_run(root: Path, name: str = "run") -> Path:
    """A run directory whose events file is a FIFO: reading it blocks until a writer comes."""
    run = root / name
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("seed: 0\n")
    os.mkfifo(run / "events.out.tfevents.1700000000.host.1.0")
    return run


def test_an_events_fifo_is_refused_before_tensorboard_opens_it(tmp_path):
    from guard.run_dir import event_files, read_events

    run = fifo_run(tmp_path)
    with pytest.raises(FileRefused, match="FIFO"):
        read_events(run, {"scalars": 0})
    (run / "events.out.tfevents.1700000000.host.1.0").unlink()
    os.symlink("/dev/zero", run / "events.out.tfevents.2")  # a device never ends
    with pytest.raises(FileRefused, match="character device"):
        event_files(run)


@pytest.mark.slow
@pytest.mark.parametrize("module, arg", [("scripts.runs", "root"),
                                         ("scripts.summarize_ablations", "sweep")])
def test_scripts_reading_runs_refuse_an_events_fifo(tmp_path, module, arg):
    fifo_run(tmp_path / "study", "base-correct_seed0")
    line = refused(script(module, f"{arg}={tmp_path / 'study'}", cwd=tmp_path))
    assert "is a FIFO" in line and "events" in line
