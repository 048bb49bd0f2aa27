"""The end-to-end flows on a real CUDA GPU; every test here is skipped where there is none.

What the meta-device guard (tests/test_devices.py) checks on any machine is run here for real:
training with evaluation, attention diagnostics, samples and checkpoints; resume; the NaN guard;
a stop by signal; generate.py; the pitfall multirun; bf16 autocast and torch.compile (both on by
default on CUDA); the static-cache decode step as a CUDA graph; the benches; and DDP with nccl
where there are two GPUs. The corpora are small local files, so no network is needed.
"""
from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from helpers import REPO_ROOT, shakespeare_like
from training.checkpoint import latest_checkpoint, load_state

pytestmark = [pytest.mark.cuda, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TRAIN, GENERATE = str(REPO_ROOT / "train.py"), str(REPO_ROOT / "generate.py")
NAN_TRAIN = str(REPO_ROOT / "tests" / "nan_train.py")  # train.py with a NaN loss at one step


def run(args: list[str], cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stderr[-4000:]}"
    return result


def scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cuda")
    (root / "train.txt").write_text(shakespeare_like(60_000, seed=1))
    (root / "val.txt").write_text(shakespeare_like(8_000, seed=2))
    return root


def smoke(corpus: Path, run_dir: Path, *overrides: str) -> list[str]:
    return [TRAIN, "+experiment=smoke", "data=text_files", f"data.train_files=[{corpus / 'train.txt'}]",
            f"data.val_files=[{corpus / 'val.txt'}]", f"data.cache_dir={corpus / 'cache'}",
            f"hydra.run.dir={run_dir}", "train.device=cuda", *overrides]


@pytest.fixture(scope="module")
def trained(corpus) -> Path:
    """A 40-step run with everything CUDA does by default (bf16 autocast, torch.compile), the
    fused attention where Triton is installed, then resumed to 60."""
    run_dir = corpus / "run"
    first = ok(run(smoke(corpus, run_dir, "train.max_steps=40", "train.eval_interval=20",
                         "train.final_full_eval=true"), corpus))
    assert "cuda bfloat16" in first.stderr
    ok(run([TRAIN, f"resume={run_dir}", "train.max_steps=60"], corpus))
    return run_dir


def test_training_evaluates_samples_checkpoints_and_resumes(trained):
    ev = scalars(trained)
    assert [s for s, _ in ev["val/loss"]] == [20, 40, 60]
    loss = dict(ev["train/loss"])
    assert loss[60] < loss[10] - 0.3, loss
    for tag in ("weights/max_weight/layer0", "weights/entropy/layer0",
                "weights/grad_norm_q/layer0"):
        assert all(math.isfinite(v) for _, v in ev[tag]), tag
    assert load_state(latest_checkpoint(trained))["step"] == 60
    assert "overfitting" not in (trained / "train.log").read_text()


def test_generate_samples_on_the_gpu(trained):
    result = ok(run([GENERATE, f"run={trained}", "device=cuda", "prompt=ROMEO:",
                     "max_new_tokens=200", "seed=3"], trained.parent))
    assert result.stdout.startswith("ROMEO:") and len(result.stdout) > 100
    again = ok(run([GENERATE, f"run={trained}", "device=cuda", "prompt=ROMEO:",
                    "max_new_tokens=200", "seed=3"], trained.parent))
    assert again.stdout == result.stdout  # seeded: the same text twice


def test_nan_guard_stops_and_names_the_last_checkpoint(corpus, tmp_path):
    _, *args = smoke(corpus, tmp_path / "nan", "train.eval_interval=30")
    result = run([NAN_TRAIN, "35", *args], corpus)
    assert result.returncode == 2 and "non-finite loss at step 35" in result.stderr
    assert "step 30" in result.stderr


def test_a_signal_saves_a_checkpoint_and_the_run_resumes(corpus, tmp_path):
    run_dir = tmp_path / "signal"
    proc = subprocess.Popen([sys.executable, *smoke(corpus, run_dir, "train.max_steps=100000",
                                                    "train.eval_interval=50")],
                            cwd=corpus, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while latest_checkpoint(run_dir) is None and time.time() < deadline:
        time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT and "checkpoint saved" in err
    stopped = load_state(latest_checkpoint(run_dir))["step"]
    ok(run([TRAIN, f"resume={run_dir}", f"train.max_steps={stopped + 10}"], corpus))
    assert load_state(latest_checkpoint(run_dir))["step"] == stopped + 10


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compiled_and_fp32_steps_train(corpus, tmp_path, mode):
    ok(run(smoke(corpus, tmp_path / mode, "train.compile=true", f"train.compile_mode={mode}",
                 "train.max_steps=30"), corpus))
    ok(run(smoke(corpus, tmp_path / f"{mode}-fp32", "train.dtype=float32", "train.compile=false",
                 "train.max_steps=30"), corpus))


def test_the_pitfall_study_runs_on_the_gpu(corpus, tmp_path):
    """One arm of each regime, shortened: the leak and its causal loss, on CUDA."""
    ok(run([TRAIN, "-m", "+arm=leak-mask_zero,scale-no_scale,heads-no_out_proj", "seed=0",
            "data=text_files", f"data.train_files=[{corpus / 'train.txt'}]",
            f"data.val_files=[{corpus / 'val.txt'}]", f"data.cache_dir={corpus / 'cache'}",
            "train.device=cuda", "train.max_steps=60", "train.eval_interval=30",
            f"hydra.sweep.dir={tmp_path}"], corpus))
    leak = scalars(tmp_path / "leak-mask_zero_seed0")
    assert "val/causal_loss" in leak


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_static_cache_decode_as_a_cuda_graph_gives_the_uncached_tokens(dtype):
    from model.config import ModelConfig
    from model.gpt import GPT

    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layer=2, n_head=4, n_embd=64, block_size=32), 50).cuda().eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    prompt = torch.randint(0, 50, (2, 5), device="cuda")
    with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
        graph = torch.cat(list(model.generate(prompt, 27, greedy=True, static_cache=True)), 1)
        growing = torch.cat(list(model.generate(prompt, 27, greedy=True, static_cache=False)), 1)
        plain = torch.cat(list(model.generate(prompt, 27, greedy=True, use_cache=False)), 1)
    assert torch.equal(graph, growing) and torch.equal(graph, plain)


