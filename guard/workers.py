"""A `-m` sweep's runs trained by several worker processes at once (hydra/launcher=processes).

A pitfall study trains dozens of tiny models. One training step of one of them is a handful of
small matrix products that a single core computes near its peak (docs/ablations.md measures
it), so a second thread inside a run buys little, and the basic launcher trains the runs one
after the other on one core while the others idle. Here `n_jobs` workers (by default one per
core) each take the next run as soon as they are free. Each run is trained exactly as
`python train.py` trains it, by the same function on one thread in a process of its own: its
numbers are the same to the bit, and its directory holds what it always held.

The parent has composed and checked every arm before any starts (guard/preflight.py). It hands
the workers one run at a time, prints a line as each run ends, and after a failure or a signal
hands out no more. A worker makes its run's directory, log and record at its turn, as a serial
sweep does (`Launch._begin`); the console lines of each run go to its train.log only (the
parent's line stands for it), and a run that fails before it trained leaves no directory.
Failures are reported, one `error:` line per run, never hidden: a mistake (the run's own one
line), a bug (its traceback is in the run's train.log) or a worker that died (its signal).

Signals: the workers are process groups of their own, so that a signal reaches each of them
once, from the parent: Ctrl-C (SIGINT) as SIGINT, a second Ctrl-C again (each run then stops at
once, keeping its last complete checkpoint, as `python train.py` does), SIGTERM and SIGHUP as
SIGTERM (finish the step, save, stop). The runs that did not finish, stopped or never started,
are what `python train.py resume=<sweep directory>` trains; the parent prints that command.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
import time
import traceback
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import wait
from pathlib import Path
from typing import Callable, Optional

from safeio.cli import MISTAKES, Terminated, UserError, one_line
from safeio.run_lock import unlock_run

FINISHED, STOPPED, FAILED = "finished", "stopped", "failed"


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity, where the system has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def worker_count(n_jobs: Optional[int], runs: int) -> int:
    """hydra.launcher.n_jobs as a number of workers: null is one per usable core; never more
    workers than runs."""
    if n_jobs is not None and (isinstance(n_jobs, bool) or not isinstance(n_jobs, int)
                               or n_jobs < 1):
        raise UserError(f"hydra.launcher.n_jobs must be a positive number of worker processes, "
                        f"or null for one per CPU core; got {n_jobs!r}")
    return max(1, min(n_jobs or usable_cores(), runs))


def oversubscription(workers: int, threads: list[Optional[int]]) -> Optional[str]:
    """A warning when the workers' threads together would outnumber the cores (train.threads of
    each run; null is torch's default, every core), else None."""
    cores = usable_cores()
    most = max((t or cores for t in threads), default=1)
    if workers > 1 and workers * most > cores:
        return (f"warning: {workers} workers x {most} threads each on {cores} cores: they will "
                f"slow each other down; set train.threads={max(cores // workers, 1)} (or lower "
                f"hydra.launcher.n_jobs)")
    return None


@dataclass
class Outcome:
    """How one run ended, as a worker reports it."""

    status: str                      # FINISHED, STOPPED or FAILED
    message: str = ""                # for FAILED: what went wrong, in one line
    seconds: float = 0.0
    score: Optional[float] = None    # the causal validation loss of a finished run
    mistake: bool = True             # a FAILED run: the user's mistake (else a bug, a crash)


def train_in_workers(jobs: list, train: Callable, n_jobs: int, sweep_dir: Path,
                     launch: Callable) -> int:
    """Train `jobs` with `n_jobs` worker processes; returns the exit status (0, 2 after a
    mistake, 1 after a bug or a dead worker, 128 + N after the signal N). `launch()` makes a
    guard.preflight.Launch in the worker, whose `_begin(job)` readies a run there (its
    directory, lock, log, record) and whose `undo()` takes back what a failed run made."""
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: no inherited state
    todo = deque(enumerate(jobs))
    workers = [_Worker(context, train, launch) for _ in range(n_jobs)]
    outcomes: dict[int, Outcome] = {}
    signals: list[int] = []
    width = len(str(len(jobs)))

    def on_signal(signum, frame):
        signals.append(signum)
        for w in workers:  # each worker hears it once: from here
            w.signal(signal.SIGINT if signum == signal.SIGINT else signal.SIGTERM)

    handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {s: signal.signal(s, on_signal) for s in handled}
    try:
        for w in workers:
            w.give(todo.popleft() if todo else None)
        while any(w.busy for w in workers):
            ready = wait([w.ready_on for w in workers if w.busy], timeout=1.0)
            for w in workers:
                if not w.busy or w.ready_on not in ready and w.process.is_alive():
                    continue
                index, outcome = w.collect()
                outcomes[index] = outcome
                name = _name(jobs[index], sweep_dir)
                print(f"[{len(outcomes):>{width}}/{len(jobs)}] {name}: {_said(outcome)}",
                      file=sys.stderr, flush=True)
                stop = signals or any(o.status != FINISHED for o in outcomes.values())
                w.give(todo.popleft() if todo and not stop and w.alive else None)
    finally:
        for w in workers:
            w.close()
        for s, handler in previous.items():
            signal.signal(s, handler)
    return _report(jobs, outcomes, signals)


def _name(job, sweep_dir: Path) -> str:
    run = job.settled.run_dir
    return str(run.relative_to(sweep_dir)) if sweep_dir in run.parents else str(run)


