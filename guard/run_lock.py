"""One process at a time in a run directory.

Two `train.py resume=<run>` started together would both train the run: each save deletes the
other's temporary checkpoint, TensorBoard gets every point twice, and `best/` can end up with the
weights of one process and the info of the other. So a process takes the run's lock before it
writes anything into it, and holds it to its end; a second one is refused in one line naming the
holder.

The lock is `flock` on `<run>/.lock`, released by the kernel when its holder exits, however it
exits (a killed process leaves no lock held). The holder writes who it is into the file (pid, host,
command, since) and empties it when it is done, so the file is empty at rest: taking and giving
back the lock leaves the run as it was. The file itself is never removed (removing a lock file
lets a process that opened it just before lock a file nobody else can find).
"""
from __future__ import annotations

import atexit
import errno
import fcntl
import json
import os
import socket
import stat
import sys
import time
from pathlib import Path

from guard.cli import UserError
from guard.files import kind_of

LOCK = ".lock"
MAX_HOLDER_BYTES = 4096

_held: dict[str, int] = {}  # resolved run directory -> the descriptor holding its lock
_command = " ".join(["python", *(os.path.basename(a) if i == 0 else a
                                 for i, a in enumerate(sys.argv))])


class RunInUse(UserError):
    """Another process holds the run's lock."""


def remember_command(argv: list[str]) -> None:
    """The command line to show as the holder (before preflight rewrites sys.argv)."""
    global _command
    _command = " ".join(["python", os.path.basename(argv[0]), *argv[1:]]) if argv else _command


def lock_run(run_dir: Path, what: str = "train") -> None:
    """Take run_dir's lock for the rest of this process (again: nothing more), or RunInUse."""
    key = os.path.realpath(run_dir)
    if key in _held:
        return
    path = Path(key) / LOCK
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UserError(f"{path} is a symbolic link, not the run's lock file") from None
        raise UserError(f"cannot take the lock of {run_dir} ({path}): {exc.strerror}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise UserError(f"the run's lock {path} is {kind_of(mode)}, not a regular file")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunInUse(f"{run_dir} is in use by {_holder(fd)}; wait for it to finish, or "
                           f"stop it (a stopped run resumes from its last checkpoint)") from None
        except OSError as exc:  # a file system without locks
            raise UserError(f"cannot lock {path}: {exc.strerror}") from None
    except BaseException:
        os.close(fd)
        raise
    _held[key] = fd
    holder = {"pid": os.getpid(), "host": socket.gethostname(), "command": _command[:500],
              "since": time.strftime("%Y-%m-%d %H:%M:%S"), "what": what}
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder).encode(), 0)
    except OSError:
        pass  # the lock holds without the note


def unlock_run(run_dir: Path) -> None:
    """Give back run_dir's lock (if this process holds it), leaving its file empty."""
    fd = _held.pop(os.path.realpath(run_dir), None)
    if fd is None:
        return
    try:
        os.ftruncate(fd, 0)
    except OSError:
        pass
    os.close(fd)


def holds_lock(run_dir: Path) -> bool:
    return os.path.realpath(run_dir) in _held


def _holder(fd: int) -> str:
    """The holder's note, as one phrase."""
    try:
        note = json.loads(os.pread(fd, MAX_HOLDER_BYTES, 0).decode("utf-8"))
        return (f"another process (pid {int(note['pid'])} on {str(note['host'])[:100]}, since "
                f"{str(note['since'])[:40]}: {str(note['command'])[:300]})")
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError):
        return "another process (which has not said who it is yet)"


@atexit.register
def release_locks() -> None:
    """Give back every lock this process holds (at its end)."""
    for key in list(_held):
        unlock_run(Path(key))
