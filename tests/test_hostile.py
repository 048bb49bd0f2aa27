"""What the bad-input tables (tests/test_cli_errors.py) cannot show: the inputs of issue 18 whose
right outcome is not a refusal, or that need timing, several processes or odd streams.

- sweeps: arms that differ only in a value run_name does not name train into directories of
  their own, each recording its own overrides; an arm that fails late takes nothing of the others;
- two processes on one run: the second is refused naming the first; a killed holder leaves no
  lock; a read-only checkpoints/ is refused before anything changes;
- signals: SIGTERM while the corpus is tokenized, while waiting for the cache's lock and in the
  middle of a long accumulation is honoured within seconds, leaves nothing half-made, and the
  interrupted run resumes bit-exactly;
- the streams: stdout closed or on a full disk, a full disk under scripts.export_hf;
- what train.py writes is what everything reads back (a property test, then one run read back by
  generate.py, scripts.attention_map, scripts.export_hf and a resume);
- values the checks let through: top_p=1e-300, a run trained with the fused kernel sampled on a
  CPU, validation text that overlaps the training text when the user asks for it.
"""
from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from forkserver import ForkServer, alive
from helpers import (GENERATE, REPO_ROOT, SCRIPT_ENV, corpus_args, ok, one_error_line, scalars,
                     shakespeare_like, tree, write_corpus)
from training.checkpoint import latest_checkpoint

pytestmark = pytest.mark.slow
ROOT_USER = os.geteuid() == 0


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    corpus = write_corpus(root)
    server = ForkServer(tmp_path_factory.mktemp("hostile_output"))
    common = ["+experiment=smoke", *corpus_args(corpus, root / "cache"), "train.threads=1",
              "train.sample_tokens=0"]
    reference = root / "reference"
    ok(server.run("train.py", [*common, "train.max_steps=20", "train.eval_interval=10",
                               f"hydra.run.dir={reference}"], cwd=root))
    yield dict(root=root, corpus=corpus, common=common, reference=reference, server=server)
    server.close()


def copy_run(env, tmp_path: Path, name: str = "run") -> Path:
    shutil.copytree(env["reference"], tmp_path / name, symlinks=True)
    return tmp_path / name