def _said(outcome: Outcome) -> str:
    took = f"({outcome.seconds:.0f} s)"
    if outcome.status == FINISHED:
        score = "" if outcome.score is None else f"causal val loss {outcome.score:.4f} "
        return f"{score}{took}"
    return f"{outcome.status} {took}"


def _report(jobs: list, outcomes: dict, signals: list) -> int:
    """The failures, one `error:` line each; the exit status (Launch.run then says how to
    continue a sweep that did not finish)."""
    failed = [(i, o) for i, o in outcomes.items() if o.status == FAILED]
    for i, outcome in failed:
        print(f"error: {jobs[i].settled.run_dir}: {outcome.message}", file=sys.stderr)
    if signals:
        return 128 + signals[0]
    if failed:
        return 2 if all(o.mistake for _, o in failed) else 1
    return 0


class _Worker:
    """One worker process, and the run it is training (the parent's side)."""

    def __init__(self, context, train: Callable, launch: Callable):
        self.conn, theirs = context.Pipe()
        self.process = context.Process(target=_serve, args=(theirs, train, launch),
                                       name="sweep-worker")
        self.process.start()
        theirs.close()
        _own_group(self.process.pid)
        self.index: Optional[int] = None
        self.started = 0.0
        self.alive = True

    @property
    def busy(self) -> bool:
        return self.index is not None

    @property
    def ready_on(self):
        """What `wait` watches: the connection (an outcome) or, when it died, the process."""
        return self.conn if self.process.is_alive() else self.process.sentinel

    def give(self, item) -> None:
        """Send the worker its next run (index, job), or None: no more."""
        try:
            self.conn.send(None if item is None else item[1])
        except (BrokenPipeError, OSError):
            self.alive = False
            return
        if item is not None:
            self.index, self.started = item[0], time.perf_counter()

    def collect(self) -> tuple[int, Outcome]:
        """The outcome of the run in hand: the worker's report, or, if it died without one,
        a failure naming how it ended."""
        index, self.index = self.index, None
        try:
            if self.conn.poll():
                return index, self.conn.recv()
        except (EOFError, OSError):
            pass
        self.alive = False
        self.process.join(timeout=10)
        code = self.process.exitcode
        how = (f"killed by {signal.Signals(-code).name}" if code is not None and code < 0
               else f"exit status {code}")
        return index, Outcome(FAILED, f"the worker training it died ({how}; out of memory?); "
                                      f"its last checkpoint, if any, is kept",
                              time.perf_counter() - self.started, mistake=False)

    def signal(self, signum: int) -> None:
        if self.process.is_alive():
            try:
                os.kill(self.process.pid, signum)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        try:
            self.conn.send(None)
        except (BrokenPipeError, OSError):
            pass
        self.process.join()
        self.conn.close()


def _own_group(pid: int) -> None:
    """Make pid a process group of its own (also done by the worker itself: whichever comes
    first), so that the terminal's Ctrl-C reaches it only through the parent."""
    try:
        os.setpgid(pid, pid)
    except (OSError, AttributeError):  # it did so already, or has exited; not POSIX
        pass


# ----------------------------------------------------------------------------- the worker


def _serve(conn, train: Callable, launch: Callable) -> None:
    """A worker: train the runs the parent sends, one at a time, until it sends None or goes
    away; report each run's outcome. A run that did not finish ends the worker."""
    _own_group(0)
    # The runs' console lines (and their progress) go nowhere: each run's train.log has them,
    # and the parent prints one line per run. (A crash of the interpreter still reaches fd 2.)
    sys.stderr = open(os.devnull, "w")
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for signum in (signal.SIGTERM, signal.SIGHUP):  # between runs: stop (a run saves first)
        signal.signal(signum, _raise_terminated)
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError, KeyboardInterrupt, Terminated):
            return
        if job is None:
            return
        outcome = _train_one(job, train, launch())
        try:
            conn.send(outcome)
        except (BrokenPipeError, OSError):
            return
        if outcome.status != FINISHED:
            return


def _raise_terminated(signum, frame):
    raise Terminated(signum)


def _train_one(job, train: Callable, launch) -> Outcome:
    started = time.perf_counter()
    outcome = Outcome(FAILED)
    try:
        launch._begin(job)
        metrics = train(job) or {}
        outcome = Outcome(FINISHED, score=metrics.get("causal_val_loss"))
    except SystemExit as exc:  # train.py's way out after a signal: 128 + N
        code = exc.code if isinstance(exc.code, int) else 1
        outcome = Outcome(STOPPED) if code >= 128 else Outcome(FAILED, f"exit status {code}")
    except (KeyboardInterrupt, Terminated):
        outcome = Outcome(STOPPED)
    except MISTAKES as exc:
        outcome = Outcome(FAILED, one_line(exc))
    except Exception as exc:  # a bug: its traceback in the run's train.log
        logging.getLogger("train").error("".join(traceback.format_exception(exc)).rstrip())
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            traceback.print_exc(file=sys.__stderr__)
        outcome = Outcome(FAILED, f"{type(exc).__name__}: {one_line(exc)} (the traceback is "
                                  f"in its train.log)", mistake=False)
    finally:
        if outcome.status != FINISHED:
            launch.undo()  # a run that failed before it trained leaves nothing
        unlock_run(job.settled.run_dir)
    outcome.seconds = time.perf_counter() - started
    return outcome

