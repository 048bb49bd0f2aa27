"""train.dtype=auto on a CPU: the choice from measured step times, its cache, the line printed,
and a resumed run keeping the dtype its run started with."""
from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from helpers import REPO_ROOT, SCRIPT_ENV, TRAIN, corpus_args, write_corpus
from model.config import ModelConfig
from training import device, dtype_probe
from training.config import Config
from training.device import NATIVE_BF16_ENV
from training.dtype_probe import (CACHE_FILE, Choice, choose_dtype, decide, measure, probe_key,
                                  read_cache, write_cache)

CPU = torch.device("cpu")
VOCAB = 40


def tiny_config(cache_dir: Path) -> Config:
    cfg = Config()
    cfg.model = ModelConfig(n_layer=1, n_head=2, n_embd=16, block_size=16)
    cfg.train.batch_size = 2
    cfg.data.cache_dir = str(cache_dir)
    return cfg


@pytest.fixture
def measured(monkeypatch):
    """The probe unforced (the suite forces fp32), its measurement replaced by given timings;
    the list records each call."""
    monkeypatch.delenv(NATIVE_BF16_ENV, raising=False)
    calls = []

    def fake(timings):
        monkeypatch.setattr(dtype_probe, "measure", lambda *a: calls.append(a) or timings)
        return calls
    return fake


# ----------------------------------------------------------------------------- the decision


def test_bf16_is_chosen_only_when_it_is_faster_by_the_margin():
    assert decide(0.140, 0.100) == Choice("bfloat16", "measured 1.40x faster than float32 here")
    assert decide(0.226, 0.255) == Choice("float32", "bf16 measured 1.13x slower here")
    assert decide(0.103, 0.100) == Choice("float32", "bf16 measured only 1.03x faster here, "
                                                     "under the 5% it must gain")
    assert decide(0.1051, 0.100).name == "bfloat16"     # just over the margin
    assert decide(0.1049, 0.100).name == "float32"
    assert decide(0.1, 0.1, margin=0.0).name == "bfloat16"


def test_the_printed_line_names_the_dtype_and_the_measured_ratio():
    assert decide(0.226, 0.255).line == "dtype: float32 (bf16 measured 1.13x slower here)"
    assert decide(0.14, 0.1).line == "dtype: bfloat16 (measured 1.40x faster than float32 here)"
    assert decide(0.14, 0.1).dtype is torch.bfloat16 and decide(1, 2).dtype is torch.float32


# ----------------------------------------------------------------------------- choosing


def test_auto_on_a_cpu_measures_once_then_reads_the_cache(tmp_path, measured):
    calls = measured((0.226, 0.255))
    cfg = tiny_config(tmp_path / "cache")
    first = choose_dtype(cfg, VOCAB, CPU)
    assert first.name == "float32" and len(calls) == 1
    # both timings named (the line once read "226 vs 255 ms", which is which unsaid)
    assert first.line.startswith("dtype: float32 (bf16 measured 1.13x slower here: a step float32 "
                                 "226 ms, bfloat16 255 ms; probe ")
    again = choose_dtype(cfg, VOCAB, CPU)
    assert len(calls) == 1  # cached
    assert again.line == (f"dtype: float32 (bf16 measured 1.13x slower here; cached in "
                          f"{tmp_path / 'cache' / CACHE_FILE})")
    cfg.model.n_embd = 32  # another shape is measured afresh, and kept next to the first
    measured((0.14, 0.10))
    assert choose_dtype(cfg, VOCAB, CPU).name == "bfloat16"
    assert len(read_cache(tmp_path / "cache" / CACHE_FILE)) == 2


def test_what_is_not_auto_on_a_cpu_is_not_measured(tmp_path, measured, monkeypatch):
    calls = measured((1.0, 0.5))
    cfg = tiny_config(tmp_path)
    cfg.train.dtype = "float32"
    assert choose_dtype(cfg, VOCAB, CPU) == Choice("float32", "train.dtype=float32")
    cfg.train.dtype = "auto"
    assert choose_dtype(cfg, VOCAB, torch.device("mps")) == Choice("float32", "auto on mps")
    monkeypatch.setenv(NATIVE_BF16_ENV, "1")  # --cpu-bf16
    assert choose_dtype(cfg, VOCAB, CPU) == Choice("bfloat16", f"auto: {NATIVE_BF16_ENV}=1")
    monkeypatch.setenv(NATIVE_BF16_ENV, "0")
    assert choose_dtype(cfg, VOCAB, CPU).name == "float32"
    assert calls == [] and not (tmp_path / CACHE_FILE).exists()