def wait_for(condition, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not happen in {seconds} s")
        time.sleep(0.01)


# ----------------------------------------------------------------------------- sweeps


def test_arms_that_differ_only_in_lr_train_in_directories_of_their_own(env, tmp_path):
    sweep = tmp_path / "sweep"
    result = ok(env["server"].run("train.py", [
        "-m", "optim.lr=3e-3,2e-3", *env["common"], "train.max_steps=4", "train.eval_interval=2",
        f"hydra.sweep.dir={sweep}"], cwd=tmp_path))
    arms = sorted(p.name for p in sweep.iterdir() if p.is_dir())
    assert arms == ["correct_seed1337_lr0.002", "correct_seed1337_lr0.003"], arms
    for arm in arms:
        lr = float(arm.rsplit("lr", 1)[1])
        overrides = (sweep / arm / ".hydra" / "overrides.yaml").read_text()
        assert f"optim.lr={lr}" in overrides and f"optim.lr={0.005 - lr:g}" not in overrides
        assert f"  lr: {lr}\n" in (sweep / arm / "config.yaml").read_text()
        assert latest_checkpoint(sweep / arm) is not None
    assert (sweep / "multirun.yaml").is_file()
    assert "already holds a checkpoint" not in result.stderr


def test_an_arm_failing_late_leaves_nothing_and_keeps_the_arms_before_it(env, tmp_path):
    """The second arm's training file is shorter than a block: found only when it is tokenized,
    after the first arm trained."""
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("ROMEO: hi\n")
    sweep = tmp_path / "sweep"
    train_file = env["corpus"] / "train.txt"
    result = env["server"].run("train.py", [
        "-m", *env["common"], f"data.train_files=[{train_file}],[{tiny}]", "train.max_steps=2",
        "train.eval_interval=2", f"hydra.sweep.dir={sweep}"], cwd=tmp_path)
    assert result.returncode == 2, result
    assert "fewer than one window" in one_error_line(result)
    arms = sorted(p for p in sweep.iterdir() if p.is_dir())
    assert len(arms) == 1 and latest_checkpoint(arms[0]) is not None, arms
    assert sorted(p.name for p in sweep.iterdir()) == sorted([".lock", "multirun.yaml",
                                                              "sweep.json", arms[0].name])


def test_a_sweep_of_one_value_with_a_configured_subdir_is_named_as_configured(env, tmp_path):
    sweep = tmp_path / "sweep"
    ok(env["server"].run("train.py", [
        "-m", "seed=3,4", *env["common"], "train.max_steps=2", "train.eval_interval=2",
        "run_name=r${seed}", f"hydra.sweep.dir={sweep}"], cwd=tmp_path))
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["r3", "r4"]


# ----------------------------------------------------------------------------- one process per run


def test_two_resumes_started_together_train_once(env, tmp_path):
    run = copy_run(env, tmp_path)
    argv = [f"resume={run}", "train.max_steps=60", "train.eval_interval=20", "train.threads=1"]
    first = env["server"].start("train.py", argv, cwd=tmp_path)
    second = env["server"].start("train.py", argv, cwd=tmp_path)
    results = [env["server"].wait(first, 120), env["server"].wait(second, 120)]
    codes = sorted(r.returncode for r in results)
    assert codes == [0, 2], results
    refused = next(r for r in results if r.returncode == 2)
    line = one_error_line(refused)
    assert f"{run} is in use by another process (pid" in line and "resume=" in line, line
    ev = scalars(run)
    for tag in ("val/loss", "train/loss"):
        steps = [s for s, _ in ev[tag]]
        assert steps == sorted(set(steps)), (tag, steps)  # every point once
    evaluations = [l for l in (run / "train.log").read_text().splitlines() if ": train loss" in l]
    assert len(evaluations) == len({l.split("] ", 1)[1] for l in evaluations}), evaluations
    assert (run / ".lock").read_bytes() == b""  # given back, empty


def test_a_killed_holder_leaves_no_lock(env, tmp_path):
    run = copy_run(env, tmp_path)
    pid = env["server"].start("train.py", [f"resume={run}", "train.max_steps=100000",
                                           "train.threads=1"], cwd=tmp_path)
    wait_for(lambda: (run / ".lock").stat().st_size > 0, 60, "the lock's note")
    assert json.loads((run / ".lock").read_text())["pid"] == pid
    os.kill(pid, signal.SIGKILL)
    env["server"].wait(pid, 30)
    ok(env["server"].run("train.py", [f"resume={run}", "train.max_steps=30", "train.threads=1"],
                         cwd=tmp_path))


def _mount_read_only(path: Path) -> bool:
    ok = subprocess.run(["mount", "--bind", str(path), str(path)], capture_output=True)
    if ok.returncode:
        return False
    if subprocess.run(["mount", "-o", "remount,bind,ro", str(path)],
                      capture_output=True).returncode:
        subprocess.run(["umount", str(path)])
        return False
    return True


@pytest.mark.skipif(not ROOT_USER, reason="tests/test_cli_errors.py's in_use table covers it")
def test_a_resume_on_a_read_only_file_system_changes_nothing(env, tmp_path):
    """As root, permission bits do not bind: a read-only bind mount of checkpoints/ does."""
    run = copy_run(env, tmp_path)
    checkpoints = run / "checkpoints"
    if not _mount_read_only(checkpoints):
        pytest.skip("cannot mount here")
    try:
        before = tree(run)
        result = env["server"].run("train.py", [f"resume={run}", "train.max_steps=30"],
                                   cwd=tmp_path, timeout=60)
        assert result.returncode == 2, result
        assert "not writable" in one_error_line(result)
        assert tree(run) == before
    finally:
        subprocess.run(["umount", str(checkpoints)], check=True)


# ----------------------------------------------------------------------------- signals


def test_sigterm_while_tokenizing_leaves_no_run_and_no_cache_entry(env, tmp_path):
    big = tmp_path / "big.txt"
    big.write_text(shakespeare_like(6_000_000, seed=5))
    cache = tmp_path / "cache"
    run = tmp_path / "run"
    pid = env["server"].start("train.py", [
        "+experiment=smoke", "tokenizer=bpe", "tokenizer.vocab_size=2048", "data=text_files",
        f"data.train_files=[{big}]", f"data.val_files=[{env['corpus'] / 'val.txt'}]",
        f"data.cache_dir={cache}", f"hydra.run.dir={run}"], cwd=tmp_path)
    wait_for(lambda: any((cache / "tokens").glob(".tmp-*")) or not alive(pid), 120,
             "tokenizing")
    assert alive(pid), env["server"].wait(pid)
    time.sleep(0.5)
    os.kill(pid, signal.SIGTERM)
    sent = time.monotonic()
    result = env["server"].wait(pid, 30)
    took = time.monotonic() - sent
    assert not result.timed_out and took < 5, (took, result)
    assert result.returncode == 128 + signal.SIGTERM, result
    assert "SIGTERM" in one_error_line(result)
    assert not run.exists()
    assert not [p.name for p in (cache / "tokens").iterdir()]


def test_sigterm_while_waiting_for_the_cache_lock(env, tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    fd = os.open(cache / ".lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # "another process" is building the cache
    try:
        run = tmp_path / "run"
        pid = env["server"].start("train.py", [*env["common"], f"data.cache_dir={cache}",
                                               f"hydra.run.dir={run}"], cwd=tmp_path)
        wait_for(lambda: "waiting for another process" in _stderr_so_far(env, pid) or not alive(pid),
                 60, "waiting for the lock")
        os.kill(pid, signal.SIGTERM)
        result = env["server"].wait(pid, 10)
        assert not result.timed_out and result.returncode == 128 + signal.SIGTERM, result
        assert not run.exists()
    finally:
        os.close(fd)


def _stderr_so_far(env, pid: int) -> str:
    try:
        return Path(env["server"].outs[pid] + ".stderr").read_text(errors="replace")
    except FileNotFoundError:  # not yet made by the child
        return ""


def test_sigterm_mid_accumulation_stops_within_seconds_and_resumes_bit_exactly(env, tmp_path):
    """With train.grad_accum=800 a step takes several seconds: the signal is taken between
    micro-batches, the step taken back (gradients, batch sampler, random generators), the
    checkpoint saved at the last whole step, and the run resumed from it ends with the very
    weights and curves of an uninterrupted run."""
    args = [*env["common"], "train.grad_accum=800", "train.batch_size=1", "train.max_steps=2",
            "train.eval_interval=3", "train.log_interval=1", "train.eval_batches=1"]
    straight = tmp_path / "straight"
    started = time.monotonic()
    ok(env["server"].run("train.py", [*args, f"hydra.run.dir={straight}"], cwd=tmp_path))
    step_s = (time.monotonic() - started) / 2
    stopped = tmp_path / "stopped"
    pid = env["server"].start("train.py", [*args, f"hydra.run.dir={stopped}"], cwd=tmp_path)
    wait_for(lambda: any(stopped.glob("events.out.tfevents.*")) or not alive(pid), 120,
             "training")
    time.sleep(min(2.0, step_s / 2))
    os.kill(pid, signal.SIGTERM)
    sent = time.monotonic()
    result = env["server"].wait(pid, 60)
    took = time.monotonic() - sent
    assert result.returncode == 128 + signal.SIGTERM, result
    assert "stopped by SIGTERM at step" in result.stderr, result
    assert took < step_s / 2, (took, step_s)  # between micro-batches, not steps (load-proof)
    ok(env["server"].run("train.py", [f"resume={stopped}", "train.threads=1"], cwd=tmp_path))
    for name in ("step_00000002", "best"):
        a = (straight / "checkpoints" / name / "model.safetensors").read_bytes()
        assert a == (stopped / "checkpoints" / name / "model.safetensors").read_bytes(), name
    assert scalars(stopped)["train/loss"] == scalars(straight)["train/loss"]


# ----------------------------------------------------------------------------- the streams


def _generate(argv: list[str], shell_redirect: str = "", **kwargs) -> subprocess.CompletedProcess:
    command = " ".join([sys.executable, GENERATE, *map(lambda a: f"'{a}'", argv)]) + shell_redirect
    return subprocess.run(command, shell=True, env=SCRIPT_ENV, capture_output=False,
                          stderr=subprocess.PIPE, text=True, timeout=120, **kwargs)


@pytest.mark.parametrize("redirect", [" >&-", " >/dev/full"], ids=["closed", "full"])
def test_generate_with_stdout_closed_or_full_says_so_in_one_line(env, tmp_path, redirect):
    result = _generate([f"run={env['reference']}", "max_new_tokens=5"], redirect, cwd=tmp_path)
    result.stdout = ""
    assert result.returncode == 2, result.stderr
    line = one_error_line(result)
    assert "stdout" in line, line


def test_train_py_with_stdout_on_a_full_disk(tmp_path):
    result = subprocess.run(f"{sys.executable} {REPO_ROOT / 'train.py'} --cfg job >/dev/full",
                            shell=True, env=SCRIPT_ENV, stderr=subprocess.PIPE, text=True,
                            cwd=tmp_path, timeout=120)
    result.stdout = ""
    assert result.returncode == 2, result.stderr
    assert "stdout" in one_error_line(result)


def test_export_on_a_full_disk_says_so_and_leaves_nothing(env, tmp_path):
    def small_disk():  # files beyond 64 KB cannot be written: as a full disk
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    out = tmp_path / "exports" / "gpt2"
    result = subprocess.run([sys.executable, "-m", "scripts.export_hf", f"run={env['reference']}",
                             f"out={out}"], cwd=REPO_ROOT, env=SCRIPT_ENV, capture_output=True,
                            text=True, timeout=120, preexec_fn=small_disk)
    assert result.returncode == 2, result
    assert "cannot write the export" in one_error_line(result)
    assert list((tmp_path / "exports").iterdir()) == []


# ----------------------------------------------------------------------------- written, read back

PIECES = ["$", "{", "}", "${", "\\", "\\\\", "'", '"', ":", ": ", "#", " #", "- ", " ", "\n", "\t",
          "\r\n", "é", "中", "😀", "\x00", "\x1b", "\x7f", "\x85", "\u2028", "\ufeff", "null",
          "true", "~", "1e3", "0x10", "yes", "[", "]", ",", "*", "&", "!", "%", "@", "|", ">",
          "?", "x", "12", ".inf", "=", "${x}", "\\${y}", "${oc.env:HOME}"]


def test_any_config_train_py_accepts_reads_back_from_its_config_yaml():
    """A property: strings made of the pieces YAML and OmegaConf give meaning to, in every text
    field of a config, are written by dump_run_config and read back by load_run_config exactly
    (check_saved_config refuses a run whose config would not)."""
    from safeio.files import dump_run_config, parse_run_config
    from guard.compose import compose
    from guard.preflight import check_saved_config
    from omegaconf import OmegaConf
    from training.config import Config

    base = compose(["+experiment=smoke"])
    rng = random.Random(18)

    def text() -> str:
        return "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 6)))

    for _ in range(500):
        cfg = dataclasses.replace(
            base, run_name=text(), train=dataclasses.replace(base.train, sample_prompt=text()),
            data=dataclasses.replace(base.data, separator=text(), hub_name=text(),
                                     train_files=[text() for _ in range(rng.randint(0, 3))]))
        check_saved_config(cfg)
        back = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), parse_run_config(
            dump_run_config(cfg), Path("config.yaml"))))
        assert back == cfg, (cfg.run_name, cfg.train.sample_prompt, cfg.data.separator)


