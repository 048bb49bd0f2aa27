"""Reliability of train.py: kills at any instant, signals, and non-finite losses.

Besides one genuine `python train.py` run (the uninterrupted reference), the runs go through
the fork server (tests/forkserver.py): that the forked, killed and resumed runs equal the
genuine process's run bit for bit is part of the kill test. Every run's cwd is a temporary
directory (train.py finds conf/ next to itself), so the repository's runs/latest is left alone.
No network: the corpora are local files. Bad inputs are tests/test_cli_errors.py's.
"""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from forkserver import ForkServer, Result, alive
from helpers import SCRIPT_ENV, TRAIN, corpus_args, ok, one_error_line, scalars, tree, write_corpus
from safeio.checkpoint import load_state
from training.checkpoint import latest_checkpoint

pytestmark = pytest.mark.slow

STEPS, EVERY = 60, 10
NAN_TRAIN = "tests/nan_train.py"  # train.py with a NaN loss at one step  # the reference run: 60 steps, a checkpoint every 10, the last 2 kept


def assert_loads(run_dir: Path) -> int:
    """`latest` names a checkpoint, and it and every other checkpoint on disk is complete and
    readable; the step of `latest`."""
    ckpt = latest_checkpoint(run_dir)
    assert ckpt is not None, f"{run_dir}: `latest` names no complete checkpoint"
    for each in (run_dir / "checkpoints").glob("step_*"):
        assert "tok_emb.weight" in load_file(str(each / "model.safetensors"))
        assert each.name == f"step_{load_state(each)['step']:08d}"
    return load_state(ckpt)["step"]


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """The corpus, the fork server, and the uninterrupted reference run (a genuine process)."""
    root = tmp_path_factory.mktemp("reliability")
    data = corpus_args(write_corpus(root), root / "cache")
    common = ["+experiment=smoke", *data, "train.threads=1", f"train.max_steps={STEPS}",
              f"train.eval_interval={EVERY}", "train.keep_checkpoints=2"]
    reference = root / "reference"
    proc = subprocess.Popen([sys.executable, TRAIN, *common, f"hydra.run.dir={reference}"],
                            cwd=root, env=SCRIPT_ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    server = ForkServer(root)  # imports while the reference trains
    out, err = proc.communicate(timeout=300)
    ok(Result(proc.returncode, out, err))
    yield dict(root=root, data=data, common=common, reference=reference, server=server,
               reference_tree=tree(reference))
    server.close()


@pytest.fixture(scope="module")
def reference(env):
    """The reference run dir, checked to be byte-for-byte as the reference run left it."""
    yield env["reference"]
    assert tree(env["reference"]) == env["reference_tree"]


# ----------------------------------------------------------------------------- kills and signals


def _new_entry(directory: Path, pattern: str, since_ns: int) -> bool:
    try:
        return any(p.stat().st_ctime_ns >= since_ns for p in directory.glob(pattern))
    except FileNotFoundError:  # gone between glob and stat
        return False


def test_kills_at_any_moment_and_sigint_resume_bit_exactly(env, reference):
    """Interrupt one run again and again, resuming it each time, until it has done its steps:
    its final weights and curves equal the uninterrupted reference run's exactly."""
    server, run_dir = env["server"], env["root"] / "interrupted"
    ckpts = run_dir / "checkpoints"
    rng = random.Random(20240605)
    # "random": a seeded random delay after training started (its event file appeared);
    # "saving": the moment a checkpoint's .tmp-step_* directory exists, i.e. mid-write.
    # SIGINT and SIGTERM must finish the step, save, and exit cleanly; SIGKILL can't be caught.
    plan = ["KILL random", "KILL saving", "INT random", "KILL random", "TERM random",
            "KILL saving", "KILL random"]
    log = []
    for what in plan:
        signame, trigger = what.split()
        signum = getattr(signal, "SIG" + signame)
        resume = latest_checkpoint(run_dir) is not None
        argv = ([f"resume={run_dir}", "train.threads=1"] if resume
                else [*env["common"], f"hydra.run.dir={run_dir}"])
        since = time.time_ns() - 1_000_000
        pid = server.start("train.py", argv)
        deadline = time.monotonic() + 60
        delay = rng.uniform(0.0, 0.3)
        fired = False
        while alive(pid) and time.monotonic() < deadline:
            if trigger == "saving" and _new_entry(ckpts, ".tmp-step_*", since):
                fired = True
            elif trigger == "random" and _new_entry(run_dir, "events.out.tfevents.*", since):
                time.sleep(delay)
                fired = alive(pid)
                if not fired:
                    break
            if fired:
                os.kill(pid, signum)
                break
            time.sleep(0.0005)
        if not fired and alive(pid):
            os.kill(pid, signal.SIGKILL)
            pytest.fail(f"{what}: the moment never came in 60 s\n{server.wait(pid)}")
        result = server.wait(pid)
        entry = dict(signal=signame, trigger=trigger, resumed=resume, rc=result.returncode)
        if trigger == "random":
            entry["delay_s"] = round(delay, 3)
        if trigger == "saving":
            entry["mid_write"] = [p.name for p in ckpts.glob(".tmp-step_*")]
        stopped = (result.returncode == -signal.SIGKILL if signame == "KILL"
                   else f"resume={run_dir}" in result.stderr)
        if not stopped:  # it finished before the signal came: allowed, but said
            ok(result)
            entry["finished_first"] = True
            log.append(entry)
            break
        if signame != "KILL":
            assert result.returncode in (0, 128 + signum), result
            assert "Traceback" not in result.stdout + result.stderr, result
        entry["latest_after"] = assert_loads(run_dir) if latest_checkpoint(run_dir) else None
        if signame != "KILL":
            # it saved where it stopped: the step it was at, not the last periodic checkpoint
            assert f"at step {entry['latest_after']};" in result.stderr, result
        log.append(entry)

    if not log[-1].get("finished_first"):
        final = ok(server.run("train.py", [f"resume={run_dir}", "train.threads=1"]))
        assert "resuming" in final.stderr
    kills = [e for e in log if e["signal"] == "KILL" and not e.get("finished_first")]
    print("\ninterruptions (latest_after = step of the checkpoint `latest` names afterwards):")
    for e in log:
        print("  ", e)
    assert len(kills) >= 4, log
    assert any(e.get("mid_write") for e in kills), log  # at least one kill mid-checkpoint
    assert any(e["signal"] == "INT" and not e.get("finished_first") for e in log), log

    last = f"step_{STEPS:08d}"
    a = load_file(str(reference / "checkpoints" / last / "model.safetensors"))
    b = load_file(str(ckpts / last / "model.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert (reference / "checkpoints" / last / "model.safetensors").read_bytes() == \
           (ckpts / last / "model.safetensors").read_bytes()
    assert load_file(str(reference / "checkpoints" / "best" / "model.safetensors")).keys() == a.keys()
    assert (reference / "checkpoints" / "best" / "model.safetensors").read_bytes() == \
           (ckpts / "best" / "model.safetensors").read_bytes()
    ev_a, ev_b = scalars(reference), scalars(run_dir)
    expected = [(s, v) for s, v in ev_a["train/loss"]]
    assert [s for s, _ in expected] == list(range(EVERY, STEPS + 1, EVERY))
    assert ev_b["train/loss"] == expected  # no duplicates, no gaps, same values
    for tag in ("val/loss", "train/lr", "train/grad_norm"):
        assert ev_b[tag] == ev_a[tag], tag
    # Keep the newest 2 + best, and no leftovers of interrupted writes. A caught signal saves
    # where it stopped (say step 51), and that checkpoint is newer than the periodic one before
    # it, so which 2 survive depends on where the signals landed: the newest 2 of all saved.
    saved = set(range(EVERY, STEPS + 1, EVERY))
    saved |= {e["latest_after"] for e in log if e["signal"] != "KILL" and e.get("latest_after")}
    newest = sorted(saved)[-2:]
    assert sorted(p.name for p in ckpts.iterdir()) == sorted(
        ["best", "latest", *(f"step_{s:08d}" for s in newest)])
    assert sorted(p.name for p in (reference / "checkpoints").iterdir()) == sorted(
        ["best", "latest", *[f"step_{s:08d}" for s in range(EVERY, STEPS + 1, EVERY)][-2:]])


# ----------------------------------------------------------------------------- non-finite losses


def test_nan_loss_stops_naming_the_step_and_keeps_the_last_good_checkpoint(env):
    run_dir = env["root"] / "nan-stop"
    result = env["server"].run(NAN_TRAIN, ["25", *env["common"], f"hydra.run.dir={run_dir}",
                                           "train.max_steps=40"])
    assert result.returncode != 0
    line = one_error_line(result)
    assert "non-finite loss at step 25" in line and "step 20" in line, line
    assert assert_loads(run_dir) == 20
    assert not (run_dir / "checkpoints" / "step_00000030").exists()


def test_nan_loss_is_skipped_and_counted_when_configured(env):
    run_dir = env["root"] / "nan-skip"
    result = ok(env["server"].run(NAN_TRAIN, ["25", *env["common"], f"hydra.run.dir={run_dir}",
                                              "train.max_steps=40", "train.on_nonfinite=skip"]))
    assert "step 25: non-finite loss, step skipped" in result.stdout + result.stderr
    assert assert_loads(run_dir) == 40
    ev = scalars(run_dir)
    assert ev["train/skipped_steps"] == [(26, 1.0)]
    assert [s for s, _ in ev["train/loss"]] == [10, 20, 30, 40]
    assert all(v == v for _, v in ev["train/loss"])  # finite: the NaN never entered a mean
    assert load_state(latest_checkpoint(run_dir))["skipped"] == 1