def test_the_key_changes_with_the_shape_and_the_threads(tmp_path):
    cfg = tiny_config(tmp_path)
    key = probe_key(cfg, VOCAB)
    assert key == probe_key(tiny_config(tmp_path), VOCAB)
    assert torch.__version__ in key and f"{torch.get_num_threads()} threads" in key
    assert probe_key(cfg, VOCAB + 1) != key
    cfg.train.batch_size += 1
    assert probe_key(cfg, VOCAB) != key
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert probe_key(tiny_config(tmp_path), VOCAB) != key
    finally:
        torch.set_num_threads(threads)


ZEN4 = ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n"
        "model name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512f avx512_bf16\n\n"
        "processor\t: 1\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2\n")


@pytest.mark.parametrize("other", [ZEN4.replace(" avx512f avx512_bf16", "", 1),  # AVX2 only
                                   ZEN4.replace(": 17", ": 1", 1)])            # another model
def test_the_key_tells_cpus_of_one_name_apart(tmp_path, monkeypatch, other):
    """A virtual machine may name an AVX2-only EPYC and a Zen 4 alike ("AMD EPYC"), and a disk
    may move between them: their timings must not share an entry. Only the first processor's
    block counts (the others repeat it)."""
    def key_on(cpuinfo: str) -> str:
        path = tmp_path / "cpuinfo"
        path.write_text(cpuinfo)
        monkeypatch.setattr(device, "CPUINFO", path)
        return probe_key(tiny_config(tmp_path), VOCAB)

    zen4 = key_on(ZEN4)
    assert zen4.startswith("AMD EPYC [") and device.cpu_has_native_bf16()
    assert key_on(ZEN4.replace("fpu avx2\n", "fpu\n")) == zen4  # the second block is ignored
    assert key_on(other) != zen4
    assert device.cpu_has_native_bf16() == ("avx512_bf16" in other)  # read from the same fields
    monkeypatch.setattr(device, "CPUINFO", tmp_path / "missing")
    assert probe_key(tiny_config(tmp_path), VOCAB)  # no /proc/cpuinfo (macOS): the platform's name


# ----------------------------------------------------------------------------- the cache


def test_the_cache_round_trips_exactly(tmp_path):
    path = tmp_path / "sub" / CACHE_FILE
    write_cache(path, "a", (0.1234567891, 0.2))
    write_cache(path, "b", (3.0, 1.5))
    assert read_cache(path) == {"a": (0.1234567891, 0.2), "b": (3.0, 1.5)}


@pytest.mark.parametrize("content", [
    b"\xff\xfe not utf-8", b"{ not json", b"[1, 2]", b'{"format": 99, "entries": {}}',
    b'{"format": 1, "entries": []}', b'{"format": 1}'])
def test_a_corrupt_or_foreign_cache_is_ignored_and_replaced(tmp_path, measured, content):
    calls = measured((0.2, 0.1))
    cfg = tiny_config(tmp_path)
    (tmp_path / CACHE_FILE).write_bytes(content)
    assert read_cache(tmp_path / CACHE_FILE) == {}
    assert choose_dtype(cfg, VOCAB, CPU).name == "bfloat16" and len(calls) == 1
    assert read_cache(tmp_path / CACHE_FILE) == {probe_key(cfg, VOCAB): (0.2, 0.1)}


def test_bad_entries_are_dropped_and_good_ones_kept(tmp_path):
    entries = {"good": {"float32_s": 0.2, "bfloat16_s": 0.1},
               "text": {"float32_s": "0.2", "bfloat16_s": 0.1},
               "zero": {"float32_s": 0.0, "bfloat16_s": 0.1},
               "negative": {"float32_s": -1, "bfloat16_s": 0.1},
               "bool": {"float32_s": True, "bfloat16_s": 0.1},
               "missing": {"float32_s": 0.2}, "list": [0.2, 0.1], "none": None}
    path = tmp_path / CACHE_FILE
    path.write_text(json.dumps({"format": 1, "entries": entries}))
    assert read_cache(path) == {"good": (0.2, 0.1)}
    path.write_text('{"format": 1, "entries": {"nan": {"float32_s": NaN, "bfloat16_s": 1}}}')
    assert read_cache(path) == {}


