"""A file that leaves things in places every process shares (issue 28): a file in /dev/shm (POSIX
shared memory), one in /tmp outside its temporary directory, a System V shared memory segment.

Each that it could create is removed again at once (a failed sandbox leaves nothing) and named in
the error raised at import. Otherwise `Layer` is a correct layer.

Test material for tests/test_sandbox.py; not part of the package.
"""
import ctypes
import os

from fused import CausalSelfAttention as Layer  # noqa: F401

worked = []
for path in ("/dev/shm/check-attention-escape", "/tmp/check-attention-escape"):
    try:
        with open(path, "x") as f:
            f.write("escaped")
        worked.append(f"created {path}")
        os.unlink(path)
    except OSError:
        pass
libc = ctypes.CDLL(None, use_errno=True)
segment = libc.shmget(0, 4096, 0o1000 | 0o600)  # IPC_PRIVATE, IPC_CREAT
if segment >= 0:
    worked.append("created a System V shared memory segment")
    libc.shmctl(segment, 0, None)  # IPC_RMID
if worked:
    raise RuntimeError("escaped: " + "; ".join(worked))
