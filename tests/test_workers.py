"""A sweep's runs trained by worker processes (hydra/launcher=processes, guard/workers.py).

The promises: each run trains as it would alone (the same weights, to the bit), and a sweep
stopped midway continues with `resume=<sweep directory>`, which trains its unfinished runs only.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from guard.preflight import SWEEP_RECORD, recorded_sweep
from guard.workers import oversubscription, usable_cores, worker_count
from helpers import SCRIPT_ENV, TRAIN, corpus_args, ok, run, scalars, write_corpus
from safeio.cli import UserError
from training.checkpoint import CHECKPOINTS, WEIGHTS, latest_checkpoint


def test_n_jobs_null_is_one_worker_per_core_and_never_more_workers_than_runs():
    assert worker_count(None, 100) == usable_cores()
    assert worker_count(3, 2) == 2
    assert worker_count(1, 5) == 1
    for wrong in (0, -1, 1.5, True, "2"):
        with pytest.raises(UserError, match="n_jobs"):
            worker_count(wrong, 4)


def test_workers_whose_threads_outnumber_the_cores_are_warned_about():
    cores = usable_cores()
    assert oversubscription(1, [None]) is None
    assert oversubscription(2, []) is None  # a sweep resumed with nothing left to train
    assert oversubscription(2, [cores]) is not None or cores == 1
    assert oversubscription(cores, [1, 1]) is None
    assert "train.threads=1" in oversubscription(2, [2 * cores])


def test_resuming_a_sweep_replays_its_command_and_takes_only_the_launcher_s_overrides(tmp_path):
    record = {"overrides": ["+experiment=smoke", "seed=1,2", "hydra.sweep.dir=elsewhere"]}
    (tmp_path / SWEEP_RECORD).write_text(json.dumps(record))
    replayed = recorded_sweep(tmp_path, [f"resume={tmp_path}", "hydra.launcher.n_jobs=1"])
    assert replayed == ["+experiment=smoke", "seed=1,2", f"hydra.sweep.dir='{tmp_path}'",
                        "hydra.launcher.n_jobs=1"]
    with pytest.raises(UserError, match="train.max_steps=9"):
        recorded_sweep(tmp_path, [f"resume={tmp_path}", "train.max_steps=9"])


# ----------------------------------------------------------------------------- real sweeps


def _weights(run_dir: Path) -> dict:
    return load_file(latest_checkpoint(run_dir) / WEIGHTS)


def _largest_difference(a: Path, b: Path) -> float:
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    return max((wa[k].double() - wb[k].double()).abs().max().item() for k in wa)


def _sample_steps(run_dir: Path) -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(run_dir), size_guidance={"tensors": 0})
    acc.Reload()
    return [e.step for e in acc.Tensors("sample/text_summary")]


@pytest.fixture(scope="module")
def common(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("workers")
    corpus = write_corpus(root, 40_000, 8_000)
    return ["+experiment=smoke", *corpus_args(corpus, root / "cache"), "train.max_steps=40",
            "train.eval_interval=20", "run_name=smoke_seed${seed}"]


@pytest.mark.slow
def test_a_run_trained_by_a_worker_equals_the_same_run_trained_alone(common, tmp_path):
    """... and logging the text sample at the last evaluation only (as the studies do) changes
    no number: the sample draws from a generator of its own."""
    sweep = tmp_path / "sweep"
    ok(run([TRAIN, "-m", *common, "seed=1,2", "hydra/launcher=processes",
            "hydra.launcher.n_jobs=2", "train.sample_every_eval=false",
            f"hydra.sweep.dir={sweep}"], tmp_path))
    alone = tmp_path / "alone"
    ok(run([TRAIN, *common, "seed=2", f"hydra.run.dir={alone}"], tmp_path))
    assert _largest_difference(sweep / "smoke_seed2", alone) == 0.0
    worker, own = scalars(sweep / "smoke_seed2"), scalars(alone)
    for tag in ("train/loss", "val/loss", "val/causal_loss", "weights/max_weight/layer0"):
        assert worker[tag] == own[tag], tag
    assert _sample_steps(sweep / "smoke_seed2") == [40]
    assert _sample_steps(alone) == [20, 40]
    for name in ("config.yaml", "train.log", "tokenizer.json", ".hydra/overrides.yaml"):
        assert (sweep / "smoke_seed1" / name).is_file(), name


@pytest.mark.slow
def test_an_interrupted_sweep_resumes_only_its_unfinished_runs(common, tmp_path):
    """Ctrl-C once the first of four runs has finished: the finished one is left alone, and
    resume=<sweep> trains the others (the stopped ones from their checkpoints) to their end,
    each to the weights it has when trained alone, uninterrupted."""
    sweep = tmp_path / "sweep"
    slow = [*common, "train.max_steps=300", "train.eval_interval=20"]
    proc = subprocess.Popen([sys.executable, TRAIN, "-m", *slow, "seed=1,2,3,4",
                             "hydra/launcher=processes", "hydra.launcher.n_jobs=2",
                             f"hydra.sweep.dir={sweep}"], cwd=tmp_path, env=SCRIPT_ENV,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    seen = ""
    deadline = time.monotonic() + 240
    while "[1/4]" not in seen and time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        seen += line
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C at a terminal does
    seen += proc.stderr.read()
    assert proc.wait(timeout=120) == 128 + signal.SIGINT, seen[-3000:]
    assert f"python train.py resume={sweep}" in seen, seen[-3000:]
    runs = sorted(sweep.glob("smoke_seed*"))
    done = [r for r in runs if (latest_checkpoint(r) or Path("_0")).name.endswith("_00000300")]
    assert len(done) >= 1, seen[-3000:]
    before = {r: (r / CHECKPOINTS / "step_00000300" / WEIGHTS).stat().st_mtime_ns for r in done}

    result = ok(run([TRAIN, f"resume={sweep}"], tmp_path, timeout=300))
    trained = result.stderr.count(": causal val loss")
    assert trained == 4 - len(done), result.stderr[-3000:]
    for r, mtime in before.items():  # the finished runs were not touched
        assert (r / CHECKPOINTS / "step_00000300" / WEIGHTS).stat().st_mtime_ns == mtime
    for seed in range(1, 5):
        assert latest_checkpoint(sweep / f"smoke_seed{seed}").name.endswith("_00000300")
    again = ok(run([TRAIN, f"resume={sweep}"], tmp_path))  # nothing left to train
    assert ": causal val loss" not in again.stderr and "nothing to train" in again.stderr
    stopped = [s for s in range(1, 5) if sweep / f"smoke_seed{s}" not in done]
    alone = tmp_path / "alone"
    ok(run([TRAIN, *slow, f"seed={stopped[0]}", f"hydra.run.dir={alone}"], tmp_path))
    assert _largest_difference(sweep / f"smoke_seed{stopped[0]}", alone) == 0.0