def test_a_run_with_a_literal_interpolation_and_900_files_is_read_back_everywhere(env, tmp_path):
    """train.sample_prompt='\\${x}' and a corpus listed as 900 files: generate.py,
    scripts.attention_map (on the run's own validation text), scripts.export_hf and a resume all
    read the run train.py wrote."""
    text = (env["corpus"] / "train.txt").read_text()
    files = []
    for i in range(900):
        path = tmp_path / "many" / f"a_rather_long_directory_name_{i:04d}" / f"part_{i:04d}.txt"
        path.parent.mkdir(parents=True)
        path.write_text(text[i * 50:i * 50 + 1000])
        files.append(str(path))
    run = tmp_path / "run"
    server = env["server"]
    ok(server.run("train.py", [
        *env["common"], f"data.train_files=[{','.join(files)}]", r"train.sample_prompt='\${x}'",
        "train.sample_tokens=5", "train.max_steps=4", "train.eval_interval=2",
        f"hydra.run.dir={run}"], cwd=tmp_path))
    assert (run / "config.yaml").stat().st_size > 64 << 10
    ok(server.run("generate.py", [f"run={run}", "max_new_tokens=5"], cwd=tmp_path))
    ok(server.run("scripts/attention_map.py", [f"run={run}", f"out={tmp_path / 'map.png'}"],
                  cwd=tmp_path))
    ok(subprocess.run([sys.executable, "-m", "scripts.export_hf", f"run={run}",
                       f"out={tmp_path / 'export'}"], cwd=REPO_ROOT, env=SCRIPT_ENV,
                      capture_output=True, text=True, timeout=120))
    resumed = ok(server.run("train.py", [f"resume={run}", "train.max_steps=6"], cwd=tmp_path))
    assert "resuming" in resumed.stderr
    from guard.run_dir import saved_config
    assert saved_config(run / "config.yaml").train.sample_prompt == "${x}"