def test_fused_attention_trains_like_the_reference(corpus, tmp_path):
    pytest.importorskip("triton")
    losses = {}
    for impl in ("reference", "fused"):
        ok(run(smoke(corpus, tmp_path / impl, f"attention.impl={impl}", "train.max_steps=40",
                     "train.compile=false"), corpus))
        losses[impl] = dict(scalars(tmp_path / impl)["train/loss"])[40]
    assert abs(losses["fused"] - losses["reference"]) < 0.05, losses


@pytest.mark.parametrize("name", ["bench.attention", "bench.train_step", "bench.generate",
                                  "tools.startup"])
def test_benches_run_on_the_gpu(name):
    done = subprocess.run([sys.executable, "-m", name, "quick=true", "device=cuda"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1].startswith("ratio=")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpus_with_nccl_match_one_with_accumulation(corpus, tmp_path):
    common = ["train.max_steps=20", "train.batch_size=4", "train.dtype=float32",
              "train.compile=false", "train.sample_tokens=0"]
    ok(run(smoke(corpus, tmp_path / "one", *common, "train.grad_accum=2"), corpus))
    ok(run(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            *smoke(corpus, tmp_path / "two", *common)], corpus))
    one, two = scalars(tmp_path / "one")["train/loss"], scalars(tmp_path / "two")["train/loss"]
    assert max(abs(a[1] - b[1]) for a, b in zip(one, two)) < 1e-3