def test_a_forged_entry_is_measured_again(tmp_path, measured):
    """Round five: times that are positive and finite but no step's (5e-324 s against 1e300 s)
    made decide() divide by zero, leaving the new run's directory behind."""
    calls = measured((0.2, 0.1))
    cfg = tiny_config(tmp_path)
    key = probe_key(cfg, VOCAB)
    for forged in ((5e-324, 1e300), (1e300, 5e-324), (1e-9, 0.1), (0.1, 1e9)):
        (tmp_path / CACHE_FILE).write_text(json.dumps(
            {"format": 1, "entries": {key: {"float32_s": forged[0], "bfloat16_s": forged[1]}}}))
        assert read_cache(tmp_path / CACHE_FILE) == {}
        assert choose_dtype(cfg, VOCAB, CPU).name == "bfloat16"
    assert len(calls) == 4


def test_a_fifo_as_the_cache_is_measured_again_without_blocking(tmp_path, measured):
    """Round five: dtype.json as a FIFO hung train.py forever (a blocking open). It is read like
    every file read back: opened without blocking, a regular file or nothing cached."""
    import os
    import threading

    calls = measured((0.2, 0.1))
    cfg = tiny_config(tmp_path)
    os.mkfifo(tmp_path / CACHE_FILE)
    result = {}
    reader = threading.Thread(target=lambda: result.update(
        choice=choose_dtype(cfg, VOCAB, CPU)), daemon=True)
    reader.start()
    reader.join(10)
    if reader.is_alive():  # let the blocked open go before failing
        os.close(os.open(tmp_path / CACHE_FILE, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(10)
        pytest.fail("reading a FIFO as dtype.json blocked")
    assert result["choice"].name == "bfloat16" and len(calls) == 1
    assert read_cache(tmp_path / CACHE_FILE) == {probe_key(cfg, VOCAB): (0.2, 0.1)}


@pytest.mark.slow  # a Python that imports torch, with its memory bounded
@pytest.mark.parametrize("make", ["link to /dev/zero", "sparse terabyte", "directory"])
def test_a_cache_that_never_ends_is_nothing_cached(tmp_path, make):
    """Round five: dtype.json as a link to /dev/zero ended train.py in MemoryError."""
    path = tmp_path / CACHE_FILE
    if make == "link to /dev/zero":
        path.symlink_to("/dev/zero")
    elif make == "sparse terabyte":
        with open(path, "wb") as f:
            f.truncate(1 << 40)
    else:
        path.mkdir()
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30)); "
            "from pathlib import Path; from training.dtype_probe import read_cache; "
            "print(read_cache(Path(sys.argv[1])))")
    result = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True,
                            text=True, timeout=120, env=SCRIPT_ENV, cwd=REPO_ROOT)
    assert result.returncode == 0 and result.stdout == "{}\n", result.stderr[-500:]


def test_an_unwritable_cache_costs_a_probe_not_the_run(tmp_path, measured):
    measured((0.2, 0.1))
    blocker = tmp_path / "file"
    blocker.write_text("")  # the cache directory would have to be inside a file
    assert choose_dtype(tiny_config(blocker / "cache"), VOCAB, CPU).name == "bfloat16"


# ----------------------------------------------------------------------------- the probe


def test_the_probe_times_both_dtypes_and_leaves_the_random_state_alone(tmp_path):
    torch.manual_seed(123)
    before = torch.get_rng_state()
    fp32, bf16 = measure(tiny_config(tmp_path), VOCAB, CPU)
    assert 0 < fp32 < 5 and 0 < bf16 < 5
    assert torch.equal(torch.get_rng_state(), before)


# ----------------------------------------------------------------------------- train.py