def test_a_resume_reads_its_corpus_through_its_own_cache_not_the_run_s(env, tmp_path):
    """A run directory is data: a config.yaml naming another data.cache_dir (a folder of the
    user's) does not choose where the resume writes; the resume's own cache is used (its
    command line's, else .cache), and a note says so."""
    run = copy_run(env, tmp_path)
    victim = tmp_path / "victim"
    victim.mkdir()
    text = (run / "config.yaml").read_text()
    (run / "config.yaml").write_text(text.replace(f"cache_dir: {env['root'] / 'cache'}",
                                                  f"cache_dir: {victim}", 1))
    resumed = ok(env["server"].run("train.py", [f"resume={run}", "train.max_steps=22"],
                                   cwd=tmp_path))
    assert list(victim.iterdir()) == []
    assert list((tmp_path / ".cache" / "tokens").iterdir())
    assert f"the run's data.cache_dir {victim} is not used" in resumed.stderr
    assert latest_checkpoint(run).name == "step_00000022"


# ----------------------------------------------------------------------------- values


def test_top_p_keeps_the_most_likely_token_however_small():
    from model.sampling import filter_logits, sample_next

    logits = torch.tensor([[1.0, 3.0, 2.0, -1.0], [0.0, 0.0, 5.0, 0.0]])
    for top_p in (1e-300, 1e-45, 1e-8, 0.01):
        kept = filter_logits(logits, top_p=top_p).isfinite()
        assert kept.tolist() == [[False, True, False, False], [False, False, True, False]]
        gen = torch.Generator().manual_seed(0)
        assert sample_next(logits, top_p=top_p, generator=gen).flatten().tolist() == [1, 2]


