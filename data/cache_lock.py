"""One builder at a time in a cache that several processes share.

Runs started together (a parallel Hydra sweep, two terminals, the ranks of a torchrun job on a
shared file system) all find the same empty cache. Whoever takes the lock fetches, extracts and
tokenizes; the others wait for it, then find the finished entry and only read it. Entries are
built under temporary names and renamed into place, so a reader never sees half of one and a
builder killed half-way leaves nothing that looks complete.

The lock is `flock` on `<cache_dir>/.lock` (on NFS, Linux maps it to a POSIX lock), released by
the kernel when its holder exits, however it exits. Taking it again inside the same process (the
corpus extraction inside the tokenizing) is allowed.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import sys
from pathlib import Path
from typing import Iterator

from guard.cli import FileRefused
from guard.files import kind_of

_held: dict[str, int] = {}  # lock path -> nesting depth in this process


@contextlib.contextmanager
def cache_lock(cache_dir: Path, what: str) -> Iterator[None]:
    """Hold the cache's lock while building `what` (a phrase for the waiting message)."""
    path = Path(cache_dir) / ".lock"
    key = os.path.abspath(path)
    if key in _held:
        _held[key] += 1
        try:
            yield
        finally:
            _held[key] -= 1
        return
    try:
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise FileRefused(f"cannot create the cache directory {cache_dir}: {exc.strerror}") from None
    try:
        # no blocking on a FIFO planted under the name, no following a planted link
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o644)
    except OSError as exc:
        raise FileRefused(f"cannot open the cache lock {path}: {exc.strerror}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise FileRefused(f"the cache lock {path} is {kind_of(mode)}, not a regular file")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another process building {what} in {cache_dir} ...",
                  file=sys.stderr)
            fcntl.flock(fd, fcntl.LOCK_EX)
        _held[key] = 1
        try:
            yield
        finally:
            del _held[key]
    finally:
        os.close(fd)  # releases the lock
