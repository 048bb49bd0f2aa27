"""Reading files that may be broken or planted: a run directory or a cache someone handed over.

Such a file can be a FIFO (reading it blocks forever), a device (`/dev/zero` never ends), a sparse
file of terabytes, or a directory. Every file the project reads back is checked here first: it must
be a regular file no bigger than what its kind can legitimately be, and it is opened without
blocking, so that what is checked is what is read.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

KIB, MIB = 1 << 10, 1 << 20


class FileRefused(OSError):
    """A file is missing, not a regular file, or implausibly big; the message says which."""

    def __str__(self) -> str:  # OSError would print "[Errno None] ..." for some arguments
        return self.args[0] if self.args else "file refused"


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"))


def kind_of(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def check_regular(path: Path, what: str, limit: int) -> int:
    """The size of path, which must be a regular file (after symbolic links) of at most limit
    bytes."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise FileRefused(f"{what} {path} does not exist") from None
    except OSError as exc:
        raise FileRefused(f"cannot read {what} {path}: {exc.strerror}") from None
    return _check_stat(st, path, what, limit)


def _check_stat(st: os.stat_result, path: Path, what: str, limit: int) -> int:
    if not stat.S_ISREG(st.st_mode):
        raise FileRefused(f"{what} {path} is {kind_of(st.st_mode)}, not a regular file")
    if st.st_size > limit:
        raise FileRefused(f"{what} {path} is {st.st_size:,} bytes, more than a {what} can be "
                          f"({limit:,}); it is not one this project wrote")
    return st.st_size


def read_bytes(path: Path, what: str, limit: int) -> bytes:
    """The bytes of a regular file of at most limit bytes. Opened without blocking and checked
    through the open descriptor, so a FIFO swapped in after a check cannot hang the read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    except FileNotFoundError:
        raise FileRefused(f"{what} {path} does not exist") from None
    except IsADirectoryError:
        raise FileRefused(f"{what} {path} is a directory, not a regular file") from None
    except OSError as exc:
        raise FileRefused(f"cannot read {what} {path}: {exc.strerror}") from None
    try:
        _check_stat(os.fstat(fd), path, what, limit)
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, min(limit + 1 - size, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:  # grew while being read
            raise FileRefused(f"{what} {path} is more than {limit:,} bytes")
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_text(path: Path, what: str, limit: int) -> str:
    """read_bytes as UTF-8 text."""
    try:
        return read_bytes(path, what, limit).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FileRefused(f"{what} {path} is not UTF-8 text (byte {exc.start})") from None