def test_generate_with_a_tiny_top_p_is_greedy(env, tmp_path):
    tiny = ok(env["server"].run("generate.py", [f"run={env['reference']}", "top_p=1e-300",
                                                "max_new_tokens=20"], cwd=tmp_path))
    greedy = ok(env["server"].run("generate.py", [f"run={env['reference']}", "greedy=true",
                                                  "max_new_tokens=20"], cwd=tmp_path))
    assert tiny.stdout == greedy.stdout


def test_a_run_trained_with_the_fused_kernel_samples_on_a_cpu(env, tmp_path):
    """impl=fused is our Triton kernel; where it cannot run, the reference layer computes the same
    function from the same weights."""
    outputs = []
    for impl in ("fused", "auto"):
        run = copy_run(env, tmp_path, impl)
        config = run / "config.yaml"  # two heads of 16: a size the kernel is built for
        config.write_text(config.read_text().replace("n_head: 4", "n_head: 2", 1)
                          .replace("impl: auto", f"impl: {impl}", 1))
        outputs.append(ok(env["server"].run("generate.py", [
            f"run={run}", "greedy=true", "max_new_tokens=20", "device=cpu"], cwd=tmp_path)).stdout)
    assert outputs[0] == outputs[1]


def test_overlapping_splits_train_when_asked_with_a_loud_warning(env, tmp_path):
    run = tmp_path / "run"
    train_file = env["corpus"] / "train.txt"
    result = ok(env["server"].run("train.py", [
        *env["common"], f"data.val_files=[{train_file}]", "data.allow_overlap=true",
        "train.max_steps=2", "train.eval_interval=2", f"hydra.run.dir={run}"], cwd=tmp_path))
    assert "WARNING: data.allow_overlap=true" in result.stderr
    assert "WARNING: data.allow_overlap=true" in (run / "train.log").read_text()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(run))
    acc.Reload()
    assert "warnings/text_summary" in acc.Tags()["tensors"]


def test_a_prompts_file_of_long_prompts_gives_one_warning(env, tmp_path):
    """Round six's Q10: 300 prompts past the context gave 300 warning lines; one says it all."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(("ROMEO: " + "O my lord " * 20 + "\n") * 300)
    result = ok(env["server"].run("generate.py", [f"run={env['reference']}", f"prompts={prompts}",
                                                 "max_new_tokens=1"], cwd=tmp_path))
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and warnings[0].startswith(
        "warning: 300 of the 300 prompts have more tokens than the context of "), result.stderr
