"""Keep the memory a CPU training step frees, so that the next step reuses it.

PyTorch has no caching allocator on the CPU: every activation, gradient and logit block of a step
is a fresh malloc, and each is freed by the step's end. glibc hands large blocks back to the
system (blocks above its mmap threshold, up to 32 MiB, and the free top of the heap above its
trim threshold), so the next step asks for them again and every 4 KiB page is faulted in and
zeroed anew: at the default model that is about 15,000 page faults a step. Two mallopt settings
make glibc keep such memory: blocks under 64 MiB come from the heap, and up to 1 GiB of free heap
is kept. The process's memory stays at its peak, as with a GPU's caching allocator.
docs/benchmarks.md has what it saves.

Only glibc (Linux) has these settings; elsewhere, and where the user has set glibc's own
variables (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_), this does nothing.
"""
from __future__ import annotations

import ctypes
import os

# glibc's malloc.h
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 64 << 20  # bytes: smaller blocks come from the heap and return to it
TRIM_THRESHOLD = 1 << 30   # bytes of free heap top kept rather than handed back
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def keep_freed_memory() -> bool:
    """Make glibc keep freed memory for reuse (see the module docstring); True if it now does."""
    if any(name in os.environ for name in USER_SETTINGS):
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # glibc only: musl and macOS have no such mallopt settings
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and
                mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
