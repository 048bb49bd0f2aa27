"""One builder at a time in a cache that several processes share.

Runs started together (a parallel Hydra sweep, two terminals, a torchrun job's ranks) all find
the same empty cache. Whoever takes the lock fetches, extracts and tokenizes; the others wait,
then only read the finished entry. Entries are built under temporary names and renamed into
place, so a builder killed half-way leaves nothing that looks complete.

The lock is `filelock` on `<cache_dir>/.lock` (flock, released by the kernel when its holder
exits, however it exits). Taking it again inside the same process (the corpus extraction inside
the tokenizing) is allowed: the same FileLock object counts its holds.
"""
from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Iterator

from filelock import FileLock, Timeout

from safeio.cli import FileRefused
from safeio.run_lock import lock_file

_locks: dict[str, FileLock] = {}  # lock path -> its lock in this process


@contextlib.contextmanager
def cache_lock(cache_dir: Path, what: str) -> Iterator[None]:
    """Hold the cache's lock while building `what` (a phrase for the waiting message)."""
    path = Path(cache_dir) / ".lock"
    key = os.path.abspath(path)
    lock = _locks.get(key)
    if lock is None or not lock.is_locked:
        try:
            Path(cache_dir).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise FileRefused(f"cannot create the cache directory {cache_dir}: "
                              f"{exc.strerror}") from None
        lock = _locks[key] = lock_file(path, "the cache lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        print(f"waiting for another process building {what} in {cache_dir} ...", file=sys.stderr)
        lock.acquire()
    except OSError as exc:
        raise FileRefused(f"cannot lock the cache lock {path}: {exc.strerror or exc}") from None
    try:
        yield
    finally:
        lock.release()
