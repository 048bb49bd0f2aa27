"""A `-m` sweep: its arms, the name of each arm's directory, and its runs handed to Hydra's
launcher.

`python train.py -m optim.lr=3e-3,2e-3 seed=1,2` trains one run per combination (an "arm"), as
Hydra's basic sweeper splits them (the config's `hydra.sweeper.params`, then the command line).
guard/launch.py composes and checks every arm before the first one trains. An arm's directory is
`hydra.sweep.dir/<hydra.sweep.subdir>`, by default its run_name; when the configured names do not
tell the arms apart, each name also gets the swept values that differ among the arms sharing it
(`correct_seed1337_lr0.003`; `-` joins a key to a value that starts with a letter).

Then the launcher the config names (`hydra/launcher=`: basic here, one run after the other;
joblib, ray, submitit elsewhere: docs/cluster.md) runs `ArmTask` for each arm, in the directory
given by name: the run trained as `python train.py` trains it alone, or continued from its
checkpoint (a retried task, `resume=<sweep>`). How each run ended is read from its directory,
never from a launcher's exceptions. Signals reach the runs wherever they are through the sweep's
`.stop` file: the command writes each Ctrl-C or SIGTERM it gets there, a task not yet started
returns, and a task training sends the signal to itself within a second (the first: finish the
step, save, stop; a second Ctrl-C: stop at once). A task leaves the terminal's process group, so
that a Ctrl-C reaches it once.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import shutil
import signal
import sys
import threading
import time
import traceback
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from filelock import FileLock, Timeout
from hydra._internal.callbacks import Callbacks
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.plugins import Plugins
from hydra.types import HydraContext
from omegaconf import DictConfig

from guard.compose import composing
from guard.preflight import Job, check_run, finished, resumed, started_training
from safeio.cli import MISTAKES, Terminated, UserError, one_line, python_command
from safeio.run_lock import LOCK, lock_run, unlock_run
from training.checkpoint import holds_checkpoints, latest_checkpoint
from training.config import CONF_DIR

MAX_NAME = 200  # a directory name's characters (file systems allow 255 bytes)
STOP = ".stop"  # in the sweep's directory: the signals the command was sent, one name a line
WAIT_S = 120    # after a launcher's failure: how long the runs still training have to stop


def expand(overrides: list[str], config_loader) -> tuple[list[list[str]], list[str]]:
    """(each arm's overrides, the keys swept) of a sweep's overrides, in Hydra's order. The config
    loader lists a group's options for `glob(*)`."""
    parsed = OverridesParser.create(config_loader=config_loader).parse_overrides(overrides)
    for o in parsed:
        if o.is_sweep_override() and not o.is_discrete_sweep():
            raise UserError(f"{o.input_line}: a sweep over an interval cannot be listed; give the "
                            f"values (key=a,b,c) or range(start,stop,step)")
    swept = [o.get_key_element() for o in parsed if o.is_sweep_override()]
    return BasicSweeper.split_arguments(parsed, None)[0], list(dict.fromkeys(swept))


def _short(key: str) -> str:
    return key.lstrip("+~").split("@", 1)[0].rsplit(".", 1)[-1].rsplit("/", 1)[-1]


def _piece(key: str, value: str) -> str:
    value = re.sub(r"[^A-Za-z0-9._-]", "-", value) or "-"
    return f"{key}{value}" if value[0] in "0123456789.-" else f"{key}-{value}"


def arm_names(arms: list[list[str]], configured: list[str], swept: list[str]) -> list[str]:
    """The directory name of each arm: its configured subdir, and when two arms share one, also
    the swept values that differ among the arms sharing a name (the same keys for every arm)."""
    groups = defaultdict(list)
    for i, name in enumerate(configured):
        groups[name].append(i)
    values = [dict((o.split("=", 1) + [""])[:2] for o in arm) for arm in arms]  # (~key: "")
    keys = [k for k in swept if any(len({values[i].get(k) for i in group}) > 1
                                    for group in groups.values() if len(group) > 1)]
    if not keys:
        return configured
    shorts = [_short(k) for k in keys]
    labels = [s if shorts.count(s) == 1 else k.lstrip("+~") for s, k in zip(shorts, keys)]
    return ["_".join([name] + [_piece(label, values[i][k]) for label, k in zip(labels, keys)])
            for i, name in enumerate(configured)]


# ----------------------------------------------------------------------------- launching


@dataclass
class Sweep:
    """A sweep, every arm checked: what Hydra's launcher is handed."""

    master: DictConfig           # the sweep's config (its hydra.sweep.dir: root)
    root: Path                   # the sweep's directory, created
    jobs: list[Job]              # the runs to train, with their directories
    overrides: list[list[str]]   # each one's overrides, its directory's name among them


def launch_sweep(sweep: Sweep, train: Callable[[Job], Optional[dict]]) -> int:
    """Train the sweep's runs with the launcher its config names, then say which did not finish
    and how to continue. The exit status: 0, 1 or 2 after failures, 128 + N after the signal N."""
    if not sweep.jobs:
        print(f"every run of the sweep {sweep.root} has finished: nothing to train",
              file=sys.stderr)
        return 0
    stop, signals, returns, failure = sweep.root / STOP, [], [], ""
    stop.unlink(missing_ok=True)  # (a sweep stopped before, continued)
    here = sweep.master.hydra.runtime.choices.get("hydra/launcher") == "basic"
    # a worker elsewhere (submitit's, a SLURM node's) imports train.py and its packages
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(CONF_DIR.parent), os.environ.get("PYTHONPATH")) if p)
    with composing(), contextlib.ExitStack() as stack:
        context = HydraContext(GlobalHydra.instance().config_loader(), Callbacks(sweep.master))
        try:
            launcher = Plugins.instance().instantiate_launcher(
                hydra_context=context, task_function=ArmTask(train, sweep.root, here),
                config=sweep.master)
        except ImportError as exc:
            raise UserError(f"hydra/launcher cannot start: {one_line(exc)} (pip install -r "
                            f"requirements-cluster.txt)") from exc
        for signum in () if here else (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            stack.callback(signal.signal, signum, signal.signal(signum, functools.partial(
                _on_signal, stop, signals)))
        try:
            returns = launcher.launch(sweep.overrides, initial_job_idx=0)
        except SystemExit as exc:  # a run trained here, stopped by the signal N: 128 + N
            signals.append(exc.code - 128 if isinstance(exc.code, int) and exc.code > 128 else 15)
        except (KeyboardInterrupt, Terminated) as exc:
            signals.append(getattr(exc, "signum", signal.SIGINT))
        except Exception as exc:  # the launcher's own failure: the runs still training stop
            failure = f"the launcher stopped: {one_line(exc)}\n"
            _ask_to_stop(stop, [signal.SIGTERM])
            deadline = time.monotonic() + WAIT_S
            while any(map(_in_use, sweep.jobs)) and time.monotonic() < deadline:
                time.sleep(1.0)
    stop.unlink(missing_ok=True)
    said = {r._return_value["run"]: r._return_value for r in returns or ()
            if isinstance(getattr(r, "_return_value", None), dict)}
    left, errors = [], []
    for job in sweep.jobs:
        run = job.checked.run_dir
        outcome = said.get(str(run), {})
        if finished(run):
            continue
        if "failed" in outcome:
            errors.append(outcome)
        else:
            latest = latest_checkpoint(run)
            left.append(f"\n  {run.relative_to(sweep.root)}: " + (
                f"stopped at step {int(latest.name[5:])}" if latest else "not started"))
    if left:
        failure += (f"{len(left)} of the sweep's {len(sweep.jobs)} runs did not finish:"
                    f"{''.join(left)}\ncontinue the sweep (its unfinished runs only) with:\n  "
                    f"{python_command()} train.py resume={sweep.root}\n")
    print(failure + "".join(f"error: {o['run']}: {o['failed']}\n" for o in errors) or
          f"the sweep's {len(sweep.jobs)} runs have finished: {sweep.root}\n", end="",
          file=sys.stderr)
    if signals:
        return 128 + signals[0]
    return (2 if all(o.get("mistake") for o in errors) else 1) if errors else int(bool(left))


def _on_signal(stop: Path, signals: list, signum: int, frame) -> None:
    """While the launcher runs: each Ctrl-C, SIGTERM or SIGHUP into the stop file (a third one
    stops waiting for the runs)."""
    signals.append(signal.SIGINT if signum == signal.SIGINT else signal.SIGTERM)
    if len(signals) > 2:
        raise KeyboardInterrupt
    _ask_to_stop(stop, signals)


def _ask_to_stop(stop: Path, signals: list) -> None:
    stop.with_name(f"{STOP}.tmp").write_text("".join(f"{signal.Signals(s).name}\n"
                                                     for s in signals))
    os.replace(stop.with_name(f"{STOP}.tmp"), stop)


def _asked(stop: Path) -> list[str]:
    """The signals in the stop file, by name."""
    try:
        return [n for n in stop.read_text().split() if n in ("SIGINT", "SIGTERM")]
    except OSError:
        return []


def _in_use(job: Job) -> bool:
    """Whether a task holds the run's lock (it is training)."""
    lock = FileLock(job.checked.run_dir / LOCK)
    if not lock.lock_file or not os.path.isfile(lock.lock_file):
        return False
    try:
        lock.acquire(timeout=0)
    except Timeout:
        return True
    lock.release()
    return False


@dataclass
class ArmTask:
    """What Hydra's launcher runs for each arm, wherever it runs, once Hydra's run_job has made
    the arm's directory, its logging and its .hydra record: the run trained, or continued from
    its checkpoint (a task started again). For the run's sake it never raises (but for a signal
    to this command, here): what it returns says how the run ended, its directory the rest."""

    train: Callable[[Job], Optional[dict]]
    root: Path   # the sweep's directory
    here: bool   # in this command's process (the basic launcher), else in a worker

    def __call__(self, cfg: DictConfig) -> dict:
        run = Path(HydraConfig.get().runtime.output_dir)
        outcome, started = {"run": str(run)}, time.perf_counter()
        if _asked(self.root / STOP):  # the sweep was stopped before this run began
            _remove_unstarted(run)
            return outcome
        try:
            with contextlib.nullcontext() if self.here else _in_worker(self.root / STOP):
                if not holds_checkpoints(run):  # a start killed before its first checkpoint
                    for events in run.glob("events.out.tfevents.*"):
                        events.unlink()
                checked = resumed(cfg, run) if holds_checkpoints(run) else check_run(cfg, [], run)
                lock_run(run)
                metrics = self.train(Job(checked, cfg, None, single=False)) or {}
        except (SystemExit, KeyboardInterrupt, Terminated):
            if self.here:
                raise  # this command's own run: the sweep stops with it
            return outcome
        except MISTAKES as exc:
            return outcome | {"failed": one_line(exc), "mistake": True}
        except Exception as exc:  # a bug: its traceback in the run's train.log
            logging.getLogger("train").error("".join(traceback.format_exception(exc)).rstrip())
            return outcome | {"failed": f"{type(exc).__name__}: {one_line(exc)} (the traceback "
                                        f"is in its train.log)"}
        finally:
            unlock_run(run)
            _remove_unstarted(run)
        if not self.here:  # its lines went to its train.log: one line for it here
            score = metrics.get("causal_val_loss")
            print(f"{run.relative_to(self.root)}: " + (f"causal val loss {score:.4f} " if score
                  is not None else "") + f"({time.perf_counter() - started:.0f} s)",
                  file=sys.__stderr__, flush=True)
        return outcome


def _remove_unstarted(run: Path) -> None:
    """A run that never started training leaves nothing behind."""
    if run.is_dir() and not started_training(run):
        shutil.rmtree(run, ignore_errors=True)


@contextlib.contextmanager
def _in_worker(stop: Path):
    """A task in a worker: in a process group of its own (the terminal's Ctrl-C reaches the
    command, which forwards it once), its run's console lines in its train.log only, and each
    signal written into the stop file sent to itself, as train.py's runs expect them."""
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    stderr, sys.stderr = sys.stderr, open(os.devnull, "w")  # (tqdm's bar)
    root = logging.getLogger()
    for handler in [h for h in root.handlers if type(h) is logging.StreamHandler]:
        root.removeHandler(handler)
    handlers = {signal.SIGINT: signal.signal(signal.SIGINT, signal.default_int_handler),
                signal.SIGTERM: signal.signal(signal.SIGTERM, _terminated)}
    done = threading.Event()

    def forward(sent: int = 0) -> None:
        while not done.wait(0.5):
            asked = _asked(stop)
            for name in asked[sent:]:
                os.kill(os.getpid(), signal.Signals[name])
            sent = max(sent, len(asked))

    thread = threading.Thread(target=forward, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        for signum, handler in handlers.items():  # the worker's own, between tasks
            signal.signal(signum, handler)
        sys.stderr.close()
        sys.stderr = stderr


def _terminated(signum, frame):
    raise Terminated(signum)
