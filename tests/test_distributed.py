"""Multi-process training (torchrun + DDP on gloo) and gradient accumulation, on CPU.

The sampler draws each step's batch_size x grad_accum x processes windows from one generator
and hands each rank its share, so these runs see exactly the same windows:
    1 process,  batch 8, accumulation 1
    1 process,  batch 4, accumulation 2
    2 processes, batch 4, accumulation 1
and differ only in the order in which floating-point gradients are added up.

Tolerance (the runs are pinned to float32, whatever train.dtype=auto would pick on this
machine): the three runs add the same per-sequence gradients in a different order (one sum, a
sum of two halves, an all_reduce of two halves), which changes float32 results in the last bits
(~1e-7 relative). AdamW divides each update by sqrt(v), so those differences do not grow large
over 20 steps: we measured 2.4e-7 between losses and 2.1e-6 between weights; 2e-4 leaves room for other BLAS
kernels while still catching any real mistake (a missing 1/accum factor, unsynchronised or
double-counted gradients, overlapping batches all move the loss by 1e-2 or more).
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import SCRIPT_ENV, TRAIN, corpus_args, scalars, write_corpus
from training.checkpoint import latest_checkpoint

STEPS = 20
TOL = 2e-4

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("ddp"), 30_000, 6_000, seeds=(3, 4))


def run(corpus: Path, run_dir: Path, *overrides: str, nproc: int = 1) -> subprocess.CompletedProcess:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={nproc}"] if nproc > 1 else [sys.executable]
    cmd = launcher + [TRAIN, "+experiment=smoke", *corpus_args(corpus, corpus / "cache"),
                      f"hydra.run.dir={run_dir}", f"train.max_steps={STEPS}", "train.eval_interval=10",
                      "train.log_interval=5", "train.sample_tokens=0", "train.threads=1",
                      "train.dtype=float32",  # the tolerance below is float32's (dtype=auto
                      *overrides]             # would pick bf16 on a CPU with bf16 units)
    proc = subprocess.run(cmd, cwd=run_dir.parent, capture_output=True, text=True, timeout=300,
                          env=SCRIPT_ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def losses(run_dir: Path) -> dict[int, float]:
    return dict(scalars(run_dir)["train/loss"])


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(latest_checkpoint(run_dir) / "model.safetensors"))


def assert_same_training(a: Path, b: Path, tol: float = TOL) -> None:
    la, lb = losses(a), losses(b)
    assert la.keys() == lb.keys() and len(la) == STEPS // 5
    for step in la:
        assert la[step] == pytest.approx(lb[step], rel=tol, abs=tol), (step, la[step], lb[step])
    wa, wb = weights(a), weights(b)
    for key in wa:
        torch.testing.assert_close(wa[key], wb[key], rtol=10 * tol, atol=10 * tol)


@pytest.fixture(scope="module")
def reference(corpus) -> Path:
    """One process, batch 8, no accumulation."""
    out = corpus / "one_proc_b8"
    run(corpus, out, "train.batch_size=8")
    return out


def test_accumulation_equals_the_full_batch(corpus, reference):
    accumulated = corpus / "one_proc_b4_acc2"
    run(corpus, accumulated, "train.batch_size=4", "train.grad_accum=2")
    assert_same_training(reference, accumulated)


def test_accumulation_is_not_a_no_op(corpus, reference):
    """Negative control: the same batch size without accumulation trains differently."""
    half = corpus / "one_proc_b4"
    run(corpus, half, "train.batch_size=4")
    la, lb = losses(reference), losses(half)
    assert max(abs(la[s] - lb[s]) for s in la) > 100 * TOL


def test_two_processes_match_one_process_with_the_same_global_batch(corpus, reference):
    ddp = corpus / "two_procs_b4"
    proc = run(corpus, ddp, "train.batch_size=4", nproc=2)
    assert "2 process(es)" in proc.stderr and "8 x block" not in proc.stderr
    assert_same_training(reference, ddp)
    # rank 0 alone writes: one checkpoint series, one event file (the HParams summary included)
    events = sorted(p.name for p in ddp.glob("events.out.tfevents.*"))
    assert len(events) == 1
    assert latest_checkpoint(ddp).name == f"step_{STEPS:08d}"
    # the other rank wrote no Hydra directory or log next to the runs
    assert not (corpus / ".hydra").exists() and not (corpus / "train.log").exists()


def test_a_two_process_checkpoint_resumes_in_one_process(corpus):
    ddp = corpus / "two_procs_resume"
    run(corpus, ddp, "train.batch_size=4", nproc=2)
    proc = run(corpus, ddp, f"resume={ddp}", f"train.max_steps={STEPS + 10}",
               "train.batch_size=4", "train.grad_accum=2")
    assert f"resuming {ddp} from step {STEPS}" in proc.stderr
    assert latest_checkpoint(ddp).name == f"step_{STEPS + 10:08d}"
    curve = losses(ddp)
    assert sorted(curve) == list(range(5, STEPS + 11, 5))
