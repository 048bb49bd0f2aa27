"""One process at a time in a run directory.

Two `train.py resume=<run>` started together would both train the run: each save deletes the other's
temporary checkpoint, TensorBoard gets every point twice, and `best/` can end up with the weights of
one process and the info of the other. So a process takes the run's lock before it writes anything
into it, and holds it to its end; a second one is refused in one line naming the holder.

The lock is `filelock` on `<run>/.lock` (flock: released by the kernel when its holder exits,
however it exits). The holder writes who it is into the file (pid, host, command, since) and
empties it when it is done, so the file is empty at rest. The file is never removed (a process
that opened it just before could lock a file nobody else can find).
"""
from __future__ import annotations

import atexit
import json
import os
import socket
import stat
import sys
import time
from pathlib import Path

from filelock import FileLock, Timeout

from safeio.cli import FileRefused, UserError
from safeio.files import kind_of

LOCK = ".lock"
MAX_HOLDER_BYTES = 4096

_held: dict[str, FileLock] = {}  # resolved run directory -> its lock, held
_command = " ".join(["python", *(os.path.basename(a) if i == 0 else a
                                 for i, a in enumerate(sys.argv))])


class RunInUse(UserError):
    """Another process holds the run's lock."""


def remember_command(argv: list[str]) -> None:
    """The command line to show as the holder (before preflight rewrites sys.argv)."""
    global _command
    _command = " ".join(["python", os.path.basename(argv[0]), *argv[1:]]) if argv else _command


def lock_file(path: Path, what: str) -> FileLock:
    """A FileLock on path, which must be a regular file or not exist yet: the holder writes into
    it, and a planted link would send that elsewhere, a planted FIFO or device would hang it. A
    file system without flock is refused, not emulated (filelock's fallback keeps its own marker
    in the file)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        mode = stat.S_IFREG
    except OSError as exc:
        raise FileRefused(f"cannot open {what} {path}: {exc.strerror}") from None
    if stat.S_ISLNK(mode):
        raise FileRefused(f"{what} {path} is a symbolic link, not a lock file")
    if not stat.S_ISREG(mode):
        raise FileRefused(f"{what} {path} is {kind_of(mode)}, not a regular file")
    return FileLock(path, fallback_to_soft=False)


def lock_run(run_dir: Path) -> None:
    """Take run_dir's lock for the rest of this process (again: nothing more), or RunInUse."""
    key = os.path.realpath(run_dir)
    if key in _held:
        return
    path = Path(key) / LOCK
    lock = lock_file(path, "the run's lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        raise RunInUse(f"{run_dir} is in use by {_holder(path)}; wait for it to finish, or "
                       f"stop it (a stopped run resumes from its last checkpoint)") from None
    except OSError as exc:  # a read-only directory, a file system without locks
        raise UserError(f"cannot lock {path}: {exc.strerror or exc}") from None
    _held[key] = lock
    _write(path, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                             "command": _command[:500],
                             "since": time.strftime("%Y-%m-%d %H:%M:%S")}).encode())


def unlock_run(run_dir: Path) -> None:
    """Give back run_dir's lock (if this process holds it), leaving its file empty."""
    key = os.path.realpath(run_dir)
    lock = _held.pop(key, None)
    if lock is not None:
        _write(Path(key) / LOCK, b"")
        lock.release()


def _write(path: Path, note: bytes) -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            os.ftruncate(fd, 0)
            os.write(fd, note)
        finally:
            os.close(fd)
    except OSError:
        pass  # the lock holds without the note


def _holder(path: Path, patience: float = 2.0) -> str:
    """The holder's note, as one phrase. A holder writes its note just after it takes the lock,
    so a note not there yet is waited for a moment (two processes started together meet here)."""
    deadline = time.monotonic() + patience
    while True:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            try:
                note = json.loads(os.read(fd, MAX_HOLDER_BYTES).decode("utf-8"))
            finally:
                os.close(fd)
            return (f"another process (pid {int(note['pid'])} on {str(note['host'])[:100]}, "
                    f"since {str(note['since'])[:40]}: {str(note['command'])[:300]})")
        except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError):
            if time.monotonic() >= deadline:
                return "another process (which has not said who it is yet)"
            time.sleep(0.05)


@atexit.register
def release_locks() -> None:
    """Give back every lock this process holds (at its end)."""
    for key in list(_held):
        unlock_run(Path(key))