def train(args: list, cwd: Path, **env) -> subprocess.CompletedProcess:
    """train.py with dtype=auto measured (the suite's SCRATCH_GPT_CPU_BF16 removed), or env's."""
    run_env = {k: v for k, v in SCRIPT_ENV.items() if k != NATIVE_BF16_ENV} | env
    result = subprocess.run([sys.executable, TRAIN, *map(str, args)], cwd=cwd, env=run_env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.mark.slow
def test_a_run_prints_records_and_keeps_its_measured_dtype(tmp_path):
    write_corpus(tmp_path, train_chars=20_000, val_chars=4_000)
    cache, run_dir = tmp_path / "cache", tmp_path / "run"
    cache.mkdir()
    (cache / CACHE_FILE).write_text("{ corrupt")
    base = ["+experiment=smoke", *corpus_args(tmp_path / "corpus", cache), "train.threads=1",
            "train.eval_interval=10", "train.attention_maps=false", "train.sample_tokens=0"]
    first = train([*base, f"hydra.run.dir={run_dir}", "train.max_steps=10"], tmp_path)
    line = next(l for l in first.stderr.splitlines() if "dtype: " in l)
    chosen = line.split("dtype: ")[1].split(" ")[0]
    assert chosen in ("float32", "bfloat16") and "measured" in line and "probe" in line, line
    assert len(read_cache(cache / CACHE_FILE)) == 1  # the corrupt file was replaced
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["train"]["dtype"] == chosen  # what auto resolved to, not "auto"
    assert f"dtype: {chosen}" in (run_dir / "train.log").read_text()
    # Resumed where auto would now decide the other way: the run keeps its dtype.
    other = "0" if chosen == "bfloat16" else "1"
    resumed = train([f"resume={run_dir}", "train.max_steps=20"], tmp_path,
                    **{NATIVE_BF16_ENV: other})
    assert f"dtype: {chosen} (train.dtype={chosen})" in resumed.stderr
    assert "from step 10" in resumed.stderr
    # ... while a new run under that setting does decide the other way
    fresh = train([*base, f"hydra.run.dir={tmp_path / 'run2'}", "train.max_steps=1"], tmp_path,
                  **{NATIVE_BF16_ENV: other})
    assert f"dtype: {'bfloat16' if other == '1' else 'float32'} (auto: " in fresh.stderr


def count_steps(monkeypatch) -> list:
    """The optimizer steps a probe takes (one per training step), counted."""
    import training.optim
    real, steps = training.optim.make_optimizer, []

    def counting(*args):
        optimizer = real(*args)
        step = optimizer.step
        optimizer.step = lambda: steps.append(1) or step()
        return optimizer
    monkeypatch.setattr(training.optim, "make_optimizer", counting)
    return steps


def test_the_probe_repeats_within_its_budget_and_stops_at_its_cap(tmp_path, monkeypatch):
    steps = count_steps(monkeypatch)
    monkeypatch.setattr(dtype_probe, "CLEAR", math.inf)  # no ratio ends it early
    measure(tiny_config(tmp_path), VOCAB, CPU)  # a tiny model: far under BUDGET_S
    assert len(steps) == 2 * (dtype_probe.WARMUP + dtype_probe.MAX_REPS)
    steps.clear()
    monkeypatch.setattr(dtype_probe, "CAP_S", 0.0)  # as if each step took longer than the cap
    measure(tiny_config(tmp_path), VOCAB, CPU)
    assert len(steps) == 2 * (dtype_probe.WARMUP + 1)  # one timed step of each, not MIN_REPS


def test_the_probe_stops_once_bf16_is_clearly_slower(tmp_path, monkeypatch):
    steps = count_steps(monkeypatch)
    monkeypatch.setattr(dtype_probe, "CLEAR", 0.0)  # any bf16 step counts as clearly slower
    fp32, bf16 = measure(tiny_config(tmp_path), VOCAB, CPU)
    assert len(steps) == 2 * (dtype_probe.WARMUP + 1)  # one timed step of each told
    assert fp32 > 0 and bf16 > 0


def test_slow_first_steps_do_not_decide(tmp_path, monkeypatch):
    """A process's first steps pay one-time costs: in fresh clones' first runs, fp32's first
    steps took over twice their later ones, and the probe, timing one, took bf16 for 2.4-4.3x
    faster than fp32 where it was 1.6x. Here fp32's first two steps are made a second slower."""
    import training.optim
    real = training.optim.make_optimizer

    def slow_first_fp32_step(model, optim, dtype):
        optimizer, calls = real(model, optim, dtype), []
        step = optimizer.step

        def first_slow():
            if dtype == torch.float32 and len(calls) < 2:
                time.sleep(1.0)
            calls.append(1)
            step()
        optimizer.step = first_slow
        return optimizer
    monkeypatch.setattr(training.optim, "make_optimizer", slow_first_fp32_step)
    fp32, bf16 = measure(tiny_config(tmp_path), VOCAB, CPU)
    assert fp32 < 0.5, fp32
