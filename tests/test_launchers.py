"""A sweep's runs trained by Hydra's launchers (guard/sweep.py): basic (in this process), joblib
(this machine, the studies'), ray (a local Ray cluster that the command starts and stops) and
submitit_local (SLURM's jobs as local processes).

The promises: each run trains as it would alone (the same weights and curves, to the bit) and
lands where the summary, TensorBoard and `resume=` find it; a study summarizes the same under
every launcher; Ctrl-C, a second Ctrl-C and SIGTERM stop every run after its step (or at once)
with its checkpoint; a worker killed mid-sweep ends the sweep with one line per run that did
not finish; and `resume=<sweep>` trains exactly those, to the weights they have trained alone.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from guard.preflight import SWEEP_RECORD, recorded_sweep
from helpers import SCRIPT_ENV, TRAIN, corpus_args, ok, one_error_line, run, scalars, write_corpus
from safeio.cli import UserError
from training.checkpoint import CHECKPOINTS, WEIGHTS, latest_checkpoint

STEPS = 300  # a run of the signal tests: long enough to be stopped midway
# Ray's session files, short (its sockets' paths must fit 107 bytes): no process names it after
RAY_TMP = tempfile.mkdtemp(prefix="ray-", dir="/tmp")


def test_resuming_a_sweep_replays_its_command_and_takes_only_the_launcher_s_overrides(tmp_path):
    record = {"overrides": ["+experiment=smoke", "seed=1,2", "hydra.sweep.dir=elsewhere"]}
    (tmp_path / SWEEP_RECORD).write_text(json.dumps(record))
    replayed = recorded_sweep(tmp_path, [f"resume={tmp_path}", "hydra/launcher=ray"])
    assert replayed == ["+experiment=smoke", "seed=1,2", f"hydra.sweep.dir='{tmp_path}'",
                        "hydra/launcher=ray"]
    with pytest.raises(UserError, match="train.max_steps=9"):
        recorded_sweep(tmp_path, [f"resume={tmp_path}", "train.max_steps=9"])


def test_a_launcher_whose_plugin_is_not_installed_is_one_error_line_naming_the_file(tmp_path):
    """The Ray plugin hidden (a package of that name that fails to import, first on the path):
    the sweep is refused in one line that names requirements-cluster.txt, before it writes."""
    hidden = tmp_path / "hidden" / "hydra_plugins" / "hydra_ray_launcher"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError('not installed')\n")
    result = subprocess.run([sys.executable, TRAIN, "-m", "+experiment=smoke", "seed=1,2",
                             "hydra/launcher=ray", f"hydra.sweep.dir={tmp_path / 's'}"],
                            cwd=tmp_path, env={**SCRIPT_ENV, "PYTHONPATH": str(hidden.parents[1])},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result
    assert one_error_line(result) == (
        "error: hydra/launcher=ray needs Hydra's ray launcher plugin, which is not installed: "
        "pip install -r requirements-cluster.txt (docs/cluster.md)")
    assert not (tmp_path / "s").exists()


# ----------------------------------------------------------------------------- real sweeps


def _launcher(name: str) -> list[str]:
    """The overrides that choose a launcher (Ray's cluster keeps its files in RAY_TMP)."""
    if name == "ray":
        pytest.importorskip("hydra_plugins.hydra_ray_launcher.ray_launcher")
        return ["hydra/launcher=ray", "+hydra.launcher.ray.init.include_dashboard=false",
                f"+hydra.launcher.ray.init._temp_dir={RAY_TMP}"]
    if name.startswith("submitit"):
        pytest.importorskip("hydra_plugins.hydra_submitit_launcher.submitit_launcher")
    return [f"hydra/launcher={name}"]


def _largest_difference(a: Path, b: Path) -> float:
    wa = load_file(latest_checkpoint(a) / WEIGHTS)
    wb = load_file(latest_checkpoint(b) / WEIGHTS)
    assert wa.keys() == wb.keys()
    return max((wa[k].double() - wb[k].double()).abs().max().item() for k in wa)


@pytest.fixture(scope="module")
def common(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("launchers")
    corpus = write_corpus(root, 40_000, 8_000)
    return ["+experiment=smoke", *corpus_args(corpus, root / "cache"), "train.threads=1",
            "train.eval_interval=20", "run_name=smoke_seed${seed}"]


@pytest.fixture(scope="module")
def alone(common, tmp_path_factory):
    """Each seed's run trained alone (python train.py), for `steps` steps: its directory."""
    root, runs = tmp_path_factory.mktemp("alone"), {}

    def trained(seed: int, steps: int = 40) -> Path:
        if (seed, steps) not in runs:
            runs[seed, steps] = root / f"seed{seed}_{steps}"
            ok(run([TRAIN, *common, f"seed={seed}", f"train.max_steps={steps}",
                    f"hydra.run.dir={runs[seed, steps]}"], root))
        return runs[seed, steps]
    return trained


def _no_process_left(*places: Path) -> None:
    """No process of this machine names one of places (a worker's sweep, Ray's session)."""
    def naming() -> list[str]:
        found = []
        for p in Path("/proc").glob("[0-9]*"):
            try:
                line = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            found += [line[:200]] if any(str(place) in line for place in places) else []
        return found
    deadline = time.monotonic() + 20
    while naming() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not naming()


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["basic", "joblib", "ray", "submitit_local"])
def test_each_launcher_trains_each_run_as_it_trains_alone(launcher, common, alone, tmp_path):
    """... its weights and its curves to the bit, with its train.log and .hydra record, and
    the sweep's record for resume=; Ray's local cluster is started and stopped by the command."""
    sweep = tmp_path / "sweep"
    ok(run([TRAIN, "-m", *common, "seed=1,2", "train.max_steps=40", *_launcher(launcher),
            f"hydra.sweep.dir={sweep}"], tmp_path, timeout=300))
    for seed in (1, 2):
        arm = sweep / f"smoke_seed{seed}"
        assert _largest_difference(arm, alone(seed)) == 0.0
        mine, own = scalars(arm), scalars(alone(seed))
        for tag in ("train/loss", "val/loss", "val/causal_loss", "weights/max_weight/layer0"):
            assert mine[tag] == own[tag], tag
        for name in ("config.yaml", "train.log", "tokenizer.json", ".hydra/overrides.yaml"):
            assert (arm / name).is_file(), name
        assert "step 40: train loss" in (arm / "train.log").read_text()
    assert (sweep / SWEEP_RECORD).is_file() and (sweep / "multirun.yaml").is_file()
    _no_process_left(tmp_path, RAY_TMP)


def _wait_for_a_finished_run(proc, sweep: Path, steps: int) -> str:
    """stderr until a run of the sweep has its last checkpoint (a worker's lines may lag)."""
    deadline, seen = time.monotonic() + 240, ""
    while time.monotonic() < deadline and proc.poll() is None:
        if any(p.name == f"step_{steps:08d}" for p in sweep.glob(f"*/{CHECKPOINTS}/step_*")):
            return seen
        time.sleep(0.2)
    pytest.fail(f"no run finished: {proc.communicate()[1][-2000:]}")


@pytest.mark.slow
@pytest.mark.parametrize("launcher, signals, code", [
    ("joblib", [signal.SIGINT], 130),
    ("joblib", [signal.SIGINT, signal.SIGINT], 130),
    ("joblib", [signal.SIGTERM], 143),
    ("basic", [signal.SIGINT], 130),
    ("ray", [signal.SIGINT], 130),
])
def test_a_stopped_sweep_names_its_unfinished_runs_and_resume_trains_only_those(
        launcher, signals, code, common, alone, tmp_path):
    """Four runs, two at a time: once one has finished, Ctrl-C (to the whole process group, as
    a terminal sends it), Ctrl-C twice, or SIGTERM (to the command alone). Every run stops with
    its last checkpoint, the command names each unfinished one and the command that continues,
    the finished ones are left alone, and the continued ones end as if never stopped."""
    sweep = tmp_path / "sweep"
    cmd = [sys.executable, TRAIN, "-m", *common, f"train.max_steps={STEPS}", "seed=1,2,3,4",
           *_launcher(launcher), f"hydra.sweep.dir={sweep}"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=SCRIPT_ENV, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    _wait_for_a_finished_run(proc, sweep, STEPS)
    for signum in signals:
        if signum == signal.SIGINT:
            os.killpg(proc.pid, signum)  # what Ctrl-C at a terminal does
        else:
            os.kill(proc.pid, signum)
        time.sleep(0.2)
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == code, err[-3000:]
    done = [r for r in sweep.glob("smoke_seed*") if latest_checkpoint(r).name.endswith(
        f"_{STEPS:08d}")]
    left = sorted({f"smoke_seed{s}" for s in range(1, 5)} - {r.name for r in done})
    assert done and left, err[-3000:]
    assert f"{len(left)} of the sweep's 4 runs did not finish:" in err, err[-3000:]
    for name in left:
        assert f"\n  {name}: " in err, err[-3000:]
    assert f"python train.py resume={sweep}" in err.replace(sys.executable, "python")
    before = {r: (latest_checkpoint(r) / WEIGHTS).stat().st_mtime_ns for r in done}

    result = ok(run([TRAIN, f"resume={sweep}", *_launcher("joblib")], tmp_path, timeout=300))
    assert f"the sweep's {len(left)} runs have finished" in result.stderr, result.stderr[-2000:]
    for r, mtime in before.items():  # the finished runs were not touched
        assert (latest_checkpoint(r) / WEIGHTS).stat().st_mtime_ns == mtime
    for name in left:
        assert _largest_difference(sweep / name, alone(int(name[-1]), STEPS)) == 0.0
    again = ok(run([TRAIN, f"resume={sweep}"], tmp_path))
    assert "nothing to train" in again.stderr
    _no_process_left(tmp_path, RAY_TMP)


@pytest.mark.slow
@pytest.mark.parametrize("launcher, retries", [("ray", 0), ("ray", None), ("submitit_local", 0)])
def test_a_worker_killed_mid_sweep(launcher, retries, common, alone, tmp_path):
    """kill -9 the process training a run. Ray retries its task by default (max_retries 3):
    the retry continues the run from its checkpoint, to the weights it has trained alone.
    Without retries (Ray's max_retries=0, or submitit), the sweep ends with a line for each
    run that did not finish, the others having saved and stopped; resume= trains those."""
    sweep = tmp_path / "sweep"
    extra = ["+hydra.launcher.ray.remote.max_retries=0"] if retries == 0 and launcher == "ray" \
        else []
    proc = subprocess.Popen([sys.executable, TRAIN, "-m", *common, f"train.max_steps={STEPS}",
                             "seed=1,2", *_launcher(launcher), *extra, f"hydra.sweep.dir={sweep}"],
                            cwd=tmp_path, env=SCRIPT_ENV, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    lock = sweep / "smoke_seed1" / ".lock"
    deadline = time.monotonic() + 240
    while not (lock.is_file() and lock.read_text() and latest_checkpoint(lock.parent)):
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()[1][-2000:]
        time.sleep(0.2)
    os.kill(json.loads(lock.read_text())["pid"], signal.SIGKILL)  # the worker training it
    err = proc.communicate(timeout=300)[1]
    if retries is None:
        assert proc.returncode == 0, err[-3000:]
    else:
        assert proc.returncode == 1, err[-3000:]
        assert "the launcher stopped: " in err and "\n  smoke_seed1: stopped at step " in err, \
            err[-3000:]
        ok(run([TRAIN, f"resume={sweep}", *_launcher("joblib")], tmp_path, timeout=300))
    for seed in (1, 2):
        assert _largest_difference(sweep / f"smoke_seed{seed}", alone(seed, STEPS)) == 0.0
    _no_process_left(tmp_path, RAY_TMP)


@pytest.mark.slow
def test_a_small_study_summarizes_the_same_under_every_launcher(common, tmp_path):
    """A few arms of the first study, two seeds, at a few steps: the summary's table under
    Ray's local cluster and submitit_local is the default launcher's (joblib), to the digit."""
    pytest.importorskip("hydra_plugins.hydra_ray_launcher.ray_launcher")
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher.submitit_launcher")
    study = ["-m", "+experiment=ablations", "+arm=leak-correct,leak-mask_zero,scale-correct,"
             "scale-no_scale", "seed=1,2", *common[1:-1], "train.max_steps=40"]
    tables = {}
    for launcher in ("joblib", "ray", "submitit_local"):
        sweep = tmp_path / launcher
        ok(run([TRAIN, *study, *_launcher(launcher), f"hydra.sweep.dir={sweep}"], tmp_path,
               timeout=300))
        out = ok(run(["-m", "scripts.summarize_ablations", f"sweep={sweep}",
                      f"out={tmp_path / ('summary_' + launcher)}"], Path(TRAIN).parent))
        tables[launcher] = out.stdout.split("\nwrote ")[0]
    assert "| leak | mask_zero | 2 |" in tables["joblib"], tables["joblib"]
    assert tables["ray"] == tables["joblib"] and tables["submitit_local"] == tables["joblib"]
    _no_process_left(tmp_path, RAY_TMP)
